"""How long the commands that do not train take to start: wall and CPU seconds of a fresh process each.

Measures ``fedhpro --help``, ``fedhpro config --keys``, ``fedhpro config`` (the resolved config), ``fedhpro run
roundz=3`` (a mistyped key, refused in one line with exit status 2) and ``python -c "import fedhpro"``, with
``python -c "import torch"`` and ``python -c pass`` as the floor they are read against, each as a fresh subprocess
(``python -m fedhpro``, the console script's code), the commands interleaved so that a change of load hits them all;
prints the median and range of ``--repeats`` runs, the machine's load (``os.getloadavg``, before and after) and its
CPU model. The children write and read ``__pycache__`` (``PYTHONDONTWRITEBYTECODE`` is dropped for them), as an
installed package does. CPU seconds (user + system of the child, from ``getrusage``) are what a command costs; they
move less with the load of other processes than wall seconds, which on a busy machine include waiting for a core.

    python bench/startup.py                      # 5 repeats, this checkout's src/
    python bench/startup.py --repeats 9 --src /tmp/other/src   # another checkout, for before / after

This process imports neither fedhpro nor torch: the children are measured alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: the exit status each command is expected to end with when it is not 0: a refused key is a usage error
EXPECTED_STATUS = {"fedhpro run roundz=3": 2}

#: label -> the arguments after ``python``
COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "import fedhpro": ["-c", "import fedhpro"],
    "fedhpro --help": ["-m", "fedhpro", "--help"],
    "fedhpro config --keys": ["-m", "fedhpro", "config", "--keys"],
    "fedhpro config": ["-m", "fedhpro", "config"],
    "fedhpro run roundz=3": ["-m", "fedhpro", "run", "roundz=3"],
    "import torch": ["-c", "import torch"],
}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's word for it elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def run_once(arguments: list[str], env: dict[str, str], status: int = 0) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one ``python <arguments>`` with its output discarded; a command that ends with
    another exit status than ``status`` stops the benchmark with its error."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *arguments], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != status:
        raise SystemExit(f"python {' '.join(arguments)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each command (default 5); the median is shown")
    parser.add_argument("--src", type=Path, default=SRC, help="the src/ folder whose fedhpro is measured "
                                                              "(default: this checkout's)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be at least 1")
    if not (args.src / "fedhpro" / "__init__.py").is_file():
        parser.error(f"--src {args.src} holds no fedhpro package (give the src/ folder of a checkout)")
    # bytecode written and read, as for an installed package (pip compiles it): without it every start compiles
    # fedhpro's modules again (~0.1-0.2 s of CPU), which no user pays
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(args.src.resolve())
    # one untimed run of each: the .pyc files are written and the files are in the page cache for every repeat
    for label, arguments in COMMANDS.items():
        run_once(arguments, env, EXPECTED_STATUS.get(label, 0))
    load_before = load()
    walls: dict[str, list[float]] = {label: [] for label in COMMANDS}
    cpus: dict[str, list[float]] = {label: [] for label in COMMANDS}
    for _ in range(args.repeats):
        for label, arguments in COMMANDS.items():
            wall, cpu = run_once(arguments, env, EXPECTED_STATUS.get(label, 0))
            walls[label].append(wall)
            cpus[label].append(cpu)
    print(f"fedhpro start-up: {args.src.resolve()}, Python {platform.python_version()}, {cpu_model()}, "
          f"{os.cpu_count()} cores")
    print(f"load average (1, 5, 15 min): {load_before} before, {load()} after; median of {args.repeats} runs "
          "[min-max]\n")
    print(f"| {'command':<22} | {'wall s':>18} | {'CPU s (user+sys)':>18} |")
    print(f"|{'-' * 24}|{'-' * 19}:|{'-' * 19}:|")
    for label in COMMANDS:
        shown = [f"{statistics.median(values):.3f} [{min(values):.2f}-{max(values):.2f}]"
                 for values in (walls[label], cpus[label])]
        print(f"| {label:<22} | {shown[0]:>18} | {shown[1]:>18} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
