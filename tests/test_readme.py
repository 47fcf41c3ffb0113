"""The README's quickstart works as written, and no page of the README or docs/ points outside the repository."""

import re
import shlex
import subprocess

import pytest

from conftest import ROOT, run_train

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages other branches write (data shapes, attention kernels): linked from the README before they land here.
ELSEWHERE = {"docs/data.md", "docs/attention.md"}


def quickstart() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Quickstart") :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_quickstart_shell_lines_parse_and_name_files_that_exist():
    lines = quickstart()
    assert any(line.startswith("sbatch ") for line in lines) and any("--dry-run" in line for line in lines)
    for line in lines:
        assert subprocess.run(["bash", "-n", "-c", line]).returncode == 0, line
        for word in shlex.split(line):
            if re.match(r"^(scripts|configs|data)/", word):
                assert (ROOT / word).exists(), (line, word)


@pytest.mark.slow
def test_quickstart_dry_runs_and_analysis_run():
    for line in quickstart():
        words = shlex.split(line)
        if words[:2] == ["python", "train_dpo.py"]:
            result = run_train(
                [*words[2:], "--output_dir", "/tmp/dpotrain-readme-dry-run"], env={"HF_HUB_OFFLINE": "1"}
            )
            assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
            assert "memory/GPU:    ~" in result.stdout, (line, result.stdout)  # a real plan, not "skipped"
        elif words[:2] == ["python", "scripts/analyze_dataset.py"]:
            python = str(ROOT / ".venv" / "bin" / "python")
            env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
            result = subprocess.run([python, *words[1:]], cwd=ROOT, text=True, capture_output=True, env=env)
            assert result.returncode == 0, (line, result.stderr[-2000:])


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_path_a_page_names_lies_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "FACTS.md" not in text and "seeds/" not in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT), (page.name, target)
        if str(path.relative_to(ROOT)) not in ELSEWHERE:
            assert path.exists(), (page.name, target)
    for name in re.findall(r"`((?:scripts|configs|dpotrain|tests|data|benchmarks|docs)/[\w./-]+?)`", text):
        if "<" not in name and "*" not in name:
            assert (ROOT / name).exists() or name in ELSEWHERE, (page.name, name)
