"""simplefsdp.py: FSDP as a DTensor parametrization (SimpleFSDP, Zhang et al., arXiv 2411.00284).

Each parameter is stored as a DTensor shard: Shard(0) over the `ici` mesh dim (and Replicate() over
`dcn` for HSDP). Reading `module.weight` does not return that shard: a per-module subclass defines
`weight` as a property that redistributes the shard to Replicate(), an all-gather, and hands the
full local tensor to the module's ordinary forward. Its backward is the transpose of an all-gather,
a reduce-scatter (plus, for HSDP, an all-reduce over dcn): we declare the gradient of the full
tensor Partial("avg") and DTensor's redistribute does the rest.

Nothing here is a hook or a side effect: the collectives are ordinary autograd ops, so make_fx and
torch.compile see `all_gather_into_tensor`, `reduce_scatter_tensor` and `wait_tensor` as nodes of
the traced graph and can schedule and overlap them. state_dict() reads the stored parameters, so
it stays sharded (torch.distributed.checkpoint saves each rank's shard). Mixed precision: the
all-gather and compute run in param_dtype, gradients are reduced in fp32.

Composed with the other layouts (mesh.py): under tensor parallelism a weight is 2-D, (Shard over the
data-parallel dims, its TP placement over tp) on different dims, and only the data-parallel dims
are gathered; an expert-parallel MoE's (E, ...) weights are (Shard(1) over the remaining
data-parallel ranks, Shard(0) over ep), each rank gathering only its own experts.

A --scan stack (layer_scan.py) is the exception: its (L, ...) weights are sharded on a dim after
the layer axis, so that each layer's slice is itself a shard, and the scan gathers ONE layer per
iteration (`LayerGather`: one bucketed all-gather per layer, issued a layer ahead; in the backward
one re-gather and one reduce-scatter per layer). Memory holds two gathered layers, not the stack.
Under ep a stack's expert weights (L, E, ...) are placed as an MoE's are, on E over ep, and gathered
per layer over the experts' own FSDP ranks (ExpertStackGather).
"""
import dataclasses
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from layer_scan import StackedLayers

c10d = torch.ops._c10d_functional

_ACTIVE = [True]


@contextmanager
def parametrization_off():
    """Read the stored shards themselves (for initialization and checkpoint loading)."""
    _ACTIVE[0] = False
    try:
        yield
    finally:
        _ACTIVE[0] = True


def replicate_compute(param, param_dtype=None, tp_mesh=None, planned=False):
    """Shard -> full tensor for compute. Forward: all-gather (ici). Backward: reduce-scatter of the
    averaged gradient (ici) and all-reduce (dcn). Under tensor parallelism the last mesh dim is tp:
    only the data-parallel dims are gathered, and a TP-planned weight is handed on as a DTensor on
    the tp mesh (its TP placement kept), the form tensor_parallel.py's module hooks expect. A weight
    outside the TP plan is the same on every tp rank, and so is its gradient: a plain tensor."""
    n_dp = len(param.placements) - (tp_mesh is not None)
    tp = list(param.placements[n_dp:])
    full = param.redistribute(placements=[Replicate()] * n_dp + tp,
                              forward_dtype=param_dtype, backward_dtype=torch.float32)
    local = full.to_local(grad_placements=[Partial("avg")] * n_dp + tp)
    if not planned:
        return local
    return DTensor.from_local(local, tp_mesh, tp, run_check=False, shape=full.shape, stride=full.stride())


def _property(name, param_dtype, tp_mesh, planned):
    def get(self):
        p = self._parameters[name]
        return replicate_compute(p, param_dtype, tp_mesh, planned) if _ACTIVE[0] else p
    return property(get)


def _placements(p, dp_ndim, tp_mesh):
    """(full tensor, placements): Shard over the last dp dim (Replicate over dcn), on a dim other than
    the TP shard dim, so the 2-D layout is two plain splits of different dims."""
    if tp_mesh is None:
        return p.data, [Replicate()] * (dp_ndim - 1) + [Shard(0)]
    tp = p.placements[0] if isinstance(p, DTensor) else Replicate()
    fsdp_dim = 1 if tp == Shard(0) else 0
    if p.is_meta:  # (built on the meta device: a whole-shaped meta tensor, no gather)
        full = torch.empty(p.shape, dtype=p.dtype, device="meta")
    else:
        full = p.data.full_tensor() if isinstance(p, DTensor) else p.data
    return full, [Replicate()] * (dp_ndim - 1) + [Shard(fsdp_dim), tp]


