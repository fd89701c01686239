"""``fedhpro run``'s start-up note that this CPU has native bfloat16 is said only where ``amp=bf16`` was measured
to help: models with a convolution. A tabular MLP on the same CPU gets no note (it used to get it on every run).
The CPU is faked (``fedhpro.runtime.cpu_features`` monkeypatched), so the test holds on any machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from torch import nn

from fedhpro import cli, runtime
from fedhpro.runtime import CpuFeatures

#: a Sapphire Rapids Xeon: AMX and AVX512-BF16, bfloat16 native
AMX = CpuFeatures("Intel(R) Xeon(R) Platinum 8480+", avx2=True, avx512=True, avx512_bf16=True, amx=True,
                  capability="AVX512")
CPU = torch.device("cpu")


@pytest.fixture
def native_bf16_cpu(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_features", lambda: AMX)


def tiny_run(data_dir: Path, out: Path, *extra: str) -> list[str]:
    """``fedhpro run`` arguments of a one-round run on 3 clients of ~40 digits."""
    return ["run", "method=fedavg", "rounds=1", "clients=3", "data.fraction=0.02", f"data.syn_size={DIGITS_SYN_SIZE}",
            f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16", "local_epochs=1", "progress=false",
            "threads=1", "device=cpu", f"data_dir={data_dir}", f"out={out}", *extra]


def test_the_note_is_decided_by_the_models_layers(native_bf16_cpu):
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(3))
    assert runtime.bf16_note("off", CPU, [mlp]) is None
    assert runtime.bf16_note("off", CPU, [mlp, cnn]) == runtime.bf16_note("off", CPU)  # one convolutional is enough
    assert "amp=bf16 trains convolutional models" in runtime.bf16_note("off", CPU, [cnn])
    assert runtime.bf16_note("bf16", CPU, [cnn]) is None  # already on
    assert runtime.bf16_note("off", torch.device("cuda"), [cnn]) is None  # a CPU's note only


def test_an_mlp_run_gets_no_note_a_cnn_run_does(native_bf16_cpu, digits_data_dir, tmp_path, capsys):
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "mlp", "model=mlp")) == 0
    assert "bfloat16" not in capsys.readouterr().out
    assert cli.main(tiny_run(digits_data_dir, tmp_path / "cnn", "model=cnn")) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "bfloat16" in line]
    assert notes == [f"note: {runtime.bf16_note('off', CPU)}"]
