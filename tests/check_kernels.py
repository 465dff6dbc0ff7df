# jax_op.py + kernels_pallas.py + kernels_splash.py + kernels_gmm.py. Oracles: plain PyTorch, JAX's production splash attention and
# megablox kernels, the lowered program's array sizes, CPU (for XLA:CPU through call_jax)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import math

import pytest
import torch

from model import sdpa_attention

from tests import launch
from tests.common import _near, _ops_of_one_more_step, _train_losses, _trainer


def _grads(fn, inputs, cot):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, [x for x in inputs if x.requires_grad], cot)


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,S,D,window,segments,block", [
    (2, 4, 2, 40, 16, None, False, 16),   # GQA, S not a multiple of the block
    (1, 4, 1, 50, 8, 7, True, 16),        # window + packed documents, MQA
    (1, 2, 2, 64, 16, 20, False, 32),     # window only
    (1, 2, 2, 64, 16, 31, False, 16),     # a window one less than two blocks: a block on its edge is PARTIAL
])
def test_splash_attention_matches_reference(dtype, B, H, Hkv, S, D, window, segments, block):
    import kernels_splash as kp
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, dtype=dtype, requires_grad=True) for h in (H, Hkv, Hkv))
    seg = torch.randint(0, 3, (B, S)).sort(-1).values if segments else None
    cot = torch.randn(B, H, S, D, dtype=dtype)
    out, grads = _grads(lambda q, k, v: kp.splash_attention(q, k, v, window, seg, block=block), (q, k, v), cot)
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want, want_grads = _grads(lambda q, k, v: sdpa_attention(q, k, v, window, seg), ref, cot.float())
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w, **TOL[dtype])


@pytest.mark.fast
def test_splash_full_attention_equals_plain_softmax_attention():
    """Non-causal splash (FLUX's joint attention): every block live, the padded keys masked; forward
    and gradients equal softmax(q k^T / sqrt(D)) v written here. S = 40 in blocks of 16: two FULL
    blocks and a padded one per row."""
    import kernels_splash as kp
    torch.manual_seed(0)
    B, H, S, D = 2, 2, 40, 16
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    cot = torch.randn(B, H, S, D)
    out, grads = _grads(lambda q, k, v: kp.splash_full_attention(q, k, v, block=16), (q, k, v), cot)
    plain = lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1) @ v
    want, want_grads = _grads(plain, [x.detach().requires_grad_() for x in (q, k, v)], cot)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    count, _, kind, *_ = kp.block_layout(3, 16, 0, 0, 0)  # (the unpadded layout: all FULL, none skipped)
    assert count.tolist() == [3, 3, 3] and (kind == kp.FULL).all()
    with pytest.raises(ValueError, match="window is causal"):
        kp.splash_attention(q, k, v, window=4, causal=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,D,V,scale", [(37, 16, 300, 1.0), (64, 8, 256, 1.0),
                                         (37, 16, 300, 0.01)])  # (logits near 0: a padded column would count)
def test_fused_linear_cross_entropy_matches_reference(dtype, N, D, V, scale):
    """V = 300 in vocabulary tiles of 128: 84 padded columns, which must not enter the log-sum-exp. At
    logits near 0 each one would add ~1 to its sum (log(384 / 300) = 0.25 in the loss); at the randn
    scale they vanish below the tolerance."""
    import kernels_pallas as kp
    from model import plain_cross_entropy
    torch.manual_seed(0)
    h = (scale * torch.randn(N, D)).to(dtype).requires_grad_()
    w = torch.randn(V, D, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::5] = -100  # ignored rows
    loss, grads = _grads(lambda h, w: kp.fused_linear_cross_entropy(h, w, t, block_n=16, block_v=128), (h, w), None)
    ref = [x.detach().float().requires_grad_() for x in (h, w)]
    want, want_grads = _grads(lambda h, w: plain_cross_entropy(h, w, t), ref, None)
    torch.testing.assert_close(loss.float(), want, **TOL[dtype])
    for g, w_ in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w_, **TOL[dtype])


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[3, 0, 10, 7], [0, 0, 20, 0], [5, 5, 5, 5], [1, 17, 0, 2], [14, 2, 0, 4]])
def test_grouped_matmul_matches_reference(dtype, sizes):
    """(the first group over two row tiles of 8: its weight gradient kept only the first tile's rows
    when the kernel read its visits' count off the wrong grid axis)"""
    import kernels_gmm
    from model import gmm_reference
    torch.manual_seed(0)
    gs = torch.tensor(sizes)
    x = torch.randn(int(gs.sum()), 6, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 6, 5, dtype=dtype, requires_grad=True)
    cot = torch.randn(x.shape[0], 5, dtype=dtype)
    out, grads = _grads(lambda x, w: kernels_gmm.gmm(x, w, gs, block_m=8), (x, w), cot)
    ref = [t.detach().float().requires_grad_() for t in (x, w)]
    want, want_grads = _grads(lambda x, w: gmm_reference(x, w, gs), ref, cot.float())
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    for g, w_ in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w_, **TOL[dtype])
    if 0 in sizes:  # an empty group's weight gradient is exactly zero
        assert grads[1][gs == 0].abs().max() == 0


