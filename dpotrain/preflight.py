"""Preflight: does the base model find the chosen responses about as likely as the rejected ones?

DPO teaches a preference between two responses the model could already write: in 001's failed run the base model
scored the chosen side ~960 nats (summed; -4.4 per token) below the rejected one, and every learning rate did nothing
or collapsed. This module scores a seeded sample of pairs with the base model exactly as training will (the project's
trainer), and says whether the gap, the lengths and the data predict such a run, and what to do instead.

`score` is the one place where the model runs; the rest is arithmetic on its output.
"""

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np

from dpotrain import options, output_folder, stages, train_stage
from dpotrain.cluster import engine, offline
from dpotrain.data import mixture
from dpotrain.data.pair_lengths import LABELS, pair_columns
from dpotrain.plan import memory
from dpotrain.recipe import config, writes
from dpotrain.recipe.config import ProjectArguments
from dpotrain.recipe.errors import ConfigError

DEFAULT_SAMPLE = 512
PREFLIGHT_FAIL_EXIT = 3
PERCENTILES = (1, 10, 50, 90, 99)
# Losses that compare per-token averages: their gap is the per-token one. Every other loss compares summed log-probs.
PER_TOKEN_LOSSES = {"sigmoid_norm", "ipo"}


@dataclass
class Thresholds:
    # 001's lessons: "if log prob difference > 100, reconsider approach; if > 500, DPO likely won't work".
    summed_warn: float = 100.0
    summed_critical: float = 500.0
    # Per token, our choice: at 1 nat/token each chosen token is ~2.7x less (or more) likely than a rejected one, a
    # different register, not a preference; 2.5 nats (12x) is past any preference data, halfway to 001's doomed -4.4.
    per_token_warn: float = 1.0
    per_token_critical: float = 2.5
    share: float = 0.2  # a verdict needs this share of the pairs past a threshold, not a few outliers
    length_ratio: float = 2.0  # median chosen/rejected length beyond 2x (or below 1/2): 001's pairs were 2-8x
    truncated: float = round(1 - ProjectArguments.auto_coverage, 6)  # more than the analyzer's default leaves cut
    dropped: float = 0.01
    duplicates: float = 0.01
    identical: float = 0.01


_T = Thresholds()
HELP_THRESHOLDS = f"""\
Thresholds (gap = log p(chosen) - log p(rejected) under the base model, per pair):
  summed    |gap| > {_T.summed_warn:g} warns (reconsider the data), > {_T.summed_critical:g} is critical (DPO is
            unlikely to work; a failed run's data sat at -600 to -1027: docs/health.md).
  per token |gap| > {_T.per_token_warn:g} nat warns (each chosen token ~2.7x less or more likely than a rejected one:
            another register, not a preference), > {_T.per_token_critical:g} is critical (12x per token; the failed
            run's data: -4.4).
  A verdict needs {_T.share:.0%} of the pairs past a threshold. The loss decides which scale counts: sigmoid_norm
  (OLMo 3) and ipo compare per-token averages, the others summed log-probs; the other scale can only warn.
  Also warned: median chosen/rejected length ratio beyond {_T.length_ratio:g}x either way, > {_T.truncated:.0%} of pairs
  truncated, > {_T.dropped:.0%} dropped (prompt alone fills max_length), > {_T.duplicates:.0%} duplicate pairs,
  > {_T.identical:.0%} pairs whose chosen equals rejected.
Exit status: 0 ok or warn, {PREFLIGHT_FAIL_EXIT} fail, 2 bad input."""


def check_outputs(json_path: str | None, plot_path: str | None) -> None:
    """Refuse unwritable outputs before a model loads."""
    output_folder.check_report_paths({"--json": json_path, "--plot": plot_path})
    if plot_path and not plot_path.endswith(".png"):
        raise ConfigError(f"--plot {plot_path!r}: the plot is a PNG, give a path ending in .png")


