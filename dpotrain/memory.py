"""Memory per GPU, planned before anything loads: does this recipe fit, under this engine, on this many GPUs?

A plan is the sum of these parts, per GPU (README "Memory plan"):
- model states: bf16 weights, gradients, fp32 master weights and Adam moments, as the engine holds and shards them.
  ZeRO-2 and ZeRO-3 are DeepSpeed's own estimates (`estimate_zero2/3_model_states_mem_needs`: tests check equality);
  FSDP2 as accelerate sets it up (fp32 sharded parameters, gradients and moments);
- what the engine gathers or buffers beside them (reduce buckets; FSDP2's unsharded layers);
- activations of one micro-batch: the backbone's forward and backward traced on fake tensors (shapes only: no memory,
  no compute) at the micro-batch's token count, with and without activation checkpointing as the recipe says;
- TRL's chunked LM head (`trl/trainer/utils.py`, `_CHUNKED_LOGPROB_CHUNK_SIZE`), which never builds the logits;
- dense attention masks, for sdpa and eager attention (FlashAttention's varlen kernel takes none, FlexAttention a block
  mask of a few MiB), for the attention of the forward the run takes (forwards/choice.py): a run plans once its forward
  is decided from the data, and first, before anything loads, for the lightest forward it could take;
- an allowance for the CUDA context, NCCL buffers and allocator fragmentation.
Parameter counts come from the model's config alone: the model is built on the meta device (no weights).
"""

import copy
import math
import warnings
from dataclasses import dataclass

from .builtin import PROJECT_ROOT
from .engine import LAUNCHED, Engine, from_config
from .errors import ConfigError

GIB = 2**30
# CUDA context (~0.5-1 GiB with torch's kernels loaded) plus NCCL communicator buffers (~1-2 GiB), per process.
CONTEXT_GIB = 3.0
# The caching allocator rarely packs tensors perfectly: 10% of everything else, a usual margin for long-sequence
# training (less with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).
FRAGMENTATION = 0.10
BF16 = 2

NAMES = {
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
    "fsdp2": "FSDP2",
    "ddp": "DDP",
    "single": "one process",
}
# The accelerate configs this project ships, one per engine: what a refusal tells the user to pass.
SHIPPED = {
    "zero2": "accelerate_config.yaml",
    "zero3": "configs/accelerate/zero3.yaml",
    "fsdp2": "configs/accelerate/fsdp2.yaml",
}
MAX_NODES = 16  # how far a refusal looks for a node count that fits


# --- the model, from its config only ---


@dataclass
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


def load_model_config(recipe):
    """The model's config from files on this machine (a folder, the HF cache, a built-in), or (None, why not)."""
    from transformers import AutoConfig

    from . import builtin

    name = recipe.model.model_name_or_path
    if builtin.is_builtin(name):
        from transformers import Olmo3Config

        key = name.removeprefix(builtin.BUILTIN_PREFIX)
        # The shape builtin.build_model gives it; its tokenizer (so the vocabulary) is 1024 tokens.
        return Olmo3Config(vocab_size=1024, **builtin.BUILTIN_MODELS[key]), None
    try:
        return AutoConfig.from_pretrained(name, revision=recipe.model.model_revision, local_files_only=True), None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, (
            f"the config of {name!r} is not on this machine ({first[:160]}); a dry run loads nothing from the "
            f"network: `python scripts/prefetch.py --config <recipe> --model_name_or_path {name}` fetches it"
        )


def model_shape(recipe, config) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    text = config.get_text_config()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
    decoder_layer = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    head = model.get_output_embeddings()
    lm_head = head.weight.numel() if head is not None else 0
    trainable, head_trains = params, True
    if recipe.model.use_peft:  # TRL wraps the model with this same config (dpotrain/trainer.py)
        from peft import get_peft_model
        from trl import get_peft_config

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, get_peft_config(recipe.model))
        params = sum(p.numel() for p in model.parameters())  # the base and the adapter
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        head_trains = head is not None and head.weight.requires_grad
    dtype = str(recipe.model.dtype or "float32").replace("torch.", "")
    load_bytes = 4 if dtype == "float32" else BF16
    return ModelShape(params, trainable, largest, decoder_layer, lm_head, head_trains, text.hidden_size,
                      text.num_hidden_layers, load_bytes)  # fmt: skip


