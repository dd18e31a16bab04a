"""Layers import downward only, nothing imports in a loop, and the core never imports jax.

Units are jaxserve's subpackages and its top-level modules. Every import the
source makes is an edge: at the top of a module, inside a function, and under TYPE_CHECKING
alike (a type-only import is still a dependency between modules). An edge between two units
must follow LAYERS, and the module graph itself has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each layer and the layers directly below it. A unit may import any layer reachable from its
# own in this DAG (every layer below it), never one above or beside it.
LAYERS: dict[str, tuple[str, ...]] = {
    "jaxserve": ("jaxserve.entrypoints",),  # the package's lazy exports
    "jaxserve.entrypoints": ("jaxserve.engine", "jaxserve.compilation"),
    "jaxserve.engine": ("jaxserve.runtime", "jaxserve.core", "jaxserve.inputs",
                        "jaxserve.outputs", "jaxserve.pooling_params"),
    "jaxserve.compilation": ("jaxserve.runtime",),  # AOT builds through a worker
    "jaxserve.runtime": ("jaxserve.programs", "jaxserve.core"),
    "jaxserve.programs": ("jaxserve.placement", "jaxserve.core"),
    "jaxserve.placement": ("jaxserve.models",),
    "jaxserve.models": ("jaxserve.layers", "jaxserve.config"),
    "jaxserve.layers": ("jaxserve.kernels", "jaxserve.sampling_params"),
    "jaxserve.kernels": (),
    # The scheduler and the KV-cache bookkeeping: pure Python and numpy, beside the device code.
    "jaxserve.core": ("jaxserve.config", "jaxserve.sampling_params"),
    "jaxserve.config": ("jaxserve.default_model",),
    "jaxserve.default_model": (),
    "jaxserve.sampling_params": (),
    "jaxserve.pooling_params": ("jaxserve.sampling_params",),
    "jaxserve.inputs": (),
    "jaxserve.outputs": (),
}
DEVICE_UNITS = {"jaxserve.compilation", "jaxserve.engine", "jaxserve.kernels", "jaxserve.layers",
                "jaxserve.models", "jaxserve.placement", "jaxserve.programs", "jaxserve.runtime"}
JAX_PACKAGES = {"jax", "jaxlib", "flax"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def imported_names(path: Path, package: str = "") -> set[str]:
    """Absolute names of every module this file imports, wherever the import statement sits
    (`package`: the file's own package, to resolve relative imports)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def imports_of(path: Path, package: str = "") -> set[str]:
    """The project modules among them."""
    return {m for m in imported_names(path, package)
            if m.split(".")[0] == "jaxserve"}


def project_files() -> dict[str, Path]:
    files = sorted(ROOT.glob("jaxserve/**/*.py"))
    return {module_name(f): f for f in files}


def project_graph() -> dict[str, set[str]]:
    modules = project_files()
    graph = {}
    for m, f in modules.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        # `from pkg import name` names a module only when pkg.name is one
        graph[m] = {i for i in imports_of(f, package) if i in modules and i != m}
    return graph


def find_cycle(graph: dict[str, set[str]] | dict[str, tuple[str, ...]]) -> list[str] | None:
    """One cycle of the graph as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def below(layers: dict[str, tuple[str, ...]]) -> dict[str, set[str]]:
    """Every layer each layer may import: those reachable from it."""
    out: dict[str, set[str]] = {}

    def reach(layer: str) -> set[str]:
        if layer not in out:
            out[layer] = set()
            for lower in layers[layer]:
                out[layer] |= {lower} | reach(lower)
        return out[layer]

    for layer in layers:
        reach(layer)
    return out


def disallowed_imports(graph: dict[str, set[str]],
                       layers: dict[str, tuple[str, ...]]) -> list[str]:
    allowed = below(layers)
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  for target in targets
                  if unit_of(target) != unit_of(module)
                  and unit_of(target) not in allowed[unit_of(module)])


def test_the_layers_are_a_dag_and_every_unit_has_one():
    assert find_cycle(LAYERS) is None
    assert all(lower in LAYERS for lowers in LAYERS.values() for lower in lowers)
    assert {unit_of(m) for m in project_files()} <= set(LAYERS)


def test_every_import_goes_down_the_layers():
    assert disallowed_imports(project_graph(), LAYERS) == []


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(project_graph())
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_core_imports_no_jax_and_no_device_code():
    assert below(LAYERS)["jaxserve.core"].isdisjoint(DEVICE_UNITS)
    jax_imports = sorted(f"{m}: {name}" for m, f in project_files().items()
                         if unit_of(m) == "jaxserve.core"
                         for name in imported_names(f) if name.split(".")[0] in JAX_PACKAGES)
    assert jax_imports == []


def test_the_checks_see_type_only_and_local_imports_cycles_and_upward_edges(tmp_path):
    """The graph really is read from the source, and each check fails on a bad graph."""
    graph = project_graph()
    assert "jaxserve.core.request" in graph["jaxserve.core.scheduler"]
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from jaxserve.engine.core import EngineCore\n"
                   "def f():\n    import jax.numpy as jnp\n    from . import sibling\n")
    assert {"jaxserve.engine.core", "jax.numpy", "jaxserve.core.sibling"} <= \
        imported_names(bad, "jaxserve.core")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({**LAYERS, "jaxserve.config": ("jaxserve.core",)}) is not None
    assert disallowed_imports({"jaxserve.core.scheduler": {"jaxserve.models.tokenizer"},
                               "jaxserve.engine.core": {"jaxserve.config"}}, LAYERS) == \
        ["jaxserve.core.scheduler -> jaxserve.models.tokenizer"]
