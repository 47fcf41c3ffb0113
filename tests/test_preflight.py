"""The preflight on the tiny model: a doomed data set fails (exit 3), a balanced one passes, bad outputs are refused.

A random-init model finds every token about equally unlikely (~ln 1024 nats), so it cannot tell styles apart. The
fixture first fine-tunes it briefly on one style (the "careful" answers of the bundled data): pairs whose chosen side
is long gibberish against rejected answers in that style then look like 001's data to it.
"""

import json
import random
import shutil
import subprocess

import pytest

from conftest import ROOT, python, warm_venv
from dpotrain.data import builtin
from dpotrain.preflight import PREFLIGHT_FAIL_EXIT

PREFLIGHT = str(ROOT / "scripts" / "preflight.py")
SMOKE = str(ROOT / "configs" / "smoke.yaml")


def careful(rng: random.Random, a: int, b: int, topic: str = "rivers") -> str:
    facts = " ".join(rng.sample(builtin._FACTS, 3))
    return f"Let us work it out step by step: {a} + {b} = {a + b}.\n\nThe answer is {a + b}.\n\nAbout {topic}: {facts}"


@pytest.fixture(scope="module")
def styled_model(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model after a short SFT on careful answers (measured: ~-1 nat/token on them, ~-7 on gibberish)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    texts = [
        tok.apply_chat_template(
            [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": careful(rng, a, b)},
            ],
            tokenize=False,
        )
        for a, b in ((rng.randint(2, 99), rng.randint(2, 99)) for _ in range(256))
    ]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(60):
        batch = tok(texts[(step * 8) % 256 : (step * 8) % 256 + 8], return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("styled") / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def write_pairs(path, chosen_fn, rejected_fn, n=48):
    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            prompt = [{"role": "user", "content": f"What is {a} plus {b}?"}]
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "chosen": [{"role": "assistant", "content": chosen_fn(rng, a, b)}],
                        "rejected": [{"role": "assistant", "content": rejected_fn(rng, a, b)}],
                    }
                )
                + "\n"
            )
    return str(path)


def gibberish(rng: random.Random, a: int, b: int) -> str:
    """Long, and nothing like what the model writes: 001's chosen side, seen from its base model."""
    return " ".join("".join(rng.choices("qxzjvkwy", k=rng.randint(3, 9))) for _ in range(120))