def sample_rows(dataset, n: int, seed: int):
    """`n` rows drawn with `seed`, in data set order, as an in-memory Dataset (nothing cached on disk for it). The data
    set is loaded whole: `dataset_streaming` is refused by the run's checks (options.check_options)."""
    import datasets

    if n < len(dataset):
        dataset = dataset.select(np.sort(np.random.default_rng(seed).choice(len(dataset), size=n, replace=False)))
    return datasets.Dataset.from_list(dataset.to_list(), features=dataset.features)


def data_quality(pairs) -> dict:
    """The report's counts of duplicate rows and of rows whose chosen equals rejected, over the whole data set of the
    run's pairs (`stages.Data`); less the repeats a mixture's upsampling makes by design."""
    from tqdm.auto import tqdm

    records = pairs.mix.records if pairs.mix is not None else []
    repeats = sum(max(r["taken"] - r["rows_usable"], 0) for r in records)
    seen, duplicates, identical, rows = set(), 0, 0, len(pairs.train)
    for row in tqdm(pairs.train, desc="Checking duplicate pairs", file=sys.stderr, mininterval=2):
        key = hashlib.sha1(json.dumps([row.get("prompt"), row["chosen"], row["rejected"]]).encode()).digest()
        duplicates += key in seen
        seen.add(key)
        identical += row["chosen"] == row["rejected"]
    duplicates -= repeats  # each upsampled source holds its pairs whole at least once: the rest are the repeats
    return {
        "quality_rows": rows,
        "quality_scope": "whole data set",
        "upsampled_repeats": repeats,
        "duplicates": duplicates,
        "identical": identical,
        "duplicate_share": duplicates / max(rows, 1),
        "identical_share": identical / max(rows, 1),
    }


def score(recipe, launch, sample) -> dict:
    """Reference log-probs of the sample, with training's tokenization, truncation and forward: the project's trainer
    is built on the sample with `precompute_ref_log_probs`, and its prepared data set read back. Returns per kept row:
    prompt / chosen / rejected token counts and summed log-probs."""
    from transformers.trainer_utils import IntervalStrategy

    with tempfile.TemporaryDirectory(prefix="preflight-") as tmp, mock.patch.dict(os.environ, DPOTRAIN_CACHE=tmp):
        # The reference cache ($DPOTRAIN_CACHE) and the output folder live in a folder removed afterwards. Nothing
        # pushed, evaluated or trained; one epoch: the reference stage scores the pairs the planned steps train.
        scoring = config.replaced(
            recipe,
            training={
                "precompute_ref_log_probs": True,
                "max_steps": -1,
                "num_train_epochs": 1,
                "report_to": [],
                "push_to_hub": False,
                "eval_strategy": IntervalStrategy.NO,
                "do_eval": False,
                "output_dir": tmp,
                # No schedule: the sample's steps train nothing, and the run's schedule checked on them (its warm-up,
                # warmup_stable_decay's phases) refused a sample whose max_length drops made few steps (`--sample 8`:
                # "this run would train nothing") though the run's own data, checked above, trains
                "warmup_steps": 0,
                "lr_scheduler_type": "constant",
                "lr_scheduler_kwargs": {},
            },
            # memory_check off: the memory plan is training's (one process's gradients and optimizer states: OLMo 3 7B
            # on one H100, ~170 GiB), and it refused every model that trains only on several GPUs, naming sbatch
            # commands; scoring loads the weights and runs forward passes alone, within the plan's activations
            project={"health_checks": False, "samples_every": 0, "memory_check": False},
        )
        spec = stages.first_half(scoring, launch, pairs=stages.given_pairs(scoring, launch, sample))
        ready = train_stage.build_run(spec)  # the run's trainer, planned: the reference is scored as training would
        ready.score_reference()
        ds = ready.trainer.train_dataset
        columns = [*pair_columns(ds), "ref_chosen_logps", "ref_rejected_logps"]
        rows = ds.select_columns(columns).to_dict()
        device = str(ready.trainer.args.device)
        del ready
    lengths = {k: np.array([len(x) for x in rows[f"{k}_ids"]]) for k in ("prompt", "chosen", "rejected")}
    # With `assistant_turns: all`, the earlier assistant turns each side's log-prob also sums over (a prompt is
    # shorter than max_length in every kept pair, so none of them is cut)
    lengths["labeled"] = np.array([sum(x) for x in rows.get(LABELS, [[]] * len(rows["prompt_ids"]))])
    return {
        **lengths,
        "logp_chosen": np.array(rows["ref_chosen_logps"], dtype=np.float64),
        "logp_rejected": np.array(rows["ref_rejected_logps"], dtype=np.float64),
        "device": device,
    }