# --- activations: the backbone traced on fake tensors ---

ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def activation_bytes(config, tokens: int, checkpointing: bool) -> tuple[int, str]:
    """Peak bytes of the backbone's forward + backward for one micro-batch of `tokens` tokens, and how they were found.

    Copies of the model with 1 and 2 layers are run on fake tensors (shapes only) at the real width and token count;
    their peaks, parameters and weight gradients left out (those are model states), give the cost of a layer (the
    slope: with activation checkpointing, its saved input) and of the rest (the embedding, one layer's recomputation
    and backward, the final norm); the model's cost is the rest + layers x slope. Attention layers are traced as full
    attention with no mask, the memory of FlashAttention and of sdpa's fused kernels; masks are counted apart
    (`mask_bytes`). Models with other layer kinds (linear attention, Mamba: their CPU reference kernels are neither
    what CUDA runs nor fast to trace) and models the trace fails on get `formula_activation_bytes`.
    """
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds - ATTENTION_TYPES:
        why = f"{'/'.join(sorted(kinds - ATTENTION_TYPES))} layers are not traced"
        return formula_activation_bytes(text, tokens, checkpointing), f"formula ({why})"
    try:
        one, two = (_traced_peak(config, n, tokens, checkpointing) for n in (1, 2))
    except Exception as e:  # noqa: BLE001 - any failure of the trace falls back to the documented formula
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}" if str(e) else type(e).__name__
        return formula_activation_bytes(text, tokens, checkpointing), f"formula (the trace failed: {reason})"
    layer = two - one
    return one - layer + text.num_hidden_layers * layer, "traced on fake tensors (1 and 2 layers, extrapolated)"


TRACE_ATTENTION = "dpotrain_memory_plan"


def _fused_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What FlashAttention and sdpa's fused kernels keep for backward: q, k, v, the output and its log-sum-exp; no
    mask and no repeated k/v for grouped-query attention. transformers builds a dense mask whenever it sees fake
    tensors (it takes them for a compiler's tracing), so the trace registers this attention with no mask instead."""
    import torch.nn.functional as F

    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register_trace_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(TRACE_ATTENTION, _fused_attention)
    AttentionMaskInterface.register(TRACE_ATTENTION, flash_attention_mask)  # no mask without padding


def _traced_peak(config, layers: int, tokens: int, checkpointing: bool) -> int:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from transformers import AutoModelForCausalLM

    register_trace_attention()
    config = copy.deepcopy(config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):  # sliding windows and chunks only change the mask, which is not traced
        text.layer_types = ["full_attention"] * layers
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=TRACE_ATTENTION)
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for p in model.parameters():  # the engine takes each weight gradient away as soon as it exists
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        ids = torch.zeros(1, tokens, dtype=torch.long)
        positions = torch.arange(tokens)[None]
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            hidden = model.base_model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            hidden.backward(torch.ones_like(hidden))
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return peak["Total"] - peak[_MemRefType.PARAM]