def preflight(*args, script=PREFLIGHT):
    return subprocess.run([python(), script, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~60 s on 2 busy cores with the fixture's SFT
def test_chosen_far_from_the_model_and_much_longer_fails(tmp_path, styled_model):
    data = write_pairs(tmp_path / "doomed.jsonl", gibberish, careful)
    report, png = tmp_path / "report.json", tmp_path / "gaps.png"
    result = preflight(
        "--config",
        SMOKE,
        "--model_name_or_path",
        styled_model,
        "--dataset_name",
        data,
        "--sample",
        "32",
        "--json",
        str(report),
        "--plot",
        str(png),
    )
    assert result.returncode == PREFLIGHT_FAIL_EXIT, result.stdout + result.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["verdict"] == "fail" and r["pairs"] == 32
    assert r["gap_per_token"]["p90"] < -2.5  # past the critical per-token threshold, as 001's -4.4
    assert r["gap_summed"]["p50"] < -500 and r["past_thresholds"]["per_token"]["critical"] == 1.0
    assert r["length_ratio"]["p50"] > 2
    assert any("far LESS likely" in x for x in r["reasons"]) and any("SFT" in x for x in r["advice"])
    assert "## Verdict: FAIL" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_balanced_pairs_pass_through_train_dpo_preflight(tmp_path, styled_model):
    # Same style and length on both sides, never identical (another topic on the rejected side).
    data = write_pairs(tmp_path / "balanced.jsonl", careful, lambda rng, a, b: careful(rng, a, b, "forests"))
    result = preflight(
        "--config",
        SMOKE,
        "--model_name_or_path",
        styled_model,
        "--dataset_name",
        data,
        "--preflight",
        "--bf16",
        "false",
        script=str(ROOT / "train_dpo.py"),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "## Verdict: OK" in result.stdout, result.stdout
    assert "48 pairs scored of 48 sampled" in result.stdout


def test_a_mixtures_upsampling_is_no_duplicate_to_remove(tmp_path):
    """A mixture source at amount 2.0 holds each of its pairs twice by design: the report counted those repeats as
    duplicate pairs and advised "deduplicate the data set". Only a pair the data itself repeats is one."""
    from dpotrain import preflight as checks
    from dpotrain import stages
    from dpotrain.recipe.config import parse_args

    rng = random.Random(0)
    rows = [(f"What is {a} plus 1?", careful(rng, a, 1), careful(rng, a, 2, "forests")) for a in range(22)]
    upsampled = write_rows(tmp_path / "a.jsonl", [*rows[:12], rows[0]])  # one pair given twice
    other = write_rows(tmp_path / "b.jsonl", rows[12:])
    recipe = tmp_path / "mix.yaml"
    mixer = f"dataset_mixer_list: [{upsampled}, '2.0', {other}, '1.0']\n"
    recipe.write_text(f"model_name_or_path: builtin:tiny-olmo3\nbf16: false\n{mixer}")
    recipe = parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "never")])
    pairs = stages.load_data(recipe, stages.checks(recipe), say=False)
    quality = checks.data_quality(pairs)
    assert (quality["quality_rows"], quality["duplicates"], quality["upsampled_repeats"]) == (36, 1, 13)


def write_rows(path, rows) -> str:
    """(question, chosen, rejected) as pairs of message lists sharing the user turn, one per line."""
    with open(path, "w") as f:
        for question, chosen, rejected in rows:
            user = {"role": "user", "content": question}
            pair = {
                k: [user, {"role": "assistant", "content": v}] for k, v in (("chosen", chosen), ("rejected", rejected))
            }
            f.write(json.dumps(pair) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plot", "gaps.jpg"], "ending in .png"),
        (["--json", "/nonexistent/dir/r.json"], "does not exist"),
        (["--json", "/tmp"], "--json '/tmp' is a folder"),  # was an IsADirectoryError once the model had scored
        # was numpy's traceback drawing the sample; the recipe's seed too, refused as the run refuses it
        (["--seed", "-1", "--sample", "8"], "seed -1 is out of range: give one from 0 to 2**32 - 1"),
        (["--sample", "0"], "--sample must be >= 1"),
        (["--json", "gaps.png", "--plot", "gaps.png"], "--json and --plot name the same file 'gaps.png'"),
        (["--betta", "5"], "unknown argument '--betta' (did you mean '--beta'?)"),
        (["--chat_template_path", "/nonexistent/t.jinja"], "chat_template_path '/nonexistent/t.jinja' does not exist"),
        # Offline (HF_HUB_OFFLINE=1 here), not cached: the run's line with the prefetch command; it said the model
        # folder needed its tokenizer files, and of a data set datasets' OfflineModeIsEnabled, naming no fix
        (["--model_name_or_path", "org/uncached"], "model 'org/uncached' is not cached. On a login node with network"),
        (["--dataset_name", "org/uncached-pairs"], "dataset 'org/uncached-pairs': not cached. On a login node with"),
        # The model loaded and the sample scored for a command that also asked to load nothing (exit 0)
        (["--dry-run"], "--dry-run with the preflight: a dry run loads nothing"),
    ],
)
def test_bad_input_is_refused_before_loading(args, message, tmp_path, capfd):
    # The script's own command line, run in this process (its imports are paid once per session); capfd reads what
    # reaches the process's stdout and stderr, progress bars of a model load included.
    import importlib.util

    from dpotrain.recipe.errors import run_cli

    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main(["--config", SMOKE, "--output_dir", str(tmp_path / "never"), *args]))
    out, err = capfd.readouterr()
    assert ended.value.code == 2 and message in err, err
    assert "Loading weights" not in out + err and not (tmp_path / "never").exists()


