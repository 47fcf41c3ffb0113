"""Sample generations during training: fixed prompts every N steps, samples.jsonl, the repetition score. The
in-process runs load only the pairs their steps train on: the reference stage scores every pair it is given."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_honest_runs import wandb_history

from conftest import ROOT, accelerate_launch, built, python, rank_python, ready
from dpotrain.data import data
from dpotrain.recipe.config import parse_args
from dpotrain.train.samples import SAMPLED, SAMPLES_FILE, repetition

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def test_repetition_flags_a_loop_and_not_prose():
    looped = repetition("Insulin matters. " + "hormonal " * 20)
    assert looped["repetition"] > 0.8 and looped["longest_run"] == ["hormonal", 20]
    prose = repetition("Let us work it out step by step: 51 + 99 = 150. The answer is 150. Rivers carry water.")
    assert prose["repetition"] == 0 and prose["longest_run"][1] == 1


def test_repetition_reads_each_character_of_a_script_without_spaces_as_a_word():
    """Split on spaces alone, a Chinese loop was one word and scored 0: no warning before a collapse in Chinese."""
    looped = repetition("好的，" + "好的" * 20)
    assert looped["repetition"] > 0.8 and looped["longest_run"][1] == 1
    prose = repetition("我们今天去公园散步，天气很好。")  # no character three in a row twice
    assert prose["repetition"] == 0
    assert repetition("ありがとう" * 10)["repetition"] > 0.8  # kana
    assert repetition("ขอบคุณครับ" * 10)["repetition"] > 0.8  # Thai
    # Words written with spaces stay whole beside them: 10 words, 8 3-grams, the last 3 seen before
    assert repetition("the model 模型 said the model 模型 said")["repetition"] == 3 / 8


@pytest.mark.slow
def test_samples_every_n_steps_from_the_datas_first_prompts(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--max_steps",
            "4",
            "--samples_every",
            "2",
            "--sample_count",
            "2",
            "--sample_max_new_tokens",
            "12",
        ]
    )
    pairs = data.load_preference_dataset(str(ROOT / recipe.script.dataset_name)).select(range(32))  # its 4 steps' 32
    trainer = ready(built(recipe, pairs))
    trainer.train()
    records = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert [(r["step"], r["prompt_index"]) for r in records] == [(s, i) for s in (0, 2, 4) for i in (0, 1)]
    assert "What is" in records[0]["prompt"] and "<|im_start|>assistant" in records[0]["prompt"]
    assert all(isinstance(r["completion"], str) and 0 <= r["repetition"] <= 1 for r in records)
    assert trainer.model.training  # train mode restored after generating
    assert trainer.state.global_step == 4


@pytest.mark.slow
def test_sample_prompts_from_the_recipe(tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me about tides.\nWhat is 2 plus 2?\n")
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--max_steps",
            "1",
            "--samples_every",
            "5",
            "--sample_prompts_file",
            str(prompts),
        ]
    )
    pairs = data.load_preference_dataset(str(ROOT / recipe.script.dataset_name)).select(range(8))  # its 1 step's 8
    trainer = ready(built(recipe, pairs))
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 0]  # the base model's answers; step 1 is not a multiple of 5
    assert "Tell me about tides." in records[0]["prompt"] and "What is 2 plus 2?" in records[1]["prompt"]


@pytest.mark.slow
def test_main_process_generation_does_not_deadlock_zero2(tmp_path, tiny_model_dir):
    """Two DeepSpeed ZeRO-2 processes on CPU: rank 0 generates while rank 1 waits at the next collective."""
    out = tmp_path / "zero2"
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        *rank_python(),
        str(ROOT / "train_dpo.py"),
        "--config",
        SMOKE,
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(out),
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--samples_every",
        "1",
        "--sample_count",
        "2",
        "--sample_max_new_tokens",
        "16",
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:]
    records = [json.loads(line) for line in (out / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 0, 1, 1, 2, 2, 3, 3]  # main process only: each sample once
    assert (out / "run_complete.json").is_file()


@pytest.mark.slow
def test_samples_reach_wandb_as_a_table(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    result = subprocess.run(
        [
            python(),
            str(ROOT / "train_dpo.py"),
            "--config",
            SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--report_to",
            "wandb",
            "--samples_every",
            "2",
            "--sample_count",
            "2",
            "--sample_max_new_tokens",
            "8",
        ],
        cwd=ROOT,
        env={**os.environ, "WANDB_MODE": "offline"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    tables = sorted(out.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 2, tables  # before step 1 and at step 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt_index", "prompt", "completion", "repetition"]
    assert [row[:2] for row in table["data"]] == [[0, 0], [0, 1]]
    # In the W&B row of the step sampled, beside that step's training log: step 2's went into step 1's row
    [run_file] = out.glob("wandb/offline-run-*/run-*.wandb")
    rows = [(step, values) for step, values in wandb_history(run_file) if "samples/_type" in values]  # the table
    assert [step for step, _ in rows] == [0, 2], rows
    assert [json.loads(values["train/global_step"]) for _, values in rows] == [0, 2]
    assert "train/loss" in rows[1][1]


def test_samples_go_to_the_wandb_row_of_the_step_sampled(tmp_path, monkeypatch):
    """W&B puts data logged without a step into its current row: the last step the Trainer logged, since a step's
    samples are generated before the Trainer logs that step (samples at step 4 showed at step 2 with logging_steps 2,
    or at any earlier step that was logged). They carry the step sampled, as the Trainer's own logs do."""
    from types import SimpleNamespace

    from dpotrain.train.samples import SampleGenerator

    logged = []
    wandb = SimpleNamespace(
        run=object(),
        Table=lambda columns, data: ("table", columns, data),
        log=lambda data, step=None, commit=None: logged.append((data, step, commit)),
    )
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    record = {"step": 4, "prompt_index": 0, "prompt": "Hi", "completion": "Hello.", **repetition("Hello.")}
    generator = SampleGenerator([[1]], None, every=4, max_new_tokens=4, warn_at=0.5)
    state = SimpleNamespace(global_step=4, stateful_callbacks={})
    generator._write(SimpleNamespace(output_dir=str(tmp_path)), state, [record])
    [(data, step, commit)] = logged
    assert step == 4 and data["train/global_step"] == 4  # the x axis the Trainer's logs are charted on
    assert not commit  # the Trainer's log of the same step joins the row
    assert json.loads((tmp_path / SAMPLES_FILE).read_text())["step"] == 4
    assert state.stateful_callbacks[SAMPLED] == [4]  # the checkpoint's record of the steps sampled


