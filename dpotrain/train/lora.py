"""LoRA DPO (`--use_peft true`): what TRL's `DPOTrainer` does with a `peft_config`, checked before anything loads.

TRL wraps the model in a PEFT adapter and scores the reference with the adapter disabled, so no second model is
held in memory. The run folder then holds the adapter (`adapter_model.safetensors`, `adapter_config.json`), not
full weights; `merge_lora: true` also writes the base with the adapter merged in to `<output_dir>/merged/`.
"""

import contextlib
import copy
import re
import shutil
import warnings
from pathlib import Path

import torch

from dpotrain.cluster.offline import is_hub_model
from dpotrain.data import builtin
from dpotrain.recipe import upstream
from dpotrain.recipe.config import settings_given
from dpotrain.recipe.errors import ConfigError
from dpotrain.recipe.refused import LORA_FIELDS, QUANTIZATION_FIELDS, said
from dpotrain.recipe.writes import quiet_progress_bars, readable_weights

MERGED_DIR = "merged"
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")  # what transformers' Trainer aligns with the tokenizer


def check_lora(recipe) -> None:
    """Refuse LoRA and quantization settings that TRL would ignore or reject only after loading the model."""
    m, p = recipe.model, recipe.project
    if not m.use_peft:
        # Not a recipe file's where the command line turns LoRA off for one run (`--use_peft false` on a LoRA recipe:
        # its lora_r was refused, which no flag unsets): unused then, as options.check_switched_off's settings
        named = settings_given(recipe, "use_peft")
        stray = [f for f in LORA_FIELDS if f in named] + ["merge_lora"] * (p.merge_lora and "merge_lora" in named)
        if stray:
            raise ConfigError(f"{stray[0]} {said(f'{stray[0]}_no_peft', name=stray[0])}")
    else:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise ConfigError("use_peft needs the peft package: `pip install -r requirements.txt`") from None
        if not m.lora_target_modules and not m.lora_target_parameters:
            raise ConfigError(
                "use_peft needs the layers to adapt: pass --lora_target_modules all-linear (every linear layer but "
                "the output head), or names of the model's layers (q_proj v_proj on Llama-style models; a name the "
                "model lacks is refused naming its layers)"
            )
        if m.lora_task_type != "CAUSAL_LM":  # PEFT would wrap the model for another task's head (or refuse the name)
            raise ConfigError(f"lora_task_type {said('lora_task_type', task=m.lora_task_type)}")
        if m.lora_r < 1:
            raise ConfigError(f"lora_r must be >= 1 (got {m.lora_r}); 8-64 is usual")
        if m.lora_alpha <= 0:  # PEFT scales the adapter's output by alpha / r: at 0 the adapter trains nothing
            raise ConfigError(
                f"lora_alpha must be > 0 (got {m.lora_alpha}): the adapter's update is scaled by lora_alpha / lora_r, "
                "so 0 trains nothing; 2 x lora_r is usual"
            )
        if not 0 <= m.lora_dropout <= 1:
            raise ConfigError(f"lora_dropout must be between 0 and 1 (got {m.lora_dropout:g}); 0.05-0.1 is usual")
        if m.lora_dropout > 0 and recipe.training.disable_dropout:  # given: its default is 0 then (config.parse_args)
            raise ConfigError(f"lora_dropout {m.lora_dropout:g} {said('lora_dropout_disabled')}")
    quantized = "load_in_4bit" if m.load_in_4bit else "load_in_8bit" if m.load_in_8bit else None
    if quantized is None:
        # Not a recipe file's where the command line turns quantization off for one run (`--load_in_4bit false` on a
        # QLoRA recipe, on a GPU with room for the weights: its bnb_4bit_quant_type was refused, which no flag unsets)
        named = settings_given(recipe, "load_in_4bit", "load_in_8bit")
        if stray := [f for f in QUANTIZATION_FIELDS if f in named]:
            raise ConfigError(f"{stray[0]} {said(f'{stray[0]}_unquantized', name=stray[0])}")
        return
    # Not a dry run's (but --use_cpu's): it plans the GPU job from a login node, as options.check_cuda_settings
    if not torch.cuda.is_available() and (recipe.training.use_cpu or not p.dry_run):
        raise ConfigError(f"{quantized} needs a CUDA GPU (bitsandbytes); on this machine remove --{quantized}")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{quantized} needs the bitsandbytes package: `pip install bitsandbytes`, or remove --{quantized}"
        ) from None
    if not m.use_peft:
        raise ConfigError(f"{quantized} {said(f'{quantized}_no_peft')}")
    from trl import get_quantization_config

    try:  # transformers' BitsAndBytesConfig checks its values as the run builds it, once the data set is tokenized
        get_quantization_config(m)
    except ValueError as e:
        raise ConfigError(
            f"{quantized}: {str(e).rstrip('. ')}: pass one of those, or remove the setting it names"
        ) from None


