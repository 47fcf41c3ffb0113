"""Issue #8: what a run records is what it did — LoRA, dropped rows, a held-out split, resumes, replaced runs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_train
from dpotrain.hub import hub
from dpotrain.train import run_files
from dpotrain.train.metrics import read_metrics

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def train(tmp_path, tiny_model_dir, *args, out="run", env=None):
    result = run_train(
        ["--config", SMOKE, "--output_dir", str(tmp_path / out), "--report_to", "none", *args],
        env={"DPOTRAIN_BUILTIN_DIR": str(tiny_model_dir.rsplit("/", 1)[0]), **(env or {})},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    return tmp_path / out, result.stdout


def first_pairs(tmp_path, steps: int) -> str:
    """The smoke data's pairs that `steps` steps of 8 train on, and no others: the reference stage scores only those."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[: 8 * steps]))
    return str(path)


LORA = [
    "--max_steps",
    "4",
    "--logging_steps",
    "1",
    "--save_strategy",
    "no",
    "--use_peft",
    "true",
    "--lora_r",
    "8",
    "--lora_target_modules",
    "q_proj",
    "v_proj",
]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    """4 steps of LoRA on the pairs they train, the adapter merged at the end: both LoRA tests below check this one
    run (the second trains the same steps beside it with a live reference). Its reference is scored in a cache of its
    own, as in a test's own (conftest.own_cache). Returns the run's folder and its pairs."""
    folder = tmp_path_factory.mktemp("lora")
    pairs = first_pairs(folder, 4)
    cache = {"DPOTRAIN_CACHE": str(folder / "cache")}
    out, _ = train(folder, tiny_model_dir, "--dataset_name", pairs, *LORA, "--merge_lora", "true", env=cache)
    return out, pairs


@pytest.mark.slow
def test_lora_trains_an_adapter_against_the_disabled_base_and_can_merge(lora_run, tiny_model_dir):
    out, _ = lora_run
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)  # B starts at 0: it was trained
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert not (out / "model.safetensors").exists()  # an adapter run does not pretend to hold full weights
    # Its own, recorded as written at its end: --overwrite_output_dir removes them, a push uploads them.
    assert {"merged", "README.md", "adapter_model.safetensors"} <= set(
        json.loads((out / "run_files.json").read_text())["names"]
    )
    # Step 1: the reference is the policy with the adapter disabled, identical to it at init -> ln 2, rewards 0.
    first = read_metrics(out)[0]
    # Within fp32 rounding: the reference stage scores in micro-batches of its own (tests/test_reference.py).
    assert abs(first["loss"] - 0.693147) < 1e-5 and abs(first["rewards/margins"]) < 1e-4
    # The merged model: the base's weights where no adapter applies, changed where q_proj / v_proj are adapted.
    base, merged = load_file(f"{tiny_model_dir}/model.safetensors"), load_file(out / "merged" / "model.safetensors")
    assert set(base) == set(merged)
    changed = {n for n in base if not torch.equal(base[n], merged[n])}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed), changed
    # ... and it computes what base + adapter compute.
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        adapted = AutoPeftModelForCausalLM.from_pretrained(out)(tokens).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(out / "merged")(tokens).logits
    assert torch.allclose(adapted, merged_logits, atol=1e-5)
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "**LoRA adapter** (PEFT) for `builtin:tiny-olmo3`" in card
    assert "r=8, alpha=32" in card and "['q_proj', 'v_proj']" in card and "merged/" in card
    assert hub.run_folder_problems(out) == []  # pushable like any run


