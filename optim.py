"""optim.py: functional AdamW, warmup + cosine schedule, global-norm gradient clipping.

AdamW (Loshchilov & Hutter, arXiv 1711.05101) written as a pure function: lists of tensors in, new
lists out, nothing mutated. That is what lets graph_trainer.py trace the optimizer into the same graph
as forward and backward (no host-side gap between backward and update), and what makes the update
easy to check: it must equal torch.optim.AdamW step for step. The `_foreach_*` ops keep the eager
path fast (one kernel launch per op over all tensors) and are traceable by make_fx.

Weight decay: applied to weight matrices (embeddings, projections, experts); norm weights and
biases are not decayed, the usual choice (nanoGPT, most LLM recipes), since shrinking a scale or
offset towards 0 is no regularizer. The rule reads names as well as shapes: under --scan a norm
weight is stacked to (L, D), a matrix by shape alone.
"""
import math

import torch


def decay_mask(names, params):
    """True where weight decay applies: matrices that are not norm weights or biases."""
    return [p.dim() >= 2 and "norm" not in name and not name.endswith("bias") for name, p in zip(names, params)]


def init_state(params):
    return {"exp_avg": [torch.zeros_like(p) for p in params],
            "exp_avg_sq": [torch.zeros_like(p) for p in params]}


def adamw(params, grads, state, step, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, mask=None):
    """One AdamW update. `step` counts from 1 (the update being made); `lr` may be a 0-d tensor.

    Returns (new_params, new_state). Same arithmetic as torch.optim.AdamW (foreach, non-capturable):
      p <- p * (1 - lr * wd);  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
      p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """
    with torch.profiler.record_function("minititan/optimizer"):  # (its range in a trace: run/profiling.py)
        b1, b2 = betas
        mask = [True] * len(params) if mask is None else mask
        bias1 = 1 - b1 ** step
        bias2_sqrt = (1 - b2 ** step) ** 0.5
        exp_avg = torch._foreach_lerp(state["exp_avg"], grads, 1 - b1)
        exp_avg_sq = torch._foreach_addcmul(torch._foreach_mul(state["exp_avg_sq"], b2), grads, grads,
                                            value=1 - b2)
        decayed = [p * (1 - lr * weight_decay) if m else p for p, m in zip(params, mask)]
        denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(exp_avg_sq), bias2_sqrt), eps)
        updates = torch._foreach_div(exp_avg, denom)
        new_params = [p - (lr / bias1) * u for p, u in zip(decayed, updates)]
        return new_params, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def global_norm(tensors, reduce_sq=None):
    """L2 norm over all tensors together, in fp32. With sharded tensors, `reduce_sq` turns the local
    squared norms, one per tensor, into the global sum of squares (one all-reduce of one scalar)."""
    norms = torch._foreach_norm([t.float() for t in tensors])
    if reduce_sq is None:
        return torch.linalg.vector_norm(torch.stack(norms))
    return reduce_sq(torch.stack(norms).square()).sqrt()


def clip_by_global_norm(grads, max_norm, reduce_sq=None):
    """(clipped grads, pre-clip norm): the rule of torch.nn.utils.clip_grad_norm_ (coef capped at 1)."""
    with torch.profiler.record_function("minititan/clip"):
        norm = global_norm(grads, reduce_sq)
        if max_norm is None or max_norm <= 0:
            return list(grads), norm
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        return torch._foreach_mul(grads, coef.to(grads[0].dtype)), norm


def lr_at(step, base_lr, warmup, total, min_ratio=0.1):
    """Learning rate for update number `step` (1-based): linear warmup over `warmup` updates, then a
    cosine decay to min_ratio * base_lr at `total`."""
    if warmup > 0 and step <= warmup:
        return base_lr * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class AdamW:
    """Stateful shell around `adamw` for the eager loop: keeps the state, writes the new values back
    into the module's parameters (so the module, its hooks and checkpoints see them)."""

    def __init__(self, params, names, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.params = list(params)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.mask = decay_mask(names, self.params)
        self.state = init_state(self.params)
        self.step_count = 0

    @torch.no_grad()
    def step(self, grads, lr, params=None, step=None):
        """`params`: fresh views of the same parameters, for owners that re-point storage (FSDP2).
        `step`: this update's number as a 0-d tensor (XLA: an input, not a new constant per step)."""
        params = self.params if params is None else params
        new_params, new_state = adamw([p.detach() for p in params], grads, self.state,
                                      self.step_count + 1 if step is None else step, lr, self.betas, self.eps,
                                      self.weight_decay, self.mask)
        self.commit(new_params, new_state, params)

    @torch.no_grad()
    def commit(self, new_params, new_state, params=None):
        """Take an update computed by `adamw` here or inside a traced step graph: write the new values
        into the parameters (so the module, its hooks and checkpoints see them), keep the new state."""
        torch._foreach_copy_([p.data for p in (self.params if params is None else params)], list(new_params))
        self.state = {k: list(v) for k, v in new_state.items()}
        self.step_count += 1
