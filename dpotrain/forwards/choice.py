"""Which forward a run takes (docs/attention.md): decided once, from the pairs' lengths, between the forwards this
machine can run, before the memory check and the model load (the attention is a `from_pretrained` argument).

`candidates` lists them in the documented order with the recipe's options applied: an option given is honoured or
refused with one line, never replaced. `choose` takes the first without lengths, else `cost.decide` ranks them; the
`Forward:` line and `derived.forward` say which rule took the winner, against what. Every rank decides alone, from
its own node, inside one gather (`stages.decide_forward`: a refusal one node meets ends every rank), and the forwards
are compared by node as they are chosen (`agreement.check_nodes`), then in full by the first half's agreement.
"""

import copy
import importlib
import math
from dataclasses import asdict, dataclass

from torch.nn.parallel import DistributedDataParallel

from dpotrain.forwards import flops, masks, packing, padded, sequence_parallel, shared_prompt
from dpotrain.recipe import init_kwargs, launcher, upstream
from dpotrain.recipe.config import uses_live_reference
from dpotrain.recipe.errors import ConfigError, cause
from dpotrain.recipe.refused import said

VARLEN_PACKAGES = {  # transformers' name: (its availability check in transformers.utils, what to install)
    "flash_attention_4": ("is_flash_attn_4_available", "pip install -r requirements-gpu.txt (flash-attn-4)"),
    "flash_attention_3": ("is_flash_attn_3_available", "FlashAttention 3 built from its hopper/ folder"),
    "flash_attention_2": ("is_flash_attn_2_available", "pip install flash-attn --no-build-isolation"),
}
# transformers' check for FA4 finds the package, not its kernels: `flash_attn.cute` fails to import when a CUTLASS DSL
# package is missing, and the run would crash at its first forward. Imported for real before FA4 counts as installed.
KERNEL_MODULES = {"flash_attention_4": "flash_attn.cute"}


@dataclass(frozen=True)
class ForwardChoice:
    packed: bool  # packed rows (packing.py), or TRL's padded batches in row groups (padded.py)
    share_prompt: bool  # each pair's prompt once in its row (shared_prompt.py)
    hidden_size: int  # the model's: packed rows weigh attention against the linear layers with it
    attention: str = "sdpa"  # the attention implementation the model runs
    reason: str = ""  # why this forward: the rule that took it, the estimates against the runner-up
    decision: dict | None = None  # `cost.Decision.record()`: every candidate's estimate, and the lengths weighed
    sequence_parallel: int = 1  # processes that split each packed row along its positions (cluster/sequence_parallel)

    @property
    def pad_multiple(self) -> int | None:
        """What a packed row's width is padded to a multiple of (FlexAttention's tile, the sequence-parallel group)."""
        multiple = math.lcm(masks.BLOCK if self.attention == "flex_attention" else 1, self.sequence_parallel)
        return multiple if multiple > 1 else None

    @property
    def one_row(self) -> bool:
        """A whole micro-batch in one row: kernels that skip the attention between sequences (varlen, FlexAttention)."""
        return packing.one_row(self.attention) or self.attention == "flex_attention"

    @property
    def layout(self) -> str:
        if not self.packed:
            return "padded micro-batches (TRL's collator)"
        rows = "one row per micro-batch" if self.one_row else "balanced rows"
        return f"{'shared prompts' if self.share_prompt else 'unshared'} packing, {rows}"

    def line(self) -> str:
        return f"Forward: {self.layout} on {self.attention}: {self.reason}."

    def record(self) -> dict:
        """The `forward` entry of resolved_config.json: the forward, and the winner, runner-up and their estimates."""
        winner, runner_up, *_ = [*(self.decision or {}).get("estimates", []), None, None]
        out = {**asdict(self), "one_row": self.one_row, "layout": self.layout}
        return out | {"winner": winner, "runner_up": runner_up}