@pytest.mark.slow
def test_a_rerun_that_does_not_merge_removes_an_earlier_attempts_merged_model(lora_run, tiny_model_dir, tmp_path):
    """An attempt with merge_lora true killed after it wrote merged/ (before run_complete.json), rerun with merge_lora
    false: the earlier merge stayed beside the new adapter, and a push uploaded it as the run's merged model. It is
    removed, as the run's own (a folder holding a person's merged/ is refused at start, as any file not a run's)."""
    out = tmp_path / "run"
    shutil.copytree(lora_run[0], out)
    (out / "run_complete.json").unlink()  # killed after the merge
    cache = {"DPOTRAIN_CACHE": str(lora_run[0].parent / "cache")}
    _, said = train(tmp_path, tiny_model_dir, "--dataset_name", lora_run[1], *LORA, "--merge_lora", "false", env=cache)
    assert not (out / "merged").exists() and f"Removed {out}/merged, an earlier attempt's merged model" in said
    assert "merged" not in json.loads((out / "run_files.json").read_text())["names"]
    assert (out / "adapter_model.safetensors").exists() and hub.run_folder_problems(out) == []


@pytest.mark.slow
def test_a_lora_recipe_that_merges_run_once_as_a_full_fine_tune_ends_with_its_model_saved(tmp_path, tiny_model_dir):
    """A LoRA recipe with merge_lora: true, run once with --use_peft false (its LoRA settings unused then): the run
    trained the full model, then went on to merge an adapter it never made and ended in PEFT's traceback, with no
    card nor run_complete.json. It ends as a full fine-tune does."""
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(Path(SMOKE).read_text() + "use_peft: true\nlora_target_modules: all-linear\nmerge_lora: true\n")
    pairs = first_pairs(tmp_path, 2)
    out = tmp_path / "run"
    args = ["--config", str(recipe), "--use_peft", "false", "--output_dir", str(out), "--report_to", "none"]
    result = run_train(
        [*args, "--dataset_name", pairs, "--max_steps", "2", "--save_strategy", "no"],
        env={"DPOTRAIN_BUILTIN_DIR": str(tiny_model_dir.rsplit("/", 1)[0])},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "run_complete.json").is_file()
    assert not (out / "merged").exists() and not (out / "adapter_config.json").exists()
    assert "merged/model.safetensors" not in json.loads((out / "run_complete.json").read_text())["model_files"]


@pytest.mark.parametrize("args, dropout", [([], 0.0), (["--disable_dropout", "false"], 0.05)], ids=["default", "kept"])
def test_lora_dropout_recorded_is_the_dropout_trained(args, dropout, tmp_path, tiny_model_dir):
    """TRL's disable_dropout (on by default) zeroes every dropout once PEFT has wrapped the model, the adapter's too:
    the record, the card and adapter_config.json said lora_dropout 0.05 (TRL's default) for an adapter trained
    without dropout."""
    import datasets

    from conftest import built
    from dpotrain.data import builtin
    from dpotrain.recipe.config import parse_args

    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", *args]
    recipe = parse_args(
        ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run"), *lora]
    )
    assert recipe.model.lora_dropout == dropout  # resolved_config.json, the card
    model = built(recipe, datasets.Dataset.from_list(builtin.make_preference_rows(16, seed=3))).trainer.model
    assert model.peft_config["default"].lora_dropout == dropout  # adapter_config.json
    # PEFT's dropout of each adapted layer as it trains: nn.Dropout, or nn.Identity for lora_dropout 0
    trained = {getattr(m, "p", 0.0) for n, m in model.named_modules() if n.endswith(".lora_dropout.default")}
    assert trained == {dropout}


