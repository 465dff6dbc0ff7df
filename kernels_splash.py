"""kernels_splash.py: block-sparse flash attention as Pallas kernels, forward and backward
(FlashAttention, arXiv 2205.14135; JAX's splash_attention), for TPU.

The static mask (causal, sliding window, or none: FLUX's full attention) is turned on the host into,
per query block, the list of kv blocks to visit and whether each is FULL (no mask work) or PARTIAL
(mask evaluated in the kernel); EMPTY blocks are never visited. Packed documents (segment ids) are
data, so they are checked inside every visited block. Never S x S.

The visits are the grid's innermost axis: one program per (batch, head, query block, visit), and
the kv block a visit needs is chosen by its BlockSpec's index map from the prefetched block list, so
Pallas streams K and V through VMEM one block at a time (double-buffered) whatever the sequence
length. The online-softmax state (running max, sum, accumulator) lives in VMEM scratch across a
query block's visits; a row's visits past its count repeat its last block (no new copy) and skip the
work. The backward is two kernels that recompute probabilities block by block from the forward's
log-sum-exp: dq streams K/V blocks per query block; dk/dv streams, per kv block, the query blocks
that see it, for each query head of its group, computing the scores transposed (keys in rows) so
that per-query vectors (log-sum-exp, delta, segment ids) are rows and nothing is transposed.

TPU layout (Mosaic): a block's last two dims must be multiples of (8, 128) or whole. Per-row vectors
are therefore stored either lane-broadcast, (S, 128) with every lane equal (a column in VMEM: the
forward's m / l / log-sum-exp, the segment ids of the rows), or as (1, S) (a row: the segment ids of
the columns, the log-sum-exp and delta the backward reads), as JAX's splash stores them.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_op import jax_op
from kernels_pallas import (INTERPRET_BLOCKS, NEG_INF, NUM_LANES, NUM_SUBLANES, TPU_BLOCKS, dot_f32, pad_to,
                            pallas_call_prefetch, round_up, target_chip)

EMPTY, PARTIAL, FULL = 0, 1, 2


@functools.lru_cache(maxsize=None)
def block_layout(n_blocks, block, window, segments, causal=1, q_blocks=None, q_offset=0):
    """Host-side block sparsity: for each query block the kv blocks to visit and their kind, and the
    transposed lists for the dk/dv kernel. Returns numpy int32 (count, index, kind) x 2. Not causal:
    every block is live (FULL, or PARTIAL where segment ids must be checked). `n_blocks` kv blocks
    from position 0; `q_blocks` query blocks (default as many) from block `q_offset` on (a chunk of a
    sequence: context parallelism's)."""
    kinds = np.zeros((q_blocks or n_blocks, n_blocks), np.int32)
    for i in range(q_blocks or n_blocks):
        qs, qe = (q_offset + i) * block, (q_offset + i + 1) * block - 1
        for j in range(n_blocks):
            ks, ke = j * block, (j + 1) * block - 1
            if causal and (ks > qe or (window and qs - ke >= window)):
                continue  # EMPTY: every key is in the future, or out of the window
            full = (not causal or ke <= qs and (not window or qe - ks < window)) and not segments
            kinds[i, j] = FULL if full else PARTIAL

    def lists(k):
        count = (k != EMPTY).sum(1).astype(np.int32)
        index = np.zeros((k.shape[0], max(1, count.max())), np.int32)
        kind = np.zeros_like(index)
        for r in range(k.shape[0]):
            nz = np.nonzero(k[r])[0]
            index[r, :len(nz)], kind[r, :len(nz)] = nz, k[r, nz]
        return count, index, kind
    return lists(kinds) + lists(kinds.T)


def _mask(s, row0, col0, kind, window, seg_rows, seg_cols, causal, queries_in_rows):
    """Causal / window / segment masking of a scores block s (rows, cols) whose first row and column
    are positions row0, col0 (queries in rows, or keys in rows for the transposed dk/dv scores);
    seg_rows (rows, 128) lane-broadcast, seg_cols (1, cols). Only a PARTIAL block pays for it."""
    def masked(s):
        r = row0 + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        c = col0 + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        q, k = (r, c) if queries_in_rows else (c, r)
        keep = seg_rows[:, :1] == seg_cols
        if causal:
            keep = keep & (k <= q)
        if window:
            keep = keep & (q - k < window)
        return jnp.where(keep, s, NEG_INF)
    return jax.lax.cond(kind == FULL, lambda s: s, masked, s)


def _visit(cnt, r, body):
    """Run body() on a real visit (r < cnt); the grid's padding visits do nothing."""
    pl.when(r < cnt)(body)


def _splash_fwd_kernel(cnt, idx, kind, q_ref, k_ref, v_ref, segq_ref, segk_ref, o_ref, lse_ref,
                       m_sc, l_sc, acc_sc, *, block, window, scale, causal, q_off):
    i, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def body():
        s = _mask(dot_f32(q_ref[...], k_ref[...], trans_b=True) * scale, (q_off + i) * block, idx[i, t] * block,
                  kind[i, t], window, segq_ref[...], segk_ref[...], causal, True)
        m_prev = m_sc[...]                                     # (block, 128), every lane the same
        m_new = jnp.maximum(m_prev, s.max(-1, keepdims=True))
        p = jnp.exp(s - m_new[:, :1])
        corr = jnp.exp(m_prev - m_new)
        l_sc[...] = l_sc[...] * corr + p.sum(-1, keepdims=True)
        m_sc[...] = m_new
        acc_sc[...] = acc_sc[...] * corr[:, :1] + dot_f32(p.astype(v_ref.dtype), v_ref[...])
    _visit(cnt[i], t, body)

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        o_ref[...] = (acc_sc[...] / l_sc[...][:, :1]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


def _splash_dq_kernel(cnt, idx, kind, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref,
                      segk_ref, dq_ref, dq_sc, *, block, window, scale, causal, q_off):
    i, t = pl.program_id(2), pl.program_id(3)

    @pl.when(t == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def body():
        k = k_ref[...]
        s = _mask(dot_f32(q_ref[...], k, trans_b=True) * scale, (q_off + i) * block, idx[i, t] * block,
                  kind[i, t], window, segq_ref[...], segk_ref[...], causal, True)
        p = jnp.exp(s - lse_ref[0][:, None])                   # (a (1, block) row as a column)
        ds = p * (dot_f32(do_ref[...], v_ref[...], trans_b=True) - delta_ref[0][:, None])
        dq_sc[...] += dot_f32(ds.astype(k.dtype), k)
    _visit(cnt[i], t, body)

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _splash_dkv_kernel(cnt, idx, kind, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segk_ref,
                       segq_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, block, window, scale, causal, q_off):
    j, g, r = pl.program_id(2), pl.program_id(3), pl.program_id(4)  # kv block, head in group, visit

    @pl.when((g == 0) & (r == 0))
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def body():  # scores transposed: keys in rows, so the per-query vectors are (1, block) rows
        q, do = q_ref[...], do_ref[...]
        s_t = _mask(dot_f32(k_ref[...], q, trans_b=True) * scale, j * block, (q_off + idx[j, r]) * block,
                    kind[j, r], window, segk_ref[...], segq_ref[...], causal, False)
        p_t = jnp.exp(s_t - lse_ref[...])
        dv_sc[...] += dot_f32(p_t.astype(do.dtype), do)
        ds_t = p_t * (dot_f32(v_ref[...], do, trans_b=True) - delta_ref[...])
        dk_sc[...] += dot_f32(ds_t.astype(q.dtype), q)
    _visit(cnt[j], r, body)

    @pl.when((g == pl.num_programs(3) - 1) & (r == pl.num_programs(4) - 1))
    def _():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _visited(cnt, idx, row, t):
    """The block a visit reads: its row's t-th, or (padding visits) the row's last, already in VMEM."""
    return idx[row, jnp.minimum(t, cnt[row] - 1)]


def _seg_layouts(seg):
    """Segment ids (B, S) as rows of a block (B, S, 128), lane-broadcast, and as its columns (B, 1, S)."""
    B, S = seg.shape
    return jax.lax.broadcast_in_dim(seg, (B, S, NUM_LANES), (0, 1)), seg[:, None, :]


def _scratch(*shapes):
    return [pltpu.VMEM(s, jnp.float32) for s in shapes]


def _splash_forward(q, k, v, seg_q, seg_k, window, block, segments, causal, q_off):
    B, H, S, D = q.shape
    group, n, n_kv = H // k.shape[1], S // block, k.shape[2] // block
    cnt, idx, kind, *_ = map(jnp.asarray, block_layout(n_kv, block, window, segments, causal, n, q_off))
    q_blk = pl.BlockSpec((None, None, block, D), lambda b, h, i, t, *_: (b, h, i, 0))
    kv_blk = pl.BlockSpec((None, None, block, D), lambda b, h, i, t, c, x, _: (b, h // group, _visited(c, x, i, t), 0))
    lanes = pl.BlockSpec((None, None, block, NUM_LANES), lambda b, h, i, t, *_: (b, h, i, 0))
    seg_rows = pl.BlockSpec((None, block, NUM_LANES), lambda b, h, i, t, *_: (b, i, 0))
    seg_cols = pl.BlockSpec((None, 1, block), lambda b, h, i, t, c, x, _: (b, 0, _visited(c, x, i, t)))
    kern = functools.partial(_splash_fwd_kernel, block=block, window=window, scale=D ** -0.5, causal=causal,
                             q_off=q_off)
    o, lse = pallas_call_prefetch(
        kern, grid=(B, H, n, idx.shape[1]), num_scalar_prefetch=3,     # cnt, idx, kind
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, S, NUM_LANES), jnp.float32)),
        in_specs=[q_blk, kv_blk, kv_blk, seg_rows, seg_cols], out_specs=[q_blk, lanes],
        scratch_shapes=_scratch((block, NUM_LANES), (block, NUM_LANES), (block, D)),
        parallel=3)(cnt, idx, kind, q, k, v, _seg_layouts(seg_q)[0], _seg_layouts(seg_k)[1])
    return o, lse[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _splash_padded(q, k, v, seg_q, seg_k, window, block, segments, causal, q_off):
    return _splash_forward(q, k, v, seg_q, seg_k, window, block, segments, causal, q_off)[0]


def _splash_fwd_rule(q, k, v, seg_q, seg_k, window, block, segments, causal, q_off):
    o, lse = _splash_forward(q, k, v, seg_q, seg_k, window, block, segments, causal, q_off)
    return o, (q, k, v, seg_q, seg_k, o, lse)


def _splash_bwd_rule(window, block, segments, causal, q_off, res, do):
    q, k, v, seg_q, seg_k, o, lse = res
    B, H, S, D = q.shape
    Hkv, n, n_kv, group = k.shape[1], S // block, k.shape[2] // block, H // k.shape[1]
    delta = (o.astype(jnp.float32) * do.astype(jnp.float32)).sum(-1)  # (B, H, S)
    lse, delta = lse[:, :, None, :], delta[:, :, None, :]             # (B, H, 1, S): rows
    cnt, idx, kind, cnt_t, idx_t, kind_t = map(jnp.asarray, block_layout(n_kv, block, window, segments, causal, n,
                                                                         q_off))
    (q_rows, q_cols), (k_rows, k_cols) = _seg_layouts(seg_q), _seg_layouts(seg_k)
    statics = dict(block=block, window=window, scale=D ** -0.5, causal=causal, q_off=q_off)
    # dq: one program per (batch, head, q block, visit), K/V blocks streamed as in the forward
    q_blk = pl.BlockSpec((None, None, block, D), lambda b, h, i, t, *_: (b, h, i, 0))
    kv_blk = pl.BlockSpec((None, None, block, D), lambda b, h, i, t, c, x, _: (b, h // group, _visited(c, x, i, t), 0))
    row_vec = pl.BlockSpec((None, None, 1, block), lambda b, h, i, t, *_: (b, h, 0, i))
    dq = pallas_call_prefetch(
        functools.partial(_splash_dq_kernel, **statics), grid=(B, H, n, idx.shape[1]), num_scalar_prefetch=3,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        in_specs=[q_blk, kv_blk, kv_blk, q_blk, row_vec, row_vec,     # q k v do lse delta
                  pl.BlockSpec((None, block, NUM_LANES), lambda b, h, i, t, *_: (b, i, 0)),
                  pl.BlockSpec((None, 1, block), lambda b, h, i, t, c, x, _: (b, 0, _visited(c, x, i, t)))],
        out_specs=q_blk, scratch_shapes=_scratch((block, D)), parallel=3,
    )(cnt, idx, kind, q, k, v, do, lse, delta, q_rows, k_cols)
    # dk/dv: one program per (batch, kv head, kv block, query head of its group, visit); the q blocks
    # that see the kv block (the transposed lists) streamed
    qh = lambda h, g: h * group + g
    q_vis = pl.BlockSpec((None, None, block, D), lambda b, h, j, g, r, c, x, _: (b, qh(h, g), _visited(c, x, j, r), 0))
    vec_vis = pl.BlockSpec((None, None, 1, block), lambda b, h, j, g, r, c, x, _: (b, qh(h, g), 0, _visited(c, x, j, r)))
    kv_own = pl.BlockSpec((None, None, block, D), lambda b, h, j, *_: (b, h, j, 0))
    dk, dv = pallas_call_prefetch(
        functools.partial(_splash_dkv_kernel, **statics), grid=(B, Hkv, n_kv, group, idx_t.shape[1]),
        num_scalar_prefetch=3,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        in_specs=[q_vis, kv_own, kv_own, q_vis, vec_vis, vec_vis,   # q k v do lse delta
                  pl.BlockSpec((None, block, NUM_LANES), lambda b, h, j, *_: (b, j, 0)),
                  pl.BlockSpec((None, 1, block), lambda b, h, j, g, r, c, x, _: (b, 0, _visited(c, x, j, r)))],
        out_specs=[kv_own, kv_own], scratch_shapes=_scratch((block, D), (block, D)), parallel=3,
    )(cnt_t, idx_t, kind_t, q, k, v, do, lse, delta, k_rows, q_cols)
    return dq, dk, dv, None, None


_splash_padded.defvjp(_splash_fwd_rule, _splash_bwd_rule)


@jax_op("splash", static=("window", "block", "segments", "causal"))
def splash_jax(q, k, v, segment_ids, *, window, block, segments, causal=1):
    """q (B, H, S, D), k/v (B, Hkv, S, D), segment_ids (B, S) int -> (B, H, S, D). q is scaled by
    1/sqrt(D) inside. window 0 = none. S is padded up to a multiple of block: padded keys are in
    every real query's future (causal), or carry segment id -1, which no real query has (not causal:
    then the segment check must be on, `segments` 1)."""
    S = q.shape[2]
    S_pad = round_up(S, block)
    seg = pad_to(segment_ids, S_pad, 1, -1)
    out = _splash_padded(pad_to(q, S_pad, 2), pad_to(k, S_pad, 2), pad_to(v, S_pad, 2), seg, seg, window, block,
                         segments, causal, 0)
    return out[:, :, :S]


@jax_op("splash_chunk", static=("q_offset", "window", "block", "segments"))
def splash_chunk_jax(q, k, v, q_segment_ids, kv_segment_ids, *, q_offset, window, block, segments):
    """Causal splash attention of a chunk of queries q (B, H, Sq, D) at global positions q_offset,
    q_offset + 1, ... (a multiple of block) over the keys k / v (B, Hkv, Sk, D) at positions 0..Sk-1,
    with the chunk's and the keys' own segment ids (B, Sq), (B, Sk). Keys past the chunk's last query
    are never visited; padded keys sit past every real query."""
    Sq, Sk = q.shape[2], k.shape[2]
    Sq_pad, Sk_pad = round_up(Sq, block), round_up(Sk, block)
    out = _splash_padded(pad_to(q, Sq_pad, 2), pad_to(k, Sk_pad, 2), pad_to(v, Sk_pad, 2),
                         pad_to(q_segment_ids, Sq_pad, 1, -1), pad_to(kv_segment_ids, Sk_pad, 1, -1), window, block,
                         segments, 1, q_offset // block)
    return out[:, :, :Sq]


def splash_block(seq_len, chip=None):
    """The query / key block for a sequence: the chip's (TPU_BLOCKS), else interpret mode's; no
    larger than the (padded) sequence."""
    return min(TPU_BLOCKS[chip]["splash"] if chip else INTERPRET_BLOCKS["splash"], round_up(seq_len, NUM_SUBLANES))


def splash_attention(q, k, v, window=None, segment_ids=None, block=None, causal=True):
    """PyTorch entry point, same contract as model.sdpa_attention; causal=False: full attention
    (every block live; a window is a causal notion and refused). The block the chip's (splash_block)."""
    if window and not causal:
        raise ValueError("a sliding window is causal: not with causal=False")
    S = q.shape[2]
    block = min(block, round_up(S, NUM_SUBLANES)) if block else splash_block(S, target_chip())
    seg = segment_ids if segment_ids is not None else q.new_zeros(q.shape[0], S, dtype=torch.int32)
    segments = segment_ids is not None or (not causal and S % block != 0)  # (padded keys: segment -1)
    return splash_jax(q, k, v, seg, window=window or 0, block=block, segments=int(segments), causal=int(causal))


def splash_chunk_attention(q, k, v, q_offset, window=None, q_segment_ids=None, kv_segment_ids=None):
    """Causal attention of a chunk of queries at global positions q_offset.. over the keys 0..Sk-1
    (context parallelism: a rank's head or tail chunk over the gathered sequence up to its end). The
    block is the largest power of two up to 128 dividing both the chunk's length and its offset, so
    chunks start on block boundaries and nothing is padded (on a TPU it must be a multiple of 8)."""
    import math
    block = math.gcd(math.gcd(q.shape[2], q_offset or q.shape[2]), 128)  # (gcd with 128: a power of two)
    segments = q_segment_ids is not None
    q_seg = q_segment_ids if segments else q.new_zeros(q.shape[0], q.shape[2], dtype=torch.int32)
    kv_seg = kv_segment_ids if segments else q.new_zeros(k.shape[0], k.shape[2], dtype=torch.int32)
    return splash_chunk_jax(q, k, v, q_seg, kv_seg, q_offset=q_offset, window=window or 0, block=block,
                            segments=int(segments))


def splash_full_attention(q_BxHxSxD, k_BxHkvxSxD, v_BxHkvxSxD, block=128):
    """Non-causal splash attention (FLUX's joint attention over text + image): flux/model.py's "splash"."""
    return splash_attention(q_BxHxSxD, k_BxHkvxSxD, v_BxHkvxSxD, block=block, causal=False)
