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
from jax.experimental.pallas import tpu as pltpu

from jax_op import jax_op
from kernels_pallas import (INTERPRET_BLOCKS, NUM_LANES, NUM_SUBLANES, TPU_BLOCKS, dot_f32, pad_to, pallas_call_prefetch,
                            round_up, target_chip, tile)

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


def _edges(meta, v, key, axis):
    """(first, last): is visit v the first / the last of the consecutive visits sharing meta row
    `key` (0: the row tile, gmm's output block; 1: the group, tgmm's)? The output block stays in VMEM
    across them: zeroed at the first, written back after the last. `axis`: the grid's visits axis
    (gmm's 1, tgmm's 2: counting the n tiles instead flagged a group's first visit its last where
    there is one n tile, and its weight gradient kept only that visit's rows)."""
    n = pl.num_programs(axis)
    first = (v == 0) | (meta[key, v] != meta[key, jnp.maximum(v - 1, 0)])
    last = (v == n - 1) | (meta[key, v] != meta[key, jnp.minimum(v + 1, n - 1)])
    return first, last


def _gmm_kernel(meta, x_ref, w_ref, o_ref, acc, *, block_m, transpose_w):
    v, k = pl.program_id(1), pl.program_id(2)
    first, last = _edges(meta, v, 0, 1)

    @pl.when(first & (k == 0))
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    x = jnp.where(_rows_in_group(meta, v, x_ref.shape, block_m), x_ref[...], 0)
    acc[...] += dot_f32(x, w_ref[...], trans_b=transpose_w)

    @pl.when(last & (k == pl.num_programs(2) - 1))
    def _():
        o_ref[...] = acc[...].astype(o_ref.dtype)


def _tgmm_kernel(meta, x_ref, dy_ref, dw_ref, acc, *, block_m):
    v = pl.program_id(2)
    first, last = _edges(meta, v, 1, 2)

    @pl.when(first)
    def _():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    x = jnp.where(_rows_in_group(meta, v, x_ref.shape, block_m), x_ref[...], 0)
    acc[...] += dot_f32(x.T, dy_ref[...])

    @pl.when(last)
    def _():
        dw_ref[...] = acc[...].astype(dw_ref.dtype)


