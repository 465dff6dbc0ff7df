"""layer_scan.py: the repeated blocks as ONE scan over stacked layer weights.

A 126-layer model traced layer by layer gives a graph (and a compiled program) 126 times the size of
one layer, and compile time grows with it. JAX's answer is lax.scan over weights stacked on a leading
layer axis; torch_xla's is torch_xla.experimental.scan_layers. Ours, for the traced step graph:

  stack_layers(model)      replaces model.layers (or each stack the family names: ModelFamily.scan_stacks) by
                           a StackedLayers holding, for every block parameter name, one (L, ...)
                           parameter; the model's run_layers() calls it. A block maps (h, cos, sin)
                           -> (h, aux): one carried tensor, two constants without gradients.
  minititan::scan_layers   one custom op: forward loops over the layers, keeping each layer's input
                           (the scan carry, (L, B, S, D)) for the backward;
  ..._scan_layers_bwd      the backward op: walks the layers in reverse, replaying one block's
                           forward + vjp, traced once by make_fx, from each saved input (per-layer
                           remat, like JAX's scan + checkpoint), stacking the weight gradients.

How control flows (one stacked block registered once as a `ScannedBlock`, found by id, since
custom ops take tensors and ints, not modules):

    StackedLayers.forward(h)
      |-- trace_block_vjp: make_fx of ONE block's forward + vjp, once per shape  -> ScannedBlock.vjps
      `-- scan_layers(h, stacked)            forward: for i in 0..L-1: h = block(h, w[i]); keep h_i
              |  autograd (eager) or make_fx (graph mode) records one node; saves carries (L, B, S, D)
              v
          scan_layers_bwd(carries, stacked, grad_h)   backward: for i in L-1..0:
                                                      grad_h, grad_w[i] = vjp(carries[i], w[i], grad_h)

Under make_fx each op is one node, so the step graph has the same size at 2 or 200 layers. We write
our own ops rather than use torch's scan higher-order op so that one code path serves eager, make_fx
and XLA (torch's scan was not evaluated here). On XLA the two ops' kernels build XLA While loops
instead of Python loops (torch_xla's scan core, torch_xla/experimental/scan.py, without its
AOTAutograd layer: our backward op is the vjp), so the compiled program, not only the FX graph,
stays one block long: the same path in eager XLA (autograd calls the backward op) and graph mode.
Under torchax (the step compiled for a TPU pod, tpu_pod/step_compile.py) the two ops are jax.lax.scan over
the stacked weights, the body the block's own traced graph (register_torchax).
Limits: static shapes only (MoE needs the Pallas gmm). Under a SimpleFSDP --mesh the (L, ...)
weights are sharded after the layer axis and each iteration gathers its own layer (the kernels call
simplefsdp.LayerGather: forward gathers, backward re-gathers and reduce-scatters, one layer ahead);
under GSPMD (spmd.py) the same sharding puts XLA's all-gather inside the While body. Under ep the
stack's one block routes every layer's rows (expert_parallel.AllToAll, set on it by the family), and
each rank holds and gathers only its experts of each layer (simplefsdp.ExpertStackGather). FSDP2
treats the stack as one unit and gathers it whole.
"""
import contextlib
import copy
import dataclasses

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx

import device as dev

@dataclasses.dataclass
class ScannedBlock:
    """All the two ops need of a stacked block, registered under an id."""
    template: nn.Module  # one block on the meta device: its code and shapes (weights come stacked)
    names: list          # its parameter names, in the order of the stacked list
    vjps: dict = dataclasses.field(default_factory=dict)  # (shape, dtype, device) -> traced fwd + vjp
    forwards: dict = dataclasses.field(default_factory=dict)  # the same -> traced forward (register_torchax)
    fsdp: object = None  # under SimpleFSDP: the stack holds shards; a simplefsdp.LayerGather gathers a layer


_BLOCKS = {}  # block id -> ScannedBlock


