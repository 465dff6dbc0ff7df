"""kernels_pallas.py: Pallas kernels that never write their big intermediates to memory, and the
Pallas plumbing they share with kernels_gmm.py (the grouped matmul for MoE).

1. splash attention: block-sparse flash attention (FlashAttention, arXiv 2205.14135; JAX's
   splash_attention). The static mask (causal, sliding window, or none: FLUX's full attention) is
   turned on the host into, per query block, the list of kv blocks to visit and whether each is
   FULL (no mask work) or PARTIAL (mask evaluated in the kernel); EMPTY blocks are never visited.
   Packed documents (segment ids) are data, so they are checked inside every visited block. Online
   softmax; the log-sum-exp is kept for the backward, whose dq and dk/dv kernels recompute
   probabilities block by block. Never S x S.
2. fused final projection + cross-entropy: running log-sum-exp over vocabulary tiles; the backward
   recomputes each logits tile to form dh and dW. Never tokens x vocab.

Each is a JAX function with a jax.custom_vjp (Pallas forward and backward kernels), registered as a
PyTorch op by jax_op.py and named in model.py's / flux/model.py's tables ("splash", "fused"). Mosaic
compiles them on TPU; everywhere else they run in Pallas interpret mode (one switch: INTERPRET).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_op import jax_op

INTERPRET = jax.default_backend() != "tpu"
NEG_INF = -1e30  # finite: exp(NEG_INF - m) == 0 without inf - inf = nan
EMPTY, PARTIAL, FULL = 0, 1, 2
# TPU vector registers are (8 sublanes x 128 lanes) of 32-bit values: a block's last dim should be a
# multiple of NUM_LANES and its second-to-last of NUM_SUBLANES, or Mosaic pads (or refuses) it.
NUM_LANES, NUM_SUBLANES = 128, 8


def round_up(x, multiple):
    """The smallest multiple of `multiple` that is >= x (sizes padded to whole blocks)."""
    return -(-x // multiple) * multiple


def pad_to(x, size, axis, value=0):
    """x padded with `value` along `axis` to `size` (sizes rounded up to whole blocks)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def dot_f32(a, b, trans_b=False):
    dims = (((1,), (1,)), ((), ())) if trans_b else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def pallas_call_prefetch(kernel, *, out_shape, grid, in_specs, out_specs, num_scalar_prefetch=0):
    """pl.pallas_call with scalar prefetch: the first `num_scalar_prefetch` operands are small int
    arrays (block lists, visit metadata) placed in SMEM and passed to every index map; in_specs
    describe the remaining operands, in order."""
    return pl.pallas_call(kernel, out_shape=out_shape, interpret=INTERPRET,
                          grid_spec=pltpu.PrefetchScalarGridSpec(
                              num_scalar_prefetch=num_scalar_prefetch, grid=grid, in_specs=in_specs,
                              out_specs=out_specs))


# ================================================================================================
# 1. Splash attention

@functools.lru_cache(maxsize=None)
def block_layout(n_blocks, block, window, segments, causal=1):
    """Host-side block sparsity: for each query block the kv blocks to visit and their kind, and the
    transposed lists for the dk/dv kernel. Returns numpy int32 (count, index, kind) x 2. Not causal:
    every block is live (FULL, or PARTIAL where segment ids must be checked)."""
    kinds = np.zeros((n_blocks, n_blocks), np.int32)
    for i in range(n_blocks):
        qs, qe = i * block, (i + 1) * block - 1
        for j in range(n_blocks):
            ks, ke = j * block, (j + 1) * block - 1
            if causal and (ks > qe or (window and qs - ke >= window)):
                continue  # EMPTY: every key is in the future, or out of the window
            full = (not causal or ke <= qs and (not window or qe - ks < window)) and not segments
            kinds[i, j] = FULL if full else PARTIAL

    def lists(k):
        count = (k != EMPTY).sum(1).astype(np.int32)
        index = np.zeros((n_blocks, max(1, count.max())), np.int32)
        kind = np.zeros_like(index)
        for r in range(n_blocks):
            nz = np.nonzero(k[r])[0]
            index[r, :len(nz)], kind[r, :len(nz)] = nz, k[r, nz]
        return count, index, kind
    return lists(kinds) + lists(kinds.T)


