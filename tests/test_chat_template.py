"""A chat template chosen by the recipe (`chat_template_path`, dpotrain/data/chat_template.py): OLMo 3 Think's
`olmo_thinker` renders as open-instruct's does; every tokenizer of the project takes the recipe's template; a missing
file is refused before anything loads; answers that leave the generation prompt are refused or dropped and counted;
the template is saved with the model and checkpoints, named in the card and the dry run, recorded by content and
checked on resume."""

import json
import runpy
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, adding_specials, built, run_train
from dpotrain import resolve, stages
from dpotrain.data import builtin, chat_template, lengths
from dpotrain.data.rows import InvalidRowError
from dpotrain.hub.hub import RUN_COMPLETE
from dpotrain.recipe.config import parse_args
from dpotrain.recipe.errors import ConfigError

OLMO_THINKER = ROOT / "configs" / "templates" / "olmo_thinker.jinja"
UPSTREAM = runpy.run_path(str(ROOT / "tests" / "data" / "chat_templates" / "open_instruct_olmo_thinker.py"))
SMOKE = ["--config", str(ROOT / "configs" / "smoke.yaml")]
DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are OLMo, a helpful function-calling AI assistant built by Ai2. Your date cutoff is "
    "November 2024, and your model weights are available at https://huggingface.co/allenai. You do not currently have "
    "access to any functions. <functions></functions><|im_end|>\n"
)
GENERATION_PROMPT = "<|im_start|>assistant\n<think>"

USER = {"role": "user", "content": "What is 51 plus 99?"}
THINKING = {"role": "assistant", "content": "<think>\n51 + 99 = 150.\n</think>\n\nThe answer is 150."}
# OLMo 3 Think's conversations: single turn, with a system message (plain, and with `functions`), multi-turn, tools.
CONVERSATIONS = {
    "one turn": [USER, THINKING],
    "system": [{"role": "system", "content": "Be brief."}, USER, THINKING],
    "system with functions": [
        {"role": "system", "content": "Use tools.", "functions": '[{"name": "add"}]'},
        USER,
        {"role": "assistant", "content": "<think>add</think>", "function_calls": "add(51, 99)"},
        {"role": "environment", "content": "150"},
        THINKING,
    ],
    "multi-turn": [
        USER,
        THINKING,
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "<think>\nsmall\n</think>\n4"},
    ],
    "user with functions": [{**USER, "functions": '[{"name": "add"}]'}, THINKING],
}


def tokenizers(model_dir: str):
    """The built-in tiny tokenizer with the shipped template, and with open-instruct's string; EOS set to OLMo's
    `<|endoftext|>`, so that EOS and `<|im_end|>` are told apart."""
    ours = lengths.load_tokenizer(model_dir, chat_template_path=str(OLMO_THINKER))
    theirs = lengths.load_tokenizer(model_dir)
    theirs.chat_template = UPSTREAM["UPSTREAM"]["olmo_thinker"]
    for tokenizer in (ours, theirs):
        tokenizer.eos_token = "<|endoftext|>"
    return ours, theirs


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_olmo_thinker_renders_as_open_instructs(tiny_model_dir, name):
    ours, theirs = tokenizers(tiny_model_dir)
    messages = CONVERSATIONS[name]
    for conversation, generation in ((messages, False), (messages[:-1], True)):
        text = ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        assert text == theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        ids = ours.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"]
        assert ids == theirs.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"]
        # What OLMo 3 Think was trained on, spelled out.
        assert text.startswith(DEFAULT_SYSTEM) == (conversation[0]["role"] != "system")
        if generation:
            assert text.endswith(GENERATION_PROMPT)
        else:  # EOS after the final assistant turn, <|im_end|> and a newline after the earlier ones
            assert text.endswith(messages[-1]["content"] + "<|endoftext|>")
            assert text.count("<|endoftext|>") == 1
            assert text.count("<|im_end|>\n<|im_start|>") == len(messages) - 1 + (conversation[0]["role"] != "system")
    system = messages[0] if messages[0]["role"] == "system" else None
    if system is not None and "functions" not in system:
        text = ours.apply_chat_template(messages, tokenize=False)
        assert text.startswith(
            "<|im_start|>system\nBe brief. You do not currently have access to any functions. "
            "<functions></functions><|im_end|>\n"
        )


def test_the_think_recipe_uses_olmo_thinker_and_32b_the_models_own():
    think = parse_args(["--config", str(ROOT / "configs" / "think.yaml"), "--dry-run"])
    assert think.project.chat_template_path == "configs/templates/olmo_thinker.jinja"
    assert chat_template.template_file(think.project.chat_template_path).resolve() == OLMO_THINKER
    big = parse_args(["--config", str(ROOT / "configs" / "think-32b.yaml"), "--model_name_or_path", "x", "--dry-run"])
    assert big.project.chat_template_path is None  # 32B Think ran on its checkpoint's template (olmo123: unknown)


# --- the option: refused before anything loads, applied by every tokenizer ------------------------------------------


@pytest.mark.slow
def test_a_missing_template_or_a_folder_without_one_is_refused_in_one_line(tmp_path, tiny_model_dir):
    (tmp_path / "folder").mkdir()
    for given, says in ((tmp_path / "nope.jinja", "does not exist"), (tmp_path / "folder", "without chat_template")):
        recipe = parse_args([*SMOKE, "--chat_template_path", str(given)])
        with pytest.raises(ConfigError) as refused:
            stages.checks(recipe)  # the run's and the dry run's first stage, and the preflight's checks
        assert says in str(refused.value) and "\n" not in str(refused.value)
    result = run_train([*SMOKE, "--chat_template_path", str(tmp_path / "nope.jinja"), "--dry-run"])
    assert result.returncode == 2 and result.stdout.strip().splitlines()[-1].startswith("error: chat_template_path")
    # A tokenizer folder saved with its template is taken as it is.
    shutil.copy(OLMO_THINKER, tmp_path / "folder" / "chat_template.jinja")
    tokenizer = lengths.load_tokenizer(tiny_model_dir, chat_template_path=str(tmp_path / "folder"))
    assert tokenizer.chat_template == OLMO_THINKER.read_text()


