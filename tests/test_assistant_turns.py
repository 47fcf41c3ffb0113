"""`assistant_turns: all` trains what open-instruct trained OLMo 3 on: every assistant turn of each side, each side's
log-prob averaged over all its labeled tokens (dpotrain/data/turns.py). The project's optimizer steps equal
open-instruct's `dpo_norm` written from its definition (tests/open_instruct_dpo.py), on single-turn, multi-turn and
truncated pairs, packed and with shared prompts, on one process and on two under ZeRO-2; `final` stays TRL's."""

import json
import math
import os
import random
import subprocess
import sys

import datasets
import pytest
import torch
from open_instruct_dpo import kept_pairs, sgd_steps, tokenize
from safetensors.torch import load_file
from transformers import AutoTokenizer, TrainerCallback

from conftest import ROOT, accelerate_launch, built, rank_python, ready
from dpotrain.data import turns
from dpotrain.data.pair_lengths import LABELS
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

SMOKE = str(ROOT / "configs" / "smoke.yaml")
MAX_LENGTH = 256
BETA = 5.0
LR = 1.0  # plain SGD: a step moves each weight by -LR x its gradient, so the weights tell the gradient
STEPS = 2  # step 1 starts at the reference (loss ln 2); step 2's loss is the policy's after one update
WORDS = (
    "river stone light north quiet market seven garden number winter paper bridge signal orange careful answer "
    "question simple think maybe because window"
).split()
# Chat templates the check runs under: name -> (a .jinja file the reference renders with, None for the model's own;
# the run's flags that choose it). OLMo 3 Think's is one more entry:
#   "olmo_thinker": (ROOT / "configs/templates/olmo_thinker.jinja",
#                    ["--chat_template_path", str(ROOT / "configs/templates/olmo_thinker.jinja")]),
# with think-shaped pairs in `pairs` (an answer that starts with `<think>`).
TEMPLATES = {"builtin": (None, [])}


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pairs(seed: int = 0) -> list[dict]:
    """Single-turn, multi-turn (one and two earlier exchanges, with and without a system message) and truncated pairs
    (a final answer longer than MAX_LENGTH leaves), each kind twice."""
    rng = random.Random(seed)
    out = []
    for kind in ("single", "multi", "multi_system", "three_turns", "truncated") * 2:
        history = []
        if kind == "multi_system":
            history.append({"role": "system", "content": words(rng, 6)})
        for _ in range({"multi": 1, "multi_system": 1, "three_turns": 2}.get(kind, 0)):
            history += [
                {"role": "user", "content": words(rng, rng.randint(2, 6))},
                {"role": "assistant", "content": words(rng, rng.randint(3, 10))},
            ]
        history.append({"role": "user", "content": words(rng, rng.randint(2, 6))})
        chosen = words(rng, 100 if kind == "truncated" else rng.randint(3, 15))
        rejected = words(rng, rng.randint(3, 15))
        out.append(
            {
                "chosen": history + [{"role": "assistant", "content": chosen}],
                "rejected": history + [{"role": "assistant", "content": rejected}],
            }
        )
    return out


def args(output_dir, model_dir, turns_trained: str, *overrides: str) -> list[str]:
    """The smoke recipe as one step per pass over all the pairs: plain SGD at a constant rate, no clipping, no
    guards (a step-2 loss far from ln 2 is what is checked here, not a doomed run)."""
    return [
        "--config",
        SMOKE,
        "--model_name_or_path",
        model_dir,
        "--output_dir",
        str(output_dir),
        "--report_to",
        "none",
        "--assistant_turns",
        turns_trained,
        "--max_length",
        str(MAX_LENGTH),
        "--beta",
        str(BETA),
        "--optim",
        "sgd",
        "--learning_rate",
        str(LR),
        "--lr_scheduler_type",
        "constant",
        "--warmup_steps",
        "0",
        "--max_grad_norm",
        "0",
        "--weight_decay",
        "0",
        "--max_steps",
        str(STEPS),
        "--num_train_epochs",
        str(STEPS),
        "--pairs_per_step",
        str(len(pairs())),
        "--logging_steps",
        "1",
        "--health_checks",
        "false",
        *overrides,
    ]


