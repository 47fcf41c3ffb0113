"""TRL's DPO loss as this project runs it: which terms hold per pair, the one normalized over the whole step, the
losses refused on a token budget, and the loss a run must show before its first update.

Each micro-batch's loss is weighed by its share of the step's pairs, so a term is the same however a step is cut only
if it is per pair. The audit of TRL 1.16's `DPOTrainer._compute_loss` is in docs/losses.md: all but `sft` (per token:
here over the whole step's chosen tokens, `SftOverStep`; refused with WPO's weights) and aot/aot_unpaired (they rank a
micro-batch's pairs: refused on a token budget) are per pair; the MoE router's loss is weighed by its pairs.
"""

import dataclasses
import math

import torch

from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.refused import said

# Which DPOConfig options each of TRL 1.16's loss types reads (`_compute_loss`): one set that no configured type reads
# is refused (`check_ignored`). label_smoothing: not sigmoid_norm (open-instruct's dpo_norm reads it; TRL's does not).
READS_LABEL_SMOOTHING = {"exo_pair", "robust", "aot", "aot_unpaired"}
# f_divergence_type: TRL allows these loss types; of them, sft scores the chosen tokens' NLL, not the log-ratios.
F_DIVERGENCE_ALLOWED = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
READS_F_DIVERGENCE = F_DIVERGENCE_ALLOWED - {"sft"}
# The f-divergences `_compute_loss` knows; TRL's DPOConfig takes any string, and another fails at step 1
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Losses across a micro-batch's pairs (they sort its log-ratios): a token budget would change what they optimize.
BATCH_LEVEL_LOSSES = {"aot", "aot_unpaired"}
SFT = "sft"
# Losses 0 at a finite margin by design (robust: below 0 once the margin is large): a loss under health_loss_floor is
# their optimum, not pairs separated far beyond beta's KL term (the `loss_floor` guard's premise): hinge relu(1 - beta
# x margin), ipo and sppo_hard a squared distance to a target margin, exo_pair a KL to [1 - eps, eps].
ZERO_AT_A_FINITE_MARGIN = {"hinge", "ipo", "sppo_hard", "exo_pair", "robust"}


def loss_types(args) -> list[str]:
    return list(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]


def loss_weights(args) -> list[float]:
    return list(args.loss_weights or [1.0] * len(loss_types(args)))


def check_options(recipe) -> None:
    """Loss settings this project cannot train as TRL defines them, refused before anything loads."""
    t, budget = recipe.training, recipe.project.max_tokens_per_microbatch
    types = loss_types(t)
    if t.loss_weights is not None and not any(loss_weights(t)):  # a loss of 0 at every step: a gradient of 0
        raise ConfigError(
            f"loss_weights {' '.join(f'{w:g}' for w in t.loss_weights)} weigh every loss term by 0: the run would "
            "train nothing: give each term of loss_type its weight (MPO: --loss_type sigmoid bco_pair sft "
            "--loss_weights 0.8 0.2 1.0), or remove loss_weights"
        )
    negative = [f"{w:g} x {n}" for n, w in zip(types, loss_weights(t), strict=False) if w < 0]
    if negative:  # TRL multiplies as given: each type's loss is lowest where chosen wins, so -w trains toward rejected
        raise ConfigError(
            f"loss_weights: {', '.join(negative)} is negative: a negative weight maximizes its loss term, training "
            "toward the rejected completions (and for most types without bound): give each term of loss_type a "
            "weight >= 0 (MPO: --loss_type sigmoid bco_pair sft --loss_weights 0.8 0.2 1.0)"
        )
    batch_level = sorted(set(types) & BATCH_LEVEL_LOSSES)
    if batch_level and budget is not None:
        raise ConfigError(
            f"loss_type {'/'.join(batch_level)} compares each pair with the other pairs of its micro-batch (it sorts "
            f"their log-ratios), so micro-batches cut by max_tokens_per_microbatch ({budget}) would change what it "
            "optimizes: add --max_tokens_per_microbatch none, for micro-batches of per_device_train_batch_size pairs "
            f"(now {t.per_device_train_batch_size}), the pairs compared together; choose them with "
            "--per_device_train_batch_size N (N dividing pairs_per_step / processes; --dry-run shows whether it fits)"
        )
    if SFT in types and t.use_weighting:
        raise ConfigError(f"use_weighting {said('weighting_sft')}")
    check_ignored(recipe)  # options the configured loss does not read at all, first
    check_values(recipe)
    if recipe.project.assistant_turns == "all":  # each side's labeled tokens are its earlier turns and its completion
        for name, value, what in (
            ("use_weighting", t.use_weighting, "WPO weighs each pair by its completions' per-token probabilities"),
            ("ld_alpha", t.ld_alpha is not None, "LD-DPO splits each completion where the shorter side's ends"),
        ):
            if value:
                raise ConfigError(
                    f"{name} with assistant_turns all: {what}, which needs one completion per side, "
                    f"not every assistant turn: remove {name}, or set assistant_turns final"
                )