def test_an_empty_template_file_is_refused_naming_it(tmp_path):
    """An empty .jinja (a file created and not yet written) was set as no template at all: the run then said "the
    tokenizer ... has no chat template ...: give one with --chat_template_path FILE.jinja", the flag it was given."""
    (tmp_path / "empty.jinja").write_text("\n")
    recipe = parse_args([*SMOKE, "--chat_template_path", str(tmp_path / "empty.jinja")])
    with pytest.raises(ConfigError) as refused:
        stages.checks(recipe)
    assert str(refused.value).startswith(f"chat_template_path {str(tmp_path / 'empty.jinja')!r}: ")
    assert "is empty: give a Jinja chat template" in str(refused.value)


def test_a_processors_json_template_file_is_refused_naming_the_jinja_to_write(tmp_path):
    """A multimodal repo's `chat_template.json` (`{"chat_template": "..."}`, which transformers' processors read) was
    read as Jinja text: the JSON's quotes and escapes became part of the template, and the run refused every pair as
    not beginning with a generation prompt of `...<think>\\n\\n\\n"}`, naming the recipe and the data, not the file.
    Refused naming the file's form and the command that writes its template as a .jinja file (which then reads as
    the template itself)."""
    given = tmp_path / "chat_template.json"
    given.write_text(json.dumps({"chat_template": OLMO_THINKER.read_text()}))
    recipe = parse_args([*SMOKE, "--chat_template_path", str(given)])
    with pytest.raises(ConfigError) as refused:
        stages.checks(recipe)
    said = str(refused.value)
    assert said.startswith(f"chat_template_path {str(given)!r} is JSON (a processor's chat_template.json), not a ")
    assert "\n" not in said
    command = said.split(": write its template to a .jinja file and give that: ", 1)[1]
    command = command.replace("FILE.jinja", str(tmp_path / "t.jinja")).replace("python ", f"{sys.executable} ", 1)
    subprocess.run(command, shell=True, check=True, cwd=tmp_path)
    assert (tmp_path / "t.jinja").read_text() == OLMO_THINKER.read_text()


def test_every_tokenizer_of_the_run_has_the_recipes_template(tiny_model_dir):

    recipe = parse_args(
        [
            *SMOKE,
            "--model_name_or_path",
            tiny_model_dir,
            "--chat_template_path",
            str(OLMO_THINKER),
            "--max_steps",
            "1",
            "--report_to",
            "none",
        ]
    )
    text = OLMO_THINKER.read_text()
    assert stages._tokenizer(recipe, tiny_model_dir, local_only=True)[0].chat_template == text  # lengths, dry run
    assert lengths.recipe_tokenizer(recipe).chat_template == text  # max_length: auto, run lengths, preflight's rows
    rows = [
        {"prompt": [USER], "chosen": [THINKING], "rejected": [{"role": "assistant", "content": "<think>x</think>"}]}
    ]
    import datasets

    trainer = built(recipe, datasets.Dataset.from_list(rows * 4)).trainer
    assert trainer.processing_class.chat_template == text  # TRL tokenizes with it, the Trainer saves it
    prompt = trainer.processing_class.decode(trainer.train_dataset[0]["prompt_ids"])
    assert prompt.startswith(DEFAULT_SYSTEM) and prompt.endswith(GENERATION_PROMPT)


def test_the_analyzer_measures_with_the_recipes_template(tmp_path, tiny_model_dir, capsys, cli):
    main = cli.main
    data = think_pairs(tmp_path / "pairs.jsonl", 8)
    report = tmp_path / "with.json"
    assert (
        main(
            [
                str(data),
                "--tokenizer",
                tiny_model_dir,
                "--chat_template_path",
                str(OLMO_THINKER),
                "--json",
                str(report),
                "--num-proc",
                "1",
            ]
        )
        == 0
    )
    # The report's header named the model's template, which was not used (its "Rows read as" named the file).
    header = capsys.readouterr().out
    assert f"with the chat template `{OLMO_THINKER}` and the tokenizer of `{tiny_model_dir}`." in header, header
    assert (
        main([str(data), "--tokenizer", tiny_model_dir, "--json", str(tmp_path / "own.json"), "--num-proc", "1"]) == 0
    )
    assert f"with the chat template of `{tiny_model_dir}`." in capsys.readouterr().out
    with_template, own = (json.loads(p.read_text()) for p in (report, tmp_path / "own.json"))
    system = len(lengths.load_tokenizer(tiny_model_dir)(DEFAULT_SYSTEM)["input_ids"])
    # Longer by the default system prompt, and the <think> the generation prompt holds (tokens of the prompt now).
    assert with_template["prompt"]["p50"] > own["prompt"]["p50"] + system - 1
    assert with_template["shape"].endswith(f"the chat template {OLMO_THINKER}")
    assert with_template["chat_template"] == str(OLMO_THINKER) and own["chat_template"] is None
    assert main([str(data), "--tokenizer", tiny_model_dir, "--chat_template_path", str(tmp_path / "x.jinja")]) == 2
    assert "error: chat_template_path" in capsys.readouterr().err


@pytest.mark.slow  # 5-9 s on 2 cores: past the fast tier's ~2 s per test
def test_the_preflight_scores_with_the_recipes_template(tmp_path, tiny_model_dir):
    from dpotrain import preflight, stages

    data = think_pairs(tmp_path / "pairs.jsonl", 16)  # two steps: the run (and so its preflight) refuses fewer
    prompts = {}
    for extra in ([], ["--chat_template_path", str(OLMO_THINKER)]):
        recipe = parse_args([*SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), *extra])
        found = stages.checks(recipe)
        pairs = stages.load_data(recipe, found, say=False).train  # the preflight's pairs: the run's
        prompts[bool(extra)] = preflight.score(recipe, found, preflight.sample_rows(pairs, 4, 0))["prompt"]
    system = len(lengths.load_tokenizer(tiny_model_dir)(DEFAULT_SYSTEM)["input_ids"])
    # Longer by the default system prompt where a row has no system message of its own, and by <think> (prompt now).
    assert (prompts[True] > prompts[False]).all() and prompts[True][0] >= prompts[False][0] + system


# --- answers that leave the generation prompt ---------------------------------------------------------------------


def think_pairs(path, n: int, plain: tuple[int, ...] = ()):
    """The bundled pairs with a thinking trace opening each answer (a row in `plain` keeps its plain chosen answer)."""
    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:n]]
    for i, row in enumerate(rows):
        for side in ("chosen", "rejected"):
            if not (side == "chosen" and i in plain):
                row[side][-1]["content"] = f"<think>\nLet me see.\n</think>\n\n{row[side][-1]['content']}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def open_instruct_prompt_length(tokenizer, prompt: list[dict]) -> int:
    """Where open-instruct's labels start on the final turn (`sft_tulu_tokenize_and_truncate_v1`): the length of the
    tokenized messages before it, with the generation prompt."""
    return len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"])


