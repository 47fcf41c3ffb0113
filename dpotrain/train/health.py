"""Guards that stop a doomed DPO run early, each with the step and the values that tripped it (post-mortems:
docs/health.md).

- `step1`: before the first update the policy IS the reference, so rewards are 0 and the loss is the configured loss at
  log-ratios 0 (`losses.step1_loss`); anything else means the reference is wrong (000: a stale reference cache).
- `loss_floor`, `accuracy_pinned`, `margin`, `logps_falling`: 001, a base model that found the chosen side ~960 nats
  less likely, collapsed: loss -> 0, reward accuracy 1.0 from the start, margins -> 18, chosen AND rejected log-probs
  falling together, outputs "hormonal hormonal hormonal".
- `nonfinite`: NaN/inf loss, grad norm or rewards.

The loss judged is `dpo_loss` where logged (MoE: without the router term); rewards are `rewards_norm/*` (beta x
log-ratio / completion tokens, the loss's scale), not TRL's `rewards/*` (beta x SUMMED log-ratio). A stop saves a
resumable checkpoint when the state is finite, ends training on every rank at the same step and leaves
`HealthGuard.stop` set: train_dpo.py exits with HEALTH_STOP_EXIT, unrequeued, and the same command is refused.
"""

import math
import sys
from dataclasses import dataclass

from transformers import TrainerCallback

from dpotrain.cluster.collectives import main_outcome, max_over_ranks
from dpotrain.recipe.errors import ConfigError
from dpotrain.train import dropout
from dpotrain.train.losses import loss_floor_applies, loss_types, step1_loss
from dpotrain.train.pair_metrics import REWARD_STATS
from dpotrain.train.resume import remember_health_stop

LN2 = math.log(2)
HEALTH_STOP_EXIT = 3  # as preflight's "fail": the run is doomed, a retry would fail the same way
# fp16's loss scaler starts at 2^16 and halves at each step it skips (gradients overflowed): 40 skips in a row reach
# 2^-24, where fp16 gradients underflow rather than overflow, so a run whose first 40 steps were all skipped is not in
# the scaler's warm-up: it trains nothing, and would go on doing so
FP16_ALL_SKIPPED = 40
# The run's optimizer steps under fp16 and those its loss scaler skipped, {"taken": n, "skipped": m}, kept in the
# checkpoint's trainer_state.json (a key of its `stateful_callbacks`, as samples.SAMPLED): a resume counts on from the
# checkpoint's, so a run that trained before it is not stopped as one that trained nothing
FP16_STEPS = "fp16_steps"


@dataclass
class Alarm:
    guard: str
    step: int
    message: str
    fatal: bool = False  # stops whatever health_action says (NaN: nothing to continue from)


def fp16_overflow(step: int, norm: float) -> str:
    """The line of an fp16 step whose gradients overflowed, said once a run."""
    return (
        f"step {step}: grad_norm {norm} under fp16: its gradients overflowed, so the loss scaler skipped that update "
        "and lowered its scale (the first steps of fp16 do this); the loss and weights are finite, so training goes "
        "on. Every step skipping is no training: use bf16 on a GPU that has it (Ampere or newer), which needs no scaler"
    )


def check_values(project) -> None:
    """Refuse health settings that cannot work, before anything loads."""
    p = project  # health_action: its parser's choices refuse another word
    for name in ("health_step1_tolerance", "health_loss_floor", "health_max_margin", "health_logp_drop"):
        if getattr(p, name) < 0:
            raise ConfigError(f"{name} must be >= 0 (got {getattr(p, name)}); 0 turns that guard off")
    if not 0 <= p.health_early_fraction <= 1:
        raise ConfigError(f"health_early_fraction must be in [0, 1] (got {p.health_early_fraction})")
    if p.health_pinned_pairs < 0:
        raise ConfigError(f"health_pinned_pairs must be >= 0 (got {p.health_pinned_pairs}); 0 turns that guard off")


