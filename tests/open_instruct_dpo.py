"""open-instruct's `dpo_norm`, the loss OLMo 3 was trained with, written here from its definition, for
tests/test_assistant_turns.py: what `assistant_turns: all` must equal.

What it follows (allenai/open-instruct at 2fd104e, the commit that trained OLMo 3 7B Instruct and 32B Think; the DPO
functions are the same at 68da0a1, 7B Think):
- labels: `dataset_transformation.py:sft_tulu_tokenize_and_truncate_v1`, applied to each side's whole conversation
  (`preference_tulu_tokenize_and_truncate_v1`): the rendered conversation cut at max_length, every position labeled but
  those of non-assistant messages, a message i spanning from the end of the rendered messages[:i] to the end of the
  rendered messages[:i+1] (with the generation prompt when message i+1 is the assistant's: each assistant header is
  masked with the message before it); indices are capped at max_length, and the masking stops at a message that
  reaches it;
- dropping: `preference_tulu_filter_v1`, a pair is kept when both sides have a label left;
- log-probs: `dpo_utils.py:_get_batch_logps(average_log_prob=True)`, labels shifted by one, each side's log-prob the
  mean over its labeled positions;
- loss: `dpo_utils.py:dpo_loss` on those means (label_smoothing 0), -logsigmoid(beta x ((pi_c - ref_c) - (pi_r -
  ref_r))), the mean over pairs.
Nothing of the project is used: each sequence is scored alone by the plain model (no padding, no packing).
"""

import torch
import torch.nn.functional as F


def tokenize(messages: list[dict], tokenizer, max_length: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one side, -100 where open-instruct masks."""

    def rendered(upto: int, generation: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(
            messages[:upto], tokenize=True, return_dict=True, add_generation_prompt=generation
        )["input_ids"]
        return list(ids)[:max_length]  # truncation=True, max_length=max_seq_length: the start is kept

    input_ids = rendered(len(messages), False)
    labels = list(input_ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            continue
        start = 0 if i == 0 else len(rendered(i, False))
        assistant_next = i < len(messages) - 1 and messages[i + 1]["role"] == "assistant"
        end = len(rendered(i + 1, assistant_next))
        labels[start:end] = [-100] * len(labels[start:end])
        if end >= max_length:
            break
    return input_ids, labels


def average_log_prob(model, input_ids: list[int], labels: list[int]) -> torch.Tensor:
    """`_get_batch_logps(..., average_log_prob=True)` of one sequence."""
    logits = model(input_ids=torch.tensor([input_ids]), use_cache=False).logits[0, :-1].float()
    target = torch.tensor(labels[1:])
    mask = target != -100
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
    return (log_probs * mask).sum() / mask.sum()


def kept_pairs(pairs: list[dict], tokenizer, max_length: int) -> list[tuple[tuple, tuple]]:
    """Each kept pair's tokenized (chosen, rejected) sides, in order."""
    out = []
    for pair in pairs:
        chosen = tokenize(pair["chosen"], tokenizer, max_length)
        rejected = tokenize(pair["rejected"], tokenizer, max_length)
        if any(x != -100 for x in chosen[1]) and any(x != -100 for x in rejected[1]):
            out.append((chosen, rejected))
    return out


def dpo_norm_loss(policy, reference, pairs: list[dict], tokenizer, beta: float, max_length: int) -> torch.Tensor:
    """The loss of one step over `pairs` (the mean over the kept pairs), differentiable in `policy`'s weights."""
    losses = []
    for chosen, rejected in kept_pairs(pairs, tokenizer, max_length):
        with torch.no_grad():
            ref_chosen, ref_rejected = average_log_prob(reference, *chosen), average_log_prob(reference, *rejected)
        pi_chosen, pi_rejected = average_log_prob(policy, *chosen), average_log_prob(policy, *rejected)
        logits = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
        losses.append(-F.logsigmoid(beta * logits))
    return torch.stack(losses).mean()


def sgd_steps(model_dir: str, pairs: list[dict], tokenizer, beta: float, max_length: int, lr: float, steps: int):
    """`steps` optimizer steps of plain SGD (no momentum, no clipping, constant lr) over all of `pairs` each: the loss
    and the gradient of each step, and the weights after each, as {name: tensor}. The reference is the model before
    the first step, as the project's reference stage scores it."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.train()  # no dropout in these models; as the trainer runs it
    reference.eval()
    out = []
    for _ in range(steps):
        policy.zero_grad()
        loss = dpo_norm_loss(policy, reference, pairs, tokenizer, beta, max_length)
        loss.backward()
        loss = loss.detach()
        grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
        with torch.no_grad():
            for p in policy.parameters():
                p.sub_(lr * p.grad)
        weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
        out.append((loss.item(), grads, weights))
    return out
