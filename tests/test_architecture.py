"""The package's shape: no import cycle, the engine in one room, fault injection unreachable, a thin CLI."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "evalrun"


def _imports() -> dict[str, set[str]]:
    """module -> the evalrun modules it imports (relative imports resolved)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = parts[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - (node.level - 1)]
                targets.add(".".join(base + ([node.module] if node.module else [])))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("evalrun"):
                targets.add(node.module)
        graph[module] = targets
    return graph


def test_no_import_cycle():
    graph = _imports()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in graph.get(module, ()):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " -> ".join(trail + [module, target]))
            if target not in state:
                visit(target, trail + [module])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_the_engine_depends_only_on_config_and_errors():
    for module, targets in _imports().items():
        if module.startswith("evalrun.engine"):
            outside = {t for t in targets if not t.startswith("evalrun.engine")} - {"evalrun.config", "evalrun.errors"}
            assert not outside, f"{module} imports {outside}"


def test_fault_injection_is_reachable_from_nothing_in_the_package():
    importers = [module for module, targets in _imports().items() if "evalrun.engine.faults" in targets]
    assert importers == [], importers


def test_only_the_cli_speaks_click():
    users = [path.name for path in PACKAGE.rglob("*.py") if "import click" in path.read_text()]
    assert users == ["cli.py"]