def test_trl_and_open_instruct_split_alike_exactly_where_the_answer_follows_the_generation_prompt(tiny_model_dir):
    tokenizer = lengths.load_tokenizer(tiny_model_dir, chat_template_path=str(OLMO_THINKER))
    plain = {"role": "assistant", "content": "The answer is 150."}
    wrong = {"role": "assistant", "content": "<think>\n51 + 99 = 149.\n</think>\n\nThe answer is 149."}
    for answer, alike in ((THINKING, True), (plain, False)):
        example = {"prompt": [USER], "chosen": [answer], "rejected": [wrong]}  # two sides the template tells apart
        trl_prompt = lengths.row_lengths(example, tokenizer)[0]  # TRL's common-prefix split
        assert (trl_prompt == open_instruct_prompt_length(tokenizer, [USER])) == alike
        assert (chat_template.answer_problem(example, tokenizer) is None) == alike


def test_answers_off_the_generation_prompt_are_refused_naming_the_rows_or_dropped_and_counted(tmp_path, tiny_model_dir):
    data = think_pairs(tmp_path / "pairs.jsonl", 12, plain=(3, 7))
    args = [
        *SMOKE,
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--chat_template_path",
        str(OLMO_THINKER),
        "--output_dir",
        str(tmp_path / "run"),
    ]
    recipe = parse_args(args)
    found = stages.checks(recipe)
    with pytest.raises(InvalidRowError) as refused:
        stages.load_data(recipe, found, say=False)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("row 3, column 'chosen': the answer does not begin with the chat ")
    assert "2 of 12 rows do so (rows 3, 7)" in line and "'<think>'" in line and "--skip_invalid true" in line
    assert "line 4 of pairs.jsonl" in line  # where the row is in the user's file
    skipped = parse_args([*args, "--skip_invalid", "true"])
    pairs = stages.load_data(skipped, stages.checks(skipped), say=False)
    assert len(pairs.train) == 10 and pairs.checked["invalid_rows"]["dropped"] == 2
    assert [r["index"] for r in pairs.checked["invalid_rows"]["first"]] == [3, 7]
    # The model's own template (no <think> in its generation prompt) reads the same rows alike: none refused.
    own = parse_args([a for a in args if a not in ("--chat_template_path", str(OLMO_THINKER))])
    assert len(stages.load_data(own, stages.checks(own), say=False).train) == 12


def test_every_row_off_the_think_template_on_either_side_is_one_line_that_names_what_fits(tmp_path, tiny_model_dir):
    """Every row's answer leaves olmo_thinker's generation prompt, on chosen in some rows and on rejected in others:
    the two sides counted as two reasons, and the line said "no usable row ... check that dataset_name and the split
    are the ones meant" (the data was the one meant; the template is not its)."""
    rows = [json.loads(line) for line in think_pairs(tmp_path / "think.jsonl", 12).read_text().splitlines()]
    for i, row in enumerate(rows):  # one side of each pair without its thinking block
        side = row["chosen" if i % 2 else "rejected"][-1]
        side["content"] = side["content"].split("</think>\n\n", 1)[1]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data)]
    recipe = parse_args([*args, "--chat_template_path", str(OLMO_THINKER), "--output_dir", str(tmp_path / "run")])
    with pytest.raises(ConfigError) as refused:
        stages.load_data(recipe, stages.checks(recipe), say=False)
    line = str(refused.value)
    assert line.startswith(
        "every row of the train split (12 of 12) fails one check: chosen or rejected: the answer does not begin with "
        "the chat template's generation prompt ('<think>')"
    ), line
    assert "configs/instruct.yaml" in line and "dataset_name" not in line and "skip_invalid" not in line


NO_SYSTEM = (  # ChatML that takes no system turn, as Gemma's and Mistral's templates raise on one
    "{%- for message in messages -%}{%- if message['role'] == 'system' -%}"
    "{{ raise_exception('System role not supported') }}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_rows_the_template_refuses_are_refused_before_the_model_loads_or_dropped_and_counted(tmp_path, tiny_model_dir):
    """A template that raises on some rows (a system turn it does not take) passed the run's row check and the dry
    run: TRL's tokenization raised jinja's TemplateError in a traceback after the model loaded, and --skip_invalid did
    not drop the rows (the analyzer refused them, or dropped them with --skip-invalid: it measured other pairs than
    the run trained). The run's check renders the row as TRL will and refuses it, as the analyzer does."""
    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:12]]
    for side in ("chosen", "rejected"):  # row 3 has a system turn already
        rows[8][side].insert(0, {"role": "system", "content": "Be brief."})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "no_system.jinja"
    template.write_text(NO_SYSTEM)
    args = [*SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data)]
    args += ["--chat_template_path", str(template), "--output_dir", str(tmp_path / "run")]
    recipe = parse_args(args)
    with pytest.raises(InvalidRowError) as refused:
        stages.load_data(recipe, stages.checks(recipe), say=False)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(
        "row 3, column 'prompt': chat template error: TemplateError: System role not supported (the chat template "
        "takes no system turn: fold the system message into the first user message, or give a chat template that "
        "takes one, chat_template_path) (line 4 of pairs.jsonl"
    ), line  # the fix beside --skip_invalid, which would drop every pair with a system turn
    skipped = parse_args([*args, "--skip_invalid", "true"])
    pairs = stages.load_data(skipped, stages.checks(skipped), say=False)
    assert len(pairs.train) == 10 and [r["index"] for r in pairs.checked["invalid_rows"]["first"]] == [3, 8]
    # The analyzer drops the same rows: it measures the pairs the run trains.
    import datasets

    tokenizer = lengths.load_tokenizer(tiny_model_dir, chat_template_path=str(template))
    measured = lengths.measure(datasets.Dataset.from_list(rows), tokenizer, skip_invalid=True)
    assert [r["index"] for r in measured.invalid] == [3, 8]
    assert [lengths.row_lengths(pair, tokenizer)[0] for pair in pairs.train] == list(measured.prompt)  # TRL's calls