def _block_call(block_id, params, h, cos, sin):
    block = _BLOCKS[block_id]
    h, aux = torch.func.functional_call(block.template, dict(zip(block.names, params)), (h, cos, sin))
    return h, aux.float()


def _layers(block_id, stacked, order):
    """(i, layer i's full weights) in `order`. Under SimpleFSDP each layer is gathered as it comes, the
    next one's all-gather issued before this one is used (prefetch). The weights come in a list that
    is emptied when the caller asks for the next layer, so a used layer is freed before the next is
    unpacked: at most the layer in use and the next one's in-flight buffer are alive."""
    fsdp, order = _BLOCKS[block_id].fsdp, list(order)
    if fsdp is None:
        yield from ((i, [w[i] for w in stacked]) for i in order)
        return
    pending = fsdp.gather_start([w[order[0]] for w in stacked])
    for k, i in enumerate(order):
        weights = fsdp.gather_wait(pending)
        pending = fsdp.gather_start([w[order[k + 1]] for w in stacked]) if k + 1 < len(order) else None
        yield i, weights
        weights.clear()  # (the caller holds no other reference: kernels pass the list on and return)


def _xla_while(body, init, xs, reverse=False):
    """One XLA While loop over the leading axis of xs: body(carry, x_i) -> (carry, y_i) is traced
    once on placeholder tensors into the loop body; ys are stacked at index i (also when reverse).
    _scan_impl_pytree is private API of torch_xla 2.9 (pinned); its public scan() would re-derive
    the backward with AOTAutograd, which cannot run inside a custom op's kernel."""
    from torch_xla.experimental.scan import _scan_impl_pytree
    return _scan_impl_pytree(body, init, xs, reverse=reverse)


