"""The README's quickstart works as written, and no page of the README or docs/ points outside the repository."""

import importlib.util
import re
import shlex
import shutil
import subprocess

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages other branches write (data shapes, attention kernels): linked from the README before they land here.
ELSEWHERE = {"docs/data.md", "docs/attention.md"}


def readme_block(after: str) -> list[str]:
    """The command lines of the README's first bash block after `after`, without comments."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(after) :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def quickstart() -> list[str]:
    return readme_block("## Quickstart")


NEXT = "Then, on the cluster"  # the block after the quickstart: instruct, the Hub push, W&B


def test_the_commands_after_the_quickstart_name_scripts_and_flags_that_exist(capsys):
    """The instruct submission, the push at the end of a job, push_to_hub.py afterwards and `wandb sync`, as a user
    pastes them: each line parses, names files of the project, and its train_dpo.py flags are taken by the recipe
    its sbatch script runs; push_to_hub.py's flags are its own."""
    from dpotrain.recipe.config import parse_args

    spec = importlib.util.spec_from_file_location("push_to_hub", ROOT / "scripts" / "push_to_hub.py")
    push_to_hub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(push_to_hub)
    lines = readme_block(NEXT)
    scripts = {"scripts/dpo_train.sh": "think", "scripts/dpo_instruct_train.sh": "instruct"}
    assert sorted(w for line in lines for w in shlex.split(line) if w in scripts) == sorted(scripts), lines
    for line in lines:
        assert subprocess.run(["bash", "-n", "-c", line]).returncode == 0, line
        words = shlex.split(line)
        for word in words:
            if re.match(r"^(scripts|configs|data)/", word):
                assert (ROOT / word).exists(), (line, word)
        if words[0] == "sbatch":
            script = next(w for w in words if w in scripts)
            flags = words[words.index(script) + 1 :]
            # --bf16 false: this machine has no GPU (the recipes train in bf16), which the flags do not depend on
            parse_args(["--config", str(ROOT / "configs" / f"{scripts[script]}.yaml"), "--bf16", "false", *flags])
        elif "scripts/push_to_hub.py" in words:
            with pytest.raises(SystemExit):
                push_to_hub.main(["--help"])
            usage = capsys.readouterr().out
            given = [w for w in words if w.startswith("--")]
            assert given and all(re.search(rf"{flag}(?![\w-])", usage) for flag in given), given
        else:
            assert words[:2] == ["wandb", "sync"], line


