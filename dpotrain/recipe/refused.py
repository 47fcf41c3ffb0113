"""The TRL and transformers fields a run refuses, each with why and the fix: the refusal says these words, and --help
and --help-all give them as the field's help (`help_words`, set by config.make_parser), so that no help line describes
a refused field as working."""

from dpotrain.recipe.init_kwargs import DECIDED_INIT_KWARGS, SECRET_INIT_KWARGS

_EVAL_CAST = (
    "transformers casts the model only for an evaluation outside training; this run evaluates during training, in "
    "its precision (bf16, fp16)"
)
_NO_METRICS = (
    "it feeds a compute_metrics function, and the run has none: evaluation logs eval_loss and the reward metrics"
)
# TrainingArguments fields read only by code this project replaces (Trainer.compute_loss, its data loaders, evaluation
# outside training, its stop on SIGTERM), each with what the run does instead.
UNREAD = {
    "label_smoothing_factor": "transformers' label smoother runs in Trainer.compute_loss, which DPO's loss replaces",
    "average_tokens_across_devices": (
        "each step's gradient is the mean over all of its pairs, on every process (the trainer weighs each "
        "micro-batch by its share of the step)"
    ),
    "auto_find_batch_size": "the step plan's micro-batches are fixed before the model loads, and the memory plan "
    "checks that they fit",
    "dataloader_drop_last": "the step plan trains every pair of an epoch (a short last step joins the one before it)",
    "dataloader_in_order": "the step plan's loader yields its steps in the plan's order",
    "remove_unused_columns": "the step plan's loader hands the collator the tokenized pairs' own columns, whatever it "
    "says (transformers' column filter runs in its loader, which this one replaces)",
    "dataloader_multiprocessing_context": "the step plan's loader starts its workers in torch's default context",
    "bf16_full_eval": _EVAL_CAST,
    "fp16_full_eval": _EVAL_CAST,
    "include_for_metrics": _NO_METRICS,
    "batch_eval_metrics": _NO_METRICS,
    "length_column_name": "only train_sampling_strategy group_by_length reads it, which is refused here",
    "enable_jit_checkpoint": "the run saves a checkpoint on SIGTERM itself, at a step's end, and exits to be "
    "requeued (docs/reliability.md)",
    "do_predict": "this script trains (and evaluates with eval_strategy); it predicts nothing",
    "label_names": "only transformers' own prediction step and column filter read it, and TRL's DPO trainer "
    "replaces both (a pair's labels are its completions)",
    "precompute_ref_batch_size": "the reference stage cuts its own micro-batches, by tokens, from training's budget "
    "(docs/reference.md)",
}
# What to do instead of an UNREAD field, where there is something.
INSTEAD = {
    "label_smoothing_factor": "for DPO's own smoothing (cDPO, robust DPO) pass --label_smoothing {value} with a loss "
    "type that reads it (robust, exo_pair: docs/losses.md)",
    "auto_find_batch_size": "for less memory per step lower per_device_train_batch_size or max_tokens_per_microbatch "
    "(docs/memory.md)",
}

# Said whether transformers' own check of the option or the run's sees it first
LOAD_BEST_REFUSED = (
    "load_best_model_at_end would save the best checkpoint's weights as the final model, while its model "
    "card, run_complete.json and push describe the last step: remove it (every checkpoint-N is a complete "
    "model: pick one by eval_loss in metrics.jsonl)"
)