def test_a_report_inside_the_data_folder_is_refused_before_loading(tmp_path, capfd):
    """The preflight's `--json` inside the folder of data files it reads would be read as pairs by the next run."""
    folder = tmp_path / "shards"
    folder.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", folder / "a.jsonl")
    path = str(folder / "gaps.json")
    test_bad_input_is_refused_before_loading(
        ["--dataset_name", str(folder), "--json", path],
        f"error: --json {path!r} is inside the data folder",
        tmp_path,
        capfd,
    )
    assert [p.name for p in folder.iterdir()] == ["a.jsonl"]


def test_a_model_folder_without_weights_is_refused_by_the_script_before_the_data_is_read(
    tmp_path, tiny_model_dir, capfd
):
    """scripts/preflight.py on a model folder whose weights are not there yet (copied without model.safetensors):
    `train_dpo.py --preflight` refused it in one line, the script read and checked the whole data set, then ended in
    transformers' `OSError: Error no file named model.safetensors ...` traceback at the model's load."""
    import importlib.util
    import shutil

    from dpotrain.recipe.errors import run_cli

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main(["--config", SMOKE, "--model_name_or_path", str(model), "--sample", "8"]))
    out, err = capfd.readouterr()
    assert ended.value.code == 2 and f"model folder '{model}' holds a config.json but no weights" in err, err
    assert "Traceback" not in err and "Reading train pairs" not in err  # before the data set is read


def test_stdout_holds_the_report_alone(tmp_path, tiny_model_dir, capfd):
    """`python scripts/preflight.py ... > report.md` ("Markdown goes to stdout"): the stages' own lines (`Forward:`,
    `Plan:`, `Cut at max_length`, `reference log-probs`) came first in the file, before `# DPO preflight`. They go to
    stderr, as a dry run's do.

    max_length 40 drops some of the 8 pairs (their prompt fills it), and the rest make one step of the sample, with
    the recipe's 5 warm-up steps: the run's schedule checked on the sample refused it ("warmup_steps makes 5 warm-up
    steps of the run's 1", "this run would train nothing"), though the run trains 44 steps on the whole data set."""
    import importlib.util

    from dpotrain.recipe.errors import run_cli

    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--sample", "8"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main([*argv, "--max_length", "40", "--warmup_steps", "5"]))
    out, err = capfd.readouterr()
    assert ended.value.code == 0, err[-3000:]
    assert out.startswith("# DPO preflight\n"), out[:2000]
    assert "Plan: " in err and "reference log-probs (train)" in err and "Cut at max_length" in err
    assert "dropped (prompt alone fills max_length): 0 of 8" not in out  # some were: the case above


def test_a_recipe_that_splits_pairs_over_a_group_is_scored_whole_in_one_process(tmp_path, tiny_model_dir, capfd):
    """`PREFLIGHT=1 sbatch scripts/dpo_train.sh --sequence_parallel_size 2` (a long-trace recipe): the preflight, one
    process, was refused with "sequence_parallel_size 2 does not divide the 1 process", which ended the job before
    training. It scores each pair whole in its one process."""
    import importlib.util

    from dpotrain.recipe.errors import run_cli

    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--sample", "8", "--sequence_parallel_size", "2"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main(argv))
    out, err = capfd.readouterr()
    assert ended.value.code == 0, err[-3000:]
    assert "Preflight: scoring in one process, each pair whole (the run splits it over 2)" in err
    assert "8 pairs scored of 8 sampled" in out


