"""The pieces of one GPU lease call against one deadline: benchmarks/gpu_lease.sh installs what was carried, then runs
this. It checks the machine (versions, real imports, the upstream seams, which kernels import), writes the model the
pieces share once per machine, and runs each named piece in its own process group with its share of the time left:

    limit = min(time left, max(its share, time left - the shares of the pieces after it))

so a piece that finishes early leaves its time to the later ones, and spare time goes to the earlier ones (the model,
which the later pieces need, counts only the least they need after it, not their shares). A piece
whose limit is below the least it needs is skipped with that reason; a piece at its limit is cut off (its process
group killed) and keeps what it finished: every piece rewrites its JSON as each measurement ends, and this rewrites
OUT/results.json whenever a piece's JSON changes. Large files stay in the work folder; OUT gets five small files.

    python3 benchmarks/gpu_lease.py --list        # the pieces, their shares and what each answers
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 2  # how often a running piece's JSON is looked at
LOG_TAIL = 1 << 20  # bytes of each piece's log kept in OUT/logs.txt
MAX_FILE = 16 << 20  # the device tool brings back files of at most 16 MiB
OUT_FILES = ("environment.json", "results.json", "table.md", "lease.log", "logs.txt")


@dataclass(frozen=True)
class Piece:
    """One measurement: its share of a call and the least it needs, in seconds on one H100 at 7B width with 4 layers
    (docs/gpu-benchmarks.md: from the estimates there), its JSON's name in its folder WORK/NAME/ (none: it writes
    none), and its commands (GPU, CPU trial) with {json}, {dir}, {model} and {python} (the pieces' interpreter)
    filled in."""

    share_s: int
    least_s: int
    result: str
    answers: str
    gpu: tuple[str, ...]
    cpu: tuple[str, ...] | None = None
    needs_model: bool = False

    def command(self, cpu: bool) -> tuple[str, ...]:
        return self.cpu if cpu and self.cpu is not None else self.gpu


def e2e(data: str, *more: str) -> dict:
    flags = ("benchmarks/end_to_end.py", "--data", data, "--paths", "trl", "project", "--model", "{model}")
    return {
        "gpu": (*flags, "--steps", "3", *more, "--out", "{dir}"),
        # 2 pairs a step, not --tiny's 4: each step's logits over the 100K vocabulary are most of a CPU trial's time
        "cpu": (*flags, "--steps", "2", "--pairs-per-step", "2", "--tiny", *more, "--out", "{dir}"),
    }


def profiled(data: str) -> dict:
    """The project's path alone, its step 2 under torch.profiler (end_to_end.py --profile-step)."""
    flags = ("benchmarks/end_to_end.py", "--data", data, "--paths", "project", "--model", "{model}", "--steps", "2")
    return {
        "gpu": (*flags, "--profile-step", "2", "--out", "{dir}"),
        "cpu": (*flags, "--profile-step", "2", "--tiny", "--out", "{dir}"),
    }


def attention(data: str) -> dict:
    script = ("benchmarks/attention.py", "--data", data, "--out", "{json}")
    return {
        "gpu": (*script, "--device", "cuda", "--layers", "4", "--budget", "32768"),
        "cpu": (*script, "--device", "cpu", "--tiny", "--micro-batches", "2", "--warmup", "0"),
    }


TESTS = ("benchmarks/gpu_tests.py", "--out", "{json}", "--", "-k")
PIECES = {
    "tests": Piece(
        240,  # lease 1 (H100): 8 tests in 47 s, then the plan's widest micro-batch on flex and sdpa past the 150 s cut
        60,
        "tests.json",
        "the GPU tests (bf16 flex, sdpa and, carried, FA4 rows = each alone)",
        (*TESTS, "not shipped_recipe"),
    ),
    "think-recipe": Piece(
        240,
        150,
        "think-recipe.json",
        "the think recipe's own settings: flex compilations, first step vs steady",
        ("benchmarks/recipe_steps.py", "--out", "{json}", "--model", "{model}", "--steps", "3", "--python", "{python}"),
        (
            "benchmarks/recipe_steps.py",
            "--out",
            "{json}",
            "--model",
            "{model}",
            "--steps",
            "2",
            "--tiny",
            "--python",
            "{python}",
        ),
        needs_model=True,
    ),
    "e2e-think": Piece(
        200,
        120,
        "results.json",
        "think: reference + training vs plain TRL, MFU, memory",
        needs_model=True,
        **e2e("think"),
    ),
    "e2e-multiturn": Piece(150, 90, "results.json", "multi-turn: the same", needs_model=True, **e2e("multiturn")),
    "profile-think": Piece(
        120,
        80,
        "results.json",
        "think: the project's step 2 under torch.profiler: kernels by device time, by kind (a missed MFU's cause)",
        needs_model=True,
        **profiled("think"),
    ),
    "attention-think": Piece(
        120, 60, "attention-think.json", "training-loop MFU per forward, think", **attention("think")
    ),
    "attention-multiturn": Piece(
        100, 60, "attention-multiturn.json", "training-loop MFU per forward, multi-turn", **attention("multiturn")
    ),
    "e2e-zero2": Piece(
        300,
        180,
        "results.json",
        "think under DeepSpeed ZeRO-2 vs plain TRL under it",
        needs_model=True,
        **e2e("think", "--engine", "zero2"),
    ),
    "tests-recipes": Piece(
        240,
        100,
        "tests-recipes.json",
        "each shipped recipe on its engine (needs DeepSpeed)",
        (*TESTS, "shipped_recipe"),
    ),
    "tests-kernels": Piece(
        150,  # lease 1c (H200): the GPU tests 196 s, 136 of them the plan's widest micro-batch
        60,
        "tests-kernels.json",
        "the GPU tests of the kernels alone (flex, sdpa, carried FA4, attention sinks): not the plan's widest "
        "micro-batch (passed in lease 1c), nor the shipped recipes",
        (*TESTS, "not shipped_recipe and not plan_holds_its_largest_micro_batch"),
    ),
    "probe": Piece(
        90,
        45,
        "probe.json",
        "flex compilations per autograd mode over 30 row widths",
        ("benchmarks/gpu_probe.py", "--out", "{json}"),
        ("benchmarks/gpu_probe.py", "--out", "{json}", "--tiny"),
    ),
}
ENVIRONMENT = Piece(
    60,
    10,
    "environment.json",
    "versions, imports, upstream seams, kernels",
    ("benchmarks/gpu_probe.py", "--env", "--out", "{json}"),
)
MODEL = Piece(
    90,  # lease 1 (H100): 62-68 s to write (31 s on this project's 2-core VM)
    40,
    "",
    "the model the pieces share (OLMo 3 7B width, 4 layers; --tiny on a CPU)",
    ("benchmarks/end_to_end.py", "--write-model", "{model}", "--layers", "4"),
    ("benchmarks/end_to_end.py", "--write-model", "{model}", "--tiny"),
)
NAMED = {**PIECES, "model": MODEL}  # what PIECES may name: `model` alone for a call that only prepares


def limit_for(left: float, share: float, later_shares: float) -> float:
    """A piece's time: its share, or more where the pieces after it need less than is left; never past the deadline."""
    return max(0.0, min(left, max(share, left - later_shares)))


@dataclass
class Lease:
    """One call: where things go, the deadline, and each piece's outcome as it comes."""

    out: Path
    work: Path
    deadline: float  # time.time() by which everything has ended
    budget_s: int
    cpu: bool
    outcomes: dict = field(default_factory=dict)  # name -> {status, reason, seconds, limit_s, share_s}
    results: dict = field(default_factory=dict)  # name -> the piece's own JSON

    @property
    def model(self) -> Path:
        return self.work / ("model-tiny" if self.cpu else "model-4-layers")

    def left(self) -> float:
        return self.deadline - time.time()

    def paths(self, name: str, piece: Piece) -> dict:
        """A piece's JSON and folder, WORK/NAME/, and the shared model."""
        return {"json": self.work / name / (piece.result or "none"), "dir": self.work / name, "model": self.model}

    def save(self) -> None:
        """OUT/results.json: every outcome and every piece's JSON so far, replaced whole."""
        record = {"lease": self.header(), "pieces": self.outcomes, "results": self.results}
        write(self.out / "results.json", json.dumps(record, indent=2) + "\n")

    def header(self) -> dict:
        return {"budget_s": self.budget_s, "cpu_trial": self.cpu, "work": str(self.work), "model": str(self.model)}


def write(path: Path, text: str) -> None:
    """A file of OUT replaced whole, cut to the device tool's 16 MiB from its start (what is kept is the newest)."""
    data = text.encode()
    if len(data) > MAX_FILE:
        data = b"[cut to the last 16 MiB]\n" + data[-(MAX_FILE - 64) :]
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_piece(lease: Lease, name: str, piece: Piece, limit: float, python: str) -> dict:
    """The piece's command in its own process group, its output in WORK/NAME.log, killed at `limit` seconds; its JSON
    copied into OUT/results.json whenever it changes."""
    paths = lease.paths(name, piece)
    paths["dir"].mkdir(parents=True, exist_ok=True)
    paths["json"].unlink(missing_ok=True)  # an earlier call's, on this machine: not this call's result
    cmd = [python, *(arg.format(**paths, python=python) for arg in piece.command(lease.cpu))]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "DPOTRAIN_CACHE": str(lease.work / "cache" / name),
    }
    log = lease.work / f"{name}.log"
    start, seen = time.time(), None
    print(f"{name}: {' '.join(cmd)} (limit {limit:.0f}s)", flush=True)
    with log.open("w") as f:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while True:
            try:
                code = process.wait(timeout=POLL_S)
                status = "finished" if code == 0 else f"failed (exit {code})"
                break
            except subprocess.TimeoutExpired:
                code = None
            stamp = paths["json"].stat().st_mtime if paths["json"].exists() else None
            if stamp != seen:
                seen, lease.results[name] = stamp, read_json(paths["json"])
                lease.save()
            if time.time() - start >= limit:
                os.killpg(process.pid, signal.SIGKILL)  # the piece and its children (accelerate's, pytest's)
                process.wait()
                status = f"cut off at its limit of {limit:.0f}s"
                break
    if piece.result:
        lease.results[name] = read_json(paths["json"])
    return {"status": status, "seconds": round(time.time() - start, 1), "limit_s": round(limit), "log": str(log)}


