"""The memory a run used beside the memory plan (dpotrain/train/memory_use.py); a real run's records are checked in
tests/test_run_records.py."""

import subprocess
import sys

import pytest

from conftest import ROOT
from dpotrain.recipe.run_record import MemoryPlan
from dpotrain.train.memory_use import MemoryUse

PLAN = {"per_gpu_gib": {"model_states": 40.0, "activations": 20.1, "total": 64.1}}


@pytest.mark.slow
def test_the_measured_peaks_are_this_process_real_size():
    """In a fresh process (this one's peak is whatever the session's largest test made it): memory touched past its
    start-up peak raises the peak."""
    code = (
        "import os\n"
        "from dpotrain.train import memory_use\n"
        "before = memory_use.peaks()['memory/peak_rss_gib']\n"
        "resident = int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 1024**3\n"
        "ballast = bytearray(int((before - resident + 0.5) * 1024**3))  # 0.5 GiB past the start-up peak\n"
        "ballast[::4096] = b'x' * len(ballast[::4096])  # touched pages count in the resident size\n"
        "after = memory_use.peaks()\n"
        "print(before, after['memory/peak_rss_gib'], 'memory/peak_reserved_gib' in after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    before, after, gpu = out.split()
    assert float(after) >= float(before) + 0.4, out
    assert gpu == "False"  # no GPU here: nothing is made up for one


def test_a_gpu_peak_is_shown_beside_the_plan_and_one_past_it_warned_once():
    use = MemoryUse(MemoryPlan.of(PLAN).total_gib)
    under = {"memory/peak_rss_gib": 12.3, "memory/peak_allocated_gib": 58.0, "memory/peak_reserved_gib": 61.2}
    assert use.line(under) == "peak 61.2 GiB reserved (58.0 allocated) per GPU, plan 64.1 GiB; host RSS 12.3 GiB"
    assert use.past_plan(under) is None
    over = {**under, "memory/peak_reserved_gib": 70.4}
    warning = use.past_plan(over)
    assert "70.4 GiB reserved" in warning and "64.1 GiB" in warning
    assert use.past_plan(over) is None  # said once


def test_an_unplanned_run_says_so():
    assert MemoryPlan.of({"skipped": "this recipe trains in fp32"}).total_gib is None
    use = MemoryUse(None)
    assert use.line({"memory/peak_rss_gib": 0.5}) == "peak host RSS 0.5 GiB (a CPU run: no GPU memory to compare)"
    assert use.past_plan({"memory/peak_rss_gib": 500.0}) is None  # host memory is not what the plan estimates
