"""Result identity across a refactor: 20 tiny runs and the default run, hashed, and a comparison of two manifests.

``run OUT_DIR`` runs 20 tiny configurations (every method on the in-process simulator, a few variants, and
six configs on Flower's simulation engine in one ``run_simulation``) on the offline digits data set, then
the default ``fedhpro run`` (no settings but ``out``: 2-5 minutes; ``--only`` leaves it out unless named), and
writes ``OUT_DIR/manifest.json``: per config the sha256 of its result files, with wall-clock keys removed.
The default run is there because tiny configs miss what only its size exercises (a fused SGD step once
changed the default run's bytes on one CPU while all 20 tiny configs stayed the same).
``compare A/manifest.json B/manifest.json`` prints one line per config and exits 1 if any differ.

Run it on two versions of the package (e.g. ``PYTHONPATH=<old checkout>/src`` for the old one) with
``OMP_NUM_THREADS=1``; the same code gives the same manifest, to the byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# before torch, flwr or ray are imported: one thread, Ray on 127.0.0.1 only, no telemetry or update check
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402

MANIFEST_FORMAT = "fedhpro-identical-runs/1"

# the digits-offline build of the test suite (tests/conftest.py): DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION and
# data.build_seed=0 (the default, conftest's DIGITS_BUILD_SEED). The suite builds it once with
# build_digits_offline(root, seed=0, test_fraction=0.05, syn_size=200); here the first run builds the same
# cache in OUT_DIR/data from these settings (fedhpro.run builds a missing cache), and the later runs read it
DIGITS_SYN_SIZE = 200
DIGITS_TEST_FRACTION = 0.05

#: keys that hold wall-clock times (removed at any depth before hashing JSON): summary.json's "seconds";
#: "elapsed" is timing.jsonl's, which is not hashed at all (metrics.jsonl keeps wall times out)
TIME_KEYS = frozenset({"seconds", "elapsed"})
#: keys that describe the machine, not the result (removed likewise): summary.json's "machine" (the CPU, its
#: instruction sets, the GPU, the thread count, the precision and memory format training ran in)
MACHINE_KEYS = frozenset({"machine"})

#: JSON result files hashed (canonical: time keys removed, json.dumps(sort_keys=True), one line per row)
JSON_FILES = {"metrics": "metrics.jsonl", "summary": "summary.json", "partition": "partition.json"}
#: torch files hashed tensor by tensor (key order), when the run wrote them
TENSOR_FILES = {"server_state": "server_state.pt", "model": "model.pt"}

#: privacy.max_epsilon of the Flower privacy run: after round 1 epsilon is 0.82, after round 2 1.76
#: (3 clients, noise_multiplier 1, rdp), so the run stops after 1 of its 3 rounds
FLOWER_MAX_EPSILON = 1.2

METHODS = ("fedavg", "fedprox", "moon", "fedrcl", "fedproto", "fedtgp", "fedgmkd", "fedsa", "fedhpro")


def tiny_settings(data_dir: Path, **extra: Any) -> dict[str, Any]:
    """tests/test_flower.py's tiny_config (3 clients of ~40 images, d=16, one local epoch), one thread."""
    return {"rounds": 2, "clients": 3, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1, "device": "cpu",
            "data_dir": str(data_dir), "progress": False, "seed": 1, "threads": "1", **extra}


#: (name, overrides) run by fedhpro.run, one after another: every method, then variants
SIMULATOR_CONFIGS: list[tuple[str, dict[str, Any]]] = (
    # MOON and FedSA 2 rounds (their per-client state is used from the 2nd round), FedHPro 2 rounds
    [(f"sim-{name}", {"method": name, "rounds": 2 if name in ("moon", "fedsa", "fedhpro") else 1})
     for name in METHODS]
    + [("sim-fedproto-proto-only", {"method": "fedproto", "rounds": 2, "fedproto.protocol": "proto-only"}),
       ("sim-fedhpro-scaled-median", {"method": "fedhpro", "rounds": 2, "aggregation": "median",
                                      "faults.scale": 0.4}),
       ("sim-fedavg-flipped-norm-clip", {"method": "fedavg", "rounds": 2, "aggregation": "norm-clip",
                                         "faults.sign_flip": 0.4}),
       ("sim-fedavg-privacy-client", {"method": "fedavg", "rounds": 2, "privacy": "client",
                                      "privacy.noise_multiplier": 1.0, "privacy.secure_noise": False}),
       ("sim-fedhpro-htfe2", {"method": "fedhpro", "rounds": 2, "heterogeneity": "htfe2"})])

#: (name, overrides) run on Flower's simulation engine, all in one run_simulation (one Ray start)
FLOWER_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("flower-fedavg", {"method": "fedavg", "rounds": 1}),
    ("flower-fedhpro-2-rounds", {"method": "fedhpro", "rounds": 2}),
    ("flower-fedproto-proto-only", {"method": "fedproto", "rounds": 2, "fedproto.protocol": "proto-only"}),
    ("flower-fedavg-privacy-max-epsilon", {"method": "fedavg", "rounds": 3, "privacy": "client",
                                           "privacy.noise_multiplier": 1.0, "privacy.secure_noise": False,
                                           "privacy.max_epsilon": FLOWER_MAX_EPSILON}),
    ("flower-moon-2-rounds", {"method": "moon", "rounds": 2}),
    ("flower-fedsa-2-rounds", {"method": "fedsa", "rounds": 2}),
]

