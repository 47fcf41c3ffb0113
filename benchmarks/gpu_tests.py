"""`pytest -m gpu` with its outcome in a JSON file: each test's outcome, seconds and, for a skip, the reason (a GPU test
skipped on a GPU machine says what is missing there). The JSON is written when pytest ends, whatever its outcome:
benchmarks/gpu_all.sh counts a piece with its JSON as finished.

    python benchmarks/gpu_tests.py --out results/pytest-gpu.json -- -k "not shipped_recipe"
"""

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Outcomes:
    """A pytest plugin: every test's outcome, from its reports."""

    def __init__(self):
        self.tests: dict[str, dict] = {}

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("pytest_args", nargs="*", help="after `--`: more pytest arguments (-k ...)")
    args = parser.parse_args()
    outcomes = Outcomes()
    start = time.perf_counter()
    code = pytest.main(
        ["-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", str(ROOT / "tests"), *args.pytest_args], plugins=[outcomes]
    )
    counts = {}
    for entry in outcomes.tests.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    record = {
        "exit_code": int(code),
        "seconds": round(time.perf_counter() - start, 1),
        "counts": counts,
        "pytest_args": args.pytest_args,
        "tests": outcomes.tests,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"pytest -m gpu: {counts} in {record['seconds']} s -> {args.out}", flush=True)
    sys.exit(int(code) if code not in (pytest.ExitCode.NO_TESTS_COLLECTED,) else 0)


if __name__ == "__main__":
    main()
