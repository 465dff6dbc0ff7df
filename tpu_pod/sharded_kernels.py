"""tpu_pod/sharded_kernels.py: the Pallas kernels inside the training step compiled for a TPU pod.

    python train.py --dry-run --compile --kernels pallas --chip tpu_v5p --mesh ici=4 --flavor llama3_debug \
        --set n_layers=1 --set max_seq_len=8192 --batch-size 256 --seq-len 8192

tpu_pod/step_compile.py hands the whole step to XLA's SPMD partitioner (GSPMD), which splits XLA's own ops
over the devices by the layout's shardings. A Mosaic kernel is a custom call whose inside the
partitioner cannot see: the TPU compiler refuses to split it (tpu_pod/target.py). So each kernel is
lowered as its JAX function (the one jax_op.py registered as a PyTorch op) under `jax.shard_map` over
the data-parallel devices, dcn x ici (x ep, which borrows them): every device calls the kernel on its own rows of the batch, as
MaxText wraps its splash kernel. Where the kernel's result mixes rows (the loss is one mean over all
of them) the devices combine their pieces with a psum. Per kernel, what each device holds:

  splash attention   q, k, v (B, H, S, D) and the segment ids (B, S): its sequences (dim 0 split);
                     the output and the backward's dq, dk, dv the same. Nothing crosses devices.
  fused loss         h (N, D) and targets (N,): its rows (the batch's tokens, dim 0 split); the head
                     w (V, D) whole (FSDP gathers it for the forward anyway). Device d's kernel gives
                     m_d, the mean over its n_d kept rows, so
                         1. loss = sum_d n_d m_d / N, with N = sum_d n_d (two psums);
                         2. d loss / d h_d = (n_d / N) d m_d / d h_d: d's own vjp at cotangent c n_d / N;
                         3. d loss / d w = sum_d of those vjps' dw, reduce-scattered (psum_scatter):
                            each device keeps 1/n of the sum, split on the first dim that n divides
                            (the FSDP shard GSPMD wants, or a reshard away), where a psum would hold
                            the whole sum on every device beside the local dw; a psum where neither
                            dim divides. Across slices (devices joined by DCN) the vocabulary is
                            padded to a multiple of n and split, never the width, within each slice
                            first (over ICI) and then across slices (over DCN: 1 / (chips a slice) of
                            the sum crosses it). Measured on Llama 3's 128256 tokens over 2 x 256
                            v6e chips (libtpu 0.0.24; docs/planning.md), one reduce-scatter over all
                            the devices on the width held ~50 GiB more; on the padded vocabulary, at
                            4 layers, 17.3 GiB against the two scatters' 15.1. The padded rows' part
                            is sliced off, GSPMD resharding the rest to the FSDP shard.
                            The kept part is behind an optimization barrier: libtpu
                            lowers the reduce-scatter as an all-reduce and a slice, and without it
                            fused the slice into AdamW's update, the whole sum held until then.
                     A device whose rows are all ignored has m_d = 0 / 0: its terms are set to 0.
                     Its tiles are the chip's (kernels_pallas.ce_blocks), not the capture's defaults.
  grouped matmul     x (M, D) and its (R, E) group sizes: its routing groups' rows (model.MoE sorts the
                     tokens of each of R = moe_groups groups on its own, one group a device, so a
                     device's rows are its own tokens, sorted); the experts' weights w (E, D, F) whole
                     (FSDP gathers them). dx is the device's rows; dw, each device's part from its own
                     rows, is summed over the devices as the loss head's (step 3). Under ep: the rows
                     tpu_pod/expert_exchange.py delivered and the device's E / ep experts, dw summed over the
                     devices of its ep rank.
  ep exchange        tpu_pod/expert_exchange.py's ops, a device's rows in and out: their one-device form,
                     whose all-to-all crosses the ep axis (by_ep_exchange).

The cost model does not see inside a Mosaic kernel (no FLOPs, ~0 s): with the kernels the compiler's
FLOPs and step leave out attention's scores, the loss's projection and the experts' matmuls
(step_compile.kernel_flops).
Verified here: the compile (the kernels' Mosaic calls counted, the HBM they save) and, on CPU devices
in interpret mode, the sharded loss, attention and grouped matmul against the unsharded JAX functions
(tests/check_step_compile.py), and the ep exchange against its global form (tests/check_expert_exchange.py). Not verified: a run on a chip.
"""
import functools
import math

