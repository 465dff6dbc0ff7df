"""tpu_pod/compile_graph.py: the captured step graph made ready for torchax and XLA's SPMD partitioner.

tpu_pod/step_compile.py captures the training step as one aten graph (make_fx, fake tensors) and has torchax
run it on JAX tracers. Between the two, the graph needs what a GSPMD program needs and the trainer's
graph does not say: where values must stay split, and what XLA must not merge. Each is a small
custom op, an identity in PyTorch, lowered to one JAX primitive (register_torchax):

  barrier      the saved activations, read by the backward through jax.lax.optimization_barrier
               (behind_barrier), as JAX's checkpoint reads its residuals;
  over_batch   a (tokens, width) activation kept split over the data-parallel devices by its rows
               (rows_over_batch), and under tp an attention matmul's (batch x heads, ., .) operands
               over those and tp (batched_matmuls_over_batch): jax.lax.with_sharding_constraint;
  like_param   a weight, as the forward reads it, and its gradient, as autograd makes it, kept in the
               parameter's own sharding (GradsLikeParams): with_sharding_constraint.

and what torchax 0.0.7 lacks: the `_foreach_*` ops unfolded tensor by tensor, no device named
(for_torchax, on_jax). The reference attention and loss reach XLA in the forms JAX writes
(JAX_FORMS: safe_softmax, softmax_backward, nll_loss_backward): torch's decompositions of the same
ops cost the attention three more S x S buffers than JAX's softmax, and the loss's gradient a
scattered one-hot the logits' size (tests/check_step_compile.py compiles both ways against JAX's
own). The shardings are the compile in progress's (use).
"""
import operator

import torch
from torch._decomp import decomposition_table
from torch.fx.experimental.proxy_tensor import make_fx

import graph_passes
from parallel import Parallel


@torch.library.custom_op("minititan_compile::barrier", mutates_args=())
def barrier(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Identity on the saved activations (jax.lax.optimization_barrier once lowered)."""
    return [x.clone() for x in xs]


barrier.register_fake(lambda xs: [torch.empty_like(x) for x in xs])


def behind_barrier(gm):
    """The backward reads the saved activations through one optimization barrier. Without it XLA's
    common-subexpression pass merges each recomputed op with its forward twin (the same op on the same
    values): the remat pass's recompute vanished (the compiler counted the same FLOPs and temporaries
    with --remat as without). JAX's checkpoint puts its residuals behind the same barrier."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    end = graph_passes.forward_end_index(gm)
    saved = graph_passes.saved_activations(gm)
    marker = list(gm.graph.nodes)[end]
    with gm.graph.inserting_after(marker):
        fenced = gm.graph.call_function(torch.ops.minititan_compile.barrier.default, (saved,))
    with gm.graph.inserting_after(fenced):
        behind = [gm.graph.call_function(operator.getitem, (fenced, i)) for i in range(len(saved))]
    for value, after in zip(saved, behind):
        value.replace_all_uses_with(after, delete_user_cb=lambda user: order.get(user, -1) > end)
    gm.graph.lint()
    gm.recompile()
    return gm


# each _foreach_ op's one-tensor form (optim.py uses these)
PER_TENSOR = {"lerp": torch.lerp, "mul": torch.mul, "div": torch.div, "add": torch.add, "sqrt": torch.sqrt,
              "addcmul": lambda s, a, b, value=1: torch.addcmul(s, a, b, value=value),
              "norm": lambda t, ord=2, dtype=None: torch.linalg.vector_norm(t, ord, dtype=dtype)}


def _unfolded(op):
    one = PER_TENSOR[op._schema.name.split("::_foreach_")[1]]

    def per_tensor(*args, **kw):
        n = next(len(a) for a in args if isinstance(a, (list, tuple)))
        return [one(*(a[i] if isinstance(a, (list, tuple)) else a for a in args), **kw) for i in range(n)]
    return per_tensor


@torch.library.custom_op("minititan_compile::over_batch", mutates_args=())
def over_batch(x: torch.Tensor) -> torch.Tensor:
    """Identity; lowered, a sharding constraint: dim 0 split over the data-parallel devices."""
    return x.clone()


over_batch.register_fake(lambda x: torch.empty_like(x))
_ROWS_SHARDING = {}  # (the lowering's shardings by rank, 2: rows, 3: a batched matmul's; the compile in progress's)


@torch.library.custom_op("minititan_compile::like_param", mutates_args=())
def like_param(grad: torch.Tensor, index: int) -> torch.Tensor:
    """Identity; lowered, a sharding constraint: parameter `index`'s layout."""
    return grad.clone()


