"""The seam with TRL, transformers, accelerate, datasets and torch (dpotrain/recipe/upstream.py): every private name the
project touches is listed there and reached only through it, and an upgrade that moves one fails here by name."""

import ast
import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

from conftest import parse_once, walk_once
from dpotrain.recipe import upstream

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ("trl", "transformers", "accelerate", "deepspeed", "datasets", "torch", "peft", "huggingface_hub")
# Private names the standard library documents as public API.
DOCUMENTED = {"_exit"}  # os._exit
SEAM_FILE = ROOT / "dpotrain" / "recipe" / "upstream.py"
# The upstream classes whose private members the project could reach through `self`, an instance or `super()`.
CLASSES = (
    "trl.trainer.dpo_trainer:DPOTrainer",
    "accelerate.accelerator:Accelerator",
    "accelerate.state:GradientState",
    "transformers.configuration_utils:PretrainedConfig",
    "datasets.arrow_dataset:Dataset",
)


def project_sources():
    files = sorted((ROOT / "dpotrain").rglob("*.py")) + [ROOT / "train_dpo.py"]
    return [(f, parse_once(f.read_text())) for f in files if f != SEAM_FILE]


def upstream_private_names() -> set[str]:
    """Private methods and instance attributes of the upstream classes (and their bases)."""
    names = set()
    for symbol in CLASSES:
        module, _, name = symbol.partition(":")
        for klass in inspect.getmro(getattr(importlib.import_module(module), name)):
            if klass is object or klass.__module__.split(".")[0] not in UPSTREAM:
                continue
            names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            for node in ast.walk(ast.parse(source)):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                    and isinstance(node.ctx, ast.Store)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                ):
                    names.add(node.attr)
    return names


def upstream_imports(tree) -> set[str]:
    return {
        a.asname or a.name
        for n in walk_once(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in UPSTREAM
        for a in n.names
    }


def upstream_subclasses(tree) -> set[str]:
    """The classes of a module that derive from an upstream class."""
    imported = upstream_imports(tree)
    return {
        c.name
        for c in walk_once(tree)
        if isinstance(c, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in imported for b in c.bases)
    }


def own_private_names(sources) -> set[str]:
    """Private names the project's own classes define (not subclasses of an upstream class): reading them is no seam."""
    names = set()
    for _, tree in sources:
        subclasses = upstream_subclasses(tree)  # once a module: it walks the whole tree
        for cls in (n for n in walk_once(tree) if isinstance(n, ast.ClassDef)):
            if cls.name in subclasses:
                continue
            for node in walk_once(cls):
                if isinstance(node, ast.FunctionDef):
                    names.add(node.name)
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return names


@pytest.mark.parametrize("seam", upstream.SEAMS, ids=lambda s: s.symbol)
def test_every_seam_is_where_the_project_expects_it(seam):
    upstream.verify(seam)  # raises SeamMoved naming the symbol, how it is used and why


@pytest.mark.parametrize(
    "seam, says",
    [
        (
            upstream.Seam("trl.trainer.dpo_trainer:DPOTrainer._compute_loss_v2", "override", "a renamed method"),
            "no longer exists",
        ),
        (
            upstream.Seam(
                "trl.trainer.dpo_trainer:DPOTrainer._compute_loss",
                "override",
                "a changed signature",
                ("model", "batch", "return_outputs"),
            ),
            "takes (model, inputs, return_outputs)",
        ),
        (upstream.Seam("trl.data_utils_v2:_tokenize", "call", "a moved module"), "cannot be imported"),
        (
            upstream.Seam(
                "trl.trainer.dpo_trainer:DPOTrainer.no_such_flag",
                "set",
                "an attribute no longer read",
                read_in="trl.trainer.dpo_trainer:DPOTrainer._compute_loss",
            ),
            "no longer exists",
        ),
        (
            upstream.Seam(
                "trl.trainer.dpo_trainer:DPOTrainer.beta",
                "set",
                "an attribute no longer read",
                read_in="trl.trainer.dpo_trainer:DPOTrainer._precompute_ref_logps",
            ),
            "is no longer read by",
        ),
    ],
)
def test_a_moved_seam_fails_naming_the_symbol_and_why(seam, says):
    with pytest.raises(upstream.SeamMoved) as raised:
        upstream.verify(seam)
    assert seam.symbol in str(raised.value) and says in str(raised.value) and seam.why in str(raised.value)


@pytest.mark.slow  # 5-9 s on 2 cores: past the fast tier's ~2 s per test
def test_no_private_member_of_an_upstream_class_is_reached_outside_the_seam():
    sources = project_sources()
    private = upstream_private_names() - own_private_names(sources)
    overrides = {s.symbol.rpartition(".")[2] for s in upstream.SEAMS if s.kind == "override"}
    found = []
    for path, tree in sources:
        subclasses = upstream_subclasses(tree)
        for cls in (n for n in walk_once(tree) if isinstance(n, ast.ClassDef) and n.name in subclasses):
            for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                if method.name in private and method.name not in overrides:
                    found.append(
                        f"{path.relative_to(ROOT)}:{method.lineno}: {cls.name}.{method.name} overrides a "
                        "private upstream method: list it as an override seam"
                    )
        for node in walk_once(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr in private:
                is_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "super"
                if not (is_super and node.attr in overrides):
                    found.append(f"{where}: {ast.unparse(node)}")
    assert not found, "reach these through dpotrain/recipe/upstream.py (a Seam and an accessor):\n" + "\n".join(found)


def test_no_upstream_module_name_is_replaced_outside_the_seam():
    """A monkeypatch of an upstream module (`dpo.create_model_from_path = ...`) goes through `upstream.patched`."""
    found = []
    for path, tree in project_sources():
        modules = set()
        for node in walk_once(tree):
            if isinstance(node, ast.Import):
                modules |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in UPSTREAM}
        for node in walk_once(tree):
            for target in node.targets if isinstance(node, ast.Assign) else []:
                owner = target.value if isinstance(target, ast.Attribute) else None
                if isinstance(owner, ast.Name) and owner.id in modules:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)} = ...")
    assert not found, (
        "replace upstream names with dpotrain/recipe/upstream.py's `patched` (a `patch` Seam):\n" + "\n".join(found)
    )


