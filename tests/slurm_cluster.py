"""A real Slurm for tests, started by tests/slurm/cluster.sh: one node, or several in network namespaces.

Use it as a session-scoped fixture (a thin wrapper, so it can live in tests/conftest.py):

    from slurm_cluster import slurm_cluster

    @pytest.fixture(scope="session")
    def slurm():
        yield from slurm_cluster()

    @pytest.mark.slurm
    def test_train(slurm, tmp_path):
        job = slurm.sbatch(["--gpus-per-node=0", str(ROOT / "scripts" / "train.sbatch")], cwd=tmp_path)
        assert slurm.wait(job, timeout=120) == "COMPLETED"
        assert slurm.job_info(job)["Restarts"] == "0"

The cluster is skipped (pytest.skip with cluster.sh's own error text) where Slurm cannot be
installed or started, e.g. when not root. At session end it is stopped only if a pytest session
started it and no other pytest session still uses it; one started by hand is left alone.
`slurm_cluster(state_dir, nodes=2)` starts a two-node cluster (each slurmd in its own network namespace); its
clients then run inside the controller's namespace (`SlurmCluster.run` does it), and it is skipped with the reason
where namespaces cannot be made. Environment: DPOTRAIN_SLURM_STATE_DIR (default /tmp/dpotrain-slurm; a
two-node cluster uses <that>-2nodes), DPOTRAIN_SLURM_KEEP=1 (leave it running), and cluster.sh's own
(DPOTRAIN_SLURM_PORT, _TIMEOUT, _CPUS).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

CLUSTER_SH = Path(__file__).resolve().parent / "slurm" / "cluster.sh"
DEFAULT_STATE_DIR = Path(os.environ.get("DPOTRAIN_SLURM_STATE_DIR", "/tmp/dpotrain-slurm"))
# Where the tests submit jobs from, the script by its full path as the README allows: sbatch writes each job's log
# (`dpo-think-<job>.out`) into the folder it was submitted from, which must not be the developer's checkout.
SUBMIT_DIR = DEFAULT_STATE_DIR.with_name(DEFAULT_STATE_DIR.name + "-submitted")

# A job in one of these states will not run again. A requeued job passes through REQUEUED and
# goes back to PENDING, so neither counts. SPECIAL_EXIT is a requeue in held state: it never runs
# again unless released, so a waiter returns on it rather than sleeping until its timeout.
TERMINAL_STATES = frozenset(
    "COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL OUT_OF_MEMORY PREEMPTED BOOT_FAIL DEADLINE REVOKED".split()
    + ["SPECIAL_EXIT"]
)

# Inherited variables that would steer sbatch/srun (a pytest run inside a Slurm job, a user's
# SBATCH_PARTITION, ...) towards another cluster's settings.
_FOREIGN_ENV = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")

# `scontrol show job -o` is one line of `Key=Value` pairs separated by spaces; keys may hold
# `/` and `:` (Socks/Node, AllocNode:Sid), values may be empty (Power=) or hold `=` (TRES=cpu=1,...).
_KEY = re.compile(r"(?:^|\s)([A-Za-z_][\w/:]*)=")


class SlurmCluster:
    """Clients for the test cluster. Every command runs with `env`: os.environ without inherited
    SLURM_*/SBATCH_*/SRUN_*/SALLOC_* variables, plus SLURM_CONF. Jobs inherit it (sbatch's
    default --export=ALL), so `scontrol requeue $SLURM_JOB_ID` works inside a job.
    `started_here`: whether this start launched the daemons (False: they were already running).
    `client_netns`: the network namespace clients must run in (several nodes), or None (one node).
    """

    def __init__(self, state_dir: Path, slurm_conf: str, started_here: bool, client_netns: str | None = None):
        self.state_dir = Path(state_dir)
        self.slurm_conf = slurm_conf
        self.started_here = started_here
        self.client_netns = client_netns

    @property
    def env(self) -> dict[str, str]:
        """A fresh copy per call, so jobs see what tests set in os.environ after the cluster started."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV)}
        env["SLURM_CONF"] = self.slurm_conf
        return env

    def run(
        self,
        args: Sequence[str],
        cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client (`["squeue", "-t", "all"]`) on this cluster, with `env` added to
        `self.env`; raise RuntimeError with its stderr when it fails and `check`."""
        full_env = {**self.env, **(env or {})}
        prefix = ["ip", "netns", "exec", self.client_netns] if self.client_netns else []
        proc = subprocess.run(prefix + list(args), cwd=cwd, env=full_env, text=True, capture_output=True, timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: Sequence[str], cwd: str | os.PathLike, env: dict[str, str] | None = None) -> int:
        """`sbatch --parsable *args` run in `cwd` (relative paths, default -o); return the job id.
        The job gets this environment (sbatch's default --export=ALL), with `env` added."""
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout.strip()
        # --parsable prints "<id>" or "<id>;<cluster>".
        return int(out.splitlines()[-1].split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o <id>` as a dict of strings: JobState, Reason, Restarts, ExitCode,
        StdOut, ... Raises RuntimeError once the job is purged (MinJobAge=600 s after it ends)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        for line in out.splitlines():
            info = _parse_key_values(line)
            if info.get("JobId") == str(job_id):
                return info
        raise RuntimeError(f"scontrol show job {job_id} printed no record for it: {out!r}")

    def state(self, job_id: int) -> str:
        """The job's base state, e.g. PENDING, RUNNING, COMPLETED (`JobState` without flags)."""
        return self.job_info(job_id)["JobState"]

    def wait(self, job_id: int, timeout: float = 120.0, poll: float = 0.5) -> str:
        """Poll until the job reaches a terminal state and return it (e.g. "COMPLETED").

        A requeue (REQUEUED, then PENDING again) is not the end: keep waiting for the rerun.
        Raises TimeoutError with the job's last record (state and Reason) after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info["JobState"] in TERMINAL_STATES:
                return info["JobState"]
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} not finished after {timeout:.0f}s: JobState={info['JobState']} "
                    f"Reason={info.get('Reason')} Restarts={info.get('Restarts')} "
                    f"(scontrol show job -o {job_id}: {info})"
                )
            time.sleep(poll)

    def signal(self, job_id: int, sig: str | int, batch_only: bool = True) -> None:
        """Send `sig` ("USR1", "TERM", 10, ...) to the batch shell (and its children) only, with
        `scancel --batch`; with batch_only=False to the batch shell and every step (`--full`)."""
        scope = "--batch" if batch_only else "--full"
        self.run(["scancel", f"--signal={sig}", scope, str(job_id)])

    def cancel(self, job_id: int) -> None:
        self.run(["scancel", str(job_id)])

    def stop(self) -> None:
        _cluster_sh("stop", self.state_dir)


def states_once_a_second(cluster: SlurmCluster, *jobs: int) -> Callable[[], list[str]]:
    """For a test's poll loop: a callable giving the jobs' base states (`cluster.state`), which asks Slurm at most once
    a second and gives its last answer in between. Such a loop polls a file the job writes every 0.05-0.2 s, and each
    `scontrol show job` is ~8 ms of CPU (the client, slurmctld and munged: 1.56 CPU-s for 200 at load 10), taken from
    the job's own 2 CPUs: asked at every poll, one job start of ~30 s paid for hundreds of them. A job that ends is
    seen within a second."""
    asked, states = -float("inf"), []

    def current() -> list[str]:
        nonlocal asked, states
        if time.monotonic() - asked >= 1.0:
            states = [cluster.state(job) for job in jobs]
            asked = time.monotonic()
        return states

    return current


def _parse_key_values(line: str) -> dict[str, str]:
    parts = _KEY.split(line.strip())  # ["", key1, value1, key2, value2, ...]
    return {k: v.strip() for k, v in zip(parts[1::2], parts[2::2], strict=True)}


def _cluster_sh(command: str, state_dir: Path, nodes: int = 1) -> subprocess.CompletedProcess:
    # The daemons' stdio goes to files under STATE_DIR/log, so capturing output does not hang.
    env = {**os.environ, "DPOTRAIN_SLURM_NODES": str(nodes)}
    return subprocess.run(
        ["bash", str(CLUSTER_SH), command, str(state_dir)], text=True, capture_output=True, timeout=600, env=env
    )


def start_slurm_cluster(state_dir: str | os.PathLike | None = None, nodes: int = 1) -> SlurmCluster:
    """`cluster.sh start` (install if missing, start, wait for the idle nodes); skip on failure."""
    state_dir = Path(state_dir) if state_dir is not None else DEFAULT_STATE_DIR
    proc = _cluster_sh("start", state_dir, nodes)
    if proc.returncode != 0:
        pytest.skip(
            f"no test Slurm cluster (tests/slurm/cluster.sh start exited {proc.returncode}):\n{proc.stderr.strip()}"
        )
    conf = re.search(r"^export SLURM_CONF=(.+)$", proc.stdout, re.M)
    if conf is None:
        raise RuntimeError(f"cluster.sh start printed no `export SLURM_CONF=`: {proc.stdout!r}")
    started_here = "# cluster.sh: started" in proc.stdout
    netns = re.search(r"^export DPOTRAIN_SLURM_CLIENT_NETNS=(.+)$", proc.stdout, re.M)
    client_netns = shlex.split(netns.group(1))[0] if netns else None
    return SlurmCluster(state_dir, shlex.split(conf.group(1))[0], started_here, client_netns)


def slurm_cluster(state_dir: str | os.PathLike | None = None, nodes: int = 1) -> Iterator[SlurmCluster]:
    """Fixture body: `yield from slurm_cluster()` in a session-scoped fixture.

    Yields a running SlurmCluster. Afterwards the cluster is stopped if a pytest session started
    it and no other pytest session (a concurrent run, an xdist worker) is still using it: the last
    one out stops it. A cluster started by hand is never stopped. DPOTRAIN_SLURM_KEEP=1 keeps it.
    """
    state_dir = Path(state_dir) if state_dir is not None else DEFAULT_STATE_DIR
    with _sessions_lock(state_dir) as sessions:
        cluster = start_slurm_cluster(state_dir, nodes)
        if cluster.started_here:
            # Tagged with slurmctld's PID, so a later restart by hand is not taken for ours.
            (sessions / "started-by-pytest").write_text(_ctld_pid(state_dir))
        lease = sessions / str(os.getpid())
        lease.touch()
    try:
        yield cluster
    finally:
        with _sessions_lock(state_dir) as sessions:
            lease.unlink(missing_ok=True)
            others = [p for p in sessions.iterdir() if p.name.isdigit() and _alive(int(p.name))]
            owned = sessions / "started-by-pytest"
            ours = owned.exists() and owned.read_text() == _ctld_pid(state_dir)
            if not others and ours and os.environ.get("DPOTRAIN_SLURM_KEEP") != "1":
                cluster.stop()
                owned.unlink()


@contextlib.contextmanager
def _sessions_lock(state_dir: Path) -> Iterator[Path]:
    # Not cluster.sh's own .lock: cluster.sh takes that one inside this critical section.
    sessions = state_dir / "pytest-sessions"
    try:
        sessions.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        pytest.skip(f"no test Slurm cluster: cannot write to {state_dir}: {e}")
    with open(sessions / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield sessions


def _ctld_pid(state_dir: Path) -> str:
    try:
        return (state_dir / "run" / "slurmctld.pid").read_text().strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