def run_step(lease: Lease, name: str, piece: Piece, later_shares: float, python: str) -> bool:
    """One piece (or the environment, or the model) under the deadline rule; its outcome recorded. True: finished."""
    left = lease.left()
    limit = limit_for(left, piece.share_s, later_shares)
    outcome = {"share_s": piece.share_s, "answers": piece.answers}
    if piece.needs_model and not lease.model.is_dir():
        outcome |= {"status": "skipped", "reason": f"no model: {lease.outcomes['model']['status']}"}
    elif limit < piece.least_s:
        outcome |= {"status": "skipped", "reason": f"needs at least {piece.least_s}s, {max(0, left):.0f}s left"}
    else:
        outcome |= run_piece(lease, name, piece, limit, python)
    lease.outcomes[name] = outcome
    lease.save()
    reason = f": {outcome['reason']}" if "reason" in outcome else ""
    spent = f" in {outcome['seconds']}s" if "seconds" in outcome else ""
    print(f"{name}: {outcome['status']}{reason}{spent}", flush=True)
    return outcome["status"] == "finished"


def run_all(lease: Lease, names: list[str], python: str) -> None:
    """The environment check, the model (once per machine, before the first piece that needs it), the pieces."""
    steps = [("environment", ENVIRONMENT)]
    if "model" not in names and any(PIECES[n].needs_model for n in names):
        steps.append(("model", MODEL))
    steps += [(n, NAMED[n]) for n in names]
    for i, (name, piece) in enumerate(steps):
        if name == "model" and lease.model.is_dir():
            lease.outcomes[name] = {"status": "finished", "reason": f"written earlier on this machine: {lease.model}"}
            continue
        # The model is what the later pieces need (lease 1 lost its think recipe to a model cut at its share): it may
        # take all but the least they need; any other piece, all but their shares.
        later = sum(p.least_s if name == "model" else p.share_s for _, p in steps[i + 1 :])
        run_step(lease, name, piece, later, python)
        if name == "environment":
            ran = "seconds" in lease.outcomes[name]  # skipped: the file there is an earlier call's
            found = (read_json(lease.paths(name, piece)["json"]) if ran else None) or {}
            install = lease.work / "install.txt"
            found["install"] = install.read_text().splitlines() if install.exists() else []
            found["nvidia_smi"] = nvidia_smi()
            write(lease.out / "environment.json", json.dumps(found, indent=2) + "\n")
            lease.results[name] = {k: found.get(k) for k in ("versions", "kernels", "upstream")}