def test_a_sample_prompts_file_is_read_as_its_editor_wrote_it(tmp_path):
    """A byte-order mark (Notepad's "UTF-8 with BOM", PowerShell's utf8) was the first prompt's first character in a
    .txt file and refused a .jsonl file's first line as no JSON; a JSON string holding U+2028 as it is (json.dumps
    with ensure_ascii=False writes it so) was cut in two lines, each refused."""
    from dpotrain.train.samples import file_prompts

    text = tmp_path / "prompts.txt"
    text.write_bytes("\ufeffBonjour\r\nHi\r\n".encode())
    assert file_prompts(str(text)) == ["Bonjour", "Hi"]
    lines = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "Bonjour"}, {"prompt": "Line one\u2028line two\x85end"}]
    lines.write_bytes(("\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)).encode())
    assert file_prompts(str(lines)) == ["Bonjour", "Line one\u2028line two\x85end"]


@pytest.mark.parametrize("where", ["file", "recipe"])
def test_a_blank_sample_prompt_is_refused_before_the_model_loads(where, tmp_path, capsys):
    """{"prompt": ""} in a .jsonl file (a .txt file's blank lines are skipped) or "" in sample_prompts: under a
    tokenizer without a chat template it is no token, and the run ended in generate's RuntimeError traceback at step
    0's samples, after the model loaded and the reference was scored (the built-in model's template hid it)."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n{"prompt": ""}\n')
    given = ["--sample_prompts_file", str(prompts)] if where == "file" else ["--sample_prompts", "Hi", " "]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(out), "--samples_every", "2", *given]))
    line = capsys.readouterr().err.splitlines()[-1]
    assert ended.value.code == 2 and not out.exists()
    assert line == (
        f"error: sample_prompts_file {str(prompts)!r}, line 2: not a JSON object with a `prompt` string, not blank "
        '(one per line: {"prompt": "..."}): fix the line, or give a .txt file of one prompt per line'
        if where == "file"
        else "error: sample_prompts holds a blank prompt, which has nothing to answer: remove it, or write one"
    )


@pytest.mark.parametrize("value, fate", [("1.5", "never warn"), ("1", "never warn"), ("-0.5", "act as 0")])
def test_a_repetition_threshold_that_cannot_warn_as_asked_is_refused(value, fate):
    """The repetition score stays below 1 (a loop's first 3-gram is new), so `sample_repetition_warn 1.5` was
    accepted and recorded and never warned, however the samples looped; a negative one warned as 0 does."""
    from dpotrain.recipe.errors import ConfigError
    from dpotrain.train.samples import check_values

    assert repetition("hormonal " * 500)["repetition"] < 1
    with pytest.raises(ConfigError) as refused:
        check_values(parse_args(["--config", SMOKE, "--sample_repetition_warn", value]).project)
    assert str(refused.value) == (
        f"sample_repetition_warn must be in [0, 1) (got {float(value):g}): a sample's repetition score is the share "
        f"of its word 3-grams seen earlier in it, from 0 (none) to below 1 (a loop), so {float(value):g} would "
        f"{fate}; 0.5 is the default"
    )
    check_values(parse_args(["--config", SMOKE, "--sample_repetition_warn", "0.99"]).project)  # in range: accepted


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--sample_max_new_tokens", "5000"],
            "sample_max_new_tokens 5,000 after a prompt reaches past the 4,096 positions builtin:tiny-olmo3 takes "
            "(max_position_embeddings 4096): samples would be generated on positions the model never learned (or "
            "fail): set --sample_max_new_tokens 4095 or lower",
        ),
        (
            ["--sample_max_new_tokens", "4090", "--sample_prompts", "Hi", ("word " * 30).strip()],
            "sample_max_new_tokens 4,090 after the longest sample prompt's 69 tokens reaches past the 4,096 positions",
        ),
    ],
)
def test_samples_past_the_models_positions_are_refused_before_loading(args, expected, tmp_path, monkeypatch, capsys):
    """sample_max_new_tokens past the model's positions was accepted: a rotary model generated on positions it never
    learned (its answers then flagged as a collapse), a model with learned positions stopped at step 0 (IndexError)."""
    import train_dpo
    from dpotrain.recipe.errors import run_cli

    args = ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--samples_every", "4", *args, "--dry-run"]
    with pytest.raises(SystemExit) as ended:  # the dry run reads the model's config and tokenizer, no weights
        run_cli(lambda: train_dpo.main(args))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "Traceback" not in err
    assert err.rstrip().splitlines()[-1].startswith(f"error: {expected}")


def test_a_data_prompt_near_the_models_positions_has_its_answer_cut_there(tmp_path, capsys):
    """A data prompt is only known once the trainer is built: its answer stops at the model's last position, said
    once, rather than a learned-position model failing (IndexError) or a rotary one going on past its context."""
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpotrain.train.samples import SampleGenerator

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    tokenizer = SimpleNamespace(
        pad_token_id=0,
        eos_token_id=None,
        decode=lambda ids, skip_special_tokens: " ".join(map(str, ids.tolist() if hasattr(ids, "tolist") else ids)),
    )
    prompts = [list(range(1, 6)), list(range(1, 31)), list(range(1, 33))]  # 5, 30 and 32 tokens of 32 positions
    generator = SampleGenerator(prompts, tokenizer, every=1, max_new_tokens=8, warn_at=0.5)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    records = generator.generate(SimpleNamespace(output_dir=str(tmp_path)), state, model)
    assert [len(r["completion"].split()) for r in records] == [8, 2]  # the prompt of 32 has no position left
    assert capsys.readouterr().err.count("samples: prompt 1 is 30 tokens, its answer cut to 2 new tokens of ") == 1


def test_samples_are_greedy_whatever_the_models_generation_config_holds(tmp_path):
    """A model's generation_config.json (`repetition_penalty`, `no_repeat_ngram_size`, sampling, beams, `max_length`)
    reached the samples' `generate`: a penalty there hides the very repetition the samples watch for, so a collapse
    went unwarned. The samples are the model's greedy answers, as docs/health.md says."""
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpotrain.train.samples import SampleGenerator

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=64, eos_token_id=7))
    model.eval()
    prompt, new = list(range(1, 6)), 24
    greedy = list(prompt)
    with torch.no_grad():
        while len(greedy) < len(prompt) + new and greedy[-1] != 7:
            greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
    assert len(set(greedy[len(prompt) :])) < len(greedy) - len(prompt), "the greedy answer repeats no token"
    model.generation_config.update(
        repetition_penalty=3.0, no_repeat_ngram_size=1, do_sample=True, temperature=0.6, num_beams=2, max_length=10
    )
    tokenizer = SimpleNamespace(
        pad_token_id=0,
        eos_token_id=None,
        decode=lambda ids, skip_special_tokens: " ".join(map(str, ids.tolist() if hasattr(ids, "tolist") else ids)),
    )
    generator = SampleGenerator([prompt], tokenizer, every=1, max_new_tokens=new, warn_at=0.5)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    (record,) = generator.generate(SimpleNamespace(output_dir=str(tmp_path)), state, model)
    assert record["completion"] == " ".join(map(str, greedy[len(prompt) :]))
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is left as it was saved


@pytest.mark.parametrize("models_max_length", [None, 10], ids=["model sets no max_length", "model sets max_length"])
def test_samples_generate_without_a_max_length_warning(models_max_length, tmp_path):
    """Every sample printed transformers' 'Both `max_new_tokens` (=64) and `max_length`(=20) seem to have been set'
    (8 lines in a 2-step smoke run with --samples_every 1): the greedy config carried the global default max_length
    20 beside max_new_tokens. A model whose generation_config.json sets max_length warned the same way."""
    import logging
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpotrain.train.samples import SampleGenerator

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=64, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    model.generation_config.max_length = models_max_length
    tokenizer = SimpleNamespace(
        pad_token_id=0,
        eos_token_id=None,
        decode=lambda ids, skip_special_tokens: " ".join(map(str, ids.tolist() if hasattr(ids, "tolist") else ids)),
    )
    generator = SampleGenerator([list(range(1, 6))], tokenizer, every=1, max_new_tokens=24, warn_at=0.5)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    heard: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = heard.append
    logger = logging.getLogger("transformers")  # transformers' loggers do not propagate to the root one
    logger.addHandler(handler)
    try:
        (record,) = generator.generate(SimpleNamespace(output_dir=str(tmp_path)), state, model)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in heard] == []
    assert len(record["completion"].split()) == 24  # no EOS: the answer is sample_max_new_tokens long