def script_help(name: str, capsys) -> str:
    """`scripts/<name>.py --help`, as a user reads it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit):
        script.main(["--help"])
    return capsys.readouterr().out


def test_every_flag_the_pages_give_prefetch_is_named_by_its_help(capsys):
    """The README's step 4 fetches a model's config with `prefetch.py --config ... --model_name_or_path ...`, and its
    --help listed --config, --split and --revision alone: a user checking it took the model for the recipe's only.
    Each flag a page gives it is named by its --help (its own, or among the train_dpo.py fields it passes on)."""
    usage = script_help("prefetch", capsys)
    given = set()
    for page in PAGES:
        for command in re.findall(r"\bprefetch\.py([^`\n]*)", page.read_text()):
            given |= set(re.findall(r"--[\w-]+", command.split("  #")[0]))
    assert {"--config", "--model_name_or_path", "--revision"} <= given, given  # the pages were read
    assert [flag for flag in sorted(given) if not re.search(rf"{flag}(?![\w-])", usage)] == []


def test_quickstart_shell_lines_parse_and_name_files_that_exist():
    lines = quickstart()
    assert any(line.startswith("sbatch ") for line in lines) and any("--dry-run" in line for line in lines)
    for line in lines:
        assert subprocess.run(["bash", "-n", "-c", line]).returncode == 0, line
        for word in shlex.split(line):
            if re.match(r"^(scripts|configs|data)/", word):
                assert (ROOT / word).exists(), (line, word)


# Quickstart lines that cannot run here, and why; every other line runs, in order. The rule, by what a line needs:
# a Slurm cluster (it submits), the network (it names a URL to download from), or it is the test suite itself.
DEMO = "bash scripts/demo.sh"  # run once per session by conftest.demo_run, whose output the rest reuses
NEEDS = {
    "a Slurm cluster": lambda line: line.startswith("sbatch "),
    "the network": lambda line: "https://" in line,
    "the test suite itself": lambda line: line.startswith("bash scripts/test.sh"),
}


def needs(line: str) -> str | None:
    return next((what for what, test in NEEDS.items() if test(line)), None)


@pytest.mark.slow
def test_quickstart_runs_line_after_line_in_a_fresh_shell(demo_run):
    """The quickstart as a newcomer types it into a new terminal, after the demo: one bash, no venv active, no Hub, no
    package index (conftest.demo_run), every line in order, each stopping the rest if it fails. The demo line itself
    ran in the same copy and environment (bash scripts/demo.sh starts a process of its own, so a shell of its own
    changes nothing that the lines after it see); the analysis reuses the tokenizer the demo built."""
    project, env, demo = demo_run
    # After the demo, a login node before credentials (issue #47): no W&B key or offline mode, no Hub token; step 2's
    # .env holds them empty. The dry runs still plan, and list what the run would refuse.
    env = {k: v for k, v in env.items() if k not in ("WANDB_MODE", "WANDB_API_KEY", "HF_TOKEN")}
    lines = quickstart()
    assert lines[0] == DEMO and demo.returncode == 0, demo.stdout[-3000:]
    skipped = {line: needs(line) for line in lines[1:] if needs(line)}
    assert sorted(skipped.values()) == ["a Slurm cluster", "the network", "the test suite itself"], skipped
    ran = [line for line in lines[1:] if line not in skipped]
    script = []
    for i, line in enumerate(ran):
        script += [f"echo '@@@ {i} start'", line, f's=$?; echo "@@@ {i} exit $s"; [ $s = 0 ] || exit $s']
    result = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", "\n".join(script)],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    said = {line: out.split(f"@@@ {i} start\n")[1].split(f"@@@ {i} exit 0\n")[0] for i, line in enumerate(ran)}
    assert any(line.startswith("source .venv/bin/activate") for line in ran)  # the python after it is the project's
    assert (project / ".env").read_text() == (project / ".env.example").read_text()
    for line, text in said.items():
        words = shlex.split(line)
        if words[:2] == ["python", "scripts/analyze_dataset.py"]:
            assert "Recommended max_length: " in text, text[-2000:]
        elif words[:2] == ["python", "train_dpo.py"]:
            assert "memory/GPU:    ~" in text, text[-2000:]  # a real plan, not "skipped"
            assert "warning: the run would refuse: report_to wandb but no W&B login" in text, text[-2000:]
    assert {tuple(shlex.split(line)[:2]) for line in ran} >= {
        ("python", "scripts/analyze_dataset.py"),
        ("python", "train_dpo.py"),
    }


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_path_a_page_names_lies_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "FACTS.md" not in text and "seeds/" not in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT), (page.name, target)
        if str(path.relative_to(ROOT)) not in ELSEWHERE:
            assert path.exists(), (page.name, target)
    for name in re.findall(r"`((?:scripts|configs|dpotrain|tests|data|benchmarks|docs)/[\w./-]+?)`", text):
        if "<" not in name and "*" not in name:
            assert (ROOT / name).exists() or name in ELSEWHERE, (page.name, name)


def test_no_file_of_the_repository_reads_the_shared_folder_beside_it():
    """The repository stands alone: no script, module, recipe or test names `../shared` (a folder beside a checkout of
    the machine it was written on, which a clone does not have). Only this file says the name."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no list of the repository's files")
    files = [ROOT / name for name in listed.stdout.split("\0") if name and name != "tests/test_readme.py"]
    named = [f.name for f in files if f.is_file() and b"../shared" in f.read_bytes()]
    assert len(files) > 100 and named == [], named