def nvidia_smi() -> str | None:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def e2e_figures(result: dict) -> dict:
    rows = {r["path"]: r for r in result.get("results", []) if "failed" not in r}
    own, trl = rows.get("project", {}), rows.get("trl", {})
    failed = [f"{r['path']}: {r['failed'][:80]}" for r in result.get("results", []) if "failed" in r]
    found = {
        "vs_trl": ratio(trl.get("end_to_end_s"), own.get("end_to_end_s")),
        "vs_trl_less_compile": ratio(trl.get("end_to_end_less_compile_s"), own.get("end_to_end_less_compile_s")),
        "attention": f"{own.get('attention', '-')}/trl:{trl.get('attention', '-')}",
        "mfu": own.get("mfu"),
        "ref_vs_train": ratio(
            own.get("reference_steady_tokens_per_s") or own.get("reference_tokens_per_s_less_compile"),
            own.get("tokens_per_s_per_gpu"),
        ),
        "first_vs_steady": ratio(own.get("first_step_s"), own.get("steady_step_s")),
        "peak_plan_gib": f"{own['peak_gib']}/{own.get('plan_gib')}" if own.get("peak_gib") else None,
        "reserved_gib": own.get("peak_reserved_gib"),
        "profile": profile_figures(own.get("profile")),
    }
    return found | ({"failed": "; ".join(failed)} if failed else {})


