"""Rank agreement at start (dpotrain/train/agreement.py): two real gloo processes that disagree are refused with one
line
naming the value and the rank."""

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, accelerate_launch, built, ddp_config, rank_python, smoke_recipe, torchrun_launch

CHECK = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from dpotrain.train import agreement
    from dpotrain.recipe.errors import ConfigError
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    values = {{"the engine": "zero2", "the resume point": "None"}}
    if rank == 1 and os.environ.get("DPOTRAIN_TEST_DIFFER"):
        values["the resume point"] = "out/checkpoint-40"
    try:
        agreement.check(values)
        said = "agreed"
    except ConfigError as e:
        said = f"error: {{e}}"
    # One file per rank: the ranks' prints share one pipe, and a line's two writes can interleave with the other's.
    with open(os.path.join({out!r}, f"rank{{rank}}.txt"), "w") as f:
        f.write(f"rank {{rank}}: {{said}}\\n")
    dist.destroy_process_group()
""")


def torchrun(tmp_path, differ: bool) -> str:
    script = tmp_path / "check.py"
    out = tmp_path / "said"
    out.mkdir()
    script.write_text(CHECK.format(root=str(ROOT), out=str(out)))
    # (ranks that agree: every multi-process training test)
    env = {**os.environ, "DPOTRAIN_TEST_DIFFER": "1" if differ else ""}
    cmd = [
        *torchrun_launch(),
        "--standalone",
        "--nproc_per_node",
        "2",
        *rank_python(),
        str(script),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return "".join(p.read_text() for p in sorted(out.iterdir()))


@pytest.mark.slow
def test_a_difference_between_two_ranks_is_one_line_naming_the_rank(tmp_path):
    lines = sorted(line for line in torchrun(tmp_path, differ=True).splitlines() if line.startswith("rank"))
    want = (
        "error: ranks disagree on the resume point: rank 1 has out/checkpoint-40, rank 0 has None: every node "
        "must see the same output_dir (a shared file system, not a node-local one)"
    )
    assert lines == [f"rank 0: {want}", f"rank 1: {want}"]  # every rank stops, with the same line


WRAPPER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    sys.argv[0] = {train!r}
    if os.environ.get("RANK") == "1":  # as if this node were launched with its own, different command line
        sys.argv[sys.argv.index({flag!r}) + 1] = {other!r}
    import runpy
    runpy.run_path({train!r}, run_name="__main__")
""")


def launch_with_rank1_given(tmp_path, tiny_model_dir, flag: str, other: str):
    """Two ranks of the smoke recipe replacing a finished run (--overwrite_output_dir), rank 1 with `flag`'s value
    `other`: the launch's output, the old run's folder and its files' texts as they were before."""
    from dpotrain.data import builtin
    from dpotrain.train import run_files

    rows = builtin.make_preference_rows(40, seed=3)
    same = tmp_path / "pairs.jsonl"
    same.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wrapper = tmp_path / "wrapper.py"
    train = str(ROOT / "train_dpo.py")
    wrapper.write_text(WRAPPER.format(root=str(ROOT), train=train, flag=flag, other=other))
    out = tmp_path / "run"  # a finished run, which --overwrite_output_dir replaces
    out.mkdir()
    old = {"run_complete.json": '{"global_step": 2}\n', "metrics.jsonl": '{"step": 1, "loss": 0.69}\n'}
    for name, text in old.items():
        (out / name).write_text(text)
    run_files.write(out, [run_files.MANIFEST, *old])
    old[run_files.MANIFEST] = (out / run_files.MANIFEST).read_text()
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        *rank_python(),
        str(wrapper),
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(same),
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        "--max_steps",
        "2",
        "--warmup_steps",
        "0",
        "--learning_rate",  # the smoke recipe's, given here for rank 1 to be given another
        "1e-4",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    return result, out, old


def refused_before_the_old_run_is_replaced(result, out, old) -> str:
    """The one `error:` line of a refused launch, checked to have come before the old run's files went and the model
    loaded."""
    assert result.returncode != 0
    errors = {line for line in result.stdout.splitlines() if line.startswith("error:")}
    assert len(errors) == 1, result.stdout[-4000:]
    # The replaced run's files, as they were: nothing of it was removed for a launch that was refused.
    assert {p.name: p.read_text() for p in out.iterdir() if p.name in old} == old, sorted(os.listdir(out))
    # Refused before the model loaded and TRL tokenized (the progress bars of both, on the old code's refusal)
    assert "Loading weights" not in result.stdout and "Tokenizing train dataset" not in result.stdout, result.stdout
    return errors.pop()