def check_targets(recipe, config, model: str) -> None:
    """Refuse LoRA names that match nothing in the model, and settings PEFT refuses for it, on the meta-device model
    before it loads: PEFT silently drops unmatched names (`q_proj v_prj` trains q_proj alone), and fails only after the
    load where nothing matches or a value is out of its range."""
    m = recipe.model
    if not m.use_peft:
        return
    from dpotrain.plan import memory

    try:  # the model's modules on the meta device, as the memory plan builds them: no weights, no memory
        built = memory.meta_model(config)
    except Exception:  # noqa: BLE001 - a model transformers cannot build from its config alone: PEFT decides
        return
    _check_target_modules(m.lora_target_modules, built, model)
    names = [name for name, _ in built.named_modules() if name]
    # modules_to_save: a module whose full name ends with the text (peft.utils.other._set_trainable)
    if missing := [t for t in m.lora_modules_to_save or [] if not any(name.endswith(t) for name in names)]:
        shown = [name.rsplit(".", 1)[-1] for name in names if not name.rsplit(".", 1)[-1].isdigit()]
        _refuse_names("lora_modules_to_save", missing, model, "modules", shown, "train without it")
    # target_parameters: a parameter's full name, or its last dotted parts (BaseTuner._inject_parameters)
    params = [name for name, _ in built.named_parameters()]
    targets = m.lora_target_parameters or []
    missing = [t for t in targets if not any(name == t or name.endswith("." + t) for name in params)]
    if missing:  # named from their layer on (self_attn.q_proj.weight, not one per layer)
        shown = [re.split(r"(?:^|\.)\d+\.", name)[-1] for name in params]
        fate = "adapt the others alone" if m.lora_target_modules or len(missing) < len(targets) else "stop"
        _refuse_names("lora_target_parameters", missing, model, "parameters", shown, fate)
    memory.model_shape(recipe, config)  # PEFT's wrap on the meta device: its refusal of these settings, in one line
    _check_output_layer(m, built)  # one PEFT wraps, which TRL's trainer refuses


def _refuse_names(field: str, missing: list[str], model: str, kind: str, shown: list[str], fate: str) -> None:
    """`field`'s names that match nothing in the model, with the names it could take and what PEFT would do (`fate`)."""
    names = "that name" if len(missing) == 1 else "those names"
    raise ConfigError(
        f"{field} {' '.join(missing)}: {model} has no {kind[:-1]} of {names} (PEFT would {fate} once the model "
        f"loaded): its {kind} are named {', '.join(dict.fromkeys(shown))}; pass some of those, or remove {field}"
    )


def _check_target_modules(targets, built, model: str) -> None:
    """Refuse `lora_target_modules` names that match no module, as PEFT matches them: a list by the full name or its
    last dotted parts, a string as a regular expression over the full name."""
    if not targets or targets == "all-linear":
        return
    names = [name for name, _ in built.named_modules() if name]
    if isinstance(targets, str):
        try:
            if any(re.fullmatch(targets, name) for name in names):
                return
        except re.error as e:
            raise ConfigError(
                f"lora_target_modules {targets!r} is not a regular expression ({e}): give module names as a list "
                "(q_proj v_proj), or all-linear"
            ) from None
        what, fate = f"{targets!r}: no module of {model} has a name this regular expression matches", "stop"
    else:
        if not (unmatched := [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]):
            return
        what = (
            f"{' '.join(unmatched)}: {model} has no module of {'that name' if len(unmatched) == 1 else 'those names'}"
        )
        fate = "adapt the others alone" if len(unmatched) < len(targets) else "stop"
    # transformers' Conv1D (GPT-2's attention and MLP) is one PEFT adapts as a linear layer, all-linear included
    from transformers.pytorch_utils import Conv1D

    layers = (torch.nn.Linear, Conv1D)
    linear = dict.fromkeys(n.rsplit(".", 1)[-1] for n, x in built.named_modules() if isinstance(x, layers))
    given = [targets] if isinstance(targets, str) else targets
    # Several names in one text (`q_proj,v_proj`; a recipe file's `q_proj v_proj`, a YAML string): one regex to PEFT.
    # "Separated by spaces" alone sent a recipe file's writer back to the same string, and the same refusal
    words = [w for t in given for w in re.split(r"[\s,]+", t) if w]
    spaced = (
        f" (on the command line separated by spaces, not commas; in a recipe file as a list: [{', '.join(words)}])"
        if len(words) > len(given)
        else ""
    )
    raise ConfigError(
        f"lora_target_modules {what} (PEFT would {fate} once the model loaded): its linear layers are named "
        f"{', '.join(linear)}; pass some of those{spaced}, or --lora_target_modules all-linear"
    )


