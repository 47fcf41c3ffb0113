"""Memory per GPU, planned before anything loads: does this recipe fit, under this engine, on this many GPUs?

A plan sums parts per GPU (docs/memory.md, "Memory plan"): model states, engine buffers, one micro-batch's activations
traced on fake tensors, TRL's chunked LM head, a live reference model's weights, attention masks, and an allowance for
the CUDA context, NCCL and fragmentation. Parameter counts come from the config alone, built on the meta device.
"""

import contextlib
import copy
import functools
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import accelerate
import torch
import transformers
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import StrictDataclassError
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import AutoConfig

from dpotrain.cluster.engine import NAMES, Engine, from_config, model_dtype
from dpotrain.cluster.sequence_parallel import head_counts
from dpotrain.data import builtin, model_identity
from dpotrain.data.lengths import refused_config
from dpotrain.forwards.flops import head_dim, layer_kinds, mlp_width, query_width
from dpotrain.forwards.masks import BLOCK
from dpotrain.forwards.packing import ATTENTION_LAYER_TYPES, VARLEN_ATTENTION, row_width_bound
from dpotrain.forwards.sequence_parallel import model_problem
from dpotrain.plan.memory_advice import advice, node_size
from dpotrain.recipe import upstream
from dpotrain.recipe.config import uses_live_reference
from dpotrain.recipe.errors import ConfigError, cause, plural

GIB = 2**30
# CUDA context (~0.5-1 GiB with torch's kernels loaded) plus NCCL communicator buffers (~1-2 GiB), per process.
CONTEXT_GIB = 3.0
# The caching allocator rarely packs tensors perfectly: 10% of everything else, with expandable segments (EXPANDABLE).
FRAGMENTATION = 0.10
# Packed micro-batches change shape every step and fragment the allocator's fixed segments (BENCHMARKS.md).
EXPANDABLE = "expandable_segments:True"
ALLOCATOR_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, then its older one
BF16 = 2


def default_allocator() -> str:
    """Sets EXPANDABLE unless the user set either allocator name; call before any CUDA allocation (read once then)."""
    if not any(os.environ.get(name) for name in ALLOCATOR_NAMES):
        os.environ[ALLOCATOR_NAMES[0]] = EXPANDABLE
    return allocator()


def allocator() -> str:
    """The caching allocator's setting in this process's environment, as the plan records it (`derived.memory`)."""
    given = next((name for name in ALLOCATOR_NAMES if os.environ.get(name)), None)
    return f"{given}={os.environ[given]}" if given else "torch's default (no PYTORCH_ALLOC_CONF)"


# --- the model, from its config only ---


@dataclass(frozen=True)
class ModelShape:
    params: int  # distinct parameters (tied ones once), as DeepSpeed's model_to_params counts them
    trainable: int  # all of them, or LoRA's adapter
    largest_layer: int  # the most parameters one module holds itself (DeepSpeed's largest_layer_params)
    decoder_layer: int  # the largest decoder layer: one FSDP2 unit
    lm_head: int  # the output embedding, vocabulary x hidden
    lm_head_trains: bool
    hidden: int
    layers: int
    load_bytes: int  # bytes per parameter as loaded (the recipe's dtype): LoRA's frozen base, one process
    quantized: int = 0  # frozen weights bitsandbytes stores in 4 or 8 bits (QLoRA: --load_in_4bit/8bit)
    quantized_bytes: float = 0.0  # bytes per such weight, its scales included


def model_config(recipe, path: str | None = None, local_only: bool = True) -> tuple:
    """The model's config (no weights), or (None, why) where `local_only` and this machine lacks it. `path`: the
    model's files; without it the recipe's model (an unbuilt built-in: its shape). A config this transformers cannot
    read (remote code not allowed, an unknown model type) raises ConfigError."""
    name = recipe.model.model_name_or_path
    if path is None and builtin.is_builtin(name):
        builtin.check_name(name)
        path = builtin.existing_model_dir(name)
        if path is None:  # not built yet: its shape, with at most 1024 tokens (its tokenizer's bound)
            return builtin.model_config(name.removeprefix(builtin.BUILTIN_PREFIX)), None
    revision, trust = recipe.model.model_revision, recipe.training.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(
            path or name, revision=revision, local_files_only=local_only, trust_remote_code=trust
        )
        return config, None
    except StrictDataclassError as e:  # a value transformers refuses: no ValueError, and no config to plan from
        raise refused_config(name, e) from None
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):  # transformers names its argument, not this project's flag
            raise ConfigError(
                f"{name} runs its own code (auto_map in its config.json): read it, then give --trust_remote_code true"
            ) from None
        if (unknown := re.search(r"has model type `(.*?)` but Transformers does not recognize", str(e))) is not None:
            # A model newer than the installed transformers: not a config missing from this machine (the dry run)
            raise ConfigError(
                f"{name}: its config.json's model_type {unknown[1]!r} is not one transformers "
                f"{transformers.__version__} knows: install a transformers release that has it (pip install -U "
                "transformers), or check model_type in its config.json"
            ) from None
        # transformers says this of a folder without config.json too (a tokenizer's alone): only one it has is refused
        has_config = os.path.isfile(os.path.join(path or name, "config.json"))
        if not has_config and (adapter := hub_adapter(path or name, revision, local_only)):
            # a Hub repo holding a LoRA adapter alone (a LoRA run pushed): refused as a local adapter folder is
            raise model_identity.adapter_refusal(f"model {name!r}", adapter) from None
        if "Should have a `model_type` key" in str(e) and has_config:  # the run's load would fail on it
            raise ConfigError(no_model_type(name, path or name)) from None
        if not local_only:
            raise
        return None, unreadable(recipe, e)  # the reason from this read's error: the config is read once


def hub_adapter(name: str, revision: str | None, local_only: bool):
    """The adapter_config.json of Hub repo `name` at `revision` (a Path), where it has one; None otherwise."""
    if os.path.isdir(name):
        return None
    try:
        return Path(hf_hub_download(name, "adapter_config.json", revision=revision, local_files_only=local_only))
    except Exception:  # noqa: BLE001 - no such file, no network, no such repo: transformers' error stands
        return None


