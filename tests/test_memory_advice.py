"""A memory refusal's advice closes the loop (dpotrain/plan/memory_advice.py): every option it prints, typed as printed,
gives a dry run whose plan fits; it never offers a lever that is already pulled."""

import re
import shlex
from pathlib import Path
from unittest.mock import ANY

import pytest

import train_dpo
from conftest import ROOT, submitted
from dpotrain.recipe.errors import ConfigError

MODELS = ROOT / "configs" / "models"
SHIPPED_ZERO3 = "configs/accelerate/zero3.yaml"
RECIPES = {"7b": ("think.yaml", "olmo3-7b"), "32b": ("think-32b.yaml", "olmo3-32b")}
OPTION = re.compile(r"\[\d+\] (.*?) \(~([\d.]+) GiB\)(?:: `([^`]*)`)?(?=; \[| \(the plan|$)")

pytestmark = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="plans for gpu_memory_gib; a GPU here would be planned instead"
)


def command(size: str, gib: int, tmp_path, *extra) -> list[str]:
    recipe, model = RECIPES[size]
    return [
        "--config",
        str(ROOT / "configs" / recipe),
        "--model_name_or_path",
        str(MODELS / model),
        "--output_dir",
        str(tmp_path / "run"),
        "--gpu_memory_gib",
        str(gib),
        "--dry-run",
        *extra,
    ]


def refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        train_dpo.main(argv)
    return str(info.value)


def options(error: str, argv: list[str]) -> list[tuple[list[str], dict, list[str], float]]:
    """Each printed option of the refusal of `argv` as (flags to add, environment of the launch it names, the dry run
    that checks it, its GiB): the refused command with the flags; or, for an sbatch command, what scripts/launch.sh
    plans that job with (WORLD_SIZE, GPUS_PER_NODE, its train_dpo.py arguments and --dry-run), which must be the
    refused command's arguments (its --config first), the flags and the engine's --accelerate_config."""
    assert "these fit: " in error, error
    found = []
    for text, gib, sbatch in OPTION.findall(error.split("these fit: ", 1)[1]):
        flags, run = edited(text, argv) if text.startswith(("add `", "change `")) else (words_in(text), None)
        env, run = {}, run or [*argv, *flags]
        if sbatch:
            launched = submitted(sbatch, Path.cwd())
            per_node = launched["processes"] // launched["machines"]
            env = {"WORLD_SIZE": str(launched["processes"]), "GPUS_PER_NODE": str(per_node)}
            run = [*launched["train"], "--dry-run"]
            config, *kept = [word for word in argv[1:] if word != "--dry-run"]  # the job's own dry run adds it
            recipe, *train = launched["train"][1:]  # RECIPE, or the script's own: read in the project
            assert (ROOT / recipe).resolve() == (ROOT / config).resolve(), sbatch
            assert train == [*kept, *flags, "--accelerate_config", launched["config"]], sbatch
        found.append((flags, env, run, float(gib)))
    assert found, error
    return found


def words_in(text: str) -> list[str]:
    """The words of an option's first `...` (an engine's "with `flags`"), none where it has none."""
    return shlex.split(text.split("`")[1]) if "`" in text else []


def edited(text: str, argv: list[str]) -> tuple[list[str], list[str]]:
    """(the flags an option gives, the refused command as its words edit it): "add `A`" appended, "change `Y` to `Z`"
    each of Y's flags (with its value) taken out of the command, Z added in their place."""
    run, given = list(argv), []
    if change := re.search(r"change `([^`]*)` to `([^`]*)`", text):
        for typed in re.split(r" (?=--)", change[1]):  # each typed flag with its value, as the command has them
            words = shlex.split(typed)
            at = next(i for i in range(len(run)) if run[i : i + len(words)] == words)
            del run[at : at + len(words)]
        given += shlex.split(change[2])
    if add := re.match(r"add `([^`]*)`", text):
        given = shlex.split(add[1]) + given
    return given, [*run, *given]