def data_parallel(model, mesh, param_dtype=None, tp_mesh=None, expert_mesh=None, experts=()):
    """Shard every parameter of `model` over `mesh` (dims ("dcn", "ici"), then "tp" when tp_mesh is
    given and the family's tensor-parallel plan has made the planned weights DTensors on it) in place.
    Two kinds of module are placed their own way: a --scan stack (its declared type,
    layer_scan.StackedLayers: the scan gathers one layer at a time) and the `experts` modules the
    family routed over `expert_mesh` (ModelFamily.split; a stack's block's own, for the stacked weights
    they name). Every rank holds the same whole tensor (or a meta one): each keeps its own block, no
    communication (src_data_rank=None)."""
    experts = {id(m) for m in experts}
    placements = [Replicate(), Shard(0)] if mesh.ndim - (tp_mesh is not None) == 2 else [Shard(0)]
    classes = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        if isinstance(module, StackedLayers):
            _shard_per_layer(module, mesh, placements[:-1], param_dtype, expert_mesh, experts)
            continue
        if id(module) in experts:
            _shard_experts(module, expert_mesh, param_dtype)  # (its router `gate` is a child: below)
            continue
        planned = tuple(isinstance(module._parameters[n], DTensor) for n in names)  # by tensor_parallel.py
        for name in names:
            p = module._parameters[name]
            full, where = _placements(p, len(placements), tp_mesh)
            module._parameters[name] = nn.Parameter(distribute_tensor(full, mesh, where, src_data_rank=None),
                                                    requires_grad=p.requires_grad)
        _add_properties(module, classes, {n: _property(n, param_dtype, tp_mesh, tp) for n, tp in zip(names, planned)},
                        (tuple(names), planned))
    return model


def _add_properties(module, classes, props, key):
    """SimpleFSDP's parametrization: the module's class becomes a subclass whose parameter names
    are properties (one subclass per (class, parameter names), shared by its instances)."""
    key = (module.__class__, key)
    if key not in classes:
        classes[key] = type(f"SimpleFSDP{module.__class__.__name__}", (module.__class__,), props)
    module.__class__ = classes[key]


# ------------------------------------------------------------------------------------------------
# a --scan stack: one layer gathered at a time, inside the scan

def layer_shard_dim(shape, n):
    """The dim of one layer's weight (the stacked weight's dims after the layer axis) that is split
    over n ranks: the first that divides evenly (all-gather concatenates whole rows; no padding)."""
    dim = next((d for d in range(len(shape)) if shape[d] % n == 0), None)
    if dim is None:
        raise ValueError(f"--scan under --mesh: a layer weight of shape {tuple(shape)} has no dim divisible by {n}")
    return dim


def _shard_per_layer(stack, mesh, replicate, param_dtype, expert_mesh=None, experts=()):
    """A stack's (L, ...) weights, each layer's slice a shard. Under ep, the weights of the block's
    `experts` modules, (L, E, ...), are (Shard over efsdp on a dim after E, Shard(E) over ep), as
    _shard_experts places an unstacked MoE's."""
    ici = mesh["ici"] if mesh.ndim == 2 else mesh
    in_experts = {stack.stacked_name(f"{prefix}.{n}" if prefix else n) for prefix, m in stack.block().named_modules()
                  if id(m) in experts for n, _ in m.named_parameters(recurse=False)}
    is_expert, dims, expert_dims = [], [], []
    for name, p in list(stack._parameters.items()):
        is_expert.append(name in in_experts)
        if is_expert[-1]:  # one layer's piece: (E/ep, ...), split further over efsdp on a dim after E
            expert_dims.append(1 + layer_shard_dim(p.shape[2:], expert_mesh.size(0)))
            where, on = [Shard(1 + expert_dims[-1]), Shard(1)], expert_mesh
        else:
            dims.append(layer_shard_dim(p.shape[1:], ici.size()))
            where, on = [*replicate, Shard(1 + dims[-1])], mesh
        stack._parameters[name] = nn.Parameter(distribute_tensor(p.data, on, where, src_data_rank=None),
                                               requires_grad=p.requires_grad)
    dcn = mesh["dcn"].get_group().group_name if mesh.ndim == 2 else ""
    dense = LayerGather(ici.get_group().group_name, ici.size(), dcn, dims, param_dtype)
    if not any(is_expert):
        return stack.gather_per_layer(dense)
    efsdp = expert_mesh.get_group("efsdp").group_name  # (experts: no HSDP, their FSDP group spans dcn)
    stack.gather_per_layer(ExpertStackGather(dense, LayerGather(efsdp, expert_mesh.size(0), "", expert_dims, param_dtype),
                                             is_expert, expert_mesh.size(1)))