def kernel_problem(attn: str, cuda: bool) -> str | None:
    """Why an attention implementation cannot run on this machine, or None."""
    name = packing.attention_name(attn)
    if name == "flex_attention" and not cuda:
        return "FlexAttention has no backward pass on CPU in PyTorch; use --attn_implementation sdpa on CPU"
    if (name in VARLEN_PACKAGES or name.startswith("kernels-community/")) and not cuda:
        return f"{name} needs a CUDA GPU; use --attn_implementation sdpa on CPU"
    if name in VARLEN_PACKAGES:
        import transformers.utils

        check, install = VARLEN_PACKAGES[name]
        if not getattr(transformers.utils, check)():
            return f"{name}'s kernel is not installed ({install}), or pick another --attn_implementation"
        try:
            if name in KERNEL_MODULES:
                importlib.import_module(KERNEL_MODULES[name])
        except Exception as e:  # noqa: BLE001 - a kernel package fails in many ways (missing libraries, CUDA versions)
            broken = f"import {KERNEL_MODULES[name]}: {cause(e, 160)}"
            return f"{name}'s kernel does not import ({broken}): reinstall it ({install}), or pick another attention"
    return None


def check_attention_name(attn: str) -> None:
    """An attention transformers knows: its own (ALL_ATTENTION_FUNCTIONS, and eager), or a Hub kernel (`org/repo`);
    refused here, not as transformers' traceback when the model is built."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # transformers 5 still takes a `paged|` prefix before any name (`paged|sdpa`), dropped with a FutureWarning
    name = packing.attention_name(attn).removeprefix("paged|")
    if name == "eager" or name in ALL_ATTENTION_FUNCTIONS or "/" in name:
        return
    known = ", ".join(["eager", *(n for n in ALL_ATTENTION_FUNCTIONS if "|" not in n)])
    raise ConfigError(
        f"attn_implementation {attn!r} is not one transformers knows: choose one of {known}, or a Hub kernel "
        "(kernels-community/...), or leave it out for the run's choice"
    )


def installed_varlen(cuda: bool) -> str | None:
    """The fastest varlen FlashAttention this machine has: FA4 (Hopper, Blackwell), FA3 (Hopper), FA2; None."""
    import torch

    if not (cuda and torch.cuda.is_available()):
        return None
    major = torch.cuda.get_device_capability()[0]
    order = ["flash_attention_4"] * (major >= 9) + ["flash_attention_3"] * (major == 9) + ["flash_attention_2"]
    return next((name for name in order if kernel_problem(name, cuda) is None), None)


# FlashAttention's kernels (2, 3, 4 and the kernels-community builds) take heads up to 256 wide ("FlashAttention only
# supports head dimensions up to 256": Gemma 4's 512-wide full-attention layers, Dao-AILab/flash-attention#2427).
# FlexAttention's training kernels at such widths were never run on a GPU here, so neither is chosen for them: sdpa
# runs their packed rows, as it ran their padded ones.
WIDEST_KERNEL_HEAD = 256

# Learnable attention sinks (gpt-oss, Granite SWA: `upstream.has_attention_sinks`): transformers hands them to
# FlashAttention 4 (`learnable_sink`) and vLLM's FlashAttention 3 build (`s_aux`) and silently drops them for the others
# (FA2, Dao's FA3), which would then train another model's attention, padded or packed. Flex and eager take them.
SINK_KERNELS = {"flash_attention_4", "kernels-community/flash-attn4", "kernels-community/vllm-flash-attn3"}


def drops_sinks(config, attention: str | None) -> bool:
    """Whether `attention` is a varlen FlashAttention that would drop this model's attention sinks."""
    name = packing.attention_name(attention)
    return name in packing.VARLEN_ATTENTION and name not in SINK_KERNELS and upstream.has_attention_sinks(config)


# The config fields transformers' attention layers hand the attention kernel as its dropout in training (`dropout=` of
# the attention interface: `attention_dropout`, GPT-2's `nn.Dropout(attn_pdrop)`'s p), kept on with `--disable_dropout
# false` (TRL's default zeroes them). The kernels that take none: FlexAttention raises on it (`flex.attention`: a GPU
# run on flex scored the reference stage in eval mode, then stopped at its first training forward in that ValueError's
# traceback); FlashAttention 3 and 4 have no dropout argument, and transformers passes a kernel only the arguments its
# signature names (`_process_flash_attention_kwargs`), so they trained without it while the record kept it on.
ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop")
NO_DROPOUT_KERNELS = {"flex_attention", "flash_attention_3", "flash_attention_4"} | {
    f"kernels-community/{name}" for name in ("flash-attn3", "vllm-flash-attn3", "flash-attn4")
}


