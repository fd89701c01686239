"""What answers before torch loads: every option declaration is read without importing torch, so ``fedhpro config
--keys``, ``fedhpro config``, every ``--help`` and every refused key or value answer in a fraction of torch's import
time (``bench/startup.py`` measures how long). Each check runs a fresh interpreter: this process has torch loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

#: the probe run in a fresh interpreter: ``fedhpro.cli.main`` with ``argv``, then the torch-like modules loaded
PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from fedhpro.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(sys.argv[1:])
        except SystemExit as stop:
            code = stop.code
    heavy = sorted(name for name in ("torch", "torchvision", "flwr", "ray", "optuna", "matplotlib")
                   if name in sys.modules)
    print(json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "heavy": heavy}))
""")


def probe(*argv: str) -> dict:
    """``fedhpro ARGV`` in a fresh interpreter: its exit code, output and the heavy modules it loaded."""
    import json

    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv, code, said", [
    (["config", "--keys"], 0, "fedhpro.tau"),
    (["config"], 0, "method: fedhpro"),
    (["config", "method=fedavg", "dataset=clients"], 0, "method: fedavg"),
    (["config", "--keys", "dataset=imagefolder"], 0, "data.image_size"),
    (["run", "roundz=3"], 2, "unknown config key 'roundz' (did you mean 'rounds'?)"),
    (["run", "rounds=0"], 2, "rounds"),
    (["run", "method=fedavgg"], 2, "did you mean 'fedavg'"),
    (["run", "dataset=digitz"], 2, "dataset='digitz' is not valid"),
    (["run", "model=resnet"], 2, "model="),
    (["run", "aggregation=krum", "aggregation.byzantine=-1"], 2, "aggregation.byzantine"),
    (["run", "faults.scale=0.7", "faults.sign_flip=0.5"], 2, "exceeds 1"),
    (["run", "privacy=client", "aggregation=median"], 2, "privacy=client cannot go with aggregation=median"),
    (["run", "fedhpro.tau=-1"], 2, "fedhpro.tau"),
    (["run", "partition=dirichlet", "partition.alpha=0"], 2, "partition.alpha"),
    (["run", "dataset=clients", "data.standardize=bogus"], 2, "data.standardize"),
    (["compare", "jobs=0"], 2, "jobs=0 is not valid"),
    (["compare", "seeds=[a]"], 2, "seeds=['a'] must be integers"),
    (["tune", "trials=0"], 2, "trials=0 gives no trial"),
    (["tune", "pruner=hyperband"], 2, "pruner"),
    (["report", "some/folder", "per_class=maybe"], 2, "per_class='maybe' is not a boolean"),
    (["reproduce", "table1", "scale=huge"], 2, "scale='huge' is not valid; choose one of: paper, smoke"),
    (["run", "--help"], 0, "usage: fedhpro run"),
    (["--help"], 0, "usage: fedhpro"),
])
def test_declarations_answer_without_loading_torch(argv, code, said):
    answer = probe(*argv)
    assert answer["heavy"] == [], f"fedhpro {' '.join(argv)} loaded {answer['heavy']}"
    assert answer["code"] == code, answer
    text = answer["stdout"] + answer["stderr"]
    assert said in text, text
    if code == 2 and "--help" not in argv:
        assert len(answer["stderr"].strip().splitlines()) == 1, answer["stderr"]  # one line, no traceback


def test_every_registry_lists_and_declares_without_loading_torch():
    code = textwrap.dedent("""
        import sys
        import fedhpro.data, fedhpro.methods, fedhpro.models, fedhpro.robust
        from fedhpro.data.partition import REGISTRY as partitions
        from fedhpro.config import load_config
        for registry in (fedhpro.data.REGISTRY, fedhpro.methods.REGISTRY, fedhpro.models.REGISTRY,
                         fedhpro.robust.REGISTRY, partitions):
            assert registry.names(), registry
            registry.declarations()
        for name in fedhpro.data.REGISTRY.names():
            load_config(None, {"dataset": name})
        for name in fedhpro.methods.REGISTRY.names():
            load_config(None, {"method": name})
        heavy = [name for name in ("torch", "torchvision", "flwr") if name in sys.modules]
        assert heavy == [], heavy
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_run_still_loads_the_declared_code_it_needs():
    """The other side: the declarations are the code's own (no second copy that could drift)."""
    import dataclasses

    import fedhpro.data
    import fedhpro.methods
    import fedhpro.models
    from fedhpro.config import load_config

    for name in fedhpro.methods.REGISTRY.names():
        assert fedhpro.methods.REGISTRY.lookup(name).options is fedhpro.methods.REGISTRY.declared(name).options
    config = load_config(None, {"method": "fedavg", "model": "cnn"})
    assert dataclasses.is_dataclass(config.methods["fedavg"])
    model = fedhpro.models.build_model("cnn", 10, (1, 28, 28), feature_dim=16)
    assert model.classifier.out_features == 10