@dataclasses.dataclass
class LayerGather:
    """SimpleFSDP's collectives for one layer of a stack, called inside the scan ops' kernels. A
    layer's local shards travel as ONE flat buffer (a bucket): the all-gather's output holds rank r's
    buffer in row r, so weight j is a column slice of it, re-joined on its shard dim."""
    ici: str          # process-group names (functional collectives take names)
    n: int            # ranks in ici
    dcn: str          # "" unless HSDP: gradients are then also averaged over the dcn replicas
    dims: list        # per weight: the dim of one layer's weight split over ici
    param_dtype: torch.dtype = None

    def full_shapes(self, shard_shapes):
        return [torch.Size((*s[:d], self.n * s[d], *s[d + 1:])) for s, d in zip(shard_shapes, self.dims)]

    def gather_start(self, shards):
        """Layer i's local shards -> an in-flight all-gather (finish with gather_wait)."""
        flat = torch.cat([s.to(self.param_dtype or s.dtype).reshape(-1) for s in shards])
        return c10d.all_gather_into_tensor(flat, self.n, self.ici), [s.shape for s in shards]

    def gather_wait(self, pending):
        out, shapes = pending
        rows_NxF, full, offset = c10d.wait_tensor(out).view(self.n, -1), [], 0
        for shape, d, full_shape in zip(shapes, self.dims, self.full_shapes(shapes)):
            piece = rows_NxF[:, offset:offset + shape.numel()].reshape(self.n, *shape)
            full.append(piece.movedim(0, d).reshape(full_shape))  # (n, *shard): side by side on dim d
            offset += shape.numel()
        return full

    def reduce_start(self, grads):
        """Layer i's full gradients -> an in-flight reduce-scatter of their average, in fp32."""
        rows, shapes = [], []
        for g, d in zip(grads, self.dims):  # the inverse of gather_wait's join: rank r's block to row r
            shape = (*g.shape[:d], self.n, g.shape[d] // self.n, *g.shape[d + 1:])
            rows.append(g.float().reshape(shape).movedim(d, 0).reshape(self.n, -1))
            shapes.append(torch.Size((*g.shape[:d], g.shape[d] // self.n, *g.shape[d + 1:])))
        flat = torch.cat(rows, dim=1).reshape(-1)
        return c10d.reduce_scatter_tensor(flat, "avg", self.n, self.ici), shapes

    def reduce_wait(self, pending, dtype):
        out, shapes = pending
        flat = c10d.wait_tensor(out)
        if self.dcn:
            flat = c10d.wait_tensor(c10d.all_reduce(flat, "avg", self.dcn))
        return [g.view(s).to(dtype) for g, s in zip(flat.split([s.numel() for s in shapes]), shapes)]


@dataclasses.dataclass
class ExpertStackGather:
    """LayerGather's interface for a stack that holds expert weights (ep): its other weights through one
    LayerGather over the data-parallel ranks, its experts (this rank's E/ep of each layer) through
    another over efsdp, their gradients scaled 1/ep as an unstacked MoE's are (_expert_property)."""
    dense: LayerGather
    experts: LayerGather
    is_expert: list   # per stacked weight, in the stack's order
    ep: int

    @property
    def param_dtype(self):
        return self.dense.param_dtype

    def _split(self, items):
        return ([x for x, e in zip(items, self.is_expert) if not e], [x for x, e in zip(items, self.is_expert) if e])

    def _join(self, dense, experts):
        dense, experts = iter(dense), iter(experts)
        return [next(experts) if e else next(dense) for e in self.is_expert]

    def full_shapes(self, shard_shapes):
        dense, experts = self._split(shard_shapes)
        return self._join(self.dense.full_shapes(dense), self.experts.full_shapes(experts))

    def gather_start(self, shards):
        dense, experts = self._split(shards)
        return self.dense.gather_start(dense), self.experts.gather_start(experts)

    def gather_wait(self, pending):
        return self._join(self.dense.gather_wait(pending[0]), self.experts.gather_wait(pending[1]))

    def reduce_start(self, grads):
        dense, experts = self._split(grads)
        return self.dense.reduce_start(dense), self.experts.reduce_start([g / self.ep for g in experts])

    def reduce_wait(self, pending, dtype):
        return self._join(self.dense.reduce_wait(pending[0], dtype), self.experts.reduce_wait(pending[1], dtype))


# ------------------------------------------------------------------------------------------------
# expert-parallel MoE weights: (E, ...) split on E over ep, FSDP over the other data-parallel ranks

class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _expert_property(name, param_dtype, ep):
    def get(self):
        p = self._parameters[name]
        if not _ACTIVE[0]:
            return p
        local = p.redistribute(placements=[Replicate(), Shard(0)], forward_dtype=param_dtype,
                               backward_dtype=torch.float32).to_local(grad_placements=[Partial("avg"), Shard(0)])
        # this rank's experts saw the tokens of its ep group: ep ranks' losses, each counted once by
        # the data-parallel mean over all ranks (efsdp averages the groups): 1/ep
        return _ScaleGrad.apply(local, 1.0 / ep)
    return property(get)


def _shard_experts(moe, mesh, param_dtype):  # (an MoE module: its (E, ...) weights, the router a child)
    """mesh: ("efsdp", "ep"); expert weights Shard(1) over efsdp, Shard(0) (the expert dim) over ep."""
    names = [n for n, p in moe._parameters.items() if p is not None]
    for name in names:
        p = moe._parameters[name]
        moe._parameters[name] = nn.Parameter(distribute_tensor(p.data, mesh, [Shard(1), Shard(0)], src_data_rank=None),
                                             requires_grad=p.requires_grad)
    _add_properties(moe, {}, {n: _expert_property(n, param_dtype, mesh.size(1)) for n in names}, tuple(names))
