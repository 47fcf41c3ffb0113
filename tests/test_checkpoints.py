"""Rotation (`save_total_limit`) never deletes the newest complete checkpoint, never counts a folder cut short as a
kept one, and a step written again starts from an empty folder: real training runs of the tiny model, resumed."""

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import types

import datasets
import pytest
import torch
from transformers import TrainerCallback, TrainerState

from conftest import (
    ROOT,
    accelerate_launch,
    built,
    in_read_only,
    launch_env,
    python,
    rank_python,
    ready,
    sealed_checkpoint,
    smoke_command,
)
from dpotrain.data import builtin
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError
from dpotrain.train import run_files
from dpotrain.train.checkpoints import MARKER, CompleteMarker, checkpoints, is_complete, rotate
from dpotrain.train.resume import newest_verified

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def trainer_for(out, model_dir, max_steps):
    recipe = parse_args(
        [
            "--config",
            SMOKE,
            "--model_name_or_path",
            model_dir,
            "--output_dir",
            str(out),
            "--max_steps",
            str(max_steps),
            "--save_steps",
            "2",
            "--save_total_limit",
            "2",
            "--report_to",
            "none",
        ]
    )
    return ready(built(recipe, datasets.Dataset.from_list(builtin.make_preference_rows(64, seed=4))))


class CompleteOnDiskBeforeTheMark(TrainerCallback):
    """What a job killed right after a save, before its COMPLETE mark, would find: the complete checkpoints on disk
    at each save, seen first in `on_save` (before CompleteMarker marks the new one)."""

    def __init__(self, out):
        self.out, self.seen = out, {}

    def on_save(self, args, state, control, **kwargs):
        self.seen[state.global_step] = [p.name for p in checkpoints(self.out) if is_complete(p)]


def cut_short(folder):
    """What a job killed mid-save leaves: some of the files, no mark, the folder named in the run's record (claimed
    before its first file)."""
    run_files.claim(folder.parent, [folder.name])
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 100)


@pytest.mark.slow
def test_rotation_with_a_checkpoint_cut_short_keeps_the_newest_complete_ones_and_a_step_written_again_starts_empty(
    tmp_path, tiny_model_dir, capsys
):
    """Rotation never counts a folder cut short as a kept one; and a save cut short at a step the resumed run saves
    again must not leave its old files (a DeepSpeed shard of another world size, say) in the new checkpoint. One
    resumed run shows both: cut short at step 5 (never saved again) and at step 4 (saved again)."""
    out = tmp_path / "run"
    trainer_for(out, tiny_model_dir, max_steps=2).train()
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2"] and is_complete(out / "checkpoint-2")

    # A later job got to step 5 and was killed while saving there (a stop request's checkpoint): resuming ignores it.
    cut_short(out / "checkpoint-5")
    # One before it was killed while saving at step 4, leaving a shard of another world size: written again below.
    cut_short(out / "checkpoint-4")
    leftover = out / "checkpoint-4" / "global_step4" / "zero_pp_rank_7_mp_rank_00_optim_states.pt"
    leftover.parent.mkdir()
    leftover.write_bytes(b"old")
    # A person copied a checkpoint of their own into the folder: not the run's, so rotation leaves it.
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-1")
    assert newest_verified(out)[0] == out / "checkpoint-2"

    resumed = trainer_for(out, tiny_model_dir, max_steps=6)
    probe = CompleteOnDiskBeforeTheMark(out)
    resumed.callback_handler.callbacks.insert(0, probe)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))

    # A kill between a save and its mark still leaves a checkpoint to resume from (transformers' own rotation had
    # deleted checkpoint-2 at step 4, keeping the stale checkpoint-5 as one of the two).
    assert probe.seen == {4: ["checkpoint-1", "checkpoint-2"], 6: ["checkpoint-1", "checkpoint-2", "checkpoint-4"]}
    # The two newest complete ones are kept; the folder cut short is gone, not counted as one of them; the person's
    # checkpoint stays.
    assert [p.name for p in checkpoints(out)] == ["checkpoint-1", "checkpoint-4", "checkpoint-6"]
    assert all(is_complete(p) for p in checkpoints(out))
    # The run's record lists its own marked complete (one of them gone later was moved or deleted: checkpoints.gone)
    assert run_files.completed(out) == ["checkpoint-4", "checkpoint-6"]
    # Step 4 was written into an empty folder: the old shard gone, the new weights, not the stale bytes
    assert (
        f"Removed {out / 'checkpoint-4'} of an earlier attempt (incomplete (no {MARKER} mark: a save or a deletion cut "
        "short))" in capsys.readouterr().out
    )
    assert not leftover.exists()
    assert (out / "checkpoint-4" / "model.safetensors").stat().st_size > 100


