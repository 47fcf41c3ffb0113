"""The package's shape, read from the source (nothing imported): the run's stages as sub-packages in run order, each
importing only the ground and earlier stages; no import circle, imports inside functions included; a few orchestration
modules flat in dpotrain/; no function longer than a reader holds in mind (docs/architecture.md)."""

import ast
import re
from pathlib import Path

from conftest import ROOT, parse_once, walk_once

PACKAGE = ROOT / "dpotrain"
# The stages in run order: a module may import its own stage and earlier ones. The flat modules orchestrate the run
# (dpotrain/stages.py and its second half) and may import any stage; no stage imports them.
ORDER = ["recipe", "data", "cluster", "forwards", "plan", "reference", "train", "hub"]
MOST_FLAT = 8
LONGEST = 80


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The package's modules `name` imports, anywhere in its file (a function's import counts)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in walk_once(parse_once(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def stage(name: str) -> int:
    """The module's place in ORDER; flat modules come after every stage."""
    parts = name.split(".")
    return ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in ORDER else len(ORDER)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_sub_package_is_a_stage_and_few_modules_are_flat():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ORDER), packages
    flat = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(flat) <= MOST_FLAT, flat


def test_no_stage_imports_a_later_stage_or_the_orchestration():
    """An earlier stage never needs a later one: data does not import plan, plan does not import train, no stage
    imports the flat modules that run the stages."""
    later = [(m, d) for m, deps in graph().items() for d in deps if stage(d) > stage(m) and d != "dpotrain"]
    assert not later, later


def test_no_import_circles():
    edges, circles = graph(), []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1 and not nxt.endswith(path[0].rpartition(".")[0]):
                circles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [node])
    # a package's __init__ that imports its own modules makes no circle of design
    circles = [c for c in circles if not any(m.count(".") == 1 and (PACKAGE / m.split(".")[1]).is_dir() for m in c)]
    assert not circles, circles


