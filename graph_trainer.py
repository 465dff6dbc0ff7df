"""graph_trainer.py: the whole training step as ONE graph, handed whole to a backend.

After TorchTitan's Graph Trainer: instead of letting a compiler see one block at a time, trace
forward, loss, backward (torch.autograd.grad), gradient clipping and the functional AdamW update
(upstream's tracer can include optimizer.step too, optionally; here it always does) into a single FX
GraphModule with make_fx, on fake tensors (no memory, no compute). The compiler then sees what JAX's jit sees: a pure function
    (params, optimizer state, step, lr, batch) -> (new params, new state, loss, grad norm)
so it can fuse across the forward/backward/update boundaries and there is no host-side gap
between backward and update. Pallas kernels appear as single opaque nodes (jax_op.py).

Backends: "fx" (the GraphModule's generated Python code, run op by op), "inductor"
(torch.compile of the graph), "xla" (the graph's aten ops run on XLA tensors: torch_xla traces
them lazily into one HLO program per step, compiled once and cached by graph hash), "openxla" (the
same program through torch_xla's dynamo bridge: recorded once, then run from its cache without
recording the graph's ops again each step, which costs "xla" ~35 ms a FLUX step on a 2-core CPU:
docs/measured.md).
The traced graph must run under torch.no_grad(): autograd is already inside it.
"""
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import device as dev
import fsdp_passes
import graph_passes
import optim
from errors import BadInput
from parallel import Parallel
from step import Microbatches, loss_and_grads


class GraphCaptureError(BadInput):
    pass


class _TracedBackward:
    """The backward hook of step.loss_and_grads inside the trace: autograd on the traced leaves, the
    forward's end marked (the passes read the first marker); between microbatches, the layout's own
    hand-over (a compiler's ordering barrier)."""

    def __init__(self, parallel):
        self.parallel = parallel

    @staticmethod
    def grads(loss, leaves, last):
        return torch.autograd.grad(graph_passes.forward_end(loss), leaves)

    def after_microbatch(self, grads_sum, micro):
        return self.parallel.after_microbatch(grads_sum, micro)


class _LossOf(nn.Module):
    """The task's loss as a module holding the model, so functional_call can swap in the traced
    parameters (named "model.<name>") for one call."""

    def __init__(self, loss_fn, model):
        super().__init__()
        self.loss_fn, self.model = loss_fn, model

    def forward(self, *batch):
        return self.loss_fn(self.model, batch)


def build_step_fn(model, names, loss_fn, clip, betas, eps, weight_decay, mask, autocast, parallel=None,
                  microbatches=None, param_dtype=None):
    """The pure step function that make_fx traces. `loss_fn(model, batch) -> (loss to report, loss to
    differentiate)` is the task's. Under a mesh `params` are the local shards: `parallel.like` wraps
    them back into DTensors for the model (whose parameter reads all-gather and whose backward
    reduce-scatters), and the gradient norm and logged loss are reduced across ranks, all inside.
    `microbatches` (step.Microbatches, --grad-accum): the loop over them is unrolled into the graph,
    each microbatch's forward + backward in turn (the passes take the first microbatch's forward as the
    forward: the first forward_end marker), one gradient sum, one update. `param_dtype` (bf16): the
    forward reads the weights cast to it, FSDP2's MixedPrecisionPolicy(param_dtype) over fp32 master
    weights, so its activations (the residual stream too) are bf16; the gradients come back fp32."""
    parallel = parallel or Parallel(None)
    microbatches = microbatches or Microbatches(1, "mean")
    backward = _TracedBackward(parallel)
    buffer_names = [n for n, _ in model.named_buffers()]
    placed_like = list(model.parameters())  # (DTensors under a mesh: their mesh and placements)
    loss_module = _LossOf(loss_fn, model)

    def step_fn(params, buffers, exp_avg, exp_avg_sq, step, lr, *batch):
        with torch.enable_grad():
            leaves = [p.detach().requires_grad_() for p in params]
            compute = [p.to(param_dtype) for p in leaves] if param_dtype else leaves
            state = {**{f"model.{n}": t for n, t in zip(names, parallel.like(compute, placed_like))},
                     **{f"model.{n}": b for n, b in zip(buffer_names, buffers)}}
            traced_loss = lambda module, micro: torch.func.functional_call(module, state, micro)  # (params swapped in)
            reported, grads = loss_and_grads(traced_loss, loss_module, batch, microbatches, backward, leaves, autocast)
        grads, norm = optim.clip_by_global_norm(list(grads), clip, parallel.global_sq_norm)
        reported = parallel.mean_over_dp(reported)
        new_params, state = optim.adamw(params, grads, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
                                        step, lr, betas, eps, weight_decay, mask)
        return new_params, state["exp_avg"], state["exp_avg_sq"], reported.detach(), norm
    return step_fn