def test_check_reports_every_moved_seam_at_once(monkeypatch):
    moved = (
        upstream.Seam("trl.data_utils:_tokenize_v2", "call", "one"),
        upstream.Seam("trl.trainer.utils:_NO_SUCH_CONSTANT", "read", "two"),
    )
    # Beside one seam that holds: not every seam again, whose check reads the sources of their classes (~1.5 CPU-s),
    # which test_check_reports_the_seams_checked does
    monkeypatch.setattr(upstream, "SEAMS", (upstream.TOKENIZE, *moved))
    with pytest.raises(SystemExit) as raised:
        upstream.check()
    assert "trl.data_utils:_tokenize_v2" in str(raised.value) and "_NO_SUCH_CONSTANT" in str(raised.value)


def test_patched_restores_the_upstream_name_after_an_error():
    import trl.trainer.dpo_trainer as dpo

    original = dpo.disable_gradient_checkpointing
    with pytest.raises(KeyError):
        with upstream.patched(upstream.DISABLE_CHECKPOINTING, None) as saved:
            assert dpo.disable_gradient_checkpointing is None and saved is original
            raise KeyError
    assert dpo.disable_gradient_checkpointing is original


def private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def defined_names(sources) -> set[str]:
    """Every name the project defines: functions, classes, variables, attributes set on `self`/`cls`."""
    names = set()
    for _, tree in sources:
        for node in walk_once(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return names


def foreign_private_names(tree, own: set[str]) -> list[tuple[int, str]]:
    """Where a module reaches a private name the project does not define: an attribute, a string given to
    getattr/hasattr/setattr/delattr, a private module imported, a patch target, or upstream source read as text. A
    patch of a dict's items (`mock.patch.dict(os.environ, ...)`, the project's environment patches) names none."""
    found = []
    dict_patches = {id(n.value) for n in walk_once(tree) if isinstance(n, ast.Attribute) and n.attr == "dict"}
    for node in walk_once(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own | DOCUMENTED:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr in ("getsource", "patch", "patch_object"):
            if id(node) in dict_patches:
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
            "setattr",
            "delattr",
        ):
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if private(name) and name not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) or isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get":
            # a private key of an upstream file or dict (datasets' state.json: "_data_files")
            key = node.slice if isinstance(node, ast.Subscript) else (node.args or [None])[0]
            if isinstance(key, ast.Constant) and private(key.value) and key.value not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(private(part) for m in modules for part in m.split(".")) or any(
                private(n) and n not in own for n in names
            ):
                found.append((node.lineno, ast.unparse(node)))
    return found


