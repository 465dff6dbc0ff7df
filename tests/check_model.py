# device.py: the XLA path. Oracle: eager PyTorch on CPU
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import math

import torch.nn.functional as F
import pytest
import torch

from model import FLAVORS, Transformer, apply_rope, check_args, flops_per_token, param_counts, rope_inv_freq, sdpa_attention

from tests.common import TINY, background, losses, run_train, tiny_args


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_xla_cpu_matches_eager_over_10_steps(dtype, tol, corpus, tmp_path):
    common = [*TINY, "--data", corpus, "--steps", "10", "--ckpt-interval", "0", "--eval-interval", "0",
              "--dtype", dtype, "--sample-tokens", "0"]  # (sampling on XLA: its own test, below)
    cpu = background(run_train, [*common, "--device", "cpu", "--out-dir", str(tmp_path / "cpu")])
    rc, out, err = run_train([*common, "--device", "xla", "--out-dir", str(tmp_path / "xla")],
                             env={"PJRT_DEVICE": "CPU"})
    assert rc == 0, err
    rc, _, err = cpu.result()
    assert rc == 0, err
    assert "on xla" in out
    eager, xla = losses(str(tmp_path / "cpu")), losses(str(tmp_path / "xla"))
    assert sorted(eager) == list(range(1, 11)) and sorted(xla) == sorted(eager)
    for step in eager:
        assert abs(eager[step] - xla[step]) < tol, (step, eager[step], xla[step])


# ------------------------------------------------------------------------------------------------
# model.py. Oracles: loop formulas (RoPE, GQA attention, MoE per token), torch's own F.rms_norm and
# F.scaled_dot_product_attention in the architecture written out (reference_logits), published counts

