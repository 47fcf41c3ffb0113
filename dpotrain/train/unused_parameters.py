"""Parameters that a short micro-batch leaves without a gradient, kept in every micro-batch's graph.

DDP and DeepSpeed ZeRO-2 reduce gradients in buckets filled as each parameter's gradient arrives: every rank must
give gradients to the same parameters. DeepSeek V4's compressed attention compresses blocks of 128 positions, and its
compressor takes part only in a micro-batch at least that long: a rank whose micro-batch was shorter reduced fewer
gradients than the others, and the launch stopped in a collective of mismatched sizes (gloo: "Received data size
doesn't match expected size"; NCCL may hang). Such parameters are found once, as the trainer is built, from the graph
of one 2-token forward (the shortest micro-batch there is), and each training micro-batch adds them to its loss
times 0: the same loss and the same gradients, given to every parameter on every rank.
"""

import torch

from dpotrain.cluster.engine import Engine
from dpotrain.recipe.errors import cause
from dpotrain.train.dense_attention import dense_attention

# The engines whose gradient reduction is filled by each parameter's gradient as it arrives, on every rank alike
BUCKETED = ("ddp", "zero2")


def left_out_by_a_short_forward(model, run_engine: Engine, world: int) -> list[torch.nn.Parameter]:
    """The trained parameters of `model` (as built, before the engine wraps it) outside the graph of a 2-token forward,
    where the engine reduces gradients by bucket over several processes; [] elsewhere, or where the forward fails (a
    forward this machine cannot run alone says so as training starts)."""
    if world < 2 or run_engine.name not in BUCKETED:
        return []
    trained = {id(p): p for p in model.parameters() if p.requires_grad}
    was_training = model.training
    model.eval()  # no activation checkpointing (its layers' graphs are made in the backward) and no dropout
    try:
        with torch.enable_grad(), dense_attention(model):
            ids = torch.zeros((1, 2), dtype=torch.long, device=next(model.parameters()).device)
            logits = model(input_ids=ids).logits
        reached = _leaves(logits.grad_fn)
    except Exception as e:  # noqa: BLE001 - a model this probe cannot run trains as it did before
        print(f"note: the short forward that finds parameters a micro-batch may leave unused failed ({cause(e, 120)})")
        return []
    finally:
        model.train(was_training)
    return [p for key, p in trained.items() if key not in reached]


def _leaves(root) -> set[int]:
    """The ids of the tensors whose gradients the graph below `root` accumulates."""
    seen, reached, stack = set(), set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf tensor's gradient
            reached.add(id(node.variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def in_every_graph(loss: torch.Tensor, parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """`loss` with `parameters` in its graph, times 0: the same value, a zero gradient for each (one element of each
    is taken, not its sum, which an overflow to inf would turn into a NaN loss)."""
    if not parameters:
        return loss
    return loss + 0.0 * sum(p.flatten()[0] for p in parameters)