class HealthGuard(TrainerCallback):
    def __init__(self, project, pairs_per_step: int):
        self.p = project
        self.pairs_per_step = pairs_per_step  # the run's (`resolve.decide_batch`), given or derived
        self.stop: Alarm | None = None  # the alarm that stopped training, read by train_dpo.py
        self.alarms: list[Alarm] = []
        self._warned: set[str] = set()
        self._fresh, self._pinned_pairs, self._last_step = False, 0, 0
        self._dropout: list[str] = []  # the dropout training keeps on (dropout.active), read at the start
        self.overflowed: int | None = None  # the last logged step whose fp16 gradients overflowed (`check`)
        self._taken = self._skipped = 0  # the run's optimizer steps under fp16, and those its loss scaler skipped
        self._accelerator = None  # the trainer's (`watch`)

    def watch(self, accelerator) -> None:
        """The trainer's accelerator, whose `optimizer_step_was_skipped` says whether fp16's loss scaler skipped the
        optimizer step just taken (DeepSpeed's too). Callbacks are given no optimizer: the Trainer makes it later."""
        self._accelerator = accelerator

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._fresh = state.global_step == 0  # a resumed run has no step 1 to check
        self._dropout = dropout.active(model) if model is not None else []
        if self._fresh and self._dropout and self.p.health_step1_tolerance > 0 and state.is_world_process_zero:
            print(f"health: {step1_unjudged(self._dropout)}", file=sys.stderr, flush=True)
        self._last_step = state.global_step
        if args.fp16:  # A checkpoint written before FP16_STEPS was kept holds none: its steps count as trained
            counted = state.stateful_callbacks.get(FP16_STEPS, {"taken": state.global_step, "skipped": 0})
            self._taken, self._skipped = counted["taken"], counted["skipped"]
        if not self._fresh:  # the pinned pairs counted up to the checkpoint: counted from 0, a resume missed the stop
            # From the checkpoint's trainer state, which every rank holds alike (every record metrics.jsonl got), not
            # from metrics.jsonl: that file may be deleted or edited between attempts, or seen late on another node.
            self._last_step = 0
            for record in state.log_history:
                if "loss" in record and record["step"] <= state.global_step:
                    self._count(record["step"], record)
            self._last_step = self._last_step or state.global_step

    def _count(self, step: int, logs: dict) -> None:
        """The pairs since the last log added to those with reward accuracy 1.0 in a row, or 0 where it fell."""
        acc = logs.get("rewards_norm/accuracies", logs.get("rewards/accuracies"))
        pairs = (step - self._last_step) * self.pairs_per_step
        self._pinned_pairs = self._pinned_pairs + pairs if acc is not None and acc >= 0.999 else 0
        self._last_step = step

    def on_optimizer_step(self, args, state, control, **kwargs):
        if args.fp16 and self._accelerator is not None:
            self._taken += 1
            self._skipped += bool(self._accelerator.optimizer_step_was_skipped)
            state.stateful_callbacks[FP16_STEPS] = {"taken": self._taken, "skipped": self._skipped}

    def on_step_end(self, args, state, control, **kwargs):
        if self._fresh and state.global_step == 1:
            control.should_log = True  # step 1 alone, before the update shows in any metric (as logging_first_step)
        # Every step skipped: the same count on every rank (the scaler's overflow check is reduced over them), so each
        # stops at the same step with no collective
        taken = self._taken
        if taken and self._skipped == taken and (taken >= FP16_ALL_SKIPPED or state.global_step >= state.max_steps):
            message = (
                f"fp16's loss scaler skipped every one of the run's {taken} optimizer steps (its gradients "
                "overflowed each time): the weights are the ones it started from, and nothing was trained. Use bf16 "
                "on a GPU that has it (Ampere or newer), which needs no scaler; else lower --learning_rate and "
                "check the data for rows far longer than the rest"
            )
            self._stop([Alarm("fp16_skipped", state.global_step, message, fatal=True)], 2, args, state, control)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:  # eval records and the end-of-training summary
            return control
        alarms = self.check(state.global_step, logs, args, state.max_steps)
        if self.overflowed is not None and "fp16_overflow" not in self._warned and state.is_world_process_zero:
            print(f"health: {fp16_overflow(self.overflowed, logs['grad_norm'])}", file=sys.stderr, flush=True)
            self._warned.add("fp16_overflow")
        self._count(state.global_step, logs)
        # 0 go on, 1 stop with a checkpoint, 2 stop without one: one rank's verdict stops all, at the same step
        action = 2 if any(a.fatal for a in alarms) else int(bool(alarms) and self.p.health_action == "stop")
        self._stop(alarms, max_over_ranks(action, args.device), args, state, control)
        return control

    def _stop(self, alarms: list[Alarm], action: int, args, state, control) -> None:
        """Say the alarms; `action` (every rank's): 0 go on, 1 stop with a checkpoint, 2 stop without one."""
        for alarm in alarms:
            self.alarms.append(alarm)
            if state.is_world_process_zero and (action or alarm.guard not in self._warned):
                verb = "STOP" if action else "warning"
                print(f"health {verb} [{alarm.guard}] step {alarm.step}: {alarm.message}", file=sys.stderr, flush=True)
            self._warned.add(alarm.guard)
        if action:
            first = next((a for a in alarms if a.fatal), alarms[0] if alarms else None)
            self.stop = first or Alarm("other rank", state.global_step, "another process's guard stopped training")
            self.stop.fatal = action == 2
            control.should_training_stop = True
            control.should_save = action == 1  # a finite state is worth resuming from; a NaN one is not
            # Its rerun must not go on from the values it stopped on (resume.py). Every rank (each has this `action`),
            # the main process writing: its refusal is every rank's line, not the main's alone while the others wait
            # in the stop's checkpoint.
            main_outcome(remember_health_stop, args.output_dir, self.stop)
            _record_in_wandb(self.stop, state)

    def check(self, step: int, logs: dict, args, max_steps: int) -> list[Alarm]:
        p, found = self.p, {}  # guard -> message
        bad = {k: v for k, v in logs.items() if isinstance(v, float) and not math.isfinite(v)}
        # fp16's loss scaler skips the update of a step whose gradients overflowed (their norm inf or NaN) and lowers
        # its scale: the weights stay as they were, and an fp16 run's first steps overflow by design (the scale starts
        # at 2^16). Judged a NaN state, an fp16 run was stopped at the first overflow logged, told to lower the learning
        # rate and start afresh, with nothing wrong.
        if args.fp16 and list(bad) == ["grad_norm"]:
            self.overflowed = step
            bad = {}
        if bad:
            message = (
                f"non-finite values {', '.join(f'{k}={v}' for k, v in bad.items())}: the weights or the loss "
                "went NaN or inf (too high a learning rate, bf16 overflow, a bad row). No checkpoint is written "
                "from this state. Rerun with a lower --learning_rate and --overwrite_output_dir to start afresh"
            )
            # Not "resume an earlier checkpoint with a lower learning rate": a resume refuses another learning rate
            # (resolve.RESUME_FIELDS), and with the same one trains the same steps into the same NaN.
            return [Alarm("nonfinite", step, message, fatal=True)]
        r = self.rewards(logs)
        if step == 1 and self._fresh and p.health_step1_tolerance > 0:
            # NEFTune's noise reaches the policy's embeddings in training, never the reference's (scored in eval
            # mode; a LoRA run's live one too): step 1 is not at log-ratios 0, and a stale reference would hide in
            # the noise
            if args.neftune_noise_alpha is not None or self._dropout:  # dropout: the same, said at the start
                return []
            return self._check_step1(step, logs, r, args)  # the collapse guards judge training, not yet happened
        name, loss = dpo_loss(logs)
        if p.health_loss_floor > 0 and loss_floor_applies(args) and loss < p.health_loss_floor:
            found["loss_floor"] = (
                f"{name} {loss:.4g} < health_loss_floor {p.health_loss_floor}: the policy separates the "
                "pairs far beyond what beta's KL term allows; in a failed run this came right before mode "
                "collapse. Lower --learning_rate (or raise beta), and run scripts/preflight.py on the data"
            )
        if p.health_max_margin > 0 and r and r["margins"] > p.health_max_margin:
            found["margin"] = (
                f"rewards_norm/margins {r['margins']:.3g} > health_max_margin {p.health_max_margin} (chosen "
                f"{r['chosen']:.3g}, rejected {r['rejected']:.3g}): margins exploding (above 5 unstable; a "
                "collapsed run reached 9-18). Lower --learning_rate"
            )
        drop = p.health_logp_drop
        if drop > 0 and r and r["chosen"] / args.beta < -drop and r["rejected"] / args.beta < -drop:
            found["logps_falling"] = (
                f"chosen and rejected log-probs both fell by more than {drop} nats/token against the reference "
                f"({r['chosen'] / args.beta:.3g} and {r['rejected'] / args.beta:.3g}): the policy pushes everything "
                "down instead of preferring the chosen side, the road to degenerate outputs. Lower --learning_rate; if "
                "the chosen style is alien to the model (scripts/preflight.py), SFT on it first"
            )
        pinned = self._pinned_pairs + (step - self._last_step) * self.pairs_per_step  # and the pairs since the last log
        early = step <= p.health_early_fraction * max_steps
        acc = r["accuracies"] if r else logs.get("rewards/accuracies")
        if p.health_pinned_pairs and early and pinned >= p.health_pinned_pairs and acc is not None and acc >= 0.999:
            found["accuracy_pinned"] = (
                f"reward accuracy has been 1.0 on {'the last pair' if pinned == 1 else f'the last {pinned} pairs'}, "
                f"within the first {p.health_early_fraction:.0%} of training (step {step} of {max_steps}): the "
                "pairs are trivially separable or the policy is collapsing onto them. Check the pairs with "
                "scripts/preflight.py; lower --learning_rate"
            )
        return [Alarm(guard, step, message) for guard, message in found.items()]

    def _check_step1(self, step, logs, r, args) -> list[Alarm]:
        tol = self.p.health_step1_tolerance
        problems = []
        expected = step1_loss(args)  # None where the configured loss depends on the model (SFT term, WPO weights)
        name, loss = dpo_loss(logs)
        if expected is not None and abs(loss - expected) > tol:
            value = f"ln 2 = {expected:.6g}" if math.isclose(expected, LN2) else f"{expected:.6g}"
            problems.append(f"{name} {loss:.6g} (expected {value}, {'+'.join(loss_types(args))} at log-ratios 0)")
        if r and (abs(r["chosen"]) > tol or abs(r["rejected"]) > tol):
            problems.append(f"rewards_norm/chosen {r['chosen']:.4g}, rejected {r['rejected']:.4g} (expected 0)")
        if not problems:
            return []
        message = (
            f"{'; '.join(problems)}, tolerance {tol}: before the first update the policy "
            "is the reference, so the reference log-probs disagree with the policy's. A reference cache computed with "
            "another model, max_length, batch or forward, a ref model that is not the base model, or a changed chat "
            "template. Recompute the reference (delete the stale cache) and restart with --overwrite_output_dir"
        )
        return [Alarm("step1", step, message)]

    def rewards(self, logs: dict) -> dict | None:
        """chosen / rejected / margins / accuracies on the loss's scale (beta x log-ratio per completion token)."""
        if "rewards_norm/chosen" not in logs:
            return None
        return {k: logs.get(f"rewards_norm/{k}") for k in REWARD_STATS}


