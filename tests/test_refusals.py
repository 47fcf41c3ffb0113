"""Issue #8: every option this project cannot honour, every bad value or row, refused before a model loads.

Each case runs the real command-line entry (`run_cli(train_dpo.main)`, in this process: cheap) and asserts exit code
2, one `error:` line that names the fix, no traceback, and that no model was loaded: the built-in model's folder
(a fresh DPOTRAIN_BUILTIN_DIR) was never even created, which the trainer does first when it loads the model.
"""

import dataclasses
import errno
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train_dpo
from conftest import ROOT, adding_specials, run_train, sealed_checkpoint, tiny_model
from dpotrain import resolve
from dpotrain.data import builtin, data
from dpotrain.recipe.config import make_parser, parse_args
from dpotrain.recipe.errors import ConfigError, RunError, plural, run_cli
from dpotrain.recipe.run_record import Spread
from dpotrain.train import resume

SMOKE = str(ROOT / "configs" / "smoke.yaml")
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def pair(chosen="Blue.", rejected="Green.", prompt=MESSAGES):
    return {
        "chosen": [*prompt, {"role": "assistant", "content": chosen}],
        "rejected": [*prompt, {"role": "assistant", "content": rejected}],
    }


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def refused(tmp_path, monkeypatch, capsys, *args) -> str:
    """The single `error:` line of `python train_dpo.py --config smoke.yaml ARGS`, after checking how it ended."""
    builtin = tmp_path / "builtin"
    monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", str(builtin))
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), *args]))
    out, err = capsys.readouterr()
    assert ended.value.code == 2, out + err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert "Traceback" not in out + err
    assert not builtin.exists(), "the model was loaded before the refusal"
    return errors[0]


LINE = json.dumps(pair()) + "\n"


def many_rows(n=40):
    return [pair(chosen=f"Blue {i}.") for i in range(n)]


# --- 1: options accepted by TRL's parser that this project cannot honour --------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--use_peft", "true"], "use_peft needs the layers to adapt: pass --lora_target_modules all-linear (every"),
        (["--lora_r", "8"], "lora_r is set but use_peft is false, so it would be ignored: add --use_peft true"),
        (["--merge_lora", "true"], "merge_lora is set but use_peft is false"),
        (["--lora_task_type", "CAUSAL_LM"], "lora_task_type is set but use_peft is false"),
        (
            ["--use_peft", "true", "--lora_target_modules", "q_proj", "--lora_task_type", "FOO"],
            "lora_task_type FOO: DPO trains a causal language model's adapter (CAUSAL_LM, the default): remove "
            "lora_task_type",
        ),
        (
            ["--use_peft", "true", "--lora_target_modules", "q_proj", "--lora_task_type", "SEQ_CLS"],
            "lora_task_type SEQ_CLS",
        ),
        (
            ["--use_peft", "true", "--lora_target_modules", "q_proj", "--lora_dropout", "0.1"],
            "lora_dropout 0.1 would be ignored: disable_dropout (true by default) sets every dropout to 0 once PEFT "
            "has wrapped the model, the adapter's too; add --disable_dropout false to train with it, or remove "
            "lora_dropout",
        ),
        (
            [
                "--use_peft",
                "true",
                "--lora_target_modules",
                "q_proj",
                "--disable_dropout",
                "false",
                "--lora_dropout",
                "2",
            ],
            "lora_dropout must be between 0 and 1 (got 2)",
        ),
        # PEFT scales the update by alpha / r: 0 trained nothing while the record and the card said LoRA alpha 0
        (
            ["--use_peft", "true", "--lora_target_modules", "q_proj", "--lora_alpha", "0"],
            "lora_alpha must be > 0 (got 0): the adapter's update is scaled by lora_alpha / lora_r, so 0 trains "
            "nothing; 2 x lora_r is usual",
        ),
        (["--use_peft", "true", "--lora_target_modules", "q_proj", "--lora_alpha", "-16"], "lora_alpha must be > 0"),
        # the parser's choices, before anything loads (health.check_values has no check of its own)
        (["--health_action", "halt"], "--health_action takes one of warn, stop, not 'halt'"),
        # torch refuses these when the trainer builds the optimizer: after the model and the reference stage had loaded
        (
            ["--adam_beta2", "1"],
            "optim adamw_torch_fused refuses the recipe's settings (Invalid beta parameter at index 1",
        ),
        (["--adam_epsilon=-1e-8"], "optim adamw_torch_fused refuses the recipe's settings (Invalid epsilon value"),
        # torch takes 0, and divides each update by sqrt(v) + eps: a parameter whose gradient was 0 (an embedding row
        # no pair of the step holds, a LoRA A matrix at step 1) got 0 / 0, and the weights were NaN after step 1
        (
            ["--adam_epsilon", "0"],
            "adam_epsilon must be > 0 (got 0): optim adamw_torch_fused divides each update by sqrt(its running "
            "squared gradient) + adam_epsilon, so a parameter whose gradient is 0 at a step (an embedding row of a "
            "token no pair of the step holds; a LoRA adapter's A matrix at step 1) would be updated by 0 / 0 = NaN: "
            "give a positive one (the recipes keep 1e-8)",
        ),
        # a parameter group's weight decay is not checked by torch: the weights grew at every step, recorded as decay
        (["--weight_decay", "-0.1"], "weight_decay must be >= 0 (got -0.1): a negative one grows the weights"),
        # transformers passes optim_args to some optimizers only: AdamW trained without them, under their record
        (
            ["--optim_args", "beta1=0.5"],
            "optim_args 'beta1=0.5' would be ignored: optim adamw_torch_fused reads none of it: remove optim_args "
            "(adam_beta1, adam_beta2, adam_epsilon and weight_decay set AdamW's), or choose an optim that reads it",
        ),
        (["--optim", "sgd", "--optim_args", "momentun=0.9"], "optim_args 'momentun=0.9' would be ignored: optim sgd"),
        (
            ["--optim", "sgd", "--optim_args", "momentum=0.9,nesterow=true"],
            "optim_args 'momentum=0.9,nesterow=true': optim sgd does not read nesterow, which would be ignored: remove "
            "it (a misspelt name?)",
        ),
        pytest.param(
            ["--optim", "paged_adamw_8bit"],
            "optim paged_adamw_8bit needs a package that is not installed here (ImportError: You need to install "
            "`bitsandbytes`",
            marks=pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="installed here"),
        ),
        (
            ["--lr_scheduler_type", "cosine_with_min_lr"],
            "lr_scheduler_type cosine_with_min_lr cannot be built with lr_scheduler_kwargs {} (One of min_lr or "
            "min_lr_rate should be set",
        ),
        # kwargs the scheduler builds with and fails or misleads on later, once the model has loaded and warm-up is over
        (
            ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"num_cycles": "a"}'],
            "lr_scheduler_type cosine with lr_scheduler_kwargs {'num_cycles': 'a'} fails at 10% of the run "
            "(ValueError: could not convert string to float: 'a'): a schedule keeps it between 0 and learning_rate "
            "(its peak) until the end: give its arguments numbers in their range (transformers' get_scheduler), or "
            "remove lr_scheduler_kwargs",
        ),
        (
            ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr_rate": 2}'],
            "{'min_lr_rate': 2} takes the learning rate to 2 x learning_rate at 100% of the run",
        ),
        (
            ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr": -1}'],
            "{'min_lr': -1} keeps the learning rate at 0 from 11% of the run on (it trains nothing more)",
        ),
        # the decay began inside warm-up: the rate peaked at 0.5 x learning_rate (max_steps 6, warmup 2), then fell
        (
            ["--lr_scheduler_type", "warmup_stable_decay", "--lr_scheduler_kwargs", '{"num_decay_steps": 10}']
            + ["--max_steps", "6", "--warmup_steps", "2"],
            "lr_scheduler_kwargs num_decay_steps 10 is more than the 4 steps after warm-up of the run's 6: "
            "warmup_stable_decay would start its decay inside the warm-up and the learning rate never reach the one "
            "set: give num_decay_steps 4 or fewer",
        ),
        # with num_stable_steps transformers takes the phases as given: 2 + 2 + 2 of 8 steps trained steps 7 and 8 at
        # learning rate 0 (metrics.jsonl), recorded as an 8-step run
        (
            ["--lr_scheduler_type", "warmup_stable_decay", "--max_steps", "8", "--warmup_steps", "2"]
            + ["--lr_scheduler_kwargs", '{"num_stable_steps": 2, "num_decay_steps": 2}'],
            "lr_scheduler_type warmup_stable_decay with lr_scheduler_kwargs warm-up 2 + stable 2 + decay 2 = 6 steps, "
            "and the run has 8 (2 of warm-up): it would hold the learning rate at min_lr_ratio (0) x learning_rate for "
            "the last 2 steps, training nothing: give num_stable_steps 4 (the phases then add up to the run's steps), "
            "or remove num_stable_steps",
        ),
        (
            ["--lr_scheduler_type", "warmup_stable_decay", "--max_steps", "6", "--warmup_steps", "2"]
            + ["--lr_scheduler_kwargs", '{"num_stable_steps": 10, "num_decay_steps": 2}'],
            "it would end before its decay begins (the learning rate never decays): give num_stable_steps 2",
        ),
        (
            ["--lr_scheduler_type", "warmup_stable_decay", "--max_steps", "6", "--warmup_steps", "2"]
            + ["--lr_scheduler_kwargs", '{"num_stable_steps": 1, "num_decay_steps": 5}'],
            "it would end before its decay does (the learning rate never comes down to the end of it): give "
            "num_stable_steps + num_decay_steps = 4",
        ),
        # transformers builds constant without warm-up: the full rate from step 1, the record counting warm-up steps
        (
            ["--lr_scheduler_type", "constant"],
            "lr_scheduler_type constant has no warm-up (transformers ignores warmup_steps for it), but warmup_steps is "
            "0.1: the run would start at the full learning rate while the dry run and the record counted warm-up "
            "steps: add --warmup_steps 0, or choose constant_with_warmup",
        ),
        (
            ["--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs", '{"power": -1}'],
            "{'power': -1} fails at 100% of the run (ZeroDivisionError",
        ),
        (["--load_in_4bit", "true", "--use_peft", "true", "--lora_target_modules", "q_proj"], "load_in_4bit needs"),
        (["--use_liger_kernel", "true"], "use_liger_kernel needs the liger-kernel package"),
        (["--ignore_bias_buffers", "true"], "ignore_bias_buffers is a DDP workaround of TRL's own script"),
        (
            ["--use_peft", "true", "--lora_target_modules", "q_proj", "--sync_ref_model", "true"],
            "sync_ref_model does not work with use_peft",
        ),
        (["--sync_ref_model", "true", "--precompute_ref_log_probs", "true"], "--precompute_ref_log_probs false"),
        (["--dataset_streaming", "true"], "dataset_streaming: the step plan and the reference stage need every pair"),
        # TRL's mixture field, refused beside a mixture only: with dataset_name it was recorded as true, never read
        (["--streaming", "true"], "error: streaming: the step plan and the reference stage need every pair"),
        # a local folder (here the built-in model) loads as it is: recorded as model_revision v1.0, not honoured
        (
            ["--model_revision", "v1.0"],
            "model_revision 'v1.0' names a commit of a Hub model, and 'builtin:tiny-olmo3' is built in: remove "
            "model_revision (a recipe file's, for a model given on the command line: --model_revision main)",
        ),
        # passed every check: transformers' ValueError traceback as the model was built
        (
            ["--attn_implementation", "sdpa_attention"],
            "attn_implementation 'sdpa_attention' is not one transformers knows: choose one of eager, ",
        ),
        # transformers builds the loggers with the trainer: its ValueError (RuntimeError) once the model had loaded
        (["--report_to", "wandbb"], "unknown report_to 'wandbb': choose from azure_ml, clearml, codecarbon, comet_ml,"),
        pytest.param(
            ["--report_to", "tensorboard"],
            "report_to tensorboard needs its Python package, which is not installed here: install it, or remove "
            "tensorboard from report_to",
            marks=pytest.mark.skipif(
                any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")), reason="installed here"
            ),
        ),
        # transformers' ValueError as the trainer was built, once the model had loaded
        (
            ["--save_strategy", "best"],
            "save_strategy best saves a checkpoint when an evaluation's metric_for_best_model improves, and this run "
            "has no metric_for_best_model: add --metric_for_best_model eval_loss --eval_strategy steps --eval_steps N",
        ),
        # no evaluation, so no metric to improve: trained to the end with no checkpoint on the way
        (
            ["--save_strategy", "best", "--metric_for_best_model", "eval_loss"],
            "save_strategy best saves a checkpoint when an evaluation's metric_for_best_model improves, and this run "
            "has no evaluation (eval_strategy no)",
        ),
        # the step1 health guard logs step 1 whatever this says: recorded false, logged
        (
            ["--logging_first_step", "false"],
            "logging_first_step false: the health guards log step 1 on its own (its loss, before any update, shows "
            "whether the reference is the policy's): remove logging_first_step, or pass --health_checks false",
        ),
        (["--save_on_each_node", "true"], "save_on_each_node is not supported: checkpoints, their COMPLETE marks"),
        # transformers counts `input_ids`, which the pairs' micro-batches do not hold: a warning per step, 0 recorded
        (
            ["--include_num_input_tokens_seen", "true"],
            "include_num_input_tokens_seen would log num_input_tokens_seen 0",
        ),
        # read only by code this project replaces (Trainer.compute_loss, its loaders...): recorded, trained without
        (
            ["--label_smoothing_factor", "0.1"],
            "label_smoothing_factor 0.1 would be ignored: transformers' label smoother runs in Trainer.compute_loss, "
            "which DPO's loss replaces: remove label_smoothing_factor; for DPO's own smoothing (cDPO, robust DPO) pass "
            "--label_smoothing 0.1",
        ),
        (["--average_tokens_across_devices", "false"], "average_tokens_across_devices false would be ignored: each"),
        (["--auto_find_batch_size", "true"], "auto_find_batch_size true would be ignored: the step plan's micro"),
        (["--dataloader_drop_last", "true"], "dataloader_drop_last true would be ignored: the step plan trains every"),
        (["--remove_unused_columns", "false"], "remove_unused_columns false would be ignored: the step plan's loader"),
        # AcceleratorConfig's TypeError traceback as the arguments were built
        (
            ["--accelerator_config", '{"split_batchs": true}'],
            "accelerator_config 'split_batchs' is no key of transformers' AcceleratorConfig: did you mean "
            "'split_batches'? Else remove it",
        ),
        # torch's ValueError at the first training forward, after the model loaded and the reference stage scored
        (
            ["--activation_checkpointing", "true", "--activation_checkpointing_kwargs", '{"use_reentrnt": false}'],
            "activation_checkpointing_kwargs 'use_reentrnt' is no argument of torch's checkpoint(), which would stop "
            "on it at the first training step: did you mean 'use_reentrant'?",
        ),
        # a dry run: transformers refuses bf16 on a machine without a GPU first
        (["--dry-run", "--bf16_full_eval", "true"], "bf16_full_eval true would be ignored: transformers casts"),
        (["--include_for_metrics", "loss"], "include_for_metrics ['loss'] would be ignored: it feeds"),
        (["--enable_jit_checkpoint", "true"], "enable_jit_checkpoint true would be ignored: the run saves"),
        (["--do_train", "false"], "do_train false would be ignored: the script always trains: remove it (--dry-run"),
        (["--do_predict", "true"], "do_predict true would be ignored: this script trains (and evaluates with"),
        (
            ["--optim_target_modules", "q_proj"],
            "optim_target_modules would be ignored: optim adamw_torch_fused trains every parameter as it is (only the "
            "galore_* and apollo_* optims read it)",
        ),
        (
            ["--dry-run", "--accelerate_config", str(ROOT / "accelerate_config.yaml"), "--ddp_static_graph", "true"],
            "ddp_static_graph would be ignored: it sets torch's DDP, and this run trains under DeepSpeed ZeRO-2",
        ),
        # the weights trained in a half dtype themselves: AdamW at 1e-6 left 98% of 0.02-sized bf16 weights as they were
        (
            ["--dry-run", "--dtype", "bfloat16"],
            "--dtype bfloat16 would train the weights themselves in bf16, with no fp32 copy under one process: an "
            "update near the learning rate (0.0001) rounds away on any weight above about 0.05: remove --dtype",
        ),
        (  # DeepSpeed keeps its fp32 copy under bf16 or fp16 only
            ["--dry-run", "--accelerate_config", str(ROOT / "accelerate_config.yaml"), "--dtype", "float16"],
            "--dtype float16 would train the weights themselves in fp16, with no fp32 copy under DeepSpeed ZeRO-2",
        ),
        # TrainingArguments' own DeepSpeed and FSDP: planned and recorded as one process; ZeRO-3 failed at the load
        (["--deepspeed", str(ROOT / "ds_config.json")], "deepspeed is not how this project selects its engine (the"),
        (["--fsdp", "full_shard"], "fsdp is not how this project selects its engine (the plan and the record would"),
        # accelerate's ValueError traceback as the trainer was built, after the model loaded ("'BOGUS' is not a valid
        # DynamoBackend"); torch's at the first compiled forward, after the reference stage ("Unrecognized mode=...")
        (
            ["--torch_compile", "true", "--torch_compile_backend", "inductr"],
            "torch_compile_backend 'inductr' is not one accelerate compiles with: choose from no, eager, aot_eager, "
            "inductor,",
        ),
        (
            ["--torch_compile_mode", "max_autotune"],
            "torch_compile_mode 'max_autotune' is not one torch.compile takes: choose from default, lite, "
            "reduce-overhead, max-autotune-no-cudagraphs, max-autotune (or remove it for default)",
        ),
        # not transformers' key=value,key=value: "ValueError: not enough values to unpack" as the optimizer was built,
        # after the reference stage (a value holding a comma is cut there too)
        (
            ["--optim", "adafactor", "--optim_args", "scale_parameter"],
            "optim_args 'scale_parameter' is not transformers' key=value,key=value: 'scale_parameter' has no '=' "
            '(a value cannot hold a comma or an =): write it as --optim_args "name=value,name2=value2"',
        ),
        (["--optim_args", "betas=(0.9,0.99)"], "optim_args 'betas=(0.9,0.99)' is not transformers' key=value,key=val"),
        # read by transformers only under `fsdp` (refused above): the run trained, exit 0, its FSDP settings unread
        (
            ["--fsdp_config", '{"min_num_params": 1000}'],
            "fsdp_config would be ignored: transformers reads it only with --fsdp, which is not how this project "
            "selects its engine: remove it, and give FSDP2's settings in its accelerate config "
            "(configs/accelerate/fsdp2.yaml's fsdp_config:)",
        ),
        # no optimizer.pt / scheduler.pt in its checkpoints: a stopped run said "run the same command again", refused
        (["--save_only_model", "true"], "save_only_model writes checkpoints without the optimizer, scheduler and RNG"),
        (["--save_only_model", "true", "--save_strategy", "no"], "save_only_model writes checkpoints without"),
        # the resumed run went on with the epoch's first batches (weights 1.7e-4 off the uninterrupted run's, silently)
        (["--ignore_data_skip", "true"], "ignore_data_skip makes a resumed run train its epoch's first batches again"),
        # the smoke recipe cuts micro-batches by tokens: the refusal names the flag that makes them fixed
        (
            ["--loss_type", "aot"],
            "micro-batches cut by max_tokens_per_microbatch (2048) would change what it optimizes"
            ": add --max_tokens_per_microbatch none, for micro-batches of per_device_train_batch_size pairs (now 8)",
        ),
        (["--loss_type", "sigmoid", "aot_unpaired", "--max_length", "auto"], "add --max_tokens_per_microbatch none"),
        (["--loss_type", "sigmoid", "sft", "--use_weighting", "true"], "use_weighting with loss_type sft"),
        # DPOConfig options the configured loss types would not read (TRL 1.16 `_compute_loss`), or that TRL refuses
        # only after loading the model
        (
            ["--label_smoothing", "0.1"],
            "label_smoothing 0.1 would be ignored: TRL's sigmoid_norm loss does not read "
            "it (only exo_pair, robust, aot and aot_unpaired do; open-instruct's dpo_norm smooths, TRL's sigmoid_norm "
            "does not): remove label_smoothing, or choose one of those loss types",
        ),
        (["--loss_type", "sigmoid", "ipo", "--label_smoothing", "0.1"], "TRL's sigmoid/ipo loss does not read it"),
        (["--loss_type", "exo_pair"], "loss_type exo_pair needs 0 < label_smoothing < 1 (got 0)"),
        (["--loss_type", "robust", "--label_smoothing", "0.5"], "loss_type robust needs 0 <= label_smoothing < 0.5"),
        # cDPO's smoothing in aot and aot_unpaired, unchecked by TRL: 0.7 trained toward the rejected answers
        (
            ["--loss_type", "aot", "--label_smoothing", "0.7", "--max_tokens_per_microbatch", "none"],
            "loss_type aot needs 0 <= label_smoothing < 0.5, the assumed share of flipped labels (got 0.7)",
        ),
        (
            ["--loss_type", "aot_unpaired", "--label_smoothing", "-0.5", "--max_tokens_per_microbatch", "none"],
            "loss_type aot_unpaired needs 0 <= label_smoothing < 0.5",
        ),
        (
            ["--loss_type", "bco_pair", "--f_divergence_type", "js_divergence"],
            "f_divergence_type js_divergence does not apply to loss_type bco_pair",
        ),
        (["--loss_type", "sft", "--f_divergence_type", "forward_kl"], "f_divergence_type forward_kl would be ignored"),
        # DPOConfig takes any string: TRL's loss raised "Unknown f_divergence_type" at step 1, after the reference stage
        (
            ["--f_divergence_type", "forward-kl"],
            "unknown f_divergence_type 'forward-kl': choose from reverse_kl, forward_kl, js_divergence, "
            "alpha_divergence (the default, reverse_kl, is DPO's)",
        ),
        (
            ["--f_alpha_divergence_coef", "0.3"],
            "f_alpha_divergence_coef 0.3 would be ignored: it is read only with --f_divergence_type alpha_divergence",
        ),
        (["--discopop_tau", "0.1"], "discopop_tau 0.1 would be ignored: only loss_type discopop reads it"),
        (["--loss_type", "sft", "--ld_alpha", "0.5"], "ld_alpha 0.5 would be ignored"),
        # TRL's field says "Must be in [0.0, 1.0]" and checks nothing: a negative weight on the tails trained on
        (["--ld_alpha", "-1", "--assistant_turns", "final"], "ld_alpha must be in [0, 1] (got -1): LD-DPO weighs"),
        (["--ld_alpha", "2", "--assistant_turns", "final"], "ld_alpha must be in [0, 1] (got 2)"),
        (
            ["--loss_type", "aot", "--use_weighting", "true", "--max_tokens_per_microbatch", "none"],
            "use_weighting with loss_type aot: TRL does not implement WPO's weights",
        ),
        (
            ["--ref_model_sync_steps", "4"],
            "ref_model_sync_steps 4 would be ignored: it is read only with --sync_ref_model true (TR-DPO)",
        ),
        (["--ref_model_mixup_alpha", "0.9"], "ref_model_mixup_alpha 0.9 would be ignored"),
        (
            ["--precompute_ref_batch_size", "64"],
            "precompute_ref_batch_size 64 would be ignored: the reference stage cuts its own micro-batches",
        ),
        # accelerate's loader settings, over the step plan's loader: dispatch_batches and split_batches a traceback
        # once the model and the reference stage had run, even_batches and use_seedable_sampler read by nothing,
        # and gradient_accumulation_kwargs {num_steps: 4} a NaN loss at step 1
        (
            ["--accelerator_config", '{"dispatch_batches": true}'],
            "accelerator_config dispatch_batches true cannot be honoured: the step plan's loader gives each process",
        ),
        (["--accelerator_config", '{"split_batches": true}'], "accelerator_config split_batches true cannot be"),
        (["--accelerator_config", '{"even_batches": false}'], "accelerator_config even_batches false cannot be"),
        (
            ["--accelerator_config", '{"use_seedable_sampler": false}'],
            "accelerator_config use_seedable_sampler false cannot be",
        ),
        (
            ["--accelerator_config", '{"gradient_accumulation_kwargs": {"num_steps": 4}}'],
            "accelerator_config gradient_accumulation_kwargs {'num_steps': 4} cannot be honoured: the trainer runs "
            "each step's micro-batches itself",
        ),
        # transformers' own refusals as TrainingArguments are built: one line, which said what was wrong but no fix
        (
            ["--logging_steps", "0"],
            "logging strategy IntervalStrategy.STEPS requires non-zero --logging_steps (give a number of steps, the "
            "recipes log every step: --logging_steps 1, or a fraction of the run: 0.1)",
        ),
        (
            ["--warmup_steps", "-0.1"],
            "Got warmup_steps = -0.1, Expected value warmup_steps >= 0 (give a number of steps, or a fraction of the "
            "run below 1: the recipes warm up over 0.1 of it; 0 for none)",
        ),
        (
            ["--save_steps", "2.5"],
            "--save_steps must be an integer if bigger than 1: 2.5 (give a whole number of steps, or a fraction of the "
            "run below 1: 0.1)",
        ),
        (
            ["--torch_empty_cache_steps", "0"],
            "`torch_empty_cache_steps` must be an integer bigger than 0, got 0. (give a number of steps, or leave it "
            "unset to never empty the cache)",
        ),
    ],
)
def test_options_that_cannot_be_honoured(args, expected, tmp_path, monkeypatch, capsys):
    assert expected in refused(tmp_path, monkeypatch, capsys, *args)