def trained_attention_dropout(config, recipe) -> tuple[str, float] | None:
    """(the field, its rate) of the attention dropout the model trains with, a `model_init_kwargs` override's first;
    None with `disable_dropout` (TRL's default) or a rate of 0."""
    if recipe.training.disable_dropout:
        return None
    overrides = init_kwargs.config_overrides(recipe.training.model_init_kwargs)
    text = config.get_text_config()
    for name in ATTENTION_DROPOUT:
        rate = overrides.get(name, getattr(text, name, None))
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            return name, float(rate)
    return None


def _dropout_note(config, attn: str, dropout: tuple[str, float]) -> str:
    return (
        f"Note: {attn} takes no attention dropout, which {config.model_type} trains with here "
        f"({dropout[0]} {dropout[1]:g}, disable_dropout false): it is not weighed."
    )


def widest_head(config) -> int:
    """The widest query/key head of any layer (Gemma 4's full-attention layers; MLA's qk_head_dim, not its head_dim)."""
    return flops.query_width(config.get_text_config())


def dense_attention(config) -> str:
    """sdpa, or eager for a model class that does not take sdpa (Gemma 2 in transformers 5.23), as transformers itself
    falls back when no attention is named."""
    model_class = upstream.causal_lm_class(config)
    return "sdpa" if model_class is None or upstream.supports_sdpa(model_class) else "eager"


def asked_to_pack(recipe) -> bool:
    """`padding_free: true` given in the recipe or on the command line (not this project's default)."""
    return "padding_free" in recipe.given and recipe.training.padding_free


def hybrid_problem(config, recipe) -> str | None:
    """Why a boundary hybrid (`packing.BOUNDARY_HYBRIDS`) stays padded for this recipe, or None: it packs only when
    asked (`padding_free: true` given), since only `packing.parity` on the loaded model can confirm it keeps sequences
    apart."""
    if config.model_type not in packing.BOUNDARY_HYBRIDS or asked_to_pack(recipe):
        return None
    return (
        f"{config.model_type}'s recurrent layers pack only when asked for (--padding_free true, on a varlen "
        "FlashAttention kernel, checked at start)"
    )


def _check_packed_options(t) -> None:
    """Options that only TRL's padded batches honour, refused where the run packs."""
    if t.pad_to_multiple_of is not None:
        raise ConfigError(f"pad_to_multiple_of {t.pad_to_multiple_of} {said('pad_to_multiple_of')}")
    if t.neftune_noise_alpha is not None:
        # transformers' hook scales the noise by alpha / sqrt(width x hidden size): padded, the width is the longest
        # sequence (TRL's, the paper's); a packed row's is the whole micro-batch
        raise ConfigError(f"neftune_noise_alpha {t.neftune_noise_alpha:g} {said('neftune_noise_alpha')}")