@pytest.mark.parametrize("skip", [[], ["--skip_invalid", "true"]], ids=["refused", "skip_invalid"])
def test_data_without_thinking_under_the_think_template_is_one_line_that_names_the_recipe_that_fits(
    skip, tmp_path, tiny_model_dir
):
    """Issue 53 item 16: non-thinking answers under think.yaml's olmo_thinker template. The error blamed every row and
    offered --skip_invalid, which then refused every row in a message split by answer text, with "OLMo 3's" printed
    as "OLMo N's". Every row failing one check is said once, with what fits: instruct.yaml, or no
    chat_template_path; --skip_invalid, which would drop everything, is not offered."""
    args = [
        *SMOKE,
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(ROOT / "data" / "smoke_prefs.jsonl"),
        "--chat_template_path",
        str(OLMO_THINKER),
        "--output_dir",
        str(tmp_path / "run"),
        *skip,
    ]
    recipe = parse_args(args)
    with pytest.raises(ConfigError) as refused:
        stages.load_data(recipe, stages.checks(recipe), say=False)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(
        "every row of the train split (384 of 384) fails one check: chosen: the answer does not begin with the chat "
        "template's generation prompt ('<think>')"
    ), line
    assert line.count("does not begin") == 1 and "OLMo 3's" in line and "OLMo N" not in line
    assert "configs/instruct.yaml" in line and "chat_template_path" in line
    assert "line 1 of smoke_prefs.jsonl" in line and "it reads 'Let us work it out step by step: 51 + 99'" in line
    assert "skip_invalid" not in line


# --- the run: saved, named, recorded, checked on resume; the reference key ---------------------------------------


@pytest.mark.slow
def test_a_run_saves_and_names_its_template_and_a_resume_with_another_is_refused(tmp_path, tiny_model_dir):
    template = tmp_path / "olmo_thinker.jinja"
    shutil.copy(OLMO_THINKER, template)
    data = think_pairs(tmp_path / "pairs.jsonl", 16)
    out = tmp_path / "run"
    args = [
        *SMOKE,
        "--model_name_or_path",
        tiny_model_dir,
        "--dataset_name",
        str(data),
        "--chat_template_path",
        str(template),
        "--max_steps",
        "2",
        "--save_steps",
        "1",
        "--output_dir",
        str(out),
    ]
    result = run_train(args)
    assert result.returncode == 0, result.stdout[-3000:]
    text = OLMO_THINKER.read_text()
    for folder in (out, out / "checkpoint-2"):  # the final model and its checkpoints: the template trained with
        assert (folder / "chat_template.jinja").read_text() == text
    resolved = json.loads((out / "resolved_config.json").read_text())
    assert resolved["chat_template_path"] == str(template)
    assert resolved["derived"]["chat_template"] == {"path": str(template), "sha256": chat_template.sha256(text)}
    card = (out / "README.md").read_text()
    assert f"| chat template | `olmo_thinker.jinja` (sha256 `{chat_template.sha256(text)[:12]}`) |" in card
    assert "template:" in result.stdout and str(template) in result.stdout  # the run's summary names it

    # The run unfinished (its completion mark gone, as after a kill past its last checkpoint): resuming with the
    # template file edited is refused before anything loads; the same content elsewhere resumes.
    (out / RUN_COMPLETE).unlink()
    template.write_text(text.replace("You are OLMo", "You are Olmo"))
    result = run_train(args)
    assert result.returncode == 2, result.stdout[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"error: output_dir {str(out)!r} holds an unfinished run with other settings (chat "
        f"template: {template} (SHA-256 "
    )
    moved = tmp_path / "elsewhere.jinja"
    moved.write_text(text)
    assert (
        resolve.changed_settings(parse_args([*args[:-1], str(out), "--chat_template_path", str(moved)]), out, 8) == []
    )
    assert (
        "the model's own"
        in resolve.changed_settings(
            parse_args([a for a in args if a not in ("--chat_template_path", str(template))]), out, 8
        )[0]
    )


def test_the_reference_cache_key_follows_the_template(tiny_model_dir, tmp_path):
    import datasets

    from dpotrain.reference import reference
    from dpotrain.reference.scorer import ReferenceScorer

    rows = [
        {"prompt": [USER], "chosen": [THINKING], "rejected": [{"role": "assistant", "content": "<think>x</think>"}]}
    ]
    keys = []
    for template in (str(OLMO_THINKER), None):
        extra = ["--chat_template_path", template] if template else []
        recipe = parse_args(
            [
                *SMOKE,
                "--model_name_or_path",
                tiny_model_dir,
                "--max_steps",
                "1",
                "--report_to",
                "none",
                "--output_dir",
                str(tmp_path / "run"),
                *extra,
            ]
        )
        trainer = built(recipe, datasets.Dataset.from_list(rows * 4)).trainer
        keys.append(reference.identity(ReferenceScorer(trainer), trainer.train_dataset))
    assert keys[0]["tokens_sha256"] != keys[1]["tokens_sha256"]  # so the cache folder differs (Store.for_identity)
    assert reference.Store.for_identity(keys[0]).folder != reference.Store.for_identity(keys[1]).folder


@pytest.mark.slow
def test_the_think_dry_run_shows_the_template():
    result = run_train(
        [
            "--config",
            "configs/think.yaml",
            "--model_name_or_path",
            "configs/models/olmo3-7b",
            "--dry-run",
            "--report_to",
            "none",
        ]
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "  template:      configs/templates/olmo_thinker.jinja (sha256 " in result.stdout, result.stdout[-3000:]


def test_the_console_names_the_recipes_template_where_it_tokenizes_with_it(capsys):
    """`Data (train): ...; the model's chat template` was printed with chat_template_path set too (the records named the
    right one)."""
    import datasets

    from dpotrain.data import builtin, rows

    dataset = datasets.Dataset.from_list(builtin.make_preference_rows(4, seed=1))
    rows.usable_pairs(dataset, rows.RowRules(template_file="templates/mine.jinja"), {}, "invalid_rows")
    assert capsys.readouterr().out.splitlines()[0].endswith("; the chat template templates/mine.jinja")
    rows.usable_pairs(dataset, rows.RowRules(), {}, "invalid_rows")
    assert capsys.readouterr().out.splitlines()[0].endswith("; the model's chat template")


def test_answers_that_write_the_eos_token_the_template_writes_after_them_are_refused(tmp_path, tiny_model_dir):
    """Message contents are rendered into the template's text, and a special token written in them is tokenized as
    the token: answers exported with their EOS ('...<|im_end|>', an SFT pipeline's) under a template that ends the
    turn with EOS trained every answer as '...<|im_end|><|im_end|>', and the run and the analyzer said nothing."""
    import datasets

    rows = [json.loads(line) for line in (ROOT / "data" / "smoke_prefs.jsonl").read_text().splitlines()[:12]]
    rows[5]["chosen"][-1]["content"] += "<|im_end|>"
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = parse_args([*SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data)])
    with pytest.raises(InvalidRowError) as refused:
        stages.load_data(recipe, stages.checks(recipe), say=False)
    assert str(refused.value).startswith(
        "row 5, column 'chosen': the answer ends with the EOS token written as text ('<|im_end|>'), and the chat "
        "template writes it after the answer as well, so it would train two: remove it from the end of the answers "
        "(line 6 of pairs.jsonl"
    ), str(refused.value)
    tokenizer = lengths.load_tokenizer(tiny_model_dir)
    measured = lengths.measure(datasets.Dataset.from_list(rows), tokenizer, skip_invalid=True)
    assert [r["index"] for r in measured.invalid] == [5]