@pytest.mark.slow
@pytest.mark.parametrize("size", ["7b", "32b"])
@pytest.mark.parametrize("gib", [24, 40, 80])
def test_every_option_of_a_refusal_gives_a_dry_run_that_fits(size, gib, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("GPUS_PER_NODE", raising=False)
    argv = command(size, gib, tmp_path)
    error = refusal(argv)
    assert error.startswith("memory plan: "), error
    for flags, env, run, gib_printed in options(error, argv):
        with monkeypatch.context() as m:
            for name, value in env.items():
                m.setenv(name, value)
            train_dpo.main(run)  # raises if the plan does not fit
        summary = capsys.readouterr().out
        planned = re.search(r"^  memory/GPU:\s+(.*)$", summary, re.MULTILINE).group(1)
        verdict = re.search(r"^  GPU:\s+(.*)$", summary, re.MULTILINE).group(1)
        assert planned.startswith(f"~{gib_printed:.1f} GiB") and verdict.startswith(f"fits one {gib:.1f} GiB GPU"), (
            flags,
            env,
            planned,
            verdict,
        )


@pytest.mark.slow  # 4 s measured on the 2-core VM at load ~1: the planner's search, dry run by dry run
def test_a_lever_already_pulled_is_not_offered_again(tmp_path):
    """LoRA already on (the issue's second command): the advice no longer offers it, and every option it does offer
    is another change."""
    lora = ["--use_peft", "true", "--lora_target_modules", "all-linear"]
    argv = command("7b", 24, tmp_path, *lora)
    error = refusal(argv)
    for flags, env, _, _ in options(error, argv):  # what each adds (its command repeats LoRA and all)
        assert (flags or env) and "--use_peft" not in flags, error


@pytest.mark.slow  # 16 s measured on the 2-core VM at load ~1: the planner's search, dry run by dry run
def test_a_shorter_max_length_is_offered_only_where_nothing_keeps_the_pairs_whole(tmp_path):
    # An 80 GiB GPU: a smaller token budget fits without cutting a single pair.
    error = refusal(command("7b", 80, tmp_path))
    assert "--max_tokens_per_microbatch 32768" in error and "--max_length" not in error, error
    # 24 GiB: sequence parallelism keeps the pairs whole (each GPU holds 1/N of a micro-batch's positions).
    argv = command("7b", 24, tmp_path)
    for flags, _, _, _ in options(refusal(argv), argv):
        assert "--sequence_parallel_size" in flags and "--max_length" not in flags, flags
    # Padded rows cannot be split: nothing short of a shorter max_length does; each option then names both numbers (a
    # pair per budget).
    argv = command("7b", 24, tmp_path, "--padding_free", "false")
    for flags, _, _, _ in options(refusal(argv), argv):
        assert "--sequence_parallel_size" not in flags, flags
        length = int(flags[flags.index("--max_length") + 1])
        assert int(flags[flags.index("--max_tokens_per_microbatch") + 1]) == 2 * length


@pytest.mark.slow  # 6 s measured on the 2-core VM at load ~1: the planner's search, dry run by dry run
def test_a_live_reference_that_does_not_fit_is_offered_the_cached_one_first(tmp_path, capsys, monkeypatch):
    """`--precompute_ref_log_probs false` on 100 GiB: the reference model's weights (13.6 GiB under ZeRO-2) tip the plan
    over; the reference stage's cached log-probs train the same without them, so that change comes first, and its dry
    run fits. TR-DPO needs its live reference (it is updated): never offered there."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    argv = command("7b", 100, tmp_path, "--precompute_ref_log_probs", "false")
    error = refusal(argv)
    change = "[1] change `--precompute_ref_log_probs false` to `--precompute_ref_log_probs true` (~"
    assert "live reference model" in error and change in error, error
    _, _, run, gib = options(error, argv)[0]
    train_dpo.main(run)  # raises if the plan does not fit
    assert f"memory/GPU:    ~{gib:.1f} GiB" in capsys.readouterr().out
    synced = refusal(command("7b", 100, tmp_path, "--sync_ref_model", "true"))
    assert "these fit: " in synced and "--precompute_ref_log_probs" not in synced, synced


@pytest.mark.slow  # the planner's search, dry run by dry run
def test_without_a_token_budget_fewer_pairs_per_micro_batch_is_offered_first(tmp_path, capsys, monkeypatch):
    """`--max_tokens_per_microbatch none` (the README's way to AOT): micro-batches of TRL's 8 pairs per GPU need ~227
    GiB on a B200, and the refusal offered only 2-4 nodes with LoRA, though 4 pairs a micro-batch fit the one node with
    the same 128 pairs per step. The advice's "fewer tokens per micro-batch" is then fewer pairs per micro-batch, typed
    as the flags that keep the recipe's pairs per step (docs/running.md), and its dry run fits as printed."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("GPUS_PER_NODE", raising=False)
    argv = command("7b", 179, tmp_path, "--max_tokens_per_microbatch", "none")
    error = refusal(argv)
    # the token budget typed as the option keeps it: not given again
    assert "[1] add `--per_device_train_batch_size 4 --pairs_per_step 128` (~" in error, error
    _, _, run, gib = options(error, argv)[0]
    train_dpo.main(run)  # raises if the plan does not fit
    summary = capsys.readouterr().out
    assert f"memory/GPU:    ~{gib:.1f} GiB" in summary and "per step:      128 pairs, over all processes\n" in summary
    # The batch flag alone on the command line (it replaces the recipe's pairs per step and token budget): the option
    # keeps the 32 pairs a step it gives, and runs as printed
    argv = command("7b", 179, tmp_path, "--per_device_train_batch_size", "8")
    error = refusal(argv)
    assert (
        "[1] add `--pairs_per_step 32 --max_tokens_per_microbatch none`, and change `--per_device_train_batch_size 8` "
        "to `--per_device_train_batch_size 4` (~"
    ) in error, error
    _, _, run, gib = options(error, argv)[0]
    train_dpo.main(run)
    summary = capsys.readouterr().out
    assert f"memory/GPU:    ~{gib:.1f} GiB" in summary and "per step:      32 pairs, over all processes\n" in summary


def test_another_engine_on_fewer_gpus_than_a_node_names_a_launch_that_exists(monkeypatch):
    """One process refused, another engine fitting on that one GPU: the advice said "fits on 1 GPU (0 nodes: ...
    sbatch --nodes=0 --gpus-per-node=4)" and a dry run line of WORLD_SIZE=1 GPUS_PER_NODE=4, which no launch is."""
    from dpotrain.plan.memory_advice import Option

    monkeypatch.chdir(ROOT)
    option = Option(("zero3",), (), "zero3", SHIPPED_ZERO3, 1, 4, 30.0, True, None)
    text = option.text(("--config", "configs/smoke.yaml"))
    assert text.startswith("DeepSpeed ZeRO-3 fits on 1 GPU (1 node) (~30.0 GiB): `"), text
    launched = submitted(text.split("`")[1], ROOT)
    assert (launched["machines"], launched["processes"]) == (1, 1), text
    eight = Option(("nodes",), (), "zero3", SHIPPED_ZERO3, 8, 4, 30.0, True, None)
    assert eight.text(("--config", "configs/smoke.yaml")).startswith("DeepSpeed ZeRO-3 fits on 8 GPUs (2 nodes) (~")


@pytest.mark.parametrize("where", ["project", "elsewhere", "job"])
def test_a_suggested_submission_runs_the_refused_command_with_the_option(tmp_path, monkeypatch, where):
    """An option on another engine or node count printed `ACCELERATE_CONFIG=configs/accelerate/zero3.yaml sbatch
    --nodes=2 --gpus-per-node=4`: no batch script, and none of the refused command's arguments nor the option's own
    flags, so pasted (with dpo_train.sh) it trained think.yaml's defaults. Now a whole command: pasted where the refused
    command ran (typed in the project, typed elsewhere, or refused inside a job: the folder it was submitted from),
    Slurm and scripts/launch.sh launch the option's engine on its GPUs, with the recipe, the arguments and the flags
    the refusal planned, and no dry run."""
    from dpotrain.plan.memory_advice import Option

    user = ["--model_name_or_path", "org/my sft", "--learning_rate", "8e-8"]
    option = Option(
        ("zero3", "nodes"), ("--max_tokens_per_microbatch", "16384"), "zero3", SHIPPED_ZERO3, 8, 4, 60.0, True, 16384
    )
    folder, recipe = tmp_path / "submitted-from", ROOT / "configs" / "think-32b.yaml"
    folder.mkdir()
    if where == "project":  # the README's dry run
        monkeypatch.chdir(ROOT)
        folder, typed = ROOT, ["--config", "configs/think-32b.yaml", *user, "--dry-run"]
    elif where == "elsewhere":  # a recipe of the user's own, in the folder the dry run is typed in
        recipe = folder / "my recipe.yaml"
        recipe.write_text((ROOT / "configs" / "instruct.yaml").read_text())
        monkeypatch.chdir(folder)
        typed = ["--config", "my recipe.yaml", *user, "--dry_run=true", "--accelerate_config", "my.yaml"]
    else:  # the dry run scripts/launch.sh runs in the project, for a job submitted from `folder`
        monkeypatch.chdir(ROOT)
        monkeypatch.setenv("DPOTRAIN_SUBMIT_DIR", str(folder))
        recipe = ROOT / "configs" / "think.yaml"  # dpo_train.sh's own: no RECIPE needed
        typed = ["--config", "configs/think.yaml", *user, "--accelerate_config", "accelerate_config.yaml"]
        typed += ["--dry-run", "--json"]
    text = option.text(tuple(typed))
    command = re.search(r"`([^`]*\bsbatch [^`]*)`", text)
    assert command, text
    launched = submitted(command.group(1), folder)
    assert (launched["machines"], launched["processes"]) == (2, 8), text
    train = launched["train"]
    in_job = lambda path: (ROOT / path).resolve()  # noqa: E731  (the job runs in the project)
    assert in_job(launched["config"]) == in_job(SHIPPED_ZERO3) and train[0] == "--config", text
    assert in_job(train[1]) == recipe.resolve(), text
    assert train[2:] == [*user, "--max_tokens_per_microbatch", "16384", "--accelerate_config", launched["config"]]
    if where == "project":  # as short as that: relative paths, RECIPE for a recipe not the script's own
        assert command.group(1) == (
            "ACCELERATE_CONFIG=configs/accelerate/zero3.yaml RECIPE=configs/think-32b.yaml sbatch --nodes=2 "
            "--gpus-per-node=4 scripts/dpo_train.sh --model_name_or_path 'org/my sft' --learning_rate 8e-8 "
            "--max_tokens_per_microbatch 16384"
        ), text
        # A `--dry_run false` that turned off a recipe's dry run stays: dropped, the job would only plan
        kept = option.text(("--config", "configs/think.yaml", "--dry_run", "false", "--json"))
        assert kept.endswith(" scripts/dpo_train.sh --dry_run false --max_tokens_per_microbatch 16384`"), kept


def test_a_flag_the_option_sets_is_given_once_in_its_sbatch_command(monkeypatch):
    """The refused command's `--max_tokens_per_microbatch 65536` stayed in the printed sbatch command beside the
    option's `--max_tokens_per_microbatch 49152`, and the job warned "given twice": the user's value, with its words as
    the parser takes them (`=`, either spelling, a list flag's several), now gives way to the option's."""
    from dpotrain.plan.memory_advice import Option

    monkeypatch.chdir(ROOT)
    flags = ("--max_tokens_per_microbatch", "49152", "--activation_checkpointing", "true", "--loss_type", "sigmoid")
    option = Option(("zero3",), flags, "zero3", SHIPPED_ZERO3, 4, 4, 70.0, True, 49152)
    typed = ["--config", "configs/think.yaml", "--max-tokens-per-microbatch", "65536", "--learning_rate", "8e-8"]
    typed += ["--activation_checkpointing=false", "--loss_type", "sigmoid", "bco_pair", "--seed", "3"]
    text = option.text(tuple(typed))
    launched = submitted(text.split("`")[-2], ROOT)
    assert launched["train"][2:] == ["--learning_rate", "8e-8", "--seed", "3", *flags, "--accelerate_config", ANY], text


def test_a_launched_runs_refusal_names_the_jobs_own_accelerate_config_for_its_engine(tmp_path, monkeypatch):
    """Inside a job (the engine read from `accelerate launch`'s environment), an option on more nodes of the same
    engine named the shipped accelerate_config.yaml, not the job's own `--accelerate_config my_accel.yaml` that
    scripts/launch.sh passes train_dpo.py. Now the job's, where it names the engine that runs; another engine's option
    still names the shipped config for that engine."""
    from dpotrain.cluster import engine
    from dpotrain.plan import memory
    from dpotrain.recipe.config import parse_args

    own = tmp_path / "my_accel.yaml"  # ZeRO-2, as the shipped one, under the user's own name
    own.write_text(
        (ROOT / "accelerate_config.yaml").read_text().replace("ds_config.json", str(ROOT / "ds_config.json"))
    )
    recipe = parse_args([*command("7b", 80, tmp_path), "--accelerate_config", str(own)])
    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "GPUS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_config.json"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    launched = engine.launched()
    assert launched.name == "zero2" and launched.source.startswith(engine.LAUNCHED)
    with pytest.raises(ConfigError) as refused:
        memory.plan(recipe, 4, launched)
    error = str(refused.value)
    assert f"DeepSpeed ZeRO-2 fits on 20 GPUs (5 nodes) (~79.9 GiB): `ACCELERATE_CONFIG={own} sbatch" in error, error
    assert f"ACCELERATE_CONFIG={SHIPPED_ZERO3} sbatch" in error, error


def test_an_option_given_to_add_replaces_the_flags_the_command_typed_for_its_fields(monkeypatch):
    """A refusal of `... --max_tokens_per_microbatch 65536 --activation_checkpointing false` said "add
    `--max_tokens_per_microbatch 16384 --activation_checkpointing true`": pasted as printed, the command gave both
    fields twice (a "given twice" warning each, the last counting). It now says which typed words to change, and adds
    only the rest; an older spelling of a field (`--gradient_checkpointing`) is the same field, in its sbatch command
    too."""
    from dpotrain.plan.memory_advice import Option

    monkeypatch.chdir(ROOT)
    flags = ("--precompute_ref_log_probs", "true", "--max_tokens_per_microbatch", "16384")
    flags += ("--activation_checkpointing", "true")
    typed = ("--config", "configs/think.yaml", "--max-tokens-per-microbatch=65536", "--seed", "3")
    typed += ("--gradient_checkpointing", "false")
    text = Option(("cached", "tokens"), flags, "zero2", "accelerate_config.yaml", 4, 4, 70.0, False, 16384).text(typed)
    assert text == (
        "add `--precompute_ref_log_probs true`, and change `--max-tokens-per-microbatch=65536 --gradient_checkpointing "
        "false` to `--max_tokens_per_microbatch 16384 --activation_checkpointing true` (~70.0 GiB)"
    ), text
    moved = Option(("zero3",), flags, "zero3", SHIPPED_ZERO3, 8, 4, 70.0, True, 16384).text(typed)
    launched = submitted(moved.split("`")[-2], ROOT)
    assert launched["train"][2:] == ["--seed", "3", *flags, "--accelerate_config", ANY], moved
