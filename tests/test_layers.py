"""The import layers of fedhpro (read from the source with ``ast``, every import, at any depth of a module,
type-checking ones too): nothing imports upward, and no two modules import each other, directly or around a
circle. The layers, from the bottom:

0. the utilities, data and models: errors, bounded and arrays (bounded readers of untrusted text and array
   files), files, seeds, runtime, options, registry, averaging (the running weighted sum), functional, robust (the
   robust aggregation rules, by name), aggregation, metrics, reports, data, models;
1. methods, and privacy (the clipping, noise and accountants the shared client loop and the round protocol use);
   within methods, base (the interface: Server, Client, MethodSpec) imports the jobs below it (layout: reply
   layouts; parts: a model's two parts; no_grad: the no-grad passes; training: the shared loop), never the reverse;
2. engines (the simulator, the round protocol, the run driver) and the config (which names the methods);
3. what builds and drives runs for the API: experiment (building one), resume, user_models (models and data
   given from Python), measurements (observers that write files), sweeps (given the job they run) and trained (the model
   files a run writes, loaded back), and deploy (certificates, the nginx gate, a supervised deployment on
   loopback: operations tooling the Flower apps run on, which imports none of them);
4. the API, compare, the CLI (and the commands it runs), reproduce, bench and the Flower apps.

No circle at all, not even between a package's ``__init__`` and its own submodules (a registry imports the
modules it lists; they import what they need from modules of their own, e.g. ``fedhpro.data.spec``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "fedhpro"

LAYERS = {
    0: ("errors", "bounded", "arrays", "files", "seeds", "runtime", "search_space", "options", "registry", "averaging",
        "functional",
        "robust", "aggregation", "metrics", "reports", "data", "models", "command_options"),
    1: ("methods", "privacy"),
    2: ("engines", "config"),
    # below the API: modules that drive runs they are given; deploy: operations tooling below the Flower apps
    3: ("sweeps", "measurements", "trackers", "experiment", "resume", "user_models", "trained", "deploy"),
    4: ("api", "compare", "tune", "cli", "commands", "config_command", "reproduce", "bench",
        "flower", "__main__", ""),
}


def modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, names in LAYERS.items():
        if top in names:
            return rank
    raise AssertionError(f"{module} is in no layer; add its top-level name to LAYERS")


def test_nothing_imports_upward():
    upward = sorted(f"{name} ({layer(name)}) imports {other} ({layer(other)})"
                    for name, targets in graph().items() for other in targets if layer(other) > layer(name))
    assert not upward, "\n".join(upward)


def test_deploy_imports_no_run_code():
    """fedhpro.deploy sets up the machines the Flower apps run on: it imports no Flower app, API, engine or
    method (its layer alone would allow the engines and methods)."""
    barred = ("fedhpro.flower", "fedhpro.api", "fedhpro.engines", "fedhpro.methods")
    found = sorted(f"{name} imports {other}" for name, targets in graph().items() if name.startswith("fedhpro.deploy")
                   for other in targets if other.startswith(barred))
    assert not found, "\n".join(found)


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert circles(graph()) == []


#: imports of fedhpro modules inside functions that remain: each says why it stays lazy (the CLI's one
#: import of its commands, fedhpro.run at the package root; the rest in modules being reworked). The target is 10.
MAX_FUNCTION_LEVEL_IMPORTS = 10


def function_level_imports() -> list[str]:
    """``path:line module`` of every import of a fedhpro module nested in a function (at any depth), which the
    reader of a module's head does not see."""
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                if any(name.split(".")[0] == "fedhpro" for name in names):
                    found.append(f"{path.relative_to(SOURCE)}:{node.lineno} {', '.join(names)}")
    return sorted(set(found))  # a function nested in another is walked twice


def test_imports_are_at_module_level():
    """Imports are in the open, at the head of a module: at most :data:`MAX_FUNCTION_LEVEL_IMPORTS` imports of
    fedhpro modules inside functions (a module that must stay lazy says why where it imports)."""
    found = function_level_imports()
    assert len(found) <= MAX_FUNCTION_LEVEL_IMPORTS, "\n".join(found)