def test_the_builtin_tokenizer_is_trained_once_and_each_caller_gets_its_own():
    """The BPE is trained once per process (its tokenizer.json text kept), but a tokenizer whose template a recipe's
    chat_template_path replaces must not change the next caller's: a check and the model's build each get a new one."""
    from dpotrain.data import builtin

    first, second = builtin.build_tokenizer(), builtin.build_tokenizer()
    first.chat_template = "{{ messages[0]['content'] }}"
    assert (
        second.chat_template == builtin.CHAT_TEMPLATE
        and builtin.build_tokenizer().chat_template == second.chat_template
    )
    assert first.get_vocab() == second.get_vocab() and first is not second


# (the tokenizer adds BOS itself, the template writes {{ bos_token }}): the BOS tokens each sequence starts with
BOS_CASES = {
    "template writes it, tokenizer adds it (Llama 3)": (True, True, 1),
    "template does not, tokenizer adds it (ChatML on a Llama base)": (True, False, 0),
    "neither (OLMo 3)": (False, False, 0),
    "template writes it, tokenizer does not": (False, True, 1),
}


@pytest.mark.parametrize(("adds", "writes", "starts"), BOS_CASES.values(), ids=BOS_CASES)
def test_a_message_lists_bos_is_the_templates_alone_in_the_trainers_rows_and_the_analyzers_lengths(
    adds, writes, starts, tmp_path, tiny_model_dir
):
    """TRL tokenizes message lists with `apply_chat_template(tokenize=True)`, which encodes the rendered text with
    add_special_tokens=False: a sequence starts with BOS exactly where the template writes it. A tokenizer that adds BOS
    itself (Llama's post-processor) adds none here: no doubled BOS under a template that writes it, and none at all
    under one that does not (docs/data.md "Chat template" says so). Each case's token ids are pinned in the trainer's
    rows, and the analyzer's lengths (both methods) against them, so an upgrade that tokenizes otherwise is caught."""
    import datasets

    model = adding_specials(tiny_model_dir, tmp_path, "<|endoftext|> $A") if adds else tiny_model_dir
    template = tmp_path / "template.jinja"
    template.write_text(("{{ bos_token }}" if writes else "") + builtin.CHAT_TEMPLATE)
    tokenizer = lengths.load_tokenizer(str(model), chat_template_path=str(template))
    bos = tokenizer.bos_token_id
    assert (tokenizer("a")["input_ids"][0] == bos) == adds  # the case's tokenizer
    rows = builtin.make_preference_rows(8, seed=1)  # one has a system turn, one an earlier exchange
    args = ["--model_name_or_path", str(model), "--chat_template_path", str(template), "--max_steps", "1"]
    recipe = parse_args([*SMOKE, *args, "--report_to", "none", "--output_dir", str(tmp_path / "run")])
    trained = built(recipe, datasets.Dataset.from_list(rows)).trainer.train_dataset
    bare = lengths.load_tokenizer(tiny_model_dir)  # the same vocabulary: adds nothing, its template writes no BOS

    def ids(messages, **kwargs):  # the conversation's own tokens, after the BOS the case expects
        text = bare.apply_chat_template(messages, tokenize=False, **kwargs)
        return [bos] * starts + bare(text, add_special_tokens=False)["input_ids"]

    assert len(trained) == len(rows)
    for row, seen in zip(rows, trained, strict=True):
        assert seen["prompt_ids"] == ids(row["chosen"][:-1], add_generation_prompt=True)
        for side in ("chosen", "rejected"):
            assert seen["prompt_ids"] + seen[f"{side}_ids"] == ids(row[side])
            assert (seen["prompt_ids"] + seen[f"{side}_ids"]).count(bos) == starts
    for method in ("batched", "reference"):  # the analyzer's (and the dry run's) count is the trainer's
        m = lengths.measure(datasets.Dataset.from_list(rows), tokenizer, method=method)
        assert m.fast_path_mismatches == 0
        for column in ("prompt", "chosen", "rejected"):
            assert getattr(m, column).tolist() == [len(x) for x in trained[f"{column}_ids"]], (method, column)


# (the tokenizer adds BOS itself, the template writes {{ bos_token }}): whether the summary warns of a missing BOS
NO_BOS_CASES = {
    "tokenizer adds it, template does not (ChatML on a Llama base)": (True, False, 1),
    "both (Llama 3)": (True, True, 0),
    "neither (OLMo 3)": (False, False, 0),
}


def bos_case(tmp_path, tiny_model_dir, adds: bool, writes: bool) -> list[str]:
    """The smoke recipe's arguments on a copy of the tiny model whose tokenizer adds BOS or not, and a template that
    writes it or not."""
    model = adding_specials(tiny_model_dir, tmp_path, "<|endoftext|> $A") if adds else tiny_model_dir
    template = tmp_path / "template.jinja"
    template.write_text(("{{ bos_token }}" if writes else "") + builtin.CHAT_TEMPLATE)
    args = ["--model_name_or_path", str(model), "--chat_template_path", str(template)]
    return [*SMOKE, *args, "--output_dir", str(tmp_path / "run")]


