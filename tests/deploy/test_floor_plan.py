"""The floor plan, checked from the code's own imports (read with `ast`, nothing of the runtime is run):

- floors, bottom to top: `protos/` and `kernels/` -> `engine/` -> `cluster/` -> `router/`, `prefill_worker/`,
  `decode_worker/` -> `kvflow/`; a module imports only from a lower floor or from its own package;
- no import circle between files;
- a router process (`kvflow router`, or the router inside `kvflow serve`) loads no module of `engine/runner`,
  `engine/models` or `kernels/` (checked in a fresh interpreter, by what lands in `sys.modules`).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOORS = {"protos": 1, "kernels": 1, "engine": 2, "cluster": 3,
          "router": 4, "prefill_worker": 4, "decode_worker": 4, "kvflow": 5}
GENERATED = ("_pb2.py", "_pb2_grpc.py")
HEAVY_FOR_ROUTER = ("engine.runner", "engine.models", "kernels")


def runtime_files() -> Iterator[Path]:
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(GENERATED):
                yield path


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(path: Path) -> list[str]:
    """Every project module the file imports (at any depth, TYPE_CHECKING blocks excepted). `from pkg import
    name` counts as `pkg.name` when that is a module, else as `pkg`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append(candidate if _is_module(candidate) else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [name for name in found if name.split(".")[0] in FLOORS]


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _file_of(dotted: str) -> str | None:
    path = ROOT.joinpath(*dotted.split("."))
    if path.with_suffix(".py").is_file():
        return str(path.with_suffix(".py").relative_to(ROOT))
    if (path / "__init__.py").is_file():
        return str((path / "__init__.py").relative_to(ROOT))
    return None


def test_imports_run_only_downward() -> None:
    upward = []
    for path in runtime_files():
        own = path.relative_to(ROOT).parts[0]
        for target in imported_modules(path):
            other = target.split(".")[0]
            if other != own and FLOORS[other] >= FLOORS[own]:
                upward.append(f"{path.relative_to(ROOT)} (floor {FLOORS[own]}) imports {target} "
                              f"(floor {FLOORS[other]})")
    assert not upward, "imports that do not run down a floor:\n" + "\n".join(upward)


def test_no_import_circles_between_files() -> None:
    graph: dict[str, set[str]] = {}
    for path in runtime_files():
        source = str(path.relative_to(ROOT))
        targets = {_file_of(name) for name in imported_modules(path)}
        graph[source] = {t for t in targets if t and t != source and not t.endswith("__init__.py")}
    circles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not circles, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in circles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has a few hundred files)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


ROUTER_PROCESS = """
import json, sys
from kvflow.cli import build_parser
from kvflow.commands import router as command
args = build_parser().parse_args(["router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"])
command.config_from_args(args)
import router.server  # what `run` starts
import kvflow.commands.serve, kvflow.launcher  # `kvflow serve` runs the router in the launcher's process
print(json.dumps(sorted(sys.modules)))
"""


def test_router_process_loads_no_runner_model_or_kernel() -> None:
    done = subprocess.run([sys.executable, "-c", ROUTER_PROCESS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True)
    loaded = json.loads(done.stdout.splitlines()[-1])
    heavy = [m for m in loaded if m.startswith(HEAVY_FOR_ROUTER) and m.split(".")[0] in FLOORS]
    assert "router.server" in loaded
    assert not heavy, f"a router process loads {heavy}"


def test_the_checks_see_a_violation() -> None:
    """The floor check reads what it should: a known downward import is found, so an empty result means
    something."""
    imports = imported_modules(ROOT / "router" / "server.py")
    assert any(name.startswith("router.") for name in imports)
    assert _strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) in (
        [["b", "a"], ["c"]], [["a", "b"], ["c"]], [["c"], ["b", "a"]], [["c"], ["a", "b"]])