def _check_output_layer(m, built) -> None:
    """Refuse LoRA on the output layer, by `lora_target_modules` or `lora_target_parameters` as PEFT matches their
    names (`check_targets`; all-linear leaves it out): TRL's fused LM head computes every log-prob from its weight
    directly, so the adapter would never train, and TRL's trainer refused it in a traceback once the model had
    loaded. `m`: the recipe's model settings."""
    head = built.get_output_embeddings()
    name = next((n for n, x in built.named_modules() if x is head), None) if head is not None else None
    if not name:
        return
    targets, weights = m.lora_target_modules, [f"{name}.{p}" for p, _ in head.named_parameters()]
    if isinstance(targets, str) and targets != "all-linear":
        by_module = re.fullmatch(targets, name) is not None
    else:
        by_module = isinstance(targets, list) and any(name == t or name.endswith("." + t) for t in targets)
    params = [t for t in m.lora_target_parameters or [] if any(w == t or w.endswith("." + t) for w in weights)]
    if not (by_module or params):
        return
    short = name.rsplit(".", 1)[-1]
    field, given = ("lora_target_modules", targets) if by_module else ("lora_target_parameters", params)
    given = given if isinstance(given, str) else " ".join(given)
    raise ConfigError(
        f"{field} {given} adapts {short}, the model's output layer, whose weight TRL's fused LM head reads directly "
        f"for every log-prob: its adapter would never train (TRL refuses it once the model loaded): remove it from "
        f"{field} (--lora_modules_to_save {short} trains a copy of it whole)"
    )


def peft_config(model_args):
    """TRL's `peft_config` of the run's model settings (None without use_peft), with the base's `model_revision` as
    its `revision`: PEFT writes no revision into adapter_config.json of its own, so an adapter trained on a revision
    and loaded as the card says (AutoPeftModelForCausalLM) was put on the base's main. Every adapter saved (each
    checkpoint's, the final one) holds it."""
    from trl import get_peft_config

    config = get_peft_config(model_args)
    if config is not None and model_args.model_revision:
        config.revision = model_args.model_revision
    return config


@contextlib.contextmanager
def without_peft_deprecation():
    """PEFT reads transformers' deprecated `is_gradient_checkpointing` as it wraps a model, and TRL's
    `disable_gradient_checkpointing` around each score of a live reference: a FutureWarning at every LoRA start and
    merge, and at a live reference's first step on every rank, that nothing a user sets can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def save_merged(output_dir: str | Path, base: str, init: dict, trained, tokenizer) -> Path:
    """The adapter saved in `output_dir`, merged into its base and saved with the tokenizer to `<output_dir>/merged/`.
    The base is loaded afresh on the main process alone: under ZeRO-3 or FSDP2 no rank holds the full weights. Its
    special token ids and generation config are the `trained` model's, as the run's own save holds them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    target = Path(output_dir) / MERGED_DIR
    # Under ZeRO-3, transformers would build this model partitioned over the ranks, which have gone: training is over
    unset_hf_deepspeed_config()
    dtype, remote = init.get("dtype"), init.get("trust_remote_code", False)  # what the trained model loaded with
    dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    model = AutoModelForCausalLM.from_pretrained(
        base, revision=init.get("revision"), dtype=dtype, trust_remote_code=remote
    )
    tied = _untie(model)
    with without_peft_deprecation():
        merged = PeftModel.from_pretrained(model, str(output_dir)).merge_and_unload()
    if tied and torch.equal(merged.get_input_embeddings().weight, merged.get_output_embeddings().weight):
        _set_tied(merged, True)  # the adapter left both alone: saved once, as the base was
        merged.get_output_embeddings().weight = merged.get_input_embeddings().weight
    # The base loaded afresh holds its files' ids: TRL and the Trainer aligned the trained model's pad, BOS and EOS
    # with the tokenizer's (a pad id the base lacked: generation padded with the stop token)
    for config in {id(c): c for c in (merged.config, merged.config.get_text_config())}.values():
        for key in TOKEN_IDS:
            setattr(config, key, getattr(trained.config.get_text_config(), key))
    merged.generation_config = copy.deepcopy(trained.generation_config)
    upstream.saved_as_loaded(merged.generation_config)  # saved as the trainer saves it: the user's settings kept
    # An earlier attempt's (killed before run_complete.json, resumed in other numerics), whole: transformers' save
    # removes its shards, not its index nor a model.safetensors, which from_pretrained loads before new shards
    shutil.rmtree(target, ignore_errors=True)
    with quiet_progress_bars():  # "Writing model shards", as at every checkpoint
        merged.save_pretrained(target)
    readable_weights(target)
    tokenizer.save_pretrained(target)
    return target