@pytest.mark.slow  # ~15 s: a 134M-parameter model built, then scored on the CPU
def test_a_model_that_trains_only_on_several_gpus_is_still_scored_on_one(tmp_path, tiny_model_dir, capfd):
    """The preflight loads the weights and runs forward passes; the memory plan it made is training's (one process's
    gradients and AdamW states), and its refusal ended the preflight of every model that trains only on several GPUs
    (`python scripts/preflight.py --config configs/think.yaml` with OLMo 3 7B on an H100: ~170 GiB planned), advising
    sbatch commands. Here bf16 on the CPU (`--use_cpu true`) stands for a GPU node, `--gpu_memory_gib 6` for its GPU:
    training plans ~7.2 GiB (2.0 of model states), the weights are 0.5."""
    import importlib.util

    from conftest import tiny_model
    from dpotrain.recipe.errors import run_cli

    shape = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8, head_dim=128)
    model = tiny_model("olmo3", tmp_path / "model", tiny_model_dir, num_key_value_heads=8, **shape)
    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    gpu = ["--bf16", "true", "--use_cpu", "true", "--gpu_memory_gib", "6"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: script.main(["--config", SMOKE, "--model_name_or_path", model, "--sample", "8", *gpu]))
    out, err = capfd.readouterr()
    assert "memory plan" not in err and ended.value.code == 0, err[-3000:]
    assert "8 pairs scored of 8 sampled" in out


def test_train_dpo_given_dry_run_and_preflight_refuses_before_anything_loads(tmp_path, capfd):
    """`train_dpo.py --dry-run --preflight`: the preflight ran in the dry run's place, on its planned launch, loaded
    the model and scored the sample (bf16 on a CPU where the recipe asked for it), its report on stderr, exit 0."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    argv = ["--config", SMOKE, "--output_dir", str(tmp_path / "never"), "--dry-run", "--preflight"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    out, err = capfd.readouterr()
    assert ended.value.code == 2 and "error: --dry-run with the preflight" in err, err[-3000:]
    assert "Checking duplicate pairs" not in err and "# DPO preflight" not in out + err


def test_train_dpo_given_json_and_preflight_names_the_scripts_json_not_dry_run(tmp_path, capfd):
    """`train_dpo.py --preflight --json` was told "add --dry-run", which the preflight then refused ("--dry-run with
    the preflight: drop --dry-run"): a circle. The preflight's JSON is scripts/preflight.py's --json FILE."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    argv = ["--config", SMOKE, "--output_dir", str(tmp_path / "never"), "--preflight", "--json"]
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(argv))
    out, err = capfd.readouterr()
    assert ended.value.code == 2 and "add --dry-run" not in err, err[-3000:]
    assert "error: --json prints the dry run's resolved configuration: the preflight is no dry run" in err
    assert "scripts/preflight.py --json FILE" in err and "# DPO preflight" not in out + err


def test_train_dpo_given_the_preflight_scripts_own_options_names_the_script():
    """`train_dpo.py --preflight --sample 128`: answered "unknown argument '--sample'" alone, where the option is
    scripts/preflight.py's (its --plot too). Named with the command that takes it, which does take them."""
    import importlib.util

    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError

    for flag in ("--sample", "--plot"):
        with pytest.raises(ConfigError) as refused:
            parse_args(["--config", SMOKE, "--preflight", flag, "128"])
        assert str(refused.value) == (
            f"unknown argument {flag!r} (an option of scripts/preflight.py: run `python scripts/preflight.py` with the "
            f"same arguments and {flag} instead of train_dpo.py --preflight, which scores the preflight's default "
            "sample); see train_dpo.py --help"
        )
    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name in ("sample", "plot"):
        own, rest = script.parse_own([f"--{name}", "128"])
        assert str(getattr(own, name)) == "128" and rest == []


