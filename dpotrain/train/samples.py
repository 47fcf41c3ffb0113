"""Sample generations during training: a few fixed prompts, greedy, every N optimizer steps.

What a collapsing run looks like before its metrics say so: 001's model answered "hormonal hormonal hormonal ...".
Each sample gets a repetition score (the share of word 3-grams seen earlier in the text: 0 for prose, ~1 for a loop;
in Chinese, Japanese or Thai each character is a word) and its longest run of one word; a score over
`sample_repetition_warn` is a warning. Samples go to samples.jsonl and, when W&B runs, to a `samples` table.

Where the weights are sharded (ZeRO-3, FSDP2) every rank generates together (`synced_gpus`), else the main process
alone; then the engine is left as training expects (`leave_for_training`). A model that trains on FlexAttention
generates on sdpa, with compilation off: generation's KV cache and one-token queries would each be a new compilation,
spending the run's limits (with `compile_layers`, the recompile limit before training's first step, leaving it eager).
"""

import itertools
import json
import re
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, TrainerCallback

from dpotrain.cluster import collectives
from dpotrain.data import chat_template, positions
from dpotrain.recipe import records as run_records
from dpotrain.recipe import upstream
from dpotrain.recipe.errors import ConfigError, warn
from dpotrain.train.dense_attention import dense_attention
from dpotrain.train.metrics import keep_before, steps_text

SAMPLES_FILE = "samples.jsonl"
# The steps sampled, kept in the checkpoint's trainer_state.json (as a key of its `stateful_callbacks`, saved as it
# stands; not this class's name, which --restore_callback_states_from_checkpoint would rebuild without its prompts)
SAMPLED = "samples_steps"
NGRAM = 3
# Scripts written without spaces between words (Chinese and Japanese characters, kana, Thai, Lao, Khmer, Myanmar): each
# character counts as a word. Split on spaces alone, a Chinese loop ("好的好的好的...") was one word, scored 0.
UNSPACED = (
    "[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f]"
)
WORD = re.compile(f"{UNSPACED}|(?:(?!{UNSPACED})\\S)+")


def check_values(project) -> None:
    p = project
    if p.samples_every < 0:
        raise ConfigError(f"samples_every must be >= 0 (got {p.samples_every}); 0 turns samples off")
    if p.sample_count < 1 or p.sample_max_new_tokens < 1:
        raise ConfigError("sample_count and sample_max_new_tokens must be >= 1")
    if not 0 <= p.sample_repetition_warn < 1:  # `repetition` is a share of repeated 3-grams, always below 1
        raise ConfigError(
            f"sample_repetition_warn must be in [0, 1) (got {p.sample_repetition_warn:g}): a sample's repetition "
            "score is the share of its word 3-grams seen earlier in it, from 0 (none) to below 1 (a loop), so "
            f"{p.sample_repetition_warn:g} would {'never warn' if p.sample_repetition_warn >= 1 else 'act as 0'}; "
            "0.5 is the default"
        )
    if p.samples_every and any(not prompt.strip() for prompt in p.sample_prompts or []):  # as a file's, above
        raise ConfigError("sample_prompts holds a blank prompt, which has nothing to answer: remove it, or write one")
    path = p.sample_prompts_file
    if path and (not Path(path).is_file() or Path(path).suffix not in (".txt", ".jsonl")):
        raise ConfigError(f"sample_prompts_file {path!r}: give an existing .txt (one prompt per line) or .jsonl file")
    if path and p.sample_prompts:  # `from_recipe` takes the list: the file would be passed over without a word
        raise ConfigError(
            f"sample_prompts and sample_prompts_file {path!r} are both given, and only one is read: remove one"
        )
    if path and p.samples_every:  # read now, not when the run is built: a bad line would be a traceback there
        file_prompts(path)


