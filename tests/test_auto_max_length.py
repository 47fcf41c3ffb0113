"""`max_length: auto`: training runs the analyzer on its split (or reuses its cache) and records the choice."""

import json

import pytest

import train_dpo
from conftest import ROOT

SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--max_length", "auto", "--report_to", "none"]


def dry_run(capsys, *args) -> dict:
    train_dpo.main([*SMOKE, *args, "--dry-run", "--json"])
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n") :])


@pytest.mark.slow
def test_auto_max_length_is_chosen_recorded_and_then_shown_by_a_dry_run(tmp_path, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    model = ["--model_name_or_path", tiny_model_dir]

    # A Hub data set the analyzer has not cached: the dry run says how to decide it now.
    hub = dry_run(capsys, *model, "--dataset_name", "allenai/Dolci-Think-DPO-7B")
    assert hub["max_length"] == "auto"
    assert hub["derived"]["max_length"]["cached"] is False
    assert "scripts/analyze_dataset.py" in hub["derived"]["max_length"]["resolved"]

    out = tmp_path / "run"
    train_dpo.main([*SMOKE, *model, "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no"])
    resolved = json.loads((out / "resolved_config.json").read_text())
    choice = resolved["derived"]["max_length"]
    # The bundled pairs are at most ~550 tokens: 512 is the smallest multiple of 512 covering 95% of them (2 cut).
    assert resolved["max_length"] == choice["max_length"] == 512
    assert choice["coverage"] >= 0.95 and choice["target_coverage"] == 0.95 and choice["rows"] == 384
    assert choice["truncated"] == 2 and choice["doubled"]["max_length"] == 1024 and choice["doubled"]["coverage"] == 1
    assert "smallest multiple of 512 that leaves at least 95.0% of pairs whole" in choice["reason"]
    assert not choice["cached"]

    after = dry_run(capsys, *model)
    assert after["max_length"] == 512 and after["derived"]["max_length"]["cached"] is True
    assert after["derived"]["max_length"]["coverage"] == choice["coverage"]


def test_the_lengths_are_cached_for_the_rows_the_run_read_not_the_file_as_it_is_later(
    tmp_path, tiny_model_dir, monkeypatch
):
    """The run keyed the analyzer's cache by the data file as it was at the lengths stage, after the rows were read:
    rows added in between (a generation job still writing) were cached as the longer file's lengths, and a file
    changed while it was read was trained on as the record of another. Keyed by the rows read; a change while they
    were read refused."""
    from dpotrain import stages
    from dpotrain.data import lengths, mixture
    from dpotrain.plan import memory
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "d.jsonl"
    rows = (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(rows[:40]))
    recipe = parse_args([*SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(path)])
    launch = stages.checks(recipe)
    pairs = stages.load_data(recipe, launch, say=False)
    with open(path, "a") as f:
        f.write("".join(rows[40:80]))  # written after the rows were read
    config = memory.model_config(recipe, tiny_model_dir, local_only=False)[0]
    auto = stages.measure_lengths(recipe, launch, pairs, tiny_model_dir, config).auto
    assert auto["rows"] == 40
    tokenizer = lengths.load_tokenizer(tiny_model_dir)
    assert lengths.cached_measure(mixture.dataset_id(recipe), tokenizer) is None  # not the 80 rows' lengths

    load = stages.data.load_preference_dataset

    def read_while_rows_are_added(*args, **kwargs):
        with open(path, "a") as f:
            f.write(rows[80])
        return load(*args, **kwargs)

    monkeypatch.setattr(stages.data, "load_preference_dataset", read_while_rows_are_added)
    with pytest.raises(ConfigError, match="changed while the run read it"):
        stages.load_data(recipe, launch, say=False)


def test_a_folders_configurations_are_cached_apart(tmp_path, tiny_model_dir, monkeypatch, cli, capsys):
    """A Hub-style folder whose README's `configs:` block names two configurations of the same split: the cache key was
    the folder's files and split alone, so the analysis of one configuration (long answers) was taken for the other,
    and `max_length: auto` on the short one chose 2,048 (refused: more than max_tokens_per_microbatch holds)."""
    from dpotrain.data import builtin

    monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "prefs"
    for name, words in (("short", 0), ("long", 700)):
        (folder / name).mkdir(parents=True)
        pairs = builtin.make_preference_rows(40, seed=1)
        for pair in pairs:
            pair["chosen"][-1]["content"] += " word" * words
        (folder / name / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/*.jsonl\n" for c in ("short", "long")
        )
        + "---\n"
    )
    argv = [str(folder), "--tokenizer", tiny_model_dir, "--num-proc", "1", "--dataset_config", "long"]
    assert cli.main(argv) == 0 and "Recommended max_length: 2048" in capsys.readouterr().out
    short = dry_run(
        capsys, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(folder), "--dataset_config", "short"
    )
    assert short["max_length"] == 512, short["derived"]["max_length"]


@pytest.mark.slow
def test_a_stop_asked_as_auto_measures_every_pair_ends_the_run_before_the_pass_is_over(tmp_path, tiny_model_dir):
    """`max_length: auto` with no cached analysis: the main process measures every pair (the other ranks waiting), and
    a SIGTERM then was acted on only once the pass was over (minutes on a large data set, past a Slurm GraceTime). The
    pass looks at the run's stop between its batches: the run stops mid-pass with its stop line and 75, caches no
    half analysis, and the same command then measures every pair and trains. The SIGTERM goes to every process of the
    run, its map's workers too, as Slurm's does: a worker ended by it could leave the map's end waiting forever."""
    import os
    import select
    import signal
    import subprocess

    from conftest import python
    from dpotrain.data import builtin
    from dpotrain.train.preemption import STOPPED_EXIT

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(6000, seed=5)))
    env = {**os.environ, "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    cmd = [python(), str(ROOT / "train_dpo.py"), *SMOKE, "--model_name_or_path", tiny_model_dir]
    cmd += [
        "--dataset_name",
        str(data),
        "--output_dir",
        str(tmp_path / "run"),
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        seen, fd = b"", proc.stdout.fileno()
        while b"Tokenizing" not in seen:  # the pass's progress bar: it has begun
            assert proc.poll() is None, seen.decode()[-3000:]
            if select.select([fd], [], [], 0.1)[0]:
                seen += os.read(fd, 65536)
        os.killpg(proc.pid, signal.SIGTERM)
        log = (seen + proc.communicate(timeout=120)[0]).decode()  # the pass alone: ~4 s here, before the fix
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == STOPPED_EXIT and "Traceback" not in log, log[-3000:]
    assert "Stop requested: stopped before the model loaded" in log, log[-3000:]
    passes = [part for part in log.replace("\r", "\n").splitlines() if part.startswith("Tokenizing")]
    assert passes and not any("100%" in part for part in passes), log[-3000:]  # stopped mid-pass
    assert "Forward:" not in log and not list((tmp_path / "cache").glob("lengths/**/*.json")), log[-3000:]

    again = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (tmp_path / "run" / "model.safetensors").exists() and list((tmp_path / "cache").glob("lengths/**/*.json"))