like_param.register_fake(lambda grad, index: torch.empty_like(grad))
_PARAM_SHARDINGS = []  # (the lowering's: the parameters' shardings in the compile in progress)


class _GradLikeParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, index):
        ctx.index = index
        return torch.ops.minititan_compile.like_param(weight, index)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.minititan_compile.like_param(grad, ctx.index), None


class GradsLikeParams(Parallel):
    """The compile's layout hook into graph_trainer.build_step_fn (its `parallel.like`, the weights the
    forward reads): each weight, as the forward reads it (cast to bf16 under --dtype bf16), and its
    gradient, where autograd makes it, are constrained to the parameter's sharding. Without it GSPMD
    gathered the embedding and head before the cast, in fp32, and made the embedding's gradient, a
    scatter-add over the batch's tokens, whole on every device (Qwen3-8B: fp32 (151936, 4096)
    buffers, 2.3 GiB each a device) before cutting out each device's shard."""
    @staticmethod
    def like(shards, params):
        return [_GradLikeParam.apply(s, i) for i, s in enumerate(shards)]

    @staticmethod
    def after_microbatch(grads_sum, micro):
        """--grad-accum: the next microbatch through one optimization barrier with the gradients' running
        sum, so that its forward starts after the previous backward is done. Without it XLA scheduled
        the unrolled microbatches' forwards together: llama3_debug at 32 x 256 on 4 devices in 4
        microbatches held more temporaries (152 MB) than the whole batch in one pass (141 MB)."""
        out = torch.ops.minititan_compile.barrier.default([*grads_sum, *micro])
        return tuple(out[len(grads_sum):])


def rows_over_batch(gm, tokens, param_shapes):
    """Every (tokens, width) activation, the batch's tokens flattened into rows (the loss's hidden
    states, logits and their gradients), stays split over the data-parallel devices by its rows.
    XLA's propagation alone let a Qwen3-8B step on 256 chips hold its (B x S, vocabulary) logits split
    far fewer ways than 256 (a 32-bit DMA bound refused the buffer). Constraining every batch-major
    activation instead raised a 4096-wide block's temporaries by 31%: only these. A node of a weight's
    shape is left out (its gradient's layout is the weight's), unless it is a projection of rows, a
    matmul whose first operand is not a transpose (a weight's gradient contracts the tokens: x^T dy);
    a transpose is left out (its rows are its input's columns). Both matter where the tokens equal
    the vocabulary: the MLP's output then has the embedding's shape, the logits' transpose the tokens'
    rows (a tp step computed the down projection, then the head's gradient, on every token: FLOPs 1.07x)."""
    transpose = lambda n: getattr(n, "target", None) in (torch.ops.aten.t.default, torch.ops.aten.permute.default,
                                                         torch.ops.aten.transpose.int)
    projection = lambda n: n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and not transpose(n.args[-2])
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() != 2 or transpose(node) \
                or val.shape[0] != tokens or (tuple(val.shape) in param_shapes and not projection(node)):
            continue
        with gm.graph.inserting_after(node):
            kept = gm.graph.call_function(torch.ops.minititan_compile.over_batch.default, (node,))
        node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
    gm.recompile()
    return gm


