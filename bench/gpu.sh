#!/usr/bin/env bash
# The GPU check, in under 8 minutes on one GPU: the no-synchronisation tests of the batch loop, then
# bench/gpu_round.py (samples/s per setting and one full-scale CIFAR-10 / ResNet-10 round, K=10, E=10).
# Extra arguments go to gpu_round.py (e.g. --data-dir /data or --epochs 1).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'bench/gpu.sh: no CUDA device')"
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_performance.py -k gpu_batch_loop
timeout 380 python bench/gpu_round.py --budget 340 "$@"