@pytest.mark.slow
def test_lora_with_a_live_reference_trains_what_the_cached_reference_trains(lora_run, tmp_path, tiny_model_dir):
    """`--precompute_ref_log_probs false` under LoRA: the live reference is the policy with its adapter disabled, run
    on the same packed rows. Were the adapter left on, the rewards would stay 0 and the loss ln 2 from step 2 on. The
    cached reference's run is `lora_run` (its merge at the end changes nothing it trains)."""
    cached, pairs = lora_run
    live, _ = train(tmp_path, tiny_model_dir, "--dataset_name", pairs, *LORA, "--precompute_ref_log_probs", "false")
    forward = json.loads((live / "resolved_config.json").read_text())["derived"]["forward"]
    assert forward["packed"], forward
    want, got = read_metrics(cached), read_metrics(live)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, b in zip(want, got, strict=True):
        for metric in ("loss", "rewards/margins", "grad_norm", "logps/chosen"):
            assert abs(b[metric] - a[metric]) <= 1e-4 * max(1, abs(a[metric])), (a["step"], metric)
    assert abs(got[-1]["rewards/margins"]) > 1e-3  # the reference and the policy have parted: the check can fail
    wa, wb = load_file(cached / "adapter_model.safetensors"), load_file(live / "adapter_model.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5


@pytest.mark.slow
def test_skip_invalid_drops_and_counts_rows(tmp_path, tiny_model_dir):
    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()][:40]
    rows[5]["chosen"] = None
    rows[9]["rejected"] = rows[9]["chosen"]
    rows[11]["rejected"][-1]["content"] = 7
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, stdout = train(
        tmp_path,
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--skip_invalid",
        "true",
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
    )
    dropped = json.loads((out / "resolved_config.json").read_text())["derived"]["invalid_rows"]
    assert dropped["rows"] == 40 and dropped["dropped"] == 3
    assert [r["index"] for r in dropped["first"]] == [5, 9, 11]
    assert dropped["by_reason"]["chosen: missing (null)"] == 1
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["dataset_rows"] == 37
    assert "Dropped 3 invalid rows of 40" in stdout


@pytest.mark.slow
def test_held_out_split_is_evaluated_and_overwrite_keeps_offline_wandb_runs(tmp_path, tiny_model_dir):
    import datasets

    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()]
    saved = tmp_path / "prefs"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:64]), "test": datasets.Dataset.from_list(rows[64:80])}
    ).save_to_disk(saved)
    # A finished run in the way, with an offline W&B run never synced.
    old = tmp_path / "run"
    (old / "wandb" / "offline-run-20260101_000000-abc").mkdir(parents=True)
    (old / "wandb" / "offline-run-20260101_000000-abc" / "run-abc.wandb").write_text("history")
    (old / "run_complete.json").write_text("{}")
    run_files.claim(old, ["run_complete.json", "wandb"])  # what the run recorded as its own (run_files.json)
    out, stdout = train(
        tmp_path,
        tiny_model_dir,
        "--dataset_name",
        str(saved),
        "--max_steps",
        "4",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--save_strategy",
        "no",
        "--overwrite_output_dir",
    )
    evals = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all("eval_rewards/accuracies" in r for r in evals)
    assert json.loads((out / "resolved_config.json").read_text())["derived"]["eval_rows"] == 16
    kept = list(tmp_path.glob("run.wandb-offline-*"))
    assert len(kept) == 1 and (kept[0] / "offline-run-20260101_000000-abc" / "run-abc.wandb").read_text() == "history"
    assert str(kept[0]) in stdout and not (out / "wandb").exists()


def wandb_history(run_file) -> list[tuple[int, dict]]:
    """Each history row of an offline W&B run file: its `_step` and its values by key, as JSON text."""
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            values = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            rows.append((record.history.step.num, values))
    return rows