import jax
import jax.numpy as jnp
import torch
from jax.sharding import PartitionSpec as P

import jax_op
import kernels_gmm
import kernels_pallas
from tpu_pod import expert_exchange

_MESH = [None]  # (the compile in progress's (dcn, ici[, ep]) mesh: set by `use`)


def batch_axes():
    """The data-parallel axes the batch's rows are split over: dcn x ici, and ep (which borrows them)."""
    return tuple(a for a in ("dcn", "ici", "ep") if a in _MESH[0].shape)


def use(mesh):
    """The mesh the kernels are split over, for the next compile (step_compile.compile_step)."""
    _MESH[0] = mesh


def _devices(axes):
    """How many devices the mesh's `axes` hold together."""
    return math.prod(_MESH[0].shape[a] for a in axes)


def slices():
    """How many slices, joined by DCN, the mesh's devices are (a multi-slice topology's devices carry
    their slice_index; one slice's, and CPU devices, none: 1)."""
    return len({getattr(d, "slice_index", None) for d in _MESH[0].devices.flat})


def _by_slice(count):
    """The mesh's devices, in its order, as (slice, chip): `count` slices of the rest. Rows split over
    the data-parallel axes land on the same devices split over ("slice", "chip"), the order being
    slice-major (tpu_target.devices lays slices out one after the other)."""
    from jax.sharding import Mesh
    flat = _MESH[0].devices.flat
    index = [getattr(d, "slice_index", i * count // _MESH[0].devices.size) for i, d in enumerate(flat)]
    if index != sorted(index):
        raise ValueError("tpu_pod.sharded_kernels: the mesh's devices are not slice by slice")
    return Mesh(_MESH[0].devices.reshape(count, -1), ("slice", "chip"))


def _sharded(body, in_specs, out_specs, mesh=None):
    return jax.shard_map(body, mesh=mesh or _MESH[0], in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _split(call, args):
    return args[:call.n_tensors], dict(zip(call.statics, args[call.n_tensors:]))


def by_sequence(call, on_device=None):
    """(forward, backward) of a kernel whose every tensor is batch-major and per-sequence (splash), or
    of an op whose every tensor is a device's rows and whose `on_device` form exchanges them over the
    ep axis (expert_exchange.ON_DEVICE)."""
    fn = on_device or call.jax_fn

    def forward(*args):
        tensors, statics = _split(call, args)
        rows = P(batch_axes())
        return _sharded(functools.partial(fn, **statics), (rows,) * len(tensors), rows)(*tensors)

    def backward(*args):
        tensors, statics = _split(call, args[:call.n_tensors] + args[call.n_tensors + 1:])
        floats = tuple(jnp.issubdtype(t.dtype, jnp.floating) for t in tensors)
        vjp = functools.partial(jax_op.vjp_fn(fn, floats), **statics)
        rows = P(batch_axes())
        return _sharded(vjp, (rows,) * (len(tensors) + 1), [rows] * sum(floats))(*tensors, args[call.n_tensors])
    return forward, backward


def mean_over_rows(call, ignore_index="ignore_index"):
    """(forward, backward) of the fused loss: rows split, the head whole, one mean (steps 1-3 above)."""
    whole = P()

    def kept(targets, statics):
        return jnp.sum(targets != statics[ignore_index]).astype(jnp.float32)

    def chip_blocks(statics, h, w):
        """The chip's own tiles when compiling for one (kernels_pallas.ce_blocks: the dW kernel's VMEM
        within the chip's limit, at the inputs' width: h and w reach the kernel in fp32, the model's
        dtype, since autocast does not cast a custom op's inputs), not the interpret-mode defaults the
        graph was captured with: at a width of 8192 those overflow VMEM (measured: Llama 2 70B's loss)."""
        chip = kernels_pallas.target_chip()
        if chip:
            itemsize = max(jnp.dtype(h.dtype).itemsize, jnp.dtype(w.dtype).itemsize)
            statics["block_n"], statics["block_v"] = kernels_pallas.ce_tiles(h.shape[0] // _devices(batch_axes()),
                                                                             w.shape[1], w.shape[0], itemsize, chip)
        return statics

    def forward(h, w, targets, *static_args):
        statics = chip_blocks(dict(zip(call.statics, static_args)), h, w)
        axes = batch_axes()
        rows = P(axes)

        def body(h, w, targets):
            n = kept(targets, statics)
            m = jnp.where(n > 0, call.jax_fn(h, w, targets, **statics).astype(jnp.float32), 0.0)
            return jax.lax.psum(m * n, axes) / jax.lax.psum(n, axes)  # 1.
        return _sharded(body, (rows, whole, rows), whole)(h, w, targets)

    def backward(h, w, targets, cotangent, *static_args):
        statics = chip_blocks(dict(zip(call.statics, static_args)), h, w)
        vjp = functools.partial(jax_op.vjp_fn(call.jax_fn, (True, True, False)), **statics)
        count = slices()
        mesh, axes = (_by_slice(count), ("slice", "chip")) if count > 1 else (_MESH[0], batch_axes())
        rows = P(axes)
        if count > 1:  # (across DCN: the vocabulary padded and split, within each slice first; step 3 above)
            pad = -w.shape[0] % mesh.size
            summed = lambda dw: jax.lax.optimization_barrier(jax.lax.psum_scatter(jax.lax.psum_scatter(  # noqa: E731
                jnp.pad(dw, [(0, pad), (0, 0)]), "chip", scatter_dimension=0, tiled=True),
                "slice", scatter_dimension=0, tiled=True))
            dw_spec = P(("chip", "slice"))  # (chip c's block of the vocabulary, its slice s's part of that)
        else:
            summed, dw_spec = _summed_over_devices(w.shape)

        def body(h, w, targets, cotangent):
            n = kept(targets, statics)
            dh, dw = vjp(h, w, targets, cotangent * n / jax.lax.psum(n, axes))  # 2.
            return [jnp.where(n > 0, dh, 0), summed(jnp.where(n > 0, dw, 0))]  # 3.
        dh, dw = _sharded(body, (rows, whole, rows, whole), [rows, dw_spec], mesh)(h, w, targets, cotangent)
        return [dh, dw[:w.shape[0]]]
    return forward, backward


def _summed_over_devices(shape, axes=None, lead=()):
    """(sum, its out spec) for a weight's gradient of which every device holds a part (its rows'):
    reduce-scattered (psum_scatter) over `axes` (default: the data-parallel ones) on the first dim
    they divide, the FSDP shard GSPMD wants or a reshard away, where a psum would hold the whole sum
    on every device beside the local part; a psum where no dim divides. `lead`: the out spec of
    dims already split (the experts' dim over ep), never scattered again."""
    axes = axes or batch_axes()
    devices = _devices(axes)
    split = next((d for d in range(len(lead), len(shape)) if shape[d] % devices == 0), None)
    if split is None:
        return (lambda dw: jax.lax.psum(dw, axes)), P(*lead)
    # (the barrier: step 3 above. Measured: Llama 3.1 8B's head on v6e-256, 0.98 GiB held through the
    # layers' backward; the HBM the step reserves 7.31 -> 6.29 GiB)
    scatter = lambda dw: jax.lax.optimization_barrier(jax.lax.psum_scatter(dw, axes, scatter_dimension=split, tiled=True))
    return scatter, P(*lead, *[None] * (split - len(lead)), axes)


def by_routing_group(call):
    """(forward, backward) of the grouped matmul: x's rows split with their (R, G) group sizes, the
    routing groups' rows (model.MoE routes one group a device: R a multiple of the devices), the
    experts' weights whole; their gradient summed over the devices as the loss head's (step 3).
    Under ep (a mesh axis) each device holds its ep rank's E / ep experts, gathered over the rest,
    and the rows expert_exchange.to_owners delivered it: its group sizes are its own experts' slice
    of the (R, E) row (zero elsewhere), its experts' gradient summed over the devices of its rank."""
    ep = lambda: _MESH[0].shape.get("ep", 1)
    specs = lambda: (P(batch_axes()), P("ep") if ep() > 1 else P())  # (rows', the experts')

    def prepare(x, sizes, static_args):
        statics = dict(zip(call.statics, static_args))
        devices = _MESH[0].devices.size
        if sizes.ndim != 2 or sizes.shape[0] % devices:
            raise ValueError(f"the grouped matmul under --compile routes one group a device: its group sizes "
                             f"are {tuple(sizes.shape)} on {devices} devices (model.MoE's moe_groups)")
        chip = kernels_pallas.target_chip()
        if chip:  # (the chip's tiles, not the capture's: block_m at most the rows a group)
            statics["block_m"], statics["block_k"], statics["block_n"] = kernels_gmm.gmm_tiles(x.shape[0] // sizes.shape[0], chip)
        return statics

    def mine(sizes, w):
        """This device's experts' columns of its (1, E) group sizes (all of them without ep)."""
        if ep() == 1:
            return sizes
        return jax.lax.dynamic_slice_in_dim(sizes, jax.lax.axis_index("ep") * w.shape[0], w.shape[0], axis=1)

    def forward(x, w, sizes, *static_args):
        statics = prepare(x, sizes, static_args)
        body = lambda x, w, sizes: call.jax_fn(x, w, mine(sizes, w), **statics)
        rows, w_spec = specs()
        return _sharded(body, (rows, w_spec, rows), rows)(x, w, sizes)

    def backward(x, w, sizes, cotangent, *static_args):
        vjp = functools.partial(jax_op.vjp_fn(call.jax_fn, (True, True, False)), **prepare(x, sizes, static_args))
        rows, w_spec = specs()
        if ep() > 1:
            summed, dw_spec = _summed_over_devices((w.shape[0] // ep(), *w.shape[1:]), ("dcn", "ici"), ("ep",))
        else:
            summed, dw_spec = _summed_over_devices(w.shape)

        def body(x, w, sizes, cotangent):
            dx, dw = vjp(x, w, mine(sizes, w), cotangent)
            return [dx, summed(dw)]
        return _sharded(body, (rows, w_spec, rows, rows), [rows, dw_spec])(x, w, sizes, cotangent)
    return forward, backward


def by_ep_exchange(call):
    """(forward, backward) of an expert_exchange op: a device's rows (and its group sizes) in and out,
    exchanged inside over the ep axis."""
    return by_sequence(call, expert_exchange.ON_DEVICE[call.jax_fn])


LAYOUTS = {"minititan::splash": by_sequence, "minititan::fused_linear_cross_entropy": mean_over_rows,
           "minititan::gmm": by_routing_group, "minititan::ep_to_owners": by_ep_exchange,
           "minititan::ep_arrived_sizes": by_ep_exchange, "minititan::ep_from_owners": by_ep_exchange}


def op_overload(qualified):
    namespace, name = qualified.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def register_torchax():
    """Each kernel's forward and backward op (jax_op.KERNELS) as its sharded JAX function, for torchax
    (once a process: torchax 0.0.7 cannot override an op it has); a kernel without a layout here is
    left out, and a step that uses it fails to lower, naming the op."""
    import kernels_gmm  # noqa: F401  (registers the grouped matmul)
    import kernels_pallas  # noqa: F401  (registers the fused loss)
    import kernels_splash  # noqa: F401  (registers splash)
    from torchax.ops import ops_registry
    for name, make in LAYOUTS.items():
        if op_overload(name) in ops_registry.all_aten_ops:
            continue
        forward, backward = make(jax_op.KERNELS[name])
        ops_registry.register_torch_dispatch_op(op_overload(name), forward)
        ops_registry.register_torch_dispatch_op(op_overload(name + "_vjp"), backward)