def test_a_bf16_model_loaded_as_auto_is_refused_where_its_weights_would_train_in_bf16(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """`--dtype auto` loads the weights in their own dtype: a bf16 model's then trained in bf16 alone on one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "bf16-model"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="bfloat16").save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    error = refused(tmp_path, monkeypatch, capsys, "--dry-run", "--model_name_or_path", str(folder), "--dtype", "auto")
    assert error.startswith("error: --dtype auto (this model: bfloat16) would train the weights themselves in bf16")
    train_dpo.main(
        ["--config", SMOKE, "--output_dir", str(tmp_path / "fp32"), "--model_name_or_path", str(folder), "--dry-run"]
    )
    assert "weights load in float32" in capsys.readouterr().out  # the same model in fp32 (no --dtype): planned


SYNCED = ["--sync_ref_model", "true", "--precompute_ref_log_probs", "false"]
HELD_OUT = ["--dataset_mixer_eval_list", str(ROOT / "data" / "smoke_prefs.jsonl"), "0.05"]


@pytest.mark.parametrize(
    "args, expected",
    [
        # torch's DataLoader: "num_workers option should be non-negative", once the model had loaded
        (["--dataloader_num_workers", "-1"], "dataloader_num_workers must be >= 0 (got -1): torch's DataLoader"),
        # datasets' map: "num_proc must be >= 0 or None." as the trainer tokenized, after the model had loaded
        (["--dataset_num_proc", "-1"], "dataset_num_proc must be >= 0 (got -1): datasets refuses it"),
        # TRL's pad: ZeroDivisionError (0) or a RuntimeError (-8) at the first padded micro-batch
        (["--padding_free", "false", "--pad_to_multiple_of", "0"], "pad_to_multiple_of must be >= 1 (got 0)"),
        (["--padding_free", "false", "--pad_to_multiple_of", "-8"], "pad_to_multiple_of must be >= 1 (got -8)"),
        # recorded as a limit, and every checkpoint kept (transformers and checkpoints.rotate: no limit)
        (["--save_total_limit", "0"], "save_total_limit must be >= 1 (got 0): transformers takes 0 or below for no"),
        # the evaluation's batches: ZeroDivisionError in plan.eval_batches at the first evaluation, mid-training
        (
            ["--per_device_eval_batch_size", "0", "--eval_strategy", "steps", "--eval_steps", "1", *HELD_OUT],
            "per_device_eval_batch_size must be >= 1 (got 0): the pairs of each process's evaluation batches",
        ),
        # transformers' evaluation loop: "integer modulo by zero" at the first evaluation, mid-training
        (
            ["--eval_accumulation_steps", "0", "--eval_strategy", "steps", "--eval_steps", "1", *HELD_OUT],
            "eval_accumulation_steps must be >= 1 (got 0): transformers' evaluation moves its outputs",
        ),
        # torch's DataLoader takes it and asserts as training's loader starts, after the reference stage
        (
            ["--dataloader_num_workers", "1", "--dataloader_prefetch_factor", "0"],
            "dataloader_prefetch_factor must be >= 1 (got 0): the batches each loader worker reads ahead",
        ),
        ([*SYNCED, "--ref_model_sync_steps", "0"], "ref_model_sync_steps must be >= 1 (got 0)"),
        ([*SYNCED, "--ref_model_mixup_alpha", "2"], "ref_model_mixup_alpha must be in (0, 1] (got 2)"),
        # TRL's sync keeps (1 - alpha) of the reference: at 0 it never moved, plain DPO recorded as TR-DPO
        ([*SYNCED, "--ref_model_mixup_alpha", "0"], "ref_model_mixup_alpha must be in (0, 1] (got 0)"),
        # 0: recorded, and the GPU's own peak used; below 0, a negative MFU logged (on a CPU too)
        (["--gpu_peak_tflops", "0"], "gpu_peak_tflops must be > 0 (got 0)"),
        (["--gpu_peak_tflops", "-1"], "gpu_peak_tflops must be > 0 (got -1)"),
        # TRL divides the logits by it: NaN at step 1, stopped by the health guard as a diverged run
        (["--loss_type", "discopop", "--discopop_tau", "0"], "discopop_tau must be > 0 (got 0)"),
    ],
)
def test_numbers_outside_what_their_option_means_are_refused(args, expected, tmp_path, monkeypatch, capsys):
    """Each was accepted, recorded in resolved_config.json and failed (or was misread) once the model had loaded: a dry
    run, which makes the same checks, is enough to see each refused."""
    assert refused(tmp_path, monkeypatch, capsys, *args, "--dry-run").startswith(f"error: {expected}")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_lora_target_modules_the_model_does_not_have_are_refused_before_it_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """PEFT adapts the target modules whose names match and drops the others without a word (`q_proj v_prj` trained
    q_proj alone), and where none matches it stopped in a traceback once the model had loaded."""
    lora = ["--model_name_or_path", tiny_model_dir, "--use_peft", "true", "--max_steps", "2", *dry_run]
    named = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", "q_proj", "v_prj")
    assert line == (
        f"error: lora_target_modules v_prj: {tiny_model_dir} has no module of that name (PEFT would adapt the others "
        f"alone once the model loaded): its linear layers are named {named}; pass some of those, or "
        "--lora_target_modules all-linear"
    )
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", "wq", "wv")
    assert line.startswith(
        f"error: lora_target_modules wq wv: {tiny_model_dir} has no module of those names (PEFT would stop once"
    )
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", ".*\\.wq")
    assert line.startswith(f"error: lora_target_modules '.*\\\\.wq': no module of {tiny_model_dir} has a name")
    # a comma list, as other tools take it, is one regular expression to PEFT: the line says how to give several
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", "q_proj,v_proj")
    assert line.endswith(
        "pass some of those (on the command line separated by spaces, not commas; in a recipe file as a list: "
        "[q_proj, v_proj]), or --lora_target_modules all-linear"
    )


@pytest.mark.parametrize("written", ["q_proj v_proj", "q_proj, v_proj"])
def test_several_lora_target_modules_in_one_text_of_a_recipe_file_are_refused_naming_the_list(
    written, tmp_path, tiny_model_dir
):
    """A recipe file's `lora_target_modules: q_proj v_proj` is one text, which PEFT reads as one regular expression:
    the refusal said "pass some of those" (or, for commas, "separated by spaces"), which is what it had been given,
    so the same refusal came again. It names the recipe file's list."""
    from transformers import AutoConfig

    from dpotrain.train import lora

    recipe = tmp_path / "lora.yaml"
    recipe.write_text(Path(SMOKE).read_text() + f"use_peft: true\nlora_target_modules: {written}\n")
    parsed = parse_args(["--config", str(recipe), "--model_name_or_path", tiny_model_dir])
    with pytest.raises(ConfigError, match=r"in a recipe file as a list: \[q_proj, v_proj\]\), or --lora_target"):
        lora.check_targets(parsed, AutoConfig.from_pretrained(tiny_model_dir), tiny_model_dir)


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_lora_adapter_folder_as_the_model_is_refused_naming_its_base_and_merged_model(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A LoRA run's folder (or checkpoint) as model_name_or_path, as a resume's refusal advises for a checkpoint: TRL
    builds the model from the folder's config.json, which an adapter's folder lacks (a traceback once the data had been
    read); with its base's config.json beside it, transformers looked for full weights there."""
    adapter = tmp_path / "lora-run"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": tiny_model_dir}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(adapter), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: model folder '{adapter}' holds a LoRA adapter (adapter_config.json), not a model a run can start "
        f"from: start from its base model ({tiny_model_dir}) with --use_peft true for a new adapter, or from the "
        "adapter merged into its base (a run with merge_lora: true saves that to <output_dir>/merged/)"
    )
    shutil.copytree(tiny_model_dir, adapter / "merged")  # saved with merge_lora: true
    shutil.copy(adapter / "merged" / "config.json", adapter)  # an adapter saved with its base's config
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(adapter), "--max_steps", "2", *dry_run)
    assert line.endswith(f"or from --model_name_or_path {adapter / 'merged'}, the adapter merged into its base")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_model_folder_with_an_adapter_beside_its_weights_is_refused_naming_the_adapters_files(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A full model with a LoRA adapter saved beside it (a repo that ships both): transformers loads the adapter onto
    the model from the folder's adapter_config.json. The refusal said the folder held no model a run can start from
    and to start from its base, the very folder given."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(model)}))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: model folder '{model}' holds a model and, beside it, a LoRA adapter (adapter_config.json), which "
        "transformers would load onto the model: move the adapter's files (adapter_config.json, adapter_model.*) to "
        "a folder of their own, or merge the adapter into the weights first (PEFT's merge_and_unload, then "
        "save_pretrained)"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_model_type_this_transformers_does_not_know_is_refused_naming_the_upgrade(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A model newer than the installed transformers (its config.json's model_type unknown to it): the run stopped in
    transformers' ValueError traceback once the data had been read, and the dry run planned on, saying the config was
    "not readable on this machine"."""
    import transformers

    model = tmp_path / "new-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config |= {"model_type": "frobnicator", "architectures": ["FrobnicatorForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: {model}: its config.json's model_type 'frobnicator' is not one transformers "
        f"{transformers.__version__} knows: install a transformers release that has it (pip install -U transformers), "
        "or check model_type in its config.json"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize(
    "field, value, problem",
    [
        (
            "tie_word_embeddings",
            "false",
            "TypeError: Field 'tie_word_embeddings' expected bool, got str (value: 'false')",
        ),
        (
            "layer_types",
            ["full_attention"],
            "ValueError: `num_hidden_layers` (2) must be equal to the number of `layer",
        ),
    ],
    ids=["quoted", "inconsistent"],
)
def test_a_config_value_transformers_refuses_is_one_line_naming_it(
    field, value, problem, dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A config.json value transformers refuses (`"tie_word_embeddings": "false"`, quoted by a hand edit or a script
    that wrote every value as text; `layer_types` that do not match `num_hidden_layers`): huggingface_hub's
    StrictDataclassFieldValidationError traceback from the tokenizer's load, in the run and its dry run alike."""
    import transformers

    model = tmp_path / "edited"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {field: value}))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
    assert line.startswith(
        f"error: {model}: transformers {transformers.__version__} refuses a value of its config.json ({problem}"
    ), line
    assert line.endswith(
        "): write it as the field takes it (true/false and numbers unquoted), or copy config.json again from where "
        "the model came from"
    ), line


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_model_config_without_model_type_is_refused_naming_the_file_and_the_type(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A config.json without `model_type` (an export that wrote its own): the run stopped in transformers' traceback,
    `ValueError: Unrecognized model in ...`, once the data had been read, and the dry run planned on, saying the
    config was "not readable on this machine". Now one line names the file and the model_type its architecture has."""
    model = tmp_path / "no-type"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    del config["model_type"]
    (model / "config.json").write_text(json.dumps(config))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: {model / 'config.json'} has no model_type, which transformers reads to know the model's "
        'architecture: add "model_type": "olmo3" (its architecture Olmo3ForCausalLM\'s), or copy config.json again '
        "from where the model came from"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_model_weights_cut_short_are_refused_naming_the_file_before_they_load(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A model folder whose model.safetensors was cut short (a copy stopped midway): the run stopped in safetensors'
    traceback, `SafetensorError: ... incomplete metadata`, as the model loaded after the data stages, and the dry run
    said nothing. Now its header (read, no weight) says how long it should be, and one line names the file."""
    model = tmp_path / "cut"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    whole = weights.stat().st_size
    for keep in (5000, whole - 1):  # within the header, and one byte short of the last tensor
        with open(weights, "r+b") as f:
            f.truncate(keep)
        line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
        assert line.startswith(f"error: the model's weights file {weights} is cut short: it has {keep:,} bytes, ")
        assert line.endswith(": copy it again from where the model came from")
    assert f"its header says {whole:,}" in line


def test_lora_target_modules_refused_on_a_model_of_conv1d_layers_name_those_layers(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """GPT-2's attention and MLP are transformers' Conv1D, which PEFT adapts as it does linear layers (all-linear takes
    them): the refusal of a name GPT-2 lacks listed its linear layers as `lm_head` alone, and a user passing what it
    named adapted the output head only."""
    model = tiny_model("gpt2", tmp_path / "gpt2", tiny_model_dir)
    lora = ["--model_name_or_path", model, "--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj"]
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--dry-run")
    assert line.endswith(
        "its linear layers are named c_attn, c_proj, c_fc, lm_head; pass some of those, or --lora_target_modules "
        "all-linear"
    ), line


@pytest.mark.parametrize(
    "model_type, targets, layer, instead",
    [
        (
            "phimoe",
            ["all-linear"],
            "router (PhimoeTopKRouter, whose forward returns a tuple)",
            "q_proj k_proj v_proj o_proj",
        ),
        ("phimoe", ["q_proj", "router"], "router (PhimoeTopKRouter, whose forward returns a tuple)", "q_proj"),
        (
            "deepseek_v4",
            ["all-linear"],
            "o_a_proj (DeepseekV4GroupedLinear, whose forward returns 1024 features, not 8192)",
            "q_a_proj q_b_proj kv_proj o_b_proj gate_proj up_proj down_proj",
        ),
    ],
)
def test_lora_on_a_layer_peft_takes_for_linear_that_is_not_is_refused_before_it_loads(
    model_type, targets, layer, instead, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """Phi-3.5-MoE's router subclasses nn.Linear and returns its logits, weights and experts; DeepSeek V4's grouped
    output projection takes its heads in groups and returns a group's width: all-linear adapted each, and the run
    loaded the model and ended at its first forward in PEFT's traceback (`'tuple' object has no attribute 'dtype'`; the
    sizes 1024 and 8192 not matching). Refused from the meta-device wrap, each such layer run on the input the model
    gives it, naming the layers to pass instead; those train (a layer of its own forward that returns the linear map,
    Falcon's, is adapted as before: test_architectures)."""
    from test_architectures import FAMILIES

    shape = FAMILIES.get(model_type, {})
    model = tiny_model(model_type, tmp_path / model_type, tiny_model_dir, **shape)
    lora = ["--model_name_or_path", model, "--use_peft", "true", "--lora_target_modules", *targets]
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--max_steps", "2")
    assert line == (
        f"error: lora_target_modules {' '.join(targets)} adapts {layer}: PEFT takes it for a linear layer, and LoRA's "
        "update cannot be added to that output (the run would fail at its first forward, once the model loaded): pass "
        f"the linear layers by name, without it (--lora_target_modules {instead})"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize(
    "field, given",
    [("lora_target_modules", ["q_proj", "lm_head"]), ("lora_target_parameters", ["lm_head.weight"])],
    ids=["module", "parameter"],
)
def test_lora_on_the_output_layer_is_refused_before_the_model_loads(
    field, given, dry_run, tmp_path, monkeypatch, capsys, llama_dir
):
    """TRL's fused LM head computes every log-prob from the output layer's weight itself, so it refuses a LoRA adapter
    there: `--lora_target_modules q_proj lm_head` (or `--lora_target_parameters lm_head.weight` on a model whose head
    is its own) loaded the model and ended in TRL's ValueError traceback as the trainer was built. Refused from the
    meta-device model, naming what trains the output layer (`lora_modules_to_save`, a whole copy, whose weight the
    fused head reads)."""
    lora = ["--model_name_or_path", llama_dir, "--use_peft", "true", f"--{field}", *given]
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--max_steps", "2", *dry_run)
    assert line == (
        f"error: {field} {' '.join(given)} adapts lm_head, the model's output layer, whose weight TRL's fused LM head "
        "reads directly for every log-prob: its adapter would never train (TRL refuses it once the model loaded): "
        f"remove it from {field} (--lora_modules_to_save lm_head trains a copy of it whole)"
    )


def test_lora_on_layers_peft_refuses_for_a_mamba_model_names_the_layers_it_takes(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """all-linear on a Mamba hybrid (Falcon-H1): PEFT refuses its mixers' `out_proj` and `conv1d` by name, and the
    refusal said "pass --lora_target_modules naming some of its linear layers" without naming any; all-linear cannot
    leave them out. It names the linear layers PEFT takes: the dry run with them plans the wrap PEFT makes (the run
    trains them: 2 steps of this model take ~40 s on a CPU, its Mamba layers without their kernels)."""
    model = tiny_model("falcon_h1", tmp_path / "falcon_h1", tiny_model_dir)
    lora = ["--model_name_or_path", model, "--use_peft", "true", "--max_steps", "2"]
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", "all-linear")
    fix = "--lora_target_modules gate_proj up_proj down_proj in_proj q_proj k_proj v_proj o_proj"
    assert line.startswith(f"error: use_peft: PEFT cannot adapt {model} with these LoRA settings ([PEFT:"), line
    assert line.endswith(f"): pass the linear layers PEFT takes by name ({fix})"), line
    args = [
        *lora,
        *fix.split(),
        "--output_dir",
        str(tmp_path / "fixed"),
        "--report_to",
        "none",
        "--bf16",
        "true",
        "--dry-run",
    ]
    assert train_dpo.main(["--config", SMOKE, *args, "--json"]) in (0, None)
    planned = json.loads(capsys.readouterr().out)["derived"]["memory"]
    assert planned["model"]["trained_parameters"] < planned["model"]["parameters"], planned  # the adapter alone


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize(
    "model_type, says, given",
    [
        # Llama 4's causal LM (and Mllama's) names its backbone `language_model` (base_model_prefix) and holds it as
        # `model`: its base_model is the whole model, which TRL's fused LM head ran as the backbone. The run loaded
        # the model and ended in the reference stage's traceback (`'MoeCausalLMOutputWithPast' object has no
        # attribute 'last_hidden_state'`), and the dry run planned it as trainable.
        (
            "llama4_text",
            "TRL {trl}'s DPOTrainer cannot train Llama4ForCausalLM (model_type 'llama4_text'): its fused LM head, "
            "which computes every log-prob, runs the model's base_model as the backbone, and this class has none (no "
            "module named 'language_model', its base_model_prefix): train a model of another type, or install a TRL "
            "release that finds its backbone",
            [],
        ),
        # Doge's config has output_router_logits and router_aux_loss_coef 0.001 with dense layers (is_moe false): TRL
        # added the router's loss, the model recorded no router logits, and the run loaded it and ended at its first
        # step in `IndexError: tuple index out of range` (plain TRL alike). The fix named trains (the test below).
        (
            "doge",
            "TRL adds the router's load-balancing loss (router_aux_loss_coef 0.001; its config has "
            "output_router_logits), and this doge model has no router (DogeCDMoE) in any layer, so the run would fail "
            "at its first step: pass --router_aux_loss_coef 0",
            [],
        ),
        # A router loss's weight given for a dense model (a mixture-of-experts recipe's router_aux_loss_coef, run on
        # a Llama): TRL raised its ValueError traceback once the model had loaded
        (
            "llama",
            "router_aux_loss_coef 0.1 weights a mixture of experts' router loss, and this llama model has none (its "
            "config has no output_router_logits): remove router_aux_loss_coef",
            ["--router_aux_loss_coef", "0.1"],
        ),
        # JetMoE's class says it cannot checkpoint its activations (supports_gradient_checkpointing False), and the
        # recipes checkpoint: the run loaded it and ended as the trainer was built, in transformers' traceback
        # ("JetMoeForCausalLM does not support activation checkpointing.")
        (
            "jetmoe",
            "activation_checkpointing is on, and transformers cannot checkpoint JetMoeForCausalLM (model_type "
            "'jetmoe'; the class says so): pass --activation_checkpointing false (a --dry-run's memory plan then says "
            "whether the activations fit)",
            ["--activation_checkpointing", "true"],
        ),
    ],
)
def test_a_model_the_run_cannot_train_as_set_is_refused_before_it_loads(
    model_type, says, given, dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    import trl

    model = tiny_model(model_type, tmp_path / model_type, tiny_model_dir)
    args = ["--model_name_or_path", model, "--max_steps", "2", *given]
    line = refused(tmp_path, monkeypatch, capsys, *args, *dry_run)
    assert line == f"error: {model}: {says.format(trl=trl.__version__)}"


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_dbrx_with_no_qkv_clip_bound_is_refused_before_it_loads(dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """DBRX's `attn_config.clip_qkv: null` (DbrxConfig's default): transformers 5.23 clamps q, k and v with neither
    bound, and the run loaded the model and stopped in its reference stage on `RuntimeError: torch.clamp: At least
    one of 'min' or 'max' must not be None`. A bound set (DBRX's own 8) trains (checked: 2 steps of this model)."""
    import transformers

    attention = {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": None}
    experts = {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}
    model = tiny_model("dbrx", tmp_path / "dbrx", tiny_model_dir, attn_config=attention, ffn_config=experts)
    # another attn_config key in model_init_kwargs leaves clip_qkv null (transformers updates the keys given): it was
    # let through, and the run stopped on the clamp
    other = ["--model_init_kwargs", json.dumps({"attn_config": {"rope_theta": 10000.0}})]
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", model, "--max_steps", "2", *other, *dry_run)
    assert line == (
        f"error: {model}: attn_config.clip_qkv is null in its config.json, and transformers "
        f"{transformers.__version__}'s DBRX attention clamps q, k and v by it even so, which stops the first forward "
        "(torch.clamp: At least one of 'min' or 'max' must not be None): set clip_qkv in attn_config of its "
        "config.json to the bound the model was trained with (DBRX's own: 8), or to one no activation reaches (1e9) if "
        "it was trained unclipped"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_dbrx_with_no_rope_theta_is_refused_before_it_loads(dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """DBRX whose attn_config has no rope_theta (a default DbrxConfig's): transformers 5.23 cannot build the model,
    and the run read its data and stopped at the load in an AttributeError traceback."""
    import transformers

    attention = {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8}
    experts = {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}
    model = tiny_model("dbrx", tmp_path / "dbrx", tiny_model_dir, attn_config=attention, ffn_config=experts)
    config = json.loads((Path(model) / "config.json").read_text())
    del config["attn_config"]["rope_theta"]
    (Path(model) / "config.json").write_text(json.dumps(config))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", model, "--max_steps", "2", *dry_run)
    assert line == (
        f"error: {model}: attn_config has no rope_theta in its config.json, and transformers "
        f"{transformers.__version__} builds DBRX's rotary embedding from it (the load stops: 'DbrxAttentionConfig' "
        "object has no attribute 'rope_theta'): set rope_theta in attn_config of its config.json to the base the "
        "model was trained with (DBRX's own: 500000)"
    )


@pytest.mark.slow  # trains 2 steps in this process (10-20 s on 2 cores): the refusals above stay in the fast tier
@pytest.mark.parametrize(
    "model_type, fix", [("doge", ["--router_aux_loss_coef", "0"]), ("jetmoe", ["--activation_checkpointing", "false"])]
)
def test_the_fix_a_model_refusal_names_trains(model_type, fix, tmp_path, tiny_model_dir):
    """The fix the refusal above names for a model the run cannot train as set is one that trains."""
    out = tmp_path / "fixed"
    model = tiny_model(model_type, tmp_path / model_type, tiny_model_dir)
    args = ["--model_name_or_path", model, *fix, "--output_dir", str(out), "--max_steps", "2", "--report_to", "none"]
    assert train_dpo.main(["--config", SMOKE, *args, "--samples_every", "0"]) in (0, None)
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == 2


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize("head", ["Olmo3ForSequenceClassification", "Olmo3Model"], ids=["reward model", "no head"])
def test_a_model_that_does_not_generate_text_is_refused_before_it_loads(
    head, dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A reward model (or a model without its language-model head) given as the policy: TRL loads the class its
    config.json names, and the run stopped in an AttributeError traceback ('... has no attribute generation_config')
    once the model had loaded, its head initialized at random."""
    model = tmp_path / "reward-model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"architectures": [head]}))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: {model} is a {head} (architectures in its config.json), a model that does not generate text: DPO "
        "trains a causal language model (Olmo3ForCausalLM): give the model to train, e.g. your SFT model, not a "
        "reward or base model"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize("kind", ["an encoder-decoder", "a masked language model"])
def test_a_model_that_is_not_decoder_only_is_refused_before_it_loads(
    kind, dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A T5 (encoder-decoder) or a BERT masked LM, which generate or fill in text but not one token after the other in
    one sequence, as TRL's DPOTrainer scores them: the run loaded it and stopped in a traceback in the reference stage
    (`You must specify exactly one of input_ids or inputs_embeds`; `... has no attribute 'generation_config'`), and
    the dry run in its memory plan (`Unrecognized configuration class ... for AutoModelForCausalLM`) or planned it."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    shape = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    if kind == "an encoder-decoder":
        model = T5ForConditionalGeneration(T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, **shape))
        named, causal = "T5ForConditionalGeneration", "a causal language model"
    else:
        model = BertForMaskedLM(
            BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, **shape)
        )
        named, causal = "BertForMaskedLM", "a causal language model (BertLMHeadModel)"
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(folder), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: {folder} is a {named} (architectures in its config.json), {kind}: DPO here trains {causal}, which "
        "reads each token after the ones before it, as TRL's DPOTrainer scores them: give a decoder-only model "
        "(...ForCausalLM)"
    )


def sentencepiece_file(path) -> None:
    """A SentencePiece model file (byte fallback and a few pieces), written with transformers' copy of its protobuf."""
    from transformers.convert_slow_tokenizer import import_protobuf

    model = import_protobuf().ModelProto()
    model.trainer_spec.model_type, model.trainer_spec.byte_fallback = 1, True  # unigram
    pieces = [("<unk>", 2), ("<s>", 3), ("</s>", 3), *((f"<0x{b:02X}>", 6) for b in range(256)), ("\u2581the", 1)]
    for text, kind in pieces:
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = text, 0.0, kind
    path.write_bytes(model.SerializeToString())


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None, reason="reads SentencePiece files")
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_sentencepiece_tokenizer_without_its_package_is_refused_naming_it(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A folder whose tokenizer is a SentencePiece tokenizer.model alone (no tokenizer.json: Llama 2 / Mistral era
    saves): transformers needs the sentencepiece package to read it, and without it fell back to reading it as a
    tiktoken file, a traceback saying "`tiktoken` is required" once the data had been read."""
    model = tmp_path / "spm-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    sentencepiece_file(model / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *dry_run)
    assert line == (
        f"error: model folder '{model}' holds its tokenizer as a SentencePiece tokenizer.model alone (no "
        "tokenizer.json), which transformers reads with the sentencepiece package, not installed here: pip install "
        "sentencepiece"
    )


def test_a_bpe_tokenizer_saved_as_vocab_and_merges_alone_is_refused_with_the_command_that_writes_its_json(
    tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A folder whose tokenizer is vocab.json and merges.txt alone (no tokenizer.json: GPT-2 era saves), for a model
    type whose tokenizer transformers builds from tokenizer.json only (OLMo's): transformers' ValueError said to install
    sentencepiece or tiktoken, and the run took the files for damaged ("cut off while it was written or copied?: copy
    the model's folder again"). The line gives the command that writes tokenizer.json, after which the run reads the
    same token ids."""
    import shlex

    import transformers

    from dpotrain.data import lengths

    model = tmp_path / "bpe-model"
    shutil.copytree(tiny_model_dir, model)
    saved = json.loads((model / "tokenizer.json").read_text())
    (model / "vocab.json").write_text(json.dumps(saved["model"]["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in saved["model"]["merges"]]
    (model / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((model / "tokenizer_config.json").read_text())
    special = {"special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    added = {str(t["id"]): {"content": t["content"], **special} for t in saved["added_tokens"]}
    config = {**config, "tokenizer_class": "GPT2Tokenizer", "added_tokens_decoder": added, "add_prefix_space": False}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "tokenizer.json").unlink()
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2")
    assert line == (
        f"error: model folder '{model}' holds its tokenizer as vocab.json and merges.txt alone (no tokenizer.json), "
        f"from which transformers {transformers.__version__} builds no tokenizer for this model's type (it needs a "
        "tokenizer.json): write one with the tokenizer's own class: python -c \"import sys; from transformers import "
        f'GPT2Tokenizer as T; T.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[1])" {model}'
    )
    command = shlex.split(line.split(": python ", 1)[1])
    subprocess.run([sys.executable, *command], check=True, capture_output=True)
    text = "<|im_start|>user\nWhat is 2 plus 2? Then tell me about tides.<|im_end|>\n"
    ids = [lengths.load_tokenizer(str(m))(text)["input_ids"] for m in (tiny_model_dir, model)]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_lora_names_and_settings_peft_would_ignore_or_refuse_are_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """lora_modules_to_save and lora_target_parameters names the model lacks were dropped by PEFT without a word (a
    typo in `lm_head` trained the adapter alone), lora_target_parameters matching nothing (alone) and settings PEFT's
    wrap refuses stopped in a traceback once the model had loaded: the memory plan, which wraps the model on the meta
    device, plans bf16 GPU runs only."""
    lora = ["--model_name_or_path", tiny_model_dir, "--use_peft", "true", "--max_steps", "2", *dry_run]
    line = refused(
        tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", "q_proj", "--lora_modules_to_save", "lm_hed"
    )
    assert line.startswith(
        f"error: lora_modules_to_save lm_hed: {tiny_model_dir} has no module of that name (PEFT would train without "
        "it once the model loaded): its modules are named model, embed_tokens, layers, self_attn, q_proj,"
    )
    assert line.endswith(", lm_head; pass some of those, or remove lora_modules_to_save")
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_parameters", "mlp.experts.gate_up_proj")
    assert line.startswith(
        f"error: lora_target_parameters mlp.experts.gate_up_proj: {tiny_model_dir} has no parameter of that name "
        "(PEFT would stop once the model loaded): its parameters are named model.embed_tokens.weight, "
        "self_attn.q_proj.weight,"
    )
    line = refused(
        tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", "q_proj", "--lora_target_parameters", "w"
    )
    assert "lora_target_parameters w: " in line and "(PEFT would adapt the others alone once the model loaded)" in line
    # A name PEFT matches, on a layer it cannot wrap that way: PEFT's own reason, in one line
    line = refused(
        tmp_path,
        monkeypatch,
        capsys,
        *lora,
        "--lora_target_modules",
        "q_proj",
        "--lora_target_parameters",
        "q_proj.weight",
    )
    assert line.startswith(
        f"error: use_peft: PEFT cannot adapt {tiny_model_dir} with these LoRA settings (Trying to wrap"
    )
    line = refused(  # PEFT's TypeError: lm_head trained whole and adapted by its weight
        tmp_path,
        monkeypatch,
        capsys,
        *lora,
        "--lora_target_modules",
        "q_proj",
        "--lora_modules_to_save",
        "lm_head",
        "--lora_target_parameters",
        "lm_head.weight",
    )
    assert line.startswith(f"error: use_peft: PEFT cannot adapt {tiny_model_dir} with these LoRA settings (modules_to")
    # A regular expression matching attention blocks, not layers: the block named by its class, not its printed tree
    line = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_target_modules", ".*self_attn")
    assert line.startswith(
        f"error: use_peft: PEFT cannot adapt {tiny_model_dir} with these LoRA settings (Target module "
        "Olmo3Attention is not supported."
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_plain_text_pairs_with_a_tokenizer_without_eos_are_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """TRL ends plain-text completions with the tokenizer's EOS token: a tokenizer without one passed every check (the
    dry run planned, the analyzer measured the pairs without it) and the run died once the model had loaded, in TRL's
    map (TypeError: endswith first arg must be str ..., not NoneType)."""
    import shutil

    from datasets import Dataset

    from dpotrain.data import lengths

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["eos_token"], config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}.", "rejected": f" {i + 2}."} for i in range(20)]
    data = write_rows(tmp_path / "text.jsonl", rows)
    args = ["--model_name_or_path", str(model), "--dataset_name", data, "--max_steps", "2", *dry_run]
    want = (
        f"error: the tokenizer of {model} has no EOS token, and the data set's rows are plain text, whose completions "
        "the trainer ends with it: set eos_token in its tokenizer_config.json, or give the pairs as message lists (the "
        "chat template then ends each answer)"
    )
    assert refused(tmp_path, monkeypatch, capsys, *args) == want
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="has no EOS token"):  # the analyzer's measure, as the run's
        lengths.measure(Dataset.from_list(rows), lengths.load_tokenizer(str(model)))


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_plain_text_that_would_train_two_bos_or_two_eos_is_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """TRL tokenizes plain text with the tokenizer's own special tokens (`tokenizer(text)`) and ends each completion
    with EOS: prompts written with the BOS token (a pre-rendered chat) under a tokenizer that adds BOS itself (Llama's)
    trained every sequence as `<s><s>...`, and a tokenizer that appends EOS itself (add_eos_token) every answer as
    `...</s></s>`; both ran and were measured so without a word."""
    from datasets import Dataset

    from dpotrain.data import lengths

    rows = [{"prompt": f"<|endoftext|>{i} + 1 =", "chosen": f" {i + 1}.", "rejected": f" {i + 2}."} for i in range(20)]
    data = write_rows(tmp_path / "text.jsonl", rows)
    model = adding_specials(tiny_model_dir, tmp_path / "bos", "<|endoftext|> $A")
    args = ["--model_name_or_path", str(model), "--dataset_name", data, "--max_steps", "2", *dry_run]
    assert refused(tmp_path, monkeypatch, capsys, *args) == (
        f"error: the prompts begin with the BOS token '<|endoftext|>', and the tokenizer of {model} adds it itself, "
        "so every sequence would start with two: remove '<|endoftext|>' from the start of the prompts"
    )
    unwritten = [{**row, "prompt": row["prompt"].removeprefix("<|endoftext|>")} for row in rows]
    assert lengths.measure(Dataset.from_list(unwritten), lengths.load_tokenizer(str(model))).rows == 20
    model = adding_specials(tiny_model_dir, tmp_path / "eos", "$A <|im_end|>")
    args[1], args[3] = str(model), write_rows(tmp_path / "unwritten.jsonl", unwritten)
    assert refused(tmp_path, monkeypatch, capsys, *args) == (
        f"error: the tokenizer of {model} appends its EOS token '<|im_end|>' to every text, and the trainer ends each "
        "plain-text completion with it as well, so every answer would end in two: remove '<|im_end|>' from the "
        "post_processor in its tokenizer.json, or give the pairs as message lists (the chat template then ends each "
        "answer)"
    )
    assert not (tmp_path / "run").exists()


ENDLESS = (  # a user's own templates: turns ended by a newline alone, or by a token the model does not stop at
    "{% for m in messages %}{{ m['role'] + ':\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:\\n' }}{% endif %}",
    builtin.CHAT_TEMPLATE.replace("<|im_end|>", "<|endoftext|>"),
)


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize("template", ENDLESS, ids=["newline", "another token"])
def test_a_chat_template_whose_answers_end_without_a_token_the_model_stops_at_is_refused(
    template, dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """TRL trains what the chat template writes after an answer (it adds EOS to plain text only): a template that ends
    the assistant turn with no token the model stops generating at (its tokenizer's EOS, config.json's and
    generation_config.json's eos_token_id) trained every answer without an end, and the run said nothing; the model
    learns not to stop. Listing the turn's end token in generation_config.json (as instruct models do) is the fix."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (tmp_path / "mine.jinja").write_text(template)
    args = ["--model_name_or_path", str(model), "--chat_template_path", str(tmp_path / "mine.jinja")]
    args += ["--max_steps", "2", *dry_run]
    end = "'\\n'" if "<|endoftext|>" not in template else "'<|endoftext|>\\n'"
    assert refused(tmp_path, monkeypatch, capsys, *args) == (
        f"error: the chat template ends each answer with {end}, and {model} stops generating at none of its tokens "
        "(it stops at '<|im_end|>': the EOS of its tokenizer, config.json and generation_config.json), so every answer "
        "would train without an end and the model would learn not to stop: give a chat template that ends the "
        "assistant turn with '<|im_end|>' (chat_template_path), or add the id of the token that ends its turns to "
        "eos_token_id in generation_config.json"
    )
    assert not (tmp_path / "run").exists()
    if "<|endoftext|>" in template and dry_run:
        generation = json.loads((model / "generation_config.json").read_text())
        generation["eos_token_id"] = [generation["eos_token_id"], 0]  # <|endoftext|>: the built-in's id 0
        (model / "generation_config.json").write_text(json.dumps(generation))
        monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", str(tmp_path / "builtin"))
        with pytest.raises(SystemExit) as ended:
            run_cli(lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), *args]))
        assert ended.value.code in (0, None), capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
@pytest.mark.parametrize(
    "setting, expected",
    [
        (
            {"num_return_sequences": 2},  # written for sampling, without do_sample
            "error: the generation_config.json of {model} is one transformers {version} refuses to load (ValueError: "
            "Greedy methods (do_sample != True) without beam search do not support `num_return_sequences` different "
            "than 1 (got 2)): correct or remove that setting in it",
        ),
        (
            None,  # cut short by a copy
            "error: {model}/generation_config.json is not a JSON file (JSONDecodeError: Expecting property name "
            "enclosed in double quotes: line 2 column 1 (char 20)), which transformers would leave unread (the model "
            "saved with generation settings made from its config.json): correct it, or remove it",
        ),
    ],
    ids=["refused by transformers", "not JSON"],
)
def test_a_generation_config_transformers_cannot_read_is_refused_before_the_model_loads(
    setting, expected, dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """A model's generation_config.json is loaded with its weights: one transformers refuses (`num_return_sequences`
    without sampling, as a sampling recipe saved it) passed the dry run, and the run ended in a ValueError traceback
    once its first half was done; one that is not JSON was dropped without a word (the model trained and was saved
    with generation settings made from config.json, its own eos_token_id list lost)."""
    import transformers

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    generation = model / "generation_config.json"
    if setting is None:
        generation.write_text('{"bos_token_id": 0,\n')
    else:
        generation.write_text(json.dumps(json.loads(generation.read_text()) | setting))
    args = ["--model_name_or_path", str(model), "--max_steps", "2", *dry_run]
    line = refused(tmp_path, monkeypatch, capsys, *args)
    assert line == expected.format(model=model, version=transformers.__version__)
    assert not (tmp_path / "run").exists()


# The dry run reads the names of safetensors weights alone (a .bin's are in its pickle: reading them is loading them)
IN_SAFETENSORS = ("from DDP, in safetensors", "index short of one", "without lm_head")
LACKING = [(saved, []) for saved in ("from DDP", *IN_SAFETENSORS)]
LACKING += [(saved, ["--dry-run"]) for saved in IN_SAFETENSORS]
LORA = ["--use_peft", "true", "--lora_target_modules", "all-linear"]  # the base model's weights load as a full run's
LACKING.append(("from DDP, in safetensors", ["--dry-run", *LORA]))


def test_a_tensor_transformers_zero3_load_renames_away_is_refused_naming_zero2_not_a_resave(tmp_path, tiny_model_dir):
    """transformers' ZeRO-3 load renames every name DeepSeek V4's checkpoint conversion matches, its own final norm
    too (`model.norm.weight` by the `.norm.` -> `.kv_norm.` rule), so a model it saved itself lacked that tensor under
    ZeRO-3 alone (checked: a 2-process ZeRO-3 launch of a tiny DeepSeek V4), and the refusal said to save it with
    save_pretrained, which it was. Where the files hold every tensor the ZeRO-3 load missed, the refusal says so and
    names ZeRO-2; a tensor the files lack is refused as before."""
    from transformers import AutoModelForCausalLM

    from dpotrain.train.weight_names import refusal

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    total = len(model.state_dict())
    renamed = {"missing_keys": {"model.norm.weight"}, "unexpected_keys": set()}
    assert str(refusal(tiny_model_dir, model, renamed, zero3=True)) == (
        f"under DeepSpeed ZeRO-3, transformers' load of {tiny_model_dir} leaves out 1 of the model's {total} tensors "
        "(model.norm.weight), which its files hold under these names (its ZeRO-3 load renames them) and which it "
        "would start at random: train under ZeRO-2 (accelerate_config.yaml), whose load reads them"
    )
    for lacking, zero3 in (
        (renamed, False),
        ({"missing_keys": {"model.kv_norm.weight"}, "unexpected_keys": set()}, True),
    ):
        assert str(refusal(tiny_model_dir, model, lacking, zero3=zero3)).startswith(
            f"the weights of {tiny_model_dir} lack 1 of the model's {total} tensors"
        )
    assert refusal(tiny_model_dir, model, {"missing_keys": set(), "unexpected_keys": set()}, zero3=True) is None


@pytest.mark.parametrize("saved, args", LACKING, ids=[f"{saved}: {' '.join(args) or 'run'}" for saved, args in LACKING])
def test_weights_lacking_some_of_the_models_tensors_are_refused_by_the_dry_run_and_as_the_model_loads(
    saved, args, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """transformers starts a tensor the weights lack at random, prints a table and goes on: a state dict saved from a
    DDP-wrapped model (every name `module.`-prefixed) scored the reference and trained a random model, and an index
    whose weight_map left a tensor out trained that tensor from random, without a refusal. Refused as the model loads,
    before the reference stage; and by the dry run, from the names in the safetensors files' headers, with the same
    line: it planned them, and a Slurm job found them once its ranks had started and loaded the weights."""
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    total = len(weights)
    if saved.startswith("from DDP"):
        wrapped = {f"module.{name}": tensor for name, tensor in weights.items()}
        if saved == "from DDP":
            torch.save(wrapped, model / "pytorch_model.bin")
        else:
            save_file(wrapped, model / "model.safetensors")
        first = sorted(weights)[0]
        lacked = f"{total} of the model's {total} tensors ({first}, ...)"
        held = f"; they hold {total} the model has no place for (module.{first}, ...)"
    elif saved == "index short of one":
        left_out = "model.layers.1.mlp.down_proj.weight"
        save_file({k: v for k, v in weights.items() if k != left_out}, model / "model-00001-of-00002.safetensors")
        save_file({left_out: weights[left_out]}, model / "model-00002-of-00002.safetensors")
        weight_map = {name: "model-00001-of-00002.safetensors" for name in weights if name != left_out}
        index = {"metadata": {}, "weight_map": weight_map}  # the second shard left out of it
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
        lacked, held = f"1 of the model's {total} tensors ({left_out})", ""
    else:  # the built-in model's embeddings are untied: its own lm_head, which the weights lack
        save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, model / "model.safetensors")
        lacked, held = f"1 of the model's {total} tensors (lm_head.weight)", ""
    line = refused(tmp_path, monkeypatch, capsys, "--model_name_or_path", str(model), "--max_steps", "2", *args)
    assert line == (
        f"error: the weights of {model} lack {lacked}, which transformers would start at random{held}: save the "
        "model with save_pretrained (a state dict saved from a wrapped model, DDP's or PEFT's, names its tensors with "
        "a prefix such as 'module.'), or copy in the missing weights"
    )
    assert not list((tmp_path / "run").glob("*.safetensors"))


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_untying_a_tied_models_output_layer_in_model_init_kwargs_is_refused_naming_the_override(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """`--model_init_kwargs '{"tie_word_embeddings": false}'` on a model saved tied: transformers starts the untied
    lm_head at random, and the refusal blamed the weights ("save the model with save_pretrained"), which were saved so;
    the dry run skipped its check for any model_init_kwargs and said nothing. Both name the override now; another
    config field that adds tensors (more layers) is named beside the usual fixes."""
    from conftest import tiny_model

    folder = tiny_model("llama", tmp_path / "tied", tiny_model_dir, tie_word_embeddings=True)
    args = ["--model_name_or_path", folder, "--max_steps", "2", *dry_run]
    untie = ["--model_init_kwargs", '{"tie_word_embeddings": false}']
    assert refused(tmp_path, monkeypatch, capsys, *args, *untie) == (
        f"error: model_init_kwargs tie_word_embeddings false unties the output layer of {folder} from its input "
        "embeddings, but its weights hold no lm_head.weight (a tied model's weights hold the input embeddings alone): "
        "transformers would start it at random. Leave tie_word_embeddings out of model_init_kwargs (a model saved tied "
        "trains tied), or save an untied copy first (lm_head.weight a copy of its input embeddings, "
        "tie_word_embeddings false in its config.json)"
    )
    line = refused(tmp_path, monkeypatch, capsys, *args, "--model_init_kwargs", '{"num_hidden_layers": 3}')
    assert "which transformers would start at random: model_init_kwargs sets num_hidden_layers of its config" in line


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_tokenizer_with_neither_pad_nor_eos_token_is_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """TRL pads with the recipe's pad_token, else the tokenizer's, else its EOS: with none of them the dry run planned
    and the run died once the model had loaded, in TRL's __init__ (ValueError: The specified `pad_token` ('None') is
    not found in the vocabulary ...)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["eos_token"], config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["--model_name_or_path", str(model), "--padding_free", "false", "--max_steps", "2", *dry_run]
    assert refused(tmp_path, monkeypatch, capsys, *args) == (
        f"error: the tokenizer of {model} has neither a pad token nor an EOS token, one of which the trainer pads "
        "with: give --pad_token, one of its tokens (which one does not matter: padding is masked by length), or set "
        "pad_token in its tokenizer_config.json"
    )


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_pad_token_the_tokenizer_does_not_have_is_refused_before_the_model_loads(
    dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    """`pad_token` (TRL's DPOConfig) outside the vocabulary: packed (the default) the run trained and recorded it in
    resolved_config.json without ever setting it; padded, TRL raised its ValueError once the model had loaded."""
    args = ["--model_name_or_path", tiny_model_dir, "--pad_token", "<nope>", "--max_steps", "2", *dry_run]
    line = refused(tmp_path, monkeypatch, capsys, *args)
    assert line == (
        f"error: pad_token '<nope>' is not a token of the tokenizer of {tiny_model_dir}: give one of its tokens (e.g. "
        "its EOS token '<|im_end|>'), or leave pad_token out (the tokenizer's own pad token, else its EOS token)"
    )
    assert not (tmp_path / "run").exists()


def test_neftune_is_refused_where_the_run_packs(tiny_model_dir):
    """transformers' NEFTune hook scales each embedding's noise by 1 / sqrt(width x hidden size) of the tensor it sees:
    padded, the batch's longest sequence, as in TRL and the paper; a packed row (the default) holds a micro-batch's
    sequences end to end, so the noise was smaller by the budget, under a record of the alpha asked. Padded it applies.
    """
    from transformers import AutoConfig

    from dpotrain.forwards import choice

    config = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError) as refused_here:
        choice.candidates(config, parse_args(["--config", SMOKE, "--neftune_noise_alpha", "5"]), False, None)
    assert str(refused_here.value).startswith(
        "neftune_noise_alpha 5 would not be NEFTune's: its noise is scaled by the length of the row it sees, and this "
        "run packs its pairs (padding_free, the default)"
    ) and str(refused_here.value).endswith(
        "pass --padding_free false (TRL's padded collator), or remove neftune_noise_alpha"
    )
    padded = parse_args(["--config", SMOKE, "--neftune_noise_alpha", "5", "--padding_free", "false"])
    (only,), _ = choice.candidates(config, padded, False, None)
    assert not only.packed


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_pad_to_multiple_of_is_refused_where_the_run_packs(dry_run, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """Only TRL's padded collator reads pad_to_multiple_of: a packed run (the default) trained without it and recorded
    it in resolved_config.json. Padded (`padding_free: false`, or a model that cannot pack) it applies."""
    from transformers import AutoConfig

    from dpotrain.forwards import choice

    args = ["--model_name_or_path", tiny_model_dir, "--pad_to_multiple_of", "64", "--max_steps", "2", *dry_run]
    line = refused(tmp_path, monkeypatch, capsys, *args)
    assert line.startswith("error: pad_to_multiple_of 64 would be ignored: it pads TRL's padded batches") and (
        "--padding_free false" in line
    )
    assert not (tmp_path / "run").exists()
    padded = parse_args(["--config", SMOKE, "--pad_to_multiple_of", "64", "--padding_free", "false"])
    (only,), _ = choice.candidates(AutoConfig.from_pretrained(tiny_model_dir), padded, False, None)
    assert not only.packed


@pytest.mark.parametrize("given", [[], ["--pad_token", "<|endoftext|>"]], ids=["none", "recipe's"])
def test_a_packed_run_sets_the_pad_token_as_trl_does(given, tmp_path, tiny_model_dir):
    """TRL sets the recipe's pad_token on the tokenizer saved with the model and on the model's configs only where it
    builds its padded collator: a packed run recorded it and never set it. Without one, the tokenizer's EOS."""
    import shutil

    import datasets

    from conftest import built

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["--config", SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"), *given]
    recipe = parse_args([*args, "--max_steps", "1", "--warmup_steps", "0", "--report_to", "none"])
    trainer = built(recipe, datasets.Dataset.from_list([pair(), pair("Red.", "Pink.")] * 4)).trainer
    want = "<|endoftext|>" if given else "<|im_end|>"  # the recipe's, else the EOS token
    assert trainer.packed and trainer.processing_class.pad_token == want
    want_id = trainer.processing_class.convert_tokens_to_ids(want)
    assert trainer.model.config.pad_token_id == trainer.model.generation_config.pad_token_id == want_id


@pytest.mark.parametrize(
    "args",
    [
        ["--label_smoothing", "0.0", "--discopop_tau", "0.05", "--ref_model_sync_steps", "512"],  # the defaults
        ["--loss_type", "sigmoid", "robust", "--label_smoothing", "0.1"],  # robust reads it
        ["--loss_type", "discopop", "--discopop_tau", "0.1"],
        ["--f_divergence_type", "alpha_divergence", "--f_alpha_divergence_coef", "0.3"],
        ["--loss_type", "sigmoid", "sft", "--ld_alpha", "0.5", "--assistant_turns", "final"],
        ["--sync_ref_model", "true", "--precompute_ref_log_probs", "false", "--ref_model_sync_steps", "4"],
    ],
)
def test_options_the_loss_reads_pass(args):
    """The other side of the refusals above: an option at its default, or read by one of the configured losses."""
    from dpotrain.train import losses

    losses.check_options(parse_args(["--config", SMOKE, *args]))


@pytest.mark.parametrize(
    "name",
    [
        "sdpa",
        "eager",
        "flex_attention",
        "flash_attention_2",
        "flash_attention_3",
        "paged|eager",
        "paged|sdpa",  # transformers 5 drops the prefix (a FutureWarning) and trains on sdpa: it was refused
        "paged|flash_attention_2",
        "kernels-community/flash-attn3",
        "kernels-community/vllm-flash-attn3@v1",
    ],
)
def test_attention_names_transformers_takes_pass(name):
    """The other side of the unknown attn_implementation's refusal: every name transformers builds a model with."""
    from dpotrain.forwards import choice

    choice.check_attention_name(name)


def test_optim_args_at_their_defaults_are_read(monkeypatch):
    """AdEMAMix's optim_args as its paper gives them (beta3=0.9999, alpha=5.0: transformers' defaults) build the
    optimizer the defaults build, and were refused as 'would be ignored: optim ademamix reads none of it'. Here on a
    stand-in for bitsandbytes, which this machine lacks and a GPU cluster has."""
    import sys
    import types

    import torch
    from transformers import trainer_optimizer
    from trl import DPOConfig

    from dpotrain import options

    class Stand(torch.optim.SGD):
        def __init__(self, params, lr, **_):
            super().__init__(params, lr=lr)

    optim = types.ModuleType("bitsandbytes.optim")
    optim.AdamW = optim.Lion = optim.RMSprop = optim.AdEMAMix = Stand
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", optim)
    monkeypatch.setattr(trainer_optimizer, "is_bitsandbytes_available", lambda: True)
    given = "beta1=0.9,beta2=0.999,beta3=0.9999,alpha=5.0"
    args = DPOConfig(output_dir="unused", optim="ademamix", optim_args=given, use_cpu=True, bf16=False, report_to=[])
    options.check_optimizer(args)
    args.optim_args = f"{given},t_alpha=1000,alpah=5"
    with pytest.raises(ConfigError, match="optim ademamix does not read alpah, which would be ignored"):
        options.check_optimizer(args)


def test_adam_settings_an_optimizer_does_not_read_are_refused_but_not_a_recipe_files(tmp_path, monkeypatch, capsys):
    """`--optim sgd --adam_beta1 0.5` was accepted and recorded, and SGD read no beta (transformers passes the Adam
    settings to the Adam family alone): the run trained otherwise than its command line said. Refused where the
    optimizer built does not change with the setting; not a recipe file's where the command line changes the optim."""
    assert refused(tmp_path, monkeypatch, capsys, "--optim", "sgd", "--adam_beta1", "0.5", "--dry-run") == (
        "error: adam_beta1 0.5 would be ignored: optim sgd does not read it (transformers passes the Adam settings "
        "to Adam-family optimizers alone; Lion reads the betas): remove adam_beta1, or choose an optim that reads it "
        "(adamw_torch)"
    )
    assert "adam_epsilon 0.001 would be ignored: optim adafactor" in refused(
        tmp_path, monkeypatch, capsys, "--optim", "adafactor", "--adam_epsilon", "1e-3", "--dry-run"
    )
    from dpotrain.options import check_adam_settings

    for optim in ("adamw_torch", "adamw_torch_fused"):  # read: passes
        check_adam_settings(parse_args(["--config", SMOKE, "--optim", optim, "--adam_beta1", "0.8"]))
    recipe = tmp_path / "betas.yaml"
    recipe.write_text((ROOT / "configs" / "smoke.yaml").read_text() + "adam_beta2: 0.95\n")
    check_adam_settings(parse_args(["--config", str(recipe), "--optim", "sgd"]))  # the recipe file's, for one run
    with pytest.raises(ConfigError, match="adam_beta2 0.95 would be ignored: optim sgd"):
        check_adam_settings(parse_args(["--config", str(recipe), "--optim", "sgd", "--adam_beta2", "0.95"]))


def test_the_checks_build_the_scheduler_once_for_its_kwargs_and_its_walk(monkeypatch):
    """check_optimizer built one scheduler on a 10-step run to try lr_scheduler_kwargs and `_check_schedule` another on
    the walked run (issue #54): one build now serves both, and the walk still refuses what only later steps show."""
    import transformers
    from trl import DPOConfig

    from dpotrain import options

    built = []
    real = transformers.get_scheduler
    monkeypatch.setattr(transformers, "get_scheduler", lambda *a, **k: built.append(k) or real(*a, **k))
    given = {"lr_scheduler_type": "cosine_with_min_lr", "use_cpu": True, "bf16": False, "report_to": []}
    options.check_optimizer(DPOConfig(output_dir="unused", lr_scheduler_kwargs={"min_lr_rate": 0.1}, **given))
    assert [k["num_training_steps"] for k in built] == [options.WALKED_STEPS]
    built.clear()
    args = DPOConfig(output_dir="unused", lr_scheduler_kwargs={"min_lr_rate": 2}, **given)
    with pytest.raises(ConfigError, match=r"\{'min_lr_rate': 2\} takes the learning rate to 2 x learning_rate at 100%"):
        options.check_optimizer(args)
    assert len(built) == 1


@pytest.mark.parametrize(
    "kwargs, refused",
    [
        ({"num_stable_steps": 4, "num_decay_steps": 2}, None),  # 2 + 4 + 2: the run's 8 steps
        ({"num_decay_steps": 2}, None),  # the stable phase is what is left
        # a floor above 0 trains the last steps, at it: still not the schedule the phases describe
        (
            {"num_stable_steps": 2, "num_decay_steps": 2, "min_lr_ratio": 0.1},
            "at min_lr_ratio (0.1) x learning_rate for the last 2 steps: give num_stable_steps 4",
        ),
    ],
)
def test_warmup_stable_decay_phases_that_add_up_to_the_run_pass(kwargs, refused):
    from trl import DPOConfig

    from dpotrain.plan import plan

    args = DPOConfig(
        output_dir="unused",
        lr_scheduler_type="warmup_stable_decay",
        lr_scheduler_kwargs=kwargs,
        use_cpu=True,
        bf16=False,
        report_to=[],
    )
    steps = {"total_steps": 8, "warmup_steps": 2}
    if refused is None:
        plan.check_schedule_fits(steps, args)
    else:
        with pytest.raises(ConfigError, match=re.escape(refused)):
            plan.check_schedule_fits(steps, args)


def test_metric_for_best_model_takes_every_metric_an_evaluation_logs():
    """The names check_best_metric accepts are what an evaluation's metrics hold (a 6-step run's eval records held
    these, eval_ prefixed): every key `PairMetrics.reduce("eval")` makes, MoE's aux_loss and dpo_loss included."""
    from dpotrain.options import check_best_metric
    from dpotrain.train import pair_metrics

    metrics = pair_metrics.PairMetrics()
    metrics.sums["eval"] = dict.fromkeys(pair_metrics.SUMS, 1.0)
    assert sorted(metrics.reduce("eval", "cpu")) == sorted(pair_metrics.EVAL_LOGGED)
    held = [
        "--dataset_mixer_eval_list",
        "data/smoke_prefs.jsonl",
        "20",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
    ]
    for name in [*pair_metrics.EVAL_LOGGED, "eval_loss", "eval_rewards_norm/accuracies", "eval_runtime"]:
        check_best_metric(parse_args(["--config", SMOKE, *held, "--metric_for_best_model", name]))


@pytest.mark.parametrize("name", ["azure_ml", "flyte", "comet_ml"])
def test_a_report_to_whose_callback_starts_passes(name, monkeypatch):
    """transformers' list of available loggers never holds flyte, nor azure_ml beside mlflow, nor comet_ml without an
    API key, though their callbacks start with flytekit (azureml, comet_ml) installed: each was refused as 'needs its
    Python package' with it installed."""
    import importlib.util
    from types import SimpleNamespace

    from transformers.integrations import integration_utils as loggers

    from dpotrain import options

    for installed in ("is_azureml_available", "is_mlflow_available", "is_flytekit_available"):
        monkeypatch.setattr(loggers, installed, lambda: True)
    monkeypatch.setattr(loggers, "is_comet_available", lambda: False)  # installed, with no API key
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: object() if m == "comet_ml" else found(m, *a))
    training = SimpleNamespace(
        logging_strategy="steps",
        logging_steps=1,
        eval_strategy="no",
        eval_steps=None,
        include_num_input_tokens_seen="no",
        report_to=[name],
    )
    recipe = SimpleNamespace(
        training=training, project=SimpleNamespace(health_checks=True), given=set(), command_line=()
    )
    options.check_logging(recipe)


# --- 3: rows the trainer would crash on or silently train on ---------------------------------------------------------


@pytest.mark.parametrize(
    "bad, expected",
    [
        ({"chosen": None, "rejected": pair()["rejected"]}, "row 3, column 'chosen': missing (null)"),
        (  # said no fix
            pair(chosen=5),
            "row 3, column 'chosen': message 1 has a non-string 'content' (int): write it as a string or a list of "
            "text parts ([{'type': 'text', 'text': ...}]), which the chat template reads",
        ),
        (
            {**pair(), "rejected": [{"content": "Name a colour."}, {"role": "assistant", "content": "x"}]},
            "row 3, column 'rejected': message 0 has no 'role'",
        ),
        (
            {"chosen": "Blue.", "rejected": "Green."},
            "row 3, column 'chosen': a str where the data set has message lists (its first row has messages): write "
            "it as a list of messages",
        ),
        (pair(chosen=""), "row 3, column 'chosen': empty completion"),
        (pair(chosen="Same.", rejected="Same."), "row 3, column 'chosen': identical to `rejected`"),
    ],
)
def test_invalid_row_is_named_with_the_training_flag(bad, expected, tmp_path, monkeypatch, capsys):
    rows = many_rows()
    rows[3] = bad
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", write_rows(tmp_path / "d.jsonl", rows))
    assert expected in message and "--skip_invalid true" in message


@pytest.mark.parametrize(
    "odd, expected",
    [
        (pair()["chosen"], "row 20, column 'chosen': a list where the data set has plain text"),
        # a JSON number among text answers: it read "a int" and named no fix
        (7, "row 20, column 'chosen': an int where the data set has plain text (its first row is text): write it "),
    ],
)
def test_text_rows_then_another_type(odd, expected, tmp_path, monkeypatch, capsys):
    rows = [{"chosen": f"Blue {i}", "rejected": "Green"} for i in range(20)] + [{"chosen": odd, "rejected": "Red"}]
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", write_rows(tmp_path / "d.jsonl", rows))
    assert expected in message and "as the first row is" in message


# --- 4: runs that would train nothing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, rows, expected",
    [
        (["--max_steps", "0"], 40, "max_steps=0 trains nothing"),
        (["--num_train_epochs", "0"], 40, "num_train_epochs=0 trains nothing"),
        (
            [],
            1,
            # it read "1 optimizer step(s)" and "from 1 rows"
            "this run would train nothing: 1 optimizer step, 1 of warmup (learning rate 0 at step 1) from 1 row at 8 "
            "pairs per step",
        ),
        (["--per_device_train_batch_size", "16"], 12, "1 optimizer step, 1 of warmup"),
        # the schedule's peak after the run's last step: it never trained at the rate set
        (["--max_steps", "3", "--warmup_steps", "5"], 40, "warmup_steps makes 5 warm-up steps of the run's 3"),
    ],
)
def test_runs_that_train_nothing(args, rows, expected, tmp_path, monkeypatch, capsys):
    data = write_rows(tmp_path / "d.jsonl", many_rows(rows))
    assert expected in refused(tmp_path, monkeypatch, capsys, "--dataset_name", data, *args)


def test_steps_are_counted_on_the_pairs_training_keeps(tmp_path, capsys):
    """16 rows make 2 steps of 8 pairs, one of warm-up; keep_start drops the 8 whose prompt alone fills max_length,
    so the run's one step was its warm-up (learning rate 0): it trained nothing and finished as a run. The dry run
    refuses it (the run, once TRL has tokenized the pairs)."""
    long = [{"role": "user", "content": "word " * 1500}]
    rows = [pair(chosen=f"Blue {i}.", prompt=long if i % 2 else MESSAGES) for i in range(16)]
    data = write_rows(tmp_path / "d.jsonl", rows)
    args = ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--dataset_name", data, "--max_length", "1024"]
    with pytest.raises(SystemExit) as ended:  # a dry run: it reads the built-in model's tokenizer, no weights
        run_cli(lambda: train_dpo.main([*args, "--dry-run"]))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.rstrip().splitlines()[-1].startswith("error: this run would train nothing")
    assert "1 optimizer step, 1 of warmup (learning rate 0 at step 1) from the 8 pairs training keeps" in err


@pytest.mark.slow  # a process of its own
def test_a_run_its_kept_pairs_leave_nothing_to_train_is_refused_before_it_replaces_a_finished_run(
    tmp_path, tiny_model_dir
):
    """The run itself refused the pairs above only once TRL had tokenized them: after the model loaded, and after
    --overwrite_output_dir had removed the finished run in its folder, replaced by nothing. Where every pair's lengths
    are measured at start (here all 16), it is refused then, the old run whole."""
    from dpotrain.train import run_files

    out = tmp_path / "run"
    shutil.copytree(tiny_model_dir, out)  # a finished run, as a run leaves it, made without training
    (out / "run_complete.json").write_text('{"global_step": 2}\n')
    run_files.write(out, [run_files.MANIFEST, "run_complete.json", *os.listdir(tiny_model_dir)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    long = [{"role": "user", "content": "word " * 1500}]
    rows = [pair(chosen=f"Blue {i}.", prompt=long if i % 2 else MESSAGES) for i in range(16)]
    data = write_rows(tmp_path / "d.jsonl", rows)
    args = ["--config", SMOKE, "--output_dir", str(out), "--dataset_name", data, "--max_length", "1024"]
    second = run_train([*args, "--overwrite_output_dir", "--report_to", "none"])
    assert second.returncode == 2, second.stdout[-3000:]
    assert second.stdout.rstrip().splitlines()[-1].startswith("error: this run would train nothing: 1 optimizer step")
    assert "Replaced the run" not in second.stdout and {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- 5: bad values and inputs that used to fail after loading, as tracebacks ------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max_length", "-5"], "max_length must be >= 1 (got -5)"),
        (["--loss_type", "sigmoid_nrom"], "unknown loss_type 'sigmoid_nrom': choose from sigmoid, hinge"),
        (["--loss_type", "sigmoid_norm,sft"], "(several separated by spaces, not commas) (OLMo 3: sigmoid_norm)"),
        (["--model_name_or_path", "./no-such-model"], "model folder './no-such-model' does not exist"),
        (["--model_name_or_path", "outputs/sft/final"], "model folder 'outputs/sft/final' does not exist"),
        (["--model_name_or_path", "data/no-such-model"], "model folder 'data/no-such-model' does not exist"),
        (["--dataset_name", "data/smoke_prefs.jsnl"], "dataset 'data/smoke_prefs.jsnl' does not exist (looked in"),
        (["--train_sampling_strategy", "group_by_length"], "group_by_length does not work on preference data"),
        # recorded and unused: the step plan draws its own seeded order
        (["--train_sampling_strategy", "sequential"], "train_sampling_strategy sequential: the step plan draws each"),
        # the user's own held-out file, the likeliest fix, was not named
        (
            ["--eval_strategy", "steps"],
            "has one split only: put it and the held-out pairs in one folder as 'train.jsonl' and 'test.jsonl' "
            "and pass the folder (datasets reads a file named for a split as that split), name a file of held-out "
            "pairs with "
            "--dataset_mixer_eval_list",
        ),
        (["--dataset_test_split", "validation"], "dataset_test_split 'validation' is only used for evaluation"),
        # read only by evaluation, and no evaluation: eval_on_start failed in a traceback after the reference stage
        # (the Trainer evaluated no data set), the others were recorded and ignored
        (["--eval_on_start", "true"], "eval_on_start is only used for evaluation, and eval_strategy is no: add"),
        (["--eval_steps", "5"], "eval_steps is only used for evaluation, and eval_strategy is no: add"),
        # transformers' Trainer does not read do_eval: evaluated nothing under do_eval true (do_train false and
        # do_predict: test_options_that_cannot_be_honoured)
        (["--do_eval", "true"], "do_eval is only used for evaluation, and eval_strategy is no: add"),
        (
            ["--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20"],
            "dataset_mixer_eval_list is only used for evaluation, and eval_strategy is no: add --eval_strategy steps",
        ),
        (["--warmup_ratio", "0.1"], "unknown argument '--warmup_ratio' (removed in transformers 5: use warmup_steps"),
        # transformers reads 0 as a fraction of the run: no checkpoint until the end, a requeue restarts from nothing
        (
            ["--save_steps", "0"],
            "save_steps=0 saves no checkpoint until the end, and a requeued job would restart from "
            "step 0: give a number of steps (the recipes save every 100) or a fraction of the run (0.1), or "
            "--save_strategy no to save none on purpose",
        ),
        (["--evaluation_strategy", "steps"], "(renamed eval_strategy in transformers 5)"),
        # TRL's DPOConfig refused it with "`loss_weights` must have the same length as `loss_type`...": no fix named
        (
            ["--loss_type", "sigmoid", "sft", "--loss_weights", "1"],
            "loss_weights 1 gives 1 weight for 2 loss types (sigmoid sft): give one weight per type, in loss_type's "
            "order",
        ),
        (["--loss_weights", "1", "0.5"], "loss_weights 1 0.5 gives 2 weights for 1 loss type (sigmoid_norm): give"),
        # every term weighed 0: a loss and gradient of 0 at every step, accepted (TRL checks only their count)
        (
            ["--loss_type", "sigmoid", "sft", "--loss_weights", "0", "0", "--dry-run"],
            "loss_weights 0 0 weigh every loss term by 0: the run would train nothing",
        ),
        # a negative weight maximizes its term (TRL multiplies as given): trained toward rejected, unbounded for most
        (
            ["--loss_type", "sigmoid", "bco_pair", "--loss_weights", "1", "-0.2", "--dry-run"],
            "loss_weights: -0.2 x bco_pair is negative: a negative weight maximizes its loss term, training toward "
            "the rejected completions",
        ),
        (
            ["--loss_type", "sigmoid", "sft", "--loss_weights", "-1", "1", "--dry-run"],
            "loss_weights: -1 x sigmoid is negative:",
        ),
        # loaded the model, scored nothing (a live reference has no stage) and exited 0 as if it had
        (
            ["--reference_only", "true", "--precompute_ref_log_probs", "false", "--dry-run"],
            "reference_only runs the reference stage alone, and this run has none",
        ),
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "epoch"),
                *("--eval_steps", "5", "--dry-run"),
            ],
            "eval_steps 5 would be ignored: eval_strategy epoch evaluates at each epoch's end",
        ),
        # the health guards judge logged steps: past step 1 nothing was logged, so a NaN loss trained on to the end
        (["--logging_strategy", "no", "--dry-run"], "logging_strategy no leaves the health guards"),
        # under epoch they judged step 1 and each epoch's end alone: a doomed 1-epoch run (loss_floor tripped at step 2
        # under steps) trained every step and was stopped at its last
        (["--logging_strategy", "epoch", "--dry-run"], "logging_strategy epoch leaves the health guards"),
        # transformers reads project for Trackio alone: --report_to wandb --project my-dpo logged to W&B's
        # 'huggingface' (WANDB_PROJECT unset), and the run's note named WANDB_PROJECT without a word of --project
        (
            ["--report_to", "wandb", "--project", "my-dpo", "--dry-run"],
            "project 'my-dpo' would be ignored: transformers reads it for Trackio alone (report_to trackio), and this "
            "run reports to wandb, whose project is WANDB_PROJECT: set WANDB_PROJECT=my-dpo in .env (or the recipe's "
            "env:) and remove project",
        ),
        (
            ["--trackio_space_id", "org/space", "--dry-run"],
            "trackio_space_id 'org/space' would be ignored: transformers",
        ),
        # transformers' fraction of the run, rounded up: ceil(48 x -0.01) = 0 ended step 1 in a ZeroDivisionError once
        # the model had loaded and the reference was scored; -1 logged (evaluated) at multiples of -max_steps alone
        (["--logging_steps", "-0.01", "--dry-run"], "logging_steps=-0.01 is below 0: give a number of steps"),
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "steps"),
                *("--eval_steps", "-1", "--dry-run"),
            ],
            "eval_steps=-1 is below 0: give a number of steps",
        ),
        # transformers reads 0 as unset: the run evaluated every logging_steps (every 2 steps here, every step under
        # the OLMo 3 recipes) while the command line said 0, and the record held logging_steps' value
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "steps"),
                *("--eval_steps", "0", "--dry-run"),
            ],
            "eval_steps 0 is no schedule: transformers would evaluate every logging_steps (2) steps instead: give a "
            "number of steps (--eval_steps 50) or a fraction of the run (0.1), or remove eval_steps to evaluate "
            "every logging_steps",
        ),
        # the final model was the best checkpoint's (step 2 of 6) while the card and run_complete.json said step 6
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "steps"),
                *("--eval_steps", "2", "--save_steps", "2", "--load_best_model_at_end", "true", "--dry-run"),
            ],
            "load_best_model_at_end would save the best checkpoint's weights as the final model",
        ),
        # read only to judge an evaluation's metrics: without one, trainer_state.json's best_metric stayed null (a
        # 4-step run) while resolved_config.json recorded the metric that picked the best checkpoint
        (
            ["--metric_for_best_model", "eval_loss", "--dry-run"],
            "metric_for_best_model is only used for evaluation, and eval_strategy is no: add",
        ),
        (["--greater_is_better", "false", "--dry-run"], "greater_is_better is only used for evaluation, and eval_st"),
        # recorded and read by nothing: TRL's prediction step reads no label_names, and no worker persists without one
        (["--label_names", "labels"], "label_names ['labels'] would be ignored: only transformers' own prediction"),
        (
            ["--dataloader_persistent_workers", "true"],
            "dataloader_persistent_workers would be ignored: it keeps the loader's worker processes between epochs, "
            "and dataloader_num_workers is 0",
        ),
        # recorded and read by nothing without an evaluation loop
        (["--per_device_eval_batch_size", "4"], "per_device_eval_batch_size is only used for evaluation, and eval_st"),
        (["--eval_accumulation_steps", "2"], "eval_accumulation_steps is only used for evaluation, and eval_strategy"),
        (["--eval_delay", "10"], "eval_delay is only used for evaluation, and eval_strategy is no"),
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "steps"),
                *("--eval_steps", "2", "--greater_is_better", "true", "--dry-run"),
            ],
            "greater_is_better true would be ignored: it says which way metric_for_best_model improves, and the run "
            "has none: add --metric_for_best_model eval_loss, or remove greater_is_better",
        ),
        # transformers' KeyError at the first evaluation, after the model loaded and the steps before it trained
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "steps"),
                *("--eval_steps", "2", "--metric_for_best_model", "eval_acc", "--dry-run"),
            ],
            "metric_for_best_model 'eval_acc' is not a metric the evaluation logs: choose one of eval_rewards/chosen, ",
        ),
        # the best checkpoint is one of the run's checkpoints: with none, the metric picked nothing
        (
            [
                *("--dataset_mixer_eval_list", "data/smoke_prefs.jsonl", "20", "--eval_strategy", "steps"),
                *("--eval_steps", "2", "--metric_for_best_model", "eval_loss", "--save_strategy", "no", "--dry-run"),
            ],
            "metric_for_best_model eval_loss picks the best of the run's checkpoints (kept from save_total_limit's "
            "rotation, named in trainer_state.json), and save_strategy is no: add --save_strategy steps",
        ),
        # without evaluation: transformers' multi-line error, whose advice (evaluate on the save schedule) led to the
        # refusal above
        (
            ["--load_best_model_at_end", "true", "--dry-run"],
            "load_best_model_at_end would save the best checkpoint's weights as the final model",
        ),
        # won over the run's own fields at load: bf16 weights while the dry run and resolved_config.json said float32
        (
            ["--model_init_kwargs", '{"dtype": "bfloat16"}', "--dry-run"],
            "model_init_kwargs 'dtype' would override dtype, which the run plans and records by: give --dtype "
            "bfloat16 instead",
        ),
        (
            ["--model_init_kwargs", '{"attn_implementation": "eager"}', "--dry-run"],
            "give --attn_implementation eager instead",
        ),
        (["--model_init_kwargs", '{"revision": "v2"}', "--dry-run"], "give --model_revision v2 instead"),
        # "unknown report_to 'wandb,none': choose from ..., wandb, or none", which listed the names it held
        (
            ["--report_to", "wandb,none"],
            "report_to 'wandb,none' names several in one word, and a run logs to one: give one of them (--report_to "
            "wandb; none turns logging off)",
        ),
        # accepted, and a launch of several processes could not form its group ("timed out after 0ms")
        (["--ddp_timeout", "0"], "ddp_timeout must be >= 1 (got 0): the seconds each process waits for the others"),
        # a token there was written, as given, into resolved_config.json and every checkpoint's
        (
            ["--model_init_kwargs", '{"token": "hf_secret"}', "--dry-run"],
            "model_init_kwargs 'token' would be recorded with the run (resolved_config.json, each checkpoint's "
            "training_args.bin): give the token as HF_TOKEN (.env, the environment) or `hf auth login`, and remove "
            "'token' from model_init_kwargs",
        ),
        # numpy's seeding refused them with a traceback, after the data had loaded (a run: after the model too)
        (["--seed", "-3"], "seed -3 is out of range: give one from 0 to 2**32 - 1"),
        (["--data_seed", "-1"], "data_seed -1 is out of range: give one from 0 to 2**32 - 1"),
        # a real run started, training where the resolved configuration on stdout was asked for
        (["--json"], "--json prints the dry run's resolved configuration: add --dry-run"),
        # recorded and ignored: the recipe's token budget cut the step of pairs_per_step as it always does
        (
            ["--pairs_per_step", "8", "--gradient_accumulation_steps", "3"],
            "gradient_accumulation_steps would not be used: max_tokens_per_microbatch cuts each step of "
            "pairs_per_step=8 pairs into micro-batches",
        ),
        (
            ["--pairs_per_step", "8", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1"],
            "gradient_accumulation_steps and per_device_train_batch_size would not be used",
        ),
    ],
)
def test_bad_values_refused_before_loading(args, expected, tmp_path, monkeypatch, capsys):
    assert expected in refused(tmp_path, monkeypatch, capsys, *args)