@pytest.mark.parametrize("named_by", ["tokenizer", "config.json"])
def test_samples_stop_at_every_token_the_end_of_answer_check_accepts(named_by, tmp_path):
    """A chat template that ends the assistant turn with a token the tokenizer's EOS or config.json's eos_token_id
    names passes the end-of-answer check (`chat_template.check_stops`), but generate was given generation_config's
    eos_token_id alone: where that file names another token, every sample ran on to sample_max_new_tokens past the
    turn's end. The samples stop at each of the model's stops (`chat_template.model_stops`)."""
    from types import SimpleNamespace

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from dpotrain.train.samples import SampleGenerator

    torch.manual_seed(2)  # its greedy answer: 15 tokens of one kind, then another (seed 0's: one kind only)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=64, eos_token_id=None)
    )
    model.eval()
    prompt, new = list(range(1, 6)), 24
    greedy = list(prompt)
    with torch.no_grad():
        while len(greedy) < len(prompt) + new:
            greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
    answer = greedy[len(prompt) :]
    end = max(set(answer), key=answer.index)  # the turn's end: the token the greedy answer reaches last
    assert answer.index(end) > 0
    model.generation_config.eos_token_id = next(i for i in range(1, 50) if i not in answer)  # another token
    eos = end if named_by == "tokenizer" else None
    model.config.eos_token_id = end if named_by == "config.json" else None
    tokenizer = SimpleNamespace(
        pad_token_id=0,
        eos_token_id=eos,
        decode=lambda ids, skip_special_tokens: " ".join(map(str, ids.tolist() if hasattr(ids, "tolist") else ids)),
    )
    generator = SampleGenerator([prompt], tokenizer, every=1, max_new_tokens=new, warn_at=0.5)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    (record,) = generator.generate(SimpleNamespace(output_dir=str(tmp_path)), state, model)
    assert record["completion"] == " ".join(map(str, answer[: answer.index(end) + 1]))  # not all 24 tokens