#: the default ``fedhpro run``: no setting but ``out`` (and one thread, as every config here)
DEFAULT_RUN = "default-run"

CONFIG_NAMES = [name for name, _ in SIMULATOR_CONFIGS + FLOWER_CONFIGS] + [DEFAULT_RUN]
assert len(CONFIG_NAMES) == len(set(CONFIG_NAMES)) == 21


# ---------------------------------------------------------------------------- hashing


def without_time_keys(value: Any) -> Any:
    """``value`` with every dict key of :data:`TIME_KEYS` and :data:`MACHINE_KEYS` removed, at any depth."""
    if isinstance(value, dict):
        return {key: without_time_keys(item) for key, item in value.items()
                if key not in TIME_KEYS and key not in MACHINE_KEYS}
    if isinstance(value, list):
        return [without_time_keys(item) for item in value]
    return value


def canonical_json(text: str, lines: bool) -> str:
    """One JSON document (or, ``lines``, one per non-blank line) without time keys, keys sorted."""
    documents = [json.loads(line) for line in text.splitlines() if line.strip()] if lines else [json.loads(text)]
    return "\n".join(json.dumps(without_time_keys(document), sort_keys=True) for document in documents)


def json_hash(path: Path) -> str:
    return hashlib.sha256(canonical_json(path.read_text(), path.suffix == ".jsonl").encode()).hexdigest()


def _hash_tree(digest: Any, value: Any, where: str) -> int:
    """Feeds ``value`` (nested dicts, lists, tensors, scalars) to ``digest``: dict keys in sorted order, each
    tensor as path, dtype, shape and raw bytes; returns the number of tensors."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{where}|tensor|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        return 1
    if isinstance(value, dict):
        count = 0
        for key in sorted(value, key=str):
            count += _hash_tree(digest, value[key], f"{where}/{key}")
        return count
    if isinstance(value, (list, tuple)):
        digest.update(f"{where}|{type(value).__name__}|{len(value)}|".encode())
        return sum(_hash_tree(digest, item, f"{where}/{index}") for index, item in enumerate(value))
    digest.update(f"{where}|{type(value).__name__}|{value!r}|".encode())
    return 0


def tensor_hash(path: Path) -> str:
    """sha256 over every tensor of a torch file (loaded with weights_only=True), in key order."""
    digest = hashlib.sha256()
    _hash_tree(digest, torch.load(path, weights_only=True, map_location="cpu"), "")
    return digest.hexdigest()


def hash_run(folder: Path) -> dict[str, Any]:
    """A finished run folder's hashes: its JSON results (canonical) and its torch files."""
    entry: dict[str, Any] = {}
    for field, name in JSON_FILES.items():
        path = folder / name
        entry[field] = json_hash(path) if path.is_file() else None
    for field, name in TENSOR_FILES.items():
        path = folder / name
        entry[field] = tensor_hash(path) if path.is_file() else None
    personal = sorted((folder / "models").glob("*.pt")) if (folder / "models").is_dir() else []
    entry["personal_models"] = {path.name: tensor_hash(path) for path in personal} or None
    if entry["metrics"] is None or entry["summary"] is None:
        entry["error"] = "the run finished without metrics.jsonl or summary.json"
    return entry


def error_text(error: BaseException, out_dir: Path) -> str:
    """One error's text, the output folder's path replaced by OUT_DIR (manifests of two folders compare)."""
    text = f"{type(error).__name__}: {error}"
    return text.replace(str(out_dir.resolve()), "OUT_DIR").replace(str(out_dir), "OUT_DIR")


# ---------------------------------------------------------------------------- running


def run_simulator_configs(out_dir: Path, data_dir: Path, names: set[str], manifest: dict[str, Any]) -> None:
    import fedhpro

    for name, extra in SIMULATOR_CONFIGS:
        if name in names:
            record(manifest, name, out_dir, lambda name=name, extra=extra: fedhpro.run(
                tiny_settings(data_dir, **extra), out=str(out_dir / name)))


def record(manifest: dict[str, Any], name: str, out_dir: Path, run: Any) -> None:
    """``run()`` the config ``name`` into ``out_dir / name`` and put its hashes (or its error, the run goes on
    with the next config) into ``manifest``, with one line of its time."""
    started = time.perf_counter()
    try:
        run()
        manifest[name] = hash_run(out_dir / name)
    except Exception as error:  # record it and go on with the next config
        traceback.print_exc()
        manifest[name] = {"error": error_text(error, out_dir)}
    print(f"{name}: {time.perf_counter() - started:.1f} s"
          f"{'  FAILED: ' + manifest[name]['error'] if 'error' in manifest[name] else ''}", flush=True)


