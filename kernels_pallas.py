"""kernels_pallas.py: the fused final projection + cross-entropy as Pallas kernels, and the Pallas
plumbing every kernel here shares (kernels_splash.py: splash attention; kernels_gmm.py: the grouped
matmul for MoE).

Fused linear + cross-entropy: a running log-sum-exp over vocabulary tiles; the backward recomputes
each logits tile to form dh (rows outer, vocabulary inner) and dW (vocabulary outer, rows inner),
accumulating in fp32 VMEM scratch. Never tokens x vocab. Per-row vectors are 2-D and lane-dense for
Mosaic: the forward's running max / sum / target logit as (N, 128) lane-broadcast columns, the
targets and the backward's inputs as (1, N) rows.

Each kernel is a JAX function with a jax.custom_vjp (Pallas forward and backward kernels), registered
as a PyTorch op by jax_op.py and named in model.py's / flux/model.py's tables ("splash", "fused",
"gmm"). Off a TPU they run in Pallas interpret mode (one switch: `target_chip`), which the suite checks
against plain PyTorch and JAX's own kernels. For a TPU they lower with Mosaic; python -m tpu_pod.target runs
that compiler, the real one (libtpu), on this CPU machine for compile-only TPU devices: forward and
backward of each kernel at production shapes compile for v5p in the suite (tests/check_tpu_compile.py)
and for v5p, v6e and Ironwood in `python -m tpu_pod.kernels sweep` (docs/measured.md). That verifies lowering,
Mosaic, and the VMEM and HBM fit; not numerics or speed on a chip, where none of them has run.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_op import jax_op

NEG_INF = -1e30  # finite: exp(NEG_INF - m) == 0 without inf - inf = nan
# TPU vector registers are (8 sublanes x 128 lanes) of 32-bit values: a block's last dim should be a
# multiple of NUM_LANES and its second-to-last of NUM_SUBLANES, or Mosaic pads (or refuses) it.
NUM_LANES, NUM_SUBLANES = 128, 8
MiB = 2**20
# VMEM a TensorCore has, as the TPU compiler states it when a kernel overflows it ("Used ... of
# 63.94M vmem" for v5p and for Ironwood, "of 128.00M" for v6e), and the scoped VMEM our kernels ask
# Mosaic for: 3/4 of it (the compiler's own default is 16 MiB on v5p, too little for a cross-entropy
# tile at hidden 4096); the rest stays for Mosaic's internal scratch.
VMEM_BYTES = {"tpu_v5p": 64 * MiB, "tpu_v6e": 128 * MiB, "tpu_v7": 64 * MiB}
VMEM_LIMIT_BYTES = {chip: b * 3 // 4 for chip, b in VMEM_BYTES.items()}
# Block sizes on a TPU, per chip: splash 512 (MaxText's default sa_block_q / sa_block_kv, configs/
# base.yml; JAX's own default is 128); gmm (tm, tk, tn) = 512 each (the m / k / n tiles of megablox's
# tiling, MaxText's default 512 rows); the cross-entropy's (rows, vocab) tile from ce_blocks.
TPU_BLOCKS = {chip: {"splash": 512, "gmm": (512, 512, 512)} for chip in VMEM_BYTES}
# Off a TPU (interpret mode) the blocks are small, so the suite's shapes span several of them.
INTERPRET_BLOCKS = {"splash": 128, "gmm": (128, 0, 0), "ce": (256, 512)}  # (gmm's 0: K / N whole)

# ================================================================================================
# 1. The chip the kernels lower for: the one switch
#
# Off a TPU every kernel runs in Pallas interpret mode. On a TPU it lowers with Mosaic for that chip,
# with the chip's blocks and VMEM limit. Two callers name the chip, and both reach the same choice
# (`target_chip`, then each kernel's tiles, `ce_tiles` / kernels_gmm.gmm_tiles / kernels_splash.
# splash_block, and VMEM_LIMIT_BYTES in `pallas_call_prefetch`): a training step on a TPU,
# whose chip JAX's own device names (`running_chip`), and the compile harness (tpu_pod/target.py),
# which compiles for a named chip on a machine without one (`lowering_for`). So the kernels a
# training step runs are the kernels that were compiled.
# jax's Device.device_kind -> our chip names: the kinds jax names (jax/_src/mesh_utils.py), and "TPU v5",
# what libtpu's v5p devices report (a compile-only one: tests/check_tpu_compile.py)
DEVICE_KINDS = {"TPU v5": "tpu_v5p", "TPU v5p": "tpu_v5p", "TPU v6 lite": "tpu_v6e", "TPU7x": "tpu_v7"}


def chip_of(device_kind):
    """Our name for the chip whose jax device_kind this is, or None (a chip without tuned blocks)."""
    return DEVICE_KINDS.get(device_kind)


@functools.cache
def on_tpu():
    """This process runs on a TPU (asked once, at the first kernel: not at import, where it would start
    jax's backends before the compile harness chooses them)."""
    return jax.default_backend() == "tpu"


@functools.cache
def running_chip():
    """The TPU chip this process runs on, or None (off a TPU, or a chip without tuned blocks)."""
    return chip_of(jax.devices()[0].device_kind) if on_tpu() else None


_COMPILING_FOR = [None]


@contextlib.contextmanager
def lowering_for(chip):
    """Trace the kernels for `chip` (Mosaic, its VMEM and blocks) whatever this process runs on: the
    compile harness, compiling for a TPU on a CPU machine. None: as this process would."""
    _COMPILING_FOR[0] = chip
    try:
        yield
    finally:
        _COMPILING_FOR[0] = None


def target_chip():
    """The chip the kernels lower for now: the harness's, else the TPU this process runs on, else None."""
    return _COMPILING_FOR[0] or running_chip()


def round_up(x, multiple):
    """The smallest multiple of `multiple` that is >= x (sizes padded to whole blocks)."""
    return -(-x // multiple) * multiple


def pad_to(x, size, axis, value=0):
    """x padded with `value` along `axis` to `size` (sizes rounded up to whole blocks)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def tile(dim, preferred):
    """A block for a dimension: the largest multiple of 128 lanes <= preferred that divides it, else
    the whole dimension (always a legal block: equal to the array's)."""
    for t in range(min(preferred, dim) // NUM_LANES * NUM_LANES, 0, -NUM_LANES):
        if dim % t == 0:
            return t
    return dim


def dot_f32(a, b, trans_b=False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def pallas_call_prefetch(kernel, *, out_shape, grid, in_specs, out_specs, num_scalar_prefetch=0,
                         scratch_shapes=(), parallel=0):
    """pl.pallas_call with scalar prefetch: the first `num_scalar_prefetch` operands are small int
    arrays (block lists, visit metadata) placed in SMEM and passed to every index map; in_specs
    describe the remaining operands, in order. scratch_shapes: VMEM buffers that live across the
    grid's steps (accumulators). The first `parallel` grid axes are independent (a chip with two
    TensorCores may split them); the others carry state from step to step, in order."""
    semantics = ("parallel",) * parallel + ("arbitrary",) * (len(grid) - parallel)
    chip = target_chip()
    return pl.pallas_call(kernel, out_shape=out_shape, interpret=not chip and not on_tpu(),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                                               vmem_limit_bytes=VMEM_LIMIT_BYTES.get(chip)),
                          grid_spec=pltpu.PrefetchScalarGridSpec(
                              num_scalar_prefetch=num_scalar_prefetch, grid=grid, in_specs=in_specs,
                              out_specs=out_specs, scratch_shapes=scratch_shapes))


# ================================================================================================
# 2. Fused final projection + cross-entropy

def _logits_tile(h_ref, w_ref, j, block_v, vocab):
    s = dot_f32(h_ref[...], w_ref[...], trans_b=True)                        # (bn, bv) fp32
    col = j * block_v + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where(col < vocab, s, NEG_INF), col                        # padded vocab -> -inf


def _column(ref):
    """A per-row vector stored as a (1, bn) row block, as a (bn, 1) column of the tile."""
    return ref[0][:, None]


def _ce_fwd_kernel(h_ref, w_ref, t_ref, m_ref, l_ref, tl_ref, *, block_v, vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        tl_ref[...] = jnp.zeros(tl_ref.shape, jnp.float32)

    s, col = _logits_tile(h_ref, w_ref, j, block_v, vocab)
    m_old = m_ref[...]                                                    # (bn, 128), every lane the same
    m_new = jnp.maximum(m_old, s.max(-1, keepdims=True))
    l_ref[...] = l_ref[...] * jnp.exp(m_old - m_new) + jnp.exp(s - m_new[:, :1]).sum(-1, keepdims=True)
    m_ref[...] = m_new
    tl_ref[...] += jnp.where(col == _column(t_ref), s, 0.0).sum(-1, keepdims=True)


def _ce_dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab):
    s, col = _logits_tile(h_ref, w_ref, j, block_v, vocab)
    p = jnp.exp(s - _column(lse_ref))
    return (p - (col == _column(t_ref))) * _column(g_ref)                # (bn, bv)


def _ce_dh_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dh_ref, acc, *, block_v, vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    d = _ce_dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab)
    acc[...] += dot_f32(d.astype(w_ref.dtype), w_ref[...])

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _ce_dw_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dw_ref, acc, *, block_v, vocab):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    d = _ce_dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab)
    acc[...] += dot_f32(d.T.astype(h_ref.dtype), h_ref[...])

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        dw_ref[...] = acc[...].astype(dw_ref.dtype)


def _ce_specs(D, bn, bv, vocab_major):
    """BlockSpecs for h, w and the per-row vectors (stored (1, N): rows of (1, bn) blocks) on a
    (row, vocab) or (vocab, row) grid."""
    rows = (lambda j, i: i) if vocab_major else (lambda i, j: i)
    vocab = (lambda j, i: j) if vocab_major else (lambda i, j: j)
    return (pl.BlockSpec((bn, D), lambda a, b: (rows(a, b), 0)), pl.BlockSpec((bv, D), lambda a, b: (vocab(a, b), 0)),
            pl.BlockSpec((1, bn), lambda a, b: (0, rows(a, b))))


def _ce_lse(h, w, t, vocab, bn, bv):
    N, D = h.shape
    h_s, w_s, r_s = _ce_specs(D, bn, bv, False)
    lanes = pl.BlockSpec((bn, NUM_LANES), lambda i, j: (i, 0))           # (bn, 128): lane-broadcast columns
    col = jax.ShapeDtypeStruct((N, NUM_LANES), jnp.float32)
    m, l, tl = pallas_call_prefetch(functools.partial(_ce_fwd_kernel, block_v=bv, vocab=vocab), grid=(N // bn, w.shape[0] // bv),
                     out_shape=(col, col, col),                 # running max, running sum, target logit
                     in_specs=[h_s, w_s, r_s], out_specs=[lanes, lanes, lanes], parallel=1)(h, w, t[None])
    return m[:, 0] + jnp.log(l[:, 0]), tl[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ce_padded(h, w, t, vocab, ignore, bn, bv):
    return _ce_fwd_rule(h, w, t, vocab, ignore, bn, bv)[0]


def _ce_fwd_rule(h, w, t, vocab, ignore, bn, bv):
    lse, tl = _ce_lse(h, w, t, vocab, bn, bv)
    valid = t != ignore
    return jnp.where(valid, lse - tl, 0.0).sum() / valid.sum(), (h, w, t, lse)


def _ce_bwd_rule(vocab, ignore, bn, bv, res, g):
    h, w, t, lse = res
    (N, D), V = h.shape, w.shape[0]
    valid = t != ignore
    g_rows = jnp.where(valid, g / valid.sum(), 0.0).astype(jnp.float32)
    kw = dict(block_v=bv, vocab=vocab)
    rows = (t[None], lse[None], g_rows[None])                            # (1, N) each
    h_s, w_s, r_s = _ce_specs(D, bn, bv, False)
    dh = pallas_call_prefetch(functools.partial(_ce_dh_kernel, **kw), grid=(N // bn, V // bv),   # rows outer, vocab inner
               out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype), in_specs=[h_s, w_s, r_s, r_s, r_s],
               out_specs=h_s, scratch_shapes=[pltpu.VMEM((bn, D), jnp.float32)], parallel=1)(h, w, *rows)
    h_s, w_s, r_s = _ce_specs(D, bn, bv, True)
    dw = pallas_call_prefetch(functools.partial(_ce_dw_kernel, **kw), grid=(V // bv, N // bn),   # vocab outer, rows inner
               out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype), in_specs=[h_s, w_s, r_s, r_s, r_s],
               out_specs=w_s, scratch_shapes=[pltpu.VMEM((bv, D), jnp.float32)], parallel=1)(h, w, *rows)
    return dh, dw, None


_ce_padded.defvjp(_ce_fwd_rule, _ce_bwd_rule)


@jax_op("fused_linear_cross_entropy", static=("ignore_index", "block_n", "block_v"))
def fused_ce_jax(h, w, targets, *, ignore_index, block_n, block_v):
    """mean over non-ignored rows of cross_entropy(h @ w.T, targets); h (N, D), w (V, D)."""
    (N, _), V = h.shape, w.shape[0]
    N_pad, V_pad = round_up(N, block_n), round_up(V, block_v)
    return _ce_padded(pad_to(h, N_pad, 0), pad_to(w, V_pad, 0),
                      pad_to(targets, N_pad, 0, ignore_index), V, ignore_index, block_n, block_v)


def ce_blocks(chip, hidden, vocab, itemsize=2):
    """The largest (block_n, block_v) whose VMEM, the dW kernel's (the largest: h and w tiles and the
    output double-buffered, an fp32 (bv, hidden) accumulator, ~4 fp32 (bn, bv) temporaries), fits
    the chip's VMEM_LIMIT_BYTES; block_v then shrunk to divide the vocabulary where a multiple of
    128 does (128256 = 501 x 256): padding it to whole tiles copies w and its gradient in HBM."""
    def vmem(bn, bv):
        return 2 * (bn + 2 * bv) * hidden * itemsize + bv * hidden * 4 + 4 * bn * bv * 4
    fits = [(bn, bv) for bn, bv in ((512, 1024), (512, 512), (256, 512), (256, 256), (128, 256), (128, 128))
            if vmem(bn, bv) <= VMEM_LIMIT_BYTES[chip]]
    bn, bv = fits[0] if fits else (NUM_SUBLANES, NUM_LANES)
    return bn, (tile(vocab, bv) if vocab % NUM_LANES == 0 else bv)


def ce_tiles(rows, hidden, vocab, itemsize, chip=None, block_n=None, block_v=None):
    """(block_n, block_v) for a loss of `rows` x `vocab`: given, else the chip's (ce_blocks), else
    interpret mode's; no larger than the (padded) array."""
    default = ce_blocks(chip, hidden, vocab, itemsize) if chip else INTERPRET_BLOCKS["ce"]
    block_n, block_v = block_n or default[0], block_v or default[1]
    return (min(block_n, round_up(rows, NUM_SUBLANES)),   # rows: the sublane dim of a logits tile
            min(block_v, round_up(vocab, NUM_LANES)))     # vocab: its lane dim


def fused_linear_cross_entropy(h_NxD, w_VxD, targets_N, ignore_index=-100, block_n=None, block_v=None):
    """PyTorch entry point, same contract as model.plain_cross_entropy; the tiles the chip's."""
    block_n, block_v = ce_tiles(h_NxD.shape[0], h_NxD.shape[1], w_VxD.shape[0], w_VxD.element_size(),
                                target_chip(), block_n, block_v)
    return fused_ce_jax(h_NxD, w_VxD, targets_N, ignore_index=ignore_index, block_n=block_n, block_v=block_v)