def profile_figures(profile: dict | None) -> str | None:
    """A profiled step's time by kernel kind, the largest first: `matmul 41%+attention 30%+...`."""
    if not profile:
        return None
    return "+".join(f"{kind} {share:.0%}" for kind, share in list(profile["by_kind"].items())[:4])


def recipe_figures(result: dict) -> dict:
    last = (result.get("steps") or [{}])[-1]
    return {
        "attention": result.get("attention"),
        "flex_compilations": result.get("flex_compilations"),
        "first_vs_steady": result.get("first_vs_steady"),
        "tokens_per_s": round(last["tokens_per_second"]) if "tokens_per_second" in last else None,
        "mfu": last.get("mfu"),
        "peak_plan_gib": (
            f"{result['peak_allocated_gib']}/{result.get('memory_plan_gib')}"
            if result.get("peak_allocated_gib")
            else None
        ),
        "reserved_gib": result.get("peak_reserved_gib"),
        "exit": result.get("exit_code"),
    }


def env_figures(env: dict) -> dict:
    versions, kernels = env.get("versions") or {}, env.get("kernels") or {}
    broken = [m for m, found in kernels.get("imports", {}).items() if found != "ok"]
    return {
        "torch": versions.get("torch"),
        "transformers": versions.get("transformers"),
        "trl": versions.get("trl"),
        "deepspeed": versions.get("deepspeed"),
        "varlen": kernels.get("varlen"),
        "upstream": {"ok": "ok", None: None}.get(env.get("upstream"), "MOVED (environment.json)"),
        "not_importing": "+".join(broken) or None,
    }


def figures(name: str, result) -> dict:
    """A piece's key figures (those it measured), from its JSON."""
    found = _figures(name, result) if result else {}
    return {k: v for k, v in found.items() if v is not None and v != "-"}


def _figures(name: str, result) -> dict:
    if name == "environment":
        return env_figures(result)
    if name.startswith("tests"):
        failed = [t for t, e in result["tests"].items() if e["outcome"] not in ("passed", "skipped")]
        return {**result["counts"], **({"failed_tests": ", ".join(failed)} if failed else {})}
    if name == "think-recipe":
        return recipe_figures(result)
    if name.startswith("e2e"):
        return e2e_figures(result)
    if name.startswith("profile"):  # its step's time includes the profiler's: no speed figures, no goals
        own = next((r for r in result.get("results", []) if r.get("profile")), {})
        return {"profile": profile_figures(own.get("profile")), "step_ms": (own.get("profile") or {}).get("total_ms")}
    if name.startswith("attention"):
        return {r["path"]: r.get("skipped") or f"mfu {r['mfu']} on {r['attention']}" for r in result[1:]}
    if name == "probe":
        return {"flex_compilations": result.get("flex", {}).get("compilations")}
    return {}


def verdicts(lease: Lease) -> list[str]:
    """The goals each finished measurement answers, PASS or FAIL (never asserted: a benchmark, not a test)."""
    lines = []
    for name, result in lease.results.items():
        if not result:
            continue
        if name == "environment" and result.get("upstream") not in ("ok", None):
            lines.append(f"FAIL environment: upstream names moved: {result.get('upstream')}")
        elif name.startswith("tests"):
            bad = {k: v for k, v in result["counts"].items() if k not in ("passed", "skipped")}
            lines.append(f"{'FAIL' if bad else 'PASS'} {name}: {result['counts']}")
        elif name == "think-recipe":
            flex, first = result.get("flex_compilations"), result.get("first_vs_steady")
            if flex is not None:
                lines.append(f"{'PASS' if flex <= 3 else 'FAIL'} think recipe: {flex} flex compilations (<= 3)")
            if first is not None:
                lines.append(
                    f"{'PASS' if first <= 2 else 'FAIL'} think recipe: first step {first}x a steady one (<= 2x)"
                )
        elif name.startswith("e2e"):
            lines += [f"{line[:4]} {name}: {line[5:]}" for line in result.get("targets", [])]
        elif name.startswith("attention"):
            lines += [
                f"{'PASS' if r['mfu'] >= 0.45 else 'FAIL'} {name} {r['path']}: MFU {r['mfu']:.1%} (>= 45%)"
                for r in result[1:]
                if r.get("mfu") is not None
            ]
    return lines