@pytest.mark.parametrize(
    "edit",
    [
        lambda files: files["optimizer.pt"].pop("bytes"),  # an entry without its size
        lambda files: files["optimizer.pt"].update(bytes=str(files["optimizer.pt"]["bytes"])),  # a size in words
        lambda files: files.update({"optimizer.pt": 13}),
    ],
)
def test_a_hand_edited_manifest_is_named_unreadable_and_skipped_not_a_traceback(edit, tmp_path):
    """MANIFEST.json edited by hand into JSON of another shape: a KeyError or TypeError traceback at every rerun,
    before anything loads and in the dry run too. Now it is unreadable, and skipped for the checkpoint before it."""
    from dpotrain.train.checkpoint_manifest import MANIFEST, problem

    sealed_checkpoint(tmp_path / "checkpoint-2")
    edited = sealed_checkpoint(tmp_path / "checkpoint-4") / MANIFEST
    record = json.loads(edited.read_text())
    edit(record["files"])
    edited.write_text(json.dumps(record))
    assert problem(edited.parent) == f"{MANIFEST} is unreadable"
    assert newest_verified(tmp_path) == (tmp_path / "checkpoint-2", [(edited.parent, f"{MANIFEST} is unreadable")])


def test_a_folder_transformers_reads_as_fsdps_put_in_a_checkpoint_after_its_seal_skips_it(tmp_path):
    """A hunt: an empty `pytorch_model_fsdp_0/` made in the newest checkpoint after its seal (the manifest checks
    files alone) made transformers load it as FSDP's: every rerun failed in "ValueError: Checkpoint found at ... is only
    supported when using PyTorch FSDP", never falling back. It is skipped for the one before it, as a stray weights
    file is; the folders an FSDP save writes, their files listed, pass."""
    from accelerate.utils.constants import FSDP_MODEL_NAME

    from dpotrain.train.checkpoint_manifest import FSDP_FOLDER, MANIFEST, problem

    assert FSDP_FOLDER == FSDP_MODEL_NAME
    sealed_checkpoint(tmp_path / "checkpoint-2")
    newest = sealed_checkpoint(tmp_path / "checkpoint-4")
    (newest / "pytorch_model_fsdp_0").mkdir()
    why = f"pytorch_model_fsdp_0/ is not in {MANIFEST} (made after the checkpoint was sealed, or copied in)"
    assert problem(newest) == why
    assert newest_verified(tmp_path) == (tmp_path / "checkpoint-2", [(newest, why)])
    fsdp = tmp_path / "checkpoint-6"  # an FSDP save's own folder, sealed with its shard
    (fsdp / "pytorch_model_fsdp_0").mkdir(parents=True)
    (fsdp / "pytorch_model_fsdp_0" / "__0_0.distcp").write_text("shard\n")
    sealed_checkpoint(fsdp)
    assert problem(fsdp) is None


def test_the_seal_line_counts_files_and_processes_in_the_singular_when_one(tmp_path, capsys):
    """A run on one process printed "checksummed by 1 process(es)"."""
    from dpotrain.train import checkpoint_manifest

    sealed_checkpoint(tmp_path / "checkpoint-2")
    assert "checkpoint-2: 4 files (0.0 MiB) checksummed by 1 process and marked COMPLETE in " in capsys.readouterr().out
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "model.safetensors").write_text("weights\n")
    checkpoint_manifest.seal(tmp_path / "checkpoint-4", MARKER, "{}\n", is_main=True)
    assert "checkpoint-4: 1 file (0.0 MiB) checksummed by 1 process and marked" in capsys.readouterr().out


def test_rotation_counts_a_checkpoint_the_resume_passed_over_as_damaged_not_as_one_kept(tmp_path, capsys):
    """A stop's checkpoint-3 damaged (a file cut short): the rerun resumed from checkpoint-2, and at checkpoint-4
    rotation (save_total_limit 2) kept the damaged 3 as one of its two and deleted the sound 2, the one left to go back
    to. The damaged one now goes, as a folder cut short does; written again at its step, it counts once more."""
    from dpotrain.train.checkpoints import clear_for_save, rotate
    from dpotrain.train.resume import latest_sound_checkpoint

    out = tmp_path / "run"
    for step in (2, 3):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
    (out / "checkpoint-3" / "optimizer.pt").write_text("cut")  # another size than the manifest's
    assert latest_sound_checkpoint(out) == out / "checkpoint-2"
    run_files.claim(out, ["checkpoint-4"])
    sealed_checkpoint(out / "checkpoint-4")
    assert rotate(out, 2, keep=(out / "checkpoint-4",)) == [out / "checkpoint-3"]
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert f"Removed {out / 'checkpoint-3'}: damaged (the resume passed over it)" in capsys.readouterr().out

    clear_for_save(out, 3)  # a later run saves step 3 again: sound once marked, rotated as any other
    run_files.claim(out, ["checkpoint-3"])
    sealed_checkpoint(out / "checkpoint-3")
    assert rotate(out, 2, keep=(out / "checkpoint-3",)) == [out / "checkpoint-2"]


