"""Every memory figure the README's recipe table and the recipes' headers quote is what the dry run prints for that
recipe and launch (docs/memory.md's own table is held by tests/test_memory.py): a change to the plan that moves one
fails here until the quote follows."""

import json
import re

import pytest
import torch

import train_dpo
from conftest import ROOT

MODELS = {"7b": ROOT / "configs" / "models" / "olmo3-7b", "32b": ROOT / "configs" / "models" / "olmo3-32b"}
# 128K traces need a model that takes 131072 positions (OLMo 3 7B takes 65536: the run refuses longer): the 7B shape
# with its context extended by yarn, as a user would extend it in config.json
LONG_CONTEXT = {
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536},
}
# The plan chooses its checkpointed layers for the GPU: named where it is not the recipe's B200.
H100 = ("--gpu_memory_gib", "79.6")
LONG_64K = ("--max_length", "65536", "--max_tokens_per_microbatch", "131072")
LONG_128K = ("--max_length", "131072", "--max_tokens_per_microbatch", "262144")
GROUP_4 = ("--sequence_parallel_size", "4")
# (file, the quote with {} for each figure, the launches planned for them: recipe, model, processes, GPUs per node,
# further flags)
QUOTES = [
    ("README.md", "7B: ~{} GiB under ZeRO-2: not 80 GB H100s", [("think", "7b", 4, 4)]),
    ("README.md", "32B: ~{} GiB on 2 nodes, ~{} on 4", [("think-32b", "32b", 8, 4), ("think-32b", "32b", 16, 4)]),
    ("README.md", "7B: ~{} GiB under ZeRO-2 (tight; ~{} on 8)", [("instruct", "7b", 4, 4), ("instruct", "7b", 8, 4)]),
    ("configs/think.yaml", "--dry-run) is ~{} GiB", [("think", "7b", 4, 4)]),
    ("configs/think.yaml", "2 nodes of 8 under ZeRO-2 (~{} GiB)", [("think", "7b", 16, 8)]),
    (
        "configs/think-32b.yaml",
        "~{} GiB per GPU on 2 nodes, ~{} on 4",
        [("think-32b", "32b", 8, 4), ("think-32b", "32b", 16, 4)],
    ),
    ("configs/think-32b.yaml", "One node (~{} GiB) does not fit", [("think-32b", "32b", 4, 4)]),
    (
        "configs/instruct.yaml",
        "~{} GiB per GPU under ZeRO-2 on 4 GPUs (tight: ~{} on 8)",
        [("instruct", "7b", 4, 4), ("instruct", "7b", 8, 4)],
    ),
    # Long traces (sequence parallelism): a launch's further flags after its GPUs per node.
    (
        "README.md",
        "64K traces, 7B, one node of 8 x H100: ~{} GiB per GPU (without the flag ~{}, refused",
        [("think", "7b", 8, 8, *H100, *LONG_64K, *GROUP_4), ("think", "7b", 8, 8, *H100, *LONG_64K)],
    ),
    (
        "docs/sequence_parallel.md",
        "Without the flag that dry run plans ~{} GiB per GPU and is refused",
        [("think", "7b", 8, 8, *H100, *LONG_64K)],
    ),
    ("docs/sequence_parallel.md", "With it, ~{} GiB per GPU", [("think", "7b", 8, 8, *H100, *LONG_64K, *GROUP_4)]),
    (
        "configs/think.yaml",
        "64K traces on one node of 8 x H100: --sequence_parallel_size 4 (~{} GiB per GPU",
        [("think", "7b", 8, 8, *H100, *LONG_64K, *GROUP_4)],
    ),
    (
        "configs/think.yaml",
        "128K traces on one node of 4 x B200: --sequence_parallel_size 2 (~{} GiB per GPU; ~{} with 4)",
        [
            ("think", "7b-128k", 4, 4, *LONG_128K, "--sequence_parallel_size", "2"),
            ("think", "7b-128k", 4, 4, *LONG_128K, *GROUP_4),
        ],
    ),
    (
        "docs/memory.md",
        "plans ~{} GiB per GPU with the cached reference and ~{} GiB with `--precompute_ref_log_probs false`",
        [
            ("think", "7b", 8, 8, *H100, *LONG_64K, *GROUP_4),
            ("think", "7b", 8, 8, *H100, *LONG_64K, *GROUP_4, "--precompute_ref_log_probs", "false"),
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the quotes are for the recipes' GPUs, planned from a CPU")
def test_every_quoted_memory_figure_is_the_dry_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the dry run checks W&B as the run does; these recipes report to it
    config = json.loads((MODELS["7b"] / "config.json").read_text())
    (tmp_path / "7b-128k").mkdir()
    (tmp_path / "7b-128k" / "config.json").write_text(json.dumps({**config, **LONG_CONTEXT}))
    models = {**MODELS, "7b-128k": tmp_path / "7b-128k"}
    planned = {}
    for launch in {launch for _, _, launches in QUOTES for launch in launches}:
        recipe, model, world, per_node, *flags = launch
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("GPUS_PER_NODE", str(per_node))
        train_dpo.main(
            [
                "--config",
                str(ROOT / "configs" / f"{recipe}.yaml"),
                "--model_name_or_path",
                str(models[model]),
                "--output_dir",
                str(tmp_path / "o"),
                "--memory_check",
                "false",
                "--dry-run",
                "--json",
                *flags,
            ]
        )
        planned[launch] = json.loads(capsys.readouterr().out)["derived"]["memory"]["per_gpu_gib"]["total"]
    for path, quote, launches in QUOTES:
        text = re.sub(r"\s*\n#\s*", " ", (ROOT / path).read_text())  # a YAML header's comment lines, joined
        expected = quote.format(*(f"{planned[launch]:.1f}" for launch in launches))
        assert expected in text, (path, expected)


# The package names the pages write, as requirements.txt spells them
PINNED = {
    "torch": "torch",
    "TRL": "trl",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "DeepSpeed": "deepspeed",
}


def test_the_versions_and_the_demos_pairs_the_pages_quote_are_the_repositorys():
    """The README's pins (`torch 2.15.0, TRL 1.16, ...`), the torch its step 2 installs and the one docs/running.md
    names, and the demo's 384 pairs: quoted where a newcomer reads them, and held by nothing until a version bump or a
    new pair left the quote behind."""
    pins = dict(line.split("==") for line in (ROOT / "requirements.txt").read_text().splitlines() if "==" in line)
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    quoted = re.search(r"installs the pins of `requirements.txt` \(([^)]*)\)", readme).group(1)
    named = dict(re.findall(r"(\w+) (\d[\d.]*)", quoted))
    assert set(named) == set(PINNED), quoted
    for name, version in named.items():
        assert f"{pins[PINNED[name]]}.".startswith(f"{version}."), (name, version, pins[PINNED[name]])
    assert f"pip install torch=={pins['torch']} " in readme and f"builds of {pins['torch']})" in readme
    assert f"the CUDA build of torch {pins['torch']} first" in (ROOT / "docs" / "running.md").read_text()
    pairs = len((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines())
    assert f"trains on {pairs} bundled preference pairs" in readme


def test_the_recipes_table_gives_each_recipes_values():
    """docs/recipes.md's first table (max_length, beta, learning rate, pairs per step and the token budget of each
    recipe, `same` for the first column's) against the recipes' own YAML, which a recipe's edit left behind unseen."""
    import yaml

    text = (ROOT / "docs" / "recipes.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.split("\n\n| | `think.yaml`", 1)[1].split("\n\n")[0].splitlines()]
    recipes = ["think", "think-32b", "instruct", "smoke"]
    fields = {
        "`max_length`": "max_length",
        "`beta`": "beta",
        "`learning_rate`": "learning_rate",
        "pairs per step": "pairs_per_step",
        "micro-batches": "max_tokens_per_microbatch",
    }
    checked = 0
    for row in rows:
        field = fields.get(row[0].strip())
        if field is None:
            continue
        cells = [cell.strip() for cell in row[1:]]
        cells = [cells[0] if cell == "same" else cell for cell in cells]
        for recipe, cell in zip(recipes, cells, strict=True):
            value = yaml.safe_load((ROOT / "configs" / f"{recipe}.yaml").read_text())[field]
            number = float(re.search(r"[\d][\d,.]*(?:e-?\d+)?", cell).group(0).replace(",", ""))
            assert number == float(value), (field, recipe, cell, value)
            checked += 1
    assert checked == len(fields) * len(recipes), checked  # every row read: a change of the table fails here