# Fields typed as objects that argparse cannot build from words: any value stopped in "invalid dict value".
UNSETTABLE = {
    "liger_kernel_config": "use_liger_kernel runs liger-kernel's kernels with their defaults: "
    "remove liger_kernel_config",
    "parallelism_config": "the accelerate config (accelerate_config: ZeRO-2/3, FSDP2 or DDP) and "
    "sequence_parallel_size split the run over the GPUs: remove parallelism_config",
}
# Fields refused at any value but their default (options.check), each with why and the fix
NOT_DEFAULT = {
    "save_on_each_node": "is not supported: checkpoints, their COMPLETE marks and the resume point live once in "
    "output_dir, which every node must see (a shared file system): remove save_on_each_node",
    "ignore_bias_buffers": "is a DDP workaround of TRL's own script that this project does not apply (it launches "
    "with DeepSpeed): remove it",
    # transformers counts the micro-batch's `input_ids`, which this project's micro-batches (pairs) do not hold
    "include_num_input_tokens_seen": "would log num_input_tokens_seen 0 (and train_tokens_per_second 0.0) at every "
    "step: the run logs the tokens it trains itself (num_tokens, tokens_per_second in metrics.jsonl): remove "
    "include_num_input_tokens_seen",
    # also under save_strategy no: a stop request still saves a checkpoint, then promises it
    "save_only_model": "writes checkpoints without the optimizer, scheduler and RNG state, which a resume needs: a "
    "stopped, preempted or requeued run could not go on from any of them (its rerun is refused): remove "
    "save_only_model (to use less disk, lower --save_total_limit)",
    "ignore_data_skip": "makes a resumed run train its epoch's first batches again instead of those after its "
    "checkpoint (some pairs trained twice, others never; a resume is exact here): remove ignore_data_skip",
}
# train_sampling_strategy other than random (options.check; group_by_length is refused first, for its own reason)
SAMPLER = (
    "the step plan draws each epoch's pairs in its own seeded random order (data_seed, else seed), whatever the "
    "sampler: remove it"
)
# With push_to_hub (hub.take_push_settings): transformers' hub_strategy other than end (every_save only untyped, as its
# default), and hub_revision
HUB_STRATEGY = (
    "is transformers' push at every save (with 'checkpoint', of the optimizer state too), which this project "
    "replaces: drop hub_strategy. The final model is pushed once training ends; push_checkpoints: true pushes each "
    "checkpoint's model to a branch step-<N>"
)
HUB_REVISION = (
    "is not supported: the final model goes to main and checkpoints (push_checkpoints: true) to branches step-<N>; "
    "drop hub_revision"
)
# TrainingArguments' own switches to DeepSpeed and FSDP, and FSDP's settings (options.check_engine_switches)
ENGINE_SWITCHES = (
    "is not how this project selects its engine (the plan and the record would name another): remove it and launch "
    "with an accelerate config (DeepSpeed ZeRO-2: accelerate_config.yaml, which names its DeepSpeed file as "
    "deepspeed_config_file; ZeRO-3, FSDP2: configs/accelerate/): `accelerate launch --config_file <it> train_dpo.py "
    "...`, and --accelerate_config <it> for a dry run"
)
FSDP_CONFIG = (
    "would be ignored: transformers reads it only with --fsdp, which is not how this project selects its engine: "
    "remove it, and give FSDP2's settings in its accelerate config (configs/accelerate/fsdp2.yaml's fsdp_config:)"
)