def check_asked(config, asked: str, cuda: bool, check_kernels: bool, dropout: tuple[str, float] | None = None) -> None:
    """The recipe's attn_implementation refused where it cannot run this model (here, with `check_kernels`). `dropout`:
    the attention dropout it trains with (`trained_attention_dropout`)."""
    name = packing.attention_name(asked)
    if name in NO_DROPOUT_KERNELS and dropout is not None:
        raise ConfigError(
            f"attn_implementation {asked} cannot run {config.model_type} here: its kernel takes no attention dropout, "
            f"and {config.model_type} trains with {dropout[0]} {dropout[1]:g} (disable_dropout false): pass "
            "--disable_dropout true, or leave --attn_implementation out"
        )
    if name in packing.VARLEN_ATTENTION and (width := widest_head(config)) > WIDEST_KERNEL_HEAD:
        raise ConfigError(
            f"attn_implementation {asked} cannot run {config.model_type}: its widest attention heads are "
            f"{width} wide, and FlashAttention's kernels take up to {WIDEST_KERNEL_HEAD}; leave "
            "--attn_implementation out (sdpa is then chosen)"
        )
    if drops_sinks(config, asked):
        raise ConfigError(
            f"attn_implementation {asked} cannot run {config.model_type}: its kernel takes no attention sinks, which "
            "transformers then drops without a word; use flash_attention_4 or flex_attention, or leave "
            "--attn_implementation out"
        )
    # FlexAttention on a CPU is refused even unchecked (a dry run): it has no backward pass there
    kernel = kernel_problem(asked, cuda) if check_kernels or name == "flex_attention" else None
    if kernel is not None:
        raise ConfigError(f"attn_implementation {asked} cannot run here: {kernel}")
    if name == "sdpa" and dense_attention(config) == "eager":
        # else transformers' ValueError traceback as the model loads, after the data was read and measured
        raise ConfigError(
            f"attn_implementation sdpa cannot run here: {config.model_type}'s model in transformers does not "
            "take sdpa; use --attn_implementation eager, or leave it out (eager is then chosen)"
        )


def candidates(config, recipe, cuda: bool, varlen: str | None, check_kernels: bool = True):
    """The forwards this machine can run for this model and recipe, in the order that decides without lengths, and the
    notes to print; a ConfigError when an option the recipe gives cannot be honoured. `check_kernels`: refuse an asked
    attention whose kernel this machine lacks (a dry run plans for other machines)."""
    from dpotrain.forwards.cost import Candidate

    t, want_share = recipe.training, recipe.project.share_prompt
    asked, dropout = recipe.model.attn_implementation, trained_attention_dropout(config, recipe)
    notes = []
    if asked is not None:
        check_asked(config, asked, cuda, check_kernels, dropout)
        attentions = [asked]
    elif cuda and (width := widest_head(config)) > WIDEST_KERNEL_HEAD:
        attentions = [dense_attention(config)]
        notes.append(
            f"Note: {config.model_type}'s widest attention heads are {width} wide: FlashAttention's kernels take up "
            f"to {WIDEST_KERNEL_HEAD} and FlexAttention's were never run that wide here, so it runs on {attentions[0]}."
        )
    elif cuda:
        if drops_sinks(config, varlen):
            notes.append(
                f"Note: {varlen} takes no attention sinks, which {config.model_type} has: it is not weighed (flash_"
                "attention_4 takes them)."
            )
            varlen = None
        attentions = [*([varlen] if varlen else []), "flex_attention", dense_attention(config)]
    else:
        attentions = [dense_attention(config)]
    # Only `padding_free: false` keeps the recipe padded: a live reference model (`precompute_ref_log_probs: false`,
    # TR-DPO's `sync_ref_model`) packs like the policy (`RecipeDPOTrainer._compute_loss`: same stand-in, same split).
    recipe_problem = None if t.padding_free else "padding_free is false"
    shared, unshared, problems, share_problems = [], [], [], []
    for attn in attentions:
        if cuda and attn == dense_attention(config) and asked is None and (shared or unshared):
            continue  # sdpa's dense rows cost flex's positions and more attention: weighed only where flex cannot pack
        if recipe_problem is None:
            upstream.set_attn_implementation(config, attn)
        problem = recipe_problem or packing.packing_problem(config) or hybrid_problem(config, recipe)
        if problem is not None:
            problems.append(problem)
            continue
        if packing.attention_name(attn) in NO_DROPOUT_KERNELS and dropout is not None:  # asked: refused (check_asked)
            notes.append(_dropout_note(config, attn, dropout))
            continue
        share = None if want_share is not False else "share_prompt is false"
        share = share or shared_prompt.share_problem(config, attn, t.router_aux_loss_coef)
        if share is None:
            shared.append(Candidate(attn, True, True))
        else:
            share_problems.append(share)
        if want_share is not True:
            unshared.append(Candidate(attn, True, False))
    packed = shared + unshared  # on a CPU, of one attention
    if cuda:
        packed.sort(key=lambda c: documented_order(c, config))
    if want_share and not shared:
        if not packed and problems and not asked_to_pack(recipe):
            raise ConfigError(
                f"share_prompt needs packed sequences, which cannot be used here: {problems[0]}; remove --share_prompt"
            )
        if packed or share_problems:
            raise ConfigError(f"share_prompt cannot be used here: {share_problems[0]}; remove --share_prompt")
    packed = sequence_parallel_forwards(recipe, config, packed, problems)
    if packed:
        _check_packed_options(t)
        if want_share is None and not shared and share_problems:
            notes.append(f"Note: each pair's prompt is computed twice (unshared packing): {share_problems[0]}.")
        return packed, notes
    if asked_to_pack(recipe):
        raise ConfigError(
            f"padding_free (packed sequences) cannot be used here: {problems[0]}; set --padding_free false"
        )
    if t.padding_free:
        notes.append(
            f"Note: padded micro-batches (TRL's collator) on the same step plan, not packed sequences: {problems[0]}."
        )
    # TRL's padded rows on transformers' default attention (padded rows on a varlen kernel are not measured here), or
    # on the attention the recipe names.
    return [Candidate(asked or dense_attention(config), False, False)], notes


