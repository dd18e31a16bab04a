"""One-shot re-layout for issue 48: jaxserve's folders become its layers.

Moves every module by a table (and a default rule for modules the table does not name), then
rewrites each reference to a moved module in the tracked text files: dotted names
(`jaxserve.executor.worker`, also inside strings such as monkeypatch targets), imports of a
module from its old package (`from jaxserve.executor import worker`), and paths
(`jaxserve/executor/worker.py`, `executor/worker.py`, `pallas_kernels/cpu_native.py`). It then
points tests/test_import_graph.py's layers at the new packages and pyproject.toml at the moved
C++ sources. Run it once, from the repository root of a clean tree, then delete it:

    python scripts/relayout.py
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import textwrap
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# jaxserve/executor/, by layer. An executor module not named here goes to the runtime.
EXECUTOR = {
    # The host-side chain one step runs through: engine -> executor -> worker -> model runner,
    # and the compiled programs it loads at start.
    "runtime": ("executor", "worker", "model_runner", "compiled_dir", "program_order"),
    # The jitted device programs, their inputs' shapes and the step arrays they take.
    "programs": ("device_step", "step_program", "spec_verify", "device_drafts", "draft_model",
                 "prompt_logprobs", "packing", "step_shapes", "input_batch", "drafter",
                 "spec_step"),
    # Where arrays live: the mesh, sharding, the KV pool, memory, and the facts fixed at start.
    "placement": ("mesh", "sharding", "kv_blocks", "huge_pages", "device_memory",
                  "host_memory", "targets", "resolved"),
    # Offline tools above the runtime: AOT builds, the compile check and its cost model.
    "compilation": ("aot", "compile_check", "compile_report", "step_cost", "step_floor",
                    "hlo_text"),
}
DEFAULT_EXECUTOR_PACKAGE = "runtime"

# pallas_kernels/ -> jaxserve/kernels/<family>/. A file not named here goes by its name:
# cpu_X -> cpu/X, xla_X -> xla/X, X_tpu -> tpu/X, X_gpu -> gpu/X, else the kernels' top.
KERNELS = {
    "ragged_paged_attention_tpu.py": "tpu/ragged_paged_attention.py",
    "ragged_paged_attention_gpu.py": "gpu/ragged_paged_attention.py",
}
KERNEL_FAMILIES = ("tpu", "gpu", "cpu", "xla")

# Top-level config modules -> jaxserve/config/ (config.py becomes the package's __init__, so
# `from jaxserve.config import EngineConfig` stays as it is). default_model.py stays: it finds
# the bundled model beside itself.
CONFIG = {
    "config.py": "config/__init__.py",
    "disaggregation_config.py": "config/disaggregation.py",
    "speculative_config.py": "config/speculative.py",
    "vllm_args.py": "config/vllm_args.py",
}

PACKAGE_DOCS = {
    "jaxserve/runtime": "The host side of a step: executor, worker and model runner, which "
                        "call the jitted programs.",
    "jaxserve/programs": "The jitted device programs (the model step, drafting, verification) "
                         "and the shapes and arrays they are compiled for.",
    "jaxserve/placement": "Where arrays live: the device mesh, sharding, the KV pool and its "
                          "memory, compile targets, and the facts resolved once at start.",
    "jaxserve/compilation": "Offline tools: ahead-of-time builds, the compile check, and the "
                            "step's cost model read from the compiled HLO.",
    "jaxserve/kernels/tpu": "Ragged paged attention for TPU (Pallas, Mosaic).",
    "jaxserve/kernels/gpu": "Ragged paged attention for GPU (Pallas, Triton).",
    "jaxserve/kernels/cpu": "The CPU's native kernels: C++ through the XLA FFI.",
    "jaxserve/kernels/xla": "Attention in plain JAX, lowered by XLA on any platform.",
    "jaxserve/entrypoints/cli": "The `jaxserve` command and its subcommands.",
}

TEXT_SUFFIXES = {".py", ".toml", ".md", ".sh", ".yaml", ".yml", ".json", ".cc", ".h", ".cfg",
                 ".txt", ".ini"}
SKIP_DIRS = ("results/compile_check/",)  # recorded compiler outputs, not references


def kernel_target(name: str) -> str:
    if name in KERNELS:
        return KERNELS[name]
    stem, dot, ext = name.partition(".")
    for family in KERNEL_FAMILIES:
        if stem.startswith(family + "_"):
            return f"{family}/{stem[len(family) + 1:]}{dot}{ext}"
        if stem.endswith("_" + family):
            return f"{family}/{stem[:-len(family) - 1]}{dot}{ext}"
    return name


def tracked(pattern: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return out.split()


def plan() -> dict[str, str]:
    """Old path -> new path, for every file that moves."""
    moves: dict[str, str] = {}
    where = {m: pkg for pkg, mods in EXECUTOR.items() for m in mods}
    for path in tracked("jaxserve/executor/*.py"):
        stem = Path(path).stem
        if stem == "__init__":
            if (ROOT / path).read_text().strip():
                sys.exit(f"{path} is not empty: give its contents a home first")
            continue
        if stem not in where:
            print(f"  (default rule) {path} -> jaxserve/{DEFAULT_EXECUTOR_PACKAGE}/")
        moves[path] = f"jaxserve/{where.get(stem, DEFAULT_EXECUTOR_PACKAGE)}/{stem}.py"
    for path in tracked("pallas_kernels/*"):
        moves[path] = "jaxserve/kernels/" + kernel_target(Path(path).name)
    for path in tracked("jaxserve/entrypoints/*.py"):
        name = Path(path).name
        if name == "cli.py":
            moves[path] = "jaxserve/entrypoints/cli/main.py"
        elif name == "cli_args.py":
            moves[path] = "jaxserve/entrypoints/cli/args.py"
        elif name.endswith("_cli.py"):
            moves[path] = f"jaxserve/entrypoints/cli/{name[:-len('_cli.py')]}.py"
    for old, new in CONFIG.items():
        if (ROOT / "jaxserve" / old).exists():
            moves[f"jaxserve/{old}"] = f"jaxserve/{new}"
    return moves


def module_of(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_map(moves: dict[str, str]) -> dict[str, str]:
    """Old dotted module -> new, for the moved modules that change name."""
    pairs = {module_of(o): module_of(n) for o, n in moves.items() if o.endswith(".py")}
    return {o: n for o, n in pairs.items() if o != n}


def package_exports(path: Path) -> set[str]:
    """The names a package's __init__ lists in __all__: `from pkg import name` means the
    export, not a submodule of that name."""
    if not path.exists():
        return set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def path_map(moves: dict[str, str]) -> dict[str, str]:
    """Old path -> new path as text may write it: from the repository root, from inside
    jaxserve/ (`executor/worker.py`), and a kernel by its bare file name (`cpu_native.py`;
    a C++ file keeps its folder, so `#include "cpu_vector.h"` becomes `"vector.h"`)."""
    out: dict[str, str] = {}
    for old, new in moves.items():
        out[old] = new
        if old.startswith("jaxserve/") and old.count("/") > 1:
            out[old.removeprefix("jaxserve/")] = new.removeprefix("jaxserve/")
        if old.startswith("pallas_kernels/") and old != "pallas_kernels/__init__.py":
            inside = new.removeprefix("jaxserve/kernels/")
            out[old.removeprefix("pallas_kernels/")] = (
                inside if old.endswith(".py") else Path(inside).name)
    return {o: n for o, n in out.items() if o != n}


def alternation(keys: list[str]) -> str:
    return "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))


IMPORT_NAME = re.compile(r"(\w+)(?:\s+as\s+(\w+))?")


def rewrite_package_imports(text: str, modules: dict[str, str],
                            exports: dict[str, set[str]]) -> str:
    """`from old.pkg import a, b as c` where a or b moved: one import per new parent."""
    packages = sorted({m.rpartition(".")[0] for m in modules if "." in m})
    pattern = re.compile(r"^([ \t]*)from (" + alternation(packages) +
                         r") import (\([^)]*\)|[^\n]*)", re.M)

    def replace(match: re.Match[str]) -> str:
        indent, package, names = match.groups()
        if names.startswith("("):
            names, comment = re.sub(r"#[^\n]*", "", names.strip("()")), ""
        else:
            names, _, comment = names.partition("#")
            comment = f"  # {comment.strip()}" if comment.strip() else ""
        pairs = IMPORT_NAME.findall(names)
        if not any(f"{package}.{name}" in modules for name, _ in pairs):
            return match.group(0)
        groups: dict[str, list[str]] = {}
        for name, alias in pairs:
            old = f"{package}.{name}"
            if old in modules and name not in exports.get(package, set()):
                parent, _, leaf = modules[old].rpartition(".")
            else:
                parent, leaf = modules.get(package, package), name
            alias = alias or name
            groups.setdefault(parent, []).append(leaf if alias == leaf else f"{leaf} as {alias}")
        lines = []
        for parent, items in groups.items():
            line = f"{indent}from {parent} import {', '.join(items)}{comment}"
            if len(line) > 99:
                inner = "".join(f"{indent}    {item},\n" for item in items)
                line = f"{indent}from {parent} import ({comment}\n{inner}{indent})"
            lines.append(line)
        return "\n".join(lines)

    return pattern.sub(replace, text)


def expand_braces(match: re.Match[str], paths: dict[str, str]) -> str:
    """`jaxserve/executor/{worker,mesh}.py`: each file to its new folder, one brace group per
    folder (inside backticks, one span per folder)."""
    folder, names = match.groups()
    groups: dict[str, list[str]] = {}
    for name in names.split(","):
        new = paths.get(f"{folder}/{name}.py", f"{folder}/{name}.py")
        groups.setdefault(str(Path(new).parent), []).append(Path(new).stem)
    quoted = match.string[match.start() - 1:match.start()] == "`"
    return ("`, `" if quoted else ", ").join(
        f"{d}/{{{','.join(s)}}}.py" if len(s) > 1 else f"{d}/{s[0]}.py"
        for d, s in groups.items())


def realign_imports(text: str, modules: dict[str, str]) -> str:
    """`from old.module import (a,\n<aligned> b)`: the continuation lines follow the paren
    when the module's name changes length."""
    pattern = re.compile(r"^([ \t]*from )(" + alternation(list(modules)) +
                         r")( import \()([^)]*\))", re.M)

    def replace(match: re.Match[str]) -> str:
        start, module, middle, body = match.groups()
        old_col = len(start + module + middle)
        shift = len(modules[module]) - len(module)
        lines = body.split("\n")
        lines[1:] = [" " * (old_col + shift) + line.lstrip()
                     if len(line) - len(line.lstrip()) == old_col else line
                     for line in lines[1:]]
        return start + module + middle + "\n".join(lines)

    return pattern.sub(replace, text)


