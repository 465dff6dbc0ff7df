"""graph_passes.py: transformations of the whole-step graph, each GraphModule -> GraphModule.

The step graph from graph_trainer.py holds forward, backward and optimizer in one FX graph, in
tracing order. A `forward_end` marker node (an identity on the loss) separates forward from the rest,
so "saved activations" are exact: forward values that a node after the marker reads. Then:

  remat        recompute cheap saved values in the backward, right before their first use, instead
               of keeping them alive across the step (policy: save only matmul-like outputs;
               Chen et al., arXiv 1604.06174; torchtitan's selective activation checkpointing).
  offload      move saved values to host memory after their forward use and back before their
               backward use (TPU/XLA: torch_xla's place_to_host / place_to_device annotations;
               CUDA: copies to and from CPU; CPU: a copy standing in for the transfer).
  split        cut the graph into stages run in order (torch.fx split_module), so each compile unit
               stays small and memory can be moved between stages.
Every pass leaves the numerics unchanged; tests check each against the untransformed graph.
"""
import torch
import torch.utils._pytree as pytree
from torch.fx.passes.split_module import split_module

import device as dev

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------
# Marker and transfer ops

@torch.library.custom_op("minititan::forward_end", mutates_args=())
def forward_end(loss: torch.Tensor) -> torch.Tensor:
    """Identity on the loss; its node marks where the forward ends in the traced step."""
    return loss.clone()


forward_end.register_fake(lambda loss: torch.empty_like(loss))
forward_end.register_autograd(lambda ctx, grad: grad)


@torch.library.custom_op("minititan::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    if dev.is_xla(x.device) and dev.is_tpu(x.device):  # memory-space annotation; XLA:CPU has no host memory space (it crashes)
        from torch_xla.experimental.stablehlo_custom_call import place_to_host
        return place_to_host(x)
    return x.to("cpu", copy=True) if x.is_cuda else x.clone()  # CPU, XLA:CPU: a copy stands in


@torch.library.custom_op("minititan::reload", mutates_args=())
def reload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    if dev.is_xla(device) and dev.is_tpu(device):
        from torch_xla.experimental.stablehlo_custom_call import place_to_device
        return place_to_device(x)
    return x.to(device, copy=True) if x.device != torch.device(device) else x.clone()


offload.register_fake(lambda x: torch.empty_like(x, device="cpu") if x.device.type == "cuda" else torch.empty_like(x))
reload.register_fake(lambda x, device: torch.empty_like(x, device=device))


# ------------------------------------------------------------------------------------------------
# Analysis

def forward_end_index(gm):
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.minititan.forward_end.default:
            return i
    raise ValueError("graph has no forward_end marker: was it traced by graph_trainer.capture?")


def storage_root(node):
    """The node whose value owns the storage `node`'s value lives in: follow views and aliases (ops
    whose schema says the output aliases the first input, without writing it) to their base."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        alias = returns[0].alias_info if returns else None
        if alias is None or alias.is_write or not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node = node.args[0]
    return node


def saved_activations(gm):
    """Forward values read after the forward ends: what the step keeps alive beyond its inputs
    (not inputs, nor views of them: the parameters' storage is there anyway)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    end = forward_end_index(gm)
    return [n for n in gm.graph.nodes if n.op == "call_function" and order[n] < end
            and n.target != torch.ops.minititan.offload.default  # those live in host memory
            and isinstance(n.meta.get("val"), torch.Tensor) and any(order[u] > end for u in n.users)
            and storage_root(n).op != "placeholder"]


def tensor_bytes(node):
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def saved_bytes(gm):
    """Device bytes kept alive from forward to backward: each storage once (a value and its views
    are one allocation)."""
    return sum(tensor_bytes(root) for root in {storage_root(n) for n in saved_activations(gm)})


def peak_live_bytes(gm, args, until=None):
    """Run `gm` on real `args` node by node (torch.fx.Interpreter frees each value after its last
    use) and return the peak bytes of intermediate tensors alive at once (inputs not counted),
    over the nodes before `until(node)` first holds. A measurement, not an estimate from metadata."""
    inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}

    class Live(torch.fx.Interpreter):
        peak, stopped = 0, False

        def run_node(self, node):
            out = super().run_node(node)
            if until is not None and not self.stopped and until(node):
                self.stopped = True
            if not self.stopped:
                live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for v in list(self.env.values()) + [out] for t in pytree.tree_leaves(v)
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs}
                self.peak = max(self.peak, sum(live.values()))
            return out

    interp = Live(gm)
    with torch.no_grad():
        interp.run(*pytree.tree_leaves(args))
    return interp.peak


def host_bytes(gm):
    return sum(tensor_bytes(n) for n in gm.graph.nodes if n.target == torch.ops.minititan.offload.default)