def _attentions(model) -> list:
    """The attention each of a model's configs (a multimodal model's text and vision configs too) names."""
    from dpotrain.recipe import upstream

    configs = [model.config, *(getattr(model.config, key) for key in model.config.sub_configs)]
    return [upstream.attn_implementation(config) for config in configs]


@pytest.mark.parametrize("trained_on", ["sdpa", "eager", "flash_attention_2", "flex_attention"])
def test_samples_and_the_unused_parameter_probe_run_their_forward_on_a_dense_attention(trained_on, tiny_model_dir):
    """Samples and the probe's 2-token forward run the trained model outside a training micro-batch: a packed-only
    kernel (a varlen FlashAttention; on a CPU it does not even load) or FlexAttention (a compilation per new shape)
    cannot run there. One context manager switches each config to sdpa inside, a PEFT model's base and a multimodal
    model's text config included, and puts each back after, an error inside included; sdpa and eager (what trains on a
    CPU) are left as they are. Before, samples switched only a model trained on flex (a FlashAttention model generated
    on its kernel) and the probe put a multimodal model's vision config back on its top config's attention."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from dpotrain.recipe import upstream
    from dpotrain.train.dense_attention import dense_attention

    two_tokens = torch.ones((1, 2), dtype=torch.long)
    text = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        on_sdpa = text(input_ids=two_tokens).logits
    upstream.set_attn_implementation(text.config, trained_on)
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=2, target_modules=["q_proj"])
    )
    upstream.set_attn_implementation(lora.base_model.model.config, trained_on)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    multimodal = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model(
            "gemma3",
            text_config=small | dict(vocab_size=300, num_key_value_heads=1, head_dim=16),
            vision_config=small | dict(image_size=28, patch_size=14),
            mm_tokens_per_image=4,
        )
    )
    # The text model trains on `trained_on`; the vision tower and the wrapper's config stay on their own
    upstream.set_attn_implementation(multimodal.config, "sdpa")
    upstream.set_attn_implementation(multimodal.config.vision_config, "eager")
    upstream.set_attn_implementation(multimodal.config.text_config, trained_on)
    dense = trained_on if trained_on in ("sdpa", "eager") else "sdpa"
    for model, inside in (
        (text, [dense]),
        (lora.base_model.model, [dense]),
        (multimodal, ["sdpa", dense, "eager"]),
    ):
        before = _attentions(model)
        wrapped = lora if model is lora.base_model.model else model
        with torch.no_grad(), dense_attention(wrapped):
            assert _attentions(model) == inside
            logits = wrapped(input_ids=two_tokens).logits  # flash_attention_2 would not load on a CPU
        assert _attentions(model) == before
        if model is text:
            torch.testing.assert_close(logits, on_sdpa)  # eager computes what sdpa does
        with pytest.raises(RuntimeError, match="inside"), dense_attention(wrapped):
            raise RuntimeError("inside")
        assert _attentions(model) == before
