"""The run's record read back by type (dpotrain/recipe/run_record.py), on literal records: the shape this version
writes (a dry run's, with its step plan, and one planned at start), the shape of an earlier version (fields it did not
write read None, and are not compared on a resume), and damaged files (one line naming the file). Then what
scripts/launch.sh reads through it (dpotrain/cluster/job.py)."""

import io
import json
import shutil
from pathlib import Path

import pytest

import train_dpo
from conftest import ROOT
from dpotrain import resolve
from dpotrain.cluster import job
from dpotrain.recipe import run_record
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.run_record import Spread

SMOKE = str(ROOT / "configs" / "smoke.yaml")

# A dry run of configs/smoke.yaml as this version writes it, its fields cut to those read here.
DRY_RUN = {
    "config": "configs/smoke.yaml",
    "output_dir": "outputs/smoke-dpo",
    "max_length": 1024,
    "per_device_train_batch_size": None,  # a token budget cuts the micro-batches
    "gradient_accumulation_steps": None,
    "max_tokens_per_microbatch": 2048,
    "learning_rate": 0.0001,
    "hub_model_id": "org/smoke",
    "derived": {
        "world_size": 1,
        "world_size_source": "single process (python train_dpo.py, no launcher)",
        "data_parallel_size": 1,
        "gradient_clipping": {"max_grad_norm": 1.0, "clipped_by": "torch's clip_grad_norm_"},
        "pairs_per_step": 8,
        "dataset_rows": 384,
        "total_steps": 48,
        "warmup_steps": 5,
        "chat_template": {"path": None, "source": "the model's own", "sha256": "f950548988e5"},
        "batching": {
            "forward": "packed, prompts shared (384 of 384 pairs)",
            "pairs_per_step": 8,
            "micro_batches_per_step": {"min": 1, "mean": 1.042, "max": 2, "lower_bound_mean": 1.042},
            "pairs_per_micro_batch": {"min": 4, "mean": 7.7, "max": 8},
            "positions_per_micro_batch": {"min": 872, "mean": 1589.6, "max": 2290},
            "padding_share": 0.0558,
            "pairs_trained": {"pairs": 384, "of": 384, "steps": 48},
        },
        "memory": {"skipped": "this recipe trains in fp32", "engine": "one process (python train_dpo.py)"},
        "output_folder": "outputs/smoke-dpo: the run starts there (new)",
        "would_refuse": [],
    },
}


def test_a_dry_runs_record_reads_by_section():
    r = run_record.of(DRY_RUN)
    assert (r.launch.world_size, r.launch.data_parallel_size) == (1, 1)
    assert (r.data.dataset_rows, r.data.total_steps, r.data.warmup_steps) == (384, 48, 5)
    assert r.batching.pairs_per_step == 8 and r.batching.max_tokens_per_microbatch == 2048
    # Cut by tokens: micro-batches per step and pairs per micro-batch are the step plan's, in one place.
    assert r.batching.micro_batches_per_step == Spread(1, 1.042, 2) and str(r.batching.micro_batches_per_step) == "1-2"
    assert r.batching.pairs_per_micro_batch == Spread(4, 7.7, 8) and r.batching.layout.startswith("packed")
    assert r.lengths.max_length == 1024 and r.lengths.chosen_by == "the recipe's"
    assert r.lengths.template.sha256 == "f950548988e5" and not r.lengths.template.plain_text
    assert r.memory.skipped == "this recipe trains in fp32" and r.memory.per_gpu_gib is None
    assert r.output.would_refuse == () and r.output.folder.endswith("(new)")
    assert r.settings.learning_rate == 1e-4 and r.settings.hub_model_id == "org/smoke"
    with pytest.raises(AttributeError):  # a field the recipe does not have is a mistake, not None
        r.settings.learning_rat  # noqa: B018


def test_fixed_micro_batches_and_a_plan_made_at_start_read_from_the_recipes_fields():
    values = {
        **DRY_RUN,
        "max_tokens_per_microbatch": None,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "derived": {**DRY_RUN["derived"], "batching": {"planned": "at start, from the token lengths"}},
    }
    b = run_record.of(values).batching
    assert b.micro_batches_per_step == Spread(4, 4, 4) and str(b.micro_batches_per_step) == "4"
    assert str(b.pairs_per_micro_batch) == "2" and b.positions_per_micro_batch is None
    assert b.planned == "at start, from the token lengths"


def test_max_length_auto_is_an_int_with_how_it_was_chosen_or_when_it_is():
    chosen = {"max_length": 4096, "coverage": 0.951, "target_coverage": 0.95, "cached": True}
    r = run_record.of({**DRY_RUN, "max_length": 4096, "derived": {"max_length": chosen}})
    assert r.lengths.max_length == 4096
    assert r.lengths.chosen_by == "max_length: auto, 95.1% of the pairs whole (target 95%)"
    later = {"max_length": "auto", "target_coverage": 0.95, "resolved": "at start, by analysing the training split"}
    r = run_record.of({**DRY_RUN, "max_length": "auto", "derived": {"max_length": later}})
    assert r.lengths.max_length is None
    assert r.lengths.chosen_by == "max_length: auto, decided at start, by analysing the training split"


