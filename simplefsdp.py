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
"""
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

_ACTIVE = [True]


@contextmanager
def parametrization_off():
    """Read the stored shards themselves (for initialization and checkpoint loading)."""
    _ACTIVE[0] = False
    try:
        yield
    finally:
        _ACTIVE[0] = True


def replicate_compute(param, param_dtype=None):
    """Shard -> full tensor for compute. Forward: all-gather (ici). Backward: reduce-scatter of the
    averaged gradient (ici) and all-reduce (dcn)."""
    n = len(param.placements)
    full = param.redistribute(placements=[Replicate()] * n,
                              forward_dtype=param_dtype, backward_dtype=torch.float32)
    return full.to_local(grad_placements=[Partial("avg")] * n)


def _property(name, param_dtype):
    def get(self):
        p = self._parameters[name]
        return replicate_compute(p, param_dtype) if _ACTIVE[0] else p
    return property(get)


def data_parallel(model, mesh, param_dtype=None):
    """Shard every parameter of `model` over `mesh` (dims ("dcn", "ici")) in place; returns model."""
    placements = [Replicate(), Shard(0)] if mesh.ndim == 2 else [Shard(0)]
    classes = {}
    for module in model.modules():
        names = [n for n, p in module._parameters.items() if p is not None]
        if not names:
            continue
        for name in names:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(distribute_tensor(p.data, mesh, placements),
                                                    requires_grad=p.requires_grad)
        key = (module.__class__, tuple(names))
        if key not in classes:  # one subclass per (class, parameter names), shared by its instances
            props = {n: _property(n, param_dtype) for n in names}
            classes[key] = type(f"SimpleFSDP{module.__class__.__name__}", (module.__class__,), props)
        module.__class__ = classes[key]
    return model


def is_sharded(param):
    return isinstance(param, DTensor)
