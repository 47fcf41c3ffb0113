"""The built-in model built by several ranks at once, as on the first multi-process or multi-node run.

Once torch.distributed is up, transformers' `save_pretrained` writes weights on global rank 0 only; a rank > 0 must
then wait for rank 0's folder, not publish one without weights (seen on the first two-node Slurm job:
"Unrecognized model in outputs/.builtin/tiny-olmo3-v1").
"""

import json
import os
import subprocess

import pytest

from conftest import ROOT, rank_python, torchrun_launch

RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
from dpotrain.data import builtin
path = builtin.materialize_model("builtin:tiny-olmo3")
# A file per rank: the ranks' prints share one pipe, and one rank's line can land inside the other's.
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"rank": dist.get_rank(), "path": path, "files": sorted(os.listdir(path))}, f)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_building_the_builtin_model_both_get_its_weights(tmp_path):
    script = tmp_path / "build.py"
    script.write_text(RANK_SCRIPT)
    env_dir = tmp_path / "builtin"
    result = subprocess.run(
        [
            *torchrun_launch(),  # the agent on the warm interpreter (tests/helpers/warm.py): ~4.5 CPU-s less
            "--standalone",
            "--nproc_per_node",
            "2",
            *rank_python(),
            str(script),
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "DPOTRAIN_BUILTIN_DIR": str(env_dir), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["path"] == str(env_dir / "tiny-olmo3-v1")
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(r["files"]), r
    assert [p.name for p in env_dir.iterdir()] == ["tiny-olmo3-v1"]  # no half-built folder left behind