def wandb_records(run_file) -> list:
    """Every record of an offline W&B run file (LevelDB log blocks of protobuf records), in order."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, records, pending = run_file.read_bytes(), 7, [], b""  # after the 7-byte ":W&B" header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@pytest.mark.slow
def test_resume_carries_the_token_count_and_the_wandb_step_on(tmp_path, tiny_model_dir):
    args = [
        "--dataset_name",
        first_pairs(tmp_path, 6),
        "--max_steps",
        "6",
        "--logging_steps",
        "1",
        "--save_steps",
        "3",
        "--report_to",
        "wandb",
    ]
    out, _ = train(tmp_path, tiny_model_dir, *args)
    tokens = {r["step"]: r["num_tokens"] for r in read_metrics(out)}
    # Make it an unfinished run that stopped after checkpoint 3, and run the same command again.
    (out / "run_complete.json").unlink()
    shutil.rmtree(out / "checkpoint-6")
    _, stdout = train(tmp_path, tiny_model_dir, *args)
    assert "Resuming from" in stdout
    resumed = {r["step"]: r["num_tokens"] for r in read_metrics(out)}
    assert resumed == tokens  # steps 4-6 count on from step 3's tokens, not from 0
    # W&B rows are numbered by optimizer step: once synced, the resumed part (4-6) is above the first part's last
    # row for each new step, instead of restarting at 0 and being dropped. The resumed run first logs again the rows
    # up to its checkpoint, from metrics.jsonl, with the first run's values: a SIGKILL loses the rows W&B still held
    # in its buffer, and without them those steps would be missing once synced.
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    # Each run's file complete: it ends with the exit record W&B's teardown writes (an exit handler, which a command's
    # end runs before it ends the process: tests/test_process_end.py).
    assert [wandb_records(f)[-1].WhichOneof("record_type") for f in files] == ["exit", "exit"], files
    first, second = [wandb_history(f) for f in files]
    assert [s for s, _ in first] == [1, 2, 3, 4, 5, 6] and [s for s, _ in second] == [1, 2, 3, 4, 5, 6]
    for (step, was), (_, again) in zip(first[:3], second[:3], strict=True):
        assert again["train/loss"] == was["train/loss"] and again["train/global_step"] == str(step), (was, again)
        assert json.loads(again["train/epoch"]) == json.loads(was["train/epoch"])
    # Killed again after its last checkpoint (step 6): the rerun resumes there and trains nothing. transformers' summary
    # then holds train_loss 0.0 and 0 pairs/s, which W&B wrote over its run's summary of the attempts that trained.
    (out / "run_complete.json").unlink()
    _, stdout = train(tmp_path, tiny_model_dir, *args)
    assert "no step left to train" in stdout
    [last] = set(out.glob("wandb/offline-run-*/run-*.wandb")) - set(files)
    summary = {i.key for r in wandb_records(last) if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert "train_runtime" in summary and not {"train_loss", "train_steps_per_second"} & summary, summary


@pytest.mark.slow
def test_a_resume_from_a_best_checkpoint_at_a_step_not_logged_counts_every_token(tmp_path, tiny_model_dir):
    """save_strategy best saves at an evaluation, after transformers' log: at step 3 of a run logging every 2 steps, a
    step in no record. Resumed from it, num_tokens counted on from step 2's record, step 3's tokens lost for good."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[200:216]))
    args = [
        *("--dataset_name", first_pairs(tmp_path, 6), "--max_steps", "6", "--logging_steps", "2"),
        *("--eval_strategy", "steps", "--eval_steps", "3", "--dataset_mixer_eval_list", str(held), "16"),
        *("--save_strategy", "best", "--metric_for_best_model", "eval_loss"),
    ]
    out, _ = train(tmp_path, tiny_model_dir, *args)
    tokens = [(r["step"], r["num_tokens"]) for r in read_metrics(out) if "loss" in r]
    assert (out / "checkpoint-3" / "COMPLETE").is_file() and tokens[-1][0] == 6
    # An unfinished run whose newest checkpoint is step 3's
    (out / "run_complete.json").unlink()
    shutil.rmtree(out / "checkpoint-6", ignore_errors=True)  # saved where step 6 evaluated better
    _, stdout = train(tmp_path, tiny_model_dir, *args)
    assert "checkpoint-3" in stdout and "Resuming from" in stdout
    assert [(r["step"], r["num_tokens"]) for r in read_metrics(out) if "loss" in r] == tokens