@pytest.mark.parametrize(
    "code",
    [
        "model._supports_sdpa",
        "getattr(config, '_name_or_path', '')",
        "import torch._dynamo.config",
        "from torch._subclasses.fake_tensor import FakeTensorMode",
        "from trl.data_utils import _tokenize",
        "mock.patch('transformers.training_args.is_torch_bf16_gpu_available', return_value=True)",
        "inspect.getsource(module)",
        "json.loads(text).get('_data_files')",
        "state['_data_files']",
    ],
)
def test_the_private_name_walk_finds_each_kind(code):
    assert foreign_private_names(ast.parse(code), set()), code


def test_an_environment_patch_is_no_patch_target():
    assert not foreign_private_names(ast.parse('mock.patch.dict(os.environ, TOKENIZERS_PARALLELISM="false")'), set())
    assert foreign_private_names(ast.parse('mock.patch.object(os, "environ", {})'), set())


def test_no_private_name_outside_the_project_is_reached_outside_the_seam():
    """Not only the classes above: any private name the project does not define itself (transformers, DeepSpeed,
    torch, tqdm, argparse...), in any spelling, is reached through dpotrain/recipe/upstream.py."""
    sources = project_sources() + [(f, parse_once(f.read_text())) for f in sorted((ROOT / "scripts").glob("*.py"))]
    own = defined_names(sources)
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path, tree in sources
        for line, text in foreign_private_names(tree, own)
    ]
    assert not found, "reach these through dpotrain/recipe/upstream.py (a Seam and an accessor):\n" + "\n".join(found)


# How an accessor reaches a seam's name: given the Seam, never the name written again
REACHES = ("_value", "_member", "_lookup", "patched")


def test_the_seam_writes_each_private_name_once_and_its_accessors_read_it_from_the_table():
    """A seam's name is written once, in `SEAMS`; its accessor reads it from the Seam (`_value(TOKENIZE)`,
    `_member(trainer, TRL_METRICS)`), so `upstream.check()` verifies the very name the code uses: an accessor that
    wrote `"torch._dynamo:config"` again passed check() while reading another name, when the two differed."""
    sources = [(SEAM_FILE, parse_once(SEAM_FILE.read_text()))] + project_sources()
    written = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path, tree in sources[:1]
        for line, text in foreign_private_names(tree, defined_names(sources[:1]))
        if re.search(r"\b_[A-Za-z]", text)
    ]
    written += [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path, tree in sources
        for node in walk_once(tree)
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in REACHES
        and node.args
        and isinstance(node.args[0], ast.Constant | ast.JoinedStr)
    ]
    assert not written, "name the Seam (NAME = _call(...)) and reach it through it:\n" + "\n".join(written)


def test_every_named_seam_is_checked():
    named = [name for name, value in vars(upstream).items() if isinstance(value, upstream.Seam)]
    assert named and all(getattr(upstream, name) in upstream.SEAMS for name in named)
    assert len(set(upstream.SEAMS)) == len(upstream.SEAMS)  # listed once each


def test_check_reports_the_seams_checked(capsys):
    upstream.check()  # raises SystemExit naming every moved seam
    assert f"upstream: {len(upstream.SEAMS)} seams checked" in capsys.readouterr().out


def test_an_attribute_set_for_a_block_leaves_nothing_behind():
    """`attributes_set` on a method of the object's class (the trainer's save_model, DeepSpeed's save_checkpoint, for
    one checkpoint): after the block the class's method answers again, not a bound copy left in the object."""

    class Saver:
        def save(self):
            return "class"

    saver, module = Saver(), types.ModuleType("m")
    module.timeout = 1
    with upstream.attributes_set(saver, save=lambda: "held"), upstream.attributes_set(module, timeout=2):
        assert saver.save() == "held" and module.timeout == 2
    assert "save" not in vars(saver) and saver.save() == "class"
    assert module.timeout == 1