@torch.library.custom_op("minititan::scan_layers", mutates_args=())
def scan_layers(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stacked: list[torch.Tensor],
                block_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dev.is_xla(h.device):  # (XLA meshes are GSPMD's, spmd.py: no SimpleFSDP stack here)
        def body(carry, weights):
            h, aux = carry
            out, layer_aux = _block_call(block_id, list(weights), h, cos, sin)
            return (out, aux + layer_aux), h
        (h, aux), carries = _xla_while(body, (h, h.new_zeros((), dtype=torch.float32)), tuple(stacked))
        return h, aux, carries
    carries, aux = [], h.new_zeros((), dtype=torch.float32)
    for i, weights in _layers(block_id, stacked, range(stacked[0].shape[0])):
        carries.append(h)
        h, layer_aux = _block_call(block_id, weights, h, cos, sin)
        aux = aux + layer_aux
    return h.clone(), aux, torch.stack(carries)


@scan_layers.register_fake
def _(h, cos, sin, stacked, block_id):
    return torch.empty_like(h), h.new_empty((), dtype=torch.float32), h.new_empty((stacked[0].shape[0], *h.shape))


def _examples_like(h):
    """Where a block's trace makes its example tensors: real empty ones in a run, fake ones when the
    step is captured on fake tensors (step_compile: a published run's global (B, S, D) is 100+ GB)."""
    return FakeTensorMode() if is_fake(h) else contextlib.nullcontext()


def _vjp_key(h):
    return tuple(h.shape), h.dtype, str(h.device)


def trace_block_vjp(block_id, h, cos, sin, stacked):
    """Trace one block's forward + backward, (h, cos, sin, params, grad_h, grad_aux) -> grads, into a
    GraphModule, once per shape/device. The backward op replays it per layer: no autograd is needed
    inside the op's kernel (where the dispatcher has switched autograd off), the same on every device."""
    vjps = _BLOCKS[block_id].vjps
    if _vjp_key(h) in vjps:
        return

    def block_vjp(h, cos, sin, params, grad_h, grad_aux):
        with torch.enable_grad():
            leaves = [h.detach().requires_grad_()] + [p.detach().requires_grad_() for p in params]
            out, aux = _block_call(block_id, leaves[1:], leaves[0], cos, sin)
            outs, cots = ((out, aux), (grad_h, grad_aux)) if aux.requires_grad else ((out,), (grad_h,))
            return list(torch.autograd.grad(outs, leaves, cots))  # (dense blocks have a constant aux)

    with disable_proxy_modes_tracing(), unset_fake_temporarily(), _examples_like(h):  # also during a capture
        empty = lambda t: torch.empty(t.shape, dtype=t.dtype, device=t.device)
        fsdp, shapes = _BLOCKS[block_id].fsdp, [w.shape[1:] for w in stacked]
        if fsdp is not None:  # the vjp sees gathered weights, in the compute dtype
            shapes = fsdp.full_shapes(shapes)
        dtype = lambda w: fsdp.param_dtype if fsdp is not None and fsdp.param_dtype else w.dtype
        layer = [torch.empty(shape, dtype=dtype(w), device=w.device) for shape, w in zip(shapes, stacked)]
        example = (empty(h), empty(cos), empty(sin), layer, empty(h),
                   torch.empty((), dtype=torch.float32, device=h.device))
        vjps[_vjp_key(h)] = make_fx(block_vjp, tracing_mode="fake")(*example)


@torch.library.custom_op("minititan::scan_layers_bwd", mutates_args=())
def scan_layers_bwd(carries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stacked: list[torch.Tensor],
                    grad_h: torch.Tensor, grad_aux: torch.Tensor, block_id: int) -> list[torch.Tensor]:
    block_vjp = _BLOCKS[block_id].vjps[_vjp_key(carries[0])]
    if dev.is_xla(carries.device):
        def body(grad_h, saved):
            h, weights = saved
            grad_h, *grad_params = block_vjp(h, cos, sin, list(weights), grad_h, grad_aux)
            return grad_h, tuple(grad_params)
        grad_h, grads = _xla_while(body, grad_h, (carries, tuple(stacked)), reverse=True)
        return [grad_h, *grads]
    # (On XLA writes into a buffer inside this op were lost: the While path above returns stacked ys.)
    fsdp, reducing, grads = _BLOCKS[block_id].fsdp, None, [torch.empty_like(w) for w in stacked]
    for i, weights in _layers(block_id, stacked, reversed(range(stacked[0].shape[0]))):
        # recompute layer i from its saved input, pull back
        grad_h, *grad_params = block_vjp(carries[i], cos, sin, weights, grad_h, grad_aux)
        if fsdp is None:
            for g, layer_g in zip(grads, grad_params):
                g[i] = layer_g
            continue
        if reducing is not None:  # SimpleFSDP: layer i+1's reduce-scatter ran during layer i's vjp
            for g, layer_g in zip(grads, fsdp.reduce_wait(reducing, stacked[0].dtype)):
                g[i + 1] = layer_g
        reducing = fsdp.reduce_start(grad_params)
        del grad_params
    if reducing is not None:
        for g, layer_g in zip(grads, fsdp.reduce_wait(reducing, stacked[0].dtype)):
            g[0] = layer_g
    return [grad_h, *grads]


@scan_layers_bwd.register_fake
def _(carries, cos, sin, stacked, grad_h, grad_aux, block_id):
    return [torch.empty_like(grad_h), *[torch.empty_like(w) for w in stacked]]


def _setup(ctx, inputs, output):
    h, cos, sin, stacked, block_id = inputs
    ctx.save_for_backward(output[2], cos, sin, *stacked)
    ctx.block_id = block_id


def _backward(ctx, grad_h, grad_aux, _grad_carries):
    carries, cos, sin, *stacked = ctx.saved_tensors
    grad_aux = grad_aux if grad_aux is not None else carries.new_zeros((), dtype=torch.float32)
    grad_h = grad_h if grad_h is not None else torch.zeros_like(carries[0])
    grad_in, *grad_stacked = scan_layers_bwd(carries, cos, sin, stacked, grad_h, grad_aux, ctx.block_id)
    return grad_in, None, None, grad_stacked, None


scan_layers.register_autograd(_backward, setup_context=_setup)


def trace_block_forward(block_id, h, cos, sin, stacked):
    """Trace one block's forward, (h, cos, sin, params) -> [h, aux], like trace_block_vjp (under the
    caller's autocast and attention backend, once per shape): the scan body of register_torchax's
    forward. Called where the step is captured (step_compile.capture), not by the ops themselves."""
    forwards = _BLOCKS[block_id].forwards
    if _vjp_key(h) in forwards:
        return
    with disable_proxy_modes_tracing(), unset_fake_temporarily(), _examples_like(h):
        empty = lambda t, shape=None: torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device=t.device)
        example = (empty(h), empty(cos), empty(sin), [empty(w, w.shape[1:]) for w in stacked])
        forwards[_vjp_key(h)] = make_fx(lambda h, cos, sin, params: list(_block_call(block_id, params, h, cos, sin)),
                                        tracing_mode="fake")(*example)