def _gmm_call(x, w, group_sizes, block_m, block_k, block_n, transpose_w=False):
    """x (M, K) @ w[group] (K, N) (w (G, N, K) read transposed when transpose_w: the backward's dx
    without a transposed copy of the weights). Grid (n tiles, visits, k tiles), k innermost: each
    output tile accumulates in fp32 VMEM over k and over its consecutive visits."""
    (M, K), N = x.shape, w.shape[1 if transpose_w else 2]
    tk, tn = tile(K, block_k), tile(N, block_n)
    meta, n_visits = group_metadata(group_sizes, M // block_m, block_m)
    w_spec = (pl.BlockSpec((None, tn, tk), lambda n, v, k, m: (m[1, v], n, k)) if transpose_w else
              pl.BlockSpec((None, tk, tn), lambda n, v, k, m: (m[1, v], k, n)))
    kern = functools.partial(_gmm_kernel, block_m=block_m, transpose_w=transpose_w)
    return pallas_call_prefetch(kern, grid=(N // tn, n_visits, K // tk), num_scalar_prefetch=1,
                 out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
                 in_specs=[pl.BlockSpec((block_m, tk), lambda n, v, k, m: (m[0, v], k)), w_spec],
                 out_specs=pl.BlockSpec((block_m, tn), lambda n, v, k, m: (m[0, v], n)),
                 scratch_shapes=[pltpu.VMEM((block_m, tn), jnp.float32)], parallel=1)(meta, x, w)


def tgmm_call(x, dy, group_sizes, block_m, block_k=None, block_n=None, out_dtype=jnp.float32):
    """dw[g] = x[rows of g]^T @ dy[rows of g]: (G, K, N). Grid (k tiles, n tiles, visits), visits
    innermost: a group's (tk, tn) block accumulates over its visits (an empty group's one visit
    writes zeros)."""
    (M, K), N, G = x.shape, dy.shape[1], group_sizes.shape[0]
    tk, tn = tile(K, block_k or K), tile(N, block_n or N)
    meta, n_visits = group_metadata(group_sizes, M // block_m, block_m)
    return pallas_call_prefetch(functools.partial(_tgmm_kernel, block_m=block_m), grid=(K // tk, N // tn, n_visits),
                 num_scalar_prefetch=1, out_shape=jax.ShapeDtypeStruct((G, K, N), out_dtype),
                 in_specs=[pl.BlockSpec((block_m, tk), lambda k, n, v, m: (m[0, v], k)),
                           pl.BlockSpec((block_m, tn), lambda k, n, v, m: (m[0, v], n))],
                 out_specs=pl.BlockSpec((None, tk, tn), lambda k, n, v, m: (m[1, v], k, n)),
                 scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)], parallel=2)(meta, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_padded(x, w, group_sizes, block_m, block_k, block_n):
    return _gmm_call(x, w, group_sizes, block_m, block_k, block_n)


def _gmm_fwd_rule(x, w, group_sizes, block_m, block_k, block_n):
    return _gmm_call(x, w, group_sizes, block_m, block_k, block_n), (x, w, group_sizes)


def _gmm_bwd_rule(block_m, block_k, block_n, res, dy):
    x, w, group_sizes = res
    dx = _gmm_call(dy, w, group_sizes, block_m, block_n, block_k, transpose_w=True)
    dw = tgmm_call(x, dy, group_sizes, block_m, block_k, block_n, w.dtype)
    return dx, dw, None


_gmm_padded.defvjp(_gmm_fwd_rule, _gmm_bwd_rule)


@jax_op("gmm", static=("block_m", "block_k", "block_n"))
def gmm_jax(x, w, group_sizes, *, block_m, block_k=0, block_n=0):
    """x (M, K) rows sorted by group, w (G, K, N), group_sizes (G,) summing to M -> (M, N).
    Tiling (megablox's tiling=(tm, tk, tn)): block_m rows, K and N in tiles of at most block_k /
    block_n lanes (`tile`; 0: whole). group_sizes (R, G): x is R equal blocks of rows (the MoE's
    routing groups, model.MoE), block r sorted by group_sizes[r]: one kernel call a block."""
    if group_sizes.ndim == 2:
        blocks = jnp.split(x, group_sizes.shape[0])
        return jnp.concatenate([gmm_jax.jax_fn(b, w, sizes, block_m=block_m, block_k=block_k, block_n=block_n)
                                for b, sizes in zip(blocks, group_sizes)])
    (M, K), N = x.shape, w.shape[2]
    M_pad = round_up(M, block_m)
    return _gmm_padded(pad_to(x, M_pad, 0), w, group_sizes, block_m, block_k or K, block_n or N)[:M]


def gmm_tiles(rows, chip=None):
    """(block_m, block_k, block_n) for `rows` routed rows: the chip's (TPU_BLOCKS), else interpret
    mode's (0: K / N whole); block_m no larger than the rows, padded to whole sublanes (on a chip to
    whole lanes too: the weight gradient's kernel contracts over them)."""
    tm, tk, tn = TPU_BLOCKS[chip]["gmm"] if chip else INTERPRET_BLOCKS["gmm"]
    return min(tm, round_up(rows, NUM_LANES if chip else NUM_SUBLANES)), tk, tn


def gmm(x_MxK, w_GxKxN, group_sizes_G, block_m=None, block_k=None, block_n=None):
    """PyTorch entry point, same contract as model.gmm_reference; the tiles the chip's (gmm_tiles)."""
    if x_MxK.shape[0] == 0:  # (an expert-parallel rank sent no rows: nothing to tile; w's gradient is zero)
        return x_MxK.new_zeros((0, w_GxKxN.shape[2])) + 0 * w_GxKxN.sum().to(x_MxK.dtype)
    tm, tk, tn = gmm_tiles(x_MxK.shape[0], target_chip())
    return gmm_jax(x_MxK, w_GxKxN, group_sizes_G, block_m=min(block_m or tm, round_up(x_MxK.shape[0], NUM_SUBLANES)),
                   block_k=tk if block_k is None else block_k, block_n=tn if block_n is None else block_n)