_OWN_LOADER = "the step plan's loader gives each process its own steps of pairs_per_step pairs, which accelerate's "
# accelerator_config keys at other values than their defaults (options.check_unread): each key's default and why
ACCELERATOR_UNREAD = {
    "split_batches": (False, _OWN_LOADER + "loader does not split again"),
    "dispatch_batches": (None, _OWN_LOADER + "loader does not dispatch from the first process"),
    "even_batches": (True, _OWN_LOADER + "loader does not even out (every process has a share of every step)"),
    "use_seedable_sampler": (True, _OWN_LOADER + "sampler does not replace (their order is the seed's)"),
    "gradient_accumulation_kwargs": (
        None,
        "the trainer runs each step's micro-batches itself (max_tokens_per_microbatch or gradient_accumulation_steps)",
    ),
}
EVAL_ONLY_WORDS = (
    "is only used for evaluation, and eval_strategy is no: add --eval_strategy steps --eval_steps N (held-out pairs: "
    "`eval_datasets:`, or the data set's test split), or remove {name}"
)
# TrainingArguments fields only an evaluation reads, at any value (the first two judge the best checkpoint)
EVAL_ONLY = """metric_for_best_model greater_is_better per_device_eval_batch_size eval_accumulation_steps eval_delay
eval_do_concat_batches eval_use_gather_object prediction_loss_only""".split()
TRACKIO_FIELDS = ("project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")
# A feature's switch, what its being off means, how to turn it on, and the settings read only while it is on (set
# while it is off, they would be recorded and never read: options.check_switched_off)
SWITCHED_SETTINGS = (
    (
        "samples_every",
        "0, so no sample is generated",
        "samples_every (e.g. 50)",
        ("sample_prompts", "sample_prompts_file", "sample_count", "sample_max_new_tokens", "sample_repetition_warn"),
    ),
    (
        "health_checks",
        "false, so no health guard runs",
        "health_checks true",
        ("health_action", "health_step1_tolerance", "health_loss_floor", "health_max_margin", "health_logp_drop")
        + ("health_pinned_pairs", "health_early_fraction"),
    ),
)
SWITCHED_OFF = "is set but {switch} is {off}: set {fix} or remove {name}"
# ModelConfig fields that only mean something with use_peft (TRL ignores them silently otherwise: train/lora.py)
LORA_FIELDS = (
    "lora_r lora_alpha lora_dropout lora_target_modules lora_target_parameters lora_modules_to_save lora_task_type "
    "use_rslora use_dora"
).split()
QUANTIZATION_FIELDS = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
_PACKED = "padding_free true (the default)"
# Fields refused in a combination: key -> (the field, when it is refused, what the refusal says after the field's name
# and value, the help's stand-ins for the values that words names). options.py and train/losses.py raise
# `<field> [<value>] {said(key, ...)}`; --help-all adds `Refused <when>: <field> <words>` to the field's own help.
COMBINED = {
    "sync_with_peft": (
        "sync_ref_model",
        "with use_peft",
        "does not work with use_peft (the reference is the base with the adapter disabled): remove one of them",
        {},
    ),
    "reference_only_live": (
        "reference_only",
        "with a live reference (precompute_ref_log_probs false, or sync_ref_model)",
        "runs the reference stage alone, and this run has none (a live reference model runs beside every step: "
        "precompute_ref_log_probs false or sync_ref_model): remove --reference_only",
        {},
    ),
    "sync_with_precomputed": (
        "sync_ref_model",
        "with precompute_ref_log_probs true",
        "updates the reference, so its log-probs cannot be precomputed: pass --precompute_ref_log_probs false, or "
        "remove --sync_ref_model",
        {},
    ),
    "persistent_workers": (
        "dataloader_persistent_workers",
        "with dataloader_num_workers 0 (the default)",
        "would be ignored: it keeps the loader's worker processes between epochs, and dataloader_num_workers is 0 (the "
        "main process reads the pairs): remove it, or pass --dataloader_num_workers N",
        {},
    ),
    "optim_target_modules": (
        "optim_target_modules",
        "unless optim is a galore_* or apollo_* one",
        "would be ignored: optim {optim} trains every parameter as it is (only the galore_* and apollo_* optims read "
        "it): remove optim_target_modules, or choose one of them",
        {"optim": "<optim>"},
    ),
    "do_train": (
        "do_train",
        "given as false",
        "would be ignored: the script always trains: remove it (--dry-run checks and plans the run without training; "
        "--reference_only runs the reference stage alone)",
        {},
    ),
    "liger": (
        "use_liger_kernel",
        "without the liger-kernel package",
        "needs the liger-kernel package, which this project does not install: remove --use_liger_kernel",
        {},
    ),
    "checkpointing_kwargs": (
        "activation_checkpointing_kwargs",
        "with activation_checkpointing false",
        "is set but activation_checkpointing is false, so no layer is checkpointed: set activation_checkpointing true "
        "or remove activation_checkpointing_kwargs",
        {},
    ),
    "epochs_under_max_steps": (
        "num_train_epochs",
        "typed alone under a recipe's max_steps",
        "would be ignored: the recipe's max_steps {steps} wins over it (as in transformers): add --max_steps -1 to "
        "train {epochs} epochs, or remove --num_train_epochs",
        {"steps": "N", "epochs": "that many"},
    ),
    "auto_coverage": (
        "auto_coverage",
        "typed without max_length auto",
        "is set but max_length is {length}, not auto, so nothing reads it: add --max_length auto (the smallest length "
        "leaving that share of pairs whole), or remove auto_coverage",
        {"length": "a number"},
    ),
    "dataset_test_split": (
        "dataset_test_split",
        "given without eval_strategy",
        "is only used for evaluation: add --eval_strategy steps --eval_steps N, or remove dataset_test_split",
        {},
    ),
    "init_secret": (
        "model_init_kwargs",
        f"with a token ({', '.join(SECRET_INIT_KWARGS)})",
        "{key!r} would be recorded with the run (resolved_config.json, each checkpoint's training_args.bin): give the "
        "token as HF_TOKEN (.env, the environment) or `hf auth login`, and remove {key!r} from model_init_kwargs",
        {"key": "token"},
    ),
    "init_decided": (
        "model_init_kwargs",
        f"with a key the run decides from its own field ({', '.join(DECIDED_INIT_KWARGS)})",
        "{key!r} would override {field}, which the run plans and records by: give --{field} {value} instead, and "
        "remove {key!r} from model_init_kwargs",
        {"key": "<key>", "field": "<its field>", "value": "<value>"},
    ),
    "greater_is_better": (
        "greater_is_better",
        "without metric_for_best_model",
        "would be ignored: it says which way metric_for_best_model improves, and the run has none: add "
        "--metric_for_best_model eval_loss, or remove greater_is_better",
        {},
    ),
    "eval_steps": (
        "eval_steps",
        "with eval_strategy epoch",
        "would be ignored: eval_strategy epoch evaluates at each epoch's end: remove eval_steps, or pass "
        "--eval_strategy steps",
        {},
    ),
    "save_steps": (
        "save_steps",
        "with save_strategy epoch or best",
        "would be ignored: save_strategy {strategy} does not save by steps: remove save_steps, or pass "
        "--save_strategy steps",
        {"strategy": "epoch (or best)"},
    ),
    "logging_steps": (
        "logging_steps",
        "with logging_strategy epoch",
        "would be ignored: logging_strategy epoch does not log by steps: remove logging_steps, or pass "
        "--logging_strategy steps",
        {},
    ),
    "optim_args": (
        "optim_args",
        "with an optim that reads none of it (AdamW's)",
        "would be ignored: optim {optim} reads none of it: remove optim_args{adam}, or choose an optim that reads it",
        {"optim": "<optim>", "adam": ""},
    ),
    "optim_args_keys": (
        "optim_args",
        "with a key its optim does not read",
        "{value}: optim {optim} does not read {keys}, which would be ignored: remove {them} (a misspelt name?)",
        {"value": "'<key>=<value>'", "keys": "<key>", "optim": "<optim>", "them": "it"},
    ),
    "label_smoothing": (
        "label_smoothing",
        "with a loss type that does not read it",
        "would be ignored: TRL's {loss} loss does not read it (only exo_pair, robust, aot and aot_unpaired do; "
        "open-instruct's dpo_norm smooths, TRL's sigmoid_norm does not): remove label_smoothing, or choose one of "
        "those loss types",
        {"loss": "<loss_type>"},
    ),
    "f_divergence_applies": (
        "f_divergence_type",
        "other than reverse_kl, with a loss type it does not apply to",
        "does not apply to loss_type {other} (TRL defines it for {allowed}): remove f_divergence_type, or choose one "
        "of those loss types",
        {"other": "<loss_type>", "allowed": "the loss types its help names"},
    ),
    "f_divergence_sft": (
        "f_divergence_type",
        "other than reverse_kl, with loss_type sft alone",
        "would be ignored: loss_type sft does not compare log-ratios: remove f_divergence_type, or add a DPO loss type",
        {},
    ),
    "f_alpha_divergence_coef": (
        "f_alpha_divergence_coef",
        "without f_divergence_type alpha_divergence",
        "would be ignored: it is read only with --f_divergence_type alpha_divergence: add that, or remove "
        "f_alpha_divergence_coef",
        {},
    ),
    "discopop_tau": (
        "discopop_tau",
        "without loss_type discopop",
        "would be ignored: only loss_type discopop reads it: remove discopop_tau, or add discopop to loss_type",
        {},
    ),
    "ld_alpha": (
        "ld_alpha",
        "with loss_type sft alone",
        "would be ignored: loss_type sft alone averages the chosen tokens' NLL, which LD-DPO does not weigh: remove "
        "ld_alpha, or add a DPO loss type",
        {},
    ),
    "weighting_sft": (
        "use_weighting",
        "with loss_type sft",
        "with loss_type sft: TRL scales the SFT term by the micro-batch's mean WPO weight, which changes with how a "
        "step is cut into micro-batches and processes: remove use_weighting, or sft",
        {},
    ),
    "weighting_sorted": (
        "use_weighting",
        "with loss_type aot or aot_unpaired",
        "with loss_type {losses}: TRL does not implement WPO's weights for losses that sort the micro-batch's pairs: "
        "remove use_weighting, or choose another loss type",
        {"losses": "aot/aot_unpaired"},
    ),
    "health_loss_floor": (
        "health_loss_floor",
        "with a loss type that is 0 at a finite margin (hinge, ipo, sppo_hard, exo_pair, robust)",
        "would be ignored: loss_type {reaching} is 0 at a finite margin by design (its optimum, not a collapse), so "
        "the loss_floor guard does not judge it: remove health_loss_floor (the margin and logps_falling guards still "
        "watch)",
        {"reaching": "<loss_type>"},
    ),
    **{
        name: (
            name,
            "without sync_ref_model",
            "would be ignored: it is read only with --sync_ref_model true (TR-DPO): add that, or remove {name}",
            {"name": name},
        )
        for name in ("ref_model_mixup_alpha", "ref_model_sync_steps")
    },
    # LoRA's settings without LoRA, and what the adapter does not train with (train/lora.check_lora)
    **{
        f"{name}_no_peft": (
            name,
            "with use_peft false",
            "is set but use_peft is false, so it would be ignored: add --use_peft true to train a LoRA adapter, or "
            "remove {name}",
            {"name": name},
        )
        for name in (*LORA_FIELDS, "merge_lora")
    },
    "lora_task_type": (
        "lora_task_type",
        "unless CAUSAL_LM (the default)",
        "{task}: DPO trains a causal language model's adapter (CAUSAL_LM, the default): remove lora_task_type",
        {"task": "<task>"},
    ),
    "lora_dropout_disabled": (
        "lora_dropout",
        "above 0 with disable_dropout true (the default)",
        "would be ignored: disable_dropout (true by default) sets every dropout to 0 once PEFT has wrapped the "
        "model, the adapter's too; add --disable_dropout false to train with it, or remove lora_dropout",
        {},
    ),
    **{
        f"{name}_unquantized": (
            name,
            "without load_in_4bit",
            "only applies with --load_in_4bit true: add it, or remove {name}",
            {"name": name},
        )
        for name in QUANTIZATION_FIELDS
    },
    **{
        f"{name}_no_peft": (
            name,
            "with use_peft false",
            "weights cannot be trained directly: add --use_peft true (QLoRA) or remove it",
            {},
        )
        for name in ("load_in_4bit", "load_in_8bit")
    },
    # a split no mixture source reads (data/mixture.py)
    **{
        f"dataset_{kind}_split_unread": (
            f"dataset_{kind}_split",
            "where every mixture source names another split",
            "would be ignored: {where} ({read}): remove dataset_{kind}_split, or name {split!r} there",
            {"where": "every source names its own split", "read": "their splits", "kind": kind, "split": "<split>"},
        )
        for kind in ("train", "test")
    },
    # what only TRL's padded batches honour (forwards/choice.py)
    "pad_to_multiple_of": (
        "pad_to_multiple_of",
        f"with {_PACKED}",
        "would be ignored: it pads TRL's padded batches, and this run packs its pairs (padding_free, the default), "
        "each row cut to its forward's own width: remove pad_to_multiple_of, or pass --padding_free false",
        {},
    ),
    "neftune_noise_alpha": (
        "neftune_noise_alpha",
        f"with {_PACKED}",
        "would not be NEFTune's: its noise is scaled by the length of the row it sees, and this run packs its pairs "
        "(padding_free, the default), a row holding a micro-batch's sequences end to end: the noise would be "
        "smaller than on TRL's padded batches, by the budget (max_tokens_per_microbatch): pass --padding_free false "
        "(TRL's padded collator), or remove neftune_noise_alpha",
        {},
    ),
    # transformers passes them to the Adam family alone (options.check_adam_settings)
    **{
        name: (
            name,
            "with an optim that does not read it",
            "would be ignored: optim {optim} does not read it (transformers passes the Adam settings to Adam-family "
            "optimizers alone; Lion reads the betas): remove {name}, or choose an optim that reads it (adamw_torch)",
            {"optim": "<optim>", "name": name},
        )
        for name in ("adam_beta1", "adam_beta2", "adam_epsilon")
    },
    # transformers reads them for Trackio alone (options.check_trackio_fields)
    **{
        name: (
            name,
            "without report_to trackio",
            "would be ignored: transformers reads it for Trackio alone (report_to trackio), and this run reports to "
            "{reports}: {fix}",
            {"reports": "another", "fix": f"remove {name}"},
        )
        for name in TRACKIO_FIELDS
    },
    # a setting of a feature that is off (options.check_switched_off)
    **{
        f"{name}_off": (
            name,
            f"with {switch} {off.split(',')[0]}",
            SWITCHED_OFF,
            {"name": name, "switch": switch, "off": off, "fix": fix},
        )
        for switch, off, fix, settings in SWITCHED_SETTINGS
        for name in settings
    },
    # with eval_strategy no, what only an evaluation reads (options.check_evaluation)
    **{
        f"{name}_eval_no": (name, "given with eval_strategy no (the default)", EVAL_ONLY_WORDS, {"name": name})
        for name in (*EVAL_ONLY, "eval_steps", "do_eval", "eval_on_start")
    },
}