@pytest.mark.slow
def test_launch_sh_preflight_ends_a_doomed_job_before_the_launch(tmp_path, tiny_model_dir):
    """PREFLIGHT=1 in the batch shell: a fail stops the job before srun. With the summed sigmoid loss, chosen
    gibberish 10x longer than the rejected answers is doomed even for the random-init model (~-7 nats per token)."""
    import os

    data = write_pairs(tmp_path / "doomed.jsonl", gibberish, careful, n=16)
    result = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "launch.sh"),
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name",
            data,
            "--loss_type",
            "sigmoid",
            "--output_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        # the dry run and the preflight on the warm interpreter: launch.sh's lines around them are under test; a job's
        # id (no Slurm answers about it): outside one, launch.sh refuses the job before planning it
        env={
            **os.environ,
            "RECIPE": "configs/smoke.yaml",
            "PREFLIGHT": "1",
            "VENV": warm_venv(),
            "SLURM_JOB_ID": "4242",
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "## Verdict: FAIL" in result.stdout and "error: preflight exited 3" in result.stderr
    assert "launch: srun" not in result.stdout  # the training launch never started


@pytest.mark.slow
def test_a_job_given_preflight_runs_the_preflight_alone_and_ends_with_its_code(tmp_path, tiny_model_dir):
    """`sbatch scripts/dpo_train.sh --preflight` (train_dpo.py's flag: the preflight instead of training): launch.sh
    ran it inside the job's dry run, where it printed its report in place of the plan, and the job failed with exit 2
    on "the dry run's output: not a run's record (JSONDecodeError ...)" whatever the verdict. It runs as PREFLIGHT=1
    runs it, on the batch node, and that is the whole job: the report in the log, the preflight's code, no launch."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PREFLIGHT"))}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch.sh"), "--model_name_or_path", tiny_model_dir, "--preflight"],
        cwd=tmp_path,
        env={**env, "RECIPE": "configs/smoke.yaml", "VENV": warm_venv()},  # the preflight warm
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "## Verdict: " in result.stdout and "not a run's record" not in result.stderr, result.stderr[-2000:]
    assert "launch: srun" not in result.stdout


def test_the_scripts_seed_is_the_recipes_seed_too(tmp_path, tiny_model_dir, capfd):
    """launch.sh's PREFLIGHT=1 passes the run's own flags to scripts/preflight.py, whose `--seed` took a run's
    `--seed 7` for the sample alone: a mixture was drawn with the recipe's seed (other rows than the run trains on)
    under a report that said seed 7. It is the recipe's seed too, as `train_dpo.py --preflight --seed 7` takes it.

    The real preflight, twice, on 12 of the bundled pairs drawn by a mixture with the recipe's seed (each whole
    sample scored): `--seed 7` on a recipe of seed 42 scores and reports what a recipe of seed 7 does without --seed
    (whose report says the recipe's seed). With the recipe's seed left at 42 the first drew other pairs."""
    import functools
    import importlib.util

    from dpotrain.recipe.errors import run_cli

    spec = importlib.util.spec_from_file_location("preflight_script", PREFLIGHT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    mixer = f"dataset_mixer_list: [{ROOT / 'data' / 'smoke_prefs.jsonl'}, '12']\n"
    reports = {}
    for seed, flags in ((42, ["--seed", "7"]), (7, [])):
        recipe = tmp_path / f"seed{seed}.yaml"
        recipe.write_text(f"model_name_or_path: {tiny_model_dir}\nbf16: false\nseed: {seed}\n{mixer}")
        report = tmp_path / f"seed{seed}.json"
        argv = ["--config", str(recipe), "--output_dir", str(tmp_path / "never"), "--json", str(report), *flags]
        with pytest.raises(SystemExit) as ended:
            run_cli(functools.partial(script.main, argv))
        assert ended.value.code in (0, 3), capfd.readouterr().err[-3000:]
        reports[seed] = json.loads(report.read_text())
    assert reports[42]["setup"]["seed"] == 7 and reports[42]["sampled"] == 12, reports[42]
    assert reports[42] == reports[7]