def test_a_file_a_resume_loads_that_the_manifest_does_not_list_is_unverified(tmp_path, capsys):
    """TR-DPO's moved reference (or any weights or state) put into a checkpoint after it was sealed (from another run,
    cut, written after the manifest) was loaded unverified: `check_live_reference` asked only that the file exist, and
    the manifest's sizes and checksums cover what it lists. Now such a checkpoint is skipped for the one before it, as
    any damaged one, and naming it is refused; one sealed with its reference resumes."""
    from dpotrain.train.checkpoint_manifest import MANIFEST, problem
    from dpotrain.train.resume import REFERENCE_FILE, check_explicit, latest_sound_checkpoint

    out = tmp_path / "run"
    for step in (2, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        (out / f"checkpoint-{step}").mkdir(parents=True)
    (out / "checkpoint-2" / REFERENCE_FILE).write_text("the reference as trained\n")
    sealed_checkpoint(out / "checkpoint-2")
    sealed_checkpoint(out / "checkpoint-4")
    (out / "checkpoint-4" / REFERENCE_FILE).write_text("another run's reference\n")
    why = f"{REFERENCE_FILE} is not in {MANIFEST} (written after the checkpoint was sealed, or copied in)"
    assert problem(out / "checkpoint-2") is None
    assert problem(out / "checkpoint-4") == why
    assert latest_sound_checkpoint(out) == out / "checkpoint-2"
    said = capsys.readouterr().out
    assert f"Not resuming from {out / 'checkpoint-4'}: {why}; trying the checkpoint before it" in said
    with pytest.raises(ConfigError, match=re.escape(f"cannot be verified ({why}): pass --resume_from_checkpoint")):
        check_explicit(str(out / "checkpoint-4"), out)
    (out / "checkpoint-4" / REFERENCE_FILE).unlink()
    (out / "checkpoint-4" / "rng_state_1.pth").write_bytes(b"another rank's")  # any state a resume loads
    assert problem(out / "checkpoint-4") == why.replace(REFERENCE_FILE, "rng_state_1.pth")


def test_weights_converted_into_a_folder_of_a_checkpoint_leave_it_verified(tmp_path):
    """`python zero_to_fp32.py . output_dir/` in a checkpoint (DeepSpeed saves the script there for that) writes
    output_dir/model.safetensors, which no resume loads: the checkpoint failed its check as holding weights its manifest
    does not list, and the run went back to the one before it and deleted it as damaged. Unlisted state where an
    engine loads it (the top level, `global_step*/`, FSDP2's folders) still fails it."""
    from dpotrain.train.checkpoint_manifest import MANIFEST, problem

    folder = sealed_checkpoint(tmp_path / "run" / "checkpoint-4")
    (folder / "output_dir").mkdir()
    (folder / "output_dir" / "model.safetensors").write_text("converted\n")
    (folder / "output_dir" / "pytorch_model.bin").write_text("converted\n")
    assert problem(folder) is None
    for rel in ("global_step4/mp_rank_00_model_states.pt", "optimizer_0/__0_0.distcp", "pytorch_model.bin"):
        (folder / rel).parent.mkdir(exist_ok=True)
        (folder / rel).write_text("copied in\n")
        assert problem(folder) == f"{rel} is not in {MANIFEST} (written after the checkpoint was sealed, or copied in)"
        (folder / rel).unlink()


def test_a_checkpoint_that_became_a_link_while_the_run_trained_is_moved_aside_not_cleared_or_rotated(tmp_path, capsys):
    """The run's own checkpoint-3 and checkpoint-4 moved to other storage and linked back while it trained (a quota):
    rotation left the link and dropped it from the record (shutil.rmtree does not follow one), and a save at step 4
    ended in `OSError: Cannot call rmtree on a symbolic link`. A link is none of the run's checkpoints, whatever the
    record says: never rotated or resumed from, moved aside where the run saves, and what it points to untouched."""
    from dpotrain.train.checkpoints import clear_for_save, rotate
    from dpotrain.train.resume import latest_sound_checkpoint

    out, elsewhere = tmp_path / "run", tmp_path / "scratch"
    elsewhere.mkdir()
    for step in (2, 3, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
    for step in (3, 4):
        shutil.move(out / f"checkpoint-{step}", elsewhere / f"checkpoint-{step}")
        (out / f"checkpoint-{step}").symlink_to(elsewhere / f"checkpoint-{step}")
    assert latest_sound_checkpoint(out) == out / "checkpoint-2"  # no link resumed from
    clear_for_save(out, 4)  # raised before
    aside = [p for p in out.iterdir() if p.name.startswith("checkpoint-4.not-this-run-")]
    assert len(aside) == 1 and aside[0].is_symlink() and not (out / "checkpoint-4").exists()
    assert f"Moved {out / 'checkpoint-4'} to {aside[0]}: a link, which no run makes" in capsys.readouterr().out
    sealed_checkpoint(out / "checkpoint-4")
    assert rotate(out, 1, keep=(out / "checkpoint-4",)) == [out / "checkpoint-2"]
    assert (out / "checkpoint-3").is_symlink() and sorted(p.name for p in (elsewhere / "checkpoint-4").iterdir())
    assert "checkpoint-3" in run_files.read(out)  # dropped only when the run itself deletes it


def test_a_step_edited_into_a_sealed_trainer_state_is_named_as_damage_not_as_a_rename(tmp_path):
    """trainer_state.json of the newest checkpoint edited after its seal (global_step 4 -> 5, the same size, so its
    size check passes): the resume passed over it as `renamed from checkpoint-5?: give it back its name`, a fix that
    does not apply. It is now named by its checksum, as any file changed after the seal; a folder really renamed (its
    state the one sealed) is still told to take its name back."""
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.resume import unverified

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        (folder / name).write_text(f"{name}\n")
    (folder / "trainer_state.json").write_text('{"global_step": 4}\n')
    checkpoint_manifest.seal(folder, MARKER, "{}\n", is_main=True)
    assert unverified(folder) is None
    shutil.copytree(folder, tmp_path / "checkpoint-6")
    assert unverified(tmp_path / "checkpoint-6") == (
        "its trainer_state.json was saved at step 4 (renamed from checkpoint-4?): give it back its name"
    )
    (folder / "trainer_state.json").write_text('{"global_step": 5}\n')
    assert unverified(folder) == "trainer_state.json does not match its checksum (damaged after it was written)"


def model_with_unread_sampling(tmp_path, tiny_model_dir):
    """A copy of the tiny model whose generation_config.json holds sampling settings its mode does not read and no
    pad_token_id (as SFT exports write it): (its folder, that file's content, the 16 pairs of 2 steps)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    given = json.loads((model / "generation_config.json").read_text())
    del given["pad_token_id"]  # TRL sets it from the tokenizer's: the config then changed since it loaded
    given |= {"temperature": 0.6, "top_p": 0.9}
    (model / "generation_config.json").write_text(json.dumps(given))
    pairs = tmp_path / "pairs.jsonl"  # the 2 steps' 16 pairs: the reference stage scores every pair it is given
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:16]))
    return model, given, pairs


@pytest.mark.slow
def test_a_generation_config_with_settings_its_mode_does_not_read_checkpoints_resumes_and_is_saved_as_given(
    tmp_path, tiny_model_dir
):
    """Sampling settings with do_sample false ("temperature": 0.6, "top_p": 0.9, as SFT exports write them) change
    nothing a run does, but transformers saves a generation config changed since it loaded only where it passes its
    strict check, and TRL set the pad_token_id this file lacks: the first checkpoint ended in a ValueError after its
    steps, and the run then refused such a model before it loaded. It trains, checkpoints, resumes and saves its final
    model, the file's settings kept and the pad id aligned with the tokenizer's (as transformers and TRL align it).
    Launched as the recipe's engine runs (ZeRO-2, 2 processes): its checkpoints and final model go through the same
    `save_model` as one process's, and this launch failed without its fix as a one-process run did."""
    model, given, pairs = model_with_unread_sampling(tmp_path, tiny_model_dir)
    out = tmp_path / "run"
    args = ["--dataset_name", str(pairs), "--output_dir", str(out), "--max_steps", "2", "--save_steps", "1"]
    args += ["--report_to", "none"]
    launcher = [*accelerate_launch(), "--config_file", str(ROOT / "accelerate_config.yaml")]
    launcher += ["--num_processes", "2", *rank_python()]
    env = launch_env(f"{out}-cache")

    def train() -> str:
        cmd = smoke_command(launcher, str(model), *args)
        result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert result.returncode == 0, result.stdout[-4000:]
        return result.stdout

    def saved(folder) -> dict:
        return json.loads((folder / "generation_config.json").read_text())

    train()
    want = given | {"pad_token_id": 1}  # the tokenizer's <|pad|>
    assert saved(out) == saved(out / "checkpoint-1") == saved(out / "checkpoint-2") == want
    shutil.rmtree(out / "checkpoint-2")
    (out / "run_complete.json").unlink()
    assert f"Resuming from {out}/checkpoint-1" in train()
    assert saved(out) == saved(out / "checkpoint-2") == want


@pytest.mark.slow
def test_a_lora_runs_merged_model_is_saved_with_the_ids_the_run_aligned(tmp_path, tiny_model_dir):
    """merge_lora loads the base afresh and saved its generation_config.json and config.json as the base's files had
    them: without the pad id TRL and the Trainer aligned with the tokenizer (the run's own save holds it), so the merged
    model generated with no pad id. merged/ now holds the trained model's generation config (the file's settings kept,
    as the run saves them) and its pad, BOS and EOS ids."""
    from transformers import AutoModelForCausalLM

    model, given, pairs = model_with_unread_sampling(tmp_path, tiny_model_dir)
    config = json.loads((model / "config.json").read_text())
    del config["pad_token_id"]  # the Trainer aligns it with the tokenizer's
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    lora = ["--use_peft", "true", "--lora_target_modules", "q_proj", "v_proj", "--merge_lora", "true"]
    args = ["--dataset_name", str(pairs), "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no"]
    cmd = smoke_command([python()], str(model), *args, *lora, "--report_to", "none")
    env = launch_env(f"{out}-cache")
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-4000:]
    merged = out / "merged"
    # what the same run without LoRA saves (test_a_generation_config_with_settings_its_mode_does_not_read_...)
    assert json.loads((merged / "generation_config.json").read_text()) == given | {"pad_token_id": 1}
    loaded = AutoModelForCausalLM.from_pretrained(merged)
    ids = ("pad_token_id", "bos_token_id", "eos_token_id")
    assert [getattr(loaded.config, i) for i in ids] == [getattr(loaded.generation_config, i) for i in ids] == [1, 0, 3]
    # Generation pads a row that has stopped with the pad id: here the first row stops at its first token (made its
    # stop) while the second goes on; without a pad id transformers pads with the stop token instead
    prompts, mask = torch.tensor([[1, 1, 5, 6], [0, 7, 8, 9]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        first = loaded.generate(prompts, attention_mask=mask, max_new_tokens=1, do_sample=False)[:, -1].tolist()
        assert first[0] != first[1], first  # else both rows stop at once and nothing is padded
        generated = loaded.generate(
            prompts, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=first[0]
        )
    assert generated[0, 4:].tolist() == [first[0], 1, 1]


def test_a_checkpoint_made_read_only_is_said_and_kept_the_runs_when_rotation_cannot_delete_it(tmp_path):
    """checkpoint-2 made read-only by a person (chmod -w) before a resume with save_total_limit 1: rotation ignored
    the errors, took the mark it could not delete for a person's file (`Kept COMPLETE in ...: not the run's`) and
    dropped the folder, whole and marked, from the run's record. Now one line names it and how to let it go, and it
    stays the run's."""
    out = tmp_path / "run"
    for step in (2, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")

    def rotation():  # in a child of this process, checkpoint-2 read-only for it (root included)
        run_files.disown(out, [p.name for p in rotate(out, 1, keep=(out / "checkpoint-4",))])

    code, stdout, stderr = in_read_only(out / "checkpoint-2", rotation)
    assert code == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"Could not remove {out / 'checkpoint-2'}"], stdout
    assert lines[0].endswith(
        f"which save_total_limit lets go: it stays, still this run's; make it writable (chmod -R u+w "
        f"{out / 'checkpoint-2'}) for a later save to remove it, or remove it yourself"
    )
    assert is_complete(out / "checkpoint-2") and "checkpoint-2" in run_files.read(out)


def test_a_checkpoint_the_run_saves_again_that_it_cannot_remove_is_refused_before_training(tmp_path):
    """checkpoint-4 cut short (a kill mid-save), then made read-only by a person keeping the run's checkpoints (chmod
    -R a-w): the rerun resumed from checkpoint-2, trained steps 3 and 4, then ended in a PermissionError traceback as
    it cleared checkpoint-4 to save it again, and so did every rerun. Now refused at start, naming the folder and the
    chmod; a writable one passes."""
    from dpotrain import output_folder

    out = tmp_path / "run"
    run_files.write(out, [run_files.MANIFEST])
    run_files.claim(out, ["checkpoint-2"])
    sealed_checkpoint(out / "checkpoint-2")
    cut_short(out / "checkpoint-4")

    def check():  # in a child of this process, checkpoint-4 read-only for it (root included)
        try:
            output_folder.check_checkpoints_of_others(str(out), str(out / "checkpoint-2"), 4)
        except ConfigError as e:
            print(e)

    code, stdout, stderr = in_read_only(out / "checkpoint-4", check)
    assert code == 0, stderr[-3000:]
    assert stdout.startswith(
        f"output_dir {str(out)!r} holds checkpoint-4, an earlier attempt's, which this run removes to save that step "
        f"again, and cannot ({out / 'checkpoint-4'}: "
    ), stdout
    assert stdout.rstrip().endswith(
        f"make it writable (chmod -R u+w {out / 'checkpoint-4'}), or move it out of the folder, then rerun"
    )
    output_folder.check_checkpoints_of_others(str(out), str(out / "checkpoint-2"), 4)  # writable: removed as before
    output_folder.check_checkpoints_of_others(str(out), str(out / "checkpoint-2"), 3)  # past max_steps: never saved


def test_a_checkpoint_the_run_saved_that_is_gone_is_said_and_with_none_left_the_rerun_is_refused(tmp_path, capsys):
    """checkpoint-4 moved or deleted between attempts (a scratch cleaner, an `rm` to free space after a push, a move
    to other storage), run_files.json still naming it: the rerun went on from checkpoint-2 without a word of it, and
    with every checkpoint gone said `holds an unfinished run with no checkpoint: training again from step 1`, as if
    the run had never saved one, and trained every step again. Now each is said as a damaged one is, and with none
    left the rerun is refused, as with damaged ones, naming them: put back, or --overwrite_output_dir."""
    from dpotrain.train.resume import latest_sound_checkpoint

    out = tmp_path / "run"
    for step in (2, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
        run_files.completed(out, f"checkpoint-{step}")  # as CompleteMarker records it once the mark is written
    why = "its folder is gone since the run saved it (run_files.json names it: moved or deleted)"
    shutil.rmtree(out / "checkpoint-4")
    capsys.readouterr()
    assert latest_sound_checkpoint(out) == out / "checkpoint-2"
    said = capsys.readouterr().out
    assert said == f"Not resuming from {out / 'checkpoint-4'}: {why}; trying the checkpoint before it\n", said

    shutil.rmtree(out / "checkpoint-2")
    with pytest.raises(ConfigError) as refused:
        latest_sound_checkpoint(out)
    assert str(refused.value) == (
        f"output_dir {str(out)!r} has no checkpoint left to resume from (checkpoint-4: {why}; checkpoint-2: {why}): "
        "restore each named folder or file from a copy, or pass --overwrite_output_dir to start afresh"
    )
    assert latest_sound_checkpoint(out, refuse=False) is None  # --overwrite_output_dir: afresh


def test_a_checkpoint_claimed_whose_folder_was_never_made_is_not_taken_for_one_gone(tmp_path, capsys):
    """A save killed between the claim of its name (run_files.json, before its first file) and its folder's making
    (transformers makes it once DeepSpeed gathered the weights: seconds) left a name without a folder, which the
    rerun took for a checkpoint saved then moved or deleted, and, the first checkpoint's, refused the requeued job
    until a person passed --overwrite_output_dir. Only a checkpoint listed as marked complete is gone; this one is
    said nowhere, as a cut-short save is, and the run trains from its last sound checkpoint (here: from step 1)."""
    from dpotrain.train.resume import latest_sound_checkpoint

    out = tmp_path / "run"
    run_files.claim(out, ["checkpoint-2"])
    sealed_checkpoint(out / "checkpoint-2")
    run_files.completed(out, "checkpoint-2")
    run_files.claim(out, ["checkpoint-4"])  # killed here: no folder yet
    capsys.readouterr()
    assert latest_sound_checkpoint(out) == out / "checkpoint-2"
    assert capsys.readouterr().out == ""
    shutil.rmtree(out / "checkpoint-2")
    run_files.disown(out, ["checkpoint-2"])  # rotation or a full disk's removal: the run's own deletion
    assert latest_sound_checkpoint(out) is None
    assert capsys.readouterr().out == ""
    assert run_files.completed(out) == []


def test_a_step_written_again_is_not_listed_complete_while_its_folder_is_replaced(tmp_path, capsys):
    """A complete checkpoint-4 removed to write step 4 again (a resume from checkpoint-2 past a damaged or named
    older one), the job killed before the new folder was made: the rerun said checkpoint-4 was "gone since the run
    saved it (moved or deleted)", and with nothing older refused the requeued job. The removal drops it from the
    complete list first."""
    from dpotrain.train.checkpoints import clear_for_save
    from dpotrain.train.resume import latest_sound_checkpoint

    out = tmp_path / "run"
    run_files.claim(out, ["checkpoint-4"])
    sealed_checkpoint(out / "checkpoint-4")
    run_files.completed(out, "checkpoint-4")
    clear_for_save(out, 4)  # the save of step 4 again begins; killed before its folder is made
    run_files.claim(out, ["checkpoint-4"])
    capsys.readouterr()
    assert latest_sound_checkpoint(out) is None
    assert "gone" not in capsys.readouterr().out
    assert run_files.completed(out) == []


def test_a_persons_file_kept_in_a_step_written_again_is_moved_aside_not_sealed_as_the_runs(tmp_path, capsys):
    """A resume from checkpoint-2 (a named older one, or past a damaged checkpoint-4) writes step 4 again: the old
    checkpoint-4's files were removed but a person's (an evaluation's results), said "Kept ...: not the run's", then
    the new save wrote into that folder and sealed them in its manifest, and rotation deleted them with it, unsaid."""
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.checkpoints import clear_for_save

    out = tmp_path / "run"
    run_files.claim(out, ["checkpoint-4"])
    sealed_checkpoint(out / "checkpoint-4")
    run_files.completed(out, "checkpoint-4")
    (out / "checkpoint-4" / "my_evals.json").write_text('{"gsm8k": 0.5}\n')
    clear_for_save(out, 4)
    run_files.claim(out, ["checkpoint-4"])  # as the save does next
    printed = capsys.readouterr().out
    assert "Kept my_evals.json in" in printed and "Moved " in printed, printed
    assert not (out / "checkpoint-4").exists()
    [aside] = out.glob("checkpoint-4.not-this-run-*")
    assert sorted(p.name for p in aside.iterdir()) == ["my_evals.json"]
    sealed_checkpoint(out / "checkpoint-4")
    assert "my_evals.json" not in checkpoint_manifest.read(out / "checkpoint-4")
    assert run_files.read(out) == ["checkpoint-4"]


def test_a_manifest_entry_that_leads_out_of_the_checkpoint_is_damage_and_nothing_outside_is_deleted(tmp_path, capsys):
    """A checkpoint's MANIFEST.json edited by hand (or copied in from another layout) listing a path out of its folder,
    `../../base/model.safetensors`, with that file's size and hash: rotation or --overwrite_output_dir, deleting the
    checkpoint's listed files one by one (a person's file kept beside them), deleted that file outside the run's
    folder, and the resume took it for one of the checkpoint's own. A manifest lists the folder's own files only:
    any other is a damaged manifest (the checkpoint unverified), and the folder goes whole."""
    from dpotrain.train import checkpoint_manifest
    from dpotrain.train.checkpoints import remove

    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"the user's weights")
    folder = sealed_checkpoint(tmp_path / "run" / "checkpoint-2")
    manifest = json.loads((folder / checkpoint_manifest.MANIFEST).read_text())
    outside = "../../base/model.safetensors"
    sha = hashlib.sha256(b"the user's weights").hexdigest()
    manifest["files"][outside] = {"bytes": len(b"the user's weights"), "sha256": sha}
    (folder / checkpoint_manifest.MANIFEST).write_text(json.dumps(manifest))
    (folder / "eval_results.json").write_text("{}\n")  # a person's, written into it: the listed files go one by one
    assert checkpoint_manifest.read(folder) == {}  # damaged: lists nothing
    assert "MANIFEST.json" in checkpoint_manifest.problem(folder)
    remove(folder)
    assert (base / "model.safetensors").read_bytes() == b"the user's weights"


def settled_run(tmp_path):
    """A run's folder as a kill right after checkpoint-4's mark leaves it: checkpoint-2 and checkpoint-4 complete,
    save_total_limit 1's rotation of checkpoint-2 not done yet."""
    out = tmp_path / "run"
    for step in (2, 4):
        run_files.claim(out, [f"checkpoint-{step}"])
        sealed_checkpoint(out / f"checkpoint-{step}")
    run_files.completed(out, "checkpoint-2")
    # on_train_begin puts the run's own save_steps, logging_steps and eval_steps back into the state
    args = types.SimpleNamespace(
        output_dir=str(out), save_total_limit=1, save_steps=2, logging_steps=2, eval_steps=None
    )
    return out, args


def test_a_resume_from_another_folders_checkpoint_of_the_same_step_settles_nothing_in_the_run(tmp_path):
    """--resume_from_checkpoint /elsewhere/checkpoint-4 into an output_dir whose own newest is checkpoint-4: matched
    by its step, the run's own checkpoint-4 was listed complete and checkpoint-2 rotated away, though nothing was
    resumed from them (seen failing on the old code, keyed on state.global_step: checkpoint-2 removed)."""
    out, args = settled_run(tmp_path)
    elsewhere = sealed_checkpoint(tmp_path / "elsewhere" / "checkpoint-4")
    state = TrainerState(global_step=4, max_steps=4)
    CompleteMarker(str(elsewhere)).on_train_begin(args, state, None)
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert run_files.completed(out) == ["checkpoint-2"]

    CompleteMarker(str(out / "checkpoint-4")).on_train_begin(args, state, None)  # the run's own: settled
    assert [p.name for p in checkpoints(out)] == ["checkpoint-4"]
    assert run_files.completed(out) == ["checkpoint-4"]


def test_a_resume_is_settled_by_the_agreed_resume_point_not_by_the_ranks_own_step(tmp_path):
    """on_train_begin's broadcast was entered where the rank's own state.global_step was > 0, read by transformers
    behind os.path.isfile, which says no for any OSError: a rank whose read failed (step 0) skipped the broadcast its
    main process entered. It is keyed on the resume point every rank agreed on: a rank at step 0 still settles, and
    one with a step but no resume point never does (seen failing on the old code: checkpoint-2 kept at step 0)."""
    out, args = settled_run(tmp_path)
    CompleteMarker(None).on_train_begin(args, TrainerState(global_step=4, max_steps=4), None)
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]

    unread = TrainerState(global_step=0, max_steps=4)  # its trainer_state.json not read
    CompleteMarker(str(out / "checkpoint-4")).on_train_begin(args, unread, None)
    assert [p.name for p in checkpoints(out)] == ["checkpoint-4"]


def test_a_checkpoint_rotation_cannot_remove_for_an_io_error_names_no_chmod(tmp_path, monkeypatch, capsys):
    """Rotation's removal failing other than for a permission (its manifest's read failing EIO, a stale mount) said
    "make it writable (chmod -R u+w ...)", which mends nothing there; the fix is now worded by the error's kind, the
    rest word for word (seen failing on the old code: the chmod fix for EIO)."""
    from dpotrain.train import checkpoint_manifest

    out, _ = settled_run(tmp_path)
    capsys.readouterr()
    real_read = checkpoint_manifest.read

    def read(folder):
        if folder.name == "checkpoint-2":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(folder / checkpoint_manifest.MANIFEST))
        return real_read(folder)

    monkeypatch.setattr(checkpoint_manifest, "read", read)
    assert rotate(out, 1, keep=(out / "checkpoint-4",)) == []
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"Could not remove {out / 'checkpoint-2'} (OSError: [Errno 5]"), line
    assert "chmod" not in line
    assert line.endswith(
        "which save_total_limit lets go: it stays, still this run's; mend its file system (an I/O error or a stale "
        "mount, not a permission: ask your admins) for a later save to remove it, or remove it yourself"
    )
    assert (out / "checkpoint-2").is_dir() and "checkpoint-2" in run_files.read(out)