@pytest.mark.parametrize(("adds", "writes", "warned"), NO_BOS_CASES.values(), ids=NO_BOS_CASES)
def test_a_template_without_the_bos_its_tokenizer_adds_to_plain_text_is_said_under_the_dry_runs_template_line(
    adds, writes, warned, tmp_path, capsys, tiny_model_dir
):
    """A ChatML template on a Llama-style base (its tokenizer adds BOS to plain text) trained every sequence without
    BOS and said nothing (TRL encodes the rendered template without the tokenizer's special tokens: the test above).
    Not refused, as inference with the template starts so too; the dry run says it once, under its template line, and
    its --json (decisions only) does not."""
    import train_dpo

    args = bos_case(tmp_path, tiny_model_dir, adds, writes)
    train_dpo.main([*args, "--dry-run"])
    out = capsys.readouterr().out
    assert out.count(lengths.NO_BOS) == warned, out
    assert ("\n  template:" in out) and ("{{ bos_token }}" in out) == bool(warned)
    if warned:  # the line right under the template it is about
        lines = out.splitlines()
        at = next(n for n, line in enumerate(lines) if line.startswith("  template:"))
        assert lines[at + 1] == f"  {'warning:':<15}{lengths.NO_BOS}"
    train_dpo.main([*args, "--dry-run", "--json"])
    assert "bos_token" not in capsys.readouterr().out


def bos_with_a_system_turn_only(tmp_path, tiny_model_dir) -> tuple[list[str], int, int]:
    """The smoke recipe on a tokenizer that adds BOS to plain text, a template that writes BOS only where a pair has a
    system turn, and pairs whose first has one and most do not: (arguments, pairs, pairs without BOS)."""
    args = bos_case(tmp_path, tiny_model_dir, adds=True, writes=False)
    template = tmp_path / "template.jinja"
    template.write_text("{% if messages[0]['role'] == 'system' %}{{ bos_token }}{% endif %}" + builtin.CHAT_TEMPLATE)
    rows = sorted(builtin.make_preference_rows(40, seed=1), key=lambda row: row["chosen"][0]["role"] != "system")
    without = sum(row["chosen"][0]["role"] != "system" for row in rows)
    assert rows[0]["chosen"][0]["role"] == "system" and 0 < without < len(rows)  # the first pair has BOS
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [*args, "--dataset_name", str(pairs)], len(rows), without


def test_a_template_writing_bos_for_some_pairs_only_is_judged_on_every_pair(tmp_path, capsys, tiny_model_dir):
    """The BOS warning was judged on the first readable pair alone: a template that writes BOS only for a pair with a
    system turn, first pair with one, said nothing of the pairs after it that train without BOS. It is judged on every
    pair the dry run tokenizes anyway (no pass of its own), and says how many lack it."""
    import train_dpo

    args, rows, without = bos_with_a_system_turn_only(tmp_path, tiny_model_dir)
    train_dpo.main([*args, "--dry-run"])
    out = capsys.readouterr().out
    warning = lengths.NO_BOS.replace("no BOS token,", f"no BOS token to {without} of {rows} pairs,")
    assert f"\n  {'warning:':<15}{warning}\n" in out, out


def test_the_analyzer_says_the_bos_warning_the_dry_run_says(cli, tmp_path, capsys, tiny_model_dir):
    """The analyzer measured every pair and said nothing of a template that writes no BOS where the tokenizer adds one
    to plain text (the dry run's warning): it says the same line, judged on the same pairs."""
    args, rows, without = bos_with_a_system_turn_only(tmp_path, tiny_model_dir)
    given = dict(zip(args[::2], args[1::2], strict=True))  # the dry run's flags, as the analyzer names them
    flags = ["--tokenizer", given["--model_name_or_path"], "--chat_template_path", given["--chat_template_path"]]
    assert cli.main([given["--dataset_name"], "--config", given["--config"], *flags, "--num-proc", "1"]) == 0
    warning = lengths.NO_BOS.replace("no BOS token,", f"no BOS token to {without} of {rows} pairs,")
    assert [line for line in capsys.readouterr().err.splitlines() if "BOS" in line] == [f"warning: {warning}"]


@pytest.mark.slow  # trains two steps
def test_a_run_says_once_as_it_starts_that_its_template_writes_no_bos(tmp_path, tiny_model_dir):
    """The run's own summary (printed as it starts, by the main process) carries the dry run's warning once."""
    result = run_train([*bos_case(tmp_path, tiny_model_dir, True, False), "--max_steps", "2", "--report_to", "none"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count(lengths.NO_BOS) == 1, result.stdout[-3000:]


# Templates by whether their answers start with the assistant turn's header, which TRL would then train as the answer's
# first tokens: (template, warned).
GENERATION_PROMPT_CASES = {
    # ChatML with its add_generation_prompt branch removed: the header moves from the prompt into every answer
    "ChatML ignoring add_generation_prompt": (builtin.CHAT_TEMPLATE.split("{% if add_generation_prompt %}")[0], True),
    "ChatML (the built-in)": (builtin.CHAT_TEMPLATE, False),
    # Llama 2's: its generation prompt is rightly empty, the answer follows [/INST] after a space
    "Llama 2 style": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
        "{% else %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endif %}{% endfor %}",
        False,
    ),
    # Qwen3's: an empty thinking block before each answer's content, after a header the generation prompt does write
    "Qwen3 style": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
        "{{ '<think>\n\n</think>\n\n' }}{% endif %}{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
        False,
    ),
}


@pytest.mark.parametrize(("template", "warned"), GENERATION_PROMPT_CASES.values(), ids=GENERATION_PROMPT_CASES)
def test_answers_that_start_with_the_turns_header_are_counted_on_every_pair_measured(
    template, warned, tmp_path, tiny_model_dir
):
    """A template that ignores add_generation_prompt renders the prompt the same with it or without: TRL took the
    assistant header as every answer's first tokens (trained, and counted in sigmoid_norm's length) and nothing said
    so. Counted where the pairs are checked against the template anyway, with no false alarm for Llama 2's empty
    generation prompt or Qwen3's empty thinking block."""
    import datasets

    path = tmp_path / "template.jinja"
    path.write_text(template)
    tokenizer = lengths.load_tokenizer(tiny_model_dir, chat_template_path=str(path))
    rows = builtin.make_preference_rows(8, seed=1)  # one has a system turn, one an earlier exchange
    for method in ("batched", "reference"):
        m = lengths.measure(datasets.Dataset.from_list(rows), tokenizer, method=method)
        assert m.unopened.tolist() == [int(warned)] * len(rows), method
    said = lengths.unopened_turn(m, tokenizer)
    assert (said is not None) == warned
    if warned:
        assert said.startswith("the chat template's add_generation_prompt adds nothing, so 8 of 8 pairs start their")
        assert "(chat_template_path)" in said and repr("<|im_start|>assistant\n") in said