@pytest.fixture(scope="module")
def open_instruct(tiny_model_dir):
    """open-instruct's two SGD steps over all the pairs (tests/open_instruct_dpo.py), per template."""
    out = {}
    for name, (template, _) in TEMPLATES.items():
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        if template is not None:
            tokenizer.chat_template = template.read_text()
        out[name] = sgd_steps(tiny_model_dir, pairs(), tokenizer, BETA, MAX_LENGTH, LR, STEPS)
    return out


def check_steps(losses: list[float], grads: list[dict], want, readout: dict | None = None) -> None:
    """Each step's loss within 1e-5 (relative) and gradient within 1e-4 (of the tensor's largest entry) of
    open-instruct's. `readout`: per tensor, what reading a gradient from fp32 weights, (before - after) / LR, may add
    (the weights' rounding)."""
    assert len(losses) == len(grads) == len(want) == STEPS
    for step, (loss, got, (want_loss, want_grads, _)) in enumerate(zip(losses, grads, want, strict=True), 1):
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (step, loss, want_loss)
        assert got.keys() == want_grads.keys()
        for name, g in want_grads.items():
            allowed = 1e-4 * g.abs().max() + (readout or {}).get(name, 0.0)
            assert (got[name] - g).abs().max() <= allowed, (step, name, float((got[name] - g).abs().max()), allowed)


def read_gradients(start: dict, after: list[dict]) -> tuple[list[dict], dict]:
    """Each step's gradient from the weights before and after it (plain SGD: w - LR x g), and what fp32 rounding of
    those weights allows the readout."""
    grads, before = [], start
    for weights in after:
        grads.append({n: (before[n] - weights[n]) / LR for n in weights})
        before = weights
    ulp = torch.finfo(torch.float32).eps
    readout = {n: 2 * ulp * max(float(w[n].abs().max()) for w in (start, *after)) / LR for n in start}
    return grads, readout


class _Gradients(TrainerCallback):
    """Each optimizer step's gradients, as the optimizer is about to apply them (one process, no DeepSpeed)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})


def one_process(tmp_path, model_dir, turns_trained: str, *overrides: str):
    gradients = _Gradients()
    trainer = ready(
        built(
            parse_args(args(tmp_path, model_dir, turns_trained, "--save_strategy", "no", *overrides)),
            datasets.Dataset.from_list(pairs()),
            callbacks=[gradients],
        )
    )
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r and "train_loss" not in r]
    return trainer, losses, gradients.steps


def test_the_labels_are_open_instructs(tiny_model_dir):
    """The prompt tokens labeled (turns.py) are the earlier assistant turns open-instruct labels, position by
    position; the completion is all of the final turn's; a single-turn pair labels no prompt token."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    from trl.data_utils import _tokenize, extract_prompt

    labeled = 0
    for pair in pairs():
        example = extract_prompt(dict(pair))
        prompt = _tokenize(tokenizer, example["prompt"], add_generation_prompt=True)["input_ids"]
        example |= {
            "prompt_ids": prompt,
            "chosen_ids": tokenize(pair["chosen"], tokenizer, 10**6)[0][len(prompt) :],
            "rejected_ids": tokenize(pair["rejected"], tokenizer, 10**6)[0][len(prompt) :],
        }
        mine = turns.prompt_labels(example, tokenizer)
        for side in ("chosen", "rejected"):
            _, labels = tokenize(pair[side], tokenizer, 10**6)
            want = [int(x != -100) for x in labels]
            got = mine + [1] * len(example[f"{side}_ids"])
            assert got[1:] == want[1:]  # position 0 is never scored (labels are shifted by one)
        assistants = sum(m["role"] == "assistant" for m in pair["chosen"])
        assert (sum(mine) > 0) == (assistants > 1)
        labeled += sum(mine)
    assert labeled > 0


# The forwards of one process: packed rows, packed rows with each prompt once, TRL's padded batches (grouped)
FORWARDS = {
    "packed": ["--share_prompt", "false"],
    "shared_prompt": ["--share_prompt", "true"],
    "padded": ["--padding_free", "false"],
}