def _mask(s, q_block, k_block, block, kind, window, segq, segk, causal):
    """Apply causal / window / segment masking to scores s (block, block), only if kind is PARTIAL."""
    def masked(s):
        q = q_block * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        k = k_block * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        keep = segq[:, None] == segk[None, :]
        if causal:
            keep = keep & (k <= q)
        if window:
            keep = keep & (q - k < window)
        return jnp.where(keep, s, NEG_INF)
    return jax.lax.cond(kind == FULL, lambda s: s, masked, s)


def _splash_fwd_kernel(cnt, idx, kind, q_ref, k_ref, v_ref, segq_ref, segk_ref, o_ref, lse_ref,
                       *, block, window, scale, causal):
    i = pl.program_id(2)
    q = q_ref[...]

    def body(t, carry):
        m, l, acc = carry
        j = idx[i, t]
        k, v = k_ref[pl.ds(j * block, block), :], v_ref[pl.ds(j * block, block), :]
        s = _mask(dot_f32(q, k, trans_b=True) * scale, i, j, block, kind[i, t], window,
                  segq_ref[...], segk_ref[pl.ds(j * block, block)], causal)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + p.sum(-1), acc * corr[:, None] + dot_f32(p.astype(v.dtype), v)

    init = (jnp.full((block,), NEG_INF, jnp.float32), jnp.zeros((block,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, cnt[i], body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _splash_dq_kernel(cnt, idx, kind, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref,
                      segk_ref, dq_ref, *, block, window, scale, causal):
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(t, dq):
        j = idx[i, t]
        k, v = k_ref[pl.ds(j * block, block), :], v_ref[pl.ds(j * block, block), :]
        s = _mask(dot_f32(q, k, trans_b=True) * scale, i, j, block, kind[i, t], window,
                  segq_ref[...], segk_ref[pl.ds(j * block, block)], causal)
        p = jnp.exp(s - lse[:, None])
        ds = p * (dot_f32(do, v, trans_b=True) - delta[:, None])
        return dq + dot_f32(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, cnt[i], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _splash_dkv_kernel(cnt, idx, kind, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, segq_ref,
                       segk_ref, dk_ref, dv_ref, *, block, window, scale, group, causal):
    j = pl.program_id(2)
    k, v, segk = k_ref[...], v_ref[...], segk_ref[...]

    def body(t, carry):  # t runs over (query head in this kv head's group) x (visited q blocks)
        dk, dv = carry
        g, r = t // cnt[j], t % cnt[j]
        i = idx[j, r]
        rows = pl.ds(i * block, block)
        q, do = q_ref[g, rows, :], do_ref[g, rows, :]
        s = _mask(dot_f32(q, k, trans_b=True) * scale, i, j, block, kind[j, r], window,
                  segq_ref[rows], segk, causal)
        p = jnp.exp(s - lse_ref[g, rows][:, None])
        dv = dv + dot_f32(p.T.astype(do.dtype), do)
        ds = p * (dot_f32(do, v, trans_b=True) - delta_ref[g, rows][:, None])
        return dk + dot_f32(ds.T.astype(q.dtype), q), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group * cnt[j], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _splash_specs(B, H, Hkv, S, D, block, group):
    q_blk = pl.BlockSpec((None, None, block, D), lambda b, h, i, *_: (b, h, i, 0))
    kv_all = pl.BlockSpec((None, None, S, D), lambda b, h, i, *_: (b, h // group, 0, 0))
    row_blk = pl.BlockSpec((None, None, block), lambda b, h, i, *_: (b, h, i))
    segq = pl.BlockSpec((None, block), lambda b, h, i, *_: (b, i))
    segk = pl.BlockSpec((None, S), lambda b, h, i, *_: (b, 0))
    return q_blk, kv_all, row_blk, segq, segk


def _splash_forward(q, k, v, seg, window, block, segments, causal):
    B, H, S, D = q.shape
    Hkv, n = k.shape[1], q.shape[2] // block
    cnt, idx, kind, *_ = map(jnp.asarray, block_layout(n, block, window, segments, causal))
    q_blk, kv_all, row_blk, segq, segk = _splash_specs(B, H, Hkv, S, D, block, H // Hkv)
    kern = functools.partial(_splash_fwd_kernel, block=block, window=window, scale=D ** -0.5, causal=causal)
    call = pallas_call_prefetch(kern, grid=(B, H, n),
                 out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),             # o
                            jax.ShapeDtypeStruct((B, H, S), jnp.float32)),       # lse
                 num_scalar_prefetch=3,                                          # cnt, idx, kind
                 in_specs=[q_blk, kv_all, kv_all, segq, segk],                  # q, k, v, seg (q), seg (k)
                 out_specs=[q_blk, row_blk])
    return call(cnt, idx, kind, q, k, v, seg, seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _splash_padded(q, k, v, seg, window, block, segments, causal):
    return _splash_forward(q, k, v, seg, window, block, segments, causal)[0]


def _splash_fwd_rule(q, k, v, seg, window, block, segments, causal):
    o, lse = _splash_forward(q, k, v, seg, window, block, segments, causal)
    return o, (q, k, v, seg, o, lse)


def _splash_bwd_rule(window, block, segments, causal, res, do):
    q, k, v, seg, o, lse = res
    B, H, S, D = q.shape
    Hkv, n, group = k.shape[1], S // block, H // k.shape[1]
    delta = (o.astype(jnp.float32) * do.astype(jnp.float32)).sum(-1)  # (B, H, S)
    cnt, idx, kind, cnt_t, idx_t, kind_t = map(jnp.asarray, block_layout(n, block, window, segments, causal))
    q_blk, kv_all, row_blk, segq, segk = _splash_specs(B, H, Hkv, S, D, block, group)
    dq = pallas_call_prefetch(functools.partial(_splash_dq_kernel, block=block, window=window, scale=D ** -0.5, causal=causal),
               grid=(B, H, n), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), num_scalar_prefetch=3,
               in_specs=[q_blk, kv_all, kv_all, q_blk, row_blk, row_blk, segq, segk],  # q k v do lse delta seg seg
               out_specs=q_blk)(cnt, idx, kind, q, k, v, do, lse, delta, seg, seg)
    # dk/dv: one program per (batch, kv head, kv block); the group's query heads are looped inside.
    grp = lambda x: x.reshape(B, Hkv, group, *x.shape[2:])
    q_grp = pl.BlockSpec((None, None, group, S, D), lambda b, h, j, *_: (b, h, 0, 0, 0))
    r_grp = pl.BlockSpec((None, None, group, S), lambda b, h, j, *_: (b, h, 0, 0))
    kv_blk = pl.BlockSpec((None, None, block, D), lambda b, h, j, *_: (b, h, j, 0))
    seg_all = pl.BlockSpec((None, S), lambda b, h, j, *_: (b, 0))
    seg_blk = pl.BlockSpec((None, block), lambda b, h, j, *_: (b, j))
    dk, dv = pallas_call_prefetch(functools.partial(_splash_dkv_kernel, block=block, window=window, scale=D ** -0.5, group=group,
                                     causal=causal),
                   grid=(B, Hkv, n), num_scalar_prefetch=3,  # the transposed block lists: q blocks per kv block
                   out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                   in_specs=[q_grp, kv_blk, kv_blk, q_grp, r_grp, r_grp, seg_all, seg_blk],  # q k v do lse delta seg seg
                   out_specs=[kv_blk, kv_blk])(cnt_t, idx_t, kind_t, grp(q), k, v, grp(do), grp(lse), grp(delta), seg, seg)
    return dq, dk, dv, None


_splash_padded.defvjp(_splash_fwd_rule, _splash_bwd_rule)


@jax_op("splash", static=("window", "block", "segments", "causal"))
def splash_jax(q, k, v, segment_ids, *, window, block, segments, causal=1):
    """q (B, H, S, D), k/v (B, Hkv, S, D), segment_ids (B, S) int -> (B, H, S, D). q is scaled by
    1/sqrt(D) inside. window 0 = none. S is padded up to a multiple of block: padded keys are in
    every real query's future (causal), or carry segment id -1, which no real query has (not causal:
    then the segment check must be on, `segments` 1)."""
    S = q.shape[2]
    S_pad = round_up(S, block)
    out = _splash_padded(pad_to(q, S_pad, 2), pad_to(k, S_pad, 2), pad_to(v, S_pad, 2),
                         pad_to(segment_ids, S_pad, 1, -1), window, block, segments, causal)
    return out[:, :, :S]


def splash_attention(q, k, v, window=None, segment_ids=None, block=128, causal=True):
    """PyTorch entry point, same contract as model.sdpa_attention; causal=False: full attention
    (every block live; a window is a causal notion and refused)."""
    if window and not causal:
        raise ValueError("a sliding window is causal: not with causal=False")
    S = q.shape[2]
    block = min(block, round_up(S, NUM_SUBLANES))
    seg = segment_ids if segment_ids is not None else q.new_zeros(q.shape[0], S, dtype=torch.int32)
    segments = segment_ids is not None or (not causal and S % block != 0)  # (padded keys: segment -1)
    return splash_jax(q, k, v, seg, window=window or 0, block=block, segments=int(segments), causal=int(causal))


def splash_full_attention(q_BxHxSxD, k_BxHkvxSxD, v_BxHkvxSxD, block=128):
    """Non-causal splash attention (FLUX's joint attention over text + image): flux/model.py's "splash"."""
    return splash_attention(q_BxHxSxD, k_BxHkvxSxD, v_BxHkvxSxD, block=block, causal=False)

# ================================================================================================
# 2. Fused final projection + cross-entropy

def _logits_tile(h_ref, w_ref, j, block_v, vocab):
    s = dot_f32(h_ref[...], w_ref[...], trans_b=True)                        # (bn, bv) fp32
    col = j * block_v + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return jnp.where(col < vocab, s, NEG_INF), col                        # padded vocab -> -inf


def _ce_fwd_kernel(h_ref, w_ref, t_ref, m_ref, l_ref, tl_ref, *, block_v, vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        tl_ref[...] = jnp.zeros(tl_ref.shape, jnp.float32)

    s, col = _logits_tile(h_ref, w_ref, j, block_v, vocab)
    m_old = m_ref[...]
    m_new = jnp.maximum(m_old, s.max(-1))
    l_ref[...] = l_ref[...] * jnp.exp(m_old - m_new) + jnp.exp(s - m_new[:, None]).sum(-1)
    m_ref[...] = m_new
    tl_ref[...] += jnp.where(col == t_ref[...][:, None], s, 0.0).sum(-1)


def _ce_dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab):
    s, col = _logits_tile(h_ref, w_ref, j, block_v, vocab)
    p = jnp.exp(s - lse_ref[...][:, None])
    return (p - (col == t_ref[...][:, None])) * g_ref[...][:, None]      # (bn, bv)


def _ce_dh_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dh_ref, *, block_v, vocab):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        dh_ref[...] = jnp.zeros(dh_ref.shape, dh_ref.dtype)

    d = _ce_dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab)
    dh_ref[...] += dot_f32(d.astype(w_ref.dtype), w_ref[...])


def _ce_dw_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dw_ref, *, block_v, vocab):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)

    d = _ce_dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab)
    dw_ref[...] += dot_f32(d.T.astype(h_ref.dtype), h_ref[...])