@pytest.mark.slow
def test_two_ranks_given_different_data_are_refused_before_the_old_run_is_replaced(tmp_path, tiny_model_dir):
    """The ranks compared the data only once the model had loaded and TRL had tokenized (minutes on a large model),
    after --overwrite_output_dir had removed the replaced run's files: the old run was gone for a launch refused. The
    first half's decisions are compared before either."""
    from dpotrain.data import builtin

    rows = builtin.make_preference_rows(40, seed=3)
    other = tmp_path / "other.jsonl"  # as if this node read its own, different copy of the data
    other.write_text("".join(json.dumps(r) + "\n" for r in rows[:20] + builtin.make_preference_rows(20, seed=4)))
    result, out, old = launch_with_rank1_given(tmp_path, tiny_model_dir, "--dataset_name", str(other))
    error = refused_before_the_old_run_is_replaced(result, out, old)
    assert error.startswith("error: ranks disagree on the data set's lengths: rank 1 has "), error
    assert "every node must read the same data" in error


@pytest.mark.slow
def test_two_ranks_given_different_learning_rates_are_refused_before_the_old_run_is_replaced(tmp_path, tiny_model_dir):
    """Only max_length, pairs per step, the engine and the forward of the recipe were compared: a node launched with
    another learning rate (another copy of the recipe, another command line) stepped its own copy with it, and the
    ranks' weights drifted apart in silence. The recipe of the run is compared with the first half's decisions."""
    result, out, old = launch_with_rank1_given(tmp_path, tiny_model_dir, "--learning_rate", "2e-4")
    error = refused_before_the_old_run_is_replaced(result, out, old)
    # The field that differs, by name: not a digest the user would have to take apart by diffing recipes by hand
    want = "rank 1 has learning_rate=0.0002, rank 0 has learning_rate=0.0001"
    assert (
        error == f"error: ranks disagree on the settings: {want}: launch every node with the same recipe file and "
        "command line"
    ), error


def test_the_evaluation_set_is_among_what_the_ranks_must_agree_on(tmp_path, tiny_model_dir):
    """Evaluation batches are cut by count alone: a rank that read other evaluation pairs of the same count would
    evaluate on them unseen, unless their lengths are part of the digest."""
    import datasets

    from dpotrain.data import builtin
    from dpotrain.recipe.config import parse_args
    from dpotrain.train import agreement

    train = datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=5))
    held_out = datasets.Dataset.from_list(builtin.make_preference_rows(12, seed=6))
    datasets.DatasetDict({"train": train, "test": held_out}).save_to_disk(tmp_path / "pairs")  # a split to evaluate on
    args = [
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(tmp_path / "pairs"),
        "--output_dir",
        str(tmp_path / "run"),
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--max_steps",
        "2",
    ]
    seen = []
    for seed in (6, 7):  # two evaluation splits of 12 pairs each; a recipe each (building fills it in)
        evaluation = datasets.Dataset.from_list(builtin.make_preference_rows(12, seed=seed))
        trainer = built(parse_args(args), train, evaluation).trainer
        seen.append(agreement.values(trainer, None))
    differ = {name for name in seen[0] if seen[0][name] != seen[1][name]}
    assert differ == {"the evaluation set"}


def test_the_first_half_compares_the_data_and_nothing_agreeing_ranks_decide_otherwise(tmp_path, tiny_model_dir):
    """The early comparison (`first_half_values`) tells other training pairs apart, and is equal for the same pairs
    decided twice (a value that differs between agreeing ranks, a time or a host, would refuse every launch); every
    name it or the build's comparison uses has its own fix."""
    import datasets

    from dpotrain import stages
    from dpotrain.data import builtin
    from dpotrain.train import agreement

    recipe = smoke_recipe(tmp_path / "run", tiny_model_dir)
    launch = stages.checks(recipe)

    def first_half(seed):
        train = datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=seed))
        spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, train, None))
        return agreement.first_half_values(spec)

    same, again, other = first_half(3), first_half(3), first_half(4)
    assert same == again
    # The first difference is the one refused: the data's, not the forward decided from it (its estimates differ too)
    assert [name for name in same if same[name] != other[name]] == ["the data set's lengths", "the forward"]
    named = set(same) | {"the data set's lengths", "the plan", "the resume point", "the reference's model"}
    named |= {"the output folder's state"}  # train_dpo.py, before a rank ends on a finished run or a push left
    assert named <= set(agreement.FIXES), named - set(agreement.FIXES)