@pytest.mark.slow
@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("forward", FORWARDS)
def test_steps_equal_open_instructs_dpo_norm(tmp_path, tiny_model_dir, open_instruct, forward, template):
    """Two SGD steps over single-turn, multi-turn and truncated pairs on one process: each step's loss and gradient
    equal open-instruct's; with `final` (TRL's, the earlier turns unlabeled) they do not."""
    want = open_instruct[template]
    assert len(kept_pairs(pairs(), AutoTokenizer.from_pretrained(tiny_model_dir), MAX_LENGTH)) == len(pairs())
    flags = [*FORWARDS[forward], *TEMPLATES[template][1]]
    trainer, losses, grads = one_process(tmp_path / "all", tiny_model_dir, "all", *flags)
    assert (trainer.packed, trainer.forward.share_prompt) == (forward != "padded", forward == "shared_prompt")
    assert abs(losses[0] - math.log(2)) < 1e-6 and abs(losses[1] - math.log(2)) > 1e-3
    check_steps(losses, grads, want)
    if forward == "packed":  # the check can fail: TRL's labels give other steps
        _, final_losses, final_grads = one_process(tmp_path / "final", tiny_model_dir, "final", *flags)
        with pytest.raises(AssertionError):
            check_steps(final_losses, final_grads, want)