def unopened_case(tmp_path) -> tuple[list[str], int]:
    """The smoke recipe with the ChatML template that ignores add_generation_prompt, on pairs of its own: (arguments,
    pairs)."""
    template = tmp_path / "template.jinja"
    template.write_text(GENERATION_PROMPT_CASES["ChatML ignoring add_generation_prompt"][0])
    rows = builtin.make_preference_rows(24, seed=2)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["--chat_template_path", str(template), "--dataset_name", str(pairs)]
    return [*SMOKE, *args, "--output_dir", str(tmp_path / "run")], len(rows)


def test_the_dry_run_says_once_that_answers_start_with_the_turns_header(tmp_path, capsys, tiny_model_dir):
    """The dry run's summary says it once, in a warning row under the template line, with the count and the fix (the
    run still trains, on a few tokens more); its --json (decisions only) does not."""
    import train_dpo

    args, rows = unopened_case(tmp_path)
    train_dpo.main([*args, "--dry-run"])
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("  warning:")]
    assert len(warnings) == 1 and f"so {rows} of {rows} pairs start their answers" in warnings[0], out
    assert "add_generation_prompt opens the assistant turn (chat_template_path)" in warnings[0]
    lines = out.splitlines()
    assert lines[lines.index(warnings[0]) - 1].startswith("  template:")
    train_dpo.main([*args, "--dry-run", "--json"])
    assert "add_generation_prompt" not in capsys.readouterr().out


