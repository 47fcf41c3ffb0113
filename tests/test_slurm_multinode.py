"""A real two-node Slurm on one machine: the project's sbatch script across both nodes, preempted, and with a node
whose training process dies.

Each slurmd runs in a network namespace of its own (own address, hostname, spool and log; tests/slurm/cluster.sh
with DPOTRAIN_SLURM_NODES=2), so the two training processes meet over the namespaces' network exactly as two hosts
do: machine rank read on each node, rendezvous at the first node's name, gloo between the two addresses.
Run: .venv/bin/python -m pytest tests/test_slurm_multinode.py -m slurm   (root; skipped with the reason otherwise)
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_slurm_jobs import slow_checkpoint_project, wait_while_running
from transformers import TrainingArguments

from conftest import ROOT, launch_smoke_meanwhile
from slurm_cluster import SUBMIT_DIR, slurm_cluster, states_once_a_second

pytestmark = pytest.mark.slurm

STEPS = 8
DDP_TIMEOUT_S = TrainingArguments.ddp_timeout  # the collective timeout of every process group (the recipes leave it)
RUN_FILES = ["model.safetensors", "tokenizer.json", "resolved_config.json", "metrics.jsonl", "run_complete.json"]


def two_node_args(out: Path, extra: tuple[str, ...] = ("--max_steps", str(STEPS))) -> list[str]:
    """The smoke recipe, 16 pairs per step over 2 processes, cut into micro-batches by the recipe's token budget;
    STEPS of them unless `extra` says otherwise."""
    return [
        *extra,
        "--pairs_per_step",
        "16",
        "--logging_steps",
        "1",
        "--save_steps",
        "1000",
        "--report_to",
        "none",
        "--output_dir",
        str(out),
    ]


def two_node_job(
    slurm2,
    out: Path,
    env: dict | None = None,
    tasks_per_node: int = 1,
    extra=None,
    script=ROOT / "scripts" / "dpo_train.sh",
) -> int:
    """`two_node_args` through scripts/dpo_train.sh (`script`: another project's) on both nodes. CPUs: what a node
    really has (`slurmd -C`), shared among `tasks_per_node` tasks (sbatch's --ntasks-per-node)."""
    args = [
        "--nodes=2",
        "--gpus-per-node=0",
        f"--ntasks-per-node={tasks_per_node}",
        f"--cpus-per-task={node_cpus(slurm2) // tasks_per_node}",
        str(script),
        *(two_node_args(out, extra) if extra else two_node_args(out)),
    ]
    # A fresh folder for the built-in model: both ranks build it at once, as on a first run (rank 1 must wait for
    # rank 0's weights; seeded, so every job gets the same model).
    env = {
        "RECIPE": "configs/smoke.yaml",
        "DPOTRAIN_BUILTIN_DIR": str(out.parent / f"builtin-{out.name}"),
        **(env or {}),
    }
    SUBMIT_DIR.mkdir(parents=True, exist_ok=True)
    return slurm2.sbatch(args, cwd=SUBMIT_DIR, env=env)


def node_cpus(slurm) -> int:
    return int(slurm.run(["sinfo", "-h", "-N", "-o", "%c"]).stdout.split()[0])


def job_log(job: int) -> str:
    path = SUBMIT_DIR / f"dpo-think-{job}.out"  # sbatch's --output: the folder the job was submitted from
    return path.read_text(errors="replace") if path.exists() else ""  # progress bars cut mid-character


def steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_steps(slurm2, job: int, out: Path, n: int, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    state = states_once_a_second(slurm2, job)  # steps polled every 0.2 s, Slurm asked once a second
    while len(steps(out)) < n:
        assert time.time() < deadline and state()[0] in ("PENDING", "RUNNING"), (
            slurm2.job_info(job),
            job_log(job)[-3000:],
        )
        time.sleep(0.2)


def uninterrupted(folder: Path):
    """What the job computes without a preemption: its launch (2 processes of ZeRO-2 on the smoke recipe, the built-in
    model built afresh) run on this machine outside Slurm, as one `accelerate launch` of 2 processes, in a thread
    (`launch_smoke_meanwhile`: a Future of its output folder). Two ranks' gradients add up to the same sum on one node
    or two, and a two-node job costs ~50 s."""
    env = {"DPOTRAIN_BUILTIN_DIR": str(folder / "builtin"), "DPOTRAIN_CACHE": str(folder / "cache")}
    return launch_smoke_meanwhile(folder / "plain", 2, two_node_args(folder / "plain"), env=env)


@pytest.fixture(scope="module")
def preempted(slurm2, tmp_path_factory):
    """A two-node job preempted mid-training by the time-limit warning's USR1, requeued, and run to its end: both
    tests below check this one job (a two-node job is ~1 min). The uninterrupted run it is compared with runs from the
    USR1 on, while the job saves, waits for its requeue's begin time and starts again (its dry run is one process);
    run from the job's submission, it shared the CPUs with its first start. Its DPOTRAIN_CACHE is on a node-local
    disk: the same path is another folder on each node (cluster.sh binds STATE_DIR/node-local-<node> over
    STATE_DIR/node-local). Returns (job, its end state, its output folder, its cache's name, the uninterrupted run's
    folder)."""
    out = tmp_path_factory.mktemp("two-nodes") / "preempted"
    cache = f"cache-{out.parent.name}"
    # Mid-training by construction: both processes of the first start wait at the end of step 2 until the stop file the
    # USR1's trap makes (tests/helpers/slow_checkpoint.py, its checkpoint not slowed). Polled for 2 logged steps, the
    # USR1 had 6 steps (seconds) to land in; a late one on a loaded machine found the job at its end, unpreempted.
    project, held = slow_checkpoint_project(tmp_path_factory.mktemp("project")), tmp_path_factory.mktemp("held")
    env = {
        "DPOTRAIN_CACHE": str(slurm2.state_dir / "node-local" / cache),
        "SLOW_CHECKPOINT_S": "0",
        "DPOTRAIN_TEST_HOLD": "step-2@0",
        "DPOTRAIN_TEST_HOLD_DIR": str(held),
    }
    job = two_node_job(slurm2, out, env=env, script=project / "scripts" / "dpo_train.sh")
    wait_while_running(slurm2, job, (held / "held-step-2").exists)
    slurm2.signal(job, "USR1")  # what --signal=B:USR1@<seconds> delivers before the time limit
    with uninterrupted(tmp_path_factory.mktemp("uninterrupted")) as plain:
        state = slurm2.wait(job, timeout=600)
        return job, state, out, cache, plain.result()


def test_cluster_has_two_nodes_with_their_own_addresses(slurm2):
    nodes = {}
    for line in slurm2.run(["scontrol", "show", "node", "-o"]).stdout.splitlines():
        info = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        nodes[info["NodeName"]] = info
    assert sorted(nodes) == ["node1", "node2"]
    assert nodes["node1"]["NodeAddr"] != nodes["node2"]["NodeAddr"]
    assert all(n["State"].startswith(("IDLE", "MIXED", "ALLOCATED")) for n in nodes.values()), nodes
    # The nodes advertise the CPUs this machine really has (`slurmd -C`), not a number made up for the sbatch header.
    real = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    assert {n["CPUTot"] for n in nodes.values()} == {re.search(r"\bCPUs=(\d+)", real).group(1)}


@pytest.mark.slow
def test_two_node_job_trains_one_process_per_node(preempted):
    job, state, out, _, _ = preempted
    log = job_log(job)
    assert state == "COMPLETED", log[-4000:]
    # Each node read its own machine rank inside srun, and both met at the first node of the allocation.
    port = 20000 + job % 10000  # from the job id: two jobs on one node meet at different ports
    assert f"node node1: machine rank 0 of 2, rendezvous node1:{port}, 2 processes" in log
    assert f"node node2: machine rank 1 of 2, rendezvous node1:{port}, 2 processes" in log
    assert "--main_process_ip node1 " in log and "--num_machines 2 --num_processes 2 " in log
    assert "batch: 16 pairs per step over 2 processes, micro-batches of at most 2048 packed tokens" in log
    derived = json.loads((out / "resolved_config.json").read_text())["derived"]
    assert derived["world_size"] == 2  # what the training processes themselves saw (WORLD_SIZE from the launch)
    for name in RUN_FILES:
        assert (out / name).is_file(), name
    assert json.loads((out / "run_complete.json").read_text())["global_step"] == STEPS
    assert "training exited with code 0" in log


@pytest.mark.slow
def test_two_node_job_preempted_checkpoints_both_ranks_and_resumes_identically_from_node_local_caches(
    slurm2, preempted
):
    """Preempted mid-training, requeued, and ending like the uninterrupted run. Rank 0's node-local cache decides for
    both, so the nodes enter the same collectives, and both keep the finished reference for the requeued run, which
    reuses it."""
    job, state, out, cache, plain = preempted
    log = job_log(job)
    assert state == "COMPLETED", log[-4000:]
    assert slurm2.job_info(job)["Restarts"] == "1", log[-4000:]
    assert "signal received: checkpointing at the next optimizer step" in log
    assert "requeueing job" in log and "Resuming from" in log and "restart 1" in log
    # Both ranks wrote their part of the ZeRO-2 checkpoint: the optimizer state is sharded per rank.
    checkpoint = Path(re.search(r"checkpoint (\S+) written; requeueing", log).group(1))
    shards = sorted(p.name for p in checkpoint.rglob("*zero_pp_rank_*optim_states.pt"))
    assert [s.split("zero_pp_")[1][:6] for s in shards] == ["rank_0", "rank_1"], shards
    assert steps(out) == list(range(1, STEPS + 1))  # every optimizer step once: none repeated, none skipped
    # Node-local caches: each node kept the finished reference in its own folder, none outside them; the rerun
    # after the requeue reused it.
    for node in ("node1", "node2"):
        assert list((slurm2.state_dir / f"node-local-{node}" / cache / "reference").glob("*/complete.npz")), node
    assert not (slurm2.state_dir / "node-local" / cache).exists()  # outside the nodes: neither of their folders
    # the 128 pairs its 8 steps of 16 train: all the reference stage scores
    assert "reference log-probs (train): all 128 pairs reused" in log.split("restart 1", 1)[1], log[-4000:]
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all((a[k] - b[k]).abs().max().item() < 1e-6 for k in a), "resumed run diverged from the uninterrupted one"


def training_process(job: int, node: str) -> int:
    """PID of job `job`'s train_dpo.py process on `node` (its environment names the job and the node)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(
                kv.split("=", 1)
                for kv in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in kv
            )
        except OSError:
            continue
        if (
            any(arg.endswith(b"train_dpo.py") for arg in cmdline)
            and b"launch" not in cmdline  # the training process, not its launcher (accelerate launch train_dpo.py)
            and env.get("SLURM_JOB_ID") == str(job)
            and (env.get("SLURMD_NODENAME") == node)
        ):
            return int(proc.name)
    raise LookupError(f"no train_dpo.py process of job {job} on {node}")


@pytest.mark.slow
def test_a_node_whose_training_dies_ends_the_whole_job_promptly(slurm2, tmp_path):
    """A job's training process killed on node2: srun ends the other node's at once, and the job fails, unrequeued.
    The job is submitted with 2 tasks per node (`sbatch --ntasks-per-node=2`, a user's habit of one task per GPU, over
    the script's 1): srun inherits the job's task count (SLURM_NTASKS) and ignores its own --ntasks-per-node=1
    ("can't honor --ntasks-per-node set to 1"), so each node started two `accelerate launch`, machine ranks past the
    job's nodes, and the job failed before its first step. One launcher per node, whatever the job's tasks: both
    ranks train (a job of its own in tests/test_slurm_jobs.py until session 43: a job start is ~30 s)."""
    out = tmp_path / "killed"
    # Far more steps than the kill needs (a killed job costs the same): with STEPS (8) the job trained on while this
    # test found the step, read the log and searched /proc for the process, and a loaded machine's late kill could
    # find it past its last step, ended COMPLETED. Its pairs are STEPS' (128), scored by the reference stage as before,
    # trained again in each epoch. The health checks off: on these pairs `loss_floor` ended a run near step 113, so
    # the 2,000 steps were never the margin they meant to be.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[: 16 * STEPS]))
    job = two_node_job(
        slurm2,
        out,
        tasks_per_node=2,
        extra=("--max_steps", "2000", "--health_checks", "false", "--dataset_name", str(pairs)),
    )
    wait_for_steps(slurm2, job, out, 1)  # both ranks are in training, inside collectives
    ranks = re.findall(r"^node (\S+): machine rank (\d+) of 2,", job_log(job), re.M)
    assert sorted(ranks) == [("node1", "0"), ("node2", "1")], job_log(job)[-4000:]  # one launcher on each node
    os.kill(training_process(job, "node2"), signal.SIGKILL)
    # "Promptly" is an order, not a speed: the job ends before any collective could have timed out on node1 (every
    # process group holds ddp_timeout, 1,800 s by default), so its end came from srun's --kill-on-bad-exit, not from
    # node1 waiting out a collective. A wait of at most a third of that fails only there, on a hang; a clock read
    # against 60 s could fail on CI's 2 loaded cores with nothing wrong.
    state = slurm2.wait(job, timeout=DDP_TIMEOUT_S / 3)
    log = job_log(job)
    assert state == "FAILED", log[-4000:]
    assert slurm2.job_info(job)["Restarts"] == "0"  # a failure is not a preemption: no requeue
    assert "srun: error: node2: task 1: Exited with exit code" in log, log[-4000:]
    assert "training failed with exit code" in log
    assert "the same sbatch command goes on from the newest complete checkpoint" in log  # what to do next
    assert not (out / "run_complete.json").exists()


def netns_names() -> set[str]:
    return {
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
        if line.strip()
    }


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_stop_removes_only_what_start_made(slurm2, tmp_path):
    """A second two-node cluster beside the session's: started and stopped, it leaves the machine's own network and
    the other cluster's namespaces as they were."""
    before_ns, before_links = netns_names(), links()
    gen = slurm_cluster(tmp_path / "state", nodes=2)
    other = next(gen)
    made = netns_names() - before_ns
    assert len(made) == 3 and all(n.endswith(("-ctl", "-node1", "-node2")) for n in made), made
    assert node_cpus(other) >= 1 and links() == before_links  # nothing was added to this machine's namespace
    with pytest.raises(StopIteration):
        next(gen)  # the fixture's teardown: this pytest session started it, so it stops it
    assert netns_names() == before_ns  # the session cluster's namespaces are still there, the others are gone
    assert sorted(set(slurm2.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.splitlines())) == [
        "node1 idle",
        "node2 idle",
    ]