def test_a_record_of_an_earlier_version_reads_none_where_it_wrote_nothing():
    earlier = {"learning_rate": 1e-4, "derived": {"pairs_per_step": 8, "world_size": 1}}
    r = run_record.of(earlier)
    assert r.launch.data_parallel_size is None and r.lengths.template is None and r.batching.planned is None
    assert r.memory == run_record.MemoryPlan(*[None] * 13) and r.output.would_refuse == () and r.model_identity is None
    assert r.settings.assistant_turns is None and r.settings.learning_rate == 1e-4
    now = run_record.of({"learning_rate": 2e-4, "assistant_turns": "all"})
    # Compared where the earlier record holds the field: assistant_turns did not exist then.
    assert r.changed(now, ["learning_rate", "assistant_turns"]) == {"learning_rate": (1e-4, 2e-4)}


def test_a_resume_compares_with_a_record_of_an_earlier_version(tmp_path):
    """resolve.changed_settings on a run folder whose record lacks what this version adds (assistant_turns, the
    template's record): the same settings resume, a changed learning rate is named."""
    out = tmp_path / "run"
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out)])
    written = json.loads(json.dumps(resolve.resolved_config(recipe, {"pairs_per_step": 8}), default=str))
    del written["assistant_turns"]
    out.mkdir()
    (out / "resolved_config.json").write_text(json.dumps(written))
    assert resolve.changed_settings(recipe, out, 8) == []
    other = parse_args(["--config", SMOKE, "--output_dir", str(out), "--learning_rate", "2e-4"])
    assert resolve.changed_settings(other, out, 16) == ["learning_rate: 0.0001 -> 0.0002", "pairs_per_step: 8 -> 16"]


def test_a_local_data_set_or_model_named_another_way_is_not_a_changed_setting(tmp_path, monkeypatch):
    """`dataset_name: data/smoke_prefs.jsonl` in the recipe, the same file given absolute on a rerun (or through a link;
    a Slurm job's command line is anchored to its submit folder): refused as `dataset_name: ... -> ...`. The content is
    what is compared (data_identity, model_identity); another file is still named."""
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--dataset_name", "data/smoke_prefs.jsonl"])
    out.mkdir()
    (out / "resolved_config.json").write_text(json.dumps(resolve.resolved_config(recipe, {"pairs_per_step": 8})))
    (tmp_path / "link.jsonl").symlink_to(ROOT / "data" / "smoke_prefs.jsonl")
    for name in (str(ROOT / "data" / "smoke_prefs.jsonl"), str(tmp_path / "link.jsonl")):
        again = parse_args(["--config", SMOKE, "--output_dir", str(out), "--dataset_name", name])
        assert resolve.changed_settings(again, out, 8) == []
    (tmp_path / "other.jsonl").write_text((ROOT / "data" / "smoke_prefs.jsonl").read_text())
    other = parse_args(["--config", SMOKE, "--output_dir", str(out), "--dataset_name", str(tmp_path / "other.jsonl")])
    assert resolve.changed_settings(other, out, 8) == [
        f"dataset_name: 'data/smoke_prefs.jsonl' -> '{tmp_path}/other.jsonl'"
    ]


