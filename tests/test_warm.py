"""The warm server (tests/helpers/warm.py) runs a request as a fresh interpreter would."""

import json
import os
import signal
import subprocess

import pytest

from conftest import PYTHON, ROOT, in_child, python

PROBE = ROOT / "tests" / "helpers" / "hub_constants.py"


# Not read from the environment: a uuid drawn per process, a loop's last name over a set (in hash order), transformers'
# table of checkpoint key renames (built from its code alone, on a process's first model load; the warm server builds it
# for every child), and fsspec's cache of file systems (`_pid`, `_latest`), which empties itself in a process of another
# pid, as a forked child is.
UNRELATED = {
    "transformers.utils.hub.SESSION_ID",
    "transformers.models.auto.tokenization_auto.model_type",
    "transformers.conversion_mapping._checkpoint_conversion_mapping_cache",
}
UNRELATED_ATTRIBUTES = ("._pid", "._latest")


@pytest.mark.slow  # a fresh interpreter per case (~20 CPU-s of imports)
@pytest.mark.skipif(os.environ.get("DPOTRAIN_TESTS_COLD") == "1", reason="no warm server: every launch is fresh")
@pytest.mark.parametrize(
    "offline",
    [{"HF_HUB_OFFLINE": "0"}, {"HF_HUB_OFFLINE": None, "HF_DATASETS_OFFLINE": None}],
    ids=["models-online-data-sets-offline", "both-online"],  # test_hub_push's runs, test_hub_revision's
)
def test_a_warm_child_given_its_own_hub_variables_holds_the_constants_a_fresh_interpreter_reads(tmp_path, offline):
    """The Hub tests' runs differ from the server in what huggingface_hub and datasets read while being imported (their
    own Hub address, HF_HOME, caches, offline switches), in tqdm's defaults (launch.sh's TQDM_ASCII) and in W&B's
    variables: run warm, each module's constants and a bar's defaults are those a fresh interpreter computes from that
    environment, not the server's."""
    env = {
        **os.environ,
        "HF_ENDPOINT": "http://127.0.0.1:9/",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache"),
        "HF_TOKEN": "hf_not_a_token",
        "HF_TOKEN_PATH": str(tmp_path / "no-token"),  # test_main_outcome's run without a token
        "TQDM_ASCII": " 123456789#",  # scripts/launch.sh's, for its dry run and preflight (test_memory's, ...)
        # W&B's, which the server reads at no import (tests/helpers/warm.py: RUNTIME_PREFIXES)
        "WANDB_MODE": "disabled",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_PROJECT": "other",
        "WANDB_SILENT": "true",
    }
    env = {k: v for k, v in {**env, **offline}.items() if v is not None}
    runs = {}
    for interpreter in (python(), PYTHON):
        out = subprocess.run([interpreter, str(PROBE)], env=env, capture_output=True, text=True, check=True).stdout
        runs[interpreter] = json.loads(out.splitlines()[-1])
    warm, fresh = runs[python()], runs[PYTHON]
    assert warm["started_warm"] and not fresh["started_warm"]  # else the comparison proves nothing
    differ = {k: (warm["constants"].get(k), v) for k, v in fresh["constants"].items() if warm["constants"].get(k) != v}
    differ = {k: v for k, v in differ.items() if k not in UNRELATED and not k.endswith(UNRELATED_ATTRIBUTES)}
    assert not differ, "\n".join(f"{k}: warm {w}, fresh {f}" for k, (w, f) in differ.items())
    assert fresh["constants"]["huggingface_hub.constants.ENDPOINT"] == repr("http://127.0.0.1:9")
    assert fresh["constants"]["tqdm.std.tqdm().ascii"] == repr(" 123456789#")