def no_model_type(name: str, where: str) -> str:
    """The refusal of a config.json without `model_type` (an export that wrote its own, a hand-made one), which
    transformers reads to know the architecture; with the model_type its `architectures` names, where it names one."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    file = os.path.join(where, "config.json") if os.path.isdir(where) else f"the config.json of {name}"
    try:
        with open(os.path.join(where, "config.json"), encoding="utf-8") as f:
            architecture = (json.load(f).get("architectures") or [None])[0]
    except (OSError, ValueError, AttributeError, TypeError):
        architecture = None
    types = [t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == architecture]
    add = f'add "model_type": "{types[0]}" (its architecture {architecture}\'s)' if types else "add its model_type"
    return (
        f"{file} has no model_type, which transformers reads to know the model's architecture: {add}, or copy "
        "config.json again from where the model came from"
    )


def model_config_or_reason(recipe, local_only: bool = True) -> tuple:
    """`model_config` that refuses nothing: a refused config is the reason not to plan. `local_only=False` asks the
    Hub where not cached (the analyzer on a login node)."""
    try:
        return model_config(recipe, local_only=local_only)
    except ConfigError as e:
        return None, str(e)
    except (OSError, ValueError) as e:  # only where not local_only (`model_config` gives the reason itself there)
        return None, unreadable(recipe, e)


def unreadable(recipe, error: BaseException) -> str:
    """Why the model's config is not read on this machine, from the error of reading it with local files only."""
    from dpotrain.cluster.offline import is_hub_model, prefetch_command

    name = recipe.model.model_name_or_path
    if not is_hub_model(name):  # a local folder: nothing on the Hub would fetch it
        return f"the config of {name!r} is not readable on this machine ({cause(error, 160)})"
    # transformers' text ("couldn't connect") would suggest a download was tried; none was.
    return (
        f"the config of {name!r} is not in the local Hugging Face cache; a dry run loads nothing from the network: "
        f"`{prefetch_command(recipe)}` on a machine with network fetches it"
    )


def model_shape(recipe, config) -> ModelShape:
    """The model's parameter counts (with LoRA's adapter where trained), from its config alone. Cached: a refusal
    plans many variants of one model, and PEFT wraps a 32B model in seconds."""
    from trl import get_peft_config

    peft = get_peft_config(recipe.model) if recipe.model.use_peft else None
    m = recipe.model
    bits = 4 if m.load_in_4bit else 8 if m.load_in_8bit else None
    key = (config.to_json_string(use_diff=False), repr(peft), str(m.dtype), bits, m.use_bnb_nested_quant)
    if key in _SHAPES:
        return _SHAPES[key]
    text = config.get_text_config()
    model = meta_model(config)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
    decoder_layer = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    head = model.get_output_embeddings()
    lm_head = head.weight.numel() if head is not None else 0
    quantized = quantized_weights(model) if bits else 0  # before PEFT wraps the layers: bitsandbytes' own choice
    trainable, head_trains = params, True
    if peft:  # TRL wraps the model with this same config (dpotrain/train/trainer.py)
        from peft import get_peft_model

        # On meta too: PEFT otherwise initialises each adapter on the CPU first (seconds for 7B, same counts).
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = get_peft_model(model, peft)
        except (ValueError, TypeError) as e:  # what TRL's wrap would raise once the weights loaded (e.g. all-linear
            # on experts, which take no lora_dropout). One line: a module named by its class, not its printed tree
            why = " ".join(re.sub(r"\(\n.*?\n\)", "", str(e), flags=re.S).split())
            raise ConfigError(
                f"use_peft: PEFT cannot adapt {recipe.model.model_name_or_path} with these LoRA settings ({why}): "
                f"{_peft_fix(config, str(e))}"
            ) from None
        check_adapted_layers(model, recipe.model.lora_target_modules)
        params = sum(p.numel() for p in model.parameters())  # the base and the adapter
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # lora_modules_to_save lm_head trains a copy of the head, whole (the model's head is PEFT's wrapper of it, the
        # original frozen): its weight gradient is the LM head's as in a full fine-tune; LoRA on the head has none
        head = model.get_output_embeddings()
        head_trains = head is not None and any(p.requires_grad and p.numel() == lm_head for p in head.parameters())
    load = 4 if str(model_dtype(recipe, config) or "float32").replace("torch.", "") == "float32" else BF16
    # bitsandbytes' 4-bit: two weights a byte and an fp32 scale per 64 (an 8-bit one with use_bnb_nested_quant)
    stored = (1.0 if bits == 8 else 0.5 + (1 if m.use_bnb_nested_quant else 4) / 64) if bits else 0.0
    counts = (params, trainable, largest, decoder_layer, lm_head, head_trains, text.hidden_size, text.num_hidden_layers)
    _SHAPES[key] = ModelShape(*counts, load, quantized, stored)
    return _SHAPES[key]


def quantized_weights(model) -> int:
    """The weights bitsandbytes stores quantized (--load_in_4bit/8bit), as transformers' quantizer replaces layers:
    every linear layer's but the output head's, a tied one's, the last module's and those the model keeps in float32."""
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    kept = HfQuantizer.get_modules_to_not_convert(model, keep_in_fp32_modules=upstream.kept_in_fp32(model))
    return sum(
        x.weight.numel()
        for name, x in model.named_modules()
        if (type(x) is torch.nn.Linear or isinstance(x, Conv1D)) and should_convert_module(name, kept)
    )


# PEFT's refusal of layers by name, whatever selected them (a Mamba model's mixers: all-linear cannot leave them out)
INCOMPATIBLE = re.compile(r"Incompatible modules: \{([^}]*)\}")


def _peft_fix(config, said: str) -> str:
    """What to pass where PEFT refused to wrap the model `config` describes: where it named the layers it cannot adapt,
    the model's other linear layers (its output head left out, as all-linear does), by name. Listed from a model built
    afresh on the meta device: PEFT had wrapped some layers of the one it refused before it stopped."""
    from transformers.pytorch_utils import Conv1D

    generic = "change the setting it names, or pass --lora_target_modules naming some of its linear layers"
    if not (refused := INCOMPATIBLE.search(said)):
        return generic
    model = meta_model(config)
    head = model.get_output_embeddings()
    layers = [n for n, x in model.named_modules() if isinstance(x, (torch.nn.Linear, Conv1D)) and x is not head]
    kept = [
        n for n in dict.fromkeys(n.rsplit(".", 1)[-1] for n in layers) if n not in re.findall(r"'([^']+)'", refused[1])
    ]
    return f"pass the linear layers PEFT takes by name (--lora_target_modules {' '.join(kept)})" if kept else generic