def _stats(values: np.ndarray) -> dict:
    if not len(values):
        return {f"p{q}": None for q in PERCENTILES} | {"mean": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in PERCENTILES} | {"mean": float(values.mean())}


def analyze(s: dict, sampled: int, max_length: int | None, loss_types: list[str], quality: dict, th: Thresholds):
    """The report (a JSON-able dict) from `score`'s output; `quality` holds duplicate / identical counts."""
    limit = max_length or sys.maxsize
    gap, gap_tok, scored_c, scored_r = gaps(s, max_length)
    pairs = len(gap)
    truncated = (s["prompt"] + np.maximum(s["chosen"], s["rejected"])) > limit
    ratio = s["chosen"] / np.maximum(s["rejected"], 1)
    loss_scale = "per_token" if set(loss_types) & PER_TOKEN_LOSSES else "summed"
    past = {  # the share of pairs past each threshold (Thresholds: <scale>_warn, <scale>_critical)
        scale: {level: _share(np.abs(values) > getattr(th, f"{scale}_{level}")) for level in ("warn", "critical")}
        for scale, values in (("summed", gap), ("per_token", gap_tok))
    }
    report = {
        "verdict": "ok",
        "pairs": pairs,
        "sampled": sampled,
        "dropped": sampled - pairs,
        "dropped_share": (sampled - pairs) / sampled if sampled else 0.0,
        "truncated_share": _share(truncated),
        "loss_scale": loss_scale,
        "gap_summed": _stats(gap),
        "gap_per_token": _stats(gap_tok),
        "logp_per_token": {k: _stats(s[f"logp_{k}"] / n) for k, n in (("chosen", scored_c), ("rejected", scored_r))},
        "past_thresholds": past,
        "length_ratio": _stats(ratio),
        "tokens": {k: _stats(s[k].astype(float)) for k in ("prompt", "chosen", "rejected")},
        **quality,
        "thresholds": th.__dict__,
        "reasons": [],
        "advice": [],
    }
    _judge(report, gap, gap_tok, th)
    return report


def _share(mask: np.ndarray) -> float:
    return float(mask.mean()) if len(mask) else 0.0


def _judge(report: dict, gap: np.ndarray, gap_tok: np.ndarray, th: Thresholds) -> None:
    """Fill verdict, reasons and advice."""
    reasons, advice = report["reasons"], report["advice"]
    levels = []

    def flag(level: str, reason: str, todo: str | None = None):
        levels.append(level)
        reasons.append(f"{level}: {reason}")
        if todo and todo not in advice:
            advice.append(todo)

    if report["pairs"] == 0:
        flag("fail", "no pair survives max_length: every sampled prompt alone fills it", "raise max_length")
    for scale, values, unit in (("summed", gap, "nats"), ("per_token", gap_tok, "nats/token")):
        share = report["past_thresholds"][scale]
        past = next((threshold for threshold in ("critical", "warn") if share[threshold] >= th.share), None)
        if not len(values) or past is None:
            continue
        median = float(np.median(values))
        counts = report["loss_scale"] == scale
        where = ("" if counts else "not ") + "the scale this recipe's loss sees"
        beyond = getattr(th, f"{scale}_{past}")
        what = f"{share[past]:.0%} of pairs have a {scale} gap beyond ±{beyond:g} {unit} ({where})"
        level = "fail" if past == "critical" and counts else "warn"
        if median < 0:
            flag(
                level,
                f"{what}; median {median:.3g}: the base model finds the chosen responses far LESS likely than "
                "the rejected ones (a run at -960 summed, -4.4 per token failed at every learning rate)",
                "SFT the model on the chosen responses first (or pick a base model that already writes that way), "
                "then run this preflight again",
            )
        else:
            flag(
                level,
                f"{what}; median {median:.3g}: the base model already finds the rejected responses far less "
                "likely; such pairs teach little, and the loss is met by pushing the rejected side down",
                "check the rejected side (truncated, broken or off-distribution responses?) or build harder pairs",
            )
    ratio = report["length_ratio"]["p50"]
    if ratio is not None and (ratio > th.length_ratio or ratio < 1 / th.length_ratio):
        normalized = report["loss_scale"] == "per_token"
        todo = "build length-controlled pairs" + ("" if normalized else ", or use the length-normalized sigmoid_norm")
        flag(
            "warn",
            f"chosen responses are {ratio:.2g}x as long as rejected ones (median): the model can learn "
            "length instead of quality" + (" (the length-normalized loss limits this)" if normalized else ""),
            todo,
        )
    for key, limit, todo in (
        ("truncated_share", th.truncated, "raise max_length (scripts/analyze_dataset.py recommends one)"),
        ("dropped_share", th.dropped, "raise max_length or shorten the prompts: these rows are dropped"),
        ("duplicate_share", th.duplicates, "deduplicate the data set: repeated pairs are trained on repeatedly"),
        ("identical_share", th.identical, "remove pairs whose chosen equals rejected: they carry no preference"),
    ):
        if report.get(key) is not None and report[key] > limit:
            flag("warn", f"{report[key]:.1%} {key.removesuffix('_share').replace('_', ' ')} (> {limit:.0%})", todo)
    report["verdict"] = "fail" if "fail" in levels else "warn" if levels else "ok"
    if levels:
        advice.append(
            "train with a lower learning rate and keep the health guards on (health_checks, the default) "
            "to stop a collapse early"
        )


def to_markdown(r: dict) -> str:
    def row(name, st, fmt="{:.3g}"):
        cells = [("-" if st[k] is None else fmt.format(st[k])) for k in [*(f"p{q}" for q in PERCENTILES), "mean"]]
        return f"| {name} | " + " | ".join(cells) + " |"

    head = "| | " + " | ".join(f"p{q}" for q in PERCENTILES) + " | mean |\n|---|" + "---|" * (len(PERCENTILES) + 1)
    th, past, setup = r["thresholds"], r["past_thresholds"], r["setup"]
    lines = [
        "# DPO preflight",
        "",
        f"Model `{setup['model']}` on `{setup['dataset']}`: {r['pairs']} pairs scored of {r['sampled']} sampled "
        f"(seed {setup['seed']}), max_length {setup['max_length']}, loss {setup['loss_type']}, on {setup['device']}.",
        "",
        "## Log-prob gap: chosen − rejected under the base model",
        "",
        head,
        row("summed (nats)", r["gap_summed"]),
        row("per token (nats)", r["gap_per_token"]),
        *(row(f"{k} per token", r["logp_per_token"][k]) for k in ("chosen", "rejected")),
        "",
        f"The loss of this recipe compares **{r['loss_scale'].replace('_', ' ')}** log-probs.",
        "",
        "| pairs past | warn | critical |",
        "|---|---|---|",
        f"| \\|summed gap\\| > {th['summed_warn']:g} / {th['summed_critical']:g} | {past['summed']['warn']:.1%} | "
        f"{past['summed']['critical']:.1%} |",
        f"| \\|per-token gap\\| > {th['per_token_warn']:g} / {th['per_token_critical']:g} | "
        f"{past['per_token']['warn']:.1%} | {past['per_token']['critical']:.1%} |",
        "",
        "## Lengths and data",
        "",
        head,
        row("chosen / rejected tokens", r["length_ratio"]),
        *(row(f"{k} tokens", r["tokens"][k], "{:.0f}") for k in ("prompt", "chosen", "rejected")),
        "",
        f"- truncated (prompt + longer side > max_length): {r['truncated_share']:.1%} of scored pairs",
        f"- dropped (prompt alone fills max_length): {r['dropped']} of {r['sampled']} ({r['dropped_share']:.1%})",
        f"- duplicate pairs: {r['duplicates']} ({r['duplicate_share']:.1%}) and chosen == rejected: "
        f"{r['identical']} ({r['identical_share']:.1%}), of {r['quality_rows']} rows ({r['quality_scope']})"
        + (
            f"; besides the {r['upsampled_repeats']} repeats the mixture's upsampling makes"
            if r.get("upsampled_repeats")
            else ""
        ),
        "",
        f"## Verdict: {r['verdict'].upper()}",
        "",
    ]
    lines += [f"- {x}" for x in r["reasons"]] or ["- the base model finds both sides of the pairs comparably likely"]
    if r["advice"]:
        lines += ["", "What to do:", ""] + [f"{i}. {x}" for i, x in enumerate(r["advice"], 1)]
    return "\n".join(lines) + "\n"


def plot(s: dict, r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # batch nodes have no display
    import matplotlib.pyplot as plt

    gap, gap_tok, _, _ = gaps(s, r["max_length"])
    th = r["thresholds"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    shown = ((gap, "summed gap (nats)", "summed"), (gap_tok, "per-token gap (nats/token)", "per_token"))
    for ax, (values, title, scale) in zip(axes, shown, strict=True):
        ax.hist(values, bins=50, color="tab:blue", alpha=0.8)
        for level, color in (("warn", "orange"), ("critical", "red")):  # each threshold on both sides of 0
            for x in (th[f"{scale}_{level}"], -th[f"{scale}_{level}"]):
                ax.axvline(x, color=color, linestyle="--", linewidth=1)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("log p(chosen) − log p(rejected)")
    axes[0].set_ylabel("pairs")
    fig.suptitle(f"DPO preflight: {r['verdict']} ({r['pairs']} pairs)")
    fig.tight_layout()
    with writes.replacing(path, "wb") as f:
        fig.savefig(f, dpi=100, format=Path(path).suffix.lstrip(".").lower() or "png")
    plt.close(fig)


def gaps(s: dict, max_length: int | None):
    """Per pair: summed gap, per-token gap, and the scored tokens (keep_start truncation) of each side: its completion's
    and, with `assistant_turns: all`, its earlier assistant turns."""
    limit = max_length or sys.maxsize
    labeled = s.get("labeled", 0)
    scored_c = np.maximum(np.minimum(s["prompt"] + s["chosen"], limit) - s["prompt"] + labeled, 1)
    scored_r = np.maximum(np.minimum(s["prompt"] + s["rejected"], limit) - s["prompt"] + labeled, 1)
    gap = s["logp_chosen"] - s["logp_rejected"]
    return gap, s["logp_chosen"] / scored_c - s["logp_rejected"] / scored_r, scored_c, scored_r


def _in_one_process(recipe):
    """The recipe the preflight scores: in its one process, each pair whole. A recipe's sequence_parallel_size N > 1
    (each pair split over a group of N processes) did not divide that one process, so `PREFLIGHT=1` ended the job
    before training; scoring is forward passes alone, without gradients or optimizer states."""
    n = recipe.project.sequence_parallel_size
    if n <= 1:
        return recipe  # 1, or a value the run's own checks refuse
    print(f"Preflight: scoring in one process, each pair whole (the run splits it over {n})", file=sys.stderr)
    return config.replaced(recipe, project={"sequence_parallel_size": 1})


def run(recipe, sample_size: int = DEFAULT_SAMPLE, seed: int | None = None, json_path=None, plot_path=None) -> int:
    """The whole preflight on a parsed recipe, for train_dpo.py --preflight and scripts/preflight.py alike; returns
    the exit status. First what the run refuses from the recipe alone (`stages.checks`), on the recipe it scores in
    its one process; the pairs are the run's: loaded by the run's data stage (a Hub data set at the run's commit,
    every row checked), and `max_length: auto` resolved by its lengths stage."""
    recipe = _in_one_process(recipe)
    launch = stages.checks(recipe)
    if recipe.project.dry_run:
        # `--dry-run --preflight` (or a recipe's dry_run: true): the preflight loaded the model and scored the sample,
        # on the dry run's planned launch and bf16 on a CPU, its report on stderr, exit 0, for a command that promised
        # to load nothing
        raise ConfigError(
            "--dry-run with the preflight: a dry run loads nothing, and the preflight loads the model to score a "
            "sample: drop --dry-run (or pass --dry_run false) to run the preflight, or run train_dpo.py --dry-run "
            "--preflight false for the dry run alone"
        )
    # A model folder without weights: refused here, for scripts/preflight.py as for `train_dpo.py --preflight`; the
    # script ended in transformers' OSError traceback at the model's load, after the whole data set was read
    options.check_weights(recipe.model.model_name_or_path)
    offline.check_job_reachable(recipe)  # a model or data set to download: the Hub must answer, within seconds
    # Offline (HF_HUB_OFFLINE), a model or data set not cached: the run's line, naming the prefetch command (the
    # preflight said the model folder needed its tokenizer files, or datasets' OfflineModeIsEnabled, naming no fix)
    offline.check_offline_artifacts(recipe)
    check_outputs(json_path, plot_path)
    inputs = writes.input_files(*(path for _, path in output_folder.reads(recipe)), recipe.config_path)
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        writes.check_not_input(flag, path, inputs)  # a report never replaces what it describes
    data_names = [recipe.script.dataset_name, *mixture.local_files(mixture.fields_of(recipe))]
    output_folder.check_reports_outside_data({"--json": json_path, "--plot": plot_path}, data_names)
    if sample_size < 1:
        raise ConfigError(f"--sample must be >= 1 (got {sample_size})")
    if seed is not None and not 0 <= seed < 2**32:  # numpy's seed range
        raise ConfigError(
            f"--seed {seed} is out of range: give one from 0 to 2**32 - 1, or leave it out (the recipe's)"
        )
    seed = recipe.training.seed if seed is None else seed
    # stdout is the report's alone (`> report.md`, "Markdown goes to stdout"): the stages' own lines (Forward:, Plan:,
    # Cut at max_length, reference log-probs) go to stderr, as a dry run's do; they came first in the report's file
    with contextlib.redirect_stdout(sys.stderr):
        pairs = stages.load_data(recipe, launch, say=False)
        if pairs.revision is not None:  # a Hub data set's commit, as the run pins it
            recipe = config.replaced(recipe, project={"dataset_revision": pairs.revision})
        if recipe.max_length_auto:  # as training resolves it (the analyzer's cached report when there is one)
            engine.start_processes(recipe.training, engine.launched())  # the recipe's timeout, as training's
            path = stages.model_files(recipe, launch)
            model_config = memory.model_config(recipe, path, local_only=launch.dry_run)[0]
            lengths = stages.measure_lengths(recipe, launch, pairs, path, model_config)
            recipe = config.replaced(recipe, training={"max_length": lengths.max_length})
        quality = data_quality(pairs)
        sample = sample_rows(pairs.train, sample_size, seed)
        loss_types = list(recipe.training.loss_type)
        sources = mixture.parse(mixture.fields_of(recipe))  # the data set the report names: a mixture's sources
        s = score(recipe, launch, sample)
    report = analyze(s, len(sample), recipe.training.max_length, loss_types, quality, Thresholds())
    report["max_length"] = recipe.training.max_length
    report["setup"] = {
        "model": recipe.model.model_name_or_path,
        "dataset": [source.spec() for source in sources] if sources is not None else recipe.script.dataset_name,
        "seed": seed,
        "max_length": recipe.training.max_length,
        "loss_type": "+".join(loss_types),
        "device": s["device"],
    }
    print(to_markdown(report), flush=True)
    if json_path:
        writes.write_text(json_path, json.dumps(report, indent=1, default=_json_default) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path:
        plot(s, report, plot_path)
        print(f"wrote {plot_path}", file=sys.stderr)
    return PREFLIGHT_FAIL_EXIT if report["verdict"] == "fail" else 0


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(type(x))