@pytest.mark.parametrize("targets", [["q_proj", "embed_tokens"], ["q_proj", "lm_head"], ["q_proj"]])
def test_a_merged_adapter_on_tied_embeddings_computes_what_the_adapter_does(targets, tmp_path):
    """A model whose output layer shares the input embedding's weight (tie_word_embeddings: Qwen2.5 0.5B, Llama 3.2 1B,
    Gemma), with LoRA on either: the merge wrote the update into the one shared weight, so merged/ changed both layers
    where the run trained one (logits off by more than the training moved them), and said so only in PEFT's warning.
    A merge that leaves them equal (LoRA elsewhere) stays tied."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from dpotrain.data import builtin
    from dpotrain.train import lora

    tokenizer = builtin.build_tokenizer()
    config = builtin.model_config("tiny-olmo3", len(tokenizer))
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapter = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)  # B nonzero: an update to merge
    with lora.without_peft_deprecation():
        adapted = get_peft_model(base, adapter)
    adapted.save_pretrained(tmp_path / "run")
    merged = lora.save_merged(tmp_path / "run", str(tmp_path / "base"), {"dtype": "float32"}, adapted, tokenizer)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want, got = adapted(tokens).logits, AutoModelForCausalLM.from_pretrained(merged)(tokens).logits
    assert torch.allclose(want, got, atol=1e-5), (want - got).abs().max()
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] == (targets == ["q_proj"])


@pytest.mark.parametrize(
    "lora",
    [
        ["--lora_r", "8", "--lora_target_modules", "q_proj"],
        ["--lora_r", "16", "--lora_target_modules", "all-linear", "--lora_modules_to_save", "lm_head"],
        ["--lora_target_modules", "q_proj", "--use_dora", "true"],
    ],
    ids=["r8", "r16-all-linear-lm_head", "dora"],
)
def test_a_lora_runs_reference_is_keyed_by_its_base_as_a_full_run_of_it(lora, tmp_path, tiny_model_dir):
    """A LoRA run's reference is its base with the adapter disabled: the same numbers a full fine-tune of that base
    scores (equal to the bit on the smoke pairs). Its cache key hashed the adapter's random initial weights too, so
    each LoRA run (another r, targets or seed) scored the whole reference again, hours on the think recipe, beside a
    finished cache of the same base. Keyed by the base weights, runs of one base share it; a resumed LoRA run
    recorded with the old hash (TRL's, of base and adapter) still passes the weights check."""
    import datasets
    from trl.trainer.utils import hash_module

    from conftest import built
    from dpotrain.data import builtin
    from dpotrain.recipe.config import parse_args
    from dpotrain.reference.reference import identity
    from dpotrain.reference.scorer import ReferenceScorer

    rows = datasets.Dataset.from_list(builtin.make_preference_rows(16, seed=3))

    def key(*args):
        base = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run")]
        trainer = built(parse_args([*base, *args]), rows).trainer
        return trainer, identity(ReferenceScorer(trainer), trainer.train_dataset)

    _, full = key()
    trainer, adapter = key("--use_peft", "true", *lora)
    assert adapter == full
    # What a LoRA run recorded before session 41, TRL's hash of base and adapter, is what a resume compares with
    assert trainer.earlier_lora_hash() == hash_module(trainer.model) != trainer.weights_hash


def test_a_fresh_lora_start_hashes_the_weights_once(tmp_path, tiny_model_dir, monkeypatch):
    """A LoRA start hashed the weights twice: the base's (the reference cache's key) and TRL's of base and adapter,
    which only a resume of a run recorded before session 41 compares with; a full pass over every weight (minutes
    for a 32B model) that a fresh start threw away. That second hash is taken by such a resume alone."""
    import datasets
    from trl.trainer import dpo_trainer

    from conftest import built
    from dpotrain.cluster import engine
    from dpotrain.data import builtin
    from dpotrain.recipe.config import parse_args

    taken = []

    def counted(hash_of):
        return lambda *args, **kw: taken.append(hash_of.__name__) or hash_of(*args, **kw)

    monkeypatch.setattr(dpo_trainer, "hash_module", counted(dpo_trainer.hash_module))
    monkeypatch.setattr(engine, "weights_sha256", counted(engine.weights_sha256))
    rows = datasets.Dataset.from_list(builtin.make_preference_rows(16, seed=3))
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "run")]
    trainer = built(parse_args([*args, "--use_peft", "true", "--lora_target_modules", "q_proj"]), rows).trainer
    assert taken == ["weights_sha256"] and trainer.weights_hash