def loss_text(s) -> str:
    """'sigmoid_norm, beta 5', with the option each configured variant reads (docs/losses.md), for the dry run and the
    model card. `s`: `Record.settings`."""
    types, weights = loss_types(s), s.loss_weights
    parts = [" + ".join(f"{w:g} x {t}" for t, w in zip(types, weights, strict=True)) if weights else " + ".join(types)]
    parts.append(f"beta {s.beta:g}")
    if set(types) & READS_LABEL_SMOOTHING:
        parts.append(f"label_smoothing {s.label_smoothing:g}")
    if "discopop" in types:
        parts.append(f"discopop_tau {s.discopop_tau:g}")
    if s.f_divergence_type not in (None, "reverse_kl"):
        parts.append(f"f_divergence_type {s.f_divergence_type}")
    if s.f_divergence_type == "alpha_divergence" and s.f_alpha_divergence_coef is not None:  # it shapes the loss
        parts.append(f"f_alpha_divergence_coef {s.f_alpha_divergence_coef:g}")
    if s.ld_alpha is not None:
        parts.append(f"ld_alpha {s.ld_alpha:g} (LD-DPO)")
    if s.use_weighting:
        parts.append("use_weighting (WPO)")
    if s.sync_ref_model:
        parts.append("sync_ref_model (TR-DPO)")
    return ", ".join(parts)


def _set(recipe, name: str) -> bool:
    """Whether the recipe or the command line set `name` to other than DPOConfig's default."""
    from trl import DPOConfig

    default = next(f.default for f in dataclasses.fields(DPOConfig) if f.name == name)
    return name in recipe.given and getattr(recipe.training, name) != default


def check_values(recipe) -> None:
    """Loss settings TRL fails on, or that trip a guard at once (an unknown f-divergence, too high a loss floor)."""
    t, floor = recipe.training, recipe.project.health_loss_floor
    types = loss_types(t)
    if t.f_divergence_type not in F_DIVERGENCES:  # a ValueError at the first loss, after the reference stage
        raise ConfigError(
            f"unknown f_divergence_type {t.f_divergence_type!r}: choose from {', '.join(F_DIVERGENCES)} (the default, "
            "reverse_kl, is DPO's)"
        )
    # TRL's field says "Must be in [0.0, 1.0]" and checks nothing: its loss weighs each side's tokens past the shorter
    # side's end by it (shared + ld_alpha x tail), so a negative one rewarded the chosen answer for a less likely tail
    if t.ld_alpha is not None and not 0 <= t.ld_alpha <= 1:
        raise ConfigError(
            f"ld_alpha must be in [0, 1] (got {t.ld_alpha:g}): LD-DPO weighs each answer's tokens past the shorter "
            "answer's end by it (1: no weighting, 0: those tokens left out); the LD-DPO paper's values lie between"
        )
    start = step1_loss(t)  # the loss floor judges a loss falling from there: one at or above it trips at once
    if floor > 0 and loss_floor_applies(t) and start is not None and floor >= start:
        raise ConfigError(
            f"health_loss_floor {floor:g} is not below the loss before any update ({start:.4g}: {'+'.join(types)} at "
            "log-ratios 0), so the guard would stop the run at its first logged step as a collapse: give a floor "
            "near 0 (default 0.01), or 0 to turn the guard off"
        )


def check_ignored(recipe) -> None:
    """Options TRL 1.16's loss would not read for the configured loss types, or fail on after the model loaded."""
    t = recipe.training
    types = loss_types(t)
    named = "/".join(types)
    if _set(recipe, "label_smoothing") and not set(types) & READS_LABEL_SMOOTHING:
        raise ConfigError(f"label_smoothing {t.label_smoothing:g} {said('label_smoothing', loss=named)}")
    if "exo_pair" in types and not 0 < t.label_smoothing < 1:
        raise ConfigError(
            f"loss_type exo_pair needs 0 < label_smoothing < 1 (got {t.label_smoothing:g}): the EXO paper recommends "
            "--label_smoothing 1e-3"
        )
    # aot's and aot_unpaired's smoothing is cDPO's, (1 - e) x -logsigmoid(x) + e x -logsigmoid(-x), which TRL never
    # checks: at 0.5 or more it trains toward the rejected answers, outside [0, 1] a term's weight is negative
    if flipped := [x for x in ("robust", "aot", "aot_unpaired") if x in types and not 0 <= t.label_smoothing < 0.5]:
        raise ConfigError(
            f"loss_type {flipped[0]} needs 0 <= label_smoothing < 0.5, the assumed share of flipped labels "
            f"(got {t.label_smoothing:g}): pass e.g. --label_smoothing 0.1"
        )
    if t.f_divergence_type != "reverse_kl":
        if other := [x for x in types if x not in F_DIVERGENCE_ALLOWED]:
            allowed = ", ".join(sorted(READS_F_DIVERGENCE))
            applies = said("f_divergence_applies", other="/".join(other), allowed=allowed)
            raise ConfigError(f"f_divergence_type {t.f_divergence_type} {applies}")
        if not set(types) & READS_F_DIVERGENCE:
            raise ConfigError(f"f_divergence_type {t.f_divergence_type} {said('f_divergence_sft')}")
    if _set(recipe, "f_alpha_divergence_coef") and t.f_divergence_type != "alpha_divergence":
        raise ConfigError(f"f_alpha_divergence_coef {t.f_alpha_divergence_coef:g} {said('f_alpha_divergence_coef')}")
    if _set(recipe, "discopop_tau") and "discopop" not in types:
        raise ConfigError(f"discopop_tau {t.discopop_tau:g} {said('discopop_tau')}")
    if t.ld_alpha is not None and types == [SFT]:
        raise ConfigError(f"ld_alpha {t.ld_alpha:g} {said('ld_alpha')}")
    if t.use_weighting and set(types) & BATCH_LEVEL_LOSSES:
        losses = "/".join(sorted(set(types) & BATCH_LEVEL_LOSSES))
        raise ConfigError(f"use_weighting {said('weighting_sorted', losses=losses)}")
    floor = recipe.project.health_loss_floor
    if "health_loss_floor" in recipe.given and floor > 0 and not loss_floor_applies(t):
        reaching = "/".join(sorted(set(types) & ZERO_AT_A_FINITE_MARGIN))
        raise ConfigError(f"health_loss_floor {floor:g} {said('health_loss_floor', reaching=reaching)}")
    for name in ("ref_model_mixup_alpha", "ref_model_sync_steps"):
        if _set(recipe, name) and not t.sync_ref_model:
            raise ConfigError(f"{name} {getattr(t, name):g} {said(name, name=name)}")