def documented_order(candidate, config) -> tuple:
    """Where a candidate stands in the order that decides on a GPU without lengths (docs/attention.md): shared prompts
    on flex_attention; unshared on a measured kernel; on an unmeasured varlen kernel; dense rows, shared first."""
    from dpotrain.forwards import cost

    attn = candidate.attention
    kernel = 0 if cost.measured(attn, cuda=True) else 2 if attn == dense_attention(config) else 1
    return not (candidate.share_prompt and attn == "flex_attention"), kernel, not candidate.share_prompt


def sequence_parallel_forwards(recipe, config, packed: list, problems: list[str]) -> list:
    """With `sequence_parallel_size` N > 1, the packed forwards that can split their rows (not eager: Ulysses needs a
    boolean mask); a run that cannot split is refused, never given a padded forward instead."""
    n = recipe.project.sequence_parallel_size
    if n == 1:
        return packed
    t = recipe.training
    if problem := sequence_parallel.model_problem(config, t.router_aux_loss_coef, t.activation_checkpointing):
        raise ConfigError(f"sequence_parallel_size {n}: {problem}")
    splittable = [c for c in packed if packing.attention_name(c.attention) in sequence_parallel.ATTENTION]
    if splittable:
        return splittable
    if packed:
        why = (
            f"{packing.attention_name(packed[0].attention)} has no split here (sequence parallelism runs "
            "flex_attention, sdpa or a varlen FlashAttention kernel)"
        )
    else:
        why = problems[0] if problems else "no packed forward runs here"
    raise ConfigError(
        f"sequence_parallel_size {n} splits packed sequences, which cannot be used here: {why}; use "
        "--sequence_parallel_size 1 (or another --attn_implementation)"
    )


def lightest_attention(config, recipe) -> str:
    """The attention of the candidate forward whose masks take the least memory on a GPU without FlashAttention 4: what
    a run's memory is first checked for, before anything loads (a dry run weighs the real choice)."""
    options, _ = candidates(copy.deepcopy(config), recipe, cuda=True, varlen=None)
    return min((c.attention for c in options), key=mask_weight)


def mask_weight(attn: str) -> int:
    """0 for an attention that takes no mask (varlen), 1 for a block mask (flex), 2 for dense masks (sdpa, eager)."""
    return 0 if packing.one_row(attn) else 1 if packing.attention_name(attn) == "flex_attention" else 2


