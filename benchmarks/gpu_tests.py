"""`pytest -m gpu` over the test files that hold GPU tests, with the outcome in a JSON file: each test's outcome,
seconds and, for a skip, the reason (a GPU test skipped on a GPU machine says what is missing there). The JSON is
rewritten as each test ends, so a run cut off keeps the outcomes it has (benchmarks/gpu_lease.sh's `tests` piece).

    python3 benchmarks/gpu_tests.py --out /tmp/lease/tests.json -- -k "not shipped_recipe"
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_test_files() -> list[str]:
    """The test modules with a `gpu` test: collecting the whole of tests/ to select a few would import every
    module, and its fixtures, for nothing."""
    return sorted(str(f) for f in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in f.read_text())


class Outcomes:
    """A pytest plugin: every test's outcome, from its reports, saved to `out` as each test ends."""

    def __init__(self, out: Path, pytest_args: list[str]):
        self.out, self.pytest_args = out, pytest_args
        self.tests: dict[str, dict] = {}
        self.start = time.perf_counter()

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 2)
        if report.skipped:
            entry["outcome"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            entry["reason"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
            entry["message"] = str(report.longrepr).strip().splitlines()[-1][:500] if report.longrepr else ""
        if report.when == "teardown":
            self.save(None)

    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for entry in self.tests.values():
            found[entry["outcome"]] = found.get(entry["outcome"], 0) + 1
        return found

    def save(self, code: int | None) -> dict:
        record = {
            "exit_code": code,  # None: pytest still running (or cut off)
            "seconds": round(time.perf_counter() - self.start, 1),
            "counts": self.counts(),
            "pytest_args": self.pytest_args,
            "tests": self.tests,
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_suffix(".partial")
        partial.write_text(json.dumps(record, indent=2) + "\n")
        partial.replace(self.out)
        return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("pytest_args", nargs="*", help="after `--`: more pytest arguments (-k ...)")
    args = parser.parse_args()
    # Every launch fresh: the suite's warm server (tests/helpers/warm.py) imports the whole stack, DeepSpeed included,
    # once for the many CPU runs of a session; the GPU tests launch a few processes, `python -m` ones, which it does
    # not serve, so it would spend ~20 s of a lease's device time importing for nothing.
    os.environ.setdefault("DPOTRAIN_TESTS_COLD", "1")
    outcomes = Outcomes(args.out, args.pytest_args)
    outcomes.save(None)
    code = pytest.main(
        ["-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", *gpu_test_files(), *args.pytest_args], plugins=[outcomes]
    )
    record = outcomes.save(int(code))
    print(f"pytest -m gpu: {record['counts']} in {record['seconds']} s -> {args.out}", flush=True)
    sys.exit(int(code) if code not in (pytest.ExitCode.NO_TESTS_COLLECTED,) else 0)


if __name__ == "__main__":
    main()
