"""Issue #47, a newcomer's path: from the demo to a cluster dry run, every command as printed, no stumble.

Each case runs the real entry (`train_dpo.main` or `run_cli(train_dpo.main)`, in this process: cheap) on a login node
as a newcomer has it: no W&B login, no Hugging Face token, no GPU.
"""

import pytest

import train_dpo
from conftest import ROOT
from dpotrain import output_folder
from dpotrain.recipe.errors import run_cli

SMOKE = str(ROOT / "configs" / "smoke.yaml")
THINK = str(ROOT / "configs" / "think.yaml")
OLMO3_7B = str(ROOT / "configs" / "models" / "olmo3-7b")


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A fresh clone on a login node, in the project folder: no W&B key or mode, no ~/.netrc, no Hugging Face token or
    cached login, no .env (a developer's own .env, found beside train_dpo.py, is not read)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(train_dpo, "load_dotenv", lambda: None)


def dry_run(capsys, *args) -> str:
    """The summary a dry run prints (exit status 0 checked)."""
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main([*args, "--dry-run"]))
    out, err = capsys.readouterr()
    assert ended.value.code in (None, 0), out + err
    return out


# --- 11: the README's dry runs before credentials ---------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["think", "instruct"])
def test_a_dry_run_without_a_wandb_login_shows_its_plan_and_what_the_run_would_refuse(
    recipe, tmp_path, capsys, no_credentials
):
    out = dry_run(capsys, "--config", str(ROOT / "configs" / f"{recipe}.yaml"), "--model_name_or_path", OLMO3_7B,
                  "--output_dir", str(tmp_path / "run"))  # fmt: skip
    assert "memory/GPU:    ~" in out, out  # the plan, made
    refusals = [line for line in out.splitlines() if line.startswith("warning: the run would refuse: ")]
    assert len(refusals) == 1 and "report_to wandb but no W&B login" in refusals[0], out
    assert "WANDB_MODE=offline" in refusals[0] and "--report_to none" in refusals[0]


def test_a_dry_run_of_a_push_without_a_token_says_the_run_would_refuse_it(tmp_path, capsys, no_credentials):
    out = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--push_to_hub",
                  "--hub_model_id", "me/x")  # fmt: skip
    assert "warning: the run would refuse: push_to_hub is set but no Hugging Face token was found" in out, out


def test_the_run_itself_still_refuses_without_a_wandb_login(tmp_path, capsys, no_credentials):
    with pytest.raises(SystemExit) as ended:
        run_cli(lambda: train_dpo.main(["--config", SMOKE, "--output_dir", str(tmp_path / "run"), "--report_to",
                                        "wandb"]))  # fmt: skip
    assert ended.value.code == 2
    assert "error: report_to wandb but no W&B login" in capsys.readouterr().err


# --- 16: a dry run after the demo -------------------------------------------------------------------------------------


def test_a_dry_run_on_a_finished_runs_folder_shows_its_plan_and_what_the_run_would_do(tmp_path, capsys):
    out = tmp_path / "smoke-dpo"
    out.mkdir()
    (out / "run_complete.json").write_text("{}")  # what the demo leaves: a finished run, its own files recorded
    output_folder.claim(out, ["run_complete.json"])
    text = dry_run(capsys, "--config", SMOKE, "--output_dir", str(out))
    assert f"output:        {out}: refused by the run (below)" in text, text
    assert text.rstrip().splitlines()[-1] == (
        f"warning: the run would refuse: output_dir {str(out)!r} already holds a finished run: pass --output_dir for "
        "a new run, or --overwrite_output_dir to replace it"
    )
    text = dry_run(capsys, "--config", SMOKE, "--output_dir", str(out), "--overwrite_output_dir")
    assert f"output:        {out}: replaced by the run (--overwrite_output_dir" in text and "warning:" not in text
    text = dry_run(capsys, "--config", SMOKE, "--output_dir", str(tmp_path / "new"))
    assert f"output:        {tmp_path / 'new'}: the run starts there (new)" in text, text