def choose(config, recipe, cuda: bool, varlen: str | None, lengths=None, check_kernels: bool = True, max_length=None):
    """(the forward, the notes to print) for this model, recipe and machine; from `lengths` when given, else by the
    candidates' order. `max_length`: the run's, else the recipe's. Prints nothing."""
    from dpotrain.forwards import cost

    hidden_size = getattr(config.get_text_config(), "hidden_size", 4096)
    options, notes = candidates(config, recipe, cuda, varlen, check_kernels)
    t, n = recipe.training, recipe.project.sequence_parallel_size
    if lengths is None:
        best, record = options[0], None
        listed = ", ".join(c.describe() for c in options)
        why = f"by the documented order (no lengths to weigh), the first of {listed}"
        why = "the only forward here" if len(options) == 1 else why
    else:
        budget, live = recipe.project.max_tokens_per_microbatch, uses_live_reference(recipe)
        pairs, cap = t.per_device_train_batch_size, packing.positions_cap(budget, t.bf16 or t.fp16)
        max_length = t.max_length if max_length is None else max_length
        decision = cost.decide(options, lengths, config, cuda, max_length, t.truncation_mode, budget, pairs, live, cap)
        best = decision.winner.candidate
        rule = decision_rule(decision, asked=recipe.model.attn_implementation is not None)
        why, record = f"{rule}: {decision.summary()}, from {decision.lengths_from}", {**decision.record(), "by": rule}
        if decision.not_weighed:
            why += f"; not weighed (speed not measured): {', '.join(decision.not_weighed)}"
    return ForwardChoice(best.packed, best.share_prompt, hidden_size, best.attention, why, record, n), notes


def decision_rule(decision, asked: bool) -> str:
    """Which rule took the winner: 'cheapest measured', 'by the documented order' or 'as the recipe names it' (then the
    least work, between layouts of one kernel), or 'the only candidate'."""
    if decision.runner_up is None and not decision.not_weighed:
        return "the only candidate"
    if decision.measured:
        return "cheapest measured"
    by = "as the recipe names it" if asked else "by the documented order"
    return f"{by}{', then the least work' if decision.runner_up else ''}"


def decide(recipe, config, cuda: bool, varlen: str | None, lengths=None, max_length=None) -> ForwardChoice:
    """The run's forward stage (`stages.decide_forward`): `choose` (`varlen`: the varlen FlashAttention to weigh),
    its notes and the `Forward:` line printed by the main process (a 4-GPU x 8-node job printed each note 32 times)."""
    chosen, notes = choose(config, recipe, cuda, varlen, lengths, max_length=max_length)
    # The same choice on every rank (compared by node right after, `agreement.check_nodes`): its lines said once
    if launcher.launched_main():
        for note in notes:
            print(note, flush=True)
        print(chosen.line(), flush=True)
    return chosen


def collator(choice: ForwardChoice, args, max_tokens_per_microbatch: int | None = None):
    """The packed collator of a packed forward (None: TRL's own, for the padded one)."""
    if not choice.packed:
        return None
    kind = shared_prompt.SharedPromptCollator if choice.share_prompt else packing.PackedPreferenceCollator
    return kind(
        args.max_length,
        args.truncation_mode,
        one_row=choice.one_row,
        hidden_size=choice.hidden_size,
        pad_to_multiple_of=choice.pad_multiple,
        max_positions=packing.positions_cap(max_tokens_per_microbatch, args.bf16 or args.fp16),
    )


def stand_in(model, batch: dict, every_rank: bool = False):
    """What answers TRL's model call for this micro-batch (the packed or the grouped padded forward), and the padded
    `[2B, L]` inputs TRL reads. `every_rank`: each forward holds a collective (`needs_every_rank`), so the ranks agree
    on the group count."""
    if packing.is_packed(batch):
        split = sequence_parallel.forward if sequence_parallel.size() > 1 else None
        return packing.PackedModel(model, batch, split), packing.padded_view(batch)
    batch = dict(batch)
    return padded.GroupedModel(model, batch.pop("row_groups", None), every_rank), batch


def needs_every_rank(run_engine, forward: ForwardChoice, model=None) -> bool:
    """Whether a forward holds collectives (sharded weights, a split sequence, or `model` wrapped in DDP, whose every
    forward broadcasts the main process's buffers), so every rank must run one together. Under DDP a rank whose padded
    micro-batch ran one row group more joined a broadcast the others never did, and the launch hung at step 1."""
    return run_engine.shards_weights or forward.sequence_parallel > 1 or isinstance(model, DistributedDataParallel)
