"""tpu_pod/expert_exchange.py: expert parallelism in the step compiled for a TPU pod (--dry-run --compile,
--mesh ici=N,ep=E): the trainer's all-to-all (expert_parallel.py) as two JAX ops.

    python train.py --dry-run --compile --flavor qwen3_moe_debug --mesh ici=4,ep=2 --chip tpu_v5p

The compile hands XLA one program over every device (GSPMD: global arrays, each split by a
sharding), and an all-to-all has no form in that view: it exists on one device's piece. So the
exchange is written once and run two ways: on the global arrays, where sending is a transpose of
(ep group, source, destination), and on one device's piece under shard_map, where it is
jax.lax.all_to_all over the mesh's `ep` axis (sharded_kernels.by_ep_exchange). The first is the
eager form (jax_op.py makes each a PyTorch op; its fake shapes come from it), checked against the
MoE's plain dispatch; the second is checked against the first on CPU devices (tests).

The routing is the trainer's padded form (expert_parallel.AllToAll._padded), a device a routing
group (model.MoE's moe_groups: the compile sets one a data-parallel device), devices r = g ep + s
an ep group g of ep consecutive devices, device s of its group owning experts [s L, (s + 1) L),
L = E / ep. For a device's M rows, sorted by expert:

  1. counts: sizes (E,) viewed (ep, L): the rows it sends each peer, per peer expert; exchanged, the
     rows each peer sends it, per local expert;
  2. the rows travel in a (ep, C, D) buffer, C slots a peer, the rows for peer p in its first slots.
     By default C = M, the worst case: nothing dropped, as in MaxText's dropless ragged all-to-all.
     With ModelArgs.ep_buffer_factor f > 0, C = min(M, ceil(f M / ep)): f times a balanced peer's
     share (MaxText's ragged_buffer_factor; the trainer's rule, expert_parallel.slots_a_peer). A
     device's rows for peer p past its first C, in expert order, are dropped: they contribute
     nothing to the output (the token keeps its residual and its other experts) nor to any
     gradient. The counts exchanged in 1 are the kept ones;
  3. arrivals, ordered by source then expert, are sorted (stably) by local expert for the grouped
     matmul, padding last, in the last local expert's group (zero rows: nothing added to its
     gradient). Their group sizes are laid out over all E experts, zero outside the device's own,
     so the grouped matmul's meaning on the whole weights (the global form) is its meaning on the
     device's experts (sharded_kernels.by_routing_group slices them under ep);
  4. the way back undoes 3 and 2: each row returns to its own slot.
Autograd's backward of each op is its jax.vjp: the all-to-all's transpose is the all-to-all back.
"""
import jax
import jax.numpy as jnp

from expert_parallel import slots_a_peer  # (C: the trainer's rule)
from jax_op import jax_op
import layer_scan
from model import MoE