# ------------------------------------------------------------------------------------------------
# remat

_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default,
              aten._scaled_dot_product_efficient_attention.default,
              aten._scaled_dot_product_flash_attention.default}


def _namespace(node):
    return getattr(node.target, "namespace", None)


# The remat policy, one row per reason to SAVE a forward value the backward reads. Everything else
# (elementwise math, norms, casts, views: cheap, and often the largest tensors) is recomputed.
SAVE_POLICY = [
    ("matmul: the FLOPs remat must not pay twice", lambda n: n.target in _MATMULS),
    ("attention: quadratic work", lambda n: n.target in _ATTENTION),
    ("our ops (Pallas kernels, markers, transfers): opaque cost", lambda n: _namespace(n) == "minititan"),
    ("collectives: a replay would communicate again", lambda n: _namespace(n) == "_c10d_functional"),
    ("random ops: a replay would draw other numbers",
     lambda n: torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())),
    ("in-place ops: a replay would mutate twice",
     lambda n: getattr(getattr(n.target, "_schema", None), "is_mutable", False)),
]


def _keep(node):
    """Saved (not recomputed) under the policy; graph inputs and non-op nodes are always kept."""
    return node.op != "call_function" or any(test(node) for _, test in SAVE_POLICY)


def remat_recomputes(node):
    """The remat policy as a predicate: not saved under SAVE_POLICY."""
    return not _keep(node)


def remat(gm):
    """Recompute every saved value the policy does not keep, just before its first backward use."""
    return recompute_in_backward(gm, remat_recomputes)


def recompute_in_backward(gm, recompute):
    """For every forward value the backward reads: if recompute(node), replay it (and the recomputable
    values it needs) right before its first backward use, instead of keeping it alive across the step."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    end = forward_end_index(gm)
    graph, copies = gm.graph, {}

    def copy_of(node, before):
        if node.op != "call_function" or order.get(node, end) >= end or not recompute(node):
            return node
        if node not in copies:
            args = pytree.tree_map_only(torch.fx.Node, lambda a: copy_of(a, before), (node.args, node.kwargs))
            with graph.inserting_before(before):
                copies[node] = graph.call_function(node.target, *args)
            copies[node].meta = dict(node.meta)
        return copies[node]

    for node in [n for n in graph.nodes if order[n] > end]:
        node.args, node.kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: copy_of(a, node),
                                                      (node.args, node.kwargs))
    graph.lint()
    gm.recompile()
    return gm


# ------------------------------------------------------------------------------------------------
# host offload

def offload_saved(gm, min_bytes=1 << 16):
    """Offload every saved activation of at least `min_bytes` between its forward and backward use."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    end = forward_end_index(gm)
    graph = gm.graph
    for node in saved_activations(gm):
        if tensor_bytes(node) < min_bytes:
            continue
        late = sorted((u for u in node.users if order[u] > end), key=order.get)
        with graph.inserting_after(node):
            host = graph.call_function(torch.ops.minititan.offload.default, (node,))
        with graph.inserting_before(late[0]):
            back = graph.call_function(torch.ops.minititan.reload.default, (host, node.meta["val"].device))
        host.meta["val"], back.meta["val"] = node.meta["val"], node.meta["val"]
        for user in late:
            user.replace_input_with(node, back)
    graph.lint()
    gm.recompile()
    return gm


def transfer_counts(gm):
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return names.count("minititan.offload.default"), names.count("minititan.reload.default")


# ------------------------------------------------------------------------------------------------
# splitter

class SplitStep:
    """The step graph cut into `stages` contiguous pieces (topological order, so every edge points
    forward), each a GraphModule run in turn; called like the original (pytree in, pytree out)."""

    def __init__(self, gm, stages):
        self.out_spec = gm.graph._codegen.pytree_info.out_spec
        flat = torch.fx.GraphModule(gm, _flat_graph(gm))
        calls = [n for n in flat.graph.nodes if n.op == "call_function"]
        stage_of = {n: min(stages - 1, i * stages // max(1, len(calls))) for i, n in enumerate(calls)}
        self.split = split_module(flat, None, lambda n: stage_of[n], keep_original_order=True)
        self.stages = [m for name, m in self.split.named_children() if name.startswith("submod_")]

    def __call__(self, *args):
        out = self.split(*pytree.tree_flatten(args)[0])
        return pytree.tree_unflatten(list(out), self.out_spec)


def _flat_graph(gm):
    """A copy of gm's graph with plain (flat) positional inputs and a flat tuple output."""
    graph, env = torch.fx.Graph(), {}
    graph.graph_copy(gm.graph, env)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = pytree.tree_flatten(out.args[0])[0]
    graph.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in flat_out))
    return graph
