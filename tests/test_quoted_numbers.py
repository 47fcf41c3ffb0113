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