def test_a_lora_resume_recorded_with_trls_hash_passes_the_weights_check_and_other_weights_do_not(
    tmp_path, tiny_model_dir
):
    """The resume of a LoRA run recorded before session 41 (its key TRL's hash of base and adapter) takes that hash
    then, and passes; a hash of neither, other weights, is refused as before."""
    import dataclasses

    import datasets
    from trl.trainer.utils import hash_module

    from conftest import built
    from dpotrain.data import builtin
    from dpotrain.recipe.config import parse_args
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.resolve import OutputDecision
    from dpotrain.train_stage import WEIGHTS_KEY, check_reference_weights

    rows = datasets.Dataset.from_list(builtin.make_preference_rows(16, seed=3))
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--output_dir", str(out)]
    run = built(parse_args([*args, "--use_peft", "true", "--lora_target_modules", "q_proj"]), rows)
    (out / "checkpoint-2").mkdir(parents=True)
    resumed = dataclasses.replace(run.spec, output=OutputDecision(str(out / "checkpoint-2"), False))
    for was in (hash_module(run.trainer.model), "0" * 64):
        (out / "resolved_config.json").write_text(json.dumps({"derived": {WEIGHTS_KEY: was}}))
        if was != "0" * 64:
            check_reference_weights(resumed, run.trainer)
            continue
        with pytest.raises(ConfigError, match="the weights loaded are not those .* was trained against"):
            check_reference_weights(resumed, run.trainer)


@pytest.mark.slow
def test_a_merge_into_a_local_base_written_over_during_training_is_refused(tmp_path, tiny_model_dir):
    """A local base folder written over during training (the SFT model exported again to the same path) was merged
    as it then was, exit 0: weights the adapter never trained on. The merge checks the base's files against the run's
    record of them first and refuses in one line naming the file; the adapter is saved, and the same command merges
    once the base is back."""
    import os
    import signal
    import subprocess

    from safetensors.torch import save_file

    from conftest import PAUSE_AT, pause_env, paused_pid, python

    base = tmp_path / "sft"
    shutil.copytree(tiny_model_dir, base)
    out, paused, pairs = tmp_path / "run", tmp_path / "paused", first_pairs(tmp_path, 2)
    args = ["--config", SMOKE, "--output_dir", str(out), "--report_to", "none", "--model_name_or_path", str(base)]
    args += ["--dataset_name", pairs, *LORA[:1], "2", *LORA[2:], "--merge_lora", "true"]
    env = {**os.environ, **pause_env("*/resolved_config.json", "*metrics.jsonl", paused)}  # loaded, not trained
    proc = subprocess.Popen(
        [python(), str(PAUSE_AT), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    weights = base / "model.safetensors"
    kept = weights.read_bytes()
    try:
        pid = paused_pid(paused, proc)
        save_file({k: v + 1 for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
        os.kill(pid, signal.SIGCONT)
        log = proc.communicate(timeout=600)[0]
    finally:
        proc.kill()
    assert proc.returncode != 0 and "Traceback" not in log, log[-3000:]
    line = log.strip().splitlines()[-1]
    assert line.startswith("error: ") and "model.safetensors" in line and "run the same command again" in line, line
    assert not (out / "merged").exists() and (out / "adapter_model.safetensors").exists()
    weights.write_bytes(kept)  # the base back: the same command merges
    result = run_train(args)
    assert result.returncode == 0, result.stdout[-3000:]
    merged = load_file(out / "merged" / "model.safetensors")
    assert all(torch.equal(t, merged[n]) for n, t in load_file(weights).items() if "_proj" not in n)