def test_the_analyzer_says_the_header_warning_the_dry_run_says(cli, tmp_path, capsys, tiny_model_dir):
    """The analyzer renders every pair against the template too: it says the same line."""
    args, rows = unopened_case(tmp_path)
    given = dict(zip(args[::2], args[1::2], strict=True))
    flags = ["--tokenizer", tiny_model_dir, "--chat_template_path", given["--chat_template_path"], "--num-proc", "1"]
    assert cli.main([given["--dataset_name"], "--config", given["--config"], *flags]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "add_generation_prompt" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: {lengths.UNOPENED[:40]}"), said
    assert f"{rows} of {rows} pairs" in said[0]


def test_a_template_folder_is_named_as_the_same_file_by_the_run_and_the_analyzer(tmp_path, tiny_model_dir, capsys, cli):
    """chat_template_path given as a folder: the run's Data line named the folder, the analyzer's report the .jinja
    file in it (and its Analysing line the folder again). One name everywhere: the file read."""
    import datasets

    from dpotrain.data import rows

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(OLMO_THINKER, folder / chat_template.FILE)
    file = f"{folder}/{chat_template.FILE}"
    data, report = think_pairs(tmp_path / "pairs.jsonl", 4), tmp_path / "r.json"
    dataset = datasets.Dataset.from_list([json.loads(line) for line in data.read_text().splitlines()])
    rows.usable_pairs(dataset, rows.RowRules(template_file=str(folder)), {}, "invalid_rows")
    assert capsys.readouterr().out.splitlines()[0].endswith(f"; the chat template {file}")
    argv = [str(data), "--tokenizer", tiny_model_dir, "--chat_template_path", str(folder), "--json", str(report)]
    assert cli.main([*argv, "--num-proc", "1"]) == 0
    out, err = capsys.readouterr()
    assert f" and the chat template {file}" in err.splitlines()[0]
    assert f"with the chat template `{file}` and the tokenizer of" in out
    said = json.loads(report.read_text())
    assert said["chat_template"] == file and said["shape"].endswith(f"the chat template {file}")


def test_the_dry_run_names_a_template_folder_as_its_file(tiny_model_dir, capsys):
    """A template folder (here the built-in model's own tokenizer folder) was the folder on the dry run's `template:`
    line while the analyzer and the run's Data line named its chat_template.jinja: the file read, on every line."""
    import train_dpo

    file = f"{tiny_model_dir}/{chat_template.FILE}"
    args = ["--config", str(ROOT / "configs" / "smoke.yaml"), "--model_name_or_path", tiny_model_dir]
    train_dpo.main([*args, "--report_to", "none", "--chat_template_path", tiny_model_dir, "--dry-run"])
    out = capsys.readouterr().out
    assert f"  template:      {file} (sha256 " in out, out


def test_a_model_with_several_templates_is_recorded_by_their_content(tiny_model_dir, tmp_path, capsys):
    """A tokenizer saved with several templates (additional_chat_templates/, Command R's `tool_use` beside its
    default) holds them as a dict by name: the record took no digest of it, and the dry run said of a tokenizer in the
    model's folder that it was not on this machine. Recorded by their content, as one template is."""
    import hashlib

    from transformers import AutoTokenizer

    import train_dpo

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = {"default": builtin.CHAT_TEMPLATE, "tool_use": "{{ bos_token }}" + builtin.CHAT_TEMPLATE}
    tokenizer.save_pretrained(model)
    assert (model / "additional_chat_templates" / "tool_use.jinja").is_file()
    digest = hashlib.sha256(json.dumps(tokenizer.chat_template, sort_keys=True).encode()).hexdigest()
    args = [*SMOKE, "--model_name_or_path", str(model), "--output_dir", str(tmp_path / "run"), "--dry-run"]
    train_dpo.main(args)
    assert f"  template:      the model's own (sha256 {digest[:12]})\n" in capsys.readouterr().out
    train_dpo.main([*args, "--json"])
    assert json.loads(capsys.readouterr().out)["derived"]["chat_template"]["sha256"] == digest


# Llama 3.2's template's own lines for the date (the rest cut to one header per turn): `strftime_now`, which
# transformers gives every template, unless a row's chat_template_kwargs give `date_string`.
DATED_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: " + date_string + "\\n\\n<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""


# What the run's data stage and the analyzer say of DATED_TEMPLATE (chat_template.dated)
DATED_WARNING = (
    "warning: the chat template writes the day it renders on into the prompts (transformers' strftime_now, as "
    "Llama 3.2's `Today Date:` does), so the same pairs are other tokens on another day, and a job requeued after "
    "midnight scores the whole reference again: give the date in each row's chat_template_kwargs "
    '({"date_string": "26 Jul 2024"})'
)


def test_a_template_that_writes_todays_date_is_said_as_the_pairs_are_read(capsys):
    """Llama 3.2's template writes the day the pairs are tokenized into every prompt: the same pairs are other token
    ids the next day, and a job requeued after midnight scored its whole reference again, with nothing said before.
    Now one warning as the training pairs are read, naming the row's `date_string`; none where the rows give it, none
    under a template that writes no date (OLMo 3's)."""
    import datasets

    from dpotrain.data import rows

    tokenizer = builtin.build_tokenizer()
    olmo = builtin.build_tokenizer()
    tokenizer.chat_template = DATED_TEMPLATE
    pairs = builtin.make_preference_rows(4, seed=1)
    rows.usable_pairs(datasets.Dataset.from_list(pairs), rows.RowRules(template=tokenizer), {}, "invalid_rows")
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warned == [DATED_WARNING], warned
    given = [p | {"chat_template_kwargs": {"date_string": "26 Jul 2024"}} for p in pairs]
    for template, read in ((tokenizer, given), (olmo, pairs)):
        rows.usable_pairs(datasets.Dataset.from_list(read), rows.RowRules(template=template), {}, "invalid_rows")
        assert "warning:" not in capsys.readouterr().err


@pytest.mark.parametrize("streaming", [False, True], ids=["read", "streamed"])
def test_the_analyzer_says_once_that_its_template_writes_todays_date(cli, tmp_path, capsys, tiny_model_dir, streaming):
    """The analyzer measures with the run's template, and its cache is keyed on the template: one that writes the day
    it renders on measures that day's tokens, and the run's data stage warned of it where the analyzer said nothing.
    It now says the run's line, once (its first row invalid and skipped: judged on the first pair that reads)."""
    template = tmp_path / "dated.jinja"
    template.write_text(DATED_TEMPLATE)
    pairs = builtin.make_preference_rows(4, seed=1)
    data = tmp_path / "pairs.jsonl"
    bad = {**pairs[0], "rejected": pairs[0]["chosen"]}  # identical answers: no preference, dropped
    data.write_text("".join(json.dumps(p) + "\n" for p in [bad, *pairs]))
    flags = ["--tokenizer", tiny_model_dir, "--chat_template_path", str(template), "--skip-invalid", "--num-proc", "1"]
    flags += ["--max-length", "64", *(["--streaming"] if streaming else [])]
    assert cli.main([str(data), *flags]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "renders on" in line]
    assert warned == [DATED_WARNING], warned
    given = [p | {"chat_template_kwargs": {"date_string": "26 Jul 2024"}} for p in pairs]
    data.write_text("".join(json.dumps(p) + "\n" for p in given))
    assert cli.main([str(data), *flags]) == 0
    assert "renders on" not in capsys.readouterr().err


def test_a_mixture_says_once_that_its_template_writes_todays_date(tmp_path, capsys):
    """The warning was said by each mixture source's read: a mixture of three sources with one template printed the
    same line three times. One line a run; where some sources give the date in their rows, the others are named."""
    import datasets

    from dpotrain.data import mixture, rows
    from dpotrain.recipe.config import parse_args

    tokenizer = builtin.build_tokenizer()
    tokenizer.chat_template = DATED_TEMPLATE
    pairs = builtin.make_preference_rows(4, seed=1)
    given = [p | {"chat_template_kwargs": {"date_string": "26 Jul 2024"}} for p in pairs]
    for name, read in (("a", pairs), ("b", pairs), ("c", given)):
        datasets.Dataset.from_list(read).to_json(tmp_path / f"{name}.jsonl")

    def said(*names) -> list[str]:
        mixer = [part for name in names for part in (str(tmp_path / f"{name}.jsonl"), "1.0")]
        recipe = parse_args([*SMOKE, "--dataset_mixer_list", *mixer])
        mixture.load(mixture.parse(mixture.fields_of(recipe)), 42, rows.RowRules(template=tokenizer), {}, "x")
        return [line for line in capsys.readouterr().err.splitlines() if "renders on" in line]

    assert said("a", "b") == [DATED_WARNING]
    sources = f"{tmp_path / 'a.jsonl'} [train], {tmp_path / 'b.jsonl'} [train]"
    assert said("a", "b", "c") == [f"{DATED_WARNING} (mixture sources {sources})"]
    assert said("c") == []


def test_a_template_that_writes_nothing_of_a_prompts_message_is_refused_naming_it(tmp_path, tiny_model_dir):
    """A chat template that skips a message (one written for user and assistant turns, which leaves out a system
    message without an error) trained the pairs without it: the system's instruction ('Answer in French.') reached
    no token, and the run, its dry run and the analyzer said nothing. Refused, naming the message and the fix; a
    template that writes it elsewhere (folded into the first user turn) passes."""
    import datasets

    def conversation(i, answer, system="Answer in French."):
        return [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}, answer]

    rows = [
        {
            "chosen": conversation(i, {"role": "assistant", "content": f"oui {i}"}),
            "rejected": conversation(i, {"role": "assistant", "content": f"yes {i}"}),
        }
        for i in range(12)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    turn = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    end = "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    skips = tmp_path / "skips.jinja"
    skips.write_text("{% for message in messages %}{% if message['role'] != 'system' %}" + turn + "{% endif %}" + end)
    recipe = parse_args([*SMOKE, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data)])
    with pytest.raises(ConfigError) as refused:
        stages.load_data(
            parse_args(
                [
                    *SMOKE,
                    "--model_name_or_path",
                    tiny_model_dir,
                    "--dataset_name",
                    str(data),
                    "--chat_template_path",
                    str(skips),
                ]
            ),
            stages.checks(recipe),
            say=False,
        )
    said = str(refused.value)
    assert "the chat template writes nothing of message 0 (system), so the pair would train without it" in said, said
    assert "(chat_template_path)" in said and said.endswith(
        "first: line 1 of pairs.jsonl, it reads 'Answer in French.'"
    )
    folds = tmp_path / "folds.jinja"  # the system message written inside the first user turn: kept
    folds.write_text(
        "{% for message in messages %}{% if message['role'] == 'user' and loop.index0 == 1 %}"
        "{{ '<|im_start|>user\\n' + messages[0]['content'] + ' ' + message['content'] + '<|im_end|>\\n' }}"
        "{% elif message['role'] != 'system' %}" + turn + "{% endif %}" + end
    )
    tokenizer = lengths.load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = folds.read_text()
    assert not lengths.measure(datasets.Dataset.from_list(rows), tokenizer, skip_invalid=True).invalid
