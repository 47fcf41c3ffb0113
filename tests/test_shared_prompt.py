"""Shared-prompt packing computes what unshared packing computes: per-token log-probs, loss and gradients (fp32), LoRA's
included; a completion never sees the other; models that carry state never share. The layout itself is proven on
literal tensors (tests/test_literal_tensors.py); step 1 of a run with prompts shared and the cached reference is ln 2
in tests/test_training.py (the smoke recipe shares prompts on a CPU)."""

import datasets
import pytest
import torch

from conftest import ROOT, built, ready
from dpotrain.data import builtin
from dpotrain.forwards import masks, packing, shared_prompt
from dpotrain.forwards.shared_prompt import SharedPromptCollator
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def random_pairs(seed=0, prompts=(150, 30, 1, 400), completions=((40, 90), (200, 20), (7, 9), (5, 3))):
    """Token-id pairs of very different shapes: prompts longer than the tiny OLMo 3's 128-token sliding window, a
    one-token prompt, long shared histories with short answers."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(5, 800, (n,), generator=g).tolist()

    return [
        {"prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(r)}
        for p, (c, r) in zip(prompts, completions, strict=True)
    ]


def fused(model_dir, attn="sdpa"):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def per_token(model, batch):
    return packing.unpack_outputs(packing.forward(model, batch), batch).log_probs


@pytest.mark.slow
@pytest.mark.parametrize("model, attn", [("olmo3", "sdpa"), ("olmo3", "eager"), ("llama", "sdpa")])
def test_shared_equals_unshared_log_probs(model, attn, tiny_model_dir, llama_dir):
    model_dir = tiny_model_dir if model == "olmo3" else llama_dir
    m = fused(model_dir, attn)
    assert shared_prompt.share_problem(m.config, attn) is None
    pairs = random_pairs()
    unshared = packing.PackedPreferenceCollator(1024, hidden_size=64)(pairs)
    shared = SharedPromptCollator(1024, hidden_size=64)(pairs)
    # P + C + R + 1 positions per pair instead of 2P + C + R
    assert shared["attention_block"].gt(0).sum() == sum(
        len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) + 1 for p in pairs
    )
    with torch.no_grad():
        want, got = per_token(m, unshared), per_token(m, shared)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 1e-5
    assert ((got.sum(1) - want.sum(1)).abs() / want.sum(1).abs()).max() < 1e-6  # fp32 resolution of the sums
    for key in ("input_ids", "attention_mask", "completion_mask"):  # TRL's view: the same padded batch
        assert torch.equal(packing.padded_view(unshared)[key], packing.padded_view(shared)[key]), key


def test_a_completion_never_sees_the_other(tiny_model_dir):
    m = fused(tiny_model_dir)
    pairs = random_pairs(prompts=(20,), completions=((15, 12),))
    batch = SharedPromptCollator(1024, hidden_size=64)(pairs)
    kind_masks = masks.dense_masks(m, batch)
    branch = batch["attention_branch"][0]
    for kind, mask in kind_masks.items():
        seen = mask[0, 0]
        assert not seen[branch == 1][:, branch == 2].any() and not seen[branch == 2][:, branch == 1].any(), kind
        assert seen[branch == 2][:, branch == 0].all() or kind == "sliding_attention"  # the prompt is seen
    # ...and in what the model computes: other rejected tokens leave the chosen log-probs bit for bit unchanged.
    other = [{**pairs[0], "rejected_ids": [t + 1 for t in pairs[0]["rejected_ids"]]}]
    with torch.no_grad():
        a = per_token(m, batch)
        b = per_token(m, SharedPromptCollator(1024, hidden_size=64)(other))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])


def test_answers_that_share_more_than_the_prompt_stay_exact(tiny_model_dir):
    """Multi-turn rows whose chosen and rejected answers start with the same tokens: only the prompt is shared, and
    the common start of the answers is scored on each side."""
    m = fused(tiny_model_dir)
    g = torch.Generator().manual_seed(3)
    common = torch.randint(5, 800, (30,), generator=g).tolist()
    pairs = [
        {
            "prompt_ids": torch.randint(5, 800, (200,), generator=g).tolist(),
            "chosen_ids": common + [7, 8, 9],
            "rejected_ids": common + [11],
        }
    ]
    with torch.no_grad():
        want = per_token(m, packing.PackedPreferenceCollator(1024, hidden_size=64)(pairs))
        got = per_token(m, SharedPromptCollator(1024, hidden_size=64)(pairs))
    assert (got - want).abs().max() < 1e-5 and want[1].ne(0).sum() == 31  # the common 30 and its own last token


def test_a_pair_without_a_prompt_is_laid_out_unshared_and_scored_as_trl_scores_it(tiny_model_dir):
    """Issue 53 item 7: text answers that share no start (" 64." / " 66.", no prompt column) give TRL an empty prompt;
    the reference stage crashed on it (IndexError: the prompt's last token). Such a pair has nothing to share: it is
    laid out unshared in the same row, scored exactly as unshared packing scores it, and planned at its true size."""
    from dpotrain.data.pair_lengths import PairLengths

    m = fused(tiny_model_dir)
    pairs = random_pairs(prompts=(0, 20, 0), completions=((6, 9), (15, 12), (1, 4)))
    shared = SharedPromptCollator(1024, hidden_size=64)(pairs)
    unshared = packing.PackedPreferenceCollator(1024, hidden_size=64)(pairs)
    with torch.no_grad():
        want, got = per_token(m, unshared), per_token(m, shared)
    assert (got - want).abs().max() < 1e-5 and want[0].ne(0).sum() == 5  # a completion's first token has no predictor
    counts = [torch.tensor([len(p[k]) for p in pairs]).numpy() for k in ("prompt_ids", "chosen_ids", "rejected_ids")]
    planned = PairLengths.from_parts(*counts, 1024, share=True)
    assert planned.tokens.sum() == shared["attention_block"].gt(0).sum() == 6 + 9 + 20 + 15 + 12 + 1 + 1 + 4


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_is_trls_and_keep_end_cuts_are_laid_out_unshared(mode, tiny_model_dir):
    m = fused(tiny_model_dir)
    pairs = random_pairs()[:3]  # (TRL drops a pair whose prompt alone fills max_length before any collator sees it)
    with torch.no_grad():
        want = per_token(m, packing.PackedPreferenceCollator(180, mode, hidden_size=64)(pairs))
        shared = SharedPromptCollator(180, mode, hidden_size=64)(pairs)
        got = per_token(m, shared)
    assert (got - want).abs().max() < 1e-5
    units = int(shared["attention_block"].max())
    assert units == (3 if mode == "keep_start" else 5)  # keep_end: two pairs cut into their prompt: 2 units each


def trainer_for(tmp_path, model_dir, rows, *overrides):
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(tmp_path),
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            *overrides,
        ]
    )
    return ready(built(recipe, datasets.Dataset.from_list(rows)))


def loss_and_grads(trainer, indices):
    trainer.model.train()
    trainer.model.zero_grad()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in indices])
    loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def perturb(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.02)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [[], ["--use_peft", "true", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj"]],
    ids=["sigmoid_norm", "lora"],
)
def test_loss_and_gradients_equal_unshared_packing(tmp_path, tiny_model_dir, extra):
    """The recipe's loss, and LoRA's adapter gradients. Other losses read the same padded view (equal for shared and
    unshared rows: tests/test_literal_tensors.py) and are each held to plain TRL in tests/test_loss_variants.py."""
    rows = builtin.make_preference_rows(6, seed=4)
    unshared = trainer_for(tmp_path / "unshared", tiny_model_dir, rows, "--share_prompt", "false", *extra)
    # Asked for: on these 6 short pairs the CPU's decision (forwards/cost.py) would not share them.
    shared = trainer_for(tmp_path / "shared", tiny_model_dir, rows, "--share_prompt", "true", *extra)
    assert shared.forward.share_prompt and not unshared.forward.share_prompt
    for trainer in (unshared, shared):  # the reference was scored before training; move the policy away from it
        perturb(trainer.model)
    indices = list(range(len(rows)))
    loss_u, grads_u = loss_and_grads(unshared, indices)
    loss_s, grads_s = loss_and_grads(shared, indices)
    assert abs(loss_s - loss_u) < 1e-5, (loss_s, loss_u)
    assert grads_s.keys() == grads_u.keys() and grads_u
    for name, g in grads_u.items():
        assert (grads_s[name] - g).abs().max() <= 1e-6 + 1e-5 * g.abs().max(), name


def test_never_shared_where_it_is_not_exact(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, OlmoHybridConfig

    hybrid = OlmoHybridConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert "carry state" in shared_prompt.share_problem(hybrid, "sdpa")
    olmo3 = AutoConfig.from_pretrained(tiny_model_dir)
    assert "varlen" in shared_prompt.share_problem(olmo3, "flash_attention_2")
    rows = builtin.make_preference_rows(4, seed=1)
    with pytest.raises(ConfigError, match="flash_attention_2 cannot run here: .*needs a CUDA GPU"):  # never replaced
        trainer_for(
            tmp_path, tiny_model_dir, rows, "--share_prompt", "true", "--attn_implementation", "flash_attention_2"
        )