def table(lease: Lease, device: str) -> str:
    lines = [
        f"# GPU lease call on {device}: budget {lease.budget_s}s",
        "",
        "| piece | status | seconds / limit | figures |",
        "|---|---|---|---|",
    ]
    for name, outcome in lease.outcomes.items():
        status = outcome["status"] + (f": {outcome['reason']}" if "reason" in outcome else "")
        spent = f"{outcome.get('seconds', '-')} / {outcome.get('limit_s', '-')}"
        shown = ", ".join(f"{k} {v}" for k, v in figures(name, lease.results.get(name)).items())
        lines.append(f"| {name} | {status} | {spent} | {shown} |")
    return "\n".join([*lines, "", *[f"- {line}" for line in verdicts(lease)], ""])


def result_line(lease: Lease, device: str, used: float) -> str:
    parts = [f"RESULT device={device.replace(' ', '_')} used={used:.0f}/{lease.budget_s}s"]
    for name, outcome in lease.outcomes.items():
        status = outcome["status"].split(" ")[0].replace(",", "")
        shown = ",".join(f"{k}={v}".replace(" ", "_") for k, v in figures(name, lease.results.get(name)).items())
        parts.append(f"{name}={status}" + (f"({shown})" if shown else ""))
    return " ".join(parts)


def logs(lease: Lease) -> None:
    """OUT/logs.txt: the end of each log of this call (the whole logs stay in the work folder)."""
    text = []
    for name, outcome in lease.outcomes.items():
        if "log" in outcome and Path(outcome["log"]).exists():
            data = Path(outcome["log"]).read_bytes()
            cut = "" if len(data) <= LOG_TAIL else f" (its last {LOG_TAIL >> 20} MiB)"
            text.append(f"===== {name}: {outcome['log']}{cut} =====\n{data[-LOG_TAIL:].decode(errors='replace')}")
    write(lease.out / "logs.txt", "\n".join(text) + "\n")


def listing() -> str:
    rows = [f"{'piece':20} {'share':>6} {'least':>6}  answers"]
    rows += [f"{n:20} {p.share_s:>5}s {p.least_s:>5}s  {p.answers}" for n, p in NAMED.items()]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--start", type=float, default=None, help="when the call began (epoch seconds): the deadline")
    parser.add_argument("--budget", type=int, default=540)
    parser.add_argument("--pieces", default="tests,think-recipe,e2e-think,e2e-multiturn")
    parser.add_argument("--cpu", action="store_true", help="the CPU trial: tiny sizes")
    parser.add_argument("--python", default=sys.executable, help="the pieces' interpreter (gpu_lease.sh's PYTHON)")
    parser.add_argument("--list", action="store_true", help="list the pieces and stop")
    args = parser.parse_args()
    if args.list:
        print(listing())
        return
    names = [n.strip() for n in args.pieces.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMED]
    if unknown or args.out is None or args.work is None:
        sys.exit(
            f"error: unknown piece(s) {', '.join(unknown)}: pick from {', '.join(NAMED)}"
            if unknown
            else "error: --out and --work are required (benchmarks/gpu_lease.sh passes them)"
        )
    start = args.start or time.time()
    lease = Lease(args.out, args.work, start + args.budget, args.budget, args.cpu)
    for name in OUT_FILES[:3] + OUT_FILES[4:]:  # this call's files only (lease.log is the shell's, appended)
        (lease.out / name).unlink(missing_ok=True)
    try:
        run_all(lease, names, args.python)
    finally:
        logs(lease)
        env = read_json(lease.out / "environment.json") or {}
        device = (env.get("versions") or {}).get("gpu") or ("CPU" if args.cpu else "unknown")
        write(lease.out / "table.md", table(lease, device))
        lease.save()
        print(table(lease, device))
        print(result_line(lease, device, time.time() - start), flush=True)


if __name__ == "__main__":
    main()