# Slow by the marker rule: the warm server it needs imports the training stack (~10 CPU-s, 15-25 s of wall time on 2
# busy cores), which no other test of the fast tier starts; its 20 clients take ~6 s. The full suite (CI) runs it,
# where its worker's one server also serves the launches.
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DPOTRAIN_TESTS_COLD") == "1", reason="no warm server: every launch is fresh")
def test_a_client_signalled_as_its_child_ends_exits_as_the_child_did(tmp_path):
    """torchrun's agent sends SIGTERM to the ranks still running once one rank has ended. A rank whose run had ended
    (stop signals ignored, exit code 75) but whose client was still winding down died of it in the client's own
    interpreter teardown (Python puts the default handler back there): the agent read -15 for a rank that ended 75
    (a CI failure of test_preemption's two-rank stop before step 1). It ends as its child did."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ending', flush=True)\nos._exit(75)\n"
    )
    codes = []
    for _ in range(20):
        client = subprocess.Popen([python(), str(script)], stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline() == "ending\n"
        while client.poll() is None:  # the agent's SIGTERM, as often as it can land until the client has ended
            try:
                os.kill(client.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
        codes.append(client.wait())
    assert codes == [75] * 20


def test_two_messages_that_reach_the_client_together_are_read_one_at_a_time():
    """The server answers a request with the child's pid, then, once it has reaped the child, with its status. A child
    that ends at once (a rank whose run had ended) lets both arrive before the client reads: one read took both, its
    JSON failed ("Extra data"), and the client died in its teardown (default handlers back) of the next SIGTERM,
    -15 for a child that ended 75 (seen in a busy fast tier, 1 of 20 tries)."""
    import socket
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    import warm

    server, client = socket.socketpair()
    with server, client:
        warm._send(server, {"pid": 1})
        warm._send(server, {"status": 75 << 8})
        assert warm._recv(client) == ({"pid": 1}, [])
        assert warm._recv(client) == ({"status": 75 << 8}, [])
        # A request's file descriptors come with its first bytes, whatever follows them
        read, write = os.pipe()
        warm._send(server, {"argv": ["x.py"]}, (read, write))
        warm._send(server, {"status": 0})
        request, fds = warm._recv(client)
        assert request == {"argv": ["x.py"]} and len(fds) == 2
        assert warm._recv(client) == ({"status": 0}, [])
        for fd in (read, write, *fds):
            os.close(fd)


def test_a_forked_child_computes_on_torch_after_this_process_used_its_threads():
    """`in_child` forks this process, and OpenMP's worker threads are not forked: once this process had computed on
    two threads (torch's default outside the workers, as `pytest tests/test_X.py` runs), the child's first parallel
    region waited for them forever. The child computes on one thread, as a worker's processes do."""
    import math

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(2000, 2000).exp().sum()  # this process's second thread started
        code, out, err = in_child(lambda: print(float(torch.ones(2000, 2000).exp().sum())))
    finally:
        torch.set_num_threads(threads)
    assert code == 0 and float(out) == pytest.approx(2000 * 2000 * math.e), err


@pytest.mark.slow  # ~5 s alone (importing accelerate), 0.1 s where torch is imported already
def test_a_forked_child_starts_without_the_accelerate_state_this_process_made():
    """A run trained in `in_child` builds its own `Accelerator`, as a fresh interpreter does: the state an earlier
    in-process run of this worker left (accelerate's singletons: here bf16 mixed precision) is not the child's, whose
    `Accelerator(cpu=True)` took that bf16 silently before `in_child` reset them (seen failing)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    kept = [dict(c._shared_state) for c in (PartialState, AcceleratorState, GradientState)]
    try:
        # this worker's own state first set aside (put back below): an earlier in-process test of the worker may have
        # made one without bf16 (a dry run), and accelerate refuses to change it
        for cls in (PartialState, AcceleratorState, GradientState):
            cls._shared_state.clear()
        Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=4)

        def child():
            made = Accelerator(cpu=True)
            print(made.mixed_precision, made.gradient_accumulation_steps)

        code, out, err = in_child(child)
    finally:
        for cls, state in zip((PartialState, AcceleratorState, GradientState), kept, strict=True):
            cls._shared_state.clear()
            cls._shared_state.update(state)
    assert (code, out) == (0, "no 1\n"), err[-3000:]