def stand_in_demo(tmp_path):
    """scripts/demo.sh copied into a project with a stand-in venv and set-up, and a function that runs it with words
    from another folder (`here`), returning what the run is given: its folder, DPOTRAIN_SUBMIT_DIR and arguments (the
    demo's own run is the slow demo_run)."""
    project, here = tmp_path / "dpotrain", tmp_path / "my runs"
    (project / "scripts").mkdir(parents=True)
    (project / ".venv" / "bin").mkdir(parents=True)
    here.mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", project / "scripts" / "demo.sh")
    (project / "scripts" / "setup_env.sh").write_text("true\n")
    python = project / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$PWD" "$DPOTRAIN_SUBMIT_DIR" "$@"\n')
    python.chmod(0o755)

    def run(*words):
        result = subprocess.run(
            ["bash", str(project / "scripts" / "demo.sh"), *words],
            cwd=here,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        *given, _next = result.stdout.splitlines()  # the demo's last line says what to do next
        cwd, submitted, *args = given
        return cwd, submitted, args

    return project, here, run


def test_the_demos_relative_output_dir_is_the_users_folder(tmp_path, monkeypatch):
    """`bash ~/dpotrain/scripts/demo.sh --output_dir my-demo` from another folder: the script runs in the project (its
    venv, recipe, the default outputs/smoke-dpo), and the run wrote ~/dpotrain/my-demo, not the folder it was typed
    in. It tells the run that folder (DPOTRAIN_SUBMIT_DIR), where a command line's relative paths are read, as a Slurm
    job's are."""
    from dpotrain.recipe.config import parse_args

    project, here, run = stand_in_demo(tmp_path)
    cwd, submitted, args = run("--output_dir", "my-demo")
    assert (cwd, args) == (str(project), ["train_dpo.py", "--config", "configs/smoke.yaml", "--output_dir", "my-demo"])
    # The run started so (in the project, told where the command was typed) writes where the user is
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", submitted)
    recipe = parse_args(["--config", "configs/smoke.yaml", "--output_dir", "my-demo"])
    assert recipe.training.output_dir == str(here / "my-demo")


def test_the_demos_relative_accelerate_config_is_the_users_file(tmp_path, monkeypatch):
    """`bash ~/dpotrain/scripts/demo.sh --accelerate_config my.yaml` from the folder holding my.yaml: train_dpo.py
    leaves a command line's accelerate_config to the launcher that placed it (launch.sh, a job's), so the demo's run
    read the project's my.yaml, or refused it as missing. The demo places it as launch.sh does: the user's file where
    it is in their folder, else as given (the project's, as its default accelerate_config.yaml stays)."""
    from dpotrain.recipe.config import parse_args

    project, here, run = stand_in_demo(tmp_path)
    for folder in (here, project):  # the project's file of the same name is not the one meant
        (folder / "my.yaml").write_text(f"# {folder.name}'s\n")
    mine = str(here / "my.yaml")
    assert run("--accelerate_config", "my.yaml")[2][-2:] == ["--accelerate_config", mine]
    assert run("--accelerate-config=my.yaml")[2][-1] == f"--accelerate-config={mine}"
    zero3 = ["--accelerate_config", "configs/accelerate/zero3.yaml"]  # not in the user's folder: the project's
    assert run(*zero3)[2][-2:] == zero3
    assert "--accelerate_config" not in run()[2]  # the default, the project's accelerate_config.yaml
    monkeypatch.chdir(ROOT)  # the run started so reads the user's file
    monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(here))
    assert parse_args(["--config", "configs/smoke.yaml", "--accelerate_config", mine]).project.accelerate_config == mine


