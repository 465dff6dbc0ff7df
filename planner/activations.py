"""planner/activations.py: the saved-activation bytes the dry run plans with, traced, not modelled.

A workload's whole training step (forward, its loss, backward, clipping, AdamW: graph_trainer's step)
is captured by make_fx on meta tensors in bf16, after graph_passes.remat where asked, and the bytes
its backward reads from the forward are counted (graph_passes.saved_bytes). Nothing is allocated, so
a full-width block traces on a laptop; blocks of one kind are equal, so the bytes at full depth come
from traces at one and two blocks (`extrapolate`).
"""
import dataclasses

import torch

import graph_passes
import graph_trainer
import optim
from model import Transformer, next_token_loss


def step_saved_bytes(model, loss, batch, remat):
    """Saved-activation bytes of the whole training step of `model` (on meta, cast to bf16) with a
    task's `loss(model, batch)` on an example `batch` of meta tensors: traced, nothing allocated."""
    model = model.to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    state = [torch.zeros_like(p) for p in params]
    step_fn = graph_trainer.build_step_fn(model, names, loss, 1.0, (0.9, 0.95), 1e-8, 0.1,
                                          optim.decay_mask(names, params), lambda: torch.autocast("cpu", enabled=False))
    one = torch.ones((), device="meta")
    gm = graph_trainer.capture(step_fn, (params, list(model.buffers()), state, state, one, one, *batch))
    if remat:
        gm = graph_passes.remat(gm)
    return graph_passes.saved_bytes(gm)


def extrapolate(saved_at, depths):
    """Saved bytes at full depth from traces at one block of each kind (`saved_at({field: n})`), plus
    one more block of each kind in turn: blocks of a kind are equal, so bytes are linear in each depth."""
    ones = {field: 1 for field in depths}
    base = saved_at(ones)
    return base + sum((n - 1) * (saved_at({**ones, field: 2}) - base) for field, n in depths.items())


def traced_saved_bytes(args, local_batch, seq_len, remat):
    """Saved-activation bytes of the traced language-model step for `args` (bf16 compute), on meta tensors."""
    with torch.device("meta"):
        model = Transformer(args)
    tokens = torch.zeros(local_batch, seq_len, dtype=torch.long, device="meta")
    return step_saved_bytes(model, next_token_loss, (tokens, tokens), remat)


def saved_bytes_per_sequence(args, seq_len, remat):
    """Saved activations of one sequence (bf16), traced at 1 and 2 layers, extrapolated to the depth."""
    return extrapolate(lambda depth: traced_saved_bytes(dataclasses.replace(args, **depth), 1, seq_len, remat),
                       {"n_layers": args.n_layers})