@pytest.mark.slow
def test_zero2_on_two_processes_equals_open_instruct(tmp_path, tiny_model_dir, open_instruct):
    """The same two steps through `accelerate launch` of 2 processes under ZeRO-2 (the pairs split over the ranks, cut
    into micro-batches by the recipe's token budget): losses from metrics.jsonl, gradients from the checkpoint after
    step 1 and the final weights. With prompts shared, the layout whose labeled prompt tokens both sides read; how
    the ranks split a step does not depend on the forward, and each forward is held to open-instruct on one process
    above."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs()))
    out = tmp_path / "run"
    cmd = [
        *accelerate_launch(),
        "--config_file",
        str(ROOT / "accelerate_config.yaml"),
        "--num_processes",
        "2",
        *rank_python(),
        str(ROOT / "train_dpo.py"),
        *args(
            out,
            tiny_model_dir,
            "all",
            "--dataset_name",
            str(data),
            "--share_prompt",
            "true",
            "--save_strategy",
            "steps",
            "--save_steps",
            "1",
        ),
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-4000:]
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["derived"]["world_size"] == 2 and resolved["assistant_turns"] == "all"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = load_file(f"{tiny_model_dir}/model.safetensors")
    after = [load_file(out / "checkpoint-1" / "model.safetensors"), load_file(out / "model.safetensors")]
    grads, readout = read_gradients(start, after)
    check_steps(losses, grads, open_instruct["builtin"], readout)


def test_a_template_whose_generation_prompt_is_not_how_the_answer_starts_is_refused(tiny_model_dir):
    """A generation prompt that ends in `<think>` where the answer has none: open-instruct masks the generation
    prompt's length of positions, which reaches into the answer TRL's split trains. Refused in one line rather than
    trained on other labels."""
    from trl.data_utils import _tokenize

    from dpotrain.data.builtin import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>'")
    prompt = [{"role": "user", "content": "river stone"}]
    example = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "light"}],
        "rejected": [{"role": "assistant", "content": "north"}],
    }
    full = {side: _tokenize(tokenizer, prompt + example[side])["input_ids"] for side in ("chosen", "rejected")}
    generation = _tokenize(tokenizer, prompt, add_generation_prompt=True)["input_ids"]
    p = next(i for i, (a, b) in enumerate(zip(generation, full["chosen"], strict=False)) if a != b)  # TRL's split
    assert p < len(generation)  # `<think>` is only in the generation prompt: TRL's completion starts before its end
    example |= {"prompt_ids": generation[:p], "chosen_ids": full["chosen"][p:], "rejected_ids": full["rejected"][p:]}
    with pytest.raises(
        ValueError, match="assistant_turns all: the pair whose prompt starts 'river stone' .* use assistant_turns final"
    ):
        turns.prompt_labels(example, tokenizer)


def test_a_generation_prompt_whose_last_token_merges_with_the_answer_labels_the_earlier_turns(tiny_model_dir):
    """`<think>` then `...`: the text check passes (the answer begins with the generation prompt), but a tokenizer
    with the merge '>...' splits the tokens one earlier than the rendered prompt. prompt_labels raised its
    ValueError inside TRL's map, a traceback once the model had loaded; TRL's split stands (as with `final`, TRL
    warns) and the earlier turns keep open-instruct's labels."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.data_utils import _tokenize, extract_prompt

    from dpotrain.data import builtin, chat_template

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=builtin.SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(["<think>... hmm</think> ok", "user assistant system river stone"] * 50, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|pad|>")
    tokenizer = chat_template.apply(tokenizer, str(ROOT / "configs" / "templates" / "olmo_thinker.jinja"))
    history = [{"role": "user", "content": "river"}, {"role": "assistant", "content": "<think>x</think> stone"}]
    user = {"role": "user", "content": "stone"}
    pair = {
        side: [*history, user, {"role": "assistant", "content": f"<think>... {answer}</think> ok"}]
        for side, answer in (("chosen", "hmm"), ("rejected", "no"))
    }
    example = extract_prompt(dict(pair))
    assert chat_template.answer_problem(example, tokenizer) is None  # the text check passes
    generation = _tokenize(tokenizer, example["prompt"], add_generation_prompt=True)["input_ids"]
    full = {side: _tokenize(tokenizer, pair[side])["input_ids"] for side in ("chosen", "rejected")}
    p = next(i for i, (a, b) in enumerate(zip(generation, full["chosen"], strict=False)) if a != b)  # TRL's split
    assert p == len(generation) - 1  # '>' and '...' merged
    example |= {"prompt_ids": generation[:p], "chosen_ids": full["chosen"][p:], "rejected_ids": full["rejected"][p:]}
    labels = turns.prompt_labels(example, tokenizer)
    _, want = tokenize(pair["chosen"], tokenizer, 10**6)  # open-instruct's, on the prompt's positions
    assert labels[1:] == [int(x != -100) for x in want[1:p]] and sum(labels) > 0  # the earlier turn is labeled


# Qwen3's way with earlier answers: their thinking block is dropped once a later user turn follows
DROPS_EARLIER_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_a_template_that_drops_earlier_thinking_is_refused_under_all_before_the_model_loads(tmp_path, tiny_model_dir):
    """A template that writes an earlier answer without its thinking block once a later user turn follows (Qwen3's):
    open-instruct's rule masks each turn from the length of the conversation rendered up to it, where that answer
    still has its block, so the masks started late and the next user turn (its header, its text, the generation
    prompt) was trained as the assistant's, with no word said. The dry run refuses it in one line; `final` takes it
    (TRL's split renders every earlier turn alike); a pair labeled anyway raises."""
    from trl.data_utils import _tokenize

    import train_dpo

    template = tmp_path / "drops.jinja"
    template.write_text(DROPS_EARLIER_THINKING)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = DROPS_EARLIER_THINKING
    history = [
        {"role": "user", "content": "river"},
        {"role": "assistant", "content": "<think>\nquiet\n</think>\n\nstone"},
        {"role": "user", "content": "north"},
    ]
    assert "<think>" not in tokenizer.apply_chat_template(history, tokenize=False)  # the template's way
    answers = {
        "chosen": [{"role": "assistant", "content": "light"}],
        "rejected": [{"role": "assistant", "content": "no"}],
    }
    prompt = _tokenize(tokenizer, history, add_generation_prompt=True)["input_ids"]
    example = {"prompt": history, **answers, "prompt_ids": prompt, "chosen_ids": [1], "rejected_ids": [2]}
    says = "assistant_turns all: the chat template writes an earlier assistant turn otherwise once a later turn follows"
    with pytest.raises(ValueError, match=says):
        turns.prompt_labels(example, tokenizer)
    args = [SMOKE, "--chat_template_path", str(template), "--output_dir", str(tmp_path / "run"), "--dry-run"]
    with pytest.raises(ConfigError, match=says) as refused:
        train_dpo.main(["--config", *args])
    assert "\n" not in str(refused.value) and "--assistant_turns final" in str(refused.value)
    train_dpo.main(["--config", *args, "--assistant_turns", "final"])


# A template that reads an answer's thinking from `reasoning_content` alone (no `</think>` in content, which the start's
# probe holds) and writes it only after the last user turn: gpt-oss's way with `thinking`
DROPS_EARLIER_REASONING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' and m.get('reasoning_content') and loop.index0 > ns.last_user -%}"
    "{{- '<think>' + m['reasoning_content'] + '</think>' -}}{%- endif -%}"
    "{{- m['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_rows_a_template_writes_otherwise_once_a_later_turn_follows_are_refused_before_the_model_loads(tmp_path):
    """The start's probe judges a template on an answer with `</think>` in its content: one that drops an earlier
    answer's `reasoning_content` (its field, which the probe has none of) passed it, and the rows that hold one raised
    `Rewritten` inside the trainer's map, a traceback once the model had loaded. Each row is judged as it is read."""
    import train_dpo

    template = tmp_path / "drops.jinja"
    template.write_text(DROPS_EARLIER_REASONING)
    history = [
        {"role": "user", "content": "river"},
        {"role": "assistant", "content": "stone", "reasoning_content": "quiet"},
        {"role": "user", "content": "north"},
    ]
    rows = [
        {
            "chosen": [*history, {"role": "assistant", "content": f"light {i}", "reasoning_content": "a"}],
            "rejected": [*history, {"role": "assistant", "content": f"no {i}", "reasoning_content": "b"}],
        }
        for i in range(16)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--dataset_name", str(path), "--chat_template_path", str(template)]
    says = "assistant_turns all: the chat template writes an earlier assistant turn otherwise once a later turn follows"
    with pytest.raises(ConfigError, match=says) as refused:
        train_dpo.main([*args, "--output_dir", str(out)])
    assert "\n" not in str(refused.value) and "--assistant_turns final" in str(refused.value)
    assert not out.exists()  # before the model loads: no trainer made the folder
    train_dpo.main([*args, "--output_dir", str(out), "--assistant_turns", "final", "--dry-run"])  # final takes them


@pytest.mark.parametrize("option", [["--use_weighting", "true"], ["--ld_alpha", "0.5"]], ids=["wpo", "ld_dpo"])
def test_losses_that_read_one_completion_refuse_all(option):
    from dpotrain import options

    recipe = parse_args(["--config", SMOKE, "--output_dir", "/tmp/unused", "--assistant_turns", "all", *option])
    with pytest.raises(ConfigError, match=f"{option[0][2:]} with assistant_turns all: .*assistant_turns final"):
        options.check_options(recipe)
    final = parse_args(["--config", SMOKE, "--output_dir", "/tmp/unused", "--assistant_turns", "final", *option])
    options.check_options(final)  # TRL's split: one completion per side


def test_every_collator_marks_the_labeled_prompt_tokens_on_both_sides():
    """The packed, shared-prompt and padded collators lay out each sequence's completion mask as its prompt's labels
    then its completion, cut at max_length; a shared prompt's labels count on both sides. Without the column (`final`)
    the prompt is unlabeled, as TRL's collator has it."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from dpotrain.forwards import packing, padded, shared_prompt

    examples = [
        {"prompt_ids": [5, 6, 7, 8], "chosen_ids": [9, 10], "rejected_ids": [11], LABELS: [0, 1, 1, 0]},
        {"prompt_ids": [5, 6], "chosen_ids": [12], "rejected_ids": [13, 14, 15], LABELS: [0, 0]},
    ]
    labeled = [[0, 1, 1, 0, 1], [0, 0, 1, 0, 0], [0, 1, 1, 0, 1], [0, 0, 1, 1, 1]]  # chosen 0, 1; rejected 0, 1
    unlabeled = [[0, 0, 0, 0, 1], [0, 0, 1, 0, 0], [0, 0, 0, 0, 1], [0, 0, 1, 1, 1]]
    collators = [
        packing.PackedPreferenceCollator(max_length=5),
        shared_prompt.SharedPromptCollator(max_length=5),
        padded.GroupedCollator(DataCollatorForPreference(pad_token_id=0, max_length=5)),
    ]
    for collate in collators:
        for rows, want in (
            (examples, labeled),
            ([{k: v for k, v in e.items() if k != LABELS} for e in examples], unlabeled),
        ):
            batch = collate(rows)
            view = packing.padded_view(batch) if packing.is_packed(batch) else batch
            assert view["completion_mask"].tolist() == want, type(collate).__name__
    assert "seq_offsets" in shared_prompt.SharedPromptCollator(max_length=5)(examples)  # the prompt was shared


@pytest.mark.slow
def test_a_pair_whose_prompt_fills_max_length_adds_nothing_to_open_instructs_gradient(tiny_model_dir):
    """Such a pair is dropped and counted here (TRL's rule, both modes: docs/data.md). open-instruct keeps it when an
    earlier assistant turn fits in max_length, but its two sides are then the same tokens with the same labels: it
    adds exactly ln 2 to the loss and nothing to the gradient (it only weighs the other pairs less)."""
    from open_instruct_dpo import dpo_norm_loss
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pair = pairs()[3]  # three_turns: two earlier exchanges
    prompt = tokenizer.apply_chat_template(pair["chosen"][:-1], add_generation_prompt=True, return_dict=True)
    max_length = len(prompt["input_ids"]) - 2  # the prompt alone fills it
    (chosen, rejected), *_ = kept_pairs([pair], tokenizer, max_length)  # kept: labeled earlier turns fit
    assert chosen == rejected and any(x != -100 for x in chosen[1])
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))  # a policy away from the reference
    loss = dpo_norm_loss(policy, reference, [pair], tokenizer, BETA, max_length)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert max(float(p.grad.abs().max()) for p in policy.parameters() if p.grad is not None) <= 1e-6


@pytest.mark.parametrize("content", ["", " \u200b"], ids=["empty", "unseen"])
def test_an_empty_earlier_answer_is_refused_where_all_trains_it_and_kept_as_context_under_final(
    content, tmp_path, tiny_model_dir
):
    """An empty earlier assistant turn of the shared prompt went through the rows check, which refused only an empty
    final answer: under `all` it trained as an empty turn. Refused in one line, by file, row and message, before the
    model loads; under `final` it is context, not trained, and the pair stays (as it did)."""
    from dpotrain import stages
    from dpotrain.data.builtin import make_preference_rows

    pairs = make_preference_rows(10, seed=3)
    assert pairs[7]["chosen"][1]["role"] == "assistant"  # the multi-turn row: an earlier exchange before the answer
    for side in ("chosen", "rejected"):
        pairs[7][side][1]["content"] = content
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(path)]
    recipe = parse_args([*args, "--output_dir", str(tmp_path / "run")])
    assert recipe.project.assistant_turns == "all"  # the smoke recipe's, as OLMo 3's
    with pytest.raises(ConfigError) as refused:
        stages.load_data(recipe, stages.checks(recipe), say=False)
    said = str(refused.value)
    assert "\n" not in said and said.startswith(
        "row 7, column 'prompt': message 1 is an earlier assistant turn with empty content, which assistant_turns all "
        "trains"
    ), said
    assert "(line 8 of " in said and "--assistant_turns final" in said and "--skip_invalid true" in said
    final = parse_args([*args, "--output_dir", str(tmp_path / "run"), "--assistant_turns", "final"])
    assert len(stages.load_data(final, stages.checks(final), say=False).train) == 10


def test_the_data_line_says_every_assistant_turn_is_trained_under_all(tmp_path, capsys, tiny_model_dir):
    """The run's and the analyzer's data line said "prompt = the messages before the last assistant turn" under
    `assistant_turns: all` too, as if the earlier answers were context only: it now says they are trained, and
    `final` keeps TRL's wording."""
    from dpotrain import stages
    from dpotrain.data import lengths
    from dpotrain.data.builtin import make_preference_rows

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in make_preference_rows(10, seed=3)))
    args = ["--config", SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(path)]
    tokenizer = lengths.load_tokenizer(tiny_model_dir)
    said = {}
    for turns_ in ("all", "final"):
        recipe = parse_args([*args, "--output_dir", str(tmp_path / "run"), "--assistant_turns", turns_])
        stages.load_data(recipe, stages.checks(recipe))
        data_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Data (train)"))
        rows = datasets.load_dataset("json", data_files=str(path))["train"]
        measured = lengths.measure(rows, tokenizer, num_proc=1, assistant_turns=turns_)
        said[turns_] = (data_line, measured.shape)
    every = "; assistant_turns all: the prompt's assistant turns are trained too (every turn, as open-instruct's); "
    assert all(every in line for line in said["all"]), said["all"]
    assert all("prompt = the messages before the last assistant turn; the " in line for line in said["final"]), said