def batched_matmuls_over_batch(gm):
    """Every batched matmul (aten.bmm: the attention's, batch and heads flattened into dim 0, the batch
    major), its operands and its result, split on that dim over the data-parallel devices and tp, in
    that order: a device's rows are its sequences' tp share of the heads. Under tp XLA's propagation
    lost the heads' split through that flatten, and each device computed every head's scores
    (llama3_debug at tp=2: FLOPs 1.24x flops_per_step, 1.02x without tp)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.bmm.default:
            continue
        with gm.graph.inserting_before(node):
            node.args = tuple(gm.graph.call_function(torch.ops.minititan_compile.over_batch.default, (a,)) for a in node.args)
        with gm.graph.inserting_after(node):
            kept = gm.graph.call_function(torch.ops.minititan_compile.over_batch.default, (node,))
        node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
    gm.recompile()
    return gm


def safe_softmax(x, dim, dtype=None):
    """aten._safe_softmax (SDPA's math form: a softmax that is 0 on a row of all -inf, a fully masked
    query) with one row max. A row is all -inf exactly when its max is -inf, and the softmax needs that
    max anyway; torch's decomposition tests every element instead (eq, then all), which XLA compiles
    to a second pass over the S x S scores and a third S x S buffer (the compiler's buffers: scores,
    exponentials, probabilities, where JAX's softmax writes one)."""
    x = x.to(dtype) if dtype is not None else x
    row_max = x.amax(dim, keepdim=True)
    empty = row_max == float("-inf")
    exps = torch.exp(x - torch.where(empty, 0.0, row_max))  # (an empty row: exp(-inf) = 0 everywhere)
    return torch.where(empty, 0.0, exps / exps.sum(dim, keepdim=True))


def softmax_backward(grad, out, dim, input_dtype):
    """aten._softmax_backward_data as JAX differentiates its softmax, out * (grad - sum(grad * out)):
    torch's decomposition, grad * out - out * sum(grad * out), reads the product twice, so XLA writes
    it out as one more S x S buffer; in this form the product is summed where it is made."""
    return (out * (grad - (grad * out).sum(dim, keepdim=True))).to(input_dtype)


def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """aten.nll_loss_backward as torch decomposes it, but its one-hot compares the targets with the
    class index (an iota, which XLA fuses into the matmuls that read the gradient) where torch's
    scatters -1 into zeros the logits' size: a buffer of the logits' size, made apart."""
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == 1:  # (Reduction.MEAN)
        grad_output = grad_output / total_weight
    target = target.unsqueeze(channel_dim)
    classes = torch.arange(self.shape[channel_dim], device=self.device)  # (C,): the last dim, (C,) or (N, C)
    grad_input = torch.where(classes == torch.where(target != ignore_index, target, 0), -1.0, 0.0).to(self.dtype)
    if grad_input.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        grad_output = grad_output * weight.reshape([weight.shape[0] if d == channel_dim else 1 for d in range(self.dim())])
    return grad_input * torch.where(target != ignore_index, grad_output, 0)


def for_torchax(gm, example):
    """The graph as torchax can run it: `_foreach_*` ops unfolded (a retrace), the forward-end marker
    (an identity) dropped, and no device named (the graph was traced on CPU; torchax's is JAX's)."""
    table = {n.target: _unfolded(n.target) for n in gm.graph.nodes
             if n.op == "call_function" and "aten._foreach_" in str(n.target)}
    gm = make_fx(gm, decomposition_table=table, tracing_mode="fake")(*example)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.minititan.forward_end.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    return on_jax(gm)


JAX_FORMS = {torch.ops.aten._safe_softmax.default: safe_softmax,
             torch.ops.aten._softmax_backward_data.default: softmax_backward,
             torch.ops.aten.nll_loss_backward.default: nll_loss_backward,
             # LayerNorm's backward (FLUX) as torch's decomposition: torchax 0.0.7's lowering takes 6
             # arguments where aten passes 8
             torch.ops.aten.native_layer_norm_backward.default:
                 decomposition_table[torch.ops.aten.native_layer_norm_backward.default]}


def on_jax(gm):
    """A graph traced on CPU made runnable by torchax: a cast keeps its tensor's place, a factory op
    makes a JAX array, the reference softmax and loss run in JAX's forms (JAX_FORMS: torchax runs
    their torch ops); also --scan's block graphs (layer_scan.register_torchax)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in JAX_FORMS:
            node.target = JAX_FORMS[node.target]
        if node.op == "call_function" and "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": None if node.target == torch.ops.aten._to_copy.default else "jax"}
    gm.recompile()
    return gm


def use(rows_sharding, param_shardings, batched_sharding=None):
    """The shardings the next lowering's constraints name: the batch's rows, each parameter's, and the
    batched matmuls' (batched_matmuls_over_batch)."""
    _ROWS_SHARDING.clear()
    _ROWS_SHARDING.update({2: rows_sharding, 3: batched_sharding})
    _PARAM_SHARDINGS[:] = param_shardings


def register_torchax():
    """The three custom ops' lowerings (barrier, over_batch, like_param), for torchax (once a process:
    torchax 0.0.7's override_op_definition is broken)."""
    import jax
    from torchax.ops import ops_registry
    ops = torch.ops.minititan_compile
    if ops.barrier.default in ops_registry.all_aten_ops:
        return
    ops_registry.register_torch_dispatch_op(ops.barrier.default, lambda xs: list(jax.lax.optimization_barrier(list(xs))))
    ops_registry.register_torch_dispatch_op(ops.over_batch.default,
                                            lambda x: jax.lax.with_sharding_constraint(x, _ROWS_SHARDING[x.ndim]))
    ops_registry.register_torch_dispatch_op(ops.like_param.default,
                                            lambda g, i: jax.lax.with_sharding_constraint(g, _PARAM_SHARDINGS[i]))