@pytest.mark.parametrize(
    "args, expected",
    [
        # text that is no JSON object: kept as text by transformers, and the run ended in a traceback ("string indices
        # must be integers" at the checks; "'str' object has no attribute 'get'" once the model had loaded)
        (
            ["--model_init_kwargs", "dtype=bfloat16"],
            "model_init_kwargs takes a JSON object, and the text given is not one: write it as --model_init_kwargs "
            """'{"key": value}' (in a recipe: `key: value` lines indented below model_init_kwargs:), """
            "or '{}' for none",
        ),
        (["--model_init_kwargs", "None"], "model_init_kwargs takes a JSON object, and the text given is not one"),
        (["--model_init_kwargs", "[1, 2]"], "model_init_kwargs takes a JSON object, and the text given is not one"),
        (
            ["--activation_checkpointing", "true", "--activation_checkpointing_kwargs", "use_reentrant"],
            "activation_checkpointing_kwargs takes a JSON object, and the text given is not one",
        ),
        (
            ["--lr_scheduler_kwargs", "min_lr=1e-7"],
            "lr_scheduler_kwargs takes a JSON object, and the text given is not",
        ),
        # JSON's own words alone: "error: Expecting value: line 1 column 6 (char 5)", naming no field (nor the text:
        # model_init_kwargs may hold a token)
        (
            ["--model_init_kwargs", '{"token": "hf_x'],
            "model_init_kwargs is not valid JSON (Unterminated string starting at character 10): write it as "
            """--model_init_kwargs '{"key": value}'""",
        ),
        # taken for a path to a JSON file: FileNotFoundError's traceback
        (
            ["--accelerator_config", "split_batches=false"],
            "accelerator_config takes a JSON object or the path of a JSON file holding one, and the text given is "
            "neither",
        ),
    ],
)
def test_a_field_that_takes_a_json_object_given_other_text_is_one_line_before_loading(
    args, expected, tmp_path, monkeypatch, capsys
):
    line = refused(tmp_path, monkeypatch, capsys, *args)
    assert expected in line and "hf_x" not in line, line