def test_no_function_longer_than_a_screen():
    long = []
    for path in [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py"]:
        for node in walk_once(parse_once(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
    assert not long, long


def _a_trainer(node) -> bool:
    """`trainer` or the stop it is given (`stop`, train_dpo.py's), or an object's `trainer` / `_trainer` (the reference
    stage's scorer holds one)."""
    return (isinstance(node, ast.Name) and node.id in ("trainer", "stop")) or (
        isinstance(node, ast.Attribute) and node.attr in ("trainer", "_trainer")
    )


def test_nothing_is_assigned_to_a_trainer_from_outside_its_class():
    """The trainer is built whole (`train_stage.build_run`): what it holds is made or given in its own `__init__` and
    changed only by its own methods (the reference stage's data sets: `use_reference`), never attached from outside;
    the benchmarks count what a trainer runs on with a subclass of it (benchmarks/throughput.py's `counted`)."""
    outside = []
    for path in [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py", *(ROOT / "benchmarks").glob("*.py")]:
        tree = parse_once(path.read_text())
        inside = {
            id(n) for c in walk_once(tree) if isinstance(c, ast.ClassDef) for n in walk_once(c) if "Trainer" in c.name
        }
        for node in walk_once(tree):
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or id(node) in inside:
                continue
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for part in walk_once(target):
                    if isinstance(part, ast.Attribute) and _a_trainer(part.value):
                        outside.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not outside, outside


def test_no_class_name_is_defined_twice():
    """One name per concept: a class name names one class in the package (the record's sections are `Recorded*`, the
    run's own are the specification's)."""
    where: dict[str, list[str]] = {}
    for path in [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py"]:
        for node in walk_once(parse_once(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not {name: places for name, places in where.items() if len(places) > 1}


def test_every_package_name_the_scripts_and_benchmarks_use_exists():
    """scripts/ and benchmarks/ run as programs, and most of them only in slow tests or on a GPU: a package name they
    use that a change removed (benchmarks/gpu_probe.py's `choice.import_problem`, inlined by a shrink) was found only
    when the lease's probe died. Every `from dpotrain... import NAME` and `MODULE.NAME` they use is checked here."""
    import importlib
    import types

    missing = []
    for path in sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        modules, tree = {}, parse_once(path.read_text())
        for node in walk_once(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpotrain"):
                parent = importlib.import_module(node.module)
                for alias in node.names:
                    found = getattr(parent, alias.name, None)
                    if found is None:
                        try:
                            found = importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
                    if isinstance(found, types.ModuleType):
                        modules[alias.asname or alias.name] = found
        for node in walk_once(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                if not hasattr(modules[node.value.id], node.attr):
                    missing.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not missing, missing


def test_a_count_and_its_noun_go_through_one_helper():
    """`errors.plural(n, "pair")`: the hand-written plural (`'s' * (n != 1)`, `(n > 1)`, `(str(n) != '1')`, `'s' if
    ... else ''`) was written 27 ways, and messages that had none read "1 warm-up steps" and "over 1 processes"."""
    idiom = re.compile(r"""['"]e?s['"]\s*\*\s*\(|['"]e?s['"] if [^'"]+ else ['"]['"]""")
    sources = [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py", *(ROOT / "scripts").glob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if idiom.search(line)
    ]
    assert not found, "write the count with dpotrain.recipe.errors.plural:\n" + "\n".join(found)


def test_a_warning_line_goes_through_one_helper():
    """`errors.warn(text)` writes `warning: text` in one flushed write: 20 hand-written `print("warning: ...",
    file=sys.stderr)` lines wrote it three ways (flushed or not, in one write or two), and a line written in parts runs
    into another rank's in a launch's shared log."""
    idiom = re.compile(r"""print\(\s*f?['"]warning:""")
    sources = [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py"]
    found = [  # over the whole text: a print( whose string starts on the next line too
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, hit.start()) + 1}"
        for path in [*sources, *(ROOT / "scripts").glob("*.py")]
        for text in [path.read_text()]
        for hit in idiom.finditer(text)
    ]
    assert not found, "write the warning with dpotrain.recipe.errors.warn:\n" + "\n".join(found)


def test_no_message_hedges_a_noun_with_s_in_parentheses():
    """ "3 epoch(s) planned", "checksummed by 1 process(es)", "column(s) not read": 26 strings in 14 modules wrote both
    numbers where the count was at hand (`errors.plural`), or a list's length (`plural(len(names), "column",
    count=False)`).
    Read from the string literals, f-strings' text included, not the docstrings or comments: code such as
    `loss_text(s)` is no message."""
    hedged = re.compile(r"[A-Za-z]\(e?s\)")
    sources = [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py", *(ROOT / "scripts").glob("*.py")]
    found = []
    for path in sources:
        tree = parse_once(path.read_text())
        documented = {
            id(node.body[0].value)
            for node in walk_once(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.strip()[:100]}"
            for node in walk_once(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in documented
            if hedged.search(node.value)
        ]
    assert not found, "count the noun with dpotrain.recipe.errors.plural:\n" + "\n".join(found)


def test_the_launchers_environment_is_read_in_one_module():
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (the launcher's) and GPUS_PER_NODE (the job's, a dry run's plan)
    are read by dpotrain/recipe/launcher.py alone: they were read in six modules, each with its own default and its own
    test of "under a launcher" (LOCAL_RANK set, or WORLD_SIZE over 1)."""
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GPUS_PER_NODE", "SLURM_PROCID", "SLURM_NTASKS"}
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}"
        for path in [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py", *(ROOT / "scripts").glob("*.py")]
        if path != PACKAGE / "recipe" / "launcher.py"
        for node in walk_once(parse_once(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not found, "read the launcher's environment through dpotrain.recipe.launcher:\n" + "\n".join(found)


def test_a_recipe_file_is_read_by_recipe_file_alone():
    """A recipe's YAML is read by dpotrain/recipe/recipe_file.py (strict: a key given twice refused, numbers as
    written); the prefetch command and the analyzer's search of configs/ each read recipes with PyYAML of their own."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in [*PACKAGE.rglob("*.py"), ROOT / "train_dpo.py", *(ROOT / "scripts").glob("*.py")]
        if path != PACKAGE / "recipe" / "recipe_file.py"
        for node in walk_once(parse_once(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if getattr(node.func.value, "id", None) == "yaml" and node.func.attr in ("load", "safe_load", "full_load")
    ]
    assert not found, "read a recipe through dpotrain.recipe.recipe_file:\n" + "\n".join(found)


def test_the_suite_command_keeps_the_order_conftest_gives_the_groups():
    """conftest's `_longest_groups_first` orders the groups each worker collects, the longest first, and xdist hands
    them out in that order only under `--no-loadscope-reorder`: without it xdist sorts them by number of tests and a
    worker runs on alone at the end, which nothing said (the suite passes, slower). scripts/test.sh's pytest line keeps
    the flag with `--dist loadgroup`, conftest still orders the groups, and the xdist installed still takes the flag."""
    import importlib.util
    import shlex

    (line,) = [line for line in (ROOT / "scripts" / "test.sh").read_text().splitlines() if " -m pytest " in line]
    words = shlex.split(line)
    assert words[words.index("--dist") + 1] == "loadgroup" and "--no-loadscope-reorder" in words, line
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "session.items[:] = _longest_groups_first(session.items)" in conftest
    xdist = Path(importlib.util.find_spec("xdist").origin).parent  # found, not imported
    assert '"--no-loadscope-reorder"' in (xdist / "plugin.py").read_text()