def _traced(graphs, shape, dtype):
    """A block's graph traced for carries of `shape` and (torch) `dtype`, on whichever device."""
    return next(g for key, g in graphs.items() if key[:2] == (tuple(shape), dtype))


def register_torchax(on_jax, unroll=1, offload=False):
    """The two ops' JAX forms, for torchax (the TPU compile of the step, tpu_pod/step_compile.py): each a
    `jax.lax.scan` over the stacked weights' layer axis, the scan body one block run by torchax from its
    traced aten graph, so the compiled program has one block in a While loop, as on XLA above.
    Forward: the carry is (h, aux), each layer's input stacked as the carries; backward: a reverse
    scan of the block's vjp (trace_block_vjp) from each saved input, the weight gradients stacked.
    Both block graphs were traced where the step was captured (trace_block_vjp, trace_block_forward);
    `on_jax(gm)` makes a copy of one runnable by torchax (its factory ops' device). `unroll`: layers a
    While iteration runs (XLA's cost model counts a While body once, whatever its trip count:
    step_compile counts a layer's cost from the difference 2 makes). `offload`: each layer's input goes
    to host memory as the forward makes it and comes back as the backward reaches it (MaxText's
    `decoder_layer_input: offload`), so HBM holds one layer's, not L. Registered anew on each call."""
    import jax
    import jax.numpy as jnp
    from torchax.ops import mappings, ops_registry

    def graph(graphs, x):  # (a copy: the eager path runs the vjp graph as traced)
        return on_jax(copy.deepcopy(_traced(graphs, x.shape, mappings.j2t_dtype(x.dtype))))

    def run(gm, env, *args):  # (inside an op's lowering torchax's modes are off: on again for the body)
        enabled = env.enabled
        with env:
            out = env.t2j_iso(gm(*env.j2t_iso(args)))
        env.enabled = enabled
        return out

    def forward(h, cos, sin, stacked, block_id, env):
        gm = graph(_BLOCKS[block_id].forwards, h)

        def body(carry, weights):
            out, aux = run(gm, env, carry[0], cos, sin, list(weights))
            return (out, carry[1] + aux), jax.device_put(carry[0], jax.memory.Space.Host) if offload else carry[0]
        (h, aux), carries = jax.lax.scan(body, (h, jnp.zeros((), jnp.float32)), list(stacked), unroll=unroll)
        return h, aux, carries

    def backward(carries, cos, sin, stacked, grad_h, grad_aux, block_id, env):
        gm = graph(_BLOCKS[block_id].vjps, carries[0])

        def body(grad, saved):  # (behind a barrier, as JAX's checkpoint: an unrolled layer's replay is
            saved = jax.lax.optimization_barrier(saved)  # not merged with its forward by XLA's CSE)
            if offload:
                saved = (jax.device_put(saved[0], jax.memory.Space.Device), saved[1])
            grad, *grad_params = run(gm, env, saved[0], cos, sin, list(saved[1]), grad, grad_aux)
            return grad, grad_params
        grad_h, grads = jax.lax.scan(body, grad_h, (carries, list(stacked)), reverse=True, unroll=unroll)
        return [grad_h, *grads]

    for op, form in ((torch.ops.minititan.scan_layers.default, forward),
                     (torch.ops.minititan.scan_layers_bwd.default, backward)):  # (replaced: no duplicate warning)
        ops_registry.all_aten_ops[op] = ops_registry.Operator(op, form, is_jax_function=True, is_user_defined=True,
                                                              needs_env=True, is_view_op=False)