@pytest.mark.parametrize("kind", [errno.ENOTEMPTY, errno.EBUSY])
def test_a_checkpoint_rotation_cannot_remove_for_a_file_held_open_names_nothing_to_mend(
    tmp_path, monkeypatch, capsys, kind
):
    """A folder not empty or busy (NFS's .nfsXXXX of a file still held open: an evaluation reading the checkpoint) was
    told to "mend its file system ... ask your admins", where nothing is broken and a later save removes it (seen
    failing on the old code: the mend fix for ENOTEMPTY and EBUSY)."""
    out, _ = settled_run(tmp_path)
    capsys.readouterr()
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.basename(path) == "checkpoint-2":
            raise OSError(kind, os.strerror(kind), str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert rotate(out, 1, keep=(out / "checkpoint-4",)) == []
    line = capsys.readouterr().out.strip()
    assert line == (
        f"Could not remove {out / 'checkpoint-2'} (OSError: [Errno {kind}] {os.strerror(kind)}: "
        f"'{out / 'checkpoint-2'}'), which save_total_limit lets go: it stays, still this run's; a file in it may be "
        "held open by another process; a later save removes it, or remove it yourself"
    ), line
    assert (out / "checkpoint-2").is_dir() and "checkpoint-2" in run_files.read(out)


def test_checkpoints_whose_complete_marks_were_removed_are_damaged_never_cut_short(tmp_path):
    """A hunt: every checkpoint's COMPLETE mark removed (by hand, or left out of a restore), their files whole and the
    run's record listing them as marked complete: the rerun took them for saves cut short, said "nothing to resume
    from: starting afresh" and deleted them. A mark the run wrote and that is gone since is damage: the rerun refuses,
    naming each checkpoint and why, as it refuses when every checkpoint fails its checks. Saves cut short, which the
    record never listed as complete, still start afresh."""
    from dpotrain.train import resume

    out = tmp_path / "run"
    names = ["checkpoint-2", "checkpoint-3", "resolved_config.json"]
    for name in names[:2]:
        (out / name).mkdir(parents=True)
        (out / name / "trainer_state.json").write_text("{}")
    (out / "resolved_config.json").write_text("{}")
    run_files.write(out, names, complete=names[:2])
    assert not resume.only_cut_short(out, [])
    with pytest.raises(ConfigError) as refused:
        resume.latest_sound_checkpoint(out)
    gone = f"its {MARKER} mark is gone since the run wrote it ({run_files.MANIFEST} lists it as complete)"
    said = str(refused.value)  # each with what else is missing (these made-up folders hold no manifest)
    assert said.startswith(f"output_dir {str(out)!r} has no checkpoint left to resume from (checkpoint-3: {gone}; ")
    assert f"; checkpoint-2: {gone}; " in said, said
    assert said.endswith("restore each named file from a copy, or pass --overwrite_output_dir to start afresh")
    run_files.write(out, names, complete=[])  # as saves killed before their marks leave the record
    assert resume.only_cut_short(out, []) and resume.latest_sound_checkpoint(out) is None


@pytest.mark.slow
def test_a_health_stop_on_a_nan_state_under_save_strategy_epoch_saves_no_checkpoint(tmp_path, tiny_model_dir):
    """The nonfinite guard stops without a checkpoint, then the Trainer ended the epoch, whose save (save_strategy
    epoch) wrote the NaN state as a complete checkpoint (rotation deleting a sound one for it), while the run's last
    line said "no checkpoint written from the non-finite state". A learning rate of 1e30 makes step 2 NaN."""
    out, data = tmp_path / "run", tmp_path / "pairs40.jsonl"
    data.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:40]))
    args = ["--dataset_name", str(data), "--output_dir", str(out), "--num_train_epochs", "1", "--save_strategy"]
    args += ["epoch", "--learning_rate", "1e30", "--warmup_steps", "0", "--logging_steps", "1", "--report_to", "none"]
    result = subprocess.run(
        smoke_command([python()], tiny_model_dir, *args), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no checkpoint written from the non-finite state" in result.stdout + result.stderr
    assert not list(out.glob("checkpoint-*"))


@pytest.mark.slow
def test_a_resume_saves_and_logs_at_the_steps_it_is_given_not_its_checkpoints(tmp_path, tiny_model_dir):
    """save_steps, logging_steps and eval_steps may change between attempts, and the record holds the new values, but
    transformers takes them from the resumed checkpoint's trainer_state.json (with a warning alone): a resume with
    --save_steps 1 of a run that saved every 4 saved only at its end, and logged every 2 steps, not every one. Here 4
    steps saved and logged every 2, resumed from step 2 with both at 1: step 3 is saved and logged, which only the
    resume's own values do (the last step is saved and logged whatever they say)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines(keepends=True)[:32]))
    env = launch_env(tmp_path / "cache")

    def run(out, *more) -> str:
        args = ["--dataset_name", str(pairs), "--output_dir", str(out), "--max_steps", "4", "--report_to", "none"]
        cmd = smoke_command([python()], tiny_model_dir, *args, *more)
        result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert result.returncode == 0, result.stdout[-3000:]
        return result.stdout

    run(tmp_path / "first", "--save_steps", "2", "--logging_steps", "2")
    named = tmp_path / "first" / "checkpoint-2"
    out = tmp_path / "second"
    said = run(out, "--save_steps", "1", "--logging_steps", "1", "--resume_from_checkpoint", str(named))
    assert f"Resuming from {named}" in said
    assert [p.name for p in checkpoints(out)] == ["checkpoint-3", "checkpoint-4"], said[-3000:]
    assert "checkpoint-3 written" in said and "checkpoint-4 written" in said
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-2:] == [3, 4], logged
