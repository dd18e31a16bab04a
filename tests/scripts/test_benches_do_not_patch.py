"""No script under scripts/ patches the engine: none assigns to an attribute of an engine object
(or of anything reached from one: its core, scheduler, config, runner...) or to a global of a
jaxserve module. Benchmarks read the engine's own timings (`EngineStats.step_seconds`,
`ModelRunner.time_last_step`) and build one engine per setting instead.

An AST check: a name is "engine-bound" when it is an engine class or maker (imported from
jaxserve, or make_engine), is named like an engine part, or is bound (assignment, for loop,
with) to an expression rooted at such a name (`core = engine.core`, `{m: make_engine(...)}`);
an `=`, `+=`, annotated assignment, `del`, `setattr` or `delattr` on an attribute or item chain
rooted at an engine-bound name or at anything imported from jaxserve is a patch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MAKERS = {"make_engine", "make_engines"}
ENGINE_NAMES = re.compile(r"^(engine|llm|core|runner|worker|executor|scheduler|sched)s?$")
ENGINE_CLASSES = re.compile(r"engine|llm|core|runner|worker|executor|scheduler", re.I)


def root_name(node: ast.AST) -> str | None:
    """The name an attribute / subscript / call chain starts from: `a` for `a.b[0].c()`."""
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call | ast.Starred):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def bound_names(target: ast.AST) -> list[str]:
    """The names a binding target binds (`a, (b, c)`; not those inside `a[i]` or `a.b`)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List | ast.Starred):
        elts = [target.value] if isinstance(target, ast.Starred) else target.elts
        return [n for e in elts for n in bound_names(e)]
    return []


def value_roots(value: ast.AST) -> set[str | None]:
    """The roots of a value, or of the items of a container or comprehension built of them."""
    if isinstance(value, ast.List | ast.Tuple | ast.Set):
        return {r for e in value.elts for r in value_roots(e)}
    if isinstance(value, ast.Dict):
        return {r for v in value.values for r in value_roots(v)}
    if isinstance(value, ast.ListComp | ast.SetComp | ast.GeneratorExp):
        return value_roots(value.elt)
    if isinstance(value, ast.DictComp):
        return value_roots(value.value)
    return {root_name(value)}


def jaxserve_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name.split(".")[0]) for a in node.names
                      if a.name.split(".")[0] == "jaxserve"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxserve":
            names |= {a.asname or a.name for a in node.names}
    return names


def engine_bound(tree: ast.AST) -> set[str]:
    names = set(MAKERS) | {n for n in jaxserve_imports(tree) if ENGINE_CLASSES.search(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and ENGINE_NAMES.match(node.arg):
            names.add(node.arg)
    changed = True
    while changed:  # propagate through bindings until nothing new is engine-bound
        changed = False
        for node in ast.walk(tree):
            pairs: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                pairs = [(node.target, node.value)]
            elif isinstance(node, ast.For | ast.comprehension):
                pairs = [(node.target, node.iter)]
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                pairs = [(node.optional_vars, node.context_expr)]
            for target, value in pairs:
                rooted = value_roots(value) & names
                new = {n for n in bound_names(target)
                       if rooted or ENGINE_NAMES.match(n)} - names
                if new:
                    names |= new
                    changed = True
    return names


def patches(source: str) -> list[str]:
    """`line: code` of every assignment to an engine-bound attribute or jaxserve global."""
    tree = ast.parse(source)
    names = engine_bound(tree) | jaxserve_imports(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args):
            if root_name(node.args[0]) in names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
                if isinstance(t, ast.Attribute | ast.Subscript) and root_name(t) in names:
                    found.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


@pytest.mark.parametrize("script", sorted(SCRIPTS.glob("*.py")), ids=lambda p: p.name)
def test_no_script_patches_the_engine(script: Path):
    assert patches(script.read_text()) == []


# What the benchmarks did before (bench_common.StepTimer, bench_chunked_prefill,
# bench_serving): each is caught.
OLD_PATCHES = {
    "module global": """
import jaxserve.runtime.model_runner as mr
setattr(mr, "_step", lambda *a: None)
""",
    "module global, from-import": """
from jaxserve.runtime import model_runner
model_runner.replicate = print
""",
    "scheduler method": """
def wrap(engine):
    core = engine.core
    for s in core.schedulers:
        s.schedule = timed(s.schedule)
""",
    "runner's batch": """
class StepTimer:
    def __init__(self, engine):
        for worker in engine.core.executor.workers:
            runner = worker.runner
            runner.batch.append_sampled = self._timed(runner.batch.append_sampled)
""",
    "scheduler config": """
engine = make_engine("m", precompile=True)
scheduler_config = engine.core.scheduler.config
for t in (0, 64):
    scheduler_config.long_prefill_token_threshold = t
""",
    "augmented, through a dict of engines": """
engines = {mode: make_engine("m", async_scheduling=mode) for mode in (False, True)}
engines[False].core.num_steps += 1
""",
    "engine step": """
from jaxserve.engine.llm_engine import LLMEngine
e = LLMEngine.from_engine_args(model="m")
e.core.step = timed("core", e.core.step)
proc = e.output_processor
proc.process_outputs = timed("output", proc.process_outputs)
""",
}


@pytest.mark.parametrize("name", OLD_PATCHES)
def test_the_check_catches_a_patch(name: str):
    assert patches(OLD_PATCHES[name])


def test_reading_the_engine_is_not_a_patch():
    assert patches("""
engine = make_engine("m")
before = engine.stats().step_seconds
rows = []
rows.append(engine.core.executor.worker.runner.time_last_step(5))
totals = {}
totals["step"] = 1.0
""") == []
