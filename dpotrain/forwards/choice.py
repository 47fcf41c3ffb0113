"""Which forward a run takes, chosen once at start from the model's config, the recipe and the device.

On CUDA the fastest exact path the machine has, in this order (the GPU benchmark, benchmarks/attention.py, is what
confirms it; docs/attention.md):
1. prompts shared, on FlexAttention: one row per micro-batch, a block mask per layer kind;
2. unshared packing on a varlen FlashAttention kernel (FA4 on Hopper/Blackwell, FA3 on Hopper, FA2), when installed;
3. unshared packing on FlexAttention (a document mask: the blocks between sequences skipped);
4. sdpa: packed rows, or TRL's padded batches for models that cannot pack.
On CPU, sdpa (FlexAttention has no backward on CPU; FlashAttention needs CUDA). An attention implementation given in
the recipe is used as given, or refused with one line when its kernel cannot run here; never replaced. Models whose
layers carry state keep `packing.packing_problem`'s rules and, for the boundary hybrids, the start-up parity check.
"""

import os
from dataclasses import asdict, dataclass

from .. import packing, padded, resolve, shared_prompt
from ..errors import ConfigError
from . import masks

VARLEN_PACKAGES = {  # transformers' name: (its availability check in transformers.utils, what to install)
    "flash_attention_4": ("is_flash_attn_4_available", "pip install -r requirements-gpu.txt (flash-attn-4)"),
    "flash_attention_3": ("is_flash_attn_3_available", "FlashAttention 3 built from its hopper/ folder"),
    "flash_attention_2": ("is_flash_attn_2_available", "pip install flash-attn --no-build-isolation"),
}


@dataclass(frozen=True)
class ForwardChoice:
    packed: bool  # packed rows (packing.py), or TRL's padded batches in row groups (padded.py)
    share_prompt: bool  # each pair's prompt once in its row (shared_prompt.py)
    hidden_size: int  # the model's: packed rows weigh attention against the linear layers with it
    attention: str = "sdpa"  # the attention implementation the model runs
    reason: str = ""  # why this forward, in a few words

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
        """The `forward` entry of resolved_config.json."""
        return {**asdict(self), "one_row": self.one_row, "layout": self.layout}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def kernel_problem(attn: str, cuda: bool) -> str | None:
    """Why an attention implementation cannot run on this machine, or None."""
    name = packing.attention_name(attn)
    if name == "flex_attention" and not cuda:
        return "FlexAttention has no backward pass on CPU in PyTorch; use --attn_implementation sdpa on CPU"
    if name in VARLEN_PACKAGES:
        check, install = VARLEN_PACKAGES[name]
        import transformers.utils

        if not cuda:
            return f"{name} needs a CUDA GPU; use --attn_implementation sdpa on CPU"
        if not getattr(transformers.utils, check)():
            return f"{name}'s kernel is not installed ({install}), or pick another --attn_implementation"
    elif name.startswith("kernels-community/") and not cuda:
        return f"{name} needs a CUDA GPU; use --attn_implementation sdpa on CPU"
    return None


def installed_varlen(cuda: bool) -> str | None:
    """The fastest varlen FlashAttention this machine has: FA4 (Hopper, Blackwell), FA3 (Hopper), FA2; None."""
    import torch

    if not (cuda and torch.cuda.is_available()):
        return None
    major = torch.cuda.get_device_capability()[0]
    order = ["flash_attention_4"] if major >= 9 else []
    order += ["flash_attention_3"] if major == 9 else []
    order += ["flash_attention_2"]
    return next((name for name in order if kernel_problem(name, cuda) is None), None)


def _packs(config, attn: str) -> bool:
    config._attn_implementation = attn
    return packing.packing_problem(config) is None