def check_positions(project, config, tokenizer, model: str) -> None:
    """Refuses samples whose prompt and `sample_max_new_tokens` reach past the model's positions, before its weights
    load (a rotary model would babble past its context, like a collapse; learned positions fail at step 0). The
    prompts: the recipe's, else the data's first, of at least one token each."""
    if not project.samples_every:
        return
    limit, how = positions.model_limit(config)
    texts = recipe_prompts(project)
    longest = max((len(_encode_prompt(tokenizer, t)) for t in texts), default=1) if tokenizer and texts else 1
    if limit is None or longest + project.sample_max_new_tokens <= limit:
        return
    prompt = f"the longest sample prompt's {longest:,} tokens" if texts and tokenizer else "a prompt"
    raise ConfigError(
        f"sample_max_new_tokens {project.sample_max_new_tokens:,} after {prompt} reaches past the {limit:,} positions "
        f"{model} takes ({how}): samples would be generated on positions the model never learned (or fail): set "
        f"--sample_max_new_tokens {max(limit - longest, 1)} or lower"
        + (", or give shorter sample_prompts" if texts and tokenizer else "")
    )


def recipe_prompts(p) -> list[str]:
    """The recipe's sample prompts (`sample_prompts`, else `sample_prompts_file`'s), `sample_count` of them at most."""
    prompts = p.sample_prompts or (file_prompts(p.sample_prompts_file) if p.sample_prompts_file else [])
    return prompts[: p.sample_count]