def _untie(model) -> bool:
    """Gives a model whose output layer shares the input embedding's weight (tie_word_embeddings) a copy of its own:
    the adapter trained one of them (LoRA on embed_tokens or lm_head), and a merge into the shared weight changed both.
    Whether they were tied."""
    into, out = model.get_input_embeddings(), model.get_output_embeddings()
    if into is None or out is None or out.weight.data_ptr() != into.weight.data_ptr():
        return False
    out.weight = torch.nn.Parameter(into.weight.detach().clone())
    _set_tied(model, False)
    return True


def _set_tied(model, tied: bool) -> None:
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        if hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = tied


# The card's line of a run's merged model, and what a push says in its place where merged/ was deleted since
MERGED_LINE = f" The merged model (base + adapter) is in `{MERGED_DIR}/`."
MERGED_DELETED = (
    f" Its merged model (`merge_lora: true`) was deleted after training, so `{MERGED_DIR}/` is not here: merge the "
    "adapter into the base with PEFT's `merge_and_unload()`."
)


def card_lines(s) -> str:
    """Model card paragraph for an adapter run (`s`: the record's settings); "" for a full fine-tune."""
    if not s.use_peft:
        return ""
    merged = MERGED_LINE if s.merge_lora else " Pass `merge_lora: true` to also save the merged model."
    load = "Load it with `peft.AutoPeftModelForCausalLM.from_pretrained(<this repo>)`."
    base = s.model_name_or_path  # a local folder by its name alone: its path is the training machine's
    base = base if is_hub_model(base) or builtin.is_builtin(base) else Path(base.rstrip("/")).name or base
    if not is_hub_model(s.model_name_or_path):  # PEFT records the folder the base loaded from: no Hub name to fetch
        built = (
            f" (the built-in model, built by `dpotrain.data.builtin.materialize_model({s.model_name_or_path!r})`)"
            if builtin.is_builtin(s.model_name_or_path)
            else ""
        )
        load = (
            "Its `adapter_config.json` names the base by the local folder it trained from, by its name alone (the "
            "training machine's path stays off the Hub), so `peft.AutoPeftModelForCausalLM.from_pretrained(<this "
            "repo>)` loads it only from a folder of that name in the working directory; elsewhere "
            f"load the base{built} and pass it to `peft.PeftModel.from_pretrained(base, <this repo>)`."
        )
    return (
        f"\nThis is a **LoRA adapter** (PEFT) for `{base}`, not a full model: r={s.lora_r}, "
        f"alpha={s.lora_alpha}, dropout={s.lora_dropout}, {_targets(s)}{_set_options(s)}. The DPO reference was "
        f"the base with the adapter disabled. {load}{merged}\n"
    )


def _targets(s) -> str:
    """What the adapter adapts: modules, parameters (PEFT's target_parameters, an MoE's experts), or both where both
    were given (the card named the modules alone, and the adapter could not be trained again from it)."""
    said = [f"target modules {s.lora_target_modules}" if s.lora_target_modules else ""]
    said.append(f"target parameters {s.lora_target_parameters}" if s.lora_target_parameters else "")
    return " and ".join(part for part in said if part)


def _set_options(s) -> str:
    """The adapter's settings past r, alpha, dropout and targets that are set (none at PEFT's defaults): without them
    a card's reader could not train the adapter again."""
    said = [
        "`use_rslora: true` (the update scaled by alpha / sqrt(r))" if s.use_rslora else "",
        "`use_dora: true` (DoRA)" if s.use_dora else "",
        f"`lora_modules_to_save: {s.lora_modules_to_save}` (trained whole, saved with the adapter)"
        if s.lora_modules_to_save
        else "",
        _quantized(s),
    ]
    return "".join(f", {part}" for part in said if part)


def _quantized(s) -> str:
    """QLoRA's quantized base, where the run loaded one: the adapter learned to correct the quantized weights, and a
    card without it told a reader to train it again, or load it, on the base in full precision."""
    if s.load_in_8bit:
        return "`load_in_8bit: true` (QLoRA: trained on the base quantized to 8 bits by bitsandbytes)"
    if not s.load_in_4bit:
        return ""
    nested = ", `use_bnb_nested_quant: true`" if s.use_bnb_nested_quant else ""
    kind = f"`bnb_4bit_quant_type: {s.bnb_4bit_quant_type or 'nf4'}`{nested}"
    return f"`load_in_4bit: true` (QLoRA: trained on the base quantized to 4 bits by bitsandbytes, {kind})"