def test_the_first_half_compares_the_resume_point_before_the_old_run_is_replaced(tmp_path, tiny_model_dir):
    """A node-local output_dir resumes one rank and starts another afresh: refused early, named as the resume point
    (with its fix: a shared output_dir), not as a difference of settings."""
    from dataclasses import replace

    import datasets

    from dpotrain import resolve, stages
    from dpotrain.data import builtin
    from dpotrain.train import agreement

    recipe = smoke_recipe(tmp_path / "run", tiny_model_dir)
    launch = stages.checks(recipe)
    train = datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=3))
    spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, train, None))
    afresh = replace(spec, output=resolve.OutputDecision(resume_from=None, start_afresh=True))
    resumed = replace(
        spec, output=resolve.OutputDecision(resume_from=str(tmp_path / "run/checkpoint-4"), start_afresh=False)
    )
    a, b = agreement.first_half_values(afresh), agreement.first_half_values(resumed)
    assert [name for name in a if a[name] != b[name]][0] == "the resume point"


def test_the_settings_leave_out_what_ranks_of_one_run_differ_in_and_nothing_else(tmp_path, tiny_model_dir):
    """The early comparison's "the settings": a process's own `--local_rank` (torch.distributed.launch passes one each)
    and a copy of the same recipe file at another path agree; another learning rate, beta or seed does not, and the
    refusal names that field alone."""
    import datasets

    from dpotrain import stages
    from dpotrain.data import builtin
    from dpotrain.recipe.config import parse_args
    from dpotrain.train import agreement

    copy = tmp_path / "node2" / "smoke.yaml"  # the same recipe, staged on another node's own disk
    copy.parent.mkdir()
    copy.write_text((ROOT / "configs" / "smoke.yaml").read_text())
    train = datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=3))
    common = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run"), "--report_to", "none"]

    def settings(recipe_file, *more):
        recipe = parse_args(["--config", str(recipe_file), *common, *more])
        launch = stages.checks(recipe)
        spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, train, None))
        return agreement.first_half_values(spec)["the settings"]  # field -> value, as the ranks send it

    rank0 = settings(ROOT / "configs" / "smoke.yaml", "--local_rank", "0")
    assert settings(copy, "--local_rank", "1") == rank0
    others = {"--learning_rate": ("2e-4", "learning_rate=0.0002", "learning_rate=0.0001")}
    others |= {"--beta": ("0.1", "beta=0.1", "beta=5.0"), "--seed": ("7", "seed=7", "seed=42")}
    for flag, (value, *shown) in others.items():
        other = settings(ROOT / "configs" / "smoke.yaml", "--local_rank", "0", flag, value)
        assert list(agreement._shown(other, rank0)) == shown  # the refusal's words: the field that differs alone
    several = settings(
        ROOT / "configs" / "smoke.yaml", "--beta", "0.1", "--seed", "7", "--warmup_steps", "0", "--max_grad_norm", "2"
    )
    assert agreement._shown(several, rank0)[1] == "beta=5.0 max_grad_norm=1.0 seed=42 (and 1 other)"


HUB_CACHE_WRAPPER = textwrap.dedent("""\
    #!/bin/bash
    # this node's own Hub cache, which holds another commit of the model (set before the libraries are imported)
    if [ "$RANK" = 1 ]; then export HF_HUB_CACHE={other}; fi
    exec {python} "$@"
""")