def check_adapted_layers(wrapped, targets) -> None:
    """Refuse a layer PEFT adapts as a linear one that is not one: a subclass of nn.Linear whose forward returns more
    than its linear map (Phi-3.5-MoE's router: its logits, weights and experts), to whose output LoRA adds its update
    only once the model loaded and the reference was scored ("'tuple' object has no attribute 'dtype'"). `wrapped` is
    the model PEFT wrapped on the meta device for lora_target_modules `targets`; each such class's forward runs once
    there, on the input the model gives it (DeepSeek V4's grouped output projection takes its heads in groups, and
    returns a group's width: LoRA's update, the full width, failed to add at the first forward)."""
    from peft.tuners.lora import Linear as LoraLinear
    from transformers.pytorch_utils import Conv1D

    plain = (torch.nn.Linear.forward, Conv1D.forward)
    adapted = [
        (name.rsplit(".", 1)[-1], x.base_layer) for name, x in wrapped.named_modules() if isinstance(x, LoraLinear)
    ]
    first = {}  # one layer of each class with a forward of its own
    for name, base in adapted:
        if type(base).forward not in plain:
            first.setdefault(type(base), (name, base))
    seen = _inputs_seen(wrapped, [base for _, base in first.values()])
    odd = {}
    for name, base in first.values():
        try:
            with torch.no_grad():
                out = base.eval()(torch.empty(seen.get(base, (1, 2, base.in_features)), device="meta"))
        except Exception:  # noqa: BLE001 - a forward that needs more than its input: PEFT decides
            continue
        if not isinstance(out, torch.Tensor):
            odd[name] = f"{type(base).__name__}, whose forward returns a {type(out).__name__}"
        elif out.shape[-1] != base.out_features:
            odd[name] = (
                f"{type(base).__name__}, whose forward returns {out.shape[-1]} features, not {base.out_features}"
            )
    if odd:
        others = dict.fromkeys(name for name, _ in adapted if name not in odd)
        given = targets if isinstance(targets, str) else " ".join(targets)
        instead = f"--lora_target_modules {' '.join(others)}" if others else "--lora_target_modules naming others"
        raise ConfigError(
            f"lora_target_modules {given} adapts {'; '.join(f'{n} ({why})' for n, why in odd.items())}: PEFT takes it "
            f"for a linear layer, and LoRA's update cannot be added to that output (the run would fail at its first "
            f"forward, once the model loaded): pass the linear layers by name, without it ({instead})"
        )


def _inputs_seen(wrapped, layers: list) -> dict:
    """The shape of the input each of `layers` is given in a forward of the meta-device `wrapped` model on 8 tokens,
    where the forward reaches it (one that stops before, on meta, leaves it out)."""
    seen = {}
    if not layers:
        return seen

    class Enough(Exception):
        pass

    def note(layer, args):
        seen.setdefault(layer, tuple(args[0].shape))
        if len(seen) == len(layers):
            raise Enough

    hooks = [layer.register_forward_pre_hook(note) for layer in layers]
    try:
        with torch.no_grad():
            wrapped.eval()(input_ids=torch.zeros(1, 8, dtype=torch.long, device="meta"))
    except Exception:  # noqa: BLE001 - Enough, or an operation meta tensors cannot run (a MoE's routing)
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return seen


_SHAPES: dict[tuple, ModelShape] = {}


def own_code(config) -> bool:
    """A config of the model's own code (auto_map), loaded only with trust_remote_code: its model is that code's."""
    return not type(config).__module__.startswith("transformers.")


def built_model(config, **kwargs):
    """The model the run loads for `config`, built from the config alone (`kwargs`: `from_config`'s): its causal-LM
    class, else the class its config.json names (`architectures`), which TRL loads: transformers maps no causal LM
    to a vision-language config such as Qwen2-VL's, whose model trains on text, and the plans stopped in a traceback
    (`Unrecognized configuration class ... for AutoModelForCausalLM`)."""
    from transformers import AutoModelForCausalLM

    named = getattr(transformers, (getattr(config, "architectures", None) or [""])[0] or "", None)
    if own_code(config) or upstream.causal_lm_class(config) is not None or named is None:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=own_code(config), **kwargs)
    return upstream.model_from_config(named, config, **kwargs)