class _OnGlobalArrays:
    """Every device's piece one after another (R groups): the exchange is a transpose."""
    @staticmethod
    def exchange(a_RxPx_, ep):
        R = a_RxPx_.shape[0]
        grouped = a_RxPx_.reshape(R // ep, ep, *a_RxPx_.shape[1:])  # (group, source, destination, ...)
        return jnp.swapaxes(grouped, 1, 2).reshape(a_RxPx_.shape)

    @staticmethod
    def ep_index(R, ep):
        return jnp.arange(R) % ep


class _OnOneDevice:
    """One device's piece under shard_map (R = 1): the exchange is the ep axis's all-to-all."""
    @staticmethod
    def exchange(a_1xPx_, ep):
        return jax.lax.all_to_all(a_1xPx_, "ep", split_axis=1, concat_axis=1, tiled=True)

    @staticmethod
    def ep_index(R, ep):
        return jnp.full((R,), jax.lax.axis_index("ep"))


def _arrival_order(from_RxPxL, C):
    """(R, P C): the arrival slots (source p, slot j) sorted by local expert, padding (expert L) last."""
    R, P, L = from_RxPxL.shape
    ends_RxPxL = jnp.cumsum(from_RxPxL, -1)
    expert_RxPxC = (jnp.arange(C)[None, None, :, None] >= ends_RxPxL[:, :, None, :]).sum(-1)  # searchsorted, right
    return jnp.argsort(expert_RxPxC.reshape(R, P * C), axis=-1, stable=True)


def _counts(sizes_RxE, ep, on, C):
    """(first, kept, received): (R, P) the row each device's rows for peer p start at; (R, P, L) the rows
    it keeps for each peer's experts (its first C for that peer, in expert order) / receives per local
    expert."""
    R, E = sizes_RxE.shape
    sent_RxPxL = sizes_RxE.reshape(R, ep, E // ep)
    send_RxP = sent_RxPxL.sum(-1)
    kept_ends_RxPxL = jnp.minimum(jnp.cumsum(sent_RxPxL, -1), C)
    kept_RxPxL = jnp.diff(kept_ends_RxPxL, axis=-1, prepend=0)
    return jnp.cumsum(send_RxP, -1) - send_RxP, kept_RxPxL, on.exchange(kept_RxPxL, ep)


def _to_owners(x_NxD, sizes_RxE, ep, C, on):
    (N, D), R = x_NxD.shape, sizes_RxE.shape[0]
    M = N // R
    first_RxP, kept_RxPxL, from_RxPxL = _counts(sizes_RxE, ep, on, C)     # 1.
    j = jnp.arange(C)
    row_RxPxC = jnp.minimum(first_RxP[..., None] + j, M - 1)               # 2. peer p's slot j: row first_p + j
    kept_RxPxC = j < kept_RxPxL.sum(-1)[..., None]
    x_RxMxD = x_NxD.reshape(R, M, D)
    buf_RxPxCxD = jnp.where(kept_RxPxC[..., None],
                            jnp.take_along_axis(x_RxMxD, row_RxPxC.reshape(R, -1, 1), 1).reshape(R, ep, C, D), 0)
    arrived_RxPxCxD = on.exchange(buf_RxPxCxD, ep)
    order_RxQ = _arrival_order(from_RxPxL, C)                              # 3. (Q = P C slots)
    return jnp.take_along_axis(arrived_RxPxCxD.reshape(R, ep * C, D), order_RxQ[..., None], 1).reshape(R * ep * C, D)


def _arrived_sizes(sizes_RxE, ep, C, on):
    """(R, E): the rows a device received per local expert (padding in its last), zero elsewhere."""
    R, E = sizes_RxE.shape
    _, _, from_RxPxL = _counts(sizes_RxE, ep, on, C)
    local_RxL = from_RxPxL.sum(1)
    local_RxL = local_RxL.at[:, -1].add(ep * C - local_RxL.sum(-1))
    mine_RxP = jax.nn.one_hot(on.ep_index(R, ep), ep, dtype=local_RxL.dtype)
    return (mine_RxP[:, :, None] * local_RxL[:, None, :]).reshape(R, E)


def _from_owners(y_QxF, sizes_RxE, ep, M, on):
    R, E = sizes_RxE.shape
    C, F, L = y_QxF.shape[0] // (R * ep), y_QxF.shape[1], E // ep
    first_RxP, _, from_RxPxL = _counts(sizes_RxE, ep, on, C)
    order_RxQ = _arrival_order(from_RxPxL, C)                              # 4. undo 3
    slots_RxQxF = jnp.take_along_axis(y_QxF.reshape(R, ep * C, F), jnp.argsort(order_RxQ, axis=-1)[..., None], 1)
    back_RxPxCxF = on.exchange(slots_RxQxF.reshape(R, ep, C, F), ep)      # undo 2: row m as peer p computed it
    expert_RxM = (jnp.arange(M)[None, :, None] >= jnp.cumsum(sizes_RxE, -1)[:, None, :]).sum(-1)
    peer_RxM = jnp.minimum(expert_RxM // L, ep - 1)
    j_RxM = jnp.arange(M) - jnp.take_along_axis(first_RxP, peer_RxM, 1)   # row m's slot at its peer
    slot_RxM = peer_RxM * C + jnp.minimum(j_RxM, C - 1)
    y_RxMxF = jnp.take_along_axis(back_RxPxCxF.reshape(R, ep * C, F), slot_RxM[..., None], 1)
    return jnp.where((j_RxM < C)[..., None], y_RxMxF, 0).reshape(R * M, F)   # (a dropped row: nothing)


ON_DEVICE = {}  # an op's JAX function -> the same function on one device's piece, under shard_map over the mesh


@jax_op("ep_to_owners")
def to_owners(x_NxD, sizes_RxE, *, ep, slots):
    """Each device's rows to the devices that own their experts, `slots` a peer, sorted there by
    expert (1-3)."""
    return _to_owners(x_NxD, sizes_RxE, ep, slots, _OnGlobalArrays)


@jax_op("ep_arrived_sizes")
def arrived_sizes(sizes_RxE, *, ep, slots):
    """The grouped matmul's (R, E) group sizes of the rows to_owners delivered (3)."""
    return _arrived_sizes(sizes_RxE, ep, slots, _OnGlobalArrays)


@jax_op("ep_from_owners")
def from_owners(y_QxF, sizes_RxE, *, ep, rows):
    """The experts' outputs back to their rows' devices, in the rows' order, a dropped row's zero (4)."""
    return _from_owners(y_QxF, sizes_RxE, ep, rows, _OnGlobalArrays)


ON_DEVICE.update({
    to_owners.jax_fn: lambda x, sizes, *, ep, slots: _to_owners(x, sizes, ep, slots, _OnOneDevice),
    arrived_sizes.jax_fn: lambda sizes, *, ep, slots: _arrived_sizes(sizes, ep, slots, _OnOneDevice),
    from_owners.jax_fn: lambda y, sizes, *, ep, rows: _from_owners(y, sizes, ep, rows, _OnOneDevice)})


class Exchange:
    """model.MoE's dispatch (its route_through seam) in the compiled step: the rows to the devices that
    own their experts, through `experts` there, and back (steps 1-4)."""

    def __init__(self, ep, buffer_factor=0.0):
        self.ep, self.factor = ep, buffer_factor

    def __call__(self, experts, x_MxD, group_sizes):
        sizes_RxE = group_sizes if group_sizes.dim() == 2 else group_sizes[None]
        rows = x_MxD.shape[0] // sizes_RxE.shape[0]
        slots = slots_a_peer(rows, self.ep, self.factor)
        arrived_QxD = to_owners(x_MxD, sizes_RxE, ep=self.ep, slots=slots)
        y_QxD = experts(arrived_QxD, arrived_sizes(sizes_RxE, ep=self.ep, slots=slots))
        return from_owners(y_QxD, sizes_RxE, ep=self.ep, rows=rows)


def route(model, ep, buffer_factor=0.0):
    """Each MoE block's rows through Exchange(ep, buffer_factor) (its route_through seam); the names of
    the experts' weights, which the compile's layout splits over ep (simplefsdp.py's choice: the block's own
    (E, ...) parameters; its router is a child, FSDP-sharded as any weight). Under --scan a stack's
    one block is routed, once for every layer, and its experts' names are the stacked (L, E, ...) ones."""

    def routed(root):
        for prefix, module in root.named_modules():
            if isinstance(module, MoE):
                module.route_through(Exchange(ep, buffer_factor))
                yield from (f"{prefix}.{name}" for name, _ in module.named_parameters(recurse=False))
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, layer_scan.StackedLayers):
            names |= {f"{prefix}.{module.stacked_name(n)}" for n in routed(module.block())}
    return names | set(routed(model))
