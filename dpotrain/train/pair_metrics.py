"""DPO metrics as sums and counts, reduced across ranks once per logged step.

TRL gathers per-pair tensors from every rank on every micro-batch and averages per-micro-batch means: with token-budget
micro-batches ranks hold different numbers of pairs (a gather of unequal tensors hangs), and a mean of means weights a
pair by its micro-batch's size. Here every metric is a (sum, count) per rank, summed over ranks with one all-reduce
when the Trainer logs. Definitions follow TRL's `_compute_loss`, plus OLMo 3's length-normalized `rewards_norm/*`.
"""

import time

import torch
from transformers import TrainerCallback

from dpotrain.cluster.collectives import all_reduce_sum

REWARD_STATS = ("chosen", "rejected", "accuracies", "margins")  # of TRL's rewards/* and the per-token rewards_norm/*
PAIR_MEAN = [*(f"rewards/{k}" for k in REWARD_STATS), "logps/chosen", "logps/rejected"]
PAIR_MEAN += [f"rewards_norm/{k}" for k in REWARD_STATS]
# Every rank sums the same keys in the same order, so one all-reduce of one vector reduces them all.
SUMS = PAIR_MEAN + str.split(
    "loss pairs entropy completion_tokens logits/chosen logits/rejected chosen_tokens rejected_tokens top1 tokens "
    "positions aux_loss aux_loss_pairs dpo_loss dpo_loss_pairs model_flops computed_tokens"
)
# What an evaluation logs (`reduce("eval")`; transformers prefixes each with eval_ and adds its runtime,
# samples_per_second and steps_per_second): the names metric_for_best_model may choose from
# (options.check_best_metric). aux_loss and dpo_loss on a MoE model only.
EVAL_LOGGED = (
    *PAIR_MEAN,
    *("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "padding_share", "aux_loss", "dpo_loss"),
    "loss",
)


def sequence_logps(per_token: torch.Tensor, shift_mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """Summed completion log-probs per sequence of a `[2B, L-1]` layout, with TRL's LD-DPO weighting when set."""
    if ld_alpha is None:
        return (per_token * shift_mask).sum(dim=1)
    position = shift_mask.cumsum(dim=1)
    chosen_lens, rejected_lens = shift_mask.sum(dim=1).chunk(2)
    shared = torch.minimum(chosen_lens, rejected_lens).repeat(2).unsqueeze(1)
    shared_mask = (position > 0) & (position <= shared) & shift_mask.bool()
    tail_mask = (position > shared) & shift_mask.bool()
    return (per_token * shared_mask).sum(dim=1) + ld_alpha * (per_token * tail_mask).sum(dim=1)


class PairMetrics(TrainerCallback):
    def __init__(self, world_size: int = 1, peak_tflops: float | None = None):
        self.world_size, self.peak_tflops = world_size, peak_tflops
        self.sums = {"train": dict.fromkeys(SUMS, 0.0), "eval": dict.fromkeys(SUMS, 0.0)}
        self.total_tokens = 0  # non-padding tokens trained on, over the whole run (TRL's `num_tokens`)
        self._last_log = (time.perf_counter(), 0)
        self._excluded = 0.0  # seconds since the last log spent on other work (samples): not training time

    def exclude(self, seconds: float) -> None:
        """Take `seconds` of other work (sample generation) out of the throughput clock's current interval."""
        self._excluded += seconds

    def start(self, log_history: list[dict]) -> None:
        """At the start of training: carry `num_tokens` over from a resumed run, and start the throughput clock."""
        counted = [r["num_tokens"] for r in log_history if "num_tokens" in r and "loss" in r]
        self.total_tokens = int(counted[-1]) if counted else 0
        self._last_log, self._excluded = (time.perf_counter(), self.total_tokens), 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start(state.log_history)  # after a resume, log_history is the checkpoint's

    def add(
        self,
        mode: str,
        outputs,
        inputs: dict,
        beta: float,
        ld_alpha,
        positions: int,
        computed_tokens: int,
        loss: torch.Tensor,
        model_flops: float = 0.0,
        dpo_loss: torch.Tensor | None = None,
    ):
        """Accumulate one micro-batch: `outputs` and `inputs` (with `ref_*_logps`) in TRL's padded `[2B, L]` layout,
        `positions` what the model ran, `computed_tokens` the real tokens among them, `loss` TRL's mean loss,
        `model_flops` its forward + backward, `dpo_loss` the loss without the MoE router term."""
        s = self.sums[mode]
        with torch.no_grad():
            shift_mask = inputs["completion_mask"][:, 1:].to(outputs.log_probs.dtype)
            logps = sequence_logps(outputs.log_probs.detach(), shift_mask, ld_alpha)
            chosen, rejected = logps.chunk(2)
            pairs = chosen.numel()
            chosen_len, rejected_len = shift_mask.sum(dim=1).clamp(min=1).chunk(2)
            rewards = beta * (chosen - inputs["ref_chosen_logps"]), beta * (rejected - inputs["ref_rejected_logps"])
            norm = rewards[0] / chosen_len, rewards[1] / rejected_len
            values = {"logps/chosen": chosen, "logps/rejected": rejected}
            for scale, (c, r) in (("rewards", rewards), ("rewards_norm", norm)):
                stats = (c, r, (c > r).float(), c - r)
                values |= {f"{scale}/{k}": v for k, v in zip(REWARD_STATS, stats, strict=True)}
            # Device tensors until the log step: a float() here would stall the GPU on every micro-batch.
            for name, v in values.items():
                s[name] += v.sum()
            s["pairs"] += pairs
            s["loss"] += loss.detach() * pairs
            chosen_mask, rejected_mask = shift_mask.chunk(2)
            s["entropy"] += (outputs.entropy * shift_mask).sum()
            s["completion_tokens"] += shift_mask.sum()
            mean_logits = outputs.mean_logits.chunk(2)
            s["logits/chosen"] += (mean_logits[0] * chosen_mask).sum()
            s["logits/rejected"] += (mean_logits[1] * rejected_mask).sum()
            s["chosen_tokens"] += chosen_mask.sum()
            s["rejected_tokens"] += rejected_mask.sum()
            s["top1"] += (outputs.is_top1.chunk(2)[0] & chosen_mask.bool()).sum()
            s["tokens"] += inputs["attention_mask"].sum()
            s["positions"] += positions
            s["model_flops"] += model_flops
            s["computed_tokens"] += computed_tokens
            # MoE: micro-batch means weighed by their pairs, as the loss is, so that over a log with steps of equal
            # size loss = dpo_loss + router_aux_loss_coef x aux_loss.
            for name, value in (("aux_loss", getattr(outputs, "aux_loss", None)), ("dpo_loss", dpo_loss)):
                if value is not None:
                    s[name] += value.detach() * pairs
                    s[f"{name}_pairs"] += pairs

    def reduce(self, mode: str, device) -> dict[str, float]:
        """Means over all ranks since the last call; every rank must call it at the same point (it all-reduces)."""
        s = self.sums[mode]
        totals = torch.stack([torch.as_tensor(s[n], dtype=torch.float64, device=device) for n in SUMS])
        totals = all_reduce_sum(totals)
        s = dict(zip(SUMS, totals.tolist(), strict=True))
        self.sums[mode] = dict.fromkeys(SUMS, 0.0)
        if not s.get("pairs"):
            return {}

        def ratio(a, b):
            return s[a] / s[b] if s.get(b) else 0.0

        out = {name: s[name] / s["pairs"] for name in PAIR_MEAN}
        out |= {
            "entropy": ratio("entropy", "completion_tokens"),
            "logits/chosen": ratio("logits/chosen", "chosen_tokens"),
            "logits/rejected": ratio("logits/rejected", "rejected_tokens"),
            "mean_token_accuracy": ratio("top1", "chosen_tokens"),
            "padding_share": 1 - ratio("computed_tokens", "positions"),
        }
        for name in ("aux_loss", "dpo_loss"):  # dpo_loss: without the router term, what the health guards judge
            if s[f"{name}_pairs"]:
                out[name] = ratio(name, f"{name}_pairs")
        # The mean over the pairs: the Trainer's eval_loss averages per-batch means, and its training loss averages the
        # window's step means, which weighs an epoch's short last step (3 pairs) as much as a full one (8).
        out["loss"] = s["loss"] / s["pairs"]
        if mode == "train":
            self.total_tokens += int(s["tokens"])
            now = time.perf_counter()
            then, tokens_then = self._last_log
            elapsed = max(now - then - self._excluded, 1e-9)
            self._excluded = 0.0
            out["num_tokens"] = self.total_tokens
            out["tokens_per_second"] = (self.total_tokens - tokens_then) / elapsed
            if self.world_size > 1:  # one process: the same number twice (two identical lines in the plot)
                out["tokens_per_second_per_gpu"] = out["tokens_per_second"] / self.world_size
            if self.peak_tflops:  # model FLOPs per second per GPU over the peak: flops.py
                out["mfu"] = s["model_flops"] / elapsed / self.world_size / (self.peak_tflops * 1e12)
            self._last_log = (now, self.total_tokens)
        return out