def dense_attention(config) -> str:
    """sdpa, or eager for a model class that does not take sdpa (Gemma 2 in transformers 5.23: loading it with sdpa
    raises), as transformers itself falls back when no attention is named."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # a config the causal-LM auto class does not map: leave it to transformers' own check
        return "sdpa"
    return "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"


def pick_attention(config, want_share: bool | None, packs: bool, cuda: bool) -> tuple[str, str]:
    """The attention for a recipe that names none, and why."""
    dense = dense_attention(config)
    if not cuda:
        return dense, "CPU (FlexAttention has no backward there, FlashAttention needs CUDA)"
    if packs and want_share is not False and _packs(config, "flex_attention") and shared_prompt.share_problem(
            config, "flex_attention") is None:  # fmt: skip
        return "flex_attention", "CUDA, and this model shares prompts: a block mask skips what no token sees"
    varlen = installed_varlen(cuda)
    if packs and varlen and _packs(config, varlen):
        return varlen, "CUDA with a varlen FlashAttention kernel installed, prompts unshared"
    if packs and _packs(config, "flex_attention"):
        return "flex_attention", "CUDA without a varlen FlashAttention kernel: a block mask skips other sequences"
    return dense, "CUDA, a model this project does not pack"


def decide_forward(recipe, model_path: str, cuda: bool | None = None) -> ForwardChoice:
    """Packed or padded forward, prompts shared or not, and the attention, for this model, recipe and device: a
    one-line note when an option is off by necessity, an error when it was asked for explicitly and cannot be
    honoured. Either way the reference is scored once before training (only the policy stays in memory), unless the
    recipe asks for a live reference model. Reads the model's config only (no weights). Sets the recipe's
    `attn_implementation` to the attention chosen."""
    from transformers import AutoConfig

    cuda = cuda_available() if cuda is None else cuda
    t, want_share = recipe.training, recipe.project.share_prompt
    config = AutoConfig.from_pretrained(model_path, revision=recipe.model.model_revision)
    hidden_size = getattr(config.get_text_config(), "hidden_size", 4096)
    live_reference = resolve.uses_live_reference(recipe)
    if not live_reference:
        t.precompute_ref_log_probs = True  # the reference stage (reference.py): only the policy stays in memory
    problem = None if t.padding_free else "padding_free is false"
    if problem is None and t.sync_ref_model:
        problem = "sync_ref_model updates the reference during training, so it cannot be scored once and cached"
    if problem is None and live_reference:
        problem = "the packed path scores the reference once before training (precompute_ref_log_probs: true)"
    asked = recipe.model.attn_implementation
    if asked is not None:
        kernel = kernel_problem(asked, cuda)
        if kernel is not None:
            raise ConfigError(f"attn_implementation {asked} cannot run here: {kernel}")
        attn, reason = asked, "the recipe's attn_implementation"
    else:
        attn, reason = pick_attention(config, want_share, problem is None, cuda)
    recipe.model.attn_implementation = attn
    config._attn_implementation = attn
    problem = problem or packing.packing_problem(config)
    if problem is not None:
        explicit = "padding_free" in recipe.given and t.padding_free
        if want_share and not explicit:
            raise ConfigError(f"share_prompt needs packed sequences, which cannot be used here: {problem}; remove "
                              "--share_prompt")  # fmt: skip
        if t.padding_free:
            padded_instead(problem, explicit)
        t.padding_free = False
        return announce(ForwardChoice(False, False, hidden_size, attn, reason))
    share_problem = None if want_share is not False else "share_prompt is false"
    share_problem = share_problem or shared_prompt.share_problem(config, attn, t.router_aux_loss_coef)
    if share_problem is not None and want_share:
        raise ConfigError(f"share_prompt cannot be used here: {share_problem}; remove --share_prompt")
    if share_problem is not None and want_share is None:
        print(f"Note: each pair's prompt is computed twice (unshared packing): {share_problem}.", flush=True)
    return announce(ForwardChoice(True, share_problem is None, hidden_size, attn, reason))


def announce(choice: ForwardChoice) -> ForwardChoice:
    if int(os.environ.get("RANK", "0")) == 0:  # the same choice on every rank: one line, not one per process
        print(choice.line(), flush=True)
    return choice


def padded_instead(problem: str, explicit: bool) -> None:
    """Packing cannot be used: an error when `padding_free: true` was given, else a one-line note."""
    if explicit:
        raise ConfigError(f"padding_free (packed sequences) cannot be used here: {problem}; set --padding_free false")
    print(f"Note: padded micro-batches (TRL's collator) on the same step plan, not packed sequences: {problem}.",
          flush=True)  # fmt: skip


def collator(choice: ForwardChoice, args):
    """The packed collator of a packed forward (None: TRL's own, for the padded one)."""
    if not choice.packed:
        return None
    multiple = masks.BLOCK if choice.attention == "flex_attention" else None
    kind = shared_prompt.SharedPromptCollator if choice.share_prompt else packing.PackedPreferenceCollator
    return kind(args.max_length, args.truncation_mode, one_row=choice.one_row, hidden_size=choice.hidden_size,
                pad_to_multiple_of=multiple)  # fmt: skip


def stand_in(model, batch: dict, every_rank: bool = False):
    """What answers TRL's model call for this micro-batch, and the padded `[2B, L]` inputs TRL reads: the packed
    forward (packing.py) or the grouped padded one (padded.py), its group count agreed over the ranks when every rank
    must run each forward (`every_rank`: the weights are sharded)."""
    if packing.is_packed(batch):
        return packing.PackedModel(model, batch), packing.padded_view(batch)
    batch = dict(batch)
    return padded.GroupedModel(model, batch.pop("row_groups", None), every_rank), batch
