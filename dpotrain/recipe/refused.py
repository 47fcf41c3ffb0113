"""The TRL and transformers fields a run refuses, each with why and the fix: the refusal says these words, and --help
and --help-all give them as the field's help (`help_words`, set by config.make_parser), so that no help line describes
a refused field as working."""

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