@pytest.mark.parametrize("flavor", ["llama3_debug", "qwen3_debug", "qwen3_moe_debug"])
def test_causality_future_tokens_do_not_change_past_logits(flavor):
    torch.manual_seed(0)
    model = Transformer(FLAVORS[flavor]).eval()
    tokens = torch.randint(0, 256, (2, 48))
    changed = tokens.clone()
    changed[:, 30:] = torch.randint(0, 256, (2, 18))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :30], b[:, :30], rtol=0, atol=1e-5)
    assert (a[:, 30:] - b[:, 30:]).abs().max() > 1e-3  # and the future does change


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_rmsnorm_matches_torch_rms_norm_at_scales_where_eps_matters(scale):
    """Against torch's own F.rms_norm (eps inside the square root) and the formula written out, at
    input scales where eps is 10% of the mean square (1e-3), negligible (1) and tiny (30); in bf16
    the statistics must still be taken in fp32."""
    from model import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-7)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(3, 5, 64) * scale
    want = F.rms_norm(x, (64,), norm.weight, eps=1e-7)
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-6 * scale)
    loop = torch.stack([v / math.sqrt(sum(float(e) ** 2 for e in v) / 64 + 1e-7) for v in x.reshape(-1, 64)])
    torch.testing.assert_close(norm(x).reshape(-1, 64), loop * norm.weight, rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    torch.testing.assert_close(norm(xb).float(), F.rms_norm(xb.float(), (64,), norm.weight, eps=1e-7).bfloat16().float(),
                               rtol=2e-2, atol=1e-2)


def test_rope_matches_pairwise_rotation_formula():
    args = tiny_args(head_dim=16)
    S, hd = 10, args.hd
    x = torch.randn(1, 1, S, hd)
    inv = rope_inv_freq(args)
    pos = torch.arange(S, dtype=torch.float32)
    emb = torch.cat([torch.outer(pos, inv)] * 2, -1)
    got = apply_rope(x, emb.cos(), emb.sin())
    # Oracle: HF layout pairs dim i with dim i + hd/2, rotated by angle pos * theta^(-2i/hd).
    want = torch.empty_like(x)
    for p in range(S):
        for i in range(hd // 2):
            ang = p * args.rope_theta ** (-2 * i / hd)
            a, b = x[0, 0, p, i], x[0, 0, p, i + hd // 2]
            want[0, 0, p, i] = a * math.cos(ang) - b * math.sin(ang)
            want[0, 0, p, i + hd // 2] = b * math.cos(ang) + a * math.sin(ang)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llama31_rope_scaling_follows_published_rule():
    args = FLAVORS["llama3_8b"]
    plain = rope_inv_freq(dataclasses.replace(args, rope_scaling=None))
    scaled = rope_inv_freq(args)
    wavelen = 2 * math.pi / plain
    hi = wavelen < 8192 / 4     # high frequencies untouched
    lo = wavelen > 8192 / 1     # low frequencies divided by the factor 8
    torch.testing.assert_close(scaled[hi], plain[hi])
    torch.testing.assert_close(scaled[lo], plain[lo] / 8)
    mid = ~hi & ~lo
    assert mid.any() and ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8)).all()


def loop_attention(q, k, v, window=None, segment_ids=None):
    """Oracle: one (batch, head, query) at a time, GQA head h reads kv head h // group."""
    B, H, S, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                keys = [j for j in range(i + 1) if (window is None or i - j < window)
                        and (segment_ids is None or segment_ids[b, i] == segment_ids[b, j])]
                s = torch.stack([q[b, h, i] @ k[b, h // group, j] for j in keys]) / math.sqrt(D)
                out[b, h, i] = torch.softmax(s, 0) @ v[b, h // group, keys]
    return out


@pytest.mark.parametrize("window,segments", [(None, False), (5, False), (None, True), (4, True)])
def test_gqa_attention_matches_loop_formula(window, segments):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    seg = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5]) if segments else None
    torch.testing.assert_close(sdpa_attention(q, k, v, window, seg), loop_attention(q, k, v, window, seg),
                               rtol=1e-5, atol=1e-5)


def test_moe_experts_compute_in_autocasts_dtype_with_the_kernel_as_with_the_reference():
    """Under autocast (--dtype bf16) the experts' outputs come out in the dtype autocast gives the
    reference's matmuls (the oracle: autocast itself) with the Pallas grouped matmul too. The kernel
    is a custom op, which autocast does not cast: before model.autocast_rows its rows and experts
    stayed fp32 where the weights are (one process, --dtype bf16 --kernels pallas)."""
    from model import run_here
    seen = {}
    for impl in ("reference", "gmm"):
        moe = Transformer(dataclasses.replace(FLAVORS["qwen3_moe_debug"], moe_impl=impl, moe_groups=2)).layers[0].mlp
        moe.route_through(lambda experts, x, sizes, impl=impl: seen.setdefault(impl, run_here(experts, x, sizes)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            moe(torch.randn(2, 8, moe.args.dim))
    assert seen["gmm"].dtype == seen["reference"].dtype == torch.bfloat16, {k: v.dtype for k, v in seen.items()}


@pytest.mark.parametrize("groups,impl", [(1, "reference"), (4, "reference"), (8, "reference"), (4, "gmm")])
def test_moe_dispatch_matches_per_token_dense(groups, impl):
    """The sorted dispatch (in `groups` routing groups, each sorted alone: one a device under --compile;
    8 does not divide the 60 tokens, so 4 are used) against a loop over tokens and their top-k
    experts: output, aux loss, and the gradients of the input, the router and the experts (measured:
    equal to ~1e-7)."""
    torch.manual_seed(0)
    args = dataclasses.replace(FLAVORS["qwen3_moe_debug"], moe_groups=groups, moe_impl=impl)
    moe = Transformer(args).layers[0].mlp
    x = torch.randn(3, 20, args.dim, requires_grad=True)
    cotangent = torch.randn(3, 20, args.dim)
    out, aux = moe(x)
    weights = [x, moe.gate.weight, moe.w_gate_ExDxF, moe.w_up_ExDxF, moe.w_down_ExFxD]
    grads = torch.autograd.grad((out * cotangent).sum() + aux, weights)
    flat = x.reshape(-1, args.dim)
    probs = torch.softmax(flat @ moe.gate.weight.t(), -1)
    want = []
    counts = torch.zeros(args.n_experts)
    for t in range(flat.shape[0]):
        w, e = probs[t].topk(args.top_k)
        w = w / w.sum()
        row = 0
        for wi, ei in zip(w, e):
            h = F.silu(flat[t] @ moe.w_gate_ExDxF[ei]) * (flat[t] @ moe.w_up_ExDxF[ei])
            row = row + wi * (h @ moe.w_down_ExFxD[ei])
            counts[ei] += 1
        want.append(row)
    want = torch.stack(want)
    torch.testing.assert_close(out.reshape(-1, args.dim), want, rtol=1e-4, atol=1e-5)
    want_aux = args.n_experts * (counts / counts.sum() * probs.mean(0)).sum()
    torch.testing.assert_close(aux, want_aux)
    want_grads = torch.autograd.grad((want * cotangent.reshape(-1, args.dim)).sum() + want_aux, weights)
    for name, g, w in zip(["x", "router", "w_gate", "w_up", "w_down"], grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item(), msg=lambda m: f"{name}: {m}")


def reference_logits(model, tokens_BxS):
    """The published Llama 3 / Qwen 3 / Qwen 3-MoE forward, written out from the weights with torch's
    own functional ops (F.rms_norm, F.scaled_dot_product_attention with enable_gqa, a per-token MoE
    loop); none of model.py's code runs here except rope_inv_freq (checked against its published
    rule above). Rotary embedding in Hugging Face's half-split layout."""
    a, w = model.args, model.state_dict()
    B, S = tokens_BxS.shape
    H, Hkv, hd, D = a.n_heads, a.n_kv_heads, a.hd, a.dim
    angle = torch.arange(S, dtype=torch.float32)[:, None] * rope_inv_freq(a)[None, :]  # (S, hd/2)
    cos, sin = angle.cos(), angle.sin()

    def rope(x_BxSxNxhd):
        x1, x2 = x_BxSxNxhd[..., :hd // 2], x_BxSxNxhd[..., hd // 2:]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def swiglu(x, gate, up, down):  # weights in x @ W layout
        return (F.silu(x @ gate) * (x @ up)) @ down

    x = w["embed_tokens.weight"][tokens_BxS]
    for i in range(a.n_layers):
        p = lambda name: w[f"layers.{i}.{name}"]
        h = F.rms_norm(x, (D,), p("input_layernorm.weight"), a.norm_eps)
        q = (h @ p("self_attn.q_proj.weight").T).view(B, S, H, hd)
        k = (h @ p("self_attn.k_proj.weight").T).view(B, S, Hkv, hd)
        v = (h @ p("self_attn.v_proj.weight").T).view(B, S, Hkv, hd)
        if a.qk_norm:  # Qwen 3: per-head RMSNorm of q and k, before the rotation
            q = F.rms_norm(q, (hd,), p("self_attn.q_norm.weight"), a.norm_eps)
            k = F.rms_norm(k, (hd,), p("self_attn.k_norm.weight"), a.norm_eps)
        o = F.scaled_dot_product_attention(rope(q).transpose(1, 2), rope(k).transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(B, S, H * hd) @ p("self_attn.o_proj.weight").T
        h = F.rms_norm(x, (D,), p("post_attention_layernorm.weight"), a.norm_eps)
        if a.n_experts:  # every token: softmax over all experts, top k, renormalized weights
            out = torch.zeros_like(h)
            probs = F.softmax(h @ p("mlp.gate.weight").T, dim=-1)
            for b in range(B):
                for t in range(S):
                    top_w, top_e = probs[b, t].topk(a.top_k)
                    for wt, e in zip(top_w / top_w.sum(), top_e):
                        out[b, t] += wt * swiglu(h[b, t], p("mlp.w_gate_ExDxF")[e], p("mlp.w_up_ExDxF")[e],
                                                 p("mlp.w_down_ExFxD")[e])
        else:
            out = swiglu(h, p("mlp.gate_proj.weight").T, p("mlp.up_proj.weight").T, p("mlp.down_proj.weight").T)
        x = x + out
    x = F.rms_norm(x, (D,), w["norm.weight"], a.norm_eps)
    return x @ w["embed_tokens.weight" if a.tie_embeddings else "lm_head.weight"].T


@pytest.mark.parametrize("flavor,extra", [("llama3_debug", {"rope_scaling": (8.0, 1.0, 4.0, 16)}),
                                          ("qwen3_debug", {}), ("qwen3_moe_debug", {})])
@pytest.mark.fast
def test_model_logits_equal_the_architecture_written_out(flavor, extra):
    """Every module's arithmetic and their composition (norm placement, residuals, GQA, q/k norm,
    rope scaling, tied embeddings, MoE routing) against reference_logits, at init scale and with
    norm weights and inputs far from 1, where eps and ordering mistakes show."""
    torch.manual_seed(0)
    args = dataclasses.replace(FLAVORS[flavor], n_layers=2, max_seq_len=64, **extra)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 2)  # not all ones: a norm weight applied twice or not at all shows
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    torch.testing.assert_close(model(tokens), reference_logits(model, tokens), rtol=1e-4, atol=1e-4)


def test_published_parameter_counts():
    # Model cards: Llama 3 8B 8.03B; 70B 70.6B; 405B 405.9B; Qwen3 0.6B 0.6B (0.44B non-embedding);
    # Qwen3 8B 8.2B; 32B 32.8B; 30B-A3B 30.5B total / 3.3B active; 235B-A22B 235B / 22B active.
    expect = {"llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "llama3_405b": 405.9e9, "qwen3_0.6b": 0.6e9,
              "qwen3_8b": 8.2e9, "qwen3_32b": 32.8e9, "qwen3_30b_a3b": 30.5e9, "qwen3_235b_a22b": 235e9}
    for name, total in expect.items():
        got, _, _ = param_counts(FLAVORS[name])
        assert abs(got / total - 1) < 0.01, (name, got)
    for name, active in {"qwen3_30b_a3b": 3.3e9, "qwen3_235b_a22b": 22e9}.items():
        _, emb, act = param_counts(FLAVORS[name])
        assert abs((act + emb) / active - 1) < 0.03, (name, act + emb)  # active incl. input embedding


@pytest.mark.parametrize("flavor", ["qwen3_0.6b", "qwen3_30b_a3b", "llama3_debug", "qwen3_moe_debug"])
def test_param_counts_and_flops_match_the_module(flavor):
    args = FLAVORS[flavor]
    with torch.device("meta"):  # full-size flavors: shapes only, no memory
        model = Transformer(args)
    numel = sum(p.numel() for p in model.parameters())
    total, emb, active = param_counts(args)
    assert numel == total
    if not args.n_experts:  # dense: torchtitan's 6 * (N - N_emb), with the output projection counted
        out_proj = emb if args.tie_embeddings else 0
        assert flops_per_token(args, 100) == 6 * (numel - emb + out_proj) + 12 * args.n_layers * args.n_heads * args.hd * 100


def test_bad_model_configs_are_refused():
    with pytest.raises(ValueError, match="divisible"):
        check_args(tiny_args(n_kv_heads=3))
    with pytest.raises(ValueError, match="positive"):
        check_args(tiny_args(dim=0))
    with pytest.raises(ValueError, match="top_k"):
        check_args(tiny_args(n_experts=4, top_k=5, moe_ffn_dim=8))