def run_flower_configs(out_dir: Path, data_dir: Path, names: set[str], manifest: dict[str, Any]) -> None:
    """The FLOWER_CONFIGS in ``names`` through one run_simulation (3 SuperNodes, 1 Ray CPU), as
    tests/test_flower.py's ``simulated`` fixture runs its configs."""
    chosen = [(name, extra) for name, extra in FLOWER_CONFIGS if name in names]
    if not chosen:
        return
    try:
        from flwr.app import Context
        from flwr.serverapp import Grid, ServerApp
        from flwr.simulation import run_simulation

        from fedhpro.flower.client import app as client_app
        from fedhpro.flower.engine import RAY_LOOPBACK_INIT_ARGS
        from fedhpro.flower.server import run_server
    except Exception as error:
        traceback.print_exc()
        for name, _ in chosen:
            manifest[name] = {"error": error_text(error, out_dir)}
        return

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for name, extra in chosen:
            record(manifest, name, out_dir, lambda name=name, extra=extra: run_server(
                grid, context.run_config, tiny_settings(data_dir, out=str(out_dir / name), **extra)))

    # Flower's Ray backend sets os.environ["PYTHONPATH"] to this process's whole sys.path and leaves it set
    pythonpath = os.environ.get("PYTHONPATH")
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=3,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 1, **RAY_LOOPBACK_INIT_ARGS}})
    except Exception as error:
        traceback.print_exc()
        for name, _ in chosen:
            manifest.setdefault(name, {"error": error_text(error, out_dir)})
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
    for name, _ in chosen:
        manifest.setdefault(name, {"error": "the Flower simulation did not reach this config"})


def command_run(out_dir: Path, only: list[str] | None) -> int:
    import fedhpro

    unknown = sorted(set(only or ()) - set(CONFIG_NAMES))
    if unknown:
        print(f"unknown config(s) {unknown}; choose from {CONFIG_NAMES}", file=sys.stderr)
        return 2
    names = set(only or CONFIG_NAMES)
    out_dir.mkdir(parents=True, exist_ok=True)
    taken = [name for name in names if (out_dir / name).exists()]
    if taken or (out_dir / "manifest.json").exists():
        print(f"{out_dir} already holds runs ({', '.join(sorted(taken)) or 'manifest.json'}); give an empty folder",
              file=sys.stderr)
        return 2
    print(f"fedhpro from {Path(fedhpro.__file__).parent}", flush=True)
    data_dir = out_dir / "data"
    manifest: dict[str, Any] = {}
    started = time.perf_counter()
    # the simulator first: a Flower app run in this process flushes denormal floats for the rest of it
    run_simulator_configs(out_dir, data_dir, names, manifest)
    if DEFAULT_RUN in names:  # its own data (the built-in default federation), not the tiny digits cache
        record(manifest, DEFAULT_RUN, out_dir, lambda: fedhpro.run({"progress": False, "threads": "1"},
                                                                   out=str(out_dir / DEFAULT_RUN)))
    run_flower_configs(out_dir, data_dir, names, manifest)
    ordered = {name: manifest[name] for name in CONFIG_NAMES if name in manifest}
    document = {"format": MANIFEST_FORMAT, "configs": ordered}
    (out_dir / "manifest.json").write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
    failed = [name for name, entry in ordered.items() if "error" in entry]
    print(f"{len(ordered)} configs in {time.perf_counter() - started:.0f} s; manifest: {out_dir / 'manifest.json'}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# ---------------------------------------------------------------------------- comparing


def command_compare(first: Path, second: Path) -> int:
    a, b = (json.loads(path.read_text())["configs"] for path in (first, second))
    names = list(a) + [name for name in b if name not in a]
    different = 0
    for name in names:
        if name not in a or name not in b:
            line = f"DIFFERENT: only in {first if name in a else second}"
        else:
            left, right = a[name], b[name]
            fields = [field for field in list(left) + [f for f in right if f not in left]
                      if left.get(field) != right.get(field)]
            if not fields:
                line = "same" + (f" (FAILED in both: {left['error']})" if "error" in left else "")
            else:
                files = [{**JSON_FILES, **TENSOR_FILES, "personal_models": "models/"}.get(field, field)
                         for field in fields]
                line = f"DIFFERENT {', '.join(files)}"
                for side, entry in ((first, left), (second, right)):
                    if "error" in entry:
                        line += f"\n    error in {side}: {entry['error']}"
        different += not line.startswith("same")
        print(f"{name:36s} {line}")
    print(f"{len(names) - different} same, {different} different")
    return 1 if different else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the 20 configs into OUT_DIR and write OUT_DIR/manifest.json")
    run.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    run.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these configs (of {CONFIG_NAMES})")
    compare = commands.add_parser("compare", help="compare two manifests; exit 1 if any config differs")
    compare.add_argument("first", type=Path, metavar="A")
    compare.add_argument("second", type=Path, metavar="B")
    args = parser.parse_args(argv)
    if args.command == "run":
        return command_run(args.out_dir, args.only)
    return command_compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