def test_a_recipe_fields_mapping_written_as_text_is_refused_and_as_a_mapping_read(tmp_path):
    """A recipe's `lr_scheduler_kwargs: min_lr=1e-7` is text, refused in the same line; a mapping is read as one."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Path(SMOKE).read_text() + "lr_scheduler_kwargs: min_lr_rate=0.1\n")
    with pytest.raises(ConfigError, match="^lr_scheduler_kwargs takes a JSON object, and the text given is not one"):
        parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "run")])
    recipe.write_text(Path(SMOKE).read_text() + "lr_scheduler_kwargs:\n  min_lr_rate: 0.1\n")
    parsed = parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--model_init_kwargs", " {}"])
    assert parsed.training.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and parsed.training.model_init_kwargs == {}


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_a_model_init_kwargs_key_the_model_cannot_take_is_refused_before_the_data_naming_the_fix(
    dry_run, tmp_path, monkeypatch, capsys
):
    """transformers 5 moved `rope_theta` into `rope_parameters`: `--model_init_kwargs '{"rope_theta": 100.0}'`, a key
    that is neither a field of the model's config nor an argument of from_pretrained, ended in a traceback at the
    model's load, after the data was prepared (`TypeError: Olmo3ForCausalLM.__init__() got an unexpected keyword
    argument 'rope_theta'`), and the dry run said nothing. Refused before anything loads, naming where it goes."""
    theta = refused(tmp_path, monkeypatch, capsys, "--model_init_kwargs", '{"rope_theta": 100.0}', *dry_run)
    assert theta.startswith(
        "error: model_init_kwargs 'rope_theta' is neither a field of the model's config (Olmo3Config) nor an argument "
        "of from_pretrained, so the model's load would stop on it: set it inside rope_parameters: --model_init_kwargs "
        """'{"rope_parameters": {"full_attention": {"rope_theta": 100.0, "rope_type": "default"}, """
        """"sliding_attention": {"rope_theta": 100.0, "rope_type": "default"}}}'"""
    ), theta
    typo = refused(tmp_path, monkeypatch, capsys, "--model_init_kwargs", '{"rms_norm_epsilon": 0.5}', *dry_run)
    assert typo.endswith("did you mean 'rms_norm_eps'? Else remove 'rms_norm_epsilon' from model_init_kwargs"), typo


def test_model_init_kwargs_keys_the_config_or_from_pretrained_takes_are_not_refused(tiny_model_dir):
    """Fields of the model's config, set in its config.json or not (return_dict, a base field), and the arguments of
    from_pretrained itself (how the files are read, quantization, remote code) reach the load as before."""
    from dpotrain import options

    kwargs = {
        "rms_norm_eps": 0.5,
        "attention_dropout": 0.1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        "return_dict": True,
        "output_attentions": False,
        "num_labels": 2,
        "low_cpu_mem_usage": True,
        "device_map": None,
        "max_memory": None,
        "offload_folder": "x",
        "quantization_config": None,
        "trust_remote_code": False,
        "use_safetensors": True,
        "subfolder": "",
        "variant": None,
        "cache_dir": None,
        "local_files_only": False,
        "force_download": False,
        "key_mapping": None,
        "use_kernels": False,
        "experts_implementation": None,
        "weights_only": True,
    }
    for model in (tiny_model_dir, "builtin:tiny-olmo3"):
        recipe = parse_args(
            ["--config", SMOKE, "--model_name_or_path", model, "--model_init_kwargs", json.dumps(kwargs)]
        )
        options.check_init_kwargs_apply(recipe)


def test_every_argument_of_the_installed_from_pretrained_is_admitted():
    """The keys from_pretrained takes from its **kwargs, read from the installed transformers' source: a newer release
    that takes another is admitted here first, not refused as unknown to the model's config."""
    import inspect

    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    from dpotrain.recipe.init_kwargs import from_pretrained_arguments

    taken = set()
    for f in (PreTrainedModel.from_pretrained, AutoModelForCausalLM.from_pretrained, PretrainedConfig.from_pretrained):
        source = inspect.getsource(f)
        taken |= set(re.findall(r'kwargs\.pop\(\s*"(\w+)"', source)) | set(re.findall(r'"(\w+)" in kwargs', source))
        taken |= set(re.findall(r'"(\w+)",?\s', "".join(re.findall(r"(?:for name in|_names =) \[[^\]]*\]", source))))
    # transformers' private keys (`_commit_hash`, `_from_auto`: passed between its own functions) are no user's to give
    assert {name for name in taken if not name.startswith("_")} - from_pretrained_arguments() == set()


def test_loss_type_typo_refused_by_the_dry_run_too(tmp_path, monkeypatch, capsys):
    assert "unknown loss_type" in refused(tmp_path, monkeypatch, capsys, "--loss_type", "sigmoid_nrom", "--dry-run")


def test_empty_and_malformed_jsonl(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "is empty" in refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(empty))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(pair()) + "\n" + json.dumps(pair())[:-9] + "\n" + json.dumps(pair()) + "\n")
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(broken))
    assert f"{broken}:2: not valid JSON" in message and "fix or remove that line" in message


BOM = "\ufeff"  # a byte-order mark, as Windows tools (Notepad, PowerShell's Out-File) write it first


@pytest.mark.parametrize(
    "name, text, expected",
    [
        # the mark was blamed: ":1: not valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig) at column 1)"
        (
            "bom.jsonl",
            BOM + LINE * 2 + LINE[:-10] + "\n",
            ":3: not valid JSON (Unterminated string starting at column",
        ),
        # these two said "could not read dataset file ...: DatasetGenerationError: An error occurred while generating
        # the dataset", naming neither the line nor the fix
        (
            "array.json",
            "[\n" + ",\n".join([json.dumps(pair())] * 2) + ",\n]\n",
            ":4: not valid JSON (Expecting value at column 1)",
        ),
        ("lines.json", LINE * 2 + "{oops\n", ":3: not valid JSON (Expecting property name enclosed in double quotes"),
        # "could not read ...: ValueError: Instruction \"train\" corresponds to no data!" and DatasetGenerationError
        ("mark.jsonl", BOM + "\n", " has no rows: it needs one JSON object per line with chosen/rejected"),
        ("empty.json", BOM + "[]", " has no rows: it needs a JSON array of objects with chosen/rejected, or one such"),
        # an export of no pairs, its header alone: "could not read ...: ValueError: Instruction \"train\" corresponds
        # to no data!", naming no fix
        ("header.csv", "prompt,chosen,rejected\n\n", " has no rows: it needs a header line naming chosen and rejected"),
        ("header.tsv", "prompt\tchosen\trejected\n", " has no rows: it needs a header line naming chosen and rejected"),
        # "could not read dataset file ...: DatasetGenerationError" too (pandas: "Expected 3 fields in line 3, saw 4")
        ("more.csv", "prompt,chosen,rejected\nQ1,a,b\nQ2,a,b,c\n", ":3: 4 cells where the header names 3: quote the"),
        # a cell starting with `"` that is not one quoted cell: pandas trained `"Hi" she said` as `Hi she said`, and
        # a quote left open ran the cell on over the next rows (4 pairs read as 2), both without a word
        (
            "quote.tsv",
            'prompt\tchosen\trejected\nQ1\ta\tb\nQ2\t"Hi" she said\tb\n',
            ":3: a cell starts with '\"' but is",
        ),
        (
            "open.tsv",
            'prompt\tchosen\trejected\nQ1\t"Hi\tb\nQ2\ta\tb\nQ3\tan "x"\tb\nQ4\ta\tb\n',
            ":2: a cell starts with",
        ),
        # a lone surrogate escape (half an emoji, as a UTF-16 string cut mid-character is dumped): JSON Lines said
        # "DatasetGenerationError: An error occurred while generating the dataset"; a JSON array loaded with the
        # character dropped in silence ('It is \\ud800.' trained as 'It is .')
        ("cut.jsonl", LINE + LINE.replace("Blue.", "Blue \\ud83d"), ":2: a lone UTF-16 surrogate (\\ud83d) at column"),
        (
            "cut.json",
            "[\n" + LINE.rstrip() + ",\n" + LINE.replace("Blue.", "Blue \\udc00").rstrip() + "\n]\n",
            ":3: a lone UTF-16 surrogate (\\udc00) at column",
        ),
        (
            "indented.json",
            json.dumps([pair(), pair("Blue \ud83d.")], indent=1),
            ":32: a lone UTF-16 surrogate (\\ud83d) at column 22",
        ),
    ],
)
def test_a_data_file_that_does_not_read_names_its_line(name, text, expected, tmp_path, monkeypatch, capsys):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(path))
    assert message.startswith(
        f"error: {path}{expected}" if expected[0] == ":" else f"error: dataset file {str(path)!r}"
    )
    assert expected in message