def meta_model(config):
    """The model `config` describes on the meta device, outside DeepSpeed's zero.Init (a ZeRO-3 launch's wrap)."""
    with torch.device("meta"), upstream.without_zero3_init(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return built_model(config)


def check_loading(engine: Engine, config, model: str) -> None:
    """FSDP2's RAM-efficient loading (the main process loads the weights and sends each rank its shard) in accelerate
    1.15 sends parameters only, and stops on a buffer saved with the weights ("'Tensor' object has no attribute
    'device_mesh'", huggingface/accelerate#3898) once the model has loaded: the router bias of DeepSeek-V3-style
    mixtures of experts (GLM-4.5, DeepSeek V3 and V4), Gemma 4's layer scalars. Refused before the load,
    naming the setting."""
    if engine.name != "fsdp2" or not engine.ram_efficient_loading:
        return
    built = meta_model(config)
    saved = set(built.state_dict()) - {name for name, _ in built.named_parameters(remove_duplicate=False)}
    if not saved:
        return
    named = ", ".join(sorted(saved)[:2]) + (f" and {len(saved) - 2} more" if len(saved) > 2 else "")
    raise ConfigError(
        f"{model} saves buffers with its weights ({named}), which FSDP2's RAM-efficient loading in accelerate "
        f"{accelerate.__version__} cannot send to the other processes (huggingface/accelerate#3898): set "
        f"fsdp_cpu_ram_efficient_loading: false in the accelerate config ({engine.source}; each process then loads "
        "the whole model in host memory), or train under DeepSpeed ZeRO-3 (configs/accelerate/zero3.yaml)"
    )


# --- activations: the backbone traced on fake tensors ---


def activation_bytes(config, tokens: int, checkpointing: bool | int) -> tuple[int, str]:
    """Peak bytes of the backbone's forward + backward for `tokens`, and how found; `checkpointing` False, True or k.
    Traced per layer kind (`layer_costs`, docs/memory.md), attention fused and unmasked (`mask_bytes`), linear-attention
    and Mamba layers without their optional CUDA kernels (the most they keep); a failed trace takes the formula."""
    text = config.get_text_config()
    every = checkpoint_every(checkpointing)
    kept = checkpointed_layers(every, text.num_hidden_layers)
    kinds = [traced_kind(k) for k in layer_kinds(text)]
    try:
        _check_builds(config, set(kinds))
        modes = [True] * (kept > 0) + [False] * (kept < text.num_hidden_layers)  # the layer kinds this plan has
        traced = {(m, k): layer_costs(config, tokens, m, k) for m in modes for k in set(kinds)}
    except Exception as e:  # noqa: BLE001 - any failure of the trace falls back to the documented formula
        return formula_activation_bytes(text, tokens, every), f"formula (the trace failed: {cause(e, 120)})"
    costs = {m: ([traced[m, k][0] for k in kinds], [traced[m, k][1] for k in kinds]) for m in modes}
    return _combine(costs, every, text.num_hidden_layers), "traced on fake tensors (1 and 2 layers, extrapolated)"


def _check_builds(config, kinds: set) -> None:
    """Builds, before any trace, the model each of a hybrid's other `kinds` is traced in (`layer_costs`): one that
    cannot be built raises here in seconds, where it stopped the plan only after the full-attention traces had run
    (Zamba: one shared-transformer layer fails its tied-weights check, after ~4 minutes of Mamba traces that loop per
    token in Python). The autocast copies' traces check it too: such a model takes the formula for both."""
    for kind in sorted(kinds - {"full_attention"}):
        with _fake_model(config, ("full_attention", kind)):
            pass


def traced_kind(kind: str) -> str:
    """Sliding windows and chunks only change the (untraced) mask: traced as full attention; other kinds as is."""
    return "full_attention" if kind in ATTENTION_LAYER_TYPES else kind


def checkpoint_every(checkpointing: bool | int | None) -> int | None:
    """None (no layer checkpointed) or k (every k-th layer; 1: all) from False / True / k."""
    if not checkpointing:
        return None
    return 1 if checkpointing is True else int(checkpointing)


def checkpointed_layers(every: int | None, layers: int) -> int:
    """How many of `layers` transformers checkpoints with `every_n_layers=every`: indices 0, every, 2 x every, ..."""
    return 0 if every is None else math.ceil(layers / every)


def _kinds_copy(config, kinds: tuple):
    """`config` with a layer of each of `kinds` (`traced_kind`)."""
    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers = len(kinds)
    if getattr(text, "layer_types", None):
        text.layer_types = list(kinds)
    return config


def layer_costs(config, tokens: int, checkpointed: bool, kind: str = "full_attention") -> tuple[int, int]:
    """(rest, slope) of layers of `kind`, all checkpointed or none: traces of 1 and 2 full-attention layers; another
    kind after one full-attention layer (a hybrid may refuse a model without attention: OLMo Hybrid). The slope is
    what each more layer keeps; the rest holds the largest layer's passing peak once. Cached."""
    key = _kinds_copy(config, ("full_attention",)).to_json_string(use_diff=False)  # the traces set their layers
    if (key, tokens, checkpointed, kind) not in _COSTS:
        if kind == "full_attention":
            one, two = (_traced_peak(config, n, tokens, checkpointed) for n in (1, 2))
            rest, slope = one - (two - one), two - one
        else:  # the full-attention layer it follows: that kind's own costs, traced once (a hybrid plans both kinds)
            slope_full = layer_costs(config, tokens, checkpointed)[1]
            after = [_traced_peak(config, ("full_attention", *[kind] * n), tokens, checkpointed) for n in (1, 2)]
            slope = after[1] - after[0]
            rest = after[0] - slope_full - slope
        _COSTS[key, tokens, checkpointed, kind] = rest, slope
    return _COSTS[key, tokens, checkpointed, kind]


# Keyed by the config's text but traced from the config itself: a JSON round trip fails some (Granite 4's
# time_step_limit holds an infinity).
_COSTS: dict[tuple, tuple[int, int]] = {}


def _combine(costs: dict[bool, tuple], every: int | None, layers: int) -> int:
    """The backbone's peak from the (rest, slope) of a checkpointed layer (True) and a plain one (False), or per layer
    (lists). Mixed: the larger of the backward's start and each checkpointed layer's recomputation, with the plain
    layers before it holding theirs."""
    kept = checkpointed_layers(every, layers)
    each = lambda v: v if isinstance(v, list) else [v] * layers  # noqa: E731 - a layer's value from one for all
    rests, slopes = {m: each(c[0]) for m, c in costs.items()}, {m: each(c[1]) for m, c in costs.items()}
    if kept in (0, layers):
        return max(rests[kept > 0]) + sum(slopes[kept > 0])
    held = sum(slopes[True][::every])  # transformers checkpoints layers 0, every, 2 x every, ...
    plain = [i for i in range(layers) if i % every]
    start = max(rests[False][i] for i in plain) + held + sum(slopes[False][i] for i in plain)
    recomputed = (
        rests[True][j] + held + sum(slopes[False][i] for i in plain if i < j) for j in range(0, layers, every)
    )
    return max(start, *recomputed)


TRACE_ATTENTION = "dpotrain_memory_plan"


def _fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What fused attention keeps for backward (q, k, v, output, log-sum-exp), unmasked: transformers builds a dense
    mask whenever it sees fake tensors (it takes them for a compiler's tracing)."""
    import torch.nn.functional as F

    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register_trace_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(TRACE_ATTENTION, _fused_attention)
    AttentionMaskInterface.register(TRACE_ATTENTION, flash_attention_mask)  # no mask without padding


@contextlib.contextmanager
def _fake_model(config, layers: int | tuple, dtype=torch.bfloat16):
    """The model with `layers` full-attention layers (or one of each kind) on fake tensors, its attention fused and
    unmasked (`TRACE_ATTENTION`): what the traces run (`_inputs` are their forward's). In eval mode, as built: a trace
    enables checkpointing before `train()`, in that order."""
    register_trace_attention()
    config = _kinds_copy(config, ("full_attention",) * layers if isinstance(layers, int) else layers)
    # A trace that fails takes the formula, which says why: torch's own error lines about it (xLSTM's) are kept quiet
    with upstream.fake_tensor_mode(), upstream.without_zero3_init(), upstream.quiet_fake_tensor_log():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield built_model(config, dtype=dtype, attn_implementation=TRACE_ATTENTION)


def _inputs(tokens: int) -> dict:
    """A backbone forward's inputs: one row of `tokens` positions."""
    return {"input_ids": torch.zeros(1, tokens, dtype=torch.long), "position_ids": torch.arange(tokens)[None]}


def _traced_peak(config, layers: int | tuple, tokens: int, checkpointing: bool | int) -> int:
    """The backbone's peak on fake tensors, less parameters: `layers` full-attention layers, or one of each kind."""
    with _fake_model(config, layers) as model:
        if every := checkpoint_every(checkpointing):
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every
            )
        model.train()
        for p in model.parameters():  # the engine takes each weight gradient away as soon as it exists
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        inputs, tracker = _inputs(tokens), upstream.mem_tracker()  # the inputs made before the tracker: not counted
        tracker.track_external(model)
        with tracker:
            hidden = model.base_model(**inputs, use_cache=False).last_hidden_state
            hidden.backward(torch.ones_like(hidden))
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return peak["Total"] - peak[upstream.mem_ref_types().PARAM]


def autocast_copies(config, tokens: int, layer_params: int) -> int:
    """Bytes a layer keeps for backward beyond the bf16 trace where float32 weights compute under bf16 autocast (one
    process, DDP): the bf16 copy autocast makes of each projection's weight, and of each projection's input (q, k and v
    each cast their own). Counted, not extrapolated: what a second full-attention layer saves (2 layers less 1: the
    embedding and final norm aside), in float32 under autocast less in bf16, on fake tensors at `tokens` (OLMo 3 7B's
    layer: 386 MiB of weights + 24 KiB a token). A model the trace cannot build takes the formula, as the activations
    do: the largest layer's `layer_params` in bf16, and 3 bf16 casts of the hidden state a token (OLMo 3's). Cached."""
    try:
        key = (_kinds_copy(config, ("full_attention",)).to_json_string(use_diff=False), tokens)  # any layer count's
        if key not in _AUTOCAST:  # a model whose activations take the formula for its build (Zamba's) too
            _check_builds(config, {traced_kind(k) for k in layer_kinds(config.get_text_config())})
            layer = {c: _saved_bytes(config, 2, tokens, c) - _saved_bytes(config, 1, tokens, c) for c in (False, True)}
            _AUTOCAST[key] = max(0, layer[True] - layer[False])
        return _AUTOCAST[key]
    except Exception:  # noqa: BLE001 - any failure of the trace falls back to the documented formula
        return BF16 * (layer_params + 3 * config.get_text_config().hidden_size * tokens)


_AUTOCAST: dict[tuple, int] = {}


def _saved_bytes(config, layers: int, tokens: int, autocast: bool) -> int:
    """The bytes the backbone's forward with `layers` full-attention layers saves for backward (parameters aside), in
    float32 under bf16 autocast or in bf16; each storage once (a view saved twice is one tensor)."""
    saved: dict[StorageWeakRef, int] = {}  # each storage once, by its identity (on fake tensors too)
    with _fake_model(config, layers, torch.float32 if autocast else torch.bfloat16) as model:
        model.train()
        params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}

        def pack(t):
            if (ref := StorageWeakRef(t.untyped_storage())) not in params:
                saved[ref] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                model.base_model(**_inputs(tokens), use_cache=False)
    return sum(saved.values())


