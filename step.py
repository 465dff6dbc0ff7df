"""step.py: one training step, the whole of it in `train_step`:

    for each microbatch:                          (--grad-accum N; one microbatch without it)
        reported, loss = loss_fn(model, micro)    forward + loss: the workload's (model.py's next_token_loss)
        grads += layout.grads(loss, params)       backward: autograd, reduced over the ranks that share a weight
    grads, norm = clip_by_global_norm(grads)      one norm over every rank's shards (optim.py)
    opt.step(grads, lr)                           AdamW (optim.py)

Two declared hooks and nothing else reach into it. The layout (parallel.Parallel: one device, a
torchrun mesh, XLA SPMD) answers `grads`, `global_sq_norm`, `local`, `mean_over_dp` and
`after_microbatch`; the microbatches (`Microbatches`) say how a batch splits. Graph mode
(graph_trainer.py) traces the same loop, `loss_and_grads`, into one graph with a functional AdamW.

Gradient accumulation: one optimizer step on the global batch, computed as N microbatches.

    python train.py --batch-size 32 --grad-accum 4     # each step: 4 forward + backward passes of 8 rows

A step's gradient is linear in its rows, so the gradient of the whole batch's loss is the weighted sum
of the gradients of its microbatches' losses; the activations of one microbatch at a time are alive.
The flag is a count (`--grad-accum N`, MaxText's `gradient_accumulation_steps`), not torchtitan's pair
of a global and a local batch size: `--batch-size` is already the global batch everywhere (the data
order, the resume checks, the planner), so a count leaves which rows a step trains on unchanged and
only says in how many passes they are computed. Each data-parallel rank splits its own rows (global
rows / dp) into N microbatches of equal size.

How the microbatches' losses add up to the batch's (`Workload.loss_reduction(cfg)`, the workload's
declaration; none: the flag is refused, since a guess could be silently wrong):
  "mean"  the loss is a mean over rows that hold equal counts (language modelling: every position of
          every row is a target; FLUX: the same latent size in every row; GRPO's per-sequence means):
          the batch's mean is the mean of the microbatches' means, each weighted 1 / N;
  "sum"   the loss is a sum divided by a count of the whole batch, carried in the batch as a 0-d entry
          (SFT's answer bytes, GRPO/DAPO's completion tokens: rows hold different counts): every
          microbatch divides by that same global count, so their losses add up (weight 1). A mean of
          microbatch means would weight a token of a short microbatch more.
What is not linear in the rows is each microbatch's own: an MoE load-balancing loss is computed per
microbatch (as torchtitan and MaxText do), so an MoE step with accumulation differs from the whole batch
by that term's nonlinearity; dense models and the four workloads' main losses are exact.

Under a mesh each rank sums its own rows' gradients, reduced over the ranks once a step where the
layout can hold the unreduced sum (FSDP2: its gradient sync off before the last microbatch; graph
mode's SimpleFSDP passes rewrite the N reduce-scatters of a parameter into one of their sum,
fsdp_passes.reduce_once), else once a microbatch, keeping only the sharded sum (eager SimpleFSDP, GSPMD).
"""
import device as dev
import optim


def train_step(model, loss_fn, batch, lr, opt, layout, params, microbatches, clip, autocast):
    """One optimizer step on `batch` (this rank's rows), in place: (loss to report, averaged over the
    data-parallel ranks; the gradients' global norm before clipping). `params`: the model's parameters
    (`model.parameters()`, in order), `opt` the optim.AdamW over the layout's local shards of them."""
    reported, grads = loss_and_grads(loss_fn, model, batch, microbatches, layout, params, autocast)
    grads, norm = optim.clip_by_global_norm(grads, clip, layout.global_sq_norm)
    step = dev.scalar(opt.step_count + 1, layout.device) if dev.is_xla(layout.device) else None  # (XLA: an input)
    opt.step(grads, lr, layout.local(params), step)
    return layout.mean_over_dp(reported), norm


def loss_and_grads(loss_fn, model, batch, microbatches, layout, params, autocast):
    """(loss to report, gradients) of the whole `batch`, one microbatch at a time: `loss_fn(model,
    micro) -> (reported, differentiated)` (the workload's), `layout.grads(loss, params, last) ->
    [gradient per parameter]` (autograd, reduced over ranks), each microbatch's loss weighted as its
    reduction says; the gradients summed. A layout that sums a step's gradients itself and reduces them
    once (FSDP2 without gradient sync) returns None before the `last` microbatch and the sum at it.
    With one microbatch this is exactly the unaccumulated step. `layout.after_microbatch(grads_sum,
    micro) -> micro` hands over each microbatch after the first (a compiler's ordering barrier)."""
    parts = microbatches.split(batch)
    reported_sum, grads_sum = None, None
    for i, (micro, weight) in enumerate(parts):
        if i and grads_sum is not None:
            micro = layout.after_microbatch(grads_sum, micro)
        with autocast():
            reported, loss = loss_fn(model, micro)
        grads = layout.grads(loss if weight is None else loss * weight, params, i == len(parts) - 1)
        reported = reported.detach() if weight is None else reported.detach() * weight
        reported_sum = reported if reported_sum is None else reported_sum + reported
        if grads is None:  # (the layout holds the running sum)
            continue
        # (in place: one buffer per parameter, whatever the count)
        grads_sum = list(grads) if grads_sum is None else [a.add_(g) for a, g in zip(grads_sum, grads)]
    return reported_sum, grads_sum


REDUCTIONS = ("mean", "sum")


class Microbatches:
    """How a step's (local) batch splits: `count` microbatches, combined by `reduction`."""

    def __init__(self, count, reduction):
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown loss reduction {reduction!r}; one of {REDUCTIONS}")
        self.count, self.reduction = count, reduction

    def split(self, batch):
        """[(microbatch, weight)]: every entry with a row dim split on dim 0 into `count` equal parts,
        a 0-d entry (a whole-batch normalizer) given to every microbatch whole. Microbatch i takes rows
        i, i + count, i + 2 count, ...: under XLA SPMD, where one process holds the global batch split
        over the devices in contiguous blocks, each device then holds its equal share of every
        microbatch (contiguous chunks would put microbatch 0 on the first devices only)."""
        n = self.count
        if n == 1:
            return [(tuple(batch), None)]
        for t in batch:
            if t.dim() and t.shape[0] % n:
                raise ValueError(f"{t.shape[0]} rows do not split into {n} microbatches")
        parts = [t.unflatten(0, (t.shape[0] // n, n)).unbind(1) if t.dim() else (t,) * n for t in batch]
        weight = 1.0 / n if self.reduction == "mean" else None
        return [(tuple(p[i] for p in parts), weight) for i in range(n)]


def check_grad_accum(count, reduction, rows, named, task):
    """Why `--grad-accum count` cannot split a rank's `rows` (its flags' words: `named`) for workload
    `task` whose loss reduction is `reduction`, or None."""
    if count == 1:
        return None
    if reduction is None:
        return (f"--grad-accum {count}: the {task} workload does not declare how its loss splits into "
                f"microbatches (Workload.loss_reduction), so it cannot accumulate")
    if rows % count:
        return f"--grad-accum {count}: {named} do not split into {count} equal microbatches"
    return None