def step1_unjudged(kept: list[str]) -> str:
    """The line that says the step1 guard is not judged, and why."""
    return (
        f"the step1 guard is not judged: dropout stays on in training ({', '.join(kept)}; --disable_dropout "
        "false), so the policy's log-probs at step 1 differ from the reference's (scored without dropout) by its "
        "noise, not by a stale reference. The other guards judge as usual"
    )


def dpo_loss(logs: dict) -> tuple[str, float]:
    """The logged DPO loss and its name: `dpo_loss` (without the MoE router term) where logged, else `loss`."""
    return ("dpo_loss", logs["dpo_loss"]) if "dpo_loss" in logs else ("loss", logs["loss"])


def _record_in_wandb(alarm: Alarm, state) -> None:
    if not state.is_world_process_zero or "wandb" not in sys.modules:
        return
    import wandb

    if wandb.run is not None:
        wandb.run.summary["health/stopped"] = f"[{alarm.guard}] step {alarm.step}: {alarm.message}"


def stop_line(alarm: Alarm, output_dir: str) -> str:
    """The run's last log line after a health stop."""
    go_on = "" if alarm.fatal else ", or with --health_action warn to go on from the checkpoint"
    if alarm.guard == "fp16_skipped":
        where = "no checkpoint written: nothing was trained"
    elif alarm.fatal:
        where = (
            f"no checkpoint written from the non-finite state (an earlier one in {output_dir} would go the same way: "
            "a resume keeps its learning rate)"
        )
    else:
        where = f"checkpoint {output_dir}/checkpoint-{alarm.step} is complete and resumable"
    return (
        f"health: training STOPPED at step {alarm.step} by the {alarm.guard} guard; {where}. The job is not "
        f"requeued (a retry would fail the same way), and the same command is refused: fix the cause above, then "
        f"rerun with --overwrite_output_dir to start afresh{go_on}"
    )
