"""What a push uploads of a run's records where the file itself would carry the training machine's paths.

The run's record (resolved_config.json) holds `output_dir`, `config`, a local model's, data file's, mixture source's or
chat template's path as the run was given them, often under the user's home (`/home/<name>/...`) or a site's project
folder, and PEFT's adapter_config.json names a local base by its path. The repo is often public, and those paths mean
nothing there: the push uploads a copy in which each absolute path is replaced by its last part, as the model card names
them (hub.shown). The files in the run's folder stay as written: a resume reads the record.

`upload_content` is the one answer for every reader of what goes up: the final push (hub.main_operations), a
checkpoint's branch (hub_push.verified_additions), and push_to_hub.py's comparison with what the Hub holds
(hub_push.remote_matches): one that compared the local file would push the same run again, each time.
"""

import os
import re
from pathlib import Path, PurePosixPath

from dpotrain.recipe import records, run_record

ADAPTER = "adapter_config.json"
# The field of the uploaded record that names what was replaced (a reader of the Hub's copy is told it is one)
MARK = "local_paths_replaced"
WHY = (
    "this is the copy of the run's record uploaded to the Hub: each path of the training machine is replaced by its "
    "last part; the run's folder keeps the record as the run wrote it"
)
# An absolute path (`/...`, `~/...`, `~user/...`) standing alone or inside a text (a mixture's `path:0.5 [train]`, a
# command line's `--output_dir=/...`): it starts a value or follows white space, a quote, a bracket or `=`, and ends at
# one (a URL's `//` follows `:`, a Hub name's `/` a letter: neither is one)
# Two parts at least: `/no_think` or `/help` in a text is a word of it, not a path.
PATH_CHARS = r"""[^\s"'`,;:()\[\]{}<>|/]"""
PATH = re.compile(rf"""(?<![^\s"'`(\[{{=,])(?:~[\w.-]*)?(?:/{PATH_CHARS}+){{2,}}/?""")
# Where a path ends inside a text: `/scratch/run` is not the start of `/scratch/run2/...` (found by PATH on its own)
PATH_END = r"""(?![^\s"'`,;:()\[\]{}<>|])"""
# The person's own words, uploaded as written: a prompt may name a path on purpose
TEXT_FIELDS = ("sample_prompts",)


def upload_content(folder: Path, name: str) -> bytes | None:
    """The bytes a push uploads as `name` of `folder` in place of the file: its copy without the training machine's
    paths (`public_record`, `public_adapter_config`); None where the file goes up as it is (no path in it, or not one of
    the run's JSON records, or unreadable: its readers refuse that)."""
    base = PurePosixPath(name).name
    if base not in (run_record.RESOLVED, ADAPTER):
        return None
    if (values := records.json_object(folder / name)) is None:
        return None
    public = public_record(values) if base == run_record.RESOLVED else public_adapter_config(values)
    if public is None:
        return None
    return (records.dumps(public, indent=2) + "\n").encode()


def public_record(values: dict) -> dict | None:
    """The run's record with each local path replaced by its last part and MARK naming the fields replaced, sealed
    again as the copy it is (run_record.SEAL: one whose seal disagrees reads as edited by hand); None where it holds
    no path."""
    sealed = run_record.SEAL in values
    body = {k: v for k, v in values.items() if k != run_record.SEAL}
    public, replaced = without_paths(body)
    if not replaced:
        return None
    public[MARK] = {"fields": replaced, "why": WHY}
    return run_record.sealed(public) if sealed else public


def public_adapter_config(values: dict) -> dict | None:
    """PEFT's adapter config with a local base (`base_model_name_or_path`) named by its last part, as the card names it;
    a Hub name stays (what `AutoPeftModelForCausalLM.from_pretrained` loads elsewhere). No field is added: PEFT reads
    the file. None where nothing changes."""
    public, replaced = without_paths(values)
    return public if replaced else None


def without_paths(value) -> tuple:
    """`value` (JSON) with every absolute path in its strings replaced by its last part, and the fields changed (dotted,
    list items by index). A whole value that is a path is replaced whole (a folder with a space in its name), and so is
    each occurrence of it elsewhere (a mixture's spec naming it), before any other path is found in a text."""
    whole = sorted({s for s in strings(value) if is_path(s)}, key=len, reverse=True)
    replaced: list[str] = []

    def walk(v, where: str):
        if isinstance(v, dict):
            return {
                key: item if key in TEXT_FIELDS else walk(item, f"{where}.{key}" if where else str(key))
                for key, item in v.items()
            }
        if isinstance(v, list):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(v)]
        if not isinstance(v, str):
            return v
        new = v
        for path in whole:
            new = re.sub(re.escape(path) + PATH_END, lambda _, path=path: last_part(path), new)
        new = PATH.sub(lambda m: last_part(m.group(0)), new)
        if new != v:
            replaced.append(where)
        return new

    return walk(value, ""), replaced


def strings(value):
    """Every string in a JSON value."""
    if isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)
    elif isinstance(value, str):
        yield value


def is_path(text: str) -> bool:
    """A whole value that is an absolute path of this machine (or a user's home), what means nothing on the Hub: of two
    parts at least, and no sentence unless it is there (a folder may have a space in its name; a text that begins with
    a path, a record's `derived.output_folder` sentence, is no path and has its paths found by PATH)."""
    if not (text.startswith("/") or re.match(r"~[\w.-]*/", text)) or "\n" in text:
        return False
    if len([part for part in text.split("/") if part]) < 2:
        return False
    # a sentence's punctuation (`x: an unfinished run, ...`) is no path's; a folder's space ("my data") may be
    return re.search(r"[:;,.!?]\s", text) is None or os.path.exists(os.path.expanduser(text))


def last_part(path: str) -> str:
    """A path's last part (`/home/me/runs/my-sft/` -> `my-sft`); the path itself where it has none."""
    return Path(path.rstrip("/")).name or path