@pytest.mark.parametrize("compression", [".gz", ".bz2", ".xz"])
def test_a_cell_not_quoted_whole_in_a_compressed_csv_shard_is_refused_as_in_a_plain_file(compression, tmp_path):
    """A folder of `.csv.gz` shards (as exports and the Hub hold them) skipped the stray-quote check and the cells'
    reading as text: a folder was checked by each file's last suffix (`.gz`), so pandas trained `"Hi" she said` as
    `Hi she said` without a word. Each compression `open_data` reads is checked as a plain file is (and a lone file)."""
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[compression]
    folder = tmp_path / "shards"
    folder.mkdir()
    for name, answer in (("train-0", "a"), ("train-1", '"Hi" she said')):
        with opener(folder / f"{name}.csv{compression}", "wt", encoding="utf-8") as f:
            f.write(f"prompt,chosen,rejected\nQ1,a,b\nQ2,{answer},b\n")
    alone = tmp_path / f"pairs.csv{compression}"
    shutil.copy(folder / f"train-1.csv{compression}", alone)
    for path, bad in ((folder, folder / f"train-1.csv{compression}"), (alone, alone)):
        with pytest.raises(ConfigError, match=re.escape(f"{bad}:3: a cell starts with '\"' but is not one quoted")):
            data.load_preference_dataset(str(path))