def test_a_run_started_where_its_data_is_resumes_from_the_folder_above(tmp_path, monkeypatch):
    """`cd exp; python train_dpo.py --dataset_name pairs.jsonl --output_dir run`, killed, then from the folder above
    `--dataset_name exp/pairs.jsonl --output_dir exp/run`: refused as "dataset_name: 'pairs.jsonl' ->
    'exp/pairs.jsonl'", the same file. The recorded relative names are looked for in the folder the run started in
    too, which its output folder, named relative to it in the record, tells. Another file is still named."""
    exp = tmp_path / "exp"
    exp.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", exp / "pairs.jsonl")
    monkeypatch.chdir(exp)
    recipe = parse_args(["--config", SMOKE, "--output_dir", "run", "--dataset_name", "pairs.jsonl"])
    (exp / "run").mkdir()
    record = resolve.resolved_config(recipe, {"pairs_per_step": 8})
    (exp / "run" / "resolved_config.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    again = parse_args(["--config", SMOKE, "--output_dir", "exp/run", "--dataset_name", "exp/pairs.jsonl"])
    assert resolve.changed_settings(again, Path("exp/run"), 8) == []
    (exp / "run" / "checkpoint-2").mkdir()  # what a resume compares: the newest checkpoint's copy of the record
    (exp / "run" / "checkpoint-2" / "resolved_config.json").write_text(json.dumps(record))
    assert resolve.changed_settings(again, Path("exp/run/checkpoint-2"), 8) == []
    # A file of the recorded name where the resume is typed (a copy, or another data set's): the recorded name was
    # looked for there first and refused "dataset_name: 'pairs.jsonl' -> 'exp/pairs.jsonl'", the same file
    shutil.copy(exp / "pairs.jsonl", tmp_path / "pairs.jsonl")
    assert resolve.changed_settings(again, Path("exp/run/checkpoint-2"), 8) == []
    (tmp_path / "other.jsonl").write_text((exp / "pairs.jsonl").read_text())  # a copy is another file
    other = parse_args(["--config", SMOKE, "--output_dir", "exp/run", "--dataset_name", "other.jsonl"])
    assert resolve.changed_settings(other, Path("exp/run"), 8) == ["dataset_name: 'pairs.jsonl' -> 'other.jsonl'"]


@pytest.mark.parametrize("spelling", ["dataset_mixer_list", "datasets"])
def test_a_mixture_started_where_its_data_is_resumes_from_the_folder_above(tmp_path, monkeypatch, spelling):
    """`cd exp; train_dpo.py --dataset_mixer_list pairs_a.jsonl 1.0 pairs_b.jsonl 1.0 --output_dir run`, stopped, then
    from the folder above with `exp/pairs_a.jsonl 1.0 exp/pairs_b.jsonl 1.0 --output_dir exp/run`: refused as a run
    with other settings, where the same for dataset_name resumes. The sources' content is still compared, and another
    file is still another setting."""
    from dpotrain.data import mixture

    exp = tmp_path / "exp"
    exp.mkdir()
    lines = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    (exp / "pairs_a.jsonl").write_text("".join(lines[:100]))
    (exp / "pairs_b.jsonl").write_text("".join(lines[100:200]))

    def given(folder: str, first: str = "pairs_a.jsonl") -> list[str]:
        names = [f"{folder}{first}", f"{folder}pairs_b.jsonl"]
        if spelling == "datasets":  # a builder's data_files, which datasets reads from the working folder too
            return ["--datasets", names[0], json.dumps({"path": "json", "data_files": names[1]})]
        return ["--dataset_mixer_list", names[0], "1.0", names[1], "1.0"]

    monkeypatch.chdir(exp)
    started = parse_args(["--config", SMOKE, "--output_dir", "run", *given("")])
    record = resolve.resolved_config(started, {"pairs_per_step": 8})
    sources = mixture.parse(mixture.fields_of(started))
    record["derived"]["data_sources"] = [{"source": s.spec(), "identity": mixture.identity_of(s)} for s in sources]
    (exp / "run" / "checkpoint-2").mkdir(parents=True)
    for folder in (exp / "run", exp / "run" / "checkpoint-2"):  # the run's record and its checkpoint's copy
        (folder / "resolved_config.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    again = parse_args(["--config", SMOKE, "--output_dir", "exp/run", *given("exp/")])
    assert resolve.changed_settings(again, Path("exp/run"), 8) == []
    assert resolve.changed_settings(again, Path("exp/run/checkpoint-2"), 8) == []
    shutil.copy(exp / "pairs_a.jsonl", tmp_path / "pairs_a.jsonl")  # the recorded name where the resume is typed
    assert resolve.changed_settings(again, Path("exp/run/checkpoint-2"), 8) == []
    with open(exp / "pairs_b.jsonl", "a") as f:  # the content, compared as before
        f.write(lines[300])
    changed = resolve.changed_settings(again, Path("exp/run"), 8)
    assert len(changed) == 1 and changed[0].startswith("dataset content: exp/pairs_b.jsonl"), changed
    shutil.copy(exp / "pairs_a.jsonl", exp / "copy.jsonl")  # a copy is another file
    other = parse_args(["--config", SMOKE, "--output_dir", "exp/run", *given("exp/", "copy.jsonl")])
    assert [c.split(":")[0] for c in resolve.changed_settings(other, Path("exp/run"), 8)] == [spelling]


@pytest.mark.parametrize(
    "text, why",
    [
        ('{"learning_rate": 0.0001, "derived": {"pairs', "JSONDecodeError: Unterminated string"),  # cut short
        ("[1, 2]", "a JSON list, not an object"),
        (None, "is unreadable (IsADirectoryError"),
    ],
)
def test_a_damaged_record_is_one_line_naming_the_file_and_the_fix(tmp_path, text, why):
    path = tmp_path / "resolved_config.json"
    path.mkdir() if text is None else path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        run_record.read(path)
    line = str(refused.value)
    assert line.startswith(str(path)) and why in line and "\n" not in line, line
    assert line.endswith("delete it to go on without that comparison, or pass a new --output_dir")


@pytest.mark.parametrize(
    "section, value, why",
    [
        ("batching", "planned at start", "derived.batching is a JSON str, not an object"),
        ("forward", ["packed"], "derived.forward is a JSON list, not an object"),
        ("memory", {"per_gpu_gib": 3}, "derived.memory.per_gpu_gib is a JSON int, not an object"),
        ("batching", {"micro_batches_per_step": {"min": 1}}, "micro_batches_per_step is neither a number nor"),
        ("batching", {"pairs_per_micro_batch": "4"}, "pairs_per_micro_batch is neither a number nor"),
    ],
)
def test_a_record_edited_into_another_shape_is_one_line_not_a_traceback(tmp_path, section, value, why):
    """A resolved_config.json whose nested sections were edited into another type (`derived.batching` a string) read
    back as an AttributeError or KeyError at whichever reader met it first, on every rerun."""
    path = tmp_path / "resolved_config.json"
    path.write_text(json.dumps({**DRY_RUN, "derived": {**DRY_RUN["derived"], section: value}}))
    with pytest.raises(ConfigError) as refused:
        run_record.read(path)
    line = str(refused.value)
    assert line.startswith(f"{path} is unreadable (") and why in line and "\n" not in line, line
    with pytest.raises(ConfigError, match="not a run's record"):
        run_record.parse(path.read_text(), "the dry run")


def test_what_launch_sh_prints_of_its_dry_run_and_its_exit_code_where_the_run_would_refuse(monkeypatch, capsys):
    shown = "[INFO] a library's line\n" + json.dumps(DRY_RUN, indent=2)  # a library may print before the JSON
    monkeypatch.setattr("sys.stdin", io.StringIO(shown))
    assert job.main(["summary"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("batch: 8 pairs per step over 1 process, micro-batches of at most 2048 packed tokens")
    assert out[1] == "memory plan skipped: this recipe trains in fp32"
    # 3 pairs kept at pairs_per_step 8 (max_length dropped the rest): the one step takes 3, the line said 8 alone
    kept = {**DRY_RUN["derived"]["batching"], "pairs_per_step_trained": {"min": 3, "mean": 3.0, "max": 3}}
    monkeypatch.setattr(
        "sys.stdin", io.StringIO(json.dumps({**DRY_RUN, "derived": {**DRY_RUN["derived"], "batching": kept}}))
    )
    assert job.main(["summary"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(
        "batch: 8 pairs per step over 1 process, micro-batches of at most 2048 packed tokens per "
    ), line
    assert line.endswith(f"process; the steps take 3 pairs; output: {ROOT / 'outputs/smoke-dpo'}"), line
    fixed = {**DRY_RUN, "max_tokens_per_microbatch": None, "per_device_train_batch_size": 2}
    fixed["gradient_accumulation_steps"] = 4
    planned = {"engine": "DeepSpeed ZeRO-2", "gpu_memory_gib": 79.6, "per_gpu_gib": {"total": 61.2}}
    refusals = ["report_to wandb but no W&B login", "output_dir 'x' already holds a finished run"]
    fixed["derived"] = {**DRY_RUN["derived"], "batching": {}, "memory": planned, "would_refuse": refusals}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(fixed, indent=2)))
    assert job.main(["summary"]) == 2
    said = capsys.readouterr()
    assert said.out.splitlines() == [
        f"batch: 8 pairs per step = 2 per process x 4 accumulation x 1 process; output: {ROOT / 'outputs/smoke-dpo'}",
        "memory plan: ~61.2 GiB per GPU of 79.6 GiB under DeepSpeed ZeRO-2",
    ]
    assert said.err.splitlines() == [f"error: {refusal}" for refusal in refusals]


@pytest.mark.parametrize(
    "line, engine",
    [
        ("accelerate_config: configs/accelerate/zero3.yaml  # ZeRO-3", "configs/accelerate/zero3.yaml"),
        ("accelerate_config: none  # plans `python train_dpo.py`; a job still launches", "accelerate_config.yaml"),
        ("beta: 5", "accelerate_config.yaml"),
        # a number-like name as written, as the run reads it: launch.sh launched `1.1` while the run planned `1.10`
        ("accelerate_config: 1.10", "1.10"),
    ],
)
def test_the_engine_launch_sh_launches_is_the_recipes_own(tmp_path, capsys, line, engine):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"learning_rate: 1.0e-6\n{line}\n")
    assert job.main(["engine", str(recipe)]) == 0
    assert capsys.readouterr().out == f"{engine}\n"


@pytest.mark.parametrize(
    "args, engine",
    [
        (["--accelerate_config", "configs/accelerate/fsdp2.yaml", "--beta", "5"], "configs/accelerate/fsdp2.yaml"),
        (["--accelerate-config=configs/accelerate/fsdp2.yaml"], "configs/accelerate/fsdp2.yaml"),
        (["--accelerate_config", "a.yaml", "--accelerate_config", "none"], "accelerate_config.yaml"),  # the last
    ],
)
def test_the_engine_launch_sh_launches_is_an_argument_of_the_job_over_the_recipes(
    tmp_path, capsys, monkeypatch, args, engine
):
    """An --accelerate_config after the sbatch script overrides the recipe's, as in the run's dry run: it was ignored
    by the launch (which read the recipe alone), so the job planned one engine and ran another."""
    monkeypatch.delenv("ACCELERATE_CONFIG", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("accelerate_config: configs/accelerate/zero3.yaml\n")
    assert job.main(["engine", str(recipe), *args]) == 0
    assert capsys.readouterr().out == f"{engine}\n"
    # launch.sh's ACCELERATE_CONFIG wins over the recipe; naming another engine than the argument is refused
    monkeypatch.setenv("ACCELERATE_CONFIG", "configs/accelerate/zero3.yaml")
    assert job.main(["engine", str(recipe)]) == 0 and capsys.readouterr().out == "configs/accelerate/zero3.yaml\n"
    with pytest.raises(ConfigError, match="^ACCELERATE_CONFIG=configs/accelerate/zero3.yaml and --accelerate_config"):
        job.engine(str(recipe), args)


def test_the_checkpoint_warning_is_the_one_sbatch_sends_a_command_line_or_sbatch_signal_over_the_scripts(
    capsys, monkeypatch
):
    """`sbatch --signal=B:USR1@60 scripts/dpo_train.sh`: sbatch takes its command line over SBATCH_SIGNAL over the
    script's `#SBATCH --signal=B:USR1@600`, and launch.sh read the script alone: its time-limit check and the save-time
    warnings counted 600 s where Slurm warns 60 s before the limit. Read from sacct's SubmitLine (where the cluster
    keeps accounting): an option after the script is the script's own argument."""
    script = str(ROOT / "scripts" / "dpo_train.sh")
    assert job.warning_lead(script) == f"600 {script}"
    given = "sbatch --signal=B:USR1@60 --time 5:00 scripts/dpo_train.sh --max_steps 4"
    assert job.warning_lead(script, given) == "60 sbatch's command line"
    given = "sbatch --signal B:SIGUSR1 scripts/dpo_train.sh"  # no @: sbatch's 60 s
    assert job.warning_lead(script, given) == "60 sbatch's command line"
    assert job.warning_lead(script, "sbatch scripts/dpo_train.sh --signal=B:USR1@60") == (f"600 {script}")
    stored = "#!/bin/bash\n#SBATCH --signal=B:USR1@100\n"  # Slurm's copy, as submitted: the file edited since
    assert job.warning_lead(script, "sbatch scripts/dpo_train.sh", stored) == f"100 {script}"
    monkeypatch.setenv("SBATCH_SIGNAL", "B:USR1@300")
    assert job.warning_lead(script, "sbatch scripts/dpo_train.sh") == "300 SBATCH_SIGNAL"
    assert job.warning_lead(script, given) == "60 sbatch's command line"
    assert job.main(["warning-lead", script, "sbatch --signal=USR1@600 scripts/dpo_train.sh"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and err == (  # without B: Slurm signals srun's processes, and launch.sh's trap never runs
        "warning: the job's --signal=USR1@600 (sbatch's command line) does not send USR1 to the batch shell, "
        "which checkpoints before the time limit (without B:, Slurm signals the job's steps only): submit with "
        "sbatch --signal=B:USR1@600\n"
    )


def test_an_sbatch_signal_line_below_the_scripts_first_command_is_no_warning(tmp_path, capsys):
    """sbatch reads #SBATCH lines only above a script's first command: `#SBATCH --signal=B:USR1@600` appended below
    it (as "add ... to <script>" invites) sets no warning. launch.sh read it anyway: "checkpoints must be written
    within 600 s (time-limit warning)" for a warning that never comes, and a job with `--time=5` was refused as
    "within its checkpoint warning"."""
    # Comments and blank lines between #SBATCH lines (the shipped scripts') are read on.
    script = tmp_path / "my_job.sh"
    top = "#!/bin/bash\n#SBATCH --time=24:00:00\n\n  # a note\n#SBATCH --signal=B:USR1@300\n"
    script.write_text(top + "bash scripts/launch.sh\n#SBATCH --signal=B:USR1@600\n")
    assert job.warning_lead(str(script)) == f"300 {script}"
    script.write_text("#!/bin/bash\n#SBATCH --time=24:00:00\nbash scripts/launch.sh\n#SBATCH --signal=B:USR1@600\n")
    assert job.warning_lead(str(script)) == ""
    assert capsys.readouterr().err.endswith(
        f"add `#SBATCH --signal=B:USR1@600` to {script} (or submit with sbatch --signal=B:USR1@600) (sbatch reads an "
        "#SBATCH line only above the script's first command)\n"
    )


def test_a_quoted_sbatch_signal_line_is_the_warning_sbatch_sends(tmp_path, capsys):
    """sbatch drops the double quotes of a directive: `#SBATCH --signal="B:USR1@150"` sends USR1 to the batch shell
    150 s before the limit. Read with its quotes, the log said it did not reach the batch shell (fix: @600), and a time
    limit within it was not refused: a `--time=3` job was warned at every start and requeued itself over and over."""
    script = tmp_path / "my_job.sh"
    script.write_text('#!/bin/bash\n#SBATCH --time=3\n#SBATCH --signal="B:USR1@150"\nbash scripts/launch.sh\n')
    assert job.warning_lead(str(script), f"sbatch {script}") == f"150 {script}"
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^the time-limit warning \(--signal=B:USR1@150\) came before training was"):
        job.check_warned_start("150", str(script), "2:40", "17", "before-launch")  # the warned start: not requeued


def test_a_job_without_a_time_limit_warning_is_told_what_that_loses_and_how_to_set_one(tmp_path, capsys):
    """A script without `#SBATCH --signal`: launch.sh said "checkpoints must be written within 600 s (time-limit
    warning)", a warning that never comes."""
    script = tmp_path / "my_job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --time=24:00:00\nbash scripts/launch.sh\n")
    assert job.main(["warning-lead", str(script), f"sbatch {script}"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and err == (
        "warning: no time-limit warning is set for this job (no --signal=B:USR1@<seconds>): at its time limit Slurm "
        "sends SIGTERM and kills it KillWait later (30 s by default): a checkpoint that takes longer is cut off, and "
        f"the steps since the last one are lost; add `#SBATCH --signal=B:USR1@600` to {script} (or submit with sbatch "
        "--signal=B:USR1@600)\n"
    )
    assert job.main(["time-limit", "", "", "90", "debug", "23:59:58"]) == 0
    assert capsys.readouterr().out == (
        "checkpoints must be written within 90 s (partition debug's preemption GraceTime); no time-limit warning is "
        "set\n"
    )
    assert job.checkpoint_window("", "0", "debug") == (
        "checkpoints must be written within KillWait (30 s by default: scontrol show config): no time-limit warning "
        "is set, and partition debug has no preemption GraceTime"
    )


def test_an_allocation_without_a_time_limit_warning_is_told_the_salloc_option_not_a_script_to_edit(capsys, monkeypatch):
    """launch.sh run in an allocation (salloc, or a job srun made: no batch script) was told to add an #SBATCH line
    to `<folder>/(null)` (salloc's Command=) or `<folder>/bash` (srun's). Slurm sends an allocation's --signal to its
    steps, whose training processes stop on USR1 (a real salloc --signal=USR1@50 saved and ended with exit 75): the
    fix names that, and a `--signal=USR1@...` on its command line (no B:, which salloc does not take) or in
    SALLOC_SIGNAL is its warning. An SBATCH_SIGNAL in the shell is sbatch's, not the allocation's."""
    monkeypatch.setenv("SBATCH_SIGNAL", "B:USR1@300")
    assert job.main(["warning-lead", "", "", "", "allocation"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and "(null)" not in err and "#SBATCH --signal=B:USR1@600` to" not in err, err
    assert err.startswith("warning: no time-limit warning is set for this allocation (salloc, or a job srun made: ")
    assert err.endswith(
        "give salloc --signal=USR1@600 (srun --signal=USR1@600 for a job srun made), or submit the script with sbatch, "
        "whose `#SBATCH --signal=B:USR1@600` requeues the job too\n"
    )
    given = "salloc --signal=USR1@120 --time=1:00:00 bash scripts/launch.sh"
    assert job.warning_lead("", given, "", allocation=True) == "120 the allocation's --signal"
    assert job.warning_lead("", "srun --signal R:10 --pty bash", "", allocation=True) == "60 the allocation's --signal"
    monkeypatch.setenv("SALLOC_SIGNAL", "USR1@300")  # salloc's own variable for it; its command line wins
    assert job.warning_lead("", "", "", allocation=True) == "300 the allocation's --signal"
    assert job.warning_lead("", given, "", allocation=True) == "120 the allocation's --signal"
    assert capsys.readouterr().err == ""


def test_a_lead_taken_from_the_script_of_a_job_not_given_the_submitting_shells_variables_says_so(capsys, monkeypatch):
    """`SBATCH_SIGNAL=B:USR1@60 sbatch --export=NONE scripts/dpo_train.sh`: Slurm sends the warning at 60 s (on the
    test cluster, @40 over a script's @110: warned with 0:49 left), but the job gets no SBATCH_SIGNAL and Slurm shows a
    job's --signal nowhere (scontrol show job, SLURM_* variables), so the job took its script's 600 s in silence.
    Its lead line says so, for --export=NONE and for a list without ALL (Slurm's SLURM_EXPORT_ENV in the job)."""
    script, line = "/p/scripts/dpo_train.sh", "checkpoints must be written within 600 s (time-limit warning)"

    def said(where: str = script) -> str:
        assert job.main(["time-limit", "600", where, "0", "debug", "1-00:00:00"]) == 0
        return capsys.readouterr().out

    for exported, given in (("NONE", "--export=NONE"), ("RECIPE=my.yaml", "an --export list without ALL")):
        monkeypatch.setenv("SLURM_EXPORT_ENV", exported)
        assert said() == (
            f"{line}; 600 s is what {script} sets: this job was submitted with {given}, so an SBATCH_SIGNAL in the "
            "shell that submitted it is not seen here, though Slurm sends its warning (a job's --signal is shown "
            "nowhere): set the lead in the script, or pass the variable on (--export=SBATCH_SIGNAL,...)\n"
        )
        assert said("SBATCH_SIGNAL") == said("sbatch's command line") == f"{line}\n"  # the job's own, read
    # passed on by name: the submitting shell had none, so the script's lead is the job's
    for exported in ("ALL", "ALL,RECIPE=my.yaml", "SBATCH_SIGNAL,RECIPE=my.yaml", "RECIPE=my.yaml,SBATCH_SIGNAL"):
        monkeypatch.setenv("SLURM_EXPORT_ENV", exported)
        assert said() == f"{line}\n"
    monkeypatch.delenv("SLURM_EXPORT_ENV")  # sbatch's default, --export=ALL: none set
    assert said() == f"{line}\n"


@pytest.mark.parametrize(
    "lead, left, minutes",
    [
        ("600", "9:58", "10 minutes"),
        ("60", "0:58", "1 minute"),
        ("90", "1:28", "90 seconds"),
        ("30", "28", "30 seconds"),
    ],
)
def test_a_time_limit_within_the_warning_is_refused_naming_the_time_to_submit_with(lead, left, minutes, capsys):
    """`submit with --time above $((lead / 60)) minutes` said "1 minutes" for a warning of 60 s, "1 minutes" for 90 s
    (a --time of 1:20 is above that, and still within the warning) and "0 minutes" for 30 s."""
    assert job.main(["time-limit", lead, "my_job.sh", "0", "debug", "1-00:00:00"]) == 0
    assert capsys.readouterr().out == f"checkpoints must be written within {lead} s (time-limit warning)\n"
    assert job.checkpoint_window(lead, "90", "debug").endswith(
        " s (time-limit warning) and 90 s (partition debug's preemption GraceTime)"
    )
    with pytest.raises(ConfigError) as refused:
        job.main(["time-limit", lead, "my_job.sh", "0", "debug", left])
    assert capsys.readouterr().out == f"checkpoints must be written within {lead} s (time-limit warning)\n"
    assert str(refused.value) == (
        f"the job's time limit ({left} left) is within its checkpoint warning (--signal=B:USR1@{lead}), which Slurm "
        f"would send at once: every requeue would stop at its first step to save; submit with --time above {minutes}, "
        f"or lower the @{lead} in my_job.sh"
    )


@pytest.mark.parametrize(
    "config, refusal",
    [
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\nnum_processes: 8\n",
            "FSDP version 1 is not supported: set fsdp_version: 2",
        ),
        (
            "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 1\n",
            "DeepSpeed ZeRO stage 1 is not supported",
        ),
        (
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_state_dict_type: FULL_STATE_DICT\n",
            "fsdp_state_dict_type FULL_STATE_DICT is not supported",
        ),
    ],
)
def test_a_job_ends_at_its_dry_run_on_an_engine_its_processes_would_refuse(
    tmp_path, monkeypatch, capsys, config, refusal
):
    """An accelerate config a user wrote (accelerate's questionnaire: FSDP without fsdp_version is FSDP1; ZeRO-1): the
    dry run left it unplanned and went on, so the job started every node's processes, each of which refused it at
    its start. The dry run says the run would refuse it, and launch.sh's summary of the dry run (its config is the one
    launched) ends the job there, in one line."""
    path = tmp_path / "my accelerate.yaml"
    path.write_text(config)

    def dry_run(accelerate_config: str, *json) -> str:
        argv = ["--config", SMOKE, "--accelerate_config", accelerate_config, "--output_dir", str(tmp_path / "run")]
        train_dpo.main([*argv, "--dry-run", *json])
        return capsys.readouterr().out

    assert f"warning: the run would refuse: {refusal}" in dry_run(str(path))
    monkeypatch.setattr("sys.stdin", io.StringIO(dry_run(str(path), "--json")))
    assert job.main(["summary"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and refusal in lines[0], lines


@pytest.mark.slow
def test_a_job_goes_on_past_its_dry_run_on_the_engines_the_project_runs(tmp_path, monkeypatch, capsys):
    """The other side of the test above (once, not once per refused config): the shipped configs, and none (plain
    `python train_dpo.py`), go on."""
    for shipped in ("accelerate_config.yaml", "configs/accelerate/zero3.yaml", "configs/accelerate/fsdp2.yaml", "none"):
        config = str(ROOT / shipped) if shipped != "none" else shipped
        argv = ["--config", SMOKE, "--accelerate_config", config, "--output_dir", str(tmp_path / "run")]
        train_dpo.main([*argv, "--dry-run", "--json"])
        monkeypatch.setattr("sys.stdin", io.StringIO(capsys.readouterr().out))
        assert job.main(["summary"]) == 0, shipped
        assert not capsys.readouterr().err


def test_a_dry_run_ends_on_an_accelerate_config_that_is_not_there(tmp_path, monkeypatch):
    """A mistyped --accelerate_config, or a recipe's default accelerate_config.yaml dry-run from outside the project
    (`python ~/dpotrain/train_dpo.py --config ~/dpotrain/configs/think.yaml --dry-run`): planned as `processes: 1
    (single process)` in silence, for a launch `accelerate launch --config_file` fails. Ended in one line naming the
    folder it was looked for in; the run itself reads the launch, not this field."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    data = str(ROOT / "data" / "smoke_prefs.jsonl")
    argv = ["--config", SMOKE, "--dataset_name", data, "--output_dir", str(tmp_path / "run"), "--dry-run"]
    for name in ("accelerate_config.yaml", "my-accel.yaml"):
        with pytest.raises(ConfigError) as refused:
            train_dpo.main([*argv, "--accelerate_config", name])
        assert str(refused.value).startswith(f"accelerate config {name!r} not found (in {tmp_path})"), refused.value
        assert "or none for one process" in str(refused.value)
    assert (
        resolve.world_size(parse_args([*argv, "--accelerate_config", str(ROOT / "accelerate_config.yaml")]), True)[0]
        == 4
    )


def test_the_default_accelerate_config_is_the_projects_from_another_folder_as_a_recipes_own_is(tmp_path, monkeypatch):
    """`python ~/dpotrain/train_dpo.py --config ~/dpotrain/configs/think.yaml --dry-run` from another folder: think.yaml
    names no accelerate_config, and its default accelerate_config.yaml was looked for there alone and refused (the
    analyzer skipped its memory plan), while think-32b.yaml, which names its own configs/accelerate/zero3.yaml, was
    planned from the project's file. The default is the project's file too; given on the command line, the folder's."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "no-engine.yaml"  # think.yaml's shape: no accelerate_config line
    text = (ROOT / "configs" / "smoke.yaml").read_text()
    recipe.write_text("".join(line for line in text.splitlines(True) if not line.startswith("accelerate_config:")))
    argv = ["--config", str(recipe), "--dataset_name", str(ROOT / "data" / "smoke_prefs.jsonl"), "--dry-run"]
    planned = parse_args(argv)
    assert planned.project.accelerate_config == str(ROOT / "accelerate_config.yaml")
    assert resolve.world_size(planned, True)[0] == 4  # the shipped config's num_processes
    with pytest.raises(ConfigError, match=f"^accelerate config 'accelerate_config.yaml' not found \\(in {tmp_path}\\)"):
        resolve.world_size(parse_args([*argv, "--accelerate_config", "accelerate_config.yaml"]), True)


def test_a_dry_run_ends_on_an_accelerate_config_accelerate_itself_refuses(tmp_path):
    """A key accelerate does not know (`gpus_per_node`, a Slurm word): the dry run, and so the job, ends in one line."""
    path = tmp_path / "my accelerate.yaml"
    path.write_text("distributed_type: MULTI_GPU\ngpus_per_node: 4\n")
    argv = ["--config", SMOKE, "--accelerate_config", str(path), "--output_dir", str(tmp_path / "run"), "--dry-run"]
    with pytest.raises(ConfigError, match="would be refused by `accelerate launch`: ValueError: .*unknown keys"):
        train_dpo.main(argv)
    # Saved as UTF-16 (PowerShell 5's `>`): the codec's UnicodeDecodeError was quoted, naming no fix
    for codec in ("utf-16", "utf-16-le"):  # without its byte-order mark: YAML's "unacceptable character #x0000"
        path.write_bytes("distributed_type: MULTI_GPU\n".encode(codec))
        with pytest.raises(ConfigError) as refused:
            train_dpo.main(argv)
        assert str(refused.value) == (
            f"accelerate config {str(path)!r} is not UTF-8 text, which `accelerate launch` reads: save it as UTF-8"
        )
