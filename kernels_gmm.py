"""kernels_gmm.py: grouped matrix multiplication for MoE experts as Pallas kernels (JAX's megablox).

The M routed rows arrive sorted by expert (group); group g owns rows [start_g, end_g). A plain
batched matmul would pad every group to the largest; instead the grid visits each (row tile, group)
pair that holds rows, in group order (`group_metadata`: the index arithmetic, derived in numbered
steps), and each visit multiplies only its group's rows of the tile by that group's weight, adding
into the output tile. A tile split between two groups is visited twice; m_tiles + G visits always
suffice, so the grid has a static size. `tgmm` is the transposed product (x^T dy per group) for the
weight gradient: the same visits, accumulating into the group's (K, N) block.

Registered as a PyTorch op by jax_op.py and named in model.py's GMM_IMPLS as "gmm"; shares the Pallas
call, padding and tile sizes of kernels_pallas.py (Mosaic on TPU, interpret mode elsewhere).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax_op import jax_op
from kernels_pallas import NUM_SUBLANES, dot_f32, pad_to, pallas_call_prefetch, round_up

def group_metadata(group_sizes, m_tiles, block_m):
    """The (row tile, group) pairs the grid visits, in group order, as traceable arrays.

    Args:
      group_sizes: (G,) int, rows per group; the M = sum(group_sizes) rows are sorted by group.
      m_tiles: M_pad // block_m, the number of row tiles.
      block_m: rows per tile.
    Returns:
      meta: (4, m_tiles + G) int32, per visit v: [row tile, group, first row, end row (exclusive)].
      n_visits: m_tiles + G, the static grid size.

    Example, block_m=4, group_sizes=[3, 0, 6] (rows 0-2 in group 0, rows 3-8 in group 2, 3 tiles):
    visits (tile, group) = (0, 0), (0, 1) with no rows, (0, 2), (1, 2), (2, 2), then one padding visit.
    """
    G = group_sizes.shape[0]
    # 1. Each group's row range [start, end).
    ends = jnp.cumsum(group_sizes)                                           # (G,)  [3, 3, 9]
    starts = ends - group_sizes                                              # (G,)  [0, 3, 3]
    # 2. The tiles each group touches: first..last. An empty group still gets one visit (of its
    #    start tile, with no rows), so tgmm writes its all-zero weight gradient.
    first = jnp.minimum(starts // block_m, m_tiles - 1)                     # (G,)  [0, 0, 0]
    last = jnp.where(group_sizes > 0, (ends - 1) // block_m, first)         # (G,)  [0, 0, 2]
    visits = last - first + 1                                                # (G,)  [1, 1, 3]
    offsets = jnp.cumsum(visits) - visits                                    # (G,)  [0, 1, 2]: group's first visit
    # 3. Visit v belongs to the group whose visit range [offset, offset + visits) holds v. A tile is
    #    split between at most two groups at each of the G - 1 boundaries, so m_tiles + G visits
    #    always suffice: a static grid size.
    v = jnp.arange(m_tiles + G)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(visits), v, side="right"), G - 1)
    # 4. Visits past the real ones are padding: they revisit the last tile with an empty row range.
    real = v < visits.sum()
    tile = jnp.where(real, first[group] + v - offsets[group], m_tiles - 1)
    group = jnp.where(real, group, G - 1)
    lo = jnp.where(real, starts[group], 0)
    hi = jnp.where(real, ends[group], 0)
    meta = jnp.stack([tile, group, lo, hi]).astype(jnp.int32)               # (4, m_tiles + G)
    return meta, m_tiles + G


def _rows_in_group(meta, v, shape, block_m):
    row = meta[0, v] * block_m + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return (row >= meta[2, v]) & (row < meta[3, v])


def _zero_on_first_visit(meta, v, key, out_ref):
    """Zero the output block when visit v is the first to write it (meta row `key`: 0 = the
    visit's row tile, for gmm; 1 = its group, for tgmm); later visits accumulate into it."""
    @pl.when((v == 0) | (meta[key, v] != meta[key, jnp.maximum(v - 1, 0)]))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _gmm_kernel(meta, x_ref, w_ref, o_ref, *, block_m):
    v = pl.program_id(0)
    _zero_on_first_visit(meta, v, 0, o_ref)
    x = jnp.where(_rows_in_group(meta, v, x_ref.shape, block_m), x_ref[...], 0)
    o_ref[...] += dot_f32(x, w_ref[...]).astype(o_ref.dtype)


def _tgmm_kernel(meta, x_ref, dy_ref, dw_ref, *, block_m):
    v = pl.program_id(0)
    _zero_on_first_visit(meta, v, 1, dw_ref)
    x = jnp.where(_rows_in_group(meta, v, x_ref.shape, block_m), x_ref[...], 0)
    dw_ref[...] += dot_f32(x.T, dy_ref[...]).astype(dw_ref.dtype)


# Block specs indexed by the visit metadata: rows of the visit's tile, or the visit's group.
_ROWS = lambda bm, cols: pl.BlockSpec((bm, cols), lambda v, m: (m[0, v], 0))
_GROUP = lambda K, N: pl.BlockSpec((None, K, N), lambda v, m: (m[1, v], 0, 0))


def _gmm_call(x, w, group_sizes, block_m):
    (M, K), N = x.shape, w.shape[2]
    meta, n_visits = group_metadata(group_sizes, M // block_m, block_m)
    return pallas_call_prefetch(functools.partial(_gmm_kernel, block_m=block_m), grid=(n_visits,), num_scalar_prefetch=1,
                 out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
                 in_specs=[_ROWS(block_m, K), _GROUP(K, N)], out_specs=_ROWS(block_m, N))(meta, x, w)


def tgmm_call(x, dy, group_sizes, block_m):
    (M, K), N, G = x.shape, dy.shape[1], group_sizes.shape[0]
    meta, n_visits = group_metadata(group_sizes, M // block_m, block_m)
    return pallas_call_prefetch(functools.partial(_tgmm_kernel, block_m=block_m), grid=(n_visits,), num_scalar_prefetch=1,
                 out_shape=jax.ShapeDtypeStruct((G, K, N), jnp.float32),
                 in_specs=[_ROWS(block_m, K), _ROWS(block_m, N)], out_specs=_GROUP(K, N))(meta, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_padded(x, w, group_sizes, block_m):
    return _gmm_call(x, w, group_sizes, block_m).astype(x.dtype)


def _gmm_fwd_rule(x, w, group_sizes, block_m):
    return _gmm_call(x, w, group_sizes, block_m).astype(x.dtype), (x, w, group_sizes)


def _gmm_bwd_rule(block_m, res, dy):
    x, w, group_sizes = res
    dx = _gmm_call(dy, jnp.swapaxes(w, 1, 2), group_sizes, block_m).astype(x.dtype)
    dw = tgmm_call(x, dy, group_sizes, block_m).astype(w.dtype)
    return dx, dw, None


_gmm_padded.defvjp(_gmm_fwd_rule, _gmm_bwd_rule)


@jax_op("gmm", static=("block_m",))
def gmm_jax(x, w, group_sizes, *, block_m):
    """x (M, K) rows sorted by group, w (G, K, N), group_sizes (G,) summing to M -> (M, N)."""
    M = x.shape[0]
    M_pad = round_up(M, block_m)
    return _gmm_padded(pad_to(x, M_pad, 0), w, group_sizes, block_m)[:M]


def gmm(x_MxK, w_GxKxN, group_sizes_G, block_m=128):
    """PyTorch entry point, same contract as model.gmm_reference."""
    if x_MxK.shape[0] == 0:  # (an expert-parallel rank sent no rows: nothing to tile; w's gradient is zero)
        return x_MxK.new_zeros((0, w_GxKxN.shape[2])) + 0 * w_GxKxN.sum().to(x_MxK.dtype)
    return gmm_jax(x_MxK, w_GxKxN, group_sizes_G, block_m=min(block_m, round_up(x_MxK.shape[0], NUM_SUBLANES)))