def _ce_specs(D, bn, bv, vocab_major):
    """BlockSpecs for (h, w, per-row vectors...) on a (row, vocab) or (vocab, row) grid."""
    if vocab_major:
        return (pl.BlockSpec((bn, D), lambda j, i: (i, 0)), pl.BlockSpec((bv, D), lambda j, i: (j, 0)),
                pl.BlockSpec((bn,), lambda j, i: (i,)))
    return (pl.BlockSpec((bn, D), lambda i, j: (i, 0)), pl.BlockSpec((bv, D), lambda i, j: (j, 0)),
            pl.BlockSpec((bn,), lambda i, j: (i,)))


def _ce_lse(h, w, t, vocab, bn, bv):
    N, D = h.shape
    h_s, w_s, r_s = _ce_specs(D, bn, bv, False)
    row = jax.ShapeDtypeStruct((N,), jnp.float32)
    m, l, tl = pallas_call_prefetch(functools.partial(_ce_fwd_kernel, block_v=bv, vocab=vocab), grid=(N // bn, w.shape[0] // bv),
                     out_shape=(row, row, row),                 # running max, running sum, target logit
                     in_specs=[h_s, w_s, r_s], out_specs=[r_s, r_s, r_s])(h, w, t)
    return m + jnp.log(l), tl


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
    h_s, w_s, r_s = _ce_specs(D, bn, bv, False)
    dh = pallas_call_prefetch(functools.partial(_ce_dh_kernel, **kw), grid=(N // bn, V // bv),   # rows outer, vocab inner
               out_shape=jax.ShapeDtypeStruct(h.shape, jnp.float32),
               in_specs=[h_s, w_s, r_s, r_s, r_s], out_specs=h_s)(h, w, t, lse, g_rows)
    h_s, w_s, r_s = _ce_specs(D, bn, bv, True)
    dw = pallas_call_prefetch(functools.partial(_ce_dw_kernel, **kw), grid=(V // bv, N // bn),   # vocab outer, rows inner
               out_shape=jax.ShapeDtypeStruct(w.shape, jnp.float32),
               in_specs=[h_s, w_s, r_s, r_s, r_s], out_specs=w_s)(h, w, t, lse, g_rows)
    return dh.astype(h.dtype), dw.astype(w.dtype), None


_ce_padded.defvjp(_ce_fwd_rule, _ce_bwd_rule)


@jax_op("fused_linear_cross_entropy", static=("ignore_index", "block_n", "block_v"))
def fused_ce_jax(h, w, targets, *, ignore_index, block_n, block_v):
    """mean over non-ignored rows of cross_entropy(h @ w.T, targets); h (N, D), w (V, D)."""
    (N, _), V = h.shape, w.shape[0]
    N_pad, V_pad = round_up(N, block_n), round_up(V, block_v)
    return _ce_padded(pad_to(h, N_pad, 0), pad_to(w, V_pad, 0),
                      pad_to(targets, N_pad, 0, ignore_index), V, ignore_index, block_n, block_v)


def fused_linear_cross_entropy(h_NxD, w_VxD, targets_N, ignore_index=-100, block_n=256, block_v=512):
    """PyTorch entry point, same contract as model.plain_cross_entropy."""
    block_n = min(block_n, round_up(h_NxD.shape[0], NUM_SUBLANES))  # rows: the sublane dim of a logits tile
    block_v = min(block_v, round_up(w_VxD.shape[0], NUM_LANES))     # vocab: its lane dim
    return fused_ce_jax(h_NxD, w_VxD, targets_N, ignore_index=ignore_index, block_n=block_n, block_v=block_v)