def file_prompts(path: str) -> list[str]:
    """The prompts of a `sample_prompts_file`: a .txt file's non-empty lines, a .jsonl file's `prompt` strings."""
    try:
        # utf-8-sig: a byte-order mark (Windows editors, PowerShell write one) is not the first prompt's first character
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"sample_prompts_file {path!r} cannot be read ({e}): give a UTF-8 text file") from None
    # Lines end at "\n" alone, as in JSON Lines: str.splitlines also cuts at U+2028, U+0085 and others, which a JSON
    # string may hold as they are. Numbered as in the file, blank lines included.
    lines = [(number, line.rstrip("\r")) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:  # else the data set's first prompts would be sampled instead, without a word
        raise ConfigError(f"sample_prompts_file {path!r} holds no prompt: write one per line, or remove it")
    if Path(path).suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for number, line in lines:
        try:
            prompt = json.loads(line).get("prompt")
        except (ValueError, AttributeError):
            prompt = None
        # A blank prompt, as a .txt file's blank line is skipped: under a tokenizer without a chat template it is no
        # token, and the run ended in generate's traceback at step 0's samples, after the reference stage
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(
                f"sample_prompts_file {path!r}, line {number}: not a JSON object with a `prompt` string, not blank "
                '(one per line: {"prompt": "..."}): fix the line, or give a .txt file of one prompt per line'
            )
        prompts.append(prompt)
    return prompts


def repetition(text: str) -> dict:
    """{"repetition": share of word 3-grams seen before in the text, "longest_run": [word, times in a row]}. Words are
    split by spaces, and each character of a script written without them is one (`UNSPACED`)."""
    words = WORD.findall(text)
    grams = [tuple(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1)]
    repeated = len(grams) - len(set(grams))  # each 3-gram after its first occurrence
    runs = ((word, len(list(same))) for word, same in itertools.groupby(words))
    longest = max(runs, key=lambda run: run[1], default=("", 0))  # the first of the longest
    return {"repetition": repeated / len(grams) if grams else 0.0, "longest_run": list(longest)}


def _encode_prompt(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"])
    return tokenizer(text)["input_ids"]


def _greedy(model, prompt_length: int, max_new_tokens: int, tokenizer) -> GenerationConfig:
    """Greedy decoding with only the model's stop tokens: generate fills what this config leaves unset from the model's
    generation_config.json, whose repetition penalty or no_repeat_ngram_size would hide the repetition samples watch.
    The stops: every one the end-of-answer check accepts (`chat_template.model_stops`), not generation_config's alone:
    a template that ends turns with the tokenizer's EOS, which that file does not list, gave samples without an end."""
    own = model.generation_config
    # The global defaults hold max_length 20: beside max_new_tokens, generate printed "Both `max_new_tokens` and
    # `max_length` seem to have been set" for every sample. It warns so wherever a max_length is set, this config's
    # or the model's: where the model's sets one, the length is given as max_length (the model's max_new_tokens,
    # filled in where this config leaves it unset, would take precedence over it, so not where the model sets one).
    greedy = {**upstream.default_generation_params(), "max_length": None}  # do_sample False, use_cache True
    if own.max_length is not None and own.max_new_tokens is None:
        greedy["max_length"] = prompt_length + max_new_tokens
    else:
        greedy["max_new_tokens"] = max_new_tokens
    stops = sorted(chat_template.model_stops(tokenizer, model.config, chat_template.eos_ids(own.eos_token_id)))
    return GenerationConfig(**greedy, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops or None)


class SampleGenerator(TrainerCallback):
    def __init__(
        self,
        prompt_ids: list[list[int]] | None,
        tokenizer,
        every: int,
        max_new_tokens: int,
        warn_at: float,
        every_rank: bool = False,
        count: int = 0,
    ):
        self.prompt_ids, self.tokenizer = prompt_ids, tokenizer  # None: the training set's first `count` (`attach`)
        self.every, self.max_new_tokens, self.warn_at, self.count = every, max_new_tokens, warn_at, count
        self.every_rank = every_rank  # weights sharded over the ranks: all of them generate together
        self.flagged: list[dict] = []  # samples over warn_at
        self._trimmed = False
        self._cut_said = False  # a prompt's answer cut at the model's positions, said once
        self._base: dict[int, float] = {}  # prompt index -> the repetition of the base model's answer (step 0)
        self.spent = None  # called with the seconds each round of samples took (the throughput clock leaves them out)
        self.stop = None  # the run's GracefulStop, agreed on again after a round (`attach`)

    @classmethod
    def from_recipe(cls, recipe, tokenizer, every_rank: bool = False) -> "SampleGenerator":
        """Prompts from the recipe (list or file), else the training data's first `sample_count` (`attach`)."""
        p = recipe.project
        texts = recipe_prompts(p)
        ids = [_encode_prompt(tokenizer, t) for t in texts] if texts else None
        warn_at = p.sample_repetition_warn
        return cls(ids, tokenizer, p.samples_every, p.sample_max_new_tokens, warn_at, every_rank, p.sample_count)

    def attach(self, trainer) -> None:
        """Once the trainer is built: its training set's first prompts where the recipe gave none, and its throughput
        clock, which leaves samples' time out."""
        if self.prompt_ids is None:
            rows = trainer.train_dataset
            self.prompt_ids = [list(x) for x in rows.select(range(min(self.count, len(rows))))["prompt_ids"]]
        self.spent = trainer.pair_metrics.exclude
        self.stop = trainer.graceful_stop

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == 0:  # the base model's answers, to compare later samples against
            self._round(args, state, model, optimizer)
        elif state.is_world_process_zero:
            self._say_lost(Path(args.output_dir) / SAMPLES_FILE, state)

    @staticmethod
    def _say_lost(path: Path, state) -> None:
        """After a resume: the steps the checkpoint says were sampled that samples.jsonl lacks (deleted or cut between
        attempts) are said; they cannot be generated again, the weights of those steps being gone."""
        sampled = [s for s in state.stateful_callbacks.get(SAMPLED, []) if s <= state.global_step]
        state.stateful_callbacks[SAMPLED] = sampled  # the steps past the checkpoint are sampled again
        have = {r["step"] for r in run_records.read(path, True)}
        if lost := [s for s in sampled if s not in have]:
            warn(
                f"{path} lacks the samples of step {steps_text(lost, 'sampled')}, which the checkpoint resumed from "
                "says were generated (the file deleted or cut since): they are lost, the weights of those steps "
                "gone; the run samples on from here"
            )

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step % self.every == 0:
            self._round(args, state, model, optimizer)
            # After the step's stop was agreed on (GracefulStop comes first): a request made while the samples were
            # generated (minutes of greedy answers on a large model) waited for the next step's end and its checkpoint
            if self.stop is not None:
                self.stop.stop_between_steps(args, control, save=True)

    def _round(self, args, state, model, optimizer) -> None:
        start = time.perf_counter()
        records = self.generate(args, state, model)  # the main process's; [] on the others
        # Every rank, the main process writing: its refusal (a full disk) is every rank's line, not the main's alone
        # while the others wait in the next step's collective. Once per round of samples, a small cost beside it.
        collectives.main_outcome(self._write, args, state, records)
        leave_for_training(model, optimizer)
        if self.spent:
            self.spent(time.perf_counter() - start)

    def generate(self, args, state, model) -> list[dict]:
        if not (state.is_world_process_zero or self.every_rank):
            return []
        records = []
        limit = positions.model_limit(model.config)[0] or sys.maxsize
        was_training = model.training
        model.eval()  # no dropout; activation checkpointing is off outside training mode
        try:
            with torch.no_grad(), dense_attention(model), torch.compiler.set_stance("force_eager"):
                for i, ids in enumerate(self.prompt_ids):
                    inputs = torch.tensor([ids], device=model.device)
                    # A data prompt near the model's positions (the recipe's are checked before loading): its answer
                    # ends at the last position rather than going on where the model never learned (or failing)
                    new = min(self.max_new_tokens, limit - len(ids))
                    if new < 1:
                        continue
                    if new < self.max_new_tokens and state.is_world_process_zero and not self._cut_said:
                        self._cut_said = True
                        print(
                            f"samples: prompt {i} is {len(ids):,} tokens, its answer cut to {new:,} new tokens of "
                            f"sample_max_new_tokens {self.max_new_tokens:,} at the model's {limit:,} positions",
                            file=sys.stderr,
                            flush=True,
                        )
                    out = model.generate(
                        inputs,
                        attention_mask=torch.ones_like(inputs),
                        generation_config=_greedy(model, len(ids), new, self.tokenizer),
                        synced_gpus=self.every_rank,
                    )
                    completion = self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
                    prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
                    record = dict(step=state.global_step, prompt_index=i, prompt=prompt, completion=completion)
                    records.append({**record, **repetition(completion)})
        finally:
            model.train(was_training)
        if not state.is_world_process_zero:
            return []
        if state.global_step == 0 or not self._base:  # the base model's answers (a resumed run reads them back)
            before = records if state.global_step == 0 else run_records.read(Path(args.output_dir) / SAMPLES_FILE, True)
            self._base = {r["prompt_index"]: r["repetition"] for r in before if r["step"] == 0}
        for r in records:
            # A collapse is what training did: not at step 0 (an untrained model may loop already), and not an answer
            # that repeats no more than the base model's to the same prompt.
            if r["step"] > 0 and r["repetition"] > max(self.warn_at, self._base.get(r["prompt_index"], 0.0)):
                self.flagged.append(r)
                word, times = r["longest_run"]
                print(
                    f"samples warning step {r['step']}: prompt {r['prompt_index']} repeats itself (repetition "
                    f"{r['repetition']:.2f}, {word!r} x{times}): degenerate output, a sign of collapse; see "
                    f"{SAMPLES_FILE}",
                    file=sys.stderr,
                    flush=True,
                )
        return records

    def _write(self, args, state, records: list[dict]) -> None:
        if not records:  # every prompt too long for the model's positions
            return
        path = Path(args.output_dir) / SAMPLES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self._trimmed:  # after a resume, the steps past the checkpoint are sampled again
            keep_before(path, state.global_step)
            self._trimmed = True
        run_records.append(path, records)
        state.stateful_callbacks.setdefault(SAMPLED, []).append(state.global_step)
        if "wandb" in sys.modules:
            import wandb

            if wandb.run is not None:
                columns = ["step", "prompt_index", "prompt", "completion", "repetition"]
                table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in records])
                worst = max(r["repetition"] for r in records)
                # At the W&B step sampled (tracking.WandbStepIsGlobalStep): without one W&B adds them to the last logged
                # step's row, as samples come before the Trainer logs their step, which joins this row (not committed).
                step = state.global_step
                logs = {"samples": table, "samples/max_repetition": worst, "train/global_step": step}
                wandb.log(logs, step=step, commit=False)


def leave_for_training(model, optimizer) -> None:
    """After generating: the engine as the next training (or evaluation) forward expects it. ZeRO-3 prefetches in the
    recorded fetch order, and generating records the LM head, which TRL's fused head gathers itself
    (`maybe_gather_lm_head_ctx`; prefetched, it is "in flight" there): the order is forgotten, as TRL's
    `unwrap_model_for_generation` does. FSDP2 reshards the units a forward leaves gathered (the root, LM head)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    # A training engine's ZeRO-3 optimizer holds the parameter offload; an inference engine's "optimizer" is it
    offload = getattr(inner, "parameter_offload", None) or inner
    coordinator = getattr(offload, "param_coordinator", None)  # DeepSpeed ZeRO-3 only
    if coordinator is not None and not coordinator.is_invalid_trace():
        upstream.forget_fetch_order(coordinator)
    if model is not None:
        from dpotrain.reference.scorer import reshard

        reshard(model)