def sort_project_imports(text: str) -> str:
    """Each run of jaxserve imports at one indentation, in module order again."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        run: list[tuple[str, list[str]]] = []
        indent = re.match(r"[ \t]*", lines[i]).group(0)
        while i < len(lines) and re.match(indent + r"(from|import) jaxserve[\w.]* ", lines[i]):
            statement = [lines[i]]
            depth = lines[i].count("(") - lines[i].count(")")
            i += 1
            while depth > 0 and i < len(lines):
                statement.append(lines[i])
                depth += lines[i].count("(") - lines[i].count(")")
                i += 1
            if len(statement) == 1 and len(statement[0]) > 99 and " import " in statement[0]:
                head, _, names = statement[0].partition(" import ")
                statement = [f"{head} import ("] + [
                    f"{indent}    {n.strip()}," for n in names.split(",")] + [f"{indent})"]
            run.append((statement[0].split()[1], statement))
        if run:
            out += [line for _, statement in sorted(run, key=lambda s: s[0])
                    for line in statement]
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


def rewrite(text: str, modules: dict[str, str], paths: dict[str, str],
            exports: dict[str, set[str]]) -> str:
    text = realign_imports(rewrite_package_imports(text, modules, exports), modules)
    text = re.sub(r"(?<![\w/.-])(" + alternation(list(paths)) + r")(?![\w])",
                  lambda m: paths[m.group(1)], text)
    text = re.sub(r"(?<![\w/.-])((?:jaxserve/)?[\w/]+)/\{([\w,]+)\}\.py",
                  lambda m: expand_braces(m, paths), text)
    text = re.sub(r"(?<![\w/.-])pallas_kernels/", "jaxserve/kernels/", text)
    return re.sub(r"(?<![\w.])(" + alternation(list(modules)) + r")(?![\w/])",
                  lambda m: modules[m.group(1)], text)


def wrap(items: list[str], first: str, indent: int, last: str) -> str:
    """`first` + items joined by ", ", broken into lines of at most 99 characters."""
    lines, line = [], first
    for i, item in enumerate(items):
        piece = item + (last if i == len(items) - 1 else ",")
        if len(line) + len(piece) + 1 > 99 and line.strip():
            lines.append(line)
            line = " " * indent + piece
        else:
            line += ("" if line == first else " ") + piece
    return "\n".join([*lines, line])


NEW_UNITS = {  # the executor's units, in order, each with the units directly below it
    "jaxserve.compilation": ("jaxserve.runtime",),
    "jaxserve.runtime": ("jaxserve.programs", "jaxserve.core"),
    "jaxserve.programs": ("jaxserve.placement", "jaxserve.core"),
    "jaxserve.placement": ("jaxserve.models",),
}
NEW_UNIT_COMMENTS = {
    "jaxserve.compilation": "AOT builds through a worker",
}


def layers_source(block: str) -> str:
    """LAYERS with jaxserve.executor split into its four units, pallas_kernels as
    jaxserve.kernels and the config modules as the one jaxserve.config; comments kept."""
    rename = {"pallas_kernels": "jaxserve.kernels",
              **{f"jaxserve.{c.removesuffix('.py')}": "jaxserve.config" for c in CONFIG}}
    layers = ast.literal_eval(block[block.index("{"):])
    before: dict[str, list[str]] = {}
    after: dict[str, str] = {}
    pending: list[str] = []
    unit = ""
    for line in block.splitlines()[1:]:
        if line.strip().startswith("#"):
            pending.append(line.strip())
            continue
        m = re.match(r'\s*"([\w.]+)":', line)
        if m:
            unit = m.group(1)
            before[unit], pending = pending, []
        if "#" in line:
            after[unit] = line.split("#", 1)[1].strip()
    after.update(NEW_UNIT_COMMENTS)
    new: dict[str, list[str]] = {}
    for unit, lowers in layers.items():
        if unit == "jaxserve.executor":
            new.update({u: list(v) for u, v in NEW_UNITS.items()})
            before.update({u: before.get(unit, []) for u in NEW_UNITS})
            continue
        lows = new.setdefault(rename.get(unit, unit), [])
        for lower in lowers:
            lower = rename.get(lower, "jaxserve.runtime" if lower == "jaxserve.executor"
                               else lower)
            if lower != rename.get(unit, unit) and lower not in lows:
                lows.append(lower)
    new["jaxserve.entrypoints"].append("jaxserve.compilation")
    lines = ["LAYERS: dict[str, tuple[str, ...]] = {"]
    for unit, lowers in new.items():
        olds = [u for u, r in rename.items() if r == unit] + [unit]
        lines += [f"    {c}" for old in olds for c in before.get(old, [])]
        first = f'    "{unit}": ('
        entry = wrap([f'"{x}"' for x in lowers] or [""], first, len(first),
                     ("," if len(lowers) == 1 else "") + "),")
        comment = next((after[o] for o in olds if o in after), "")
        if comment and len(entry.splitlines()[-1]) + len(comment) + 4 <= 99:
            entry += f"  # {comment}"
        lines.append(entry)
    return "\n".join(lines) + "\n}"


def update_import_graph_test(path: Path) -> None:
    """The layers become the new packages; pallas_kernels is no longer a unit of its own."""
    text = path.read_text()
    block = re.search(r"^LAYERS: dict\[str, tuple\[str, \.\.\.\]\] = \{.*?^\}", text,
                      re.M | re.S).group(0)
    text = text.replace(block, layers_source(block))
    device = re.search(r"^DEVICE_UNITS = (\{.*?\})", text, re.M | re.S)
    units = ast.literal_eval(device.group(1)) - {"jaxserve.executor", "pallas_kernels"} | {
        *NEW_UNITS, "jaxserve.kernels"}
    first = "DEVICE_UNITS = {"
    text = text.replace(device.group(0),
                        wrap([f'"{u}"' for u in sorted(units)], first, len(first), "}"))
    for old, new in (
            ("Units are jaxserve's subpackages, its top-level modules and `pallas_kernels`.",
             "Units are jaxserve's subpackages and its top-level modules."),
            ('    if parts[0] == "pallas_kernels":\n        return "pallas_kernels"\n', ""),
            ('if m.split(".")[0] in ("jaxserve", "pallas_kernels")}',
             'if m.split(".")[0] == "jaxserve"}'),
            ('files = sorted([*ROOT.glob("jaxserve/**/*.py"), '
             '*ROOT.glob("pallas_kernels/**/*.py")])',
             'files = sorted(ROOT.glob("jaxserve/**/*.py"))')):
        if old not in text:
            print(f"  WARNING: {path.name}: did not find {old!r}; check it by hand")
        text = text.replace(old, new)
    path.write_text(text)


def update_pyproject(path: Path, moves: dict[str, str]) -> None:
    """pallas_kernels is no package of its own now; its C++ sources ship as package data of
    the folder they moved to."""
    text = path.read_text()
    text = text.replace(', "pallas_kernels*"]', "]")
    folders = sorted({str(Path(n).parent) for o, n in moves.items()
                      if Path(o).suffix in (".cc", ".h")})
    data = "\n".join(f'"{f.replace("/", ".")}" = ["*.cc", "*.h"]' for f in folders)
    text, found = re.subn(r"^pallas_kernels = \[[^\]]*\]", data, text, flags=re.M)
    if not found:
        print(f"  WARNING: {path.name}: no pallas_kernels package-data line; check it by hand")
    path.write_text(text)


def main() -> None:
    if subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                      text=True, check=True).stdout.strip():
        sys.exit("the tree has uncommitted changes: commit or stash them first")
    moves = plan()
    modules = module_map(moves)
    paths = path_map(moves)
    exports = {"pallas_kernels": package_exports(ROOT / "pallas_kernels/__init__.py")}

    # Text first, while the old tree still names the files; scripts/relayout.py keeps its
    # table as written.
    update_import_graph_test(ROOT / "tests/test_import_graph.py")
    update_pyproject(ROOT / "pyproject.toml", moves)
    changed = []
    long_lines: dict[str, list[int]] = {}
    for name in tracked("."):
        path = ROOT / name
        if (path.suffix not in TEXT_SUFFIXES and not name.startswith(".ci/")) or \
                name.startswith(SKIP_DIRS) or name == "scripts/relayout.py" or \
                not path.is_file():
            continue
        text = path.read_text()
        new = rewrite(text, modules, paths, exports)
        if path.suffix == ".py" and new != text:
            new = sort_project_imports(new)
        if new != text:
            path.write_text(new)
            changed.append(name)
            if path.suffix == ".py":
                long_lines[name] = [n for n, line in enumerate(new.splitlines(), 1)
                                    if len(line) > 100]

    for old, new in moves.items():
        (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", old, new], cwd=ROOT, check=True)
        print(f"  git mv {old} -> {new}")
    if (ROOT / "jaxserve/executor/__init__.py").exists():
        subprocess.run(["git", "rm", "-q", "jaxserve/executor/__init__.py"], cwd=ROOT,
                       check=True)
    for folder in ("jaxserve/executor", "pallas_kernels"):  # left holding only bytecode
        if (ROOT / folder).is_dir() and not tracked(folder):
            shutil.rmtree(ROOT / folder)
    for folder, doc in PACKAGE_DOCS.items():
        init = ROOT / folder / "__init__.py"
        if (ROOT / folder).is_dir() and not init.exists():
            init.write_text('"""' + textwrap.fill(doc + '"""', 96) + "\n")
            print(f"  created {folder}/__init__.py")
    subprocess.run(["git", "add", "-A", "."], cwd=ROOT, check=True)

    print(f"moved {len(moves)} files; rewrote references in {len(changed)} files:")
    for name in changed:
        print(f"  {name}")
        if long_lines.get(name):
            print(f"    lines over 100 characters now: {long_lines[name]}")
    stale = subprocess.run(["git", "grep", "-n", "-E",
                            r"jaxserve[./]executor|(^|[^_[:alnum:]])pallas_kernels",
                            "--", ".", ":!results/compile_check", ":!scripts/relayout.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    if stale:
        print("references left to the old folders (check these by hand):\n" + stale)


if __name__ == "__main__":
    main()