def hub_cache_of(folder, model_dir, commit: str, nudge: float = 0.0) -> None:
    """A Hub cache in `folder` holding `model_dir` as commit `commit` of tiny/olmo (refs/main names it), its weights
    moved by `nudge`: what a node's own cache holds of a Hub model fetched there at another time."""
    from safetensors.torch import load_file, save_file

    repo = folder / "models--tiny--olmo"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    if nudge:
        weights = load_file(snapshot / "model.safetensors")
        save_file({k: v + nudge for k, v in weights.items()}, snapshot / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.parametrize("lora, live", [(False, False), (True, False), (False, True)], ids=["full", "lora", "live"])
def test_ranks_that_loaded_other_weights_are_refused_before_the_reference_is_scored(
    lora, live, tmp_path, tiny_model_dir
):
    """A Hub model read offline from node-local caches, one of which holds another commit (or a model folder staged
    on each node's own disk from two checkpoints): every rank loads its own copy, and each scored its share of the
    reference stage with its own weights. The reference cache, keyed by rank 0's weights, then held rank 1's pairs
    scored by other weights; that run stopped at step 1 (its step-1 guard, blaming a stale cache), and so did every
    later run of those weights and data, on every node, until the cache was found and deleted (a run with dropout or
    health_action warn trained against it). The weights each rank loaded are compared before the stage. A live
    reference (`live`: --precompute_ref_log_probs false) has no cache key: each rank trained against its own reference
    model at every step (exit 0 with --health_checks false); a fingerprint of what each rank loaded is compared."""
    from dpotrain.data import builtin
    from dpotrain.train import agreement

    same, other = tmp_path / "hub", tmp_path / "node2-hub"
    hub_cache_of(same, tiny_model_dir, "a" * 40)
    hub_cache_of(other, tiny_model_dir, "b" * 40, nudge=0.01)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin.make_preference_rows(16, seed=3)))
    wrapper = tmp_path / "wrapper.sh"
    rank = rank_python()[1:] or [sys.executable, "-u"]  # the warm interpreter starts cold for rank 1's cache
    wrapper.write_text(HUB_CACHE_WRAPPER.format(other=shlex.quote(str(other)), python=shlex.join(rank)))
    wrapper.chmod(0o755)
    args = [str(ROOT / "train_dpo.py"), "--config", str(ROOT / "configs" / "smoke.yaml")]
    args += ["--model_name_or_path", "tiny/olmo"]
    args += ["--dataset_name", str(data), "--output_dir", str(tmp_path / "run"), "--report_to", "none"]
    args += ["--max_steps", "2", "--max_length", "512", "--save_strategy", "no"]
    args += ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj"] if lora else []
    args += ["--precompute_ref_log_probs", "false", "--health_checks", "false"] if live else []
    launcher = [*accelerate_launch(), "--config_file", str(ddp_config(tmp_path)), "--num_processes", "2"]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    env |= {"HF_HUB_CACHE": str(same), "DPOTRAIN_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [*launcher, "--no_python", str(wrapper), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0, result.stdout[-4000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    said = errors[0] if len(errors) == 1 else result.stdout[-4000:]
    assert said.startswith("error: ranks disagree on the model's weights: rank 1 has "), said
    assert errors[0].endswith(agreement.FIXES["the model's weights"]), errors
    assert "reference log-probs" not in result.stdout, result.stdout[-4000:]  # nothing scored, nothing cached
    assert not list((tmp_path / "cache").glob("reference/*/*"))


def test_ranks_that_measured_the_lengths_into_node_local_caches_at_other_paths_agree(
    tmp_path, tiny_model_dir, monkeypatch
):
    """`max_length: auto` measures every pair into the analyzer's cache (DPOTRAIN_CACHE), node-local on some clusters
    and at another path on each node (`/scratch/$SLURMD_NODENAME/...`). The forward each rank decided was compared with
    the path its lengths were read from, so ranks that decided the same forward from the same lengths were refused
    ("ranks disagree on the forward", told to see the same analyzer cache). What was decided is compared, not where."""
    import datasets

    from dpotrain import stages
    from dpotrain.data import builtin
    from dpotrain.train import agreement

    train = datasets.Dataset.from_list(builtin.make_preference_rows(40, seed=3))

    def first_half(cache: str) -> dict:
        monkeypatch.setenv("DPOTRAIN_CACHE", str(tmp_path / cache))
        recipe = smoke_recipe(tmp_path / "run", tiny_model_dir, "--max_length", "auto")
        launch = stages.checks(recipe)
        spec = stages.first_half(recipe, launch, pairs=stages.given_pairs(recipe, launch, train, None))
        assert spec.lengths.auto is not None and spec.forward.planned is not None  # measured: the forward weighed them
        return agreement.first_half_values(spec)

    node1, node2 = first_half("node1"), first_half("node2")
    assert [name for name in node1 if node1[name] != node2[name]] == []