def formula_activation_bytes(text, tokens: int, checkpointing: bool) -> int:
    """Llama-shaped layer in bf16, when no trace is possible: per token, 2 x (10 H + 2 H_kv + 4 I) bytes saved per
    layer (norms in fp32, q/k/v, attention output, the MLP's four I-wide tensors); with activation checkpointing each
    layer keeps only its input (2 H) and one layer is recomputed with its gradients (2 x that)."""
    h = text.hidden_size
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    h_kv = kv * (getattr(text, "head_dim", None) or h // text.num_attention_heads)
    inner = getattr(text, "moe_intermediate_size", None)
    inner = inner * getattr(text, "num_experts_per_tok", 1) if inner else getattr(text, "intermediate_size", 4 * h)
    per_layer = BF16 * (10 * h + 2 * h_kv + 4 * inner)
    if checkpointing:
        return tokens * (text.num_hidden_layers * BF16 * h + 2 * per_layer)
    return tokens * (text.num_hidden_layers + 1) * per_layer


def mask_bytes(attn_implementation: str, tokens: int, width: int, config, checkpointing: bool) -> int:
    """sdpa and eager build a dense mask per micro-batch row and layer kind (rows x width^2 = tokens x width: bool for
    sdpa, bf16 for eager). On CUDA, sdpa's fused kernels take a float mask: PyTorch converts the boolean one to the
    query's dtype at each call (a bf16 copy, one at a time: measured, tests/test_memory.py). Eager also keeps each
    layer's attention probabilities (its fp32 softmax and a bf16 copy), of one layer at a time under activation
    checkpointing."""
    from .forwards.masks import BLOCK
    from .packing import VARLEN_ATTENTION

    if attn_implementation in VARLEN_ATTENTION:
        return 0
    text = config.get_text_config()
    kinds = len(set(getattr(text, "layer_types", None) or ["full_attention"]) & ATTENTION_TYPES) or 1
    if attn_implementation == "flex_attention":  # per kind, a BlockMask's int32 tables (partial and full, kv and q)
        return kinds * 4 * 4 * math.ceil(tokens / BLOCK) ** 2
    if attn_implementation != "eager":
        return tokens * width * (kinds + BF16)
    layers = 1 if checkpointing else text.num_hidden_layers
    return tokens * width * (kinds * BF16 + text.num_attention_heads * (4 + BF16) * layers)


def lm_head_bytes(shape: ModelShape, tokens: int) -> int:
    """TRL's fused LM head (`trl.kernels.ChunkedLogProbFunction`): the scored hidden rows (a bf16 copy, saved) and
    their fp32 gradient, one [TOKEN_CHUNK_SIZE x _CHUNKED_LOGPROB_CHUNK_SIZE] logits tile, fp32 running statistics,
    and, when the head trains, its weight gradient accumulated in fp32 and cast to bf16. Every token counted as scored
    (only completion tokens are, on CUDA)."""
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    tile = min(tokens, TOKEN_CHUNK_SIZE) * _CHUNKED_LOGPROB_CHUNK_SIZE * BF16
    per_token = shape.hidden * (BF16 + 4) + 12 * 4
    weight_grad = shape.lm_head * (4 + BF16) if shape.lm_head_trains else 0
    return tile + tokens * per_token + weight_grad


# --- the engines ---


def model_state_bytes(engine: Engine, shape: ModelShape, world: int) -> tuple[int, str]:
    """Weights, gradients and optimizer state per GPU, and the formula in bytes per parameter.

    ZeRO-2 / ZeRO-3 are DeepSpeed's `estimate_zero{2,3}_model_states_mem_needs` (tests/test_memory.py): ZeRO-2 keeps
    the bf16 weights whole (2 P) and shards 18 bytes per trained parameter (bf16 + fp32 gradients, fp32 master,
    Adam's two moments); ZeRO-3 shards everything (2 P + 16 per trained parameter, DeepSpeed's 18 at full
    fine-tuning) and adds 4 bytes x the largest layer for the parameters it gathers. FSDP2 under accelerate keeps
    trained parameters in fp32 (4), their gradients in fp32 (4) and Adam's moments (8), all sharded; frozen ones
    (LoRA's base) as loaded. One process or DDP: everything whole, Adam's moments in the weights' dtype.

    Between a step's micro-batches each engine holds its gradients as counted here: ZeRO-2 its bf16 gradient
    partition (`grads_in_partition`, the 2 of DeepSpeed's 18; the fp32 copy, 4 more, exists at the step), ZeRO-3 its
    fp32 gradient partition (`grad_partitions_flat_buffer`, 4 of the 16), FSDP2 its fp32 sharded gradients (4 of the
    16): it reduce-scatters every micro-batch (`Engine.defers_gradient_sync`) instead of keeping every layer's
    unsharded bf16 gradient, which would add 2 bytes x parameters per GPU. DDP keeps its full gradients anyway.
    """
    p, t, n, L = shape.params, shape.trainable, world, shape.largest_layer
    frozen = p - t
    if engine.name == "zero2":
        sharded = 0 if engine.offload_optimizer else int(18 * t / n)
        return BF16 * p + sharded, f"2 x {p:,} + 18 x {t:,} / {n} (DeepSpeed's ZeRO-2 estimate)"
    if engine.name == "zero3":
        sharded = (0 if engine.offload_params else BF16 * p) + (0 if engine.offload_optimizer else 16 * t)
        return 4 * L + int(sharded / n), f"4 x {L:,} + (2 x {p:,} + 16 x {t:,}) / {n} (DeepSpeed's ZeRO-3 estimate)"
    if engine.name == "fsdp2":
        if engine.offload_params:
            return 0, "0 (fsdp_offload_params: parameters, gradients and optimizer state on the CPU)"
        formula = f"(16 x {t:,} + {shape.load_bytes} x {frozen:,}) / {n}"
        return int((16 * t + shape.load_bytes * frozen) / n), formula
    w = shape.load_bytes  # the weights as loaded; the gradients and Adam's moments alike
    copies = 5 if engine.name == "ddp" else 4  # DDP also keeps a copy of the gradients in its buckets
    return copies * w * t + w * frozen, f"{copies} x {w} x {t:,} + {w} x {frozen:,}"


def engine_buffer_bytes(engine: Engine, shape: ModelShape) -> int:
    """Beside the model states: DeepSpeed's reduce buckets (bf16, kept between micro-batches; two with overlap_comm
    under ZeRO-2), FSDP2's unsharded bf16 working set (the LM head kept from forward to backward, the layer computing
    and the one prefetched, and the unsharded gradients of the head and of one layer before their reduce-scatter)."""
    if engine.name in ("zero2", "zero3"):
        bucket = engine.reduce_bucket if engine.reduce_bucket is not None else shape.hidden**2  # transformers' auto
        return bucket * BF16 * (2 if engine.name == "zero2" and engine.overlap_comm else 1)
    if engine.name == "fsdp2":
        layer_trainable = shape.decoder_layer if shape.trainable == shape.params else shape.trainable // shape.layers
        head_grad = shape.lm_head if shape.lm_head_trains else 0
        return BF16 * (shape.lm_head + 2 * shape.decoder_layer + head_grad + layer_trainable)
    return 0


# --- the plan ---


def gpu_memory(recipe) -> tuple[float | None, str]:
    """GPU memory in GiB: the GPU of this machine when it has one (the job's first node, in scripts/launch.sh), else
    the recipe's gpu_memory_gib."""
    import torch

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
    from .packing import row_width_bound

    t, budget = recipe.training, recipe.project.max_tokens_per_microbatch
    if budget is not None:  # packed rows for dense-mask attention: fill_rows keeps them within row_width_bound
        width = min(budget, row_width_bound(t.max_length)) if t.max_length else budget
        return budget, width, f"max_tokens_per_microbatch ({budget})"
    if t.max_length is None:
        return None, None, "max_length unset or auto: no bound on a micro-batch's tokens"
    tokens = t.per_device_train_batch_size * 2 * t.max_length
    width = min(tokens, row_width_bound(t.max_length)) if t.padding_free else t.max_length  # padded: a row per sequence
    return tokens, width, f"per_device_train_batch_size x 2 x max_length ({tokens})"


@dataclass
class Plan:
    engine: Engine
    world: int
    states: int
    states_formula: str
    buffers: int
    activations: int
    activations_method: str
    lm_head: int
    masks: int

    @property
    def subtotal(self) -> int:
        return self.states + self.buffers + self.activations + self.lm_head + self.masks

    @property
    def allowance(self) -> float:
        return CONTEXT_GIB * GIB + FRAGMENTATION * self.subtotal

    @property
    def total(self) -> float:
        return self.subtotal + self.allowance


def plan(recipe, world: int, engine: Engine | None = None, attention: str | None = None) -> dict:
    """derived.memory: for `engine`, else the recipe's accelerate config (a dry run); a ConfigError when the GPU memory
    is known and the plan does not fit it. `attention`: the forward's attention implementation (its masks), else the
    recipe's (which `forwards.choice.decide_forward` sets to the one chosen), else sdpa."""
    engine = engine or from_config(recipe.project.accelerate_config)
    if engine.name == "unplanned":
        return {"skipped": engine.source}
    if not (recipe.training.bf16 or recipe.training.fp16):
        return {"skipped": "planned for bf16 mixed precision (bf16: true), as on GPUs; this recipe trains in fp32"}
    tokens, width, token_source = micro_batch(recipe)
    if tokens is None:
        return {"skipped": token_source}
    config, why = load_model_config(recipe)
    if config is None:
        return {"skipped": why}
    shape = model_shape(recipe, config)
    checkpointing = bool(recipe.training.activation_checkpointing)
    activations, method = activation_bytes(config, tokens, checkpointing)
    attn = attention or recipe.model.attn_implementation or "sdpa"
    common = dict(activations=activations, activations_method=method, lm_head=lm_head_bytes(shape, tokens),
                  masks=mask_bytes(attn, tokens, width, config, checkpointing))  # fmt: skip

    def for_engine(e: Engine, n: int) -> Plan:
        states, formula = model_state_bytes(e, shape, n)
        return Plan(e, n, states, formula, engine_buffer_bytes(e, shape), **common)

    chosen = for_engine(engine, world)
    gpu, gpu_source = gpu_memory(recipe)
    record = {
        "engine": f"{NAMES[engine.name]} ({engine.source})",
        "world_size": world,
        "gpu_memory_gib": round(gpu, 1) if gpu else None,
        "gpu_memory_source": gpu_source,
        "fits": None if gpu is None else chosen.total <= gpu * GIB,
        "per_gpu_gib": {
            "model_states": _gib(chosen.states),
            "engine_buffers": _gib(chosen.buffers),
            "activations": _gib(chosen.activations),
            "lm_head": _gib(chosen.lm_head),
            "attention_masks": _gib(chosen.masks),
            "cuda_context_and_fragmentation": _gib(chosen.allowance),
            "total": _gib(chosen.total),
        },
        "model": {
            "parameters": shape.params,
            "trained_parameters": shape.trainable,
            "hidden_size": shape.hidden,
            "layers": shape.layers,
        },
        "model_states_bytes": chosen.states_formula,
        "micro_batch_tokens": tokens,
        "micro_batch_tokens_from": token_source,
        "activation_checkpointing": checkpointing,
        "attention": attn,
        "activations_from": method,
        "allowance": f"{CONTEXT_GIB:g} GiB CUDA context and NCCL + {FRAGMENTATION:.0%} of the rest",
    }
    if record["fits"] is False and recipe.project.memory_check:
        raise ConfigError(_refusal(recipe, chosen, gpu, gpu_source, for_engine, tokens))
    return record


def _gib(n: float) -> float:
    return round(n / GIB, 1)


def _refusal(recipe, chosen: Plan, gpu: float, gpu_source: str, for_engine, tokens: int) -> str:
    """One line: what does not fit, by how much and in which part, and what would fit."""
    e, world = chosen.engine, chosen.world
    per_node = e.gpus_per_node if e.gpus_per_node > 1 else 4  # one process planned: nodes of 4 GPUs suggested
    pairs = recipe.project.pairs_per_step or math.inf
    options = []
    for kind in ("zero2", "zero3", "fsdp2"):
        alternative = e if kind == e.name else from_config(str(PROJECT_ROOT / SHIPPED[kind]))
        for nodes in range(1, MAX_NODES + 1):
            n = nodes * per_node
            if n > pairs:  # each process needs a pair per step
                break
            if (kind, n) != (e.name, world) and for_engine(alternative, n).total <= gpu * GIB:
                launched = e.source.startswith(LAUNCHED)  # the config file is not known: name the shipped one
                config = recipe.project.accelerate_config if kind == e.name and not launched else SHIPPED[kind]
                launch = f"ACCELERATE_CONFIG={config} sbatch --nodes={nodes}"
                options.append(f"{NAMES[kind]} fits on {n} GPUs ({nodes} node{'s' * (nodes > 1)}: {launch})")
                break
    # The same engine and GPUs with fewer tokens per micro-batch: everything but the model states and buffers, and
    # the context, scales with the tokens.
    fixed = (chosen.states + chosen.buffers) * (1 + FRAGMENTATION) + CONTEXT_GIB * GIB
    per_token = (chosen.activations + chosen.lm_head + chosen.masks) * (1 + FRAGMENTATION) / tokens
    most = int((gpu * GIB - fixed) / per_token) // 1024 * 1024 if gpu * GIB > fixed else 0
    floor = 2 * (recipe.training.max_length or 0)
    if recipe.project.max_tokens_per_microbatch is not None and most >= max(floor, 1024):
        options.append(f"max_tokens_per_microbatch {most} fits on these {world} GPUs")
    parts = (f"model states {_gib(chosen.states)}, buffers {_gib(chosen.buffers)}, activations "
             f"{_gib(chosen.activations)}, LM head {_gib(chosen.lm_head)}, masks {_gib(chosen.masks)}, allowance "
             f"{_gib(chosen.allowance)}")  # fmt: skip
    if not options:
        options.append(f"nothing shipped fits on up to {MAX_NODES} nodes: train a LoRA adapter (--use_peft true) or "
                       "lower max_length")  # fmt: skip
    return (f"memory plan: {NAMES[e.name]} on {world} GPU{'s' * (world > 1)} needs ~{_gib(chosen.total)} GiB per GPU "
            f"({parts}), more than the {gpu:.1f} GiB GPU ({gpu_source}): {'; '.join(options)} (the plan is an "
            "estimate: --memory_check false runs anyway)")  # fmt: skip