def said(refusal: str, /, **values) -> str:
    """The words COMBINED[refusal] says after its field's name (and value), `values` filling them in."""
    return COMBINED[refusal][2].format(**values)


def combined_words() -> dict[str, str]:
    """Each field refused in a combination: `Refused <when>: <field> <words>`, for each one, which config.make_parser
    adds to the field's own help (what it does where it is not refused)."""
    words: dict[str, list[str]] = {}
    for field, when, said_words, stand_ins in COMBINED.values():
        words.setdefault(field, []).append(f"Refused {when}: {field} {said_words.format(**stand_ins)}")
    keys = ", ".join(
        f"{key} {'unset' if default is None else str(default).lower()}"
        for key, (default, _) in ACCELERATOR_UNREAD.items()
    )
    words["accelerator_config"] = [
        f"Refused with a key off its default (the run needs {keys}): "
        + "; ".join(f"{key} cannot be honoured: {why}" for key, (_, why) in ACCELERATOR_UNREAD.items())
    ]
    return {field: ". ".join(lines) for field, lines in words.items()}


def help_words() -> dict[str, str]:
    """Each refused field's help line: that it is refused (and when), then the refusal's own why and fix."""
    words = {
        name: f"Refused unless left at its default, which the run does not read: {why}" for name, why in UNREAD.items()
    }
    words |= {name: f"Refused unless left at its default: it {why}" for name, why in NOT_DEFAULT.items()}
    words |= {name: f"Refused: {why}" for name, why in UNSETTABLE.items()}
    words |= {name: f"Refused: it {ENGINE_SWITCHES}" for name in ("deepspeed", "fsdp")}
    return words | {
        "fsdp_config": f"Refused: it {FSDP_CONFIG}",
        "train_sampling_strategy": f"Refused unless random: {SAMPLER}",
        "load_best_model_at_end": f"Refused: it {LOAD_BEST_REFUSED.removeprefix('load_best_model_at_end ')}",
        "hub_strategy": f"Unset (the default) or end: the final model pushed once; another (a typed every_save "
        f"too), with push_to_hub, is refused: it {HUB_STRATEGY}",
        "hub_revision": f"Refused with push_to_hub: it {HUB_REVISION}",
    }
