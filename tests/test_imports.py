"""The import graph of ``dpml/`` points one way (docs/explanations/design.md: "Layers").

The graph is derived from the source with ``ast``: every ``import``/``from … import`` of a dpml module, at
module level or inside a function (a function-level import still runs, so it counts), except those under
``if TYPE_CHECKING:`` (annotations only: nothing is imported when the program runs). A module imported
from a package (``from dpml import io``) is an edge to that module, not to the package.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import from its own layer and the layers below it, never from one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",
        (
            "dpml.formatting",
            "dpml.faults",
            "dpml.io",
            "dpml.terminal",
            "dpml.devices",
            "dpml.interrupts",
            "dpml.progress",
            "dpml.params_yaml",
            "dpml.cli_help",
            "dpml.cli_completion",
            "dpml.routing",
            "dpml.definitions",
            "dpml.init_schemes",
        ),
    ),
    ("models", ("dpml.models",)),
    ("attack statistics", ("dpml.audit.attacks", "dpml.audit.signals")),
    ("settings", ("dpml.sections", "dpml.sections_stores")),
    ("data", ("dpml.data",)),
    ("accounting", ("dpml.accounting",)),
    ("ledger", ("dpml.ledger",)),
    ("training", ("dpml.train",)),
    ("configuration", ("dpml.config",)),
    ("evidence", ("dpml.audit", "dpml.report")),
    ("records of a run", ("dpml.tracking", "dpml.provenance", "dpml.preflight")),
    ("stages", ("dpml.stages",)),
    (
        "front doors",
        (
            "dpml",
            "dpml.__main__",
            "dpml.api",
            "dpml.cli",
            "dpml.cli_compare",
            "dpml.cli_privacy",
            "dpml.cli_text",
            "dpml.reproduce",
        ),
    ),
]


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in (ROOT / "dpml").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module that a dotted name lives in (``dpml.train.clipping.engine_pass`` → ``dpml.train.clipping``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported dpml module, line) for each import that runs (module docstring)."""
    found: list[tuple[str, int]] = []
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            if not any(name in known for name in names):
                names = [base]
        else:
            visit(node)
            return
        for name in names:
            owner = _owner(name, known) if name.split(".")[0] == "dpml" else None
            if owner is not None and owner != module:
                found.append((owner, node.lineno))

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module → {imported module: the line of its first import}."""
    known = modules()
    graph: dict[str, dict[str, int]] = defaultdict(dict)
    for module, path in known.items():
        for target, line in imports_of(module, path, known):
            graph[module].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the longest prefix that names the module."""
    best: tuple[int, int] | None = None
    for position, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (position, len(prefix))
    return None if best is None else best[0]


def test_the_graph_is_read_from_the_code() -> None:
    """The reader sees the imports it must (module level, inside functions, relative, from a package) and skips
    annotation-only ones: checked on modules whose imports are known."""
    graph = import_graph()
    assert "dpml.train.registry" in graph["dpml.config"]  # module level
    assert "dpml.train.trainers.dpsgd" in graph["dpml.train.registry"]
    assert "dpml.stages" in graph["dpml.cli"]  # inside a function
    assert "dpml.config" not in graph["dpml.train.registry"]  # only under TYPE_CHECKING
    assert "dpml.data.records" in graph["dpml.data.sources"] and "dpml.data.tables" in graph["dpml.data.sources"]


def test_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    described = [
        "; ".join(f"{a} imports {b} (line {graph[a][b]})" for a in component for b in graph[a] if b in component)
        for component in found
    ]
    assert found == [], "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert unplaced == [], (
        f"place these modules in a layer (tests/test_imports.py LAYERS, docs/explanations/design.md): {unplaced}"
    )


def test_imports_point_down() -> None:
    graph = import_graph()
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]}), line {line}"  # type: ignore[index]
        for a, targets in sorted(graph.items())
        for b, line in sorted(targets.items())
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)
    ]  # type: ignore[operator]
    assert upward == [], "imports that point up a layer:\n" + "\n".join(upward)


LAZY = re.compile(r"#.*\blazy: \S")


def untagged_function_imports(source: str) -> list[int]:
    """Lines of imports inside functions without ``# lazy: <reason>`` on their first line."""
    lines = source.splitlines()
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found |= {
                sub.lineno
                for sub in ast.walk(node)
                if isinstance(sub, (ast.Import, ast.ImportFrom)) and not LAZY.search(lines[sub.lineno - 1])
            }
    return sorted(found)


def test_every_import_inside_a_function_says_why_it_is_there() -> None:
    """An import inside a function is for an optional dependency or a load kept off a path that does not need it
    (the command line's start, MLflow where nothing is recorded), with the reason on its line; any other import
    is at the top of its module."""
    untagged = {
        name: lines
        for name, path in modules().items()
        if (lines := untagged_function_imports(path.read_text(encoding="utf-8")))
    }
    assert untagged == {}


def test_an_untagged_import_inside_a_function_is_found() -> None:
    source = (
        "import os\n\n\ndef f():\n    import json  # lazy: json only here\n    from dpml import config\n"
        "    return json, config\n"
    )
    assert untagged_function_imports(source) == [6]


def imports_of_package(source: str, package: str) -> list[int]:
    """Lines that import ``package`` or one of its modules, anywhere in ``source`` (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(name == package or name.startswith(package + ".") for name in names):
            found.append(node.lineno)
    return sorted(found)


def test_only_the_tracking_package_imports_mlflow() -> None:
    """Everything MLflow lives in ``dpml/tracking/`` (docs/explanations/design.md): a stage, a front door or a
    report that needs a run, a version or a store asks that package, so an MLflow change is made in one place."""
    elsewhere = {
        name: lines
        for name, path in modules().items()
        if not (name == "dpml.tracking" or name.startswith("dpml.tracking."))
        and (lines := imports_of_package(path.read_text(encoding="utf-8"), "mlflow"))
    }
    assert elsewhere == {}, f"mlflow imported outside dpml/tracking/ (module: lines): {elsewhere}"
    assert imports_of_package((ROOT / "dpml" / "tracking" / "runs.py").read_text(encoding="utf-8"), "mlflow")


def test_an_mlflow_import_is_found_wherever_it_is_written() -> None:
    source = (
        "import os\nimport mlflow.pyfunc\n\n\ndef f():\n    from mlflow import MlflowClient  # lazy: x\n"
        "    import mlflowx\n    from .mlflow import y\n    return MlflowClient\n"
    )
    assert imports_of_package(source, "mlflow") == [2, 6]


def test_the_privacy_core_and_the_configuration_load_without_their_heavy_dependencies() -> None:
    """The ledger and the accountants load without torch (a process that only charges or reads the ledger loads it
    in about a second), and no command's configuration loads scipy.stats (a second of every ``dpml`` process)."""
    import subprocess
    import sys

    probe = (
        "import sys, importlib; importlib.import_module(sys.argv[1]); "
        "print(','.join(m for m in ('torch', 'scipy.stats', 'mlflow') if m in sys.modules))"
    )

    def loaded(module: str) -> set[str]:
        done = subprocess.run(
            [sys.executable, "-c", probe, module], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return set(filter(None, done.stdout.strip().split(",")))

    assert loaded("dpml.ledger.ledger") == set()
    assert loaded("dpml.accounting.accountants") == set()
    assert loaded("dpml.cli") == {"torch"}  # the trainers' registry needs torch; nothing else heavy