@pytest.mark.parametrize("words", [["--run_name", "think-dpo"], ["--run_name=think-dpo"], ["--run-name", "think-dpo"]])
def test_the_demo_given_a_run_name_does_not_replace_the_run_in_that_folder(tmp_path, words):
    """`bash scripts/demo.sh --run_name think-dpo`: a run name chooses the output folder (outputs/<run_name>) as
    --output_dir does, but the demo still passed --overwrite_output_dir, so the finished run in outputs/think-dpo
    (configs/think.yaml's own folder) was replaced. Only the demo's own folder, outputs/smoke-dpo, is replaced."""
    _, _, run = stand_in_demo(tmp_path)
    assert "--overwrite_output_dir" in run()[2]  # its own outputs/smoke-dpo: repeatable
    assert "--overwrite_output_dir" not in run(*words)[2]


@pytest.mark.slow
@pytest.mark.parametrize("spelling", ["--output_dir", "--output_dir="])
def test_the_demo_sent_to_a_folder_of_the_users_does_not_replace_the_run_there(demo_run, tmp_path, spelling):
    """`bash scripts/demo.sh` replaces its own previous run (outputs/smoke-dpo), so that it can be run again; it passed
    --overwrite_output_dir whatever folder it was given, so `bash scripts/demo.sh --output_dir outputs/my-real-run`
    replaced the finished run there. Given a folder, the demo is refused there as any run is."""
    project, env, demo = demo_run
    assert demo.returncode == 0, demo.stdout[-3000:]
    mine = tmp_path / "my real run"
    shutil.copytree(project / "outputs" / "smoke-dpo", mine)
    words = [spelling, str(mine)] if spelling.endswith("dir") else [f"{spelling}{mine}"]
    result = subprocess.run(
        ["bash", "scripts/demo.sh", *words, "--dry-run"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    (output,) = [line for line in result.stdout.splitlines() if line.strip().startswith("output:")]
    assert "refused by the run" in output and "replace" not in output, output


def loss_table_flags() -> list[list[str]]:
    """Each flag set of the README's loss table, as a user would paste it: the row's flag spans of one `;`-part
    (`--loss_type aot` ... with `--max_tokens_per_microbatch none`), a span of one word (`--loss_type`, named in a
    sentence) left out."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| you want | flags |") :].split("\n\n", 1)[0]
    commands = []
    for row in table.splitlines()[2:]:
        for part in row.split("|")[2].split(";"):
            spans = [s.split() for s in re.findall(r"`([^`]*)`", part) if s.startswith("--")]
            flags = [word for span in spans if len(span) > 1 for word in span]
            if flags:
                commands.append(flags)
    return commands


@pytest.mark.parametrize("recipe", ["think", "instruct"])
def test_every_flag_set_of_the_loss_table_passes_the_loss_checks_on_a_recipe(recipe):
    """`--use_weighting true` was refused on every recipe (assistant_turns all: WPO reads one answer per side), as
    pasted from the table, so the table gives each flag set a run takes."""
    from dpotrain.recipe.config import parse_args
    from dpotrain.train import losses

    commands = loss_table_flags()
    assert len(commands) >= 9, commands  # every row read: a change of the table's layout fails here, not silently
    for flags in commands:
        # --bf16 false: this machine has no GPU (the recipes train in bf16), which the loss checks do not read
        args = ["--config", str(ROOT / "configs" / f"{recipe}.yaml"), "--bf16", "false", *flags]
        losses.check_options(parse_args(args))


def test_every_test_the_docs_and_code_name_exists():
    """A test named as a claim's proof (docs/losses.md: "tests/test_loss_variants.py::test_...") is one a reader can
    run: a test merged or renamed since left the docs naming one that no longer existed."""
    defined = {path.stem for path in (ROOT / "tests").rglob("test_*.py")}  # a file named without its .py
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.MULTILINE))
    sources = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]
    sources += [*(ROOT / "dpotrain").rglob("*.py"), *(ROOT / "scripts").glob("*"), *(ROOT / "benchmarks").glob("*")]
    missing = []
    for path in (p for p in sources if p.is_file()):
        for name in set(re.findall(r"\b(test_[a-z0-9_]{16,})\b(?!\.py)", path.read_text(errors="replace"))):
            if name not in defined:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing
