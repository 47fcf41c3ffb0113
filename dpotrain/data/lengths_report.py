"""The analyzer's report for people: the markdown tables and the length histogram (numbers from `lengths.summarize`)."""

from pathlib import Path

from dpotrain.data.lengths import STEP, Measured, capped_line, longer, short_of_target
from dpotrain.recipe.errors import plural
from dpotrain.recipe.writes import replacing

LISTED = 50  # the invalid rows the report lists (the JSON report holds them all)


def to_markdown(report: dict, current_max_length: int | None = None, given_by: str = "recipe") -> str:
    """The "Sequence Length Analysis" section: percentiles, breakdown, cumulative distribution, rationale.
    `given_by`: whose the current max_length is, the recipe's or `--max_length` (the command line's, over it)."""
    n = report["rows"]
    lines = [f"### Sequence Length Analysis: {report.get('dataset', 'dataset')}", ""]
    seen = report.get("rows_seen", n)
    sample = f" (a seeded sample of {plural(seen, 'row', ',')})" if report.get("sample") else ""
    if report.get("synthetic"):
        lines += [f"{plural(n, 'pair', ',')} of synthetic token counts (nothing tokenized).", ""]
    else:
        tokenizer = report.get("tokenizer", "?")
        how = f"with the chat template of `{tokenizer}`"
        if template := report.get("chat_template"):  # a chat_template_path: the model's own was not used
            how = f"with the chat template `{template}` and the tokenizer of `{tokenizer}`"
        if report["format"] != "messages":
            how = f"as plain text with the tokenizer of `{tokenizer}` (no chat template)"
        read = f" Rows read as: {report['shape']}." if report.get("shape") else ""
        lines += [f"{plural(n, 'pair', ',')}{sample} tokenized as TRL's DPOTrainer tokenizes them, {how}.{read}", ""]
    lines += [
        "**Total Length (prompt + max(chosen, rejected)):**",
        "",
        "| Percentile | Tokens |",
        "|------------|--------|",
    ]
    names = {"p50": "Median (50th)", "p90": "90th", "p95": "95th", "p99": "99th", "max": "Max"}
    lines += [f"| {names[k]} | {v:,} |" for k, v in report["total"].items()]
    lines += [
        "",
        "**Component Breakdown:**",
        "",
        "| Component | Median | 90th | 95th | 99th | Max |",
        "|-----------|--------|------|------|------|-----|",
    ]
    for key, label in (("prompt", "Prompt"), ("chosen", "Chosen Response"), ("rejected", "Rejected Response")):
        lines.append(f"| {label} | " + " | ".join(f"{v:,}" for v in report[key].values()) + " |")
    lines += ["", "**Cumulative Distribution:**", "", "| Max Length | Samples Covered |", "|---|---|"]
    lines += [f"| {int(k):,} | {v:.1%} |" for k, v in report["coverage"].items()]
    batch = next(iter(report["candidates"].values()))["padding"]["batch_size"]
    best = report["recommended_max_length"]
    lines += [
        "",
        f"**Candidates.** Packed (the default) a pair costs the positions of its two sequences cut at max_length, "
        f"(P + C) + (P + R); with the prompt computed once per pair, P + C + R; both per pair and against "
        f"max_length={best:,}. *Price*: what this row costs over the row above per 1% more pairs made whole, in packed "
        f"compute as a share of the recommended row's (+0.50% per 1%: ten more pairs in a hundred whole for 5% more "
        f"compute; — where none is made whole). Padded batches (TRL's DataCollatorForPreference, "
        f"{plural(batch, 'pair')} = {2 * batch} sequences padded to the longest) would also run the padding shown.",
        "",
        "| max_length | Covered | Truncated | Dropped (prompt fills it) | Packed per pair | vs recommended "
        "| Prompt once: per pair | vs recommended | Price | Padded: padding (shuffled) | (data set order) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for k, c in report["candidates"].items():
        p, compute = c["padding"], c["compute"]
        mark = " (recommended)" if int(k) == best else ""
        mark += f" ({given_by})" if current_max_length == int(k) else ""
        price = "—"
        if previous is not None and c["coverage"] > previous["coverage"]:
            extra = compute["relative"] - previous["compute"]["relative"]
            price = f"{extra / (c['coverage'] - previous['coverage']) / 100:+.2%} per 1%"
        previous = c
        lines.append(
            f"| {int(k):,}{mark} | {c['coverage']:.1%} | {c['truncated']:,} ({c['truncated'] / n:.1%}) | "
            f"{c['dropped']:,} | {compute['positions'] / n:,.0f} | {compute['relative']:.1%} | "
            f"{compute['positions_shared_prompt'] / n:,.0f} | {compute['relative_shared_prompt']:.1%} | {price} | "
            f"{p['padded']:.1%} ({p['wasted_per_pair']:,.0f} per pair) | {p['padded_dataset_order']:.1%} |"
        )
    lines += _rationale(report, current_max_length, batch, given_by)
    return "\n".join(lines) + "\n"


def _rationale(report: dict, current_max_length: int | None, batch: int, given_by: str = "recipe") -> list[str]:
    """The markdown's last part: why the recommended max_length, the recipe's own, and the invalid rows."""
    n, r = report["rows"], report["recommendation"]
    chosen = report["candidates"][str(r["max_length"])]
    lower, doubled = r["lower"], r["doubled"]
    cheaper = f"{lower['max_length']:,} leaves {lower['coverage']:.1%} for {-lower['compute']:.1%} less packed compute"
    lines = [
        "",
        f"**Rationale for max_length={r['max_length']}:**",
        "",
        (
            f"- Within the model's positions, below the target of {r['target_coverage']:.1%} of pairs whole"
            if short_of_target(r)
            else f"- Smallest multiple of {STEP} leaving at least {r['target_coverage']:.1%} of pairs whole"
        )
        + f": it leaves {r['coverage']:.1%}"
        + (f"; {cheaper}" if lower["max_length"] > 0 else ""),
    ]
    if raised := r.get("raised"):
        lines.append(
            f"- Raised from {raised['from']:,}, the smallest multiple reaching the target, where only "
            f"{raised['teaching']:,} of {n:,} pairs keep anything to learn (their prompts alone fill it): "
            "training refuses fewer than half"
        )
    if r.get("capped"):
        line = capped_line(r)
        lines.append(f"- {line[0].upper()}{line[1:]}")
    cut, dropped = r["truncated"], r["dropped"]
    lines.append(
        f"- {plural(cut, 'pair', ',')} ({cut / n:.1%}) {'is' if cut == 1 else 'are'} cut at max_length (the collator "
        f"keeps the {'end' if r.get('truncation_mode') == 'keep_end' else 'start'}); {dropped:,} "
        f"{'is' if dropped == 1 else 'are'} dropped by the trainer because {'its' if dropped == 1 else 'their'} prompt "
        "alone fills it"
    )
    if doubled is not None:  # None at the model's positions: no longer length a run takes
        more = doubled["coverage"] - r["coverage"]
        # the longer length's trade in the Price column's unit too: compute per 1% more pairs whole
        per_point = (
            f", {doubled['compute'] / more / 100:+.2%} per 1% more pairs whole (the Price column's unit)"
            if more > 0
            else ""
        )
        lines.append(
            f"- Packed, a longer max_length costs only the extra tokens of the longer pairs: {longer(r)} would leave "
            f"{more:.1%} more pairs whole for {doubled['compute']:+.1%} packed compute "
            f"({doubled['compute_shared_prompt']:+.1%} with the prompt once){per_point}"
        )
    lines += [
        f"- Padded batches of {plural(batch, 'pair')} would add {chosen['padding']['padded']:.1%} padding "
        f"({chosen['padding']['wasted_per_pair']:,.0f} positions per pair); packed batches: none",
    ]
    if current_max_length and str(current_max_length) in report["candidates"]:
        c = report["candidates"][str(current_max_length)]
        whose = "The recipe's max_length=" if given_by == "recipe" else f"{given_by} "
        lines.append(
            f"- {whose}{current_max_length:,} covers {c['coverage']:.1%} ({c['truncated']:,} "
            f"truncated, {c['dropped']:,} dropped) at {c['compute']['relative']:.1%} of the recommended packed compute"
        )
    invalid = report["invalid"]
    if invalid["count"]:
        lines += ["", f"**Invalid rows, left out of every number above: {invalid['count']:,}**", ""]
        listed = invalid["rows"][:LISTED]
        if any("where" in p for p in listed):  # where each is in the user's files (`data.row_locations`)
            lines += ["| Row | Where | Column | Problem |", "|---|---|---|---|"]
            lines += [f"| {p['index']} | {p.get('where', '')} | {p['column']} | {p['problem']} |" for p in listed]
        else:
            lines += ["| Row | Column | Problem |", "|---|---|---|"]
            lines += [f"| {p['index']} | {p['column']} | {p['problem']} |" for p in listed]
        if invalid["count"] > LISTED:
            lines.append(f"| ... | | {invalid['count'] - LISTED:,} more in the JSON report |")
    return lines


def plot(m: Measured, report: dict, path: str | Path) -> Path:
    """Histogram of total length, with the candidate cut-offs dashed and the recommendation in red."""
    import matplotlib

    matplotlib.use("Agg")  # login nodes have no display
    import matplotlib.pyplot as plt

    total = m.total
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.hist(total, bins=100, color="#4c72b0", alpha=0.8)
    best = report["recommended_max_length"]
    right = max(int(total.max()), best) * 1.05
    ax.set_xlim(0, right)
    for k, c in report["candidates"].items():
        n = int(k)
        if n == best or n > right:  # cut-offs far beyond the data would squash the histogram
            continue
        ax.axvline(n, color="grey", linestyle="--", linewidth=1)
        ax.text(n, ax.get_ylim()[1] * 0.95, f" {n:,}\n {c['coverage']:.0%}", fontsize=8, va="top")
    ax.axvline(
        best, color="red", linewidth=2, label=f"recommended {best:,} ({report['recommendation']['coverage']:.1%})"
    )
    ax.set_xlabel("prompt + max(chosen, rejected), tokens")
    ax.set_ylabel("pairs")
    ax.set_title(f"{report.get('dataset', '')}: {m.rows:,} pairs")
    ax.legend()
    fig.tight_layout()
    with replacing(path, "wb") as f:  # never half an image where an earlier one was
        fig.savefig(f, dpi=100, format=Path(path).suffix.lstrip(".").lower())
    plt.close(fig)
    return Path(path)