class StackedLayers(nn.Module):
    """All blocks' weights as (L, ...) parameters named like one block's, dots as '__'."""

    def __init__(self, layers, built=None):
        super().__init__()
        template = copy.deepcopy(layers[0]).to("meta")  # shapes and code only; weights come stacked
        self.names = [n for n, _ in layers[0].named_parameters()]
        for name in self.names:
            stacked = torch.stack([dict(layer.named_parameters())[name].detach() for layer in layers])
            self.register_parameter(self.stacked_name(name), nn.Parameter(stacked))
        # each stacked weight's layer names in the model as built (materialize.seed_names fills it from them)
        self.origins = {self.stacked_name(n): [built[id(dict(layer.named_parameters())[n])] for layer in layers]
                        for n in self.names} if built is not None else None
        self.block_id = len(_BLOCKS)
        _BLOCKS[self.block_id] = ScannedBlock(template, self.names)
        self.n_layers = len(layers)

    def block(self):
        """The one block every layer runs (on meta: code and shapes). A seam set on it (model.MoE's
        route_through) holds for every layer; its parameter `name` is the stack's `stacked_name(name)`."""
        return _BLOCKS[self.block_id].template

    @staticmethod
    def stacked_name(name):
        return name.replace(".", "__")

    def gather_per_layer(self, fsdp):
        """Called by simplefsdp.data_parallel, which sharded this stack: the scan gathers per layer."""
        _BLOCKS[self.block_id].fsdp = fsdp

    def forward(self, h, cos, sin):
        stacked = [getattr(self, self.stacked_name(n)) for n in self.names]
        if _BLOCKS[self.block_id].fsdp is not None:  # the ops get local shards; their gradients come
            stacked = [p.to_local(grad_placements=p.placements) for p in stacked]  # back reduced
        trace_block_vjp(self.block_id, h, cos, sin, stacked)
        out, aux, _ = scan_layers(h, cos, sin, stacked, self.block_id)
        return out, aux

    def __len__(self):
        return self.n_layers


def stack_layers(model, stacks=None, built=None):
    """Swap each stack, (owner module, attribute) of a ModuleList of identical blocks (default: the
    model's `layers`), for one StackedLayers, in place. `built`: {id(parameter): name} of the model as
    built (materialize.built_names), recorded per stacked weight so the seed fill can find its layers."""
    for owner, name in stacks or [(model, "layers")]:
        setattr(owner, name, StackedLayers(list(getattr(owner, name)), built))
    return model


@torch.no_grad()
def unstack_into(stacked_pairs, plain_pairs):
    """Copy the weights of stacks (StackedLayers, at each (owner, attribute) of `stacked_pairs`) into the
    blocks of a model prepared the same way but not stacked (`plain_pairs`): layer i of every stacked
    parameter into block i's parameter of the same name. How a run trained with --scan is loaded as a
    plain model (checkpoint.load_run)."""
    for (owner_s, attr_s), (owner_p, attr_p) in zip(stacked_pairs, plain_pairs):
        stack, blocks = getattr(owner_s, attr_s), getattr(owner_p, attr_p)
        for i, block in enumerate(blocks):
            for name in stack.names:
                block.get_parameter(name).copy_(getattr(stack, stack.stacked_name(name))[i])