@pytest.mark.parametrize("block_k, block_n", [(128, 128), (128, 0), (0, 128)])
def test_grouped_matmul_with_k_and_n_in_several_tiles_matches_reference(block_k, block_n):
    """K = N = 256 in tiles of 128, as a TPU step tiles them (512 on a chip, the suite's other cases
    one tile): the output sums every K tile's product, the weight gradient fills every (K, N) tile."""
    import kernels_gmm
    from model import gmm_reference
    torch.manual_seed(0)
    gs = torch.tensor([9, 0, 20, 3])
    x = torch.randn(int(gs.sum()), 256, requires_grad=True)
    w = torch.randn(4, 256, 256, requires_grad=True)
    cot = torch.randn(x.shape[0], 256)
    out, grads = _grads(lambda x, w: kernels_gmm.gmm(x, w, gs, block_m=8, block_k=block_k, block_n=block_n),
                        (x, w), cot)
    ref = [t.detach().requires_grad_() for t in (x, w)]
    want, want_grads = _grads(lambda x, w: gmm_reference(x, w, gs), ref, cot)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    for g, w_ in zip(grads, want_grads):
        torch.testing.assert_close(g, w_, **TOL[torch.float32])


def test_splash_matches_jax_production_splash_attention():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    import kernels_splash as kp
    H, S, D, window = 2, 256, 64, 32
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((H, S, D)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, S)), jnp.int32)
    mask = sm.MultiHeadMask([sm.LocalMask((S, S), (window - 1, 0), 0) for _ in range(H)])  # causal window
    bs = sk.BlockSizes(**{f: 128 for f in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv",
                                              "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")})
    theirs = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=bs, interpret=True)
    # JAX's splash does not scale q by 1/sqrt(d); ours does.
    f_theirs = lambda q, k, v: (theirs(q * D ** -0.5, k, v, segment_ids=sk.SegmentIds(q=seg, kv=seg)) ** 2).sum()
    f_ours = lambda q, k, v: (kp.splash_jax.jax_fn(q[None], k[None], v[None], seg[None], window=window,
                                                   block=128, segments=1)[0] ** 2).sum()
    assert abs(float(f_theirs(q, k, v) - f_ours(q, k, v))) < 1e-2  # sum of S*H*D squares ~ 3e4
    for a, b in zip(jax.grad(f_theirs, (0, 1, 2))(q, k, v), jax.grad(f_ours, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_gmm_matches_jax_megablox():
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm as mb_gmm, tgmm as mb_tgmm
    import kernels_gmm
    rng = np.random.default_rng(0)
    gs = jnp.array([100, 0, 156, 0], jnp.int32)
    x, dy = (jnp.asarray(rng.standard_normal((256, 128)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((4, 128, 128)), jnp.float32)
    np.testing.assert_allclose(np.asarray(kernels_gmm.gmm_jax.jax_fn(x, w, gs, block_m=128)),
                               np.asarray(mb_gmm(x, w, gs, tiling=(128, 128, 128), interpret=True)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(kernels_gmm.tgmm_call(x, dy, gs, 128)),
                               np.asarray(mb_tgmm(x.T, dy, gs, tiling=(128, 128, 128), interpret=True)), rtol=1e-5, atol=1e-5)


def _largest_intermediate(fn, *specs):
    """Largest tensor (elements) in the lowered StableHLO of forward + backward."""
    import re
    import jax
    text = jax.jit(fn).lower(*specs).as_text()
    sizes = [math.prod(int(d) for d in m.split("x")) for m in re.findall(r"tensor<((?:\d+x)+)[a-z]", text)
             for m in [m.rstrip("x")]]
    return max(sizes)


def test_kernels_never_materialize_the_quadratic_arrays():
    import jax
    import jax.numpy as jnp
    import kernels_pallas as kp
    import kernels_splash as ks
    S, D = 4096, 64
    f = lambda q, k, v, s: ks.splash_jax.jax_fn(q, k, v, s, window=0, block=128, segments=1).sum()
    qs = jax.ShapeDtypeStruct((1, 1, S, D), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32)
    biggest = _largest_intermediate(jax.grad(f, (0, 1, 2)), qs, qs, qs, seg)
    assert S * D <= biggest < S * S
    T, V = 4096, 32768
    g = lambda h, w, t: kp.fused_ce_jax.jax_fn(h, w, t, ignore_index=-100, block_n=256, block_v=512)
    biggest = _largest_intermediate(jax.grad(g, (0, 1)), jax.ShapeDtypeStruct((T, D), jnp.float32),
                                    jax.ShapeDtypeStruct((V, D), jnp.float32), jax.ShapeDtypeStruct((T,), jnp.int32))
    assert V * D <= biggest < T * V


@pytest.mark.fast
def test_jax_ops_are_single_nodes_under_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx
    import kernels_splash as kp
    q, k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)

    def step(q, k, v):
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = kp.splash_attention(q, k, v)
        return torch.autograd.grad(out.square().sum(), (q, k, v))

    with torch.enable_grad():
        gm = make_fx(step, tracing_mode="fake")(q, k, v)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("minititan.splash.default") == 1 and targets.count("minititan.splash_vjp.default") == 1
    with torch.no_grad():
        got = gm(q, k, v)
    want = step(q.clone(), k.clone(), v.clone())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def child_xla_kernels():
    """(child process) The three kernels on XLA:CPU through call_jax and on CPU: fwd + grads."""
    import torch_xla
    import kernels_pallas as kp
    import kernels_splash as ks
    import kernels_gmm
    torch.manual_seed(0)
    xla = torch_xla.device()  # the XLA runtime starts before any CPU backward (see README)
    q, k, v = torch.randn(1, 2, 24, 8), torch.randn(1, 1, 24, 8), torch.randn(1, 1, 24, 8)
    h, w, t = torch.randn(20, 8), torch.randn(40, 8), torch.randint(0, 40, (20,))
    x, wg, gs = torch.randn(12, 8), torch.randn(3, 8, 4), torch.tensor([5, 0, 7])

    def run(d):
        qq, kk, vv, hh, ww, xx, wgw = (z.to(d).requires_grad_() for z in (q, k, v, h, w, x, wg))
        a = ks.splash_attention(qq, kk, vv, window=5)
        l = kp.fused_linear_cross_entropy(hh, ww, t.to(d))
        m = kernels_gmm.gmm(xx, wgw, gs.to(d))
        total = a.square().sum() + l + m.square().sum()
        grads = torch.autograd.grad(total, (qq, kk, vv, hh, ww, xx, wgw))
        return [z.detach().cpu() for z in (a, l, m, *grads)]
    on_cpu, on_xla = run("cpu"), run(xla)
    print("diffs", json.dumps([(a - b).abs().max().item() for a, b in zip(on_cpu, on_xla)]))  # (NaN: json's NaN)


def test_kernels_on_xla_cpu_through_call_jax_equal_cpu():
    rc, out, err = launch.python(["test_all.py", "child_xla_kernels"], env={"PJRT_DEVICE": "CPU"})
    assert rc == 0, err[-3000:]
    diffs = json.loads(out.split("diffs")[1])
    assert len(diffs) == 10 and all(d < 1e-5 for d in diffs), diffs  # (a NaN difference fails: nan < x is False)


@pytest.mark.parametrize("flavor", ["qwen3_debug", "qwen3_moe_debug"])
def test_training_with_pallas_kernels_matches_reference(flavor, corpus, tmp_path):
    moe = flavor == "qwen3_moe_debug"
    common = ["--flavor", flavor, *(["--set", "moe_ffn_dim=32"] if moe else [])]
    reference, pallas = _trainer(corpus, tmp_path, *common), _trainer(corpus, tmp_path, *common, "--kernels", "pallas")
    _near(_train_losses(reference), _train_losses(pallas), atol=1e-4)
    # ... and the Pallas kernels are what ran: forward and backward ops called in a step (none without)
    kernels = ["splash", "fused_linear_cross_entropy", *(["gmm"] if moe else [])]
    want = {f"minititan::{k}{vjp}" for k in kernels for vjp in ("", "_vjp")}
    ran = _ops_of_one_more_step(pallas)
    assert want <= ran, sorted(want - ran)
    assert not any(n.startswith("minititan::") for n in _ops_of_one_more_step(reference))