def capture(step_fn, example_args):
    """Trace `step_fn` on fake tensors into one GraphModule (no real memory or compute)."""
    try:
        gm = make_fx(step_fn, tracing_mode="fake")(*example_args)
    except Exception as e:  # data-dependent shapes cannot be traced (train.py refuses the known case first)
        raise GraphCaptureError(f"cannot capture the step as one graph ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:160]})") from None
    # Dead code out: DTensor's sharding propagation for the vocabulary-split embedding runs the op
    # once on uninitialized example tensors, and the trace records that probe (its result unused;
    # run, it reads garbage indices). Ops with side effects (in place, collectives' waits) stay.
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def op_counts(gm):
    counts = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            key = str(node.target)
            counts[key] = counts.get(key, 0) + 1
    return counts


class GraphStep:
    """Drop-in for Trainer.eager_step: (*batch, lr) -> (loss, grad norm). Captures the step on first
    use, then runs the compiled graph. Its ingredients: the model and the task's loss (the code to
    trace), the optimizer (the parameters it updates, its hyper-parameters and state, which it keeps
    owning), and how to run: clipping, autocast, the parallel layout, the backend and the passes."""

    def __init__(self, model, loss_fn, opt, device, *, clip, autocast, parallel=None, backend=None, remat=False,
                 offload=False, split=0, fsdp_passes=(), blocks=(), microbatches=None):
        self.backend = backend or ("xla" if dev.is_xla(device) else "fx")  # (cli.validate refused what cannot run)
        self.model, self.opt, self.device = model, opt, device
        self.param_names = [n for n, _ in model.named_parameters()]
        self.step_fn = build_step_fn(model, self.param_names, loss_fn, clip, opt.betas, opt.eps,
                                     opt.weight_decay, opt.mask, autocast, parallel, microbatches)
        self.remat, self.offload, self.split, self.fsdp_passes = remat, offload, split, tuple(fsdp_passes)
        self.blocks = list(blocks)  # the model's repeated modules: the bucket pass's buckets
        self.gm = None        # the captured (and transformed) step graph
        self.compiled = None  # what runs it: gm, its stages (split), or inductor's compilation
        self.report = {}      # graph size, collectives, saved / offloaded bytes (the `graph:` log line)

    def transform(self, gm):
        """Apply the enabled passes, recording saved-activation bytes before and after."""
        self.report["saved_bytes_captured"] = graph_passes.saved_bytes(gm)
        if "reshard" in self.fsdp_passes:  # (with --remat: one sweep recomputes both)
            gm = fsdp_passes.reshard_after_forward(gm, also=graph_passes.remat_recomputes if self.remat else None)
        elif self.remat:
            gm = graph_passes.remat(gm)
        if "bucket" in self.fsdp_passes:
            gm = fsdp_passes.bucket_by_block(gm, fsdp_passes.param_buckets(self.model.named_parameters(), self.blocks))
        if "prefetch" in self.fsdp_passes:
            gm = fsdp_passes.prefetch(gm)
        if self.offload:
            gm = graph_passes.offload_saved(gm)
        self.report["saved_bytes"] = graph_passes.saved_bytes(gm)
        self.report["offloaded_bytes"] = graph_passes.host_bytes(gm)
        ops = op_counts(gm)
        self.report["nodes"] = len(gm.graph.nodes)
        self.report["collectives"] = {k.split(".")[1]: v for k, v in ops.items() if k.startswith("_c10d_functional.")}
        if self.fsdp_passes or self.report["collectives"]:
            self.report["collectives_by_side"] = fsdp_passes.collective_counts(gm)
            self.report["prefetched_gathers"] = fsdp_passes.prefetched(gm)
            self.report["reduce_scatter_bytes"] = fsdp_passes.reduce_scatter_bytes(gm)
            gathered = fsdp_passes.gather_chains(gm)  # (once: it walks the whole graph)
            roots = {graph_passes.storage_root(n) for n in graph_passes.saved_activations(gm) if n in gathered}
            self.report["saved_gathered_bytes"] = sum(graph_passes.tensor_bytes(r) for r in roots)
        return gm

    def args(self, batch, lr):
        """The step function's inputs: (params, buffers, AdamW moments, step, lr, *batch)."""
        opt = self.opt
        return ([p.detach() for p in opt.params], list(self.model.buffers()), opt.state["exp_avg"],
                opt.state["exp_avg_sq"], dev.scalar(opt.step_count + 1, self.device), lr, *batch)

    def __call__(self, *batch_and_lr):
        *batch, lr = batch_and_lr
        args = self.args(batch, lr)
        if self.gm is None:
            self.gm = self.transform(capture(self.step_fn, args))
            run = self.gm if not self.split else graph_passes.SplitStep(self.gm, self.split)
            self.compiled = torch.compile(run, backend="inductor") if self.backend == "inductor" else \
                torch.compile(run, backend="openxla", fullgraph=True) if self.backend == "openxla" else run
        with torch.no_grad():
            new_params, exp_avg, exp_avg_sq, reported, norm = self.compiled(*args)
        self.opt.commit(new_params, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})
        return reported, norm