def test_a_folder_whose_files_hold_no_row_says_so(tmp_path, monkeypatch, capsys):
    """Exports of no pairs, their headers alone: "could not read the local folder ... (ValueError: Instruction "train"
    corresponds to no data!)", as if the folder's format were wrong."""
    folder = tmp_path / "exports"
    folder.mkdir()
    (folder / "a.csv").write_text("prompt,chosen,rejected\n")
    (folder / "b.csv").write_text("prompt,chosen,rejected\n\n")
    assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder)) == (
        f"error: dataset folder {str(folder)!r} has no rows: none of its files (a.csv, b.csv) holds a pair; put the "
        "pairs in them"
    )


def test_a_folder_whose_held_out_file_alone_is_empty_names_that_file(tmp_path, monkeypatch, capsys):
    """A test.jsonl made for held-out pairs not written yet, beside train.jsonl: "could not read the local folder ...
    (ValueError: Instruction "test" corresponds to no data!) ...: put the pairs there as .jsonl, .json, .parquet or
    .csv files of one format", advice about the folder's format, naming neither the file nor its fix."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", folder / "train.jsonl")
    (folder / "test.jsonl").write_text("")
    assert refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder)) == (
        f"error: dataset folder {str(folder)!r}: test.jsonl holds no pair, and datasets reads a file named for a split "
        "as that split, which cannot be empty: put pairs in it, or remove it"
    )


@pytest.mark.parametrize("score, kind", [("high", "string"), (1.5, "double")])
def test_a_folder_whose_files_give_an_unread_column_two_types_names_it(score, kind, tmp_path, monkeypatch, capsys):
    """A `score` written as a whole number in one shard and as text (or 1.5: datasets casts to the first file's int64)
    in another, a column the run does not read, made the folder unreadable with `ArrowInvalid: Failed to parse
    string: 'high' as a scalar of type int64` and the advice to put the pairs there as files of one format, which
    they were."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({**pair(f"Blue {i}."), "score": i}) + "\n" for i in range(4)))
    (folder / "b.jsonl").write_text("".join(json.dumps({**pair(f"Red {i}."), "score": score}) + "\n" for i in range(4)))
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder))
    assert message.startswith(
        f"error: dataset folder {str(folder)!r}: column 'score' is int64 in a.jsonl and {kind} in b.jsonl, and "
        "datasets reads its files as one table, one type to a column: "
    )
    assert "write it with one type in every file, or remove it (it is not read" in message


def test_a_folder_of_json_arrays_whose_files_give_a_column_two_types_names_it(tmp_path, monkeypatch, capsys):
    """`.json` files, each an array of rows (one here, JSON Lines there, as datasets reads either): a `score` a number
    in one and text in the other got datasets' `ArrowInvalid: Failed to parse string` and the folder's generic line.
    A date string is a timestamp in both, as datasets types an array (its rows as JSON Lines), not the column named;
    the array's byte-order mark (Windows tools write one) is skipped, as datasets does."""
    folder = tmp_path / "shards"
    folder.mkdir()
    rows = [{**pair(f"Blue {i}."), "date": "2024-01-01", "score": i} for i in range(4)]
    (folder / "a.json").write_text("\ufeff" + json.dumps(rows), encoding="utf-8")
    rows = [{**pair(f"Red {i}."), "date": "2024-01-01", "score": "high"} for i in range(4)]
    (folder / "b.json").write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder))
    assert message.startswith(
        f"error: dataset folder {str(folder)!r}: column 'score' is int64 in a.json and string in b.json, and "
    ), message