def loss_floor_applies(args) -> bool:
    """Whether a loss near 0 means the pairs separate far beyond beta's KL term (see `ZERO_AT_A_FINITE_MARGIN`)."""
    return not set(loss_types(args)) & ZERO_AT_A_FINITE_MARGIN


def step1_loss(args) -> float | None:
    """The loss before the first update, when the policy is the reference and every log-ratio is 0 (so is every
    f-divergence's score, and LD-DPO's weighted sums are equal); None where it depends on the model (the SFT term,
    WPO's weights)."""
    if args.use_weighting:
        return None
    beta, eps = args.beta, args.label_smoothing
    at_zero = {
        **dict.fromkeys(("sigmoid", "sigmoid_norm", "robust", "aot", "aot_unpaired"), math.log(2)),
        **dict.fromkeys(("hinge", "apo_zero", "apo_down"), 1.0),
        **dict.fromkeys(("nca_pair", "bco_pair"), 2 * math.log(2)),
        "ipo": _over_beta_squared(1 / 4, beta),
        "sppo_hard": _over_beta_squared(1 / 2, beta),
        "discopop": (math.log(2) + 1) / 2,  # half logistic, half exponential at a modulation of sigmoid(0)
        # KL([1/2, 1/2] || [1 - eps, eps])
        "exo_pair": -math.log(2) - 0.5 * math.log(eps * (1 - eps)) if 0 < eps < 1 else None,
    }
    values = [at_zero.get(t) for t in loss_types(args)]
    if any(v is None for v in values):
        return None
    return sum(v * w for v, w in zip(values, loss_weights(args), strict=True))


def _over_beta_squared(k: float, beta: float) -> float | None:
    """k / beta^2, None where floats cannot hold it (a beta of 1e-200 or 1e300)."""
    try:
        return k / beta**2
    except ArithmeticError:
        return None


def chosen_tokens(view: dict) -> torch.Tensor:
    """The chosen completion tokens TRL's SFT term averages over, in its padded `[2B, L]` layout (shifted by one)."""
    mask = view["completion_mask"]
    return mask[: mask.shape[0] // 2, 1:].sum()


class SftOverStep:
    """TRL's SFT term as the mean over the whole step's chosen tokens on all ranks. The trainer weighs a micro-batch's
    loss by n_k x W / N (its pairs n_k of the step's N, on W ranks whose gradients are averaged). The SFT term of
    micro-batch k is NLL_k x N / (n_k x T), T the step's chosen tokens, so that over the step it gives sum_k NLL_k / T:
    independent of the cut, and TRL's mean when it is one cut."""

    def __init__(self, args):
        types, weights = loss_types(args), loss_weights(args)
        self.weight = sum(w for t, w in zip(types, weights, strict=True) if t == SFT)
        self.active = SFT in types
        # What TRL's `_compute_loss` computes besides it (the loss types it loops over, and their weights)
        self.others = ([t for t in types if t != SFT], [w for t, w in zip(types, weights, strict=True) if t != SFT])

    def term(self, outputs, view: dict, pairs: int, step_pairs, step_tokens) -> torch.Tensor:
        mask = view["completion_mask"][:, 1:]
        chosen_mask = mask[: mask.shape[0] // 2].bool()
        chosen_logps = outputs.log_probs[:, -mask.shape[1] :].chunk(2, dim=0)[0]
        nll = -chosen_logps[chosen_mask].sum()
        if pairs == 0:  # a filler: weighed 0 by the trainer
            return nll * 0
        return self.weight * nll * step_pairs / (pairs * step_tokens.clamp(min=1))
