"""Layers import downward only, and nothing imports in a loop.

Units are jaxserve's subpackages, its top-level modules and `pallas_kernels`. Every import the
source makes (at the top of a module or inside a function, except under TYPE_CHECKING) is an
edge; an edge must go to a unit lower in LAYERS, and the module graph itself has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Lowest first. A unit may import only units before it.
LAYERS = (
    "jaxserve.default_model", "jaxserve.disaggregation_config", "jaxserve.speculative_config",
    "jaxserve.vllm_args",
    "jaxserve.config", "jaxserve.inputs",
    "jaxserve.sampling_params", "pallas_kernels", "jaxserve.layers", "jaxserve.models",
    "jaxserve.core", "jaxserve.outputs", "jaxserve.executor", "jaxserve.engine",
    "jaxserve.entrypoints", "jaxserve",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "pallas_kernels"
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def imports_of(path: Path) -> set[str]:
    """Absolute names of the project modules this file imports, TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
               for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] in ("jaxserve", "pallas_kernels")}


def project_graph() -> dict[str, set[str]]:
    files = sorted([*ROOT.glob("jaxserve/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")])
    modules = {module_name(f): f for f in files}
    # `from pkg import name` names a module only when pkg.name is one
    return {m: {i for i in imports_of(f) if i in modules and i != m}
            for m, f in modules.items()}


def test_every_import_goes_down_the_layers():
    upward = []
    for module, targets in project_graph().items():
        src = unit_of(module)
        for target in targets:
            dst = unit_of(target)
            if dst != src and LAYERS.index(dst) >= LAYERS.index(src):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_module_imports_itself_through_others():
    graph = project_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import loop: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The graph really is read from the source: a core module importing the engine shows up."""
    graph = project_graph()
    assert "jaxserve.core.request" in graph["jaxserve.core.scheduler"]
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from jaxserve.engine.core import EngineCore\n")
    assert "jaxserve.engine.core" in imports_of(bad)