def test_column_types_datasets_joins_are_not_blamed_for_a_folder_that_does_not_read(tmp_path):
    """A message's keys in another order in one file (`{"content", "role"}`), string against large_string, int32
    against int64: datasets joins each, and a folder failing for another cause (a file whose `score` changes type
    within it, which pyarrow cannot read alone) was said to fail on the `chosen` column of two sound files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dpotrain.data import data

    def turns(reverse):
        said = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
        return [dict(reversed(list(m.items()))) for m in said] if reverse else said

    (tmp_path / "a.jsonl").write_text(json.dumps({"chosen": turns(False), "rejected": turns(False)}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"chosen": turns(True), "rejected": turns(True)}) + "\n")
    rows = [{"chosen": turns(False), "rejected": turns(False), "score": s} for s in (1, "n/a")]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.column_types_differ("folder", {n: tmp_path / n for n in ("a.jsonl", "b.jsonl")}) is None
    assert data.column_types_differ("folder", {n: tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl")}) is None
    for name, text, score in (("p.parquet", pa.large_string(), pa.int32()), ("q.parquet", pa.string(), pa.int64())):
        pq.write_table(pa.table({"chosen": pa.array(["Hi."], text), "score": pa.array([1], score)}), tmp_path / name)
    assert data.column_types_differ("folder", {n: tmp_path / n for n in ("p.parquet", "q.parquet")}) is None


@pytest.mark.parametrize("named, other", [("train.jsonl", "more_pairs.jsonl"), ("test.jsonl", "pairs.jsonl")])
def test_a_folder_named_by_split_with_another_data_file_is_refused(named, other, tmp_path, monkeypatch, capsys):
    """datasets reads only the files named by split once one is: `more_pairs.jsonl` beside `train.jsonl` trained the
    train file's pairs alone, in silence, and `pairs.jsonl` beside `test.jsonl` was refused as `has no split 'train':
    set --dataset_train_split to one of ['test']`, offering the held-out pairs to train on."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    write_rows(folder / named, [pair()])
    write_rows(folder / other, [pair(chosen="Red.")])
    (folder / "README.md").write_text("Pairs.\n")  # not a data file
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder), "--dry-run")
    split = named.removesuffix(".jsonl")
    assert message == (
        f"error: dataset folder {str(folder)!r} names its files by split ({split}: {named}), and datasets then reads "
        f"those alone: {other} would be left out: name each data file by its split (train.jsonl, train-2.jsonl, "
        "test.jsonl), or move it out of the folder"
    )


@pytest.mark.parametrize(
    "files, held_out",
    [
        (("Train.jsonl", "Test.jsonl"), "Test.jsonl"),  # capitalized: datasets' split names are lower-case
        (("trainset.jsonl", "testset.jsonl"), "testset.jsonl"),  # not between separators
        (("pairs.jsonl", "heldout.jsonl"), "heldout.jsonl"),  # not a name datasets knows
        (("trn.jsonl", "tst.jsonl"), "tst.jsonl"),
    ],
)
def test_a_folder_read_whole_with_a_held_out_file_is_refused(files, held_out, tmp_path, monkeypatch, capsys):
    """A newcomer's hunt: a folder whose files are named by split in a way datasets does not read as split names was
    read as one data set, every file of it trained, the held-out pairs too, without a word (a dry run said `(split
    train): 2 rows`)."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    for i, name in enumerate(files):
        write_rows(folder / name, [pair(chosen=f"Red {i}.")])
    message = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder), "--dry-run")
    assert message == (
        f"error: dataset folder {str(folder)!r} is read as one data set, every file of it trained, since none of its "
        "files is named by split as datasets reads split names (train, test, validation in lower case, alone or "
        f"between separators: prefs_test.jsonl): {held_out} would be trained on, though its name says held-out "
        "pairs: name the files by split (train.jsonl, test.jsonl), or move it out of the folder"
    )


def test_a_folder_read_whole_whose_files_name_no_split_is_read(tmp_path):
    """Shards of one data set, named anyhow, are its pairs: read whole, as datasets reads them."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, name in enumerate(("part-a.jsonl", "latest.jsonl", "contest_pairs.jsonl")):
        write_rows(folder / name, [pair(chosen=f"Red {i}.")])
    assert len(data.load_preference_dataset(str(folder))) == 3


@pytest.mark.parametrize(
    "text, line",
    [
        ('{"text": "Tell me about tides."}\n', 1),  # no `prompt`: a KeyError traceback once the data had loaded
        ('{"prompt": "Hi"}\nWhat is 2 plus 2?\n', 2),  # a plain line: a JSONDecodeError traceback
        ('{"prompt": [{"role": "user", "content": "Hi"}]}\n', 1),  # messages, not the documented string
        ('{"prompt": "Hi"}\n\n{"text": "Hi"}\n', 3),  # the file's line: blank lines were not counted (line 2)
    ],
)
def test_a_sample_prompts_file_line_without_a_prompt_string(text, line, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(text)
    message = refused(tmp_path, monkeypatch, capsys, "--samples_every", "1", "--sample_prompts_file", str(prompts))
    assert f"sample_prompts_file {str(prompts)!r}, line {line}: not a JSON object with a `prompt` string" in message


def test_sample_prompts_and_a_sample_prompts_file_together_are_refused(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me about tides.\n")  # was passed over for the list, without a word
    args = ["--samples_every", "1", "--sample_prompts", "Hi", "--sample_prompts_file", str(prompts), "--dry-run"]
    assert "sample_prompts and sample_prompts_file" in refused(tmp_path, monkeypatch, capsys, *args)


def test_an_empty_sample_prompts_file_is_refused(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n\n")  # the data set's first prompts were sampled instead, without a word
    args = ["--samples_every", "1", "--sample_prompts_file", str(prompts), "--dry-run"]  # the dry run says it too
    assert f"sample_prompts_file {str(prompts)!r} holds no prompt" in refused(tmp_path, monkeypatch, capsys, *args)


def test_save_steps_under_another_save_strategy_is_refused_but_not_a_recipe_files(tmp_path, monkeypatch, capsys):
    """`--save_strategy epoch --save_steps 5` was recorded as saving every 5 steps and saved at the epoch's end alone
    (transformers reads save_steps under `steps` only). smoke.yaml's own save_steps 20 is unused, not refused, where
    the command line changes the strategy for one run; nor is any under `no`, saving turned off."""
    from dpotrain.options import check_saving

    args = ["--save_strategy", "epoch", "--save_steps", "5"]
    assert refused(tmp_path, monkeypatch, capsys, *args) == (
        "error: save_steps 5 would be ignored: save_strategy epoch does not save by steps: remove save_steps, or pass "
        "--save_strategy steps"
    )
    for strategy in ("epoch", "no"):
        check_saving(parse_args(["--config", SMOKE, "--save_strategy", strategy]))  # the recipe file's save_steps 20
    check_saving(parse_args(["--config", SMOKE, "--save_steps", "5", "--save_strategy", "no"]))  # saving turned off
    recipe = tmp_path / "epochs.yaml"
    recipe.write_text(
        (ROOT / "configs" / "smoke.yaml").read_text().replace("save_strategy: steps", "save_strategy: epoch")
    )
    with pytest.raises(ConfigError, match="save_steps 20 would be ignored: save_strategy epoch"):
        check_saving(parse_args(["--config", str(recipe)]))


def test_logging_steps_under_logging_strategy_epoch_is_refused_but_not_a_recipe_files(tmp_path, monkeypatch, capsys):
    """`--logging_strategy epoch --logging_steps 5` was recorded as logging every 5 steps and logged at the epoch's end
    alone (transformers reads logging_steps under `steps` only): metrics.jsonl, W&B and the curves had one point per
    epoch. smoke.yaml's own logging_steps 2 is unused, not refused, where the command line changes the strategy."""
    from dpotrain.options import check_logging

    args = ["--logging_strategy", "epoch", "--logging_steps", "5", "--health_checks", "false"]
    assert refused(tmp_path, monkeypatch, capsys, *args) == (
        "error: logging_steps 5 would be ignored: logging_strategy epoch does not log by steps: remove logging_steps, "
        "or pass --logging_strategy steps"
    )
    unguarded = ["--health_checks", "false"]  # under epoch the guards would judge each epoch's end alone: refused
    check_logging(
        parse_args(["--config", SMOKE, "--logging_strategy", "epoch", *unguarded])
    )  # the file's logging_steps
    recipe = tmp_path / "epochs.yaml"
    recipe.write_text((ROOT / "configs" / "smoke.yaml").read_text() + "logging_strategy: epoch\nhealth_checks: false\n")
    with pytest.raises(ConfigError, match="logging_steps 2 would be ignored: logging_strategy epoch"):
        check_logging(parse_args(["--config", str(recipe)]))


def test_a_lora_recipe_runs_once_as_a_full_fine_tune_from_the_command_line(tmp_path):
    """A LoRA recipe (`use_peft: true`, its lora_r, lora_alpha, target modules, merge_lora), run once with `--use_peft
    false`: refused as "lora_r is set but use_peft is false, ... or remove lora_r", a line of the recipe no flag unsets.
    Unused then (no adapter is made), as the other features' settings; a LoRA setting typed beside it stays refused."""
    from dpotrain.train import lora

    recipe = tmp_path / "lora.yaml"
    recipe.write_text(
        (ROOT / "configs" / "smoke.yaml").read_text()
        + "use_peft: true\nlora_r: 32\nlora_alpha: 64\nlora_target_modules: all-linear\nmerge_lora: true\n"
    )
    lora.check_lora(parse_args(["--config", str(recipe)]))
    off = parse_args(["--config", str(recipe), "--use_peft", "false"])
    lora.check_lora(off)
    assert not off.model.use_peft and lora.peft_config(off.model) is None
    for typed in (["--lora_r", "8"], ["--merge_lora", "true"]):
        with pytest.raises(ConfigError, match=rf"^{typed[0][2:]} is set but use_peft is false, so it would be ignored"):
            lora.check_lora(parse_args(["--config", str(recipe), "--use_peft", "false", *typed]))


def test_a_qlora_recipe_runs_once_unquantized_from_the_command_line(tmp_path):
    """A QLoRA recipe (`load_in_4bit: true` with bnb_4bit_quant_type, use_bnb_nested_quant), run once with
    `--load_in_4bit false` (a GPU with room for the weights): refused as "bnb_4bit_quant_type only applies with
    --load_in_4bit true: add it, or remove bnb_4bit_quant_type", a line of the recipe no flag unsets. Unused then; one
    typed beside it stays refused."""
    from dpotrain.train import lora

    recipe = tmp_path / "qlora.yaml"
    recipe.write_text(
        (ROOT / "configs" / "smoke.yaml").read_text()
        + "use_peft: true\nlora_target_modules: all-linear\nload_in_4bit: true\nbnb_4bit_quant_type: nf4\n"
        + "use_bnb_nested_quant: true\n"
    )
    off = parse_args(["--config", str(recipe), "--load_in_4bit", "false"])
    lora.check_lora(off)
    assert not off.model.load_in_4bit
    with pytest.raises(ConfigError, match=r"^bnb_4bit_quant_type only applies with --load_in_4bit true"):
        lora.check_lora(
            parse_args(["--config", str(recipe), "--load_in_4bit", "false", "--bnb_4bit_quant_type", "fp4"])
        )


def test_a_recipe_that_evaluates_runs_once_without_evaluation_from_the_command_line(tmp_path):
    """A recipe with `eval_strategy: steps`, its held-out pairs and settings, run once with `--eval_strategy no`: it was
    refused as "eval_datasets is only used for evaluation, and eval_strategy is no: ... or remove eval_datasets", a
    line of the recipe no flag unsets. Unused then (the held-out pairs are not read), as the other features' settings;
    but eval_on_start, which the Trainer reads all the same (a traceback without held-out pairs), and a setting typed
    beside the `--eval_strategy no` stay refused."""
    from dpotrain.options import check_options

    recipe = tmp_path / "evaluates.yaml"
    recipe.write_text(
        (ROOT / "configs" / "smoke.yaml").read_text()
        + "eval_strategy: steps\neval_steps: 10\nmetric_for_best_model: eval_loss\n"
        + "eval_datasets:\n  - path: data/smoke_prefs.jsonl\n    amount: 20\n"
    )
    check_options(parse_args(["--config", str(recipe)]))
    off = parse_args(["--config", str(recipe), "--eval_strategy", "no"])
    check_options(off)
    assert off.training.eval_strategy == "no"
    with pytest.raises(ConfigError, match=r"^eval_steps is only used for evaluation, and eval_strategy is no: add"):
        check_options(parse_args(["--config", str(recipe), "--eval_strategy", "no", "--eval_steps", "5"]))
    with pytest.raises(ConfigError, match=r"^eval_on_start is only used for evaluation, and eval_strategy is no: add"):
        recipe.write_text(recipe.read_text() + "eval_on_start: true\n")
        check_options(parse_args(["--config", str(recipe), "--eval_strategy", "no"]))


def test_settings_of_a_feature_that_is_off_are_refused(tmp_path, monkeypatch, capsys):
    """`sample_prompts_file` with samples_every 0, `--health_action warn` with `--health_checks false`: accepted and
    recorded as the run's, while no sample was generated and no guard watched. Refused, but where the command line
    turns the feature off for one run of a recipe that sets them: unused then, and the record says the feature is off
    (and `health_action` where a guard stopped the run: a rerun reads it, guards on or off, to go on or not)."""
    from dpotrain.options import check_options
    from dpotrain.resolve import resolved_config

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a colour.\n")
    for args, expected in [
        (
            ["--sample_prompts_file", str(prompts)],  # smoke.yaml: samples_every 0
            "sample_prompts_file is set but samples_every is 0, so no sample is generated: set samples_every (e.g. 50) "
            "or remove sample_prompts_file",
        ),
        (
            ["--health_checks", "false", "--health_action", "warn"],
            "health_action is set but health_checks is false, so no health guard runs: set health_checks true or "
            "remove health_action",
        ),
        (
            ["--gradient_checkpointing_kwargs", '{"every_n_layers": 2}'],  # smoke.yaml: activation_checkpointing false
            "activation_checkpointing_kwargs is set but activation_checkpointing is false, so no layer is "
            "checkpointed: set activation_checkpointing true or remove activation_checkpointing_kwargs",
        ),
        # what max_length: auto aims at, typed for smoke.yaml's max_length 1024: recorded, read by nothing
        (
            ["--auto_coverage", "0.9"],
            "auto_coverage 0.9 is set but max_length is 1024, not auto, so nothing reads it: add --max_length auto "
            "(the smallest length leaving that share of pairs whole), or remove auto_coverage",
        ),
    ]:
        assert refused(tmp_path, monkeypatch, capsys, *args) == f"error: {expected}", args
    check_options(parse_args(["--config", SMOKE, "--max_length", "auto", "--auto_coverage", "0.9"]))
    recipe = tmp_path / "tuned.yaml"
    recipe.write_text(
        (ROOT / "configs" / "smoke.yaml").read_text().replace("samples_every: 0", "samples_every: 8")
        + "sample_count: 2\nhealth_loss_floor: 0.05\nauto_coverage: 0.9\n"  # the analyzer's target for this recipe
    )
    # One run of the recipe with the features off: its settings unused, and the record says the features are off.
    off = parse_args(["--config", str(recipe), "--health_checks", "false", "--samples_every", "0"])
    check_options(off)
    tuned = recipe.read_text()
    checkpointed = tuned.replace("activation_checkpointing: false", "activation_checkpointing: true")
    recipe.write_text(checkpointed + 'activation_checkpointing_kwargs: {"every_n_layers": 2}\n')
    check_options(parse_args(["--config", str(recipe), "--gradient_checkpointing", "false"]))  # off for one run
    recipe.write_text(tuned)
    check_options(off)
    record = resolved_config(off, {})
    assert (record["health_checks"], record["samples_every"], record["health_loss_floor"]) == (False, 0, 0.05)
    for args, says in [
        (["--samples_every", "0", "--sample_max_new_tokens", "16"], "sample_max_new_tokens is set but samples_every"),
        (["--health_checks", "false", "--health_pinned_pairs", "64"], "health_pinned_pairs is set but health_checks"),
    ]:
        with pytest.raises(ConfigError, match=says):  # the command line's setting beside its own switch, off
            check_options(parse_args(["--config", str(recipe), *args]))
    recipe.write_text(recipe.read_text() + "health_checks: false\n")  # the recipe file contradicts itself
    with pytest.raises(ConfigError, match="health_loss_floor is set but health_checks is false"):
        check_options(parse_args(["--config", str(recipe)]))
    # A rerun of a run a guard stopped reads health_action, guards on or off (resume.after_health_stop).
    out = tmp_path / "stopped"
    out.mkdir()
    (out / "health_stop.json").write_text('{"guard": "loss_floor", "step": 3, "message": "", "fatal": false}\n')
    check_options(parse_args(["--config", SMOKE, "--output_dir", str(out), *("--health_checks", "false")] + WARN))


WARN = ["--health_action", "warn"]


def test_wandb_without_a_login(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.chdir(tmp_path)  # no .env with a key
    data = str(ROOT / "data" / "smoke_prefs.jsonl")
    message = refused(tmp_path, monkeypatch, capsys, "--report_to", "wandb", "--dataset_name", data)
    assert "report_to wandb but no W&B login" in message and "WANDB_MODE=offline" in message


def test_report_to_wandb_into_a_wandb_folder_this_job_cannot_write_is_refused_before_the_model_loads(
    tmp_path, monkeypatch
):
    """W&B's folder (`<WANDB_DIR, else output_dir>/wandb`) made another user's or read-only: the run loaded the model
    and scored the reference stage, then failed as wandb started. Refused at the start, naming folder and fix."""
    from conftest import in_child

    if os.geteuid() != 0:
        pytest.skip("needs a read-only bind mount in a mount namespace of its own (root)")
    (tmp_path / "w" / "wandb").mkdir(parents=True)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "w"))
    monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", str(tmp_path / "builtin"))
    data = str(ROOT / "data" / "smoke_prefs.jsonl")
    argv = ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to", "wandb", "--dataset_name", data]
    code, out, err = in_child(lambda: run_cli(lambda: train_dpo.main(argv)), read_only=[tmp_path / "w" / "wandb"])
    assert code == 2 and "Traceback" not in out + err, (out + err)[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: report_to wandb: wandb writes its files in {tmp_path / 'w' / 'wandb'}"), line
    assert "chmod -R u+w" in line and "--report_to none" in line, line
    assert not (tmp_path / "builtin").exists(), "the model was loaded before the refusal"


@pytest.mark.parametrize("text", ["", "# my recipe: beta 5, OLMo 3's\n#beta: 5\n\n"])
def test_an_empty_or_comment_only_recipe_is_refused(text, tmp_path, monkeypatch, capsys):
    """It trained TRL's defaults (beta 0.1, sigmoid, 3 epochs) under the recipe's name."""
    recipe = tmp_path / "olmo3-mine.yaml"
    recipe.write_text(text)
    monkeypatch.setenv("DPOTRAIN_BUILTIN_DIR", str(tmp_path / "builtin"))
    for argv in (["--config", str(recipe)], ["--config", str(recipe), "--dry-run"]):
        with pytest.raises(SystemExit) as ended:
            run_cli(lambda argv=argv: train_dpo.main(argv))
        err = capsys.readouterr().err
        assert ended.value.code == 2 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1] == (
            f"error: {recipe}: the recipe holds no settings (empty, or comments "
            "only): write its `field: value` lines (configs/smoke.yaml is a small "
            "one to start from)"
        )
    assert not (tmp_path / "olmo3-mine-dpo").exists() and not (tmp_path / "builtin").exists()


def test_save_strategy_no_in_a_slurm_job_says_what_it_risks_at_start(tmp_path, monkeypatch, capsys):
    from dpotrain import options

    recipe = parse_args(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--save_strategy", "no"])
    options.check_options(recipe)
    assert "Note: save_strategy no" not in capsys.readouterr().out  # not preemptible: nothing to say
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    options.check_options(recipe)
    assert capsys.readouterr().out == (
        "Note: save_strategy no: no checkpoint on the way; a stop request (preemption, "
        "time limit) still saves one, but a job killed without one (a node lost, out of "
        "memory) restarts from step 0\n"
    )


@pytest.mark.slow
def test_a_real_process_exits_2_with_one_line(tmp_path):
    result = run_train(
        ["--config", SMOKE, "--output_dir", str(tmp_path / "r"), "--loss_type", "sigmoid_nrom"],
        env={"DPOTRAIN_BUILTIN_DIR": str(tmp_path / "builtin")},
    )
    assert result.returncode == 2 and "Traceback" not in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("error: unknown loss_type 'sigmoid_nrom'")
    assert not (tmp_path / "builtin").exists()


# --- 2: resuming with other settings ---------------------------------------------------------------------------------


def unfinished_run(tmp_path, capsys, *args):
    """An output folder as a run killed after checkpoint 4 leaves it: its resolved_config.json and a checkpoint."""
    out = tmp_path / "run"
    train_dpo.main(["--config", SMOKE, "--output_dir", str(out), "--dry-run", "--json", *args])
    printed = capsys.readouterr().out
    sealed_checkpoint(out / "checkpoint-4")
    (out / "resolved_config.json").write_text(printed[printed.index("{") :])
    return out


def test_a_rerun_with_auto_resume_false_is_refused_in_the_words_it_was_given_naming_the_checkpoint_to_pass(
    tmp_path, capsys
):
    """docs/resuming.md tells a user `--auto_resume false` (or `auto_resume: false` in the recipe); the refusal said
    `--no_auto_resume is set`, a flag nobody typed, and left out the way on that page: name the checkpoint."""
    out = unfinished_run(tmp_path, capsys)
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--auto_resume", "false"])
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(recipe, 8)
    assert str(refused.value) == (
        f"output_dir {str(out)!r} has checkpoints and auto_resume is false: pass --resume_from_checkpoint "
        f"{out / 'checkpoint-4'} to go on from the newest, --overwrite_output_dir to start afresh, or a new "
        "--output_dir"
    )


def test_every_command_printed_to_paste_keeps_a_path_with_a_space_or_a_quote_as_one_word(tmp_path, capsys):
    """A command a line prints for the user to paste names paths as a shell reads them: `--resume_from_checkpoint
    /data/my runs/x/checkpoint-4` (auto_resume false, a failed save, a checkpoint given as output_dir) or `jq -c
    '.data[]' my pairs.json` pasted as printed gave the checkpoint or file as two words; each is quoted now (shlex),
    like push_to_hub.py's and prefetch.py's commands."""
    from datasets import Dataset

    from dpotrain.cluster import offline
    from dpotrain.hub import hub_push
    from dpotrain.recipe import run_record
    from dpotrain.train import disk_full

    def pasted(command: str, between: tuple[str, str]) -> list[str]:  # the command's words as a shell splits them
        return shlex.split(command.split(between[0], 1)[1].split(between[1], 1)[0])

    out = unfinished_run(tmp_path / "my runs 'a'", capsys)  # out / "checkpoint-4"; a space and a quote above it
    newest = str(out / "checkpoint-4")
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--auto_resume", "false"])
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(recipe, 8)
    assert pasted(str(refused.value), ("pass ", " to go on")) == ["--resume_from_checkpoint", newest]

    (out / run_record.RESOLVED).write_text(json.dumps({"auto_resume": False}))
    after = str(disk_full.final_save_failed(out, disk_full.FULL[errno.ENOSPC]))
    assert pasted(after, ("add ", " to go on")) == ["--resume_from_checkpoint", newest]

    wrapped = out.parent / "pairs 'v2'.json"
    wrapped.write_text(json.dumps({"my pairs": [{"prompt": "Hi", "chosen": "A.", "rejected": "B."}]}))
    with pytest.raises(ConfigError) as refused:
        data.check_columns(Dataset.from_json(str(wrapped)), str(wrapped))
    jq = str(refused.value).split("(`", 1)[1].split("`)", 1)[0]
    assert shlex.split(jq) == ["jq", "-c", '.["my pairs"][]', str(wrapped), ">", "pairs.jsonl"]
    if shutil.which("jq"):  # pasted as printed, it writes the pairs as JSON Lines
        subprocess.run(["bash", "-c", jq], cwd=out.parent, check=True)
        assert json.loads((out.parent / "pairs.jsonl").read_text())["chosen"] == "A."

    from dpotrain import output_folder  # a checkpoint given as output_dir: its resume, and the copy of its weights

    with pytest.raises(ConfigError) as refused:
        output_folder.check(newest, lock=False)
    assert pasted(str(refused.value), ("with ", "; or")) == ["--resume_from_checkpoint", newest]
    assert pasted(str(refused.value), ("(cp -r ", " <new folder>")) == [newest]

    assert shlex.split(hub_push.push_command(out, "--checkpoints"))[2:] == [str(out), "--checkpoints"]
    assert str(out) in shlex.split(offline.prefetch_command(recipe, str(out)))


def test_overwrite_output_dir_over_a_run_of_the_same_settings_says_it_resumes(tmp_path, capsys):
    """--overwrite_output_dir on an unfinished run of the same settings resumes it (a job requeued with the flag in its
    command must not lose its progress, docs/resuming.md), and said nothing: a person who typed it to train again from
    step 1 saw "Resuming from ..." alone. Said now, with the way to train afresh; other settings are replaced."""
    out = unfinished_run(tmp_path, capsys)
    capsys.readouterr()  # its checkpoint's seal line
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--overwrite_output_dir"])
    assert resolve.check_output_dir(recipe, 8) == resolve.OutputDecision(str(out / "checkpoint-4"), False)
    assert capsys.readouterr().out == (
        f"note: --overwrite_output_dir resumes {out / 'checkpoint-4'}, not afresh: the run in {str(out)!r} has these "
        "settings, and a job requeued with the flag in its command must not lose its progress; to train again from "
        "step 1, pass a new --output_dir\n"
    )
    recipe = parse_args(["--config", SMOKE, "--output_dir", str(out), "--overwrite_output_dir", "--beta", "1"])
    assert resolve.check_output_dir(recipe, 8) == resolve.OutputDecision(None, True)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--learning_rate", "1e-3"], "learning_rate: 0.0001 -> 0.001"),
        (["--model_name_or_path", "org/other-model"], "model_name_or_path: 'builtin:tiny-olmo3' -> 'org/other-model'"),
        (["--pairs_per_step", "16"], "pairs_per_step: 8 -> 16"),
        # The loss's other settings: each resumed before, the rest trained on another loss under the new value
        (["--f_divergence_type", "js_divergence"], "f_divergence_type: 'reverse_kl' -> 'js_divergence'"),
        (["--disable_dropout", "false"], "disable_dropout: True -> False"),
        (["--sync_ref_model", "true", "--precompute_ref_log_probs", "false"], "sync_ref_model: False -> True"),
    ],
)
def test_resume_with_changed_settings_is_refused(args, expected, tmp_path, monkeypatch, capsys):
    unfinished_run(tmp_path, capsys)
    message = refused(tmp_path, monkeypatch, capsys, *args)
    assert "holds an unfinished run with other settings" in message and expected in message
    assert "new --output_dir, or --overwrite_output_dir to start afresh" in message


def test_a_resume_with_another_neftune_noise_alpha_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    """NEFTune's noise changes every step's embeddings: missing from RESUME_FIELDS, the resume trained on under the
    new alpha while its checkpoint was trained without noise."""
    padded = ["--padding_free", "false"]  # NEFTune is refused where the run packs
    unfinished_run(tmp_path, capsys, *padded)
    message = refused(tmp_path, monkeypatch, capsys, *padded, "--neftune_noise_alpha", "5")
    assert "holds an unfinished run with other settings (neftune_noise_alpha: None -> 5.0)" in message


# Every other field a recipe can set, decided too (the test below holds each field to exactly one of this list and
# resolve.RESUME_FIELDS, so that one a TRL upgrade adds waits for a decision). These may differ between a run and its
# resumption:
MAY_CHANGE_FIELDS = (
    # where the run writes and what the command does this time, not what it trains
    """output_dir run_name overwrite_output_dir auto_resume resume_from_checkpoint dry_run json preflight
    reference_only learning_rate_note"""
    # logging, tracking and the run's own reports: read after each step, never by it
    """ logging_strategy logging_steps logging_first_step log_on_each_node logging_nan_inf_filter
    include_num_input_tokens_seen log_level log_level_replica disable_tqdm report_to project trackio_space_id
    trackio_bucket_id trackio_static_space_id skip_memory_metrics debug gpu_peak_tflops samples_every sample_prompts
    sample_prompts_file sample_count sample_max_new_tokens sample_repetition_warn"""
    # the health guards watch the steps (after a stop, `--health_action warn` goes on from its checkpoint on purpose)
    """ health_checks health_action health_step1_tolerance health_loss_floor health_max_margin health_logp_drop
    health_pinned_pairs health_early_fraction"""
    # evaluation runs on held-out pairs with no gradient
    """ eval_strategy eval_steps eval_delay per_device_eval_batch_size prediction_loss_only eval_on_start
    eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics
    metric_for_best_model greater_is_better load_best_model_at_end do_eval dataset_test_split eval_datasets
    dataset_mixer_eval_list dataset_mixer_eval_list_splits test_split_size"""
    # saving and pushing: when and where checkpoints and the final model go (a resume is exact whatever they were)
    """ save_strategy save_steps save_total_limit save_only_model save_on_each_node enable_jit_checkpoint
    restore_callback_states_from_checkpoint ignore_data_skip reference_save_seconds push_to_hub hub_token
    hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision push_checkpoints merge_lora"""
    # precision and the forward's kernels: the same step in other numerics or memory (docs/reliability.md)
    """ bf16 fp16 tf32 bf16_full_eval fp16_full_eval dtype attn_implementation full_determinism use_cpu
    activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing gradient_checkpointing_kwargs
    activation_offloading torch_compile torch_compile_backend torch_compile_mode compile_layers use_liger_kernel
    liger_kernel_config use_cache torch_empty_cache_steps padding_free pad_to_multiple_of share_prompt
    precompute_ref_log_probs precompute_ref_batch_size"""
    # the work split: the same pairs per step (compared below) on other processes, micro-batches or loaders
    """ per_device_train_batch_size gradient_accumulation_steps max_tokens_per_microbatch sequence_parallel_size
    auto_find_batch_size average_tokens_across_devices accelerate_config accelerator_config parallelism_config
    gpu_memory_gib memory_check dataloader_drop_last dataloader_num_workers dataloader_pin_memory
    dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order
    dataset_num_proc remove_unused_columns label_names train_sampling_strategy length_column_name
    ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout fsdp
    fsdp_config deepspeed local_rank"""
    # read by code this project replaces, refused at any value but their default (options.py): nothing to compare
    """ label_smoothing_factor do_train do_predict dataset_streaming ignore_bias_buffers streaming"""
    # compared otherwise (`changed_settings`): pairs per step, the chat template and a Hub data set's commit by what
    # they give, auto_coverage under `max_length: auto`, model_init_kwargs without the keys the run decides (recorded as
    # the model loaded, refused when given: init_kwargs.DECIDED_INIT_KWARGS) or that only say how the files are read
    """ pairs_per_step chat_template_path dataset_revision auto_coverage model_init_kwargs"""
).split()


def test_every_recipe_field_is_decided_for_a_resume_once():
    """Each field a recipe can set must either be kept by a resume or be free to change: one a TRL or transformers
    upgrade adds (or this project) fails here until someone decides which (RESUME_FIELDS or MAY_CHANGE_FIELDS)."""
    fields = [f.name for part in make_parser().dataclass_types for f in dataclasses.fields(part)]
    kept, free = set(resolve.RESUME_FIELDS), set(MAY_CHANGE_FIELDS)
    assert len(kept) == len(resolve.RESUME_FIELDS) and len(free) == len(MAY_CHANGE_FIELDS), "listed twice"
    assert not kept & free, f"in both lists: {sorted(kept & free)}"
    assert not set(fields) - kept - free, f"undecided: {sorted(set(fields) - kept - free)}"
    assert not (kept | free) - set(fields), f"no such field: {sorted((kept | free) - set(fields))}"


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_a_history_edited_by_hand_is_refused_before_the_resume_loads_the_model(name, tmp_path, monkeypatch, capsys):
    """A resume trims metrics.jsonl (samples.jsonl) at its first logged step: a line changed by hand was found there,
    after the model and the reference stage, in the same one line."""
    out = unfinished_run(tmp_path, capsys)
    (out / name).write_text('{"step": 1, "loss": 0.69}\n{"note": "lowered the lr"}\n')
    message = refused(tmp_path, monkeypatch, capsys)
    assert message == (
        f"error: {out / name}: line 2 is not a JSON record (its step is None, not a number); a crash can cut only the "
        "last line of this file, so it was changed by hand or another program: restore it, or delete that line, then "
        "rerun"
    )


@pytest.mark.parametrize(
    "first, args, expected",
    [
        # The optimizer's own arguments: the resume loaded the checkpoint's momentum while the record said 0.5
        (
            ["--optim", "sgd", "--optim_args", "momentum=0.9"],
            ["--optim_args", "momentum=0.5"],
            "optim_args: 'momentum=0.9' -> 'momentum=0.5'",
        ),
        # `max_length: auto` decides again at each start: the coverage edited while the job waited chose 1024 where
        # the checkpoint trained at 512, and the run went on at 1024, its record rewritten
        (["--max_length", "auto"], ["--auto_coverage", "1.0"], "auto_coverage: 0.95 -> 1.0"),
        # a fixed length resumed under auto: named as the user wrote it, not as the None auto stands for until chosen
        (["--max_length", "512"], ["--max_length", "auto"], "max_length: 512 -> 'auto'"),
    ],
)
def test_a_resume_that_would_train_otherwise_than_its_checkpoint_is_refused_naming_the_setting(
    first, args, expected, tmp_path, monkeypatch, capsys
):
    out = unfinished_run(tmp_path, capsys, *first)
    message = refused(tmp_path, monkeypatch, capsys, *first, *args)
    assert f"holds an unfinished run with other settings ({expected}): rerun with its settings" in message, message
    same = parse_args(["--config", SMOKE, "--output_dir", str(out), *first])
    assert resolve.check_output_dir(same, 8) == resolve.OutputDecision(str(out / "checkpoint-4"), False)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--learning_rate", "1e-3"], "learning_rate: 0.0001 -> 0.001"),
        (["--max_steps", "7"], "max_steps: 5 -> 7"),
    ],
)
def test_resume_from_checkpoint_with_changed_settings_is_refused_as_the_automatic_resume(
    args, expected, tmp_path, monkeypatch, capsys
):
    """It trained at the checkpoint's schedule while resolved_config.json and the card recorded the new value."""
    out = unfinished_run(tmp_path, capsys, "--max_steps", "5")
    checkpoint = str(out / "checkpoint-4")
    elsewhere = ["--output_dir", str(tmp_path / "continued")]  # TRL's users resume into a new folder as often
    for where in ([], elsewhere):
        message = refused(
            tmp_path, monkeypatch, capsys, "--max_steps", "5", "--resume_from_checkpoint", checkpoint, *args, *where
        )
        assert message.startswith(
            f"error: resume_from_checkpoint {checkpoint!r} was written by a run with other "
            f"settings ({expected}): rerun with its settings to resume it, or start a new run "
            f"from a copy of its weights (cp -r {checkpoint} <new folder>, then --model_name_or_path <new folder> "
            "and a new --output_dir)"
        ), message
    same = parse_args(["--config", SMOKE, "--max_steps", "5", "--resume_from_checkpoint", checkpoint, *elsewhere])
    assert resolve.check_output_dir(same, 8) == resolve.OutputDecision(checkpoint, False)


def test_a_lora_checkpoint_refused_for_other_settings_advises_a_new_run_from_its_base(tmp_path, monkeypatch, capsys):
    """The advice 'start a new run from its weights (--model_name_or_path <checkpoint>)' led a LoRA checkpoint, an
    adapter, to the refusal of an adapter's folder as the model."""
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "--max_steps", "5"]
    out = tmp_path / "run"
    train_dpo.main(["--config", SMOKE, "--output_dir", str(out), "--dry-run", "--json", *lora])
    printed = capsys.readouterr().out
    (out / "checkpoint-4").mkdir(parents=True)
    (out / "checkpoint-4" / "adapter_config.json").write_text("{}")
    checkpoint = str(sealed_checkpoint(out / "checkpoint-4"))
    (out / "resolved_config.json").write_text(printed[printed.index("{") :])
    elsewhere = ["--output_dir", str(tmp_path / "continued"), "--resume_from_checkpoint", checkpoint]
    message = refused(tmp_path, monkeypatch, capsys, *lora, "--lora_r", "8", *elsewhere)
    assert message == (
        f"error: resume_from_checkpoint {checkpoint!r} was written by a run with other settings (lora_r: 16 -> 8): "
        "rerun with its settings to resume it, or start a new run from its base model with --use_peft true (it holds "
        "a LoRA adapter, which a run cannot start from), a new --output_dir"
    )


def test_a_lora_run_recorded_with_trls_lora_dropout_under_disable_dropout_resumes(tmp_path, capsys):
    """Its adapter trained without dropout (disable_dropout zeroes it), as the resumed run's does: a run recorded before
    lora_dropout followed disable_dropout (0.05, TRL's default) must not be refused as one of another dropout, which no
    command could then resume (--lora_dropout 0.05 is refused under disable_dropout, which is compared too)."""
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj"]
    out = unfinished_run(tmp_path, capsys, *lora)
    record = json.loads((out / "resolved_config.json").read_text())
    assert record["lora_dropout"] == 0.0
    (out / "resolved_config.json").write_text(json.dumps(record | {"lora_dropout": 0.05}))
    assert resolve.changed_settings(parse_args(["--config", SMOKE, "--output_dir", str(out), *lora]), out, 8) == []
    record |= {"lora_dropout": 0.05, "disable_dropout": False}  # another dropout did train: refused, as before
    (out / "resolved_config.json").write_text(json.dumps(record))
    changed = resolve.changed_settings(parse_args(["--config", SMOKE, "--output_dir", str(out), *lora]), out, 8)
    assert changed == ["disable_dropout: False -> True", "lora_dropout: 0.05 -> 0.0"]


def test_resume_from_checkpoint_does_not_write_over_another_run_in_output_dir(tmp_path, capsys):
    """A named checkpoint was resumed into whatever output_dir held: a finished run of other settings there had its
    final model, record and metrics replaced, its checkpoints rotated away, with exit code 0 and not a word."""
    checkpoint = str(unfinished_run(tmp_path, capsys, "--max_steps", "5") / "checkpoint-4")
    other = tmp_path / "other"  # a run of another learning rate, killed after its checkpoint 2
    train_dpo.main(
        [
            "--config",
            SMOKE,
            "--output_dir",
            str(other),
            "--max_steps",
            "5",
            "--learning_rate",
            "1e-3",
            "--dry-run",
            "--json",
        ]
    )
    printed = capsys.readouterr().out
    sealed_checkpoint(other / "checkpoint-2")
    (other / "resolved_config.json").write_text(printed[printed.index("{") :])
    (other / "run_complete.json").write_text("{}\n")  # then finished
    argv = ["--config", SMOKE, "--max_steps", "5", "--resume_from_checkpoint", checkpoint, "--output_dir"]
    for rest, refusal in (
        ([], "already holds a finished run: pass --output_dir for a new run, or --overwrite_output_dir to replace it"),
        (
            ["--learning_rate", "1e-4"],  # unfinished: the same refusal as the automatic resume's, said of the folder
            "holds an unfinished run with other settings (learning_rate: 0.001 -> 0.0001), which resuming "
            f"{checkpoint} there would write over: pass a new --output_dir, or --overwrite_output_dir to replace "
            "that run",
        ),
    ):
        with pytest.raises(ConfigError) as refused_here:
            resolve.check_output_dir(parse_args([*argv, str(other), *rest]), 8)
        assert str(refused_here.value) == f"output_dir {str(other)!r} {refusal}"
        replaced = resolve.check_output_dir(parse_args([*argv, str(other), "--overwrite_output_dir"]), 8)
        assert replaced == resolve.OutputDecision(checkpoint, True)  # the old run's own files go, then it resumes
        (other / "run_complete.json").unlink(missing_ok=True)
    # Replacing the run that holds the named checkpoint would remove the checkpoint with it.
    (tmp_path / "run" / "run_complete.json").write_text("{}\n")
    with pytest.raises(ConfigError, match="is in output_dir .*: copy the checkpoint out of that folder first"):
        resolve.check_output_dir(parse_args([*argv, str(tmp_path / "run"), "--overwrite_output_dir"]), 8)


def test_resume_from_checkpoint_into_its_own_run_reads_that_run_as_written_not_as_edited_by_hand(tmp_path, capsys):
    """`--resume_from_checkpoint run/checkpoint-4 --output_dir run` with the run's settings, its resolved_config.json
    "fixed" by hand: the run in output_dir was compared as the edit reads, and refused as "an unfinished run with other
    settings (learning_rate: ...)", its own checkpoint then resumable by no command. Read as the run wrote it (its
    checkpoint's copy), as the automatic resume reads it: resumed, the edit said not to be used."""
    from dpotrain.recipe import run_record

    out = unfinished_run(tmp_path, capsys, "--max_steps", "5")
    written = run_record.sealed(json.loads((out / "resolved_config.json").read_text()))
    for folder in (out, out / "checkpoint-4"):  # as a run writes them: sealed, a copy in each checkpoint
        (folder / "resolved_config.json").write_text(json.dumps(written))
    (out / "resolved_config.json").write_text(json.dumps(written | {"learning_rate": 2e-4}))
    checkpoint = str(out / "checkpoint-4")
    argv = ["--config", SMOKE, "--max_steps", "5", "--resume_from_checkpoint", checkpoint, "--output_dir", str(out)]
    assert resolve.check_output_dir(parse_args(argv), 8) == resolve.OutputDecision(checkpoint, False)
    assert "resolved_config.json was edited after the run wrote it (learning_rate: 0.0001 -> 0.0002)" in (
        capsys.readouterr().out
    )
    with pytest.raises(ConfigError) as refused_here:  # other settings than the run's as written: refused, as before
        resolve.check_output_dir(parse_args([*argv, "--learning_rate", "2e-4"]), 8)
    assert "other settings (learning_rate: 0.0001 -> 0.0002)" in str(refused_here.value)
    # No copy of the run as written left: its settings are not known, said so, not compared with the edit.
    (out / "checkpoint-4" / "resolved_config.json").unlink()
    other = str(unfinished_run(tmp_path / "other", capsys, "--max_steps", "5") / "checkpoint-4")
    argv[argv.index(checkpoint)] = other
    with pytest.raises(ConfigError) as refused_here:
        resolve.check_output_dir(parse_args(argv), 8)
    assert str(refused_here.value) == (
        f"output_dir {str(out)!r} holds an unfinished run whose resolved_config.json was edited after the run wrote "
        f"it, and no checkpoint of it holds its copy, so the settings it ran with are not known, and resuming {other} "
        "there would write over it: pass a new --output_dir, or --overwrite_output_dir to replace that run"
    )
    replaced = resolve.check_output_dir(parse_args([*argv, "--overwrite_output_dir"]), 8)
    assert replaced == resolve.OutputDecision(other, True)


def test_resume_from_a_checkpoint_that_is_not_this_projects_is_refused(tmp_path):
    """Written by TRL's own script: no COMPLETE mark, no manifest, and no record of the settings it was trained with.
    It cannot be verified, nor its settings compared: refused, naming what is missing and the way out."""
    checkpoint = tmp_path / "trl-run" / "checkpoint-3"
    checkpoint.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        (checkpoint / name).write_text("{}")
    recipe = parse_args(
        ["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(checkpoint)]
    )
    with pytest.raises(ConfigError) as refused:
        resolve.check_output_dir(recipe, 8)
    assert str(refused.value) == (
        f"resume_from_checkpoint {str(checkpoint)!r} cannot be verified (no COMPLETE mark (a save or a deletion "
        "cut short, or not this project's); MANIFEST.json is missing): restore each named file from a copy, or start a "
        f"new run from a copy of its weights (cp -r {checkpoint} <new folder>, then --model_name_or_path <new folder> "
        "and a new --output_dir)"
    )
    # Sealed as this project seals a checkpoint, but moved out of its run without the record of its settings.
    sealed_checkpoint(checkpoint)
    with pytest.raises(ConfigError, match="holds no record of the settings it was trained with"):
        resolve.check_output_dir(recipe, 8)


@pytest.mark.parametrize("word", ["true", "False"])
def test_resume_from_checkpoint_given_a_word_or_its_runs_folder_names_the_fix(word, tmp_path, capsys):
    """transformers' `resume_from_checkpoint=True` typed as a word: `'true' is not a folder`, and no way on; the run's
    own folder named: its checkpoints were not looked at, and the fix offered was to start a new run from it."""
    out = unfinished_run(tmp_path, capsys)
    with pytest.raises(ConfigError) as refused_here:
        resolve.check_output_dir(
            parse_args(["--config", SMOKE, "--output_dir", str(out), "--resume_from_checkpoint", word]), 8
        )
    assert str(refused_here.value) == (
        f"resume_from_checkpoint {word!r} is not a folder: it names a checkpoint-N folder; drop it, and a rerun "
        "resumes from output_dir's newest verified checkpoint by itself (--auto_resume false: never; "
        "--overwrite_output_dir: starts afresh)"
    )
    with pytest.raises(ConfigError) as refused_here:
        resolve.check_output_dir(
            parse_args(["--config", SMOKE, "--output_dir", str(out), "--resume_from_checkpoint", str(out)]), 8
        )
    assert str(refused_here.value).endswith(
        f"pass --resume_from_checkpoint {out / 'checkpoint-4'}, the newest verified checkpoint in it"
    ), refused_here.value


def test_every_checkpoint_damaged_says_none_is_left_not_that_it_tries_one_before(tmp_path, capsys):
    """With each checkpoint cut short, the oldest one's line still said "trying the checkpoint before it", just above
    the refusal that none was left."""
    out = unfinished_run(tmp_path, capsys)
    sealed_checkpoint(out / "checkpoint-2")
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "optimizer.pt").write_text("cut")
    capsys.readouterr()
    # "restore the named file(s)", of one file or of many
    fix = "; checkpoint-2: .*: restore each named file from a copy, or pass --overwrite_output_dir to start afresh$"
    with pytest.raises(
        ConfigError, match=f"has no checkpoint left to resume from \\(checkpoint-4: optimizer.pt has 3.*{fix}"
    ):
        resolve.check_output_dir(parse_args(["--config", SMOKE, "--output_dir", str(out)]), 8)
    said = capsys.readouterr().out
    assert f"Not resuming from {out / 'checkpoint-4'}: optimizer.pt has 3 bytes" in said, said
    assert "bytes, 13 were written (cut short or replaced); trying the checkpoint before it\n" in said, said
    assert said.rstrip().endswith("bytes, 13 were written (cut short or replaced); no verified checkpoint before it")
    # The same once processes have started (checksums: each file at its size, its bytes changed)
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "optimizer.pt").write_text("optimizer.ps\n")
    with pytest.raises(RunError, match="no checkpoint left to resume from"):
        resume.confirm(
            resolve.check_output_dir(parse_args(["--config", SMOKE, "--output_dir", str(out)]), 8).resume_from, False
        )
    said = capsys.readouterr().out
    assert "checkpoint-4: optimizer.pt does not match its checksum" in said.replace(
        f"{out / 'checkpoint-4'}: ", "checkpoint-4: "
    ), said
    assert said.rstrip().endswith(
        "does not match its checksum (damaged after it was written); no verified checkpoint before it"
    ), said


@pytest.mark.parametrize("held", [[], ["notes.txt"], ["logs/"]])
def test_resume_from_a_folder_with_no_checkpoint_nor_weights_names_a_checkpoint_to_pass(held, tmp_path):
    """An empty or unrelated folder named: the advice was to restore its files, or to start a new run from its
    weights (--model_name_or_path on it), which it does not hold."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    for name in held:
        (folder / name.rstrip("/")).mkdir() if name.endswith("/") else (folder / name).write_text("mine\n")
    recipe = parse_args(recipe_args(tmp_path / "run", folder))
    with pytest.raises(ConfigError) as refused_here:
        resolve.check_output_dir(recipe, 8)
    assert str(refused_here.value).endswith(
        "it holds no checkpoint, nor weights to start from: name a checkpoint-N folder (a rerun of the same command "
        "resumes from the newest one by itself)"
    ), refused_here.value
    (folder / "config.json").write_text("{}")  # a model (a finished run's folder): starting from it is the way out
    with pytest.raises(ConfigError, match=f"start a new run from a copy of its weights \\(cp -r {folder} "):
        resolve.check_output_dir(recipe, 8)


def recipe_args(out, checkpoint) -> list[str]:
    return ["--config", SMOKE, "--output_dir", str(out), "--resume_from_checkpoint", str(checkpoint)]


def test_a_named_checkpoint_behind_the_folders_newest_is_gone_on_from_when_requeued_and_refused_before(
    tmp_path, capsys, monkeypatch
):
    """`sbatch ... --resume_from_checkpoint <other run>/checkpoint-2 --output_dir <new>`, preempted after saving its own
    checkpoint-4: the requeue runs the same command, and went back to checkpoint-2 (every requeue: the steps since
    trained again). A first start behind the folder's newest (a run sent back to an earlier checkpoint, or the command
    typed again instead of the printed one) left the newer checkpoints for the next rerun to go on from, silently."""
    out = unfinished_run(tmp_path, capsys)  # the folder, holding checkpoint-4
    named = sealed_checkpoint(tmp_path / "earlier" / "checkpoint-2")
    (named / "resolved_config.json").write_text((out / "resolved_config.json").read_text())  # the same settings
    recipe = parse_args(recipe_args(out, named))
    capsys.readouterr()
    with pytest.raises(ConfigError) as refused_here:
        resolve.check_output_dir(recipe, 8)
    assert str(refused_here.value) == (
        f"output_dir {str(out)!r} holds checkpoint-4, past resume_from_checkpoint {str(named)!r} (step 2), which the "
        "run's next rerun or requeue would go on from, not from this run's progress: drop --resume_from_checkpoint "
        "(one the recipe file names: add --resume_from_checkpoint '') to go on from checkpoint-4, move the "
        "checkpoints past step 2 out of that folder to go back to the one named, or pass a new --output_dir"
    )
    # --auto_resume false: nothing goes on from a checkpoint not named, so the one named is where it goes on from
    # (the folder's checkpoint-4, saved past it, moved aside as the run starts: output_folder.set_aside_past)
    chosen = parse_args([*recipe_args(out, named), "--auto_resume", "false"])
    going_back = resolve.OutputDecision(str(named), False, set_aside=("checkpoint-4",))
    assert resolve.check_output_dir(chosen, 8) == going_back
    assert going_back.record(str(out))["output_folder"] == (
        f"{out}: the run starts there, from the checkpoint {named}; the checkpoints saved past it (checkpoint-4) are "
        f"moved to {out}.past-checkpoint-2-<time>"
    )
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resolve.check_output_dir(chosen, 8) == going_back
    assert resolve.check_output_dir(recipe, 8) == resolve.OutputDecision(str(out / "checkpoint-4"), False)
    assert capsys.readouterr().out == (
        f"resume_from_checkpoint {named}: this job was requeued (Slurm restart 1) after saving {out / 'checkpoint-4'}: "
        "going on from that one, not back to the checkpoint named\n"
    )
    # A named checkpoint past what the folder holds is the one to go on from, requeued or not.
    ahead = named.rename(named.parent / "checkpoint-6")
    recipe = parse_args(recipe_args(out, ahead))
    assert resolve.check_output_dir(recipe, 8) == resolve.OutputDecision(str(ahead), False)
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert resolve.check_output_dir(recipe, 8) == resolve.OutputDecision(str(ahead), False)


def test_requeue_resumes_and_overwrite_starts_afresh_only_when_settings_changed(tmp_path, capsys):
    out = unfinished_run(tmp_path, capsys)
    same = parse_args(["--config", SMOKE, "--output_dir", str(out), "--logging_steps", "1", "--overwrite_output_dir"])
    # logging is not a training setting: a requeue (even with --overwrite_output_dir) keeps its progress
    assert resolve.check_output_dir(same, 8) == resolve.OutputDecision(str(out / "checkpoint-4"), False)
    other = parse_args(["--config", SMOKE, "--output_dir", str(out), "--beta", "1", "--overwrite_output_dir"])
    assert resolve.check_output_dir(other, 8) == resolve.OutputDecision(None, True)


def test_a_count_reads_in_the_singular_for_one_and_in_the_plural_otherwise():
    """One helper for every message's count (it was `'s' * (n != 1)`, `(n > 1)` or `(str(n) != '1')` by the site, and
    some sites none: "1 warm-up steps", "over 1 processes")."""
    assert [plural(n, "pair") for n in (0, 1, 2)] == ["0 pairs", "1 pair", "2 pairs"]
    assert [plural(n, "process") for n in (1, 4)] == ["1 process", "4 processes"]
    assert [plural(2, "epoch"), plural(2, "micro-batch", many="micro-batches")] == ["2 epochs", "2 micro-batches"]
    assert [plural(n, "epoch", "g") for n in (1.0, 0.5, 2.0)] == ["1 epoch", "0.5 epochs", "2 epochs"]
    assert plural(1234, "optimizer step", ",") == "1,234 optimizer steps"
    assert [plural(Spread(1, 1, 1), "pair"), plural(Spread(1, 1.5, 2), "pair")] == [
        "1 pair",
        "1-2 pairs",
    ]
    assert [plural(n, "step", count=False) for n in (1, 3)] == ["step", "steps"]


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--dataset_train_split", "training"], "--dataset_train_split"),
        (
            ["--eval_strategy", "steps", "--eval_steps", "1", "--dataset_test_split", "validation"],
            "--dataset_test_split",
        ),
    ],
    ids=["train", "test"],
)
def test_a_missing_split_names_the_flag_that_chose_it(args, flag, tmp_path, monkeypatch, capsys):
    """A split the data set does not have said "choose one of [...]" and left the user to guess which of the run's two
    split options to change: the line names it."""
    folder = tmp_path / "prefs"
    folder.mkdir()
    for split in ("train", "test"):  # datasets reads a file named for a split as that split
        shutil.copy(ROOT / "data" / "smoke_prefs.jsonl", folder / f"{split}.jsonl")
    error = refused(tmp_path, monkeypatch, capsys, "--dataset_name", str(folder), *args)
    split = args[-1]
    assert error == f"error: dataset {str(folder)!r} has no split {split!r}: set {flag} to one of ['test', 'train']"