def formula_activation_bytes(text, tokens: int, checkpointing: bool | int) -> int:
    """Llama-shaped layer in bf16, where no trace is possible: per token, 2 x (10 H + 2 H_kv + 4 I) bytes per layer; a
    checkpointed layer keeps only its input (2 H), and one is recomputed with its gradients (2 x that)."""
    h = text.hidden_size
    _, kv = head_counts(text)
    per_layer = BF16 * (10 * h + 2 * kv * head_dim(text) + 4 * mlp_width(text))
    costs = {True: (2 * per_layer, BF16 * h), False: (per_layer, per_layer)}
    return tokens * _combine(costs, checkpoint_every(checkpointing), text.num_hidden_layers)


REFERENCE_MULTIPLE_MOST = 8  # more buys little: a forward of 8 training micro-batches already fills a GPU's kernels


def forward_only_multiple(
    config,
    tokens: int,
    width: int | None,
    attn: str,
    checkpointing: bool | int,
    n: int = 1,
    training: int | None = None,
) -> int:
    """How many training micro-batches' `tokens` a forward-only (reference stage) micro-batch may hold in the memory
    the plan gives training's (activations, LM head, masks): `training` bytes, else their formula (fp32, no plan).
    Without gradients a token holds the residual stream in and out and one layer's working set at a time. Rounded
    down, in [1, `REFERENCE_MULTIPLE_MOST`]; `n`: the sequence-parallel group."""
    text = config.get_text_config()
    h = text.hidden_size
    layer = formula_activation_bytes(text, 1, False) // (text.num_hidden_layers + 1)  # one layer, per token
    width = width or tokens
    local = -(-tokens // n)
    tile = _logits_tile(local)
    exchange = all_to_all_bytes(config, tokens, n)
    if training is None:
        training = (
            formula_activation_bytes(text, local, checkpointing)
            + tile
            + local * (h * (BF16 + 4) + 12 * 4)
            + mask_bytes(attn, tokens, width, config, checkpoint_every(checkpointing) == 1)
            + exchange
        )
    per_token = (
        (layer + 2 * BF16 * h + 12 * 4) / n + mask_bytes(attn, tokens, width, config, True) / tokens + exchange / tokens
    )
    return max(1, min(REFERENCE_MULTIPLE_MOST, int((training - tile) / (tokens * per_token))))


def mask_bytes(attn_implementation: str, tokens: int, width: int, config, checkpointing: bool) -> int:
    """sdpa and eager build a dense mask per row and layer kind (tokens x width: bool for sdpa, bf16 for eager); sdpa's
    fused CUDA kernels convert it to a bf16 copy at each call. Eager also keeps each layer's probabilities (fp32
    softmax and a bf16 copy), of one layer at a time under activation checkpointing."""
    if attn_implementation in VARLEN_ATTENTION:
        return 0
    text = config.get_text_config()
    kinds = len(set(layer_kinds(text)) & ATTENTION_LAYER_TYPES) or 1
    if attn_implementation == "flex_attention":  # per kind, a BlockMask's int32 tables (partial and full, kv and q)
        return kinds * 4 * 4 * math.ceil(tokens / BLOCK) ** 2
    if attn_implementation != "eager":
        return tokens * width * (kinds + BF16)
    layers = 1 if checkpointing else text.num_hidden_layers
    heads = getattr(text, "num_attention_heads", None) or 0  # none in a model without attention (Mamba, RWKV)
    return tokens * width * (kinds * BF16 + heads * (4 + BF16) * layers)


def lm_head_bytes(shape: ModelShape, tokens: int) -> int:
    """TRL's fused LM head (`trl.kernels.ChunkedLogProbFunction`): the hidden rows (bf16) and their fp32 gradient, one
    logits tile, fp32 running statistics, and a trained head's fp32 weight gradient. Every token counted as scored."""
    per_token = shape.hidden * (BF16 + 4) + 12 * 4
    weight_grad = shape.lm_head * (4 + BF16) if shape.lm_head_trains else 0
    return _logits_tile(tokens) + tokens * per_token + weight_grad


def _logits_tile(tokens: int) -> int:
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE

    return min(tokens, TOKEN_CHUNK_SIZE) * upstream.chunked_logprob_chunk_size() * BF16


# --- the engines ---


# Optimizer states a trained weight keeps, by a part of transformers' optim name, longest first; any other (Adam's
# family, GaLore, APOLLO, LOMO, ...) is planned as Adam's two moments. Adafactor's second moment whole: ZeRO hands it
# flat partitions, which it cannot factor
OPTIMIZER_STATES = {"schedule_free_sgd": 1, "grokadamw": 3, "ademamix": 3, "adafactor": 1, "rmsprop": 1, "adagrad": 1}
OPTIMIZER_STATES |= {"lion": 1, "sgd": 0}


def optimizer_state_bytes(optim, optim_args: str | None, master: int) -> float:
    """Bytes of optimizer state per trained weight: its states (SGD's momentum where optim_args sets one) at 1 byte
    each in an 8-bit optimizer, half in a 4-bit one, else at `master`, the precision the optimizer updates in."""
    name = str(getattr(optim, "value", optim) or "adamw_torch")
    states = next((n for part, n in OPTIMIZER_STATES.items() if part in name), 2)
    states += name == "sgd" and "momentum" in (optim_args or "")
    return states * (1 if "8bit" in name else 0.5 if "4bit" in name else master)


def model_state_bytes(engine: Engine, shape: ModelShape, world: int, optim=None, optim_args=None) -> tuple[int, str]:
    """Weights, gradients and optimizer state per GPU, and the formula in bytes per parameter (docs/memory.md); ZeRO's
    are DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs` with Adam (`optim`: the recipe's, its states counted).
    FSDP2 too reduce-scatters every micro-batch."""
    p, t, n, L = shape.params, shape.trainable, world, shape.largest_layer
    # DeepSpeed and FSDP2 keep fp32 master weights and gradients (8 bytes) beside the optimizer's states, Adam's 8
    s = optimizer_state_bytes(optim, optim_args, 4)
    frozen, q = p - t, shape.quantized
    # QLoRA: the base's quantized weights take quantized_bytes each, not the bytes the formula gives every weight
    less = lambda w: int(q * (w - shape.quantized_bytes))  # noqa: E731
    said = lambda w: f" - {q:,} x ({w} - {shape.quantized_bytes:g})" if q else ""  # noqa: E731
    if engine.name == "zero2":
        sharded = 0 if engine.offload_optimizer else int((10 + s) * t / n)
        formula = f"2 x {p:,}{said(2)} + {10 + s:g} x {t:,} / {n} (DeepSpeed's ZeRO-2 estimate)"
        return BF16 * p - less(BF16) + sharded, formula
    if engine.name == "zero3":
        optimizer = 0 if engine.offload_optimizer else (8 + s) * t
        sharded = (0 if engine.offload_params else BF16 * p - less(BF16)) + optimizer
        formula = f"4 x {L:,} + (2 x {p:,}{said(2)} + {8 + s:g} x {t:,}) / {n} (DeepSpeed's ZeRO-3 estimate)"
        return 4 * L + int(sharded / n), formula
    w = shape.load_bytes  # the weights as loaded; the gradients and Adam's moments alike
    if engine.name == "fsdp2":
        if engine.offload_params:
            return 0, "0 (fsdp_offload_params: parameters, gradients and optimizer state on the CPU)"
        formula = f"({8 + s:g} x {t:,} + {w} x {frozen:,}{said(w)}) / {n}"
        return int(((8 + s) * t + w * frozen - less(w)) / n), formula
    copies = 3 if engine.name == "ddp" else 2  # weights and gradients; DDP also keeps the gradients in its buckets
    each = copies * w + optimizer_state_bytes(optim, optim_args, w)  # the optimizer's states in the weights' dtype
    return int(each * t + w * frozen - less(w)), f"{each:g} x {t:,} + {w} x {frozen:,}{said(w)}"


def reference_model_bytes(recipe, engine: Engine, shape: ModelShape, world: int) -> int:
    """A live reference model's weights per GPU (0 when cached, or with LoRA: the policy without its adapter), as TRL's
    `prepare_deepspeed` / `prepare_fsdp` hold it: sharded under ZeRO-3 and FSDP2; bf16 under DeepSpeed."""
    if not uses_live_reference(recipe) or recipe.model.use_peft:
        return 0
    per_param = BF16 if engine.deepspeed else shape.load_bytes
    shards = world if engine.shards_weights else 1
    return int(per_param * shape.params / shards)


def engine_buffer_bytes(engine: Engine, shape: ModelShape) -> int:
    """DeepSpeed's bf16 reduce buckets (two with overlap_comm under ZeRO-2); FSDP2's unsharded bf16 working set (the LM
    head, the layer computing and the one prefetched, the head's and a layer's gradients)."""
    if engine.deepspeed:
        bucket = engine.reduce_bucket if engine.reduce_bucket is not None else shape.hidden**2  # transformers' auto
        return bucket * BF16 * (2 if engine.name == "zero2" and engine.overlap_comm else 1)
    if engine.name == "fsdp2":
        layer_trainable = shape.decoder_layer if shape.trainable == shape.params else shape.trainable // shape.layers
        head_grad = shape.lm_head if shape.lm_head_trains else 0
        return BF16 * (shape.lm_head + 2 * shape.decoder_layer + head_grad + layer_trainable)
    return 0


# --- the plan ---


def gpu_memory(recipe) -> tuple[float | None, str]:
    """GPU memory in GiB: this machine's GPU when it has one, else the recipe's gpu_memory_gib."""
    given = recipe.project.gpu_memory_gib
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        note = f" (gpu_memory_gib {given} not used: CUDA_VISIBLE_DEVICES= plans for it)" if given else ""
        return props.total_memory / GIB, f"detected: {props.name}{note}"
    if given:
        return float(given), "gpu_memory_gib"
    return None, "unknown: no GPU on this machine and no gpu_memory_gib in the recipe, so nothing is checked"


def micro_batch(recipe) -> tuple[int | None, int | None, str]:
    """Tokens of one micro-batch per GPU, the widest row attention sees, and where the count comes from."""
    t, budget = recipe.training, recipe.project.max_tokens_per_microbatch
    if budget is not None:
        # Packed rows for dense-mask attention stay within row_width_bound (fill_rows); padded: a row per sequence.
        bound = row_width_bound(t.max_length) if t.padding_free else t.max_length
        width = min(budget, bound) if t.max_length else budget
        return budget, width, f"max_tokens_per_microbatch ({budget})"
    if t.max_length is None:
        return None, None, "max_length unset or auto: no bound on a micro-batch's tokens"
    tokens = t.per_device_train_batch_size * 2 * t.max_length
    width = min(tokens, row_width_bound(t.max_length)) if t.padding_free else t.max_length  # padded: a row per sequence
    return tokens, width, f"per_device_train_batch_size x 2 x max_length ({tokens})"


# A plan's parts as its record (`derived.memory`) and a refusal list them: (field, record key, refusal's name). A live
# reference model, autocast's copies and the all-to-all buffers are listed only where the run has them.
PARTS = (
    ("states", "model_states", "model states"),
    ("reference", "reference_model", "live reference model"),
    ("buffers", "engine_buffers", "buffers"),
    ("activations", "activations", "activations"),
    ("casts", "autocast_copies", "autocast copies"),
    ("lm_head", "lm_head", "LM head"),
    ("masks", "attention_masks", "masks"),
    ("all_to_all", "all_to_all", "all-to-all"),
    ("allowance", "cuda_context_and_fragmentation", "allowance"),
)


LISTED_WHERE_HELD = ("reference", "casts", "all_to_all")  # the parts named only where the run has them


@dataclass
class PerGpuBytes:
    """The plan's parts on one GPU, in bytes, for one checkpointing choice (recorded in GiB: `per_gpu_gib`)."""

    states: int
    buffers: int
    activations: int
    activations_method: str
    lm_head: int
    masks: int
    all_to_all: int = 0  # sequence parallelism's exchange buffers (`all_to_all_bytes`)
    reference: int = 0  # a live reference model's weights (`reference_model_bytes`)
    casts: int = 0  # float32 weights under autocast: the bf16 copies the layers keep (`autocast_copies`)

    @property
    def subtotal(self) -> int:
        return sum(getattr(self, field) for field, _, _ in PARTS if field != "allowance")

    def parts(self) -> list[tuple[str, str, float]]:
        """(record key, refusal's name, GiB) of each part listed (`PARTS`)."""
        listed = [(f, key, name) for f, key, name in PARTS if getattr(self, f) or f not in LISTED_WHERE_HELD]
        return [(key, name, _gib(getattr(self, f))) for f, key, name in listed]

    @property
    def allowance(self) -> float:
        return CONTEXT_GIB * GIB + FRAGMENTATION * self.subtotal

    @property
    def total(self) -> float:
        return self.subtotal + self.allowance


def held_copies(engine: Engine, shape: ModelShape, config, tokens: int, every: int | None) -> int:
    """autocast's bf16 copies (`autocast_copies`) where float32 weights compute under it: one process and DDP (DeepSpeed
    trains bf16 weights; FSDP2 computes from its unsharded bf16 working set, in the engine buffers). Every layer not
    checkpointed keeps its own to its backward; a checkpointed one only while it is recomputed, one at a time."""
    if engine.name not in ("single", "ddp") or shape.load_bytes != 4:
        return 0
    kept = checkpointed_layers(every, shape.layers)
    return (shape.layers - kept + (kept > 0)) * autocast_copies(config, tokens, shape.decoder_layer)


def all_to_all_bytes(config, tokens: int, n: int) -> int:
    """Ulysses' exchange per GPU (0 without it): q, k, v and the output in both layouts (1/N positions x all heads, all
    positions x 1/N heads), one layer at a time, bf16. Key/value heads fewer than N are repeated to N."""
    if n == 1:
        return 0
    heads, kv = head_counts(config)
    local = -(-tokens // n)
    # q, k and v (values padded to the queries' width: multi-head latent attention's are narrower) and the output
    return BF16 * local * query_width(config.get_text_config()) * (2 * (heads + 2 * max(kv, n)) + 2 * heads)


def plan(recipe, world: int, engine: Engine | None = None, attention: str | None = None, model=None) -> dict:
    """derived.memory for `engine`, else the recipe's accelerate config; a ConfigError where the GPU memory is known and
    the plan does not fit. `attention`: the forward's, else the recipe's, else sdpa. Sequence parallelism (N) splits
    activations and LM head N ways; masks stay whole. `model`: (config, why not) where the caller read it already."""
    engine = engine or from_config(recipe.project.accelerate_config)
    if engine.name == "unplanned":
        return {"skipped": engine.source}
    named = {"engine": f"{NAMES[engine.name]} ({engine.source})"}  # what the run summary shows, planned or not
    if not (recipe.training.bf16 or recipe.training.fp16):
        return {
            "skipped": "this recipe trains in fp32, and memory is planned for GPU runs in bf16 (bf16: true)",
            **named,
        }
    tokens, width, token_source = micro_batch(recipe)
    if tokens is None:
        return {"skipped": token_source, **named}
    config, why = model or model_config_or_reason(recipe)
    if config is None:
        return {"skipped": why, **named}
    shape = model_shape(recipe, config)
    attn = attention or recipe.model.attn_implementation or "sdpa"
    gpu, gpu_source = gpu_memory(recipe)
    n = recipe.project.sequence_parallel_size
    local = -(-tokens // n)  # the positions one GPU holds: the micro-batch padded to a multiple of N, split N ways

    optim = (recipe.training.optim, recipe.training.optim_args)  # these parts do not change with the checkpointing
    states, formula = model_state_bytes(engine, shape, world, *optim)
    buffers, head = engine_buffer_bytes(engine, shape), lm_head_bytes(shape, local)
    exchange, reference = all_to_all_bytes(config, tokens, n), reference_model_bytes(recipe, engine, shape, world)

    def per_gpu(every: int | None) -> PerGpuBytes:
        activations, method = activation_bytes(config, local, every or False)
        # eager keeps the probabilities of every layer not checkpointed: counted for all unless all are
        masks = mask_bytes(attn, tokens, width, config, every == 1)
        casts = held_copies(engine, shape, config, local, every)
        return PerGpuBytes(states, buffers, activations, method, head, masks, exchange, reference, casts)

    every, checkpointing_record = choose_checkpointing(recipe, shape.layers, gpu, lambda k: per_gpu(k).total)
    chosen = per_gpu(every)
    parts = {key: gib for key, _, gib in chosen.parts()} | {"total": _gib(chosen.total)}
    record = {
        **named,
        "world_size": world,
        "gpu_memory_gib": round(gpu, 1) if gpu else None,
        "gpu_memory_source": gpu_source,
        "gpus_per_node": node_size(engine),
        "fits": None if gpu is None else chosen.total <= gpu * GIB,
        "per_gpu_gib": parts,
        "model": {
            "parameters": shape.params,
            "trained_parameters": shape.trainable,
            "hidden_size": shape.hidden,
            "layers": shape.layers,
        },
        "model_states_bytes": formula,
        "micro_batch_tokens": tokens,
        "micro_batch_tokens_from": token_source,
        "activation_checkpointing": every is not None,
        "attention": attn,
    }
    if n > 1:
        record["sequence_parallel"] = {"size": n, "tokens_per_gpu": local, "data_parallel_size": world // n}
    record["activations_from"] = chosen.activations_method
    record["allowance"] = f"{CONTEXT_GIB:g} GiB CUDA context and NCCL + {FRAGMENTATION:.0%} of the rest"
    record["allocator"] = allocator()  # the allowance assumes expandable segments (EXPANDABLE)
    record["checkpointing"] = checkpointing_record  # which layers: layers.checkpointing_fields gives the run them
    if not uses_live_reference(recipe):  # the reference stage's micro-batch, in what this plan gives training's
        given = chosen.activations + chosen.lm_head + chosen.masks + chosen.all_to_all
        record["reference_multiple"] = forward_only_multiple(config, tokens, width, attn, every or False, n, given)
    if record["fits"] is False and recipe.project.memory_check:
        raise ConfigError(_refusal(recipe, engine, world, chosen, gpu, gpu_source, attention, config))
    return record


def splittable_heads(config, recipe) -> tuple[int, int] | None:
    """The heads a sequence-parallel group would split; None for a model no group runs (`model_problem`)."""
    t = recipe.training
    return None if model_problem(config, t.router_aux_loss_coef, t.activation_checkpointing) else head_counts(config)


# --- activation checkpointing, chosen per run ---


def checkpointing_request(recipe) -> tuple[int | None, bool]:
    """(every, explicit): `activation_checkpointing: false` or a given `every_n_layers` are honoured; `true` alone
    allows every layer, and the plan may checkpoint fewer."""
    t = recipe.training
    if not t.activation_checkpointing:
        return None, True
    kwargs = t.activation_checkpointing_kwargs or {}
    named = {"activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"} & recipe.given
    if named and "every_n_layers" in kwargs:
        every = kwargs["every_n_layers"]
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(
                f"activation_checkpointing_kwargs every_n_layers must be an integer >= 1 (got "
                f"{every!r}): 1 checkpoints every decoder layer, 2 every other one"
            )
        return every, True
    return 1, False


def describe_checkpointing(every: int | None, layers: int) -> str:
    kept = checkpointed_layers(every, layers)
    if kept == 0:
        return "none"
    if kept == layers:
        return f"all {layers} layers"
    return f"1 in {every} layers ({kept} of {layers}: layers 0, {every}, {2 * every}, ...)"


def choose_checkpointing(recipe, layers: int, gpu: float | None, total_for) -> tuple[int | None, dict]:
    """Every k-th decoder layer to checkpoint (None: none, 1: all), and its record. An explicit setting is kept; else
    the least recomputation whose `total_for(every)` fits the GPU (every layer where its memory is unknown)."""
    request, explicit = checkpointing_request(recipe)
    chosen, why = request, "the recipe (activation_checkpointing)"
    if explicit and request is not None:
        why = "the recipe (activation_checkpointing_kwargs every_n_layers)"
    elif not explicit and gpu is None:
        why = "the recipe: the GPU memory is unknown, so fewer checkpointed layers are not weighed"
    elif not explicit:
        candidates = {}  # fewest checkpointed layers first; for each count the largest k
        for every in [None, *range(layers, 0, -1)]:
            candidates.setdefault(checkpointed_layers(every, layers), every)
        # Stops at the first that fits: where none checkpointed fits, a checkpointed layer is never traced.
        fits = next((kept for kept, every in candidates.items() if total_for(every) <= gpu * GIB), None)
        chosen, why = candidates.get(fits, 1), "the memory plan: the least recomputation that fits"
        if fits is None:
            why = "the memory plan: nothing fits, so every layer (the least memory)"
        if chosen is not None:
            fewer = candidates[max(c for c in candidates if c < checkpointed_layers(chosen, layers))]
            why += f" ({describe_checkpointing(fewer, layers)} would need ~{_gib(total_for(fewer))} GiB)"
    kept = checkpointed_layers(chosen, layers)
    return chosen, {
        "layers": describe_checkpointing(chosen, layers),
        "every_n_layers": chosen,
        "checkpointed_layers": kept,
        "recomputed_forward": f"{kept / layers:.0%}",
        "chosen_by": why,
    }


def _gib(n: float) -> float:
    return round(n / GIB, 1)


def _refusal(recipe, e: Engine, world: int, chosen: PerGpuBytes, gpu: float, gpu_source: str, attention, config) -> str:
    """One line: what does not fit, by how much and in which part, and what would fit (`advice`, same model config)."""
    parts = ", ".join(f"{name} {gib}" for _, name, gib in chosen.parts())
    n = recipe.project.sequence_parallel_size
    on = plural(world, "GPU") + (f" (sequence_parallel_size {n})" if n > 1 else "")
    planned = functools.partial(plan, model=(config, None))
    options = advice(recipe, world, e, attention, gpu, planned, splittable_heads(config, recipe))
    return (
        f"memory plan: {NAMES[e.name]} on {on} needs ~{_gib(chosen.total)} GiB per GPU ({parts}), more than the "
        f"{gpu:.1f} GiB GPU ({gpu_source}): {options} (the plan is an estimate: --memory_check false runs anyway)"
    )
