"""test_all.py: every concept checked against an independent oracle. Run: .venv/bin/python -m pytest test_all.py

One section per file, in the README's reading order, each naming its oracles: formulas written out
loop by loop (RoPE, GQA attention, MoE per token), torch's own functional ops (the architecture
written out), torch.optim.AdamW and clip_grad_norm_, the uninterrupted run (resume), eager CPU
(XLA:CPU), JAX's production Pallas kernels, one process and FSDP2 (data parallel), the unrolled loop
(scan). A test that must run in a fresh process (XLA runtime first, torchrun) calls one of the
`child_*` functions below through `python test_all.py child_NAME ARGS`. CPU only, ~17.5 min on 2 cores (199 tests).
"""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import data
import optim
import task as task_lib
from model import (FLAVORS, ModelArgs, Transformer, apply_rope, check_args,
                   flops_per_token, param_counts, rope_inv_freq, sdpa_attention)

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ["--set", "n_layers=2", "--set", "dim=64", "--set", "n_heads=4", "--set", "n_kv_heads=2",
        "--set", "ffn_dim=128", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2",
        "--log-interval", "1", "--warmup", "2"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus made from stdlib sources (no ../shared needed)."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    with open(os.path.join(data.stdlib_dir(), "argparse.py"), "rb") as f:
        path.write_bytes(f.read())
    return str(path)


def run_train(args, env=None, timeout=300):
    """train.py in a subprocess: (returncode, stdout, stderr)."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "train.py"), *args], cwd=HERE,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


_ONE_PROCESS_RUNS = {}


def one_process_run(args, tmp_path_factory):
    """The one-process oracle run of `args` (read only by its callers), run once per distinct args:
    several parametrizations of the multi-process tests compare against the same one."""
    key = tuple(args)
    if key not in _ONE_PROCESS_RUNS:
        out = str(tmp_path_factory.mktemp("one_process"))
        rc, _, err = run_train([*args, "--out-dir", out])
        assert rc == 0, err[-3000:]
        _ONE_PROCESS_RUNS[key] = out
    return _ONE_PROCESS_RUNS[key]


def _records(out_dir, key):
    """{step: value of `key`} from a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in recs if key in r and "step" in r}


def losses(out_dir):
    return _records(out_dir, "loss")


def tiny_args(**kw):
    return dataclasses.replace(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128), **kw)


def _near(want, got, atol, rtol=0.0):
    """Every |got - want| <= atol + rtol |want|, and a NaN or Inf fails (torch.testing.assert_close):
    Python's max() over differences skips a NaN (max(0.0, nan) is 0.0). Lists compare in order,
    {step: value} dicts by step, with the same steps."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), (sorted(want), sorted(got))
        want, got = [want[k] for k in sorted(want)], [got[k] for k in sorted(want)]
    assert len(got) == len(want), (want, got)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------------
# Shared helpers: train.py in this process or a subprocess, torchrun, a trainer driven step by step

def _main(argv):
    import train
    try:
        return train.main(argv)
    except SystemExit as exit_:
        return exit_.code


def _trainer(corpus, tmp_path, *extra):
    import train
    cfg = train.parse_config([*TINY, "--data", corpus, "--steps", "20", "--ckpt-interval", "0",
                                           "--eval-batches", "0", "--out-dir", str(tmp_path / "r"), *extra])
    return train.Trainer(cfg)


def _train_losses(trainer, steps=20, norms=None):
    """Losses of `steps` steps (and their pre-clip gradient norms appended to `norms`, if given)."""
    import optim as o
    out = []
    for i in range(1, steps + 1):
        x, y = trainer.task.batch(i)
        ce, norm = trainer.step_fn(x, y, torch.tensor(o.lr_at(i, trainer.cfg.lr, trainer.cfg.warmup, steps)))
        out.append(ce.item())
        if norms is not None:
            norms.append(norm.item())
    return out


def _ops_of_one_more_step(trainer):
    """The names torch.profiler (a public hook) records during one more step: which code ran, e.g.
    dynamo's "Torch-Compiled Region", inductor's "## Call CompiledFxGraph", our "minititan::" ops."""
    from torch.profiler import ProfilerActivity, profile
    x, y = trainer.task.batch(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step_fn(x, y, torch.tensor(1e-4))
    return {e.key for e in prof.key_averages()}


DIST_TINY = [*TINY, "--set", "ffn_dim=131"]  # 131: an uneven first dimension for the shards

def torchrun(nproc, args, timeout=300):
    """Launch train.py on `nproc` gloo ranks. A rank that dies of SIGSEGV (seen once in ~50 CI runs of the
    4-process tests: a crash inside gloo, every rank's own line otherwise correct) is reported as a
    warning (with the crashed rank's Python stack, train.py enables faulthandler) and the run is repeated
    once from the same starting files; a second crash fails the test."""
    out_dir = args[args.index("--out-dir") + 1] if "--out-dir" in args else None
    before = _snapshot(out_dir)
    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), os.path.join(HERE, "train.py"), *args], cwd=HERE, capture_output=True,
                              text=True, timeout=timeout)
        if attempt == 2 or "Signal 11 (SIGSEGV)" not in proc.stderr:
            return proc.returncode, proc.stdout, proc.stderr
        import warnings
        warnings.warn(f"torchrun {' '.join(args)}: a rank died of SIGSEGV; repeating once:\n{proc.stderr[-4000:]}")
        _restore(out_dir, before)


def _snapshot(path):
    """A copy of directory `path` as it is (None if there is none), for _restore."""
    import shutil
    import tempfile
    if not path or not os.path.exists(path):
        return None
    copy = os.path.join(tempfile.mkdtemp(), "copy")
    shutil.copytree(path, copy, symlinks=True)
    return copy


def _restore(path, copy):
    import shutil
    if path and os.path.exists(path):
        shutil.rmtree(path)
    if copy:
        shutil.copytree(copy, path, symlinks=True)


def _full_params(ckpt_dir, args, name=None):
    """Load a (possibly sharded) checkpoint into full, plain tensors in this process."""
    import checkpoint
    import train
    cfg = train.parse_config(args)
    model = Transformer(train.model_args(cfg))
    if cfg.scan:  # stacked (L, ...) block weights, as --scan saves them
        import layer_scan
        model = layer_scan.stack_layers(model)
    state = {"model": model.state_dict()}
    path = os.path.join(ckpt_dir, name) if name else checkpoint.find_resumable(ckpt_dir)[0]
    return checkpoint.load(path, state)["model"]


def _ranks_equal_one_process(single, multi, steps, args, keys=("grad_norm", "val_loss")):
    """The oracle of every data-parallel test: N ranks' run equals one process's on the same global
    batch. Losses at every step; pre-clip gradient norms (a gradient scale, a sum for a mean over ranks,
    hides behind clipping and Adam in the losses) and validation; final weights gathered whole.
    Returns the one process's full parameters."""
    want, got = losses(single), losses(multi)
    assert sorted(got) == list(range(1, steps + 1))
    _near(want, got, atol=1e-5)
    for key in keys:
        want, got = _records(single, key), _records(multi, key)
        assert sorted(got) == sorted(want) and len(want) >= 2, key
        _near(want, got, atol=0, rtol=1e-5)
    p_single = _full_params(os.path.join(single, "checkpoints"), args)
    p_multi = _full_params(os.path.join(multi, "checkpoints"), args)
    assert sorted(p_single) == sorted(p_multi)
    for name in p_single:
        torch.testing.assert_close(p_multi[name], p_single[name], rtol=0, atol=1e-5, msg=name)
    return p_single


def _files(run_dir):
    """{relative path: sha256} of everything under run_dir/checkpoints: 'nothing lost' = unchanged."""
    import checkpoint
    root = os.path.join(run_dir, "checkpoints")
    return {os.path.relpath(os.path.join(d, f), root): checkpoint.sha256_of(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


# ------------------------------------------------------------------------------------------------
# device.py: the XLA path. Oracle: eager PyTorch on CPU

@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 1e-2)])
def test_xla_cpu_matches_eager_over_10_steps(dtype, tol, corpus, tmp_path):
    common = [*TINY, "--data", corpus, "--steps", "10", "--ckpt-interval", "0", "--eval-interval", "0",
              "--dtype", dtype, "--sample-tokens", "0"]  # (sampling on XLA: its own test, below)
    rc, _, err = run_train([*common, "--device", "cpu", "--out-dir", str(tmp_path / "cpu")])
    assert rc == 0, err
    rc, out, err = run_train([*common, "--device", "xla", "--out-dir", str(tmp_path / "xla")],
                             env={"PJRT_DEVICE": "CPU"})
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


def test_moe_dispatch_matches_per_token_dense():
    torch.manual_seed(0)
    args = FLAVORS["qwen3_moe_debug"]
    model = Transformer(args)
    moe = model.layers[0].mlp
    x = torch.randn(3, 20, args.dim)
    out, aux = moe(x)
    flat = x.reshape(-1, args.dim)
    probs = torch.softmax(flat @ moe.gate.weight.t(), -1)
    want = torch.zeros_like(flat)
    counts = torch.zeros(args.n_experts)
    for t in range(flat.shape[0]):
        w, e = probs[t].topk(args.top_k)
        w = w / w.sum()
        for wi, ei in zip(w, e):
            h = F.silu(flat[t] @ moe.w_gate_ExDxF[ei]) * (flat[t] @ moe.w_up_ExDxF[ei])
            want[t] += wi * (h @ moe.w_down_ExFxD[ei])
            counts[ei] += 1
    torch.testing.assert_close(out.reshape(-1, args.dim), want, rtol=1e-4, atol=1e-5)
    want_aux = args.n_experts * (counts / counts.sum() * probs.mean(0)).sum()
    torch.testing.assert_close(aux, want_aux)


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


# ------------------------------------------------------------------------------------------------
# optim.py. Oracles: torch.optim.AdamW (param groups chosen by name), clip_grad_norm_

def test_functional_adamw_equals_torch_adamw_over_20_steps():
    torch.manual_seed(0)
    params = [torch.randn(8, 5), torch.randn(5), torch.randn(3, 4, 2)]
    ref = [p.clone().requires_grad_() for p in params]
    mask = [True, False, True]  # (the trainer's mask is tested by name against its rule below)
    torch_opt = torch.optim.AdamW([{"params": [ref[0], ref[2]], "weight_decay": 0.1},
                                   {"params": [ref[1]], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    state = optim.init_state(params)
    for step in range(1, 21):
        lr = optim.lr_at(step, 1e-2, 5, 20)
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        params, state = optim.adamw(params, grads, state, torch.tensor(float(step)), torch.tensor(lr),
                                    weight_decay=0.1, mask=mask)
        for mine, theirs in zip(params, ref):
            torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("flags", [["--flavor", "qwen3_moe_debug"], ["--flavor", "qwen3_debug", "--scan"]])
def test_the_trainers_decay_mask_follows_the_rule_and_steps_like_torch_adamw(flags, corpus, tmp_path):
    """The mask the trainer really builds, checked per parameter against the modules it belongs to
    (Linear, Embedding and expert matrices decay; RMSNorm weights do not), also with --scan, where a
    norm weight is stacked to (L, D). Then one update against torch.optim.AdamW with groups by name."""
    from model import RMSNorm
    tr = _trainer(corpus, tmp_path, *flags)
    plain = Transformer(tr.model_args)  # per-layer names: layers.<i>.<path>
    norms = {n for m_name, m in plain.named_modules() if isinstance(m, RMSNorm) for n in [f"{m_name}.weight"]}
    per_layer = lambda name: name.replace("layers.", "layers.0.").replace("__", ".") if "--scan" in flags else name
    for name, decays in zip(tr.param_names, tr.opt.mask):
        assert per_layer(name) in dict(plain.named_parameters()), name
        assert decays == (per_layer(name) not in norms), name
    ref = [p.detach().clone().requires_grad_() for p in tr.params]
    names = dict(zip(tr.param_names, ref))
    torch_opt = torch.optim.AdamW([{"params": [p for n, p in names.items() if per_layer(n) not in norms], "weight_decay": 0.1},
                                   {"params": [p for n, p in names.items() if per_layer(n) in norms], "weight_decay": 0.0}],
                                  lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    grads = [torch.randn_like(p) for p in ref]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    torch_opt.step()  # lr 1.0: weight decay shrinks by 10%, a mask error is far above the tolerance
    tr.opt.step(grads, torch.tensor(1.0))
    for name, mine, theirs in zip(tr.param_names, tr.params, ref):
        torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=1e-5, msg=name)


def test_adamw_is_pure():
    params, grads = [torch.ones(3, 3)], [torch.full((3, 3), 0.5)]
    state = optim.init_state(params)
    before = [params[0].clone(), state["exp_avg"][0].clone()]
    optim.adamw(params, grads, state, 1, 0.1)
    assert torch.equal(params[0], before[0]) and torch.equal(state["exp_avg"][0], before[1])


@pytest.mark.parametrize("max_norm", [1.0, 1e3])  # above the norm (clipped) and below it (untouched)
def test_clipping_matches_torch(max_norm):
    torch.manual_seed(0)
    grads = [torch.randn(10, 10) * 3, torch.randn(7)]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    clipped, norm = optim.clip_by_global_norm(grads, max_norm)
    torch.testing.assert_close(norm, want_norm)
    for c, p in zip(clipped, ref):
        torch.testing.assert_close(c, p.grad)


def test_schedule_warmup_then_cosine():
    lrs = [optim.lr_at(s, 1.0, 10, 110) for s in range(1, 111)]
    assert lrs[:10] == pytest.approx([s / 10 for s in range(1, 11)])
    assert lrs[10] < 1.0 and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert optim.lr_at(60, 1.0, 10, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos = 0


# ------------------------------------------------------------------------------------------------
# data.py. Oracle: the one-process batch (rank slices concatenate to it)

def test_data_is_deterministic_and_rank_dependent(corpus):
    train, val = data.load_corpus(corpus)
    assert len(train) > 0 and len(val) > 0 and len(train) > 10 * len(val)
    a, b = data.Batches(train, 4, 16, seed=1), data.Batches(train, 4, 16, seed=1)
    x1, y1 = a.get(7)
    x2, y2 = b.get(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])            # targets are inputs shifted by one
    for world in (1, 2, 4):  # ranks read disjoint slices of B / world rows that make up the batch
        split = data.Batches(train, 4, 16, seed=1, world=world)
        parts = [split.get(7, r) for r in range(world)]
        assert all(x.shape == y.shape == (4 // world, 16) for x, y in parts)
        assert torch.equal(torch.cat([x for x, _ in parts]), x1) and torch.equal(torch.cat([y for _, y in parts]), y1)
    val = [data.eval_batches(val, 4, 16, 1, 2, rank, 2) for rank in (0, 1)]  # validation too
    assert all(x.shape == (2, 16) for batches in val for x, _ in batches)
    assert not torch.equal(val[0][0][0], val[1][0][0])
    assert not torch.equal(a.get(8)[0], x1)               # steps read different data
    assert not torch.equal(data.Batches(train, 4, 16, seed=2).get(7)[0], x1)


def test_default_corpus_is_the_stdlib_and_split_by_file(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i}\n" * 10)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")        # binary: skipped
    train, val = data.load_corpus(str(tmp_path))
    assert b"file 19" in val.tobytes() and b"file 39" in val.tobytes() and b"file 19" not in train.tobytes()
    assert b"\0" not in train.tobytes()
    assert "site-packages" not in data.stdlib_dir() and os.path.isfile(os.path.join(data.stdlib_dir(), "os.py"))


def test_a_data_dir_reads_only_regular_files_and_notes_what_it_skips(tmp_path, capsys):
    """A FIFO (a plain open() waits for a writer: forever), a dangling and a looping symlink are
    skipped with one note; the corpus is exactly the regular files' bytes in path order (written out
    here); such an entry named as --data itself is bad input (DataError: exit 2), not a hang."""
    import threading
    texts = [f"file {i}\n".encode() * 40 for i in range(3)]
    for i, text in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_bytes(text)
    os.mkfifo(tmp_path / "a_fifo")
    (tmp_path / "b_dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "c_loop").symlink_to(tmp_path / "c_loop")
    (tmp_path / "d_link.txt").symlink_to(tmp_path / "f2.txt")  # a link to a regular file is read
    got = {}
    reader = threading.Thread(target=lambda: got.update(split=data.load_corpus(str(tmp_path))), daemon=True)
    reader.start()
    reader.join(timeout=15)
    if reader.is_alive():  # blocked on the FIFO: open its other end to release the thread, then fail
        os.close(os.open(tmp_path / "a_fifo", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load_corpus blocked on a FIFO")
    train, val = got["split"]  # (fewer files than the validation stride: split by bytes, 95% / 5%)
    assert train.tobytes() + val.tobytes() == texts[2] + texts[0] + texts[1] + texts[2]
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("note:"), err
    assert all(name in err for name in ("a_fifo", "b_dangling", "c_loop")) and "f0.txt" not in err, err
    for entry, message in (("a_fifo", "not a regular file or a directory"), ("c_loop", "no such file")):
        with pytest.raises(data.DataError, match=message):
            data.load_corpus(str(tmp_path / entry))


def test_the_token_cache_is_verified_rebuilt_and_never_left_half_written(corpus, tmp_path, monkeypatch, capsys):
    """Zeros over a cached file's ids (its size and header kept), a truncated file, a lost checksum:
    each is found, named in one note and tokenized again, so the ids training reads always decode
    to the text (oracle: the tokenizers library's own decode) and equal the first tokenization. A
    write cut short by a file-size limit is an OSError naming the file, leaving no temporary file."""
    import resource
    import numpy as np
    from tokenizers import Tokenizer
    monkeypatch.setenv("MINITITAN_CACHE", str(tmp_path / "cache"))  # not the real ~/.cache
    qwen = os.path.join(HF_FIXTURES, "qwen3")
    text, val = data.load_corpus(corpus)
    first = np.array(data.tokenize(text, val, qwen)[0])
    assert Tokenizer.from_file(os.path.join(qwen, "tokenizer.json")).decode(first.tolist()) == text.tobytes().decode()
    folder = tmp_path / "cache" / "tokens"
    npy, = folder.glob("*-train.npy")
    size = npy.stat().st_size
    for damage in ("zeros", "truncated", "no checksum"):
        if damage == "zeros":
            raw = npy.read_bytes()
            head = 10 + int.from_bytes(raw[8:10], "little")  # .npy v1: magic, version, header length
            npy.write_bytes(raw[:head] + bytes(size - head))
        elif damage == "truncated":
            npy.write_bytes(npy.read_bytes()[:size // 2])
        else:
            (folder / (npy.name + ".sha256")).unlink()
        if damage == "zeros":  # through train.py: the batches read the rebuilt ids (the note printed at start)
            trainer = _trainer(corpus, tmp_path, "--tokenizer", qwen, "--set", "vocab_size=320")
            ids, err = trainer.task.batches.data, "".join(line + "\n" for line in trainer.notes)
        else:
            ids, err = data.tokenize(text, val, qwen)[0], capsys.readouterr().err
        assert np.array_equal(ids, first), damage
        assert err.count("note:") == 1 and f"the token cache {npy} " in err, (damage, err)
    for f in folder.iterdir():
        f.unlink()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))  # (Python ignores SIGXFSZ: the write fails)
    try:
        with pytest.raises(OSError) as failed:
            data.tokenize(text, val, qwen)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert failed.value.filename == str(npy) and "writing the token cache failed" in str(failed.value)
    assert list(folder.iterdir()) == []  # no .tmp left behind, and nothing unverified


# ------------------------------------------------------------------------------------------------
# checkpoint.py + rundir.py + train.py: the promises (README). Oracles: the uninterrupted run,
# checksums of the files on disk before and after, real processes (SIGKILL, a file-size limit, SIGSTOP)

def test_resume_equals_uninterrupted_bit_for_bit(corpus, tmp_path):
    """Also: a garbage `latest` pointer neither hides the checkpoints from a fresh run (refused) nor
    from --resume (newest verified step_N), and the saved RNG state is the uninterrupted run's."""
    import checkpoint
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = [*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "0"]
    assert run_train([*common, "--out-dir", full])[0] == 0
    assert run_train([*common, "--out-dir", part, "--halt-at", "4"])[0] == 0
    assert sorted(losses(part)) == [1, 2, 3, 4]
    with open(os.path.join(part, "checkpoints", "latest"), "wb") as f:
        f.write(b"\xff garbage")
    rc, _, err = run_train([*common, "--out-dir", part])
    assert rc == 2 and "already holds checkpoints" in err and sorted(losses(part)) == [1, 2, 3, 4]
    rc, out, err = run_train([*common, "--out-dir", part, "--resume"])
    assert rc == 0, err
    assert "start at step 4" in out and "resuming from step_000004, which verifies" in err
    assert losses(part) == losses(full)  # exact float equality, steps 1..8
    # Every tensor of the final checkpoints bit-equal: weights, both AdamW moments, step, RNG (the
    # last update shows in no logged loss, only in what is saved).
    import copy
    template = _trainer(corpus, tmp_path).state()

    def flat(state):
        out = {"step": state["step"], "rng": state["rng"], **{f"model/{n}": t for n, t in state["model"].items()}}
        for kind, tensors in state["optim"].items():
            out.update({f"{kind}/{n}": t for n, t in tensors.items()})
        return out
    flat = [flat(checkpoint.load(os.path.join(d, "checkpoints", "step_000008"), copy.deepcopy(template))) for d in (full, part)]
    assert sorted(flat[0]) == sorted(flat[1]) and len(flat[0]) == 3 * len(template["model"]) + 2
    for name, t in flat[0].items():
        assert torch.equal(t, flat[1][name]), name
    assert int(flat[0]["step"]) == 8


BAD_INPUTS = [
    (["--flavor", "gpt5"], "unknown flavor"),
    (["--steps", "0"], "--steps must be positive"),
    (["--batch-size", "-1"], "--batch-size must be positive"),
    (["--seq-len", "4096"], "exceeds the model's max_seq_len"),
    (["--set", "n_kv_heads=4"], "divisible"),
    (["--set", "warp=9"], "expected FIELD=VALUE"),
    (["--data", "/nonexistent/path"], "no such file"),
    (["--device", "cuda"], "no CUDA device"),
    (["--lr", "nan"], "--lr must be"),
    (["--steps", "ten"], "invalid int value"),
    (["--remat"], "add --mode graph"),
    (["--mode", "graph", "--flavor", "qwen3_moe_debug"], "graph mode traces ahead of time; the reference MoE dispatch"),
    (["--mode", "compile", "--scan"], "--scan has no per-block modules"),
    (["--scan", "--flavor", "qwen3_moe_debug"], "--scan traces ahead of time; the reference MoE dispatch reads group sizes on the host (data-dependent shapes): add --kernels pallas"),
    (["--set", "vocab_size=10"], "smaller than the data's 256 byte values"),  # (was an IndexError at step 1)
    (["--set", "attn_impl=foo"], "unknown attention implementation 'foo'"),
    (["--set", "norm_eps=-1"], "norm_eps must be a positive number"),  # (was a NaN loss, exit 3)
    (["--set", "rope_theta=0"], "rope_theta must be a positive number"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--flavor", "llama3_405b"], "GiB is free here"),  # refused before the 1.6 TB of weights are allocated
    (["--allow-change", "lr,colour"], "unknown ['colour']"),
    (["--resume-from", "step_000001"], "no such checkpoint"),
    (["--watchdog", "-1"], "--watchdog must be >= 0"),
    (["--init-from", "/nonexistent"], "config.json: missing or unreadable"),
    (["--batch-size", "100000"], "and the activations of 100000 sequences need"),  # (the dry run's estimate)
    (["--scan", "--mesh", "ici=2,tp=2"], "--scan with tp or ep is not built"),  # (checked before any launch)
    (["--task", "flux", "--mesh", "ici=1,tp=2"], "the flux task runs data parallel (dcn / ici) only"),
    (["--task", "flux", "--image-size", "16"], "the digits are 8 x 8"),  # (other sizes: the dry run only)
    (["--task", "flux", "--flavor", "flux_dev", "--data", ""], "(the published flavors: --dry-run)"),  # (on the digits)
]

@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_one_line_exit_2_nothing_written(args, message, corpus, tmp_path, capsys):
    import train
    out_dir = str(tmp_path / "run")
    argv = ["--data", corpus, "--out-dir", out_dir, *args]
    try:
        rc = train.main(argv)
    except SystemExit as exit_:  # argparse type errors exit from inside parse_args
        rc = exit_.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out_dir)


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc, out, err = run_train(["--data", str(empty), "--out-dir", str(tmp_path / "r")])
    assert rc == 2 and err.strip().splitlines() == [f"error: --data {empty}: no text found (empty, or only binary files)"]


def test_set_parses_each_field_by_its_declared_type():
    import train
    parse = lambda *sets: train.model_args(train.parse_config([x for s in sets for x in ("--set", s)]))
    args = parse("rope_scaling=8,1,4,8192", "head_dim=none", "qk_norm=true", "norm_eps=1e-6", "n_layers=3")
    assert args.rope_scaling == (8, 1, 4, 8192) and args.head_dim is None and args.qk_norm is True
    assert args.norm_eps == 1e-6 and args.n_layers == 3
    assert parse("head_dim=16").head_dim == 16  # Optional[int]: an int, not a string
    for bad, message in [("qk_norm=maybe", "is not a bool"), ("n_layers=2.5", "is not a int"),
                         ("rope_scaling=8,1", "rope_scaling is (factor, low_freq_factor")]:
        with pytest.raises(train.ConfigError, match=re.escape(message)):
            parse(bad)


def test_checkpoint_of_another_flavor_is_refused_and_kept(corpus, tmp_path):
    out_dir = str(tmp_path / "run")
    assert run_train([*TINY, "--data", corpus, "--steps", "2", "--out-dir", out_dir])[0] == 0
    ckpt = os.path.join(out_dir, "checkpoints", "step_000002")
    before = sorted(os.listdir(ckpt))
    rc, _, err = run_train([*TINY, "--flavor", "qwen3_debug", "--data", corpus, "--steps", "4",
                            "--out-dir", out_dir, "--resume"])
    assert rc == 2 and "from another model" in err and len(err.strip().splitlines()) == 1
    assert sorted(os.listdir(ckpt)) == before and not os.path.exists(os.path.join(out_dir, "checkpoints", "step_000004"))
    rc, _, err = run_train([*TINY, "--data", corpus, "--steps", "4", "--out-dir", out_dir])
    assert rc == 2 and "--resume" in err  # a fresh run refuses to overwrite existing checkpoints
    rc, _, err = run_train([*TINY, "--data", corpus, "--steps", "4", "--out-dir", out_dir, "--resume", "--scan"])
    assert rc == 2 and err.strip().endswith("resume without --scan")  # stacked names differ


@pytest.mark.parametrize("what,value", [("loss", float("nan")), ("grad norm", float("inf"))])
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(what, value, corpus, tmp_path, monkeypatch, capsys):
    import train
    out_dir = str(tmp_path / "run")
    real_step = train.Trainer.eager_step

    def poisoned(self, inputs, targets, lr):
        ce, norm = real_step(self, inputs, targets, lr)
        if self.step == 5:
            ce, norm = (ce * value, norm) if what == "loss" else (ce, norm * value)
        return ce, norm

    monkeypatch.setattr(train.Trainer, "eager_step", poisoned)
    rc = train.main([*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "3", "--out-dir", out_dir])
    assert rc == 3 and f"error: {what} is {value} at step 5" in capsys.readouterr().err
    ckpts = os.path.join(out_dir, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["latest", "step_000003"]
    import checkpoint
    assert checkpoint.find_resumable(ckpts)[0].endswith("step_000003")


def test_an_out_dir_that_is_a_file_or_unwritable_is_refused(corpus, tmp_path, capsys):
    """README: an --out-dir that is a file, lies under a file, or under a folder this user cannot
    write: one line, exit 2, the file untouched. (/proc/sys is read-only even for root.)"""
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    for out, message in [(str(afile), "exists and is not a directory"), (str(afile / "run"), "is a file, not a directory"),
                         ("/proc/sys/minititan-run", "/proc/sys is not writable")]:
        assert _main([*TINY, "--data", corpus, "--steps", "1", "--out-dir", out]) == 2, out
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --out-dir ") and message in err and len(err.splitlines()) == 1, err
    assert afile.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_checkpoint_write_protocol_survives_a_crash_at_every_step(tmp_path, monkeypatch):
    """Fault injection at each write step in turn: the DCP write, the checksums, meta.json, the
    rename, the `latest` pointer. After each crash `latest` names a complete checkpoint and the
    resumable one holds exactly what its step saved (a crash before the rename: the previous one)."""
    import checkpoint
    ckpt_dir = str(tmp_path / "ck")
    checkpoint.save(ckpt_dir, 1, {"w": torch.full((4,), 1.0)}, {"flavor": "x"})
    committed = 1

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    for step, name in enumerate(["write_shards", "sha256_of", "_write_meta", "_commit", "_point_latest"], start=2):
        with monkeypatch.context() as m:
            m.setattr(checkpoint, name, crash)
            with pytest.raises(OSError):
                checkpoint.save(ckpt_dir, step, {"w": torch.full((4,), float(step))}, {"flavor": "x"})
        if name == "_point_latest":  # renamed, so complete: only the pointer is behind
            committed = step
        pointer = open(os.path.join(ckpt_dir, "latest")).read()
        assert checkpoint.verify(os.path.join(ckpt_dir, pointer)) is None, name
        path, _ = checkpoint.find_resumable(ckpt_dir)
        assert path.endswith(f"step_{committed:06d}") and checkpoint.verify(path) is None, name
        restored = checkpoint.load(path, {"w": torch.zeros(4)})["w"]
        assert torch.equal(restored, torch.full((4,), float(committed))), name
        if name in ("write_shards", "sha256_of", "_write_meta"):  # failed writes clean up after themselves
            assert not [f for f in os.listdir(ckpt_dir) if f.endswith(".tmp")], name


def test_a_second_run_on_the_same_directory_is_refused_and_a_dead_holder_leaves_no_lock(corpus, tmp_path, capsys):
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, rundir; rundir.RunDir(sys.argv[1]).open(); "
                               "print('locked', flush=True); time.sleep(300)", out], cwd=HERE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc = _main([*TINY, "--data", corpus, "--steps", "2", "--out-dir", out])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("error:") and f"is in use by another run (pid {holder.pid}" in err
        assert sorted(os.listdir(out)) == [".lock.rank0"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert _main([*TINY, "--data", corpus, "--steps", "2", "--out-dir", out]) == 0  # the kernel dropped its lock


def test_nonfinite_values_are_never_saved_and_metrics_stay_strict_json(corpus, tmp_path, monkeypatch, capsys):
    import train
    out = str(tmp_path / "lr")  # lr 1e6: the gradient norm turns NaN while the loss is still finite
    rc = _main([*TINY, "--data", corpus, "--steps", "6", "--lr", "1e6", "--ckpt-interval", "1", "--out-dir", out])
    err = capsys.readouterr().err
    assert rc == 3 and ("error: grad norm is nan" in err or "error: loss is nan" in err), err
    saved = [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_")]
    assert saved
    for name in saved:
        state = _full_params(os.path.join(out, "checkpoints"), [*TINY, "--data", corpus], name)
        assert all(torch.isfinite(t).all() for t in state.values()), name
    for line in open(os.path.join(out, "metrics.jsonl")):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))
    # A NaN validation loss at the last step: exit 3 before the final checkpoint is written.
    monkeypatch.setattr(train.Trainer, "evaluate", lambda self: float("nan") if self.step else 1.0)
    out = str(tmp_path / "val")
    assert _main([*TINY, "--data", corpus, "--steps", "2", "--ckpt-interval", "0", "--out-dir", out]) == 3
    assert "error: val loss is nan at step 2" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "checkpoints"))


def test_resume_refuses_a_changed_config_and_says_what_it_does(corpus, tmp_path, capsys):
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "3", "--out-dir", out]
    assert _main([*common, "--halt-at", "3"]) == 0
    before = _files(out)
    capsys.readouterr()
    other = tmp_path / "other.txt"
    other.write_text(open(corpus).read()[::-1])
    for extra, message in [(["--lr", "0.01"], "lr: saved 0.003, now 0.01); pass --allow-change lr"),
                           (["--data", str(other)], "data: saved"), (["--seed", "1"], "seed: saved 0, now 1"),
                           (["--steps", "3"], "is at step 3, --steps is 3: nothing to train"),
                           (["--batch-size", "8"], "batch_size: saved 4, now 8"), (["--seq-len", "16"], "seq_len: saved 32, now 16"),
                           (["--warmup", "3"], "warmup: saved 2, now 3"), (["--clip", "0.5"], "clip: saved 1.0, now 0.5"),
                           (["--weight-decay", "0"], "weight_decay: saved 0.1, now 0.0"),
                           (["--dtype", "bf16"], "dtype: saved 'fp32', now 'bf16'")]:
        assert _main([*common, "--resume", *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert _files(out) == before and sorted(losses(out)) == [1, 2, 3]
    os.remove(os.path.join(out, "checkpoints", "latest"))  # a missing pointer: said, and the directory trusted
    assert _main([*common, "--resume", "--lr", "0.01", "--allow-change", "lr"]) == 0  # deliberate
    assert "note: " in (err := capsys.readouterr().err) and "latest is missing or does not name the newest checkpoint; " \
        "resuming from step_000003, which verifies" in err, err
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    assert _main([*common[:-1], str(tmp_path / "empty"), "--resume", "--steps", "1"]) == 0
    assert "note: no checkpoint in" in capsys.readouterr().err


def _corrupt_truncate(d):
    f = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".distcp"))
    os.truncate(f, os.path.getsize(f) // 2)


def _corrupt_metadata(d):
    with open(os.path.join(d, ".metadata"), "r+b") as f:
        f.seek(40)
        f.write(os.urandom(16))


@pytest.mark.parametrize("corrupt,names", [(_corrupt_truncate, ".distcp does not match its checksum"),
                                           (_corrupt_metadata, ".metadata does not match its checksum"),
                                           (lambda d: os.remove(os.path.join(d, "meta.json")), "meta.json is missing"),
                                           (lambda d: open(os.path.join(d, "meta.json"), "w").write("{"), "meta.json is missing or unreadable")])
def test_a_corrupt_checkpoint_is_named_and_the_good_one_resumes(corrupt, names, corpus, tmp_path, capsys):
    full = str(tmp_path / "full")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "3", "--eval-batches", "0"]
    assert _main([*common, "--out-dir", full]) == 0
    corrupt(os.path.join(full, "checkpoints", "step_000006"))
    capsys.readouterr()
    assert _main([*common, "--out-dir", full, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err and "pass --resume-from step_000003" in err, err
    want = losses(full)
    os.remove(os.path.join(full, "metrics.jsonl"))
    assert _main([*common, "--out-dir", full, "--resume-from", "step_000003"]) == 0
    assert losses(full) == {s: want[s] for s in (4, 5, 6)}  # the good checkpoint, bit for bit
    assert os.path.isdir(os.path.join(full, "checkpoints", "step_000006.superseded"))  # kept, not resumed


def test_small_data_says_validation_is_skipped(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"All work and no play makes a dull model. " * 3)
    assert _main([*TINY, "--data", str(tiny), "--steps", "1", "--out-dir", str(tmp_path / "r")]) == 0
    assert "note: validation skipped: the validation split has 7 tokens" in capsys.readouterr().err


def test_disk_full_during_a_checkpoint_removes_the_partial_one_and_keeps_the_last(corpus, tmp_path):
    import checkpoint
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "3", "--out-dir", out]
    assert run_train([*common, "--halt-at", "3"])[0] == 0
    before = _files(out)
    # A file-size limit of 256 KiB (smaller than one checkpoint) stands in for a full disk.
    proc = subprocess.run(["bash", "-c", 'ulimit -f 256 && exec "$@"', "-", sys.executable, "train.py", *common,
                           "--resume"], cwd=HERE, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == 5 and len(err.splitlines()) == 1, err
    assert err.startswith("error: a write failed: writing checkpoint step_000006 failed") and "step_000003 is kept" in err
    assert _files(out) == before  # no step_000006.tmp left behind, step_000003 untouched
    assert checkpoint.find_resumable(os.path.join(out, "checkpoints"))[0].endswith("step_000003")
    assert run_train([*common, "--resume"])[0] == 0 and sorted(losses(out))[-1] == 6


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_a_checkpoint_removes_it_and_exits_like_a_shell(sig, code, corpus, tmp_path, monkeypatch, capsys):
    """SIGTERM / SIGINT arriving while checkpoint step 4 is being written: one line naming the
    signal and the checkpoint kept, exit 128 + signal number (as a shell reports it), no partial
    step_4 left, and the run resumes from step 2 to the uninterrupted losses."""
    import signal
    import checkpoint
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "2", "--eval-batches", "0",
              "--sample-tokens", "0", "--out-dir", out]
    real = checkpoint.write_shards

    def write_then_signal(tmp, state):
        real(tmp, state)
        if tmp.endswith("step_000004.tmp"):
            os.kill(os.getpid(), getattr(signal, sig))  # delivered here, mid-save (before the rename)
    monkeypatch.setattr(checkpoint, "write_shards", write_then_signal)
    assert _main(common) == code
    err = capsys.readouterr().err.strip()
    assert err == f"error: interrupted by {sig} at step 4; checkpoint step_000002 is kept (a partial one is removed)", err
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000002"]
    monkeypatch.setattr(checkpoint, "write_shards", real)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert _main([*common, "--resume"]) == 0
    assert _main([*common, "--out-dir", out + "_full"]) == 0
    assert losses(out) == losses(out + "_full")


def test_own_failures_and_peer_failures_are_told_apart(corpus, tmp_path, monkeypatch, capsys):
    """An out-of-memory error names itself and the intact checkpoint (exit 1), not a peer; a peer's
    connection dropping while a checkpoint is written (DCP wraps it) is a peer failure (exit 4), not
    a failed write (exit 5); a cut last line in metrics.jsonl (a crash mid-write) does not stop a
    --resume; a loss.png that cannot be written is named."""
    import checkpoint
    import task
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "4", "--ckpt-interval", "2", "--eval-batches", "1",
              "--eval-interval", "2", "--sample-tokens", "0", "--out-dir", out]
    real_loss = task.LanguageModel.loss

    def oom_at_step_3(model, batch):  # (training calls run with grad enabled, evaluations without)
        oom_at_step_3.calls += torch.is_grad_enabled()
        if oom_at_step_3.calls == 3:
            raise torch.OutOfMemoryError("CPU out of memory: tried to allocate 64.00 GiB")
        return real_loss(model, batch)
    oom_at_step_3.calls = 0
    monkeypatch.setattr(task.LanguageModel, "loss", staticmethod(oom_at_step_3))
    assert _main(common) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: out of memory at step 3 (CPU out of memory") and "checkpoint step_000002 is intact" in err, err
    monkeypatch.setattr(task.LanguageModel, "loss", staticmethod(real_loss))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "lo')  # the crash cut this record
    real_write = checkpoint.write_shards

    def peer_drops(tmp, state):
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
        dropped = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        raise CheckpointException("save", {1: _wrap_exception(dropped)})  # (what DCP raises on rank 0)
    monkeypatch.setattr(checkpoint, "write_shards", peer_drops)
    assert _main([*common, "--resume"]) == 4
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: a collective failed at step 4: a peer process died or stalled") and len(err.splitlines()) == 1, err
    assert not os.path.exists(os.path.join(out, "checkpoints", "step_000004.tmp"))
    monkeypatch.setattr(checkpoint, "write_shards", real_write)
    import matplotlib.figure
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    assert _main([*common, "--resume"]) == 5
    err = capsys.readouterr().err.strip()
    assert err == f"error: a write failed: No space left on device: {os.path.join(out, 'loss.png')}", err


def test_the_watchdog_of_one_process_blames_no_peer_and_evaluation_batches_are_progress(corpus, tmp_path):
    """One process has no peer: its watchdog line says the process is stuck (exit 4). Every
    evaluation batch is progress: an evaluation longer than --watchdog in all is not a stall."""
    code = "import rundir, time; rundir.Watchdog(0.5, 0, peers=False); time.sleep(30)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4 and "the process is stuck or too slow" in proc.stderr and "peer" not in proc.stderr
    import rundir
    beats = []
    monkeypatch_beat = rundir.Watchdog.beat
    try:
        rundir.Watchdog.beat = lambda self, where: beats.append(where) or monkeypatch_beat(self, where)
        assert _main([*TINY, "--data", corpus, "--steps", "1", "--eval-batches", "3", "--sample-tokens", "0",
                      "--out-dir", str(tmp_path / "r")]) == 0
    finally:
        rundir.Watchdog.beat = monkeypatch_beat
    assert [b for b in beats if b.startswith("evaluation batch")] == [f"evaluation batch {i} at step {s}"
                                                                     for s in (0, 1) for i in (1, 2, 3)]


# ------------------------------------------------------------------------------------------------
# jax_op.py + kernels_pallas.py. Oracles: plain PyTorch, JAX's production splash attention and
# megablox kernels, the lowered program's array sizes, CPU (for XLA:CPU through call_jax)

def _grads(fn, inputs, cot):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, [x for x in inputs if x.requires_grad], cot)


TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,S,D,window,segments,block", [
    (2, 4, 2, 40, 16, None, False, 16),   # GQA, S not a multiple of the block
    (1, 4, 1, 50, 8, 7, True, 16),        # window + packed documents, MQA
    (1, 2, 2, 64, 16, 20, False, 32),     # window only
])
def test_splash_attention_matches_reference(dtype, B, H, Hkv, S, D, window, segments, block):
    import kernels_pallas as kp
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


def test_splash_full_attention_equals_plain_softmax_attention():
    """Non-causal splash (FLUX's joint attention): every block live, the padded keys masked; forward
    and gradients equal softmax(q k^T / sqrt(D)) v written here. S = 40 in blocks of 16: two FULL
    blocks and a padded one per row."""
    import kernels_pallas as kp
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
@pytest.mark.parametrize("N,D,V", [(37, 16, 300), (64, 8, 256)])
def test_fused_linear_cross_entropy_matches_reference(dtype, N, D, V):
    import kernels_pallas as kp
    from model import plain_cross_entropy
    torch.manual_seed(0)
    h = torch.randn(N, D, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::5] = -100  # ignored rows
    loss, grads = _grads(lambda h, w: kp.fused_linear_cross_entropy(h, w, t, block_n=16, block_v=128), (h, w), None)
    ref = [x.detach().float().requires_grad_() for x in (h, w)]
    want, want_grads = _grads(lambda h, w: plain_cross_entropy(h, w, t), ref, None)
    torch.testing.assert_close(loss.float(), want, **TOL[dtype])
    for g, w_ in zip(grads, want_grads):
        torch.testing.assert_close(g.float(), w_, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[3, 0, 10, 7], [0, 0, 20, 0], [5, 5, 5, 5], [1, 17, 0, 2]])
def test_grouped_matmul_matches_reference(dtype, sizes):
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


def test_splash_matches_jax_production_splash_attention():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    import kernels_pallas as kp
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
    S, D = 4096, 64
    f = lambda q, k, v, s: kp.splash_jax.jax_fn(q, k, v, s, window=0, block=128, segments=1).sum()
    qs = jax.ShapeDtypeStruct((1, 1, S, D), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, S), jnp.int32)
    biggest = _largest_intermediate(jax.grad(f, (0, 1, 2)), qs, qs, qs, seg)
    assert S * D <= biggest < S * S
    T, V = 4096, 32768
    g = lambda h, w, t: kp.fused_ce_jax.jax_fn(h, w, t, ignore_index=-100, block_n=256, block_v=512)
    biggest = _largest_intermediate(jax.grad(g, (0, 1)), jax.ShapeDtypeStruct((T, D), jnp.float32),
                                    jax.ShapeDtypeStruct((V, D), jnp.float32), jax.ShapeDtypeStruct((T,), jnp.int32))
    assert V * D <= biggest < T * V


def test_jax_ops_are_single_nodes_under_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx
    import kernels_pallas as kp
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
    import kernels_gmm
    torch.manual_seed(0)
    xla = torch_xla.device()  # the XLA runtime starts before any CPU backward (see README)
    q, k, v = torch.randn(1, 2, 24, 8), torch.randn(1, 1, 24, 8), torch.randn(1, 1, 24, 8)
    h, w, t = torch.randn(20, 8), torch.randn(40, 8), torch.randint(0, 40, (20,))
    x, wg, gs = torch.randn(12, 8), torch.randn(3, 8, 4), torch.tensor([5, 0, 7])

    def run(d):
        qq, kk, vv, hh, ww, xx, wgw = (z.to(d).requires_grad_() for z in (q, k, v, h, w, x, wg))
        a = kp.splash_attention(qq, kk, vv, window=5)
        l = kp.fused_linear_cross_entropy(hh, ww, t.to(d))
        m = kernels_gmm.gmm(xx, wgw, gs.to(d))
        total = a.square().sum() + l + m.square().sum()
        grads = torch.autograd.grad(total, (qq, kk, vv, hh, ww, xx, wgw))
        return [z.detach().cpu() for z in (a, l, m, *grads)]
    on_cpu, on_xla = run("cpu"), run(xla)
    print("diffs", json.dumps([(a - b).abs().max().item() for a, b in zip(on_cpu, on_xla)]))  # (NaN: json's NaN)


def test_kernels_on_xla_cpu_through_call_jax_equal_cpu():
    proc = subprocess.run([sys.executable, "test_all.py", "child_xla_kernels"], cwd=HERE, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.split("diffs")[1])
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


# ------------------------------------------------------------------------------------------------
# parallel.py + mesh.py + simplefsdp.py (gloo, CPU, torchrun). Oracles: one process on the same global batch
# (losses, gradient norms, validation, final parameters), FSDP2, eager (for the traced graph)

@pytest.mark.parametrize("nproc,mesh,impl,flavor", [(2, "ici=2", "simple", "llama3_debug"),
                                                    (4, "dcn=2,ici=2", "simple", "llama3_debug"),
                                                    (2, "ici=2", "fsdp2", "llama3_debug"),
                                                    (2, "ici=2", "simple", "qwen3_moe_debug")])
def test_data_parallel_matches_single_process(nproc, mesh, impl, flavor, corpus, tmp_path, tmp_path_factory):
    common = [*DIST_TINY, "--flavor", flavor, "--data", corpus, "--steps", "10", "--ckpt-interval", "0",
              "--eval-batches", "1", *(["--set", "moe_ffn_dim=32", "--set", "aux_loss_coef=0"] if "moe" in flavor else [])]
    # (MoE: the load-balancing loss E * sum_e f_e * P_e is computed per rank, as is usual, and is not
    # linear in the batch, so only with it off is N ranks' step exactly one process's step.)
    single, multi = one_process_run(common, tmp_path_factory), str(tmp_path / "multi")
    rc, out, err = torchrun(nproc, [*common, "--out-dir", multi, "--mesh", mesh, "--dp-impl", impl])
    assert rc == 0, err[-3000:]
    # (Partial("sum") for Partial("avg") doubles every gradient and still trains the same: the pre-clip
    # norms see it. And every rank validates its own rows.)
    p_single = _ranks_equal_one_process(single, multi, 10, common)
    # MFU is per device: all ranks' FLOP/s over the sum of their peaks (it was over one device's peak).
    for rec in (json.loads(line) for line in open(os.path.join(multi, "metrics.jsonl"))):
        if "mfu" in rec:
            assert rec["devices"] == nproc and math.isclose(rec["mfu"] * rec["peak_flops"] * nproc, rec["tflops"] * 1e12)
    # Per-rank parameter and optimizer bytes: 1/shards of the total, plus at most one row per tensor.
    start = lambda d: next(json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if '"start"' in line)
    shards = int(mesh.split("ici=")[1])
    row_bytes = sum(p[0].numel() * 4 for p in p_single.values())
    for key in ("param_bytes_local", "optim_bytes_local"):
        total, local = start(single)[key], start(multi)[key]
        slack = row_bytes * (2 if key == "optim_bytes_local" else 1)
        assert total / shards <= local <= total / shards + slack, (key, total, local)


def test_sharded_resume_equals_uninterrupted_and_other_mesh_is_refused(corpus, tmp_path):
    common = [*DIST_TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "0",
              "--mesh", "ici=2"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert torchrun(2, [*common, "--out-dir", full])[0] == 0
    assert torchrun(2, [*common, "--out-dir", part, "--halt-at", "3"])[0] == 0
    rc, out, err = torchrun(2, [*common, "--out-dir", part, "--resume"])
    assert rc == 0, err[-3000:]
    assert losses(part) == losses(full)
    rc, _, err = torchrun(4, [*common[:-2], "--mesh", "dcn=2,ici=2", "--out-dir", part, "--resume"])
    assert rc != 0 and "was saved on mesh 'ici=2', this run uses 'dcn=2,ici=2'" in err
    # One process <-> two: refused both ways (DCP could reshard; we do not claim it, so we refuse).
    rc, _, err = run_train([*common[:-2], "--out-dir", part, "--resume", "--steps", "8", "--allow-change", "steps"])
    assert rc == 2 and "was saved on mesh 'ici=2', this run uses None" in err
    single = str(tmp_path / "single")
    assert run_train([*common[:-2], "--out-dir", single, "--halt-at", "3"])[0] == 0
    rc, _, err = torchrun(2, [*common, "--out-dir", single, "--resume"])
    assert rc != 0 and "was saved on mesh None, this run uses 'ici=2'" in err


def test_mesh_that_does_not_match_world_size_fails_fast(corpus, tmp_path):
    rc, _, err = torchrun(2, [*DIST_TINY, "--data", corpus, "--steps", "2", "--mesh", "ici=4",
                              "--out-dir", str(tmp_path / "r")], timeout=120)
    assert rc != 0 and "error: --mesh 'ici=4' has 4 devices but the world size is 2" in err
    assert not os.path.exists(tmp_path / "r")
    for mesh, extra, message in [("ici=1,tp=2", ["--set", "n_kv_heads=1"], "n_kv_heads=1 is not divisible by tp=2"),
                                 ("ici=1,tp=2", ["--set", "ffn_dim=131"], "ffn_dim=131 is not divisible by tp=2"),
                                 ("ici=2,ep=4", [], "ep=4 must divide the data-parallel ranks dcn x ici = 2"),
                                 ("ici=2,ep=2", [], "n_experts")]:
        rc, _, err = torchrun(2, [*TINY, "--data", corpus, "--steps", "2", "--mesh", mesh, *extra,
                                  "--out-dir", str(tmp_path / "r")], timeout=120)
        # One line per rank that gets to say it, each one write (torchrun ends the other rank with SIGTERM
        # once the first exits: on a loaded machine that can be before the second has printed its line).
        lines = [l for l in err.splitlines() if l.startswith("error:")]
        assert rc != 0 and len(lines) in (1, 2) and all(message in l and l.count("error:") == 1 for l in lines), err[-2000:]
        assert not os.path.exists(tmp_path / "r")


def _signal_one_of_two_ranks(corpus, out_dir, sig, *extra):
    """A long 2-rank run; once it is logging, send `sig` to one rank: (torchrun process, worker pids,
    the time it was sent)."""
    import time
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             os.path.join(HERE, "train.py"), *DIST_TINY, "--data", corpus, "--steps", "100000",
                             "--eval-batches", "0", "--ckpt-interval", "0", "--mesh", "ici=2", "--out-dir", str(out_dir),
                             *extra], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out_dir / "metrics.jsonl").exists():
        time.sleep(0.5)
    time.sleep(2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), sig)
    return proc, workers, time.time()


def test_a_killed_rank_ends_the_run_within_60s(corpus, tmp_path):
    """The two ranks are started by hand (torchrun's environment, no torchrun): torchrun would end the
    survivor itself with SIGTERM and print its own words for the killed rank, which would pass even
    if the survivor hung. Here the survivor must end itself: its own one `error:` line, exit 4."""
    import socket
    import time
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_dir = tmp_path / "r"
    ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *DIST_TINY, "--data", corpus, "--steps",
                               "100000", "--eval-batches", "0", "--ckpt-interval", "0", "--mesh", "ici=2", "--out-dir",
                               str(out_dir)], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "OMP_NUM_THREADS": "1"}) for r in (0, 1)]
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out_dir / "metrics.jsonl").exists():
            time.sleep(0.5)
        time.sleep(2)
        assert ranks[0].poll() is None and ranks[1].poll() is None, "the run ended before the kill"
        ranks[1].kill()
        killed_at = time.time()
        _, err = ranks[0].communicate(timeout=90)
        took = time.time() - killed_at
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    lines = [l for l in err.splitlines() if l.strip()]
    assert took < 60 and ranks[0].returncode == 4, (took, ranks[0].returncode, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: a collective failed at step "), err[-3000:]
    assert "a peer process died or stalled" in lines[0], err[-3000:]


def test_a_stalled_peer_ends_every_rank_within_the_watchdog(corpus, tmp_path):
    """A peer that stops without dying (SIGSTOP) leaves the other rank waiting inside a collective,
    where no gloo timeout fires: the watchdog ends it (exit 4, one line naming where), and torchrun
    then ends the stopped one."""
    import signal
    import time
    proc, workers, stopped_at = _signal_one_of_two_ranks(corpus, tmp_path / "r", signal.SIGSTOP, "--watchdog", "10")
    try:
        def alive(pid):  # torchrun's child: gone, or a zombie until torchrun reaps it
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False
        while alive(workers[0]) and time.time() - stopped_at < 90:
            time.sleep(0.2)
        took = time.time() - stopped_at
        # torchrun's SIGTERM cannot reach a stopped process; it would wait 30 s before SIGKILL: end it now.
        subprocess.run(["kill", "-9", workers[1]], capture_output=True)
        _, err = proc.communicate(timeout=120)
    finally:
        for w in workers:  # never leave a stopped process behind
            subprocess.run(["kill", "-9", w], capture_output=True)
    assert took < 60 and proc.returncode != 0, (took, err[-3000:])
    line = next(l for l in err.splitlines() if "no progress for" in l)
    assert line.startswith("error: rank ") and "in step " in line and "(--watchdog 10)" in line, line
    assert "exitcode: 4" in err


def child_simplefsdp_fx():
    """(child process, torchrun, 2 ranks) make_fx of a SimpleFSDP model's forward + backward."""
    from torch.fx.experimental.proxy_tensor import make_fx
    import mesh
    import simplefsdp
    ctx = mesh.TorchrunMesh("ici=2")
    torch.manual_seed(0)
    model = simplefsdp.data_parallel(torch.nn.Sequential(torch.nn.Linear(8, 7, bias=False),
                                                         torch.nn.Linear(7, 3, bias=False)), ctx.mesh["ici"])
    params = list(model.parameters())
    x = torch.randn(4, 8) + ctx.global_rank

    def step(x):
        with torch.enable_grad():
            loss = model(x).square().mean()
            grads = torch.autograd.grad(loss, params)
        return [g.to_local() for g in grads]
    gm = make_fx(step)(x)
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    with torch.no_grad():  # a traced graph already holds its backward: run it without autograd
        got = gm(x)
    want = step(x)
    with simplefsdp.parametrization_off():
        shard = model[0].weight
        assert isinstance(shard, torch.distributed.tensor.DTensor) and shard.to_local().shape[0] == (4 if ctx.global_rank == 0 else 3)
    if ctx.global_rank == 0:
        print("RESULT", {k: names.count(k) for k in ("_c10d_functional.all_gather_into_tensor.default",
                                                     "_c10d_functional.reduce_scatter_tensor.default",
                                                     "_c10d_functional.wait_tensor.default")},
              [(a - b).abs().max().item() for a, b in zip(got, want)])


def test_simplefsdp_collectives_are_nodes_of_the_traced_graph(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "test_all.py", "child_simplefsdp_fx"], cwd=HERE, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    import ast
    counts = ast.literal_eval(line[len("RESULT"):line.rindex("}") + 1].strip())
    assert counts["_c10d_functional.all_gather_into_tensor.default"] == 2      # one per parameter
    assert counts["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert counts["_c10d_functional.wait_tensor.default"] >= 4
    assert ast.literal_eval(line[line.rindex("}") + 1:].strip()) == [0.0, 0.0]   # graph == eager (NaN != 0.0)


# ------------------------------------------------------------------------------------------------
# spmd.py (one process, 4 virtual XLA:CPU devices: CPU_NUM_DEVICES=4). Oracles: one eager CPU
# process on the same global batch, the partitioned program's collectives and replica groups,
# torch_xla's compile counter, the uninterrupted run (resume)

SPMD_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}


def child_spmd_steps(*argv):
    """(child process) train.py's Trainer under XLA SPMD, step by step: losses, compile counts, the
    partition specs of parameters and AdamW state after the updates, per-device bytes."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import device
    import spmd
    import train
    cfg = train.parse_config(argv)
    ctx = spmd.XlaSpmd(cfg.mesh)
    tr = train.Trainer(cfg, ctx)
    out, norms, compiles = [], [], []
    for i in range(1, cfg.steps + 1):
        xs, ys = ctx.place_batch(tr.task.batch(i))
        ce, norm = tr.step_fn(xs, ys, device.scalar(optim.lr_at(i, cfg.lr, cfg.warmup, cfg.steps), tr.device))
        torch_xla.sync()
        out.append(ce.item())
        norms.append(norm.item())
        compiles.append(met.metric_data("CompileTime")[0])
    spec = torch_xla._XLAC._get_xla_sharding_spec
    os.makedirs(cfg.out_dir, exist_ok=True)  # the final weights, gathered to the host, for the test
    torch.save({n: p.detach().cpu() for n, p in zip(tr.param_names, tr.params)}, os.path.join(cfg.out_dir, "params.pt"))
    print(json.dumps({"losses": out, "norms": norms, "compiles": compiles, "specs": [spec(p) for p in tr.params],
                      "batch_spec": spec(xs), "batch_shards": [list(t.shape) for t, _ in torch_xla._XLAC._get_local_shards([xs])[0]],
                      "state_specs": [spec(t) for t in tr.opt.state["exp_avg"] + tr.opt.state["exp_avg_sq"]],
                      "shapes": [list(p.shape) for p in tr.params],
                      "param_bytes": ctx.local_bytes(tr.params), "total_bytes": sum(p.numel() * 4 for p in tr.params)}))


def _replica_groups(hlo, op):
    """The replica groups of every `op` in HLO text, as sets of tuples (explicit or iota form)."""
    import numpy as np
    found = []
    for m in re.finditer(rf"= [^\n]*? {op}\([^\n]*?replica_groups=(\{{[^ ]*?\}}\}}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", hlo):
        g = m.group(1)
        if g.startswith("{"):
            found.append(frozenset(tuple(map(int, x.split(","))) for x in re.findall(r"\{([\d,]+)\}", g)))
        else:  # [groups,size]<=[dims]T(perm): iota over dims, transposed, reshaped
            shape, dims, perm = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", g).groups()
            ids = np.arange(int(np.prod([int(d) for d in dims.split(",")]))).reshape([int(d) for d in dims.split(",")])
            if perm:
                ids = ids.transpose([int(p) for p in perm.split(",")])
            found.append(frozenset(tuple(r) for r in ids.reshape([int(s) for s in shape.split(",")]).tolist()))
    return found


@pytest.mark.parametrize("mesh,mode,extra", [("ici=4", "eager", []), ("dcn=2,ici=2", "graph", []),
                                             ("ici=4", "graph", ["--scan", "--set", "n_layers=4"]),
                                             ("dcn=2,ici=2", "eager", ["--flavor", "qwen3_debug", "--scan", "--set", "n_layers=4"])])
def test_spmd_mesh_on_xla_equals_one_cpu_process(mesh, mode, extra, corpus, tmp_path):
    args = [*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "0", "--eval-batches", "0", *extra]
    dump = tmp_path / "hlo"
    proc = subprocess.run([sys.executable, "test_all.py", "child_spmd_steps", *args, "--out-dir", str(tmp_path / "x"),
                           "--device", "xla", "--mesh", mesh, "--mode", mode], cwd=HERE, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **SPMD_ENV, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    oracle, norms = _trainer(corpus, tmp_path, *extra), []
    want = _train_losses(oracle, steps=8, norms=norms)
    _near(want, res["losses"], atol=1e-4)
    # Gradients and weights too: clipping and Adam's normalization hide a gradient scale from losses.
    _near(norms, res["norms"], atol=0, rtol=1e-4)
    got = torch.load(tmp_path / "x" / "params.pt")
    assert list(got) == oracle.param_names
    for name, p in zip(oracle.param_names, oracle.params):  # (XLA:CPU sums in another order: measured 1.6e-5
        # on one of 32768 elements after 8 steps; one step's update is ~lr = 3e-3)
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
    # The batch is split over every data-parallel device, dcn included: a batch replicated across
    # slices computes the same numbers (GSPMD keeps the semantics), so only its layout shows it.
    dp = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    assert res["batch_spec"].startswith(f"{{devices=[{dp},1]") and "replicate" not in res["batch_spec"], res["batch_spec"]
    assert res["batch_shards"] == [[4 // dp, 32]] * dp, res["batch_shards"]
    ici = int(mesh.split("ici=")[1])
    # Sharded, and still sharded after 8 updates: parameters and both AdamW moments, 1/ici per device.
    assert all(s.startswith("{devices=[") for s in res["specs"] + res["state_specs"]), res["specs"]
    assert res["total_bytes"] / ici <= res["param_bytes"] < res["total_bytes"] / ici * 1.1
    if mode == "graph":  # one step program, compiled at step 1 and never again
        assert res["compiles"][0] == res["compiles"][-1], res["compiles"]
    # The partitioned step program (the largest after-optimizations module) holds the collectives.
    hlo = max((p for p in dump.iterdir() if p.name.endswith("after_optimizations.txt")), key=lambda p: p.stat().st_size).read_text()
    gathers = _replica_groups(hlo, "all-gather")
    assert gathers, "no all-gather in the step program"
    if mesh == "dcn=2,ici=2":  # gathers inside each ici pair; gradients summed across the dcn replicas
        assert frozenset({(0, 1), (2, 3)}) in gathers, gathers
        assert frozenset({(0, 2), (1, 3)}) in _replica_groups(hlo, "all-reduce")
    else:
        assert frozenset({(0, 1, 2, 3)}) in gathers, gathers
    if "--scan" in extra:  # one layer gathered per iteration: inside the While bodies, no stack outside
        bodies = set(re.findall(r" while\([^\n]*?body=%?([\w.\-]+)", hlo))
        entry = hlo[hlo.index("\nENTRY"):]
        assert len(bodies) == 2 and all(" all-gather(" in _hlo_computation(hlo, b) for b in bodies), bodies
        gathered = {tuple(map(int, m.split(","))) for m in re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", entry)}
        stacks = {tuple(shape) for shape in res["shapes"] if len(shape) > 1 and shape[0] == 4}
        assert stacks and not gathered & stacks, gathered & stacks


def _hlo_computation(hlo, name):
    start = hlo.index(f"%{name} ")
    return hlo[start:hlo.index("\n}", start)]


def test_spmd_resume_is_bit_for_bit_and_bad_meshes_are_refused(corpus, tmp_path):
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "1",
              "--device", "xla", "--mesh", "ici=4", "--sample-tokens", "0"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert run_train([*common, "--out-dir", full], env=SPMD_ENV)[0] == 0
    assert run_train([*common, "--out-dir", part, "--halt-at", "3"], env=SPMD_ENV)[0] == 0
    rc, out, err = run_train([*common, "--out-dir", part, "--resume"], env=SPMD_ENV)
    assert rc == 0, err[-3000:]
    assert losses(part) == losses(full) and _records(part, "val_loss") == _records(full, "val_loss")
    start = next(json.loads(line) for line in open(os.path.join(full, "metrics.jsonl")) if '"start"' in line)
    assert start["devices"] == 4
    for extra, message in [(["--mesh", "ici=8"], "has 8 devices but XLA sees 4"),
                           (["--kernels", "pallas"], "drop --kernels pallas")]:
        rc, _, err = run_train([*common, "--out-dir", str(tmp_path / "bad"), *extra], env=SPMD_ENV)
        assert rc == 2 and err.strip().startswith("error:") and message in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------
# tensor_parallel.py + expert_parallel.py (gloo, CPU, torchrun). Oracles: one process on the same global
# batch (losses, gradient norms, validation, final weights), the planner's per-device bytes, the uninterrupted run

TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")


MOE_EXACT = ["--set", "moe_ffn_dim=32", "--set", "aux_loss_coef=0"]  # (aux loss per rank: see above)


@pytest.mark.parametrize("nproc,mesh,flavor,extra", [
    (2, "ici=1,tp=2", "llama3_debug", []), (2, "ici=1,tp=2", "qwen3_debug", ["--mode", "graph"]),
    (4, "ici=2,tp=2", "llama3_debug", []), (4, "dcn=2,ici=1,tp=2", "qwen3_debug", []),
    (2, "ici=2,ep=2", "qwen3_moe_debug", MOE_EXACT), (4, "dcn=2,ici=2,ep=2", "qwen3_moe_debug", MOE_EXACT),
    (2, "ici=2,ep=2", "qwen3_moe_debug", [*MOE_EXACT, "--mode", "graph", "--kernels", "pallas"])])
def test_tensor_and_expert_parallel_match_single_process(nproc, mesh, flavor, extra, corpus, tmp_path, tmp_path_factory):
    """Tensor + sequence parallelism (tensor_parallel.py) and expert parallelism (expert_parallel.py),
    under SimpleFSDP's 2-D placements, vs one process on the same global batch: losses, gradient
    norms, validation and final weights to 1e-5; per-rank parameter and AdamW bytes: 1/(ici x tp) of
    the split matmuls, 1/(ep x its FSDP size) of the experts, 1/ici of the rest; in graph mode the
    TP collectives / EP all-to-alls are nodes of the one step graph (EP traced: static buffers)."""
    common = [*TINY, "--flavor", flavor, "--data", corpus, "--steps", "10", "--ckpt-interval", "0", "--eval-batches", "1"]
    single, multi = one_process_run([*common, *[a for a in extra if a in MOE_EXACT]], tmp_path_factory), str(tmp_path / "multi")
    rc, out, err = torchrun(nproc, [*common, *extra, "--out-dir", multi, "--mesh", mesh])
    assert rc == 0, err[-3000:]
    p_single = _ranks_equal_one_process(single, multi, 10, [*common, *extra])
    dims = {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}
    ici, tp = dims["ici"], dims.get("tp", 1)
    share = lambda n: nproc if "_Ex" in n else ici * (tp if any(k in n for k in TP_SPLIT) else 1)
    want_bytes = sum(p.numel() * 4 / share(n) for n, p in p_single.items())
    start = next(json.loads(line) for line in open(os.path.join(multi, "metrics.jsonl")) if '"start"' in line)
    assert start["param_bytes_local"] == want_bytes and start["optim_bytes_local"] == 2 * want_bytes
    # the planner's per-device figures for this layout are the run's measured allocation
    import dryrun
    import mesh as mesh_lib
    import train
    cfg = train.parse_config([*common, *extra])
    report = dryrun.dry_run(train.model_args(cfg), flavor, mesh_lib.mesh_dims(mesh), cfg.batch_size, cfg.seq_len,
                            "tpu_v5p", remat=False)
    assert report["memory_bytes"]["params (fp32 shard)"] == start["param_bytes_local"]
    assert report["memory_bytes"]["AdamW state (fp32 shard)"] == start["optim_bytes_local"]
    if "graph" in extra:
        graph = next(json.loads(line) for line in open(os.path.join(multi, "metrics.jsonl")) if '"graph"' in line)
        fwd, bwd = graph["collectives_by_side"]["forward"], graph["collectives_by_side"]["backward"]
        if "tp" in dims:  # per block: SP's all-gathers before attention and MLP, reduce-scatters after
            assert fwd["all_gather_into_tensor"] >= 2 * 2 + 1 and fwd["reduce_scatter_tensor"] >= 2 * 2, fwd
        else:  # per MoE layer: counts, rows out, rows back (forward); rows out and back (backward)
            assert fwd["all_to_all_single"] == 3 * 2 and bwd["all_to_all_single"] == 2 * 2, (fwd, bwd)


@pytest.mark.parametrize("mesh,flavor,other", [("ici=1,tp=2", "llama3_debug", "ici=2"),
                                               ("ici=2,ep=2", "qwen3_moe_debug", "ici=2")])
def test_tp_and_ep_checkpoints_resume_bit_for_bit_and_another_layout_is_refused(mesh, flavor, other, corpus, tmp_path):
    common = [*TINY, "--flavor", flavor, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "0",
              *(MOE_EXACT if "moe" in flavor else [])]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    assert torchrun(2, [*common, "--mesh", mesh, "--out-dir", full])[0] == 0
    assert torchrun(2, [*common, "--mesh", mesh, "--out-dir", part, "--halt-at", "3"])[0] == 0
    with open(os.path.join(part, "checkpoints", "latest"), "w") as f:
        f.write("garbage")  # -> one note at resume, printed by the one process that writes
    rc, out, err = torchrun(2, [*common, "--mesh", mesh, "--out-dir", part, "--resume"])
    assert rc == 0, err[-3000:]
    assert losses(part) == losses(full)
    assert err.count("note: ") == 1, err  # (under tp both ranks of a tp group are data-parallel rank 0)
    if "tp" in mesh:  # --resume-from twice: idempotent, done by one process, superseded ones kept
        for _ in range(2):
            rc, _, err = torchrun(2, [*common, "--mesh", mesh, "--out-dir", part, "--resume-from", "step_000003"])
            assert rc == 0, err[-3000:]
        assert sorted(os.listdir(os.path.join(part, "checkpoints"))) == [
            "latest", "step_000003", "step_000006", "step_000006.superseded", "step_000006.superseded.2"]
        assert losses(part) == losses(full)
    rc, _, err = torchrun(2, [*common, "--mesh", other, "--out-dir", part, "--resume", "--steps", "8", "--allow-change", "steps"])
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert rc != 0 and lines and all(f"was saved on mesh '{mesh}', this run uses '{other}'" in l for l in lines), err[-2000:]


# ------------------------------------------------------------------------------------------------
# graph_trainer.py. Oracles: the eager loop, one process (under HSDP), torch_xla's compile counter

@pytest.mark.parametrize("extra", [[], ["--flavor", "qwen3_moe_debug", "--kernels", "pallas", "--set", "moe_ffn_dim=32"]])
def test_graph_mode_is_one_graph_and_equals_eager(corpus, tmp_path, extra):
    eager = _trainer(corpus, tmp_path, *extra)
    graph = _trainer(corpus, tmp_path, "--mode", "graph", *extra)
    want, got = _train_losses(eager), _train_losses(graph)
    _near(want, got, atol=1e-5)
    for p, q in zip(eager.params, graph.params):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    import graph_trainer
    ops = graph_trainer.op_counts(graph.step_fn.gm)
    # forward (embedding, matmuls), backward (embedding_dense_backward), optimizer (sqrt of AdamW's
    # second moment, foreach lerp), all in ONE GraphModule:
    assert ops.get("aten.embedding.default") == 1 and ops.get("aten.embedding_dense_backward.default") == 1
    assert any("lerp" in k for k in ops) and any("sqrt" in k for k in ops)
    assert sum(v for k, v in ops.items() if k in ("aten.mm.default", "aten.bmm.default")) >= 3 * 4 * 2


def test_compile_mode_matches_eager_over_20_steps(corpus, tmp_path):
    want = _train_losses(_trainer(corpus, tmp_path))
    compiled = _trainer(corpus, tmp_path, "--mode", "compile")
    got = _train_losses(compiled)
    _near(want, got, atol=1e-5)
    ran = _ops_of_one_more_step(compiled)  # dynamo's frames ran, and inductor's compiled code in them
    assert any(n.startswith("Torch-Compiled Region") for n in ran) and any("CompiledFxGraph" in n for n in ran), sorted(ran)


def test_graph_mode_inductor_backend_matches_eager(corpus, tmp_path):
    want = _train_losses(_trainer(corpus, tmp_path), steps=6)
    inductor = _trainer(corpus, tmp_path, "--mode", "graph", "--backend", "inductor")
    got = _train_losses(inductor, steps=6)
    _near(want, got, atol=1e-4)
    ran = _ops_of_one_more_step(inductor)  # inductor's compiled step ran, not the FX interpreter
    assert any("CompiledFxGraph" in n for n in ran), sorted(ran)


def child_xla_graph_steps(*argv):
    """(child process) 8 steps (or --steps, if fewer) of train.py's step function on XLA, any task's
    batches; losses and compile counts."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import device
    import train
    cfg = train.parse_config(argv)
    tr = train.Trainer(cfg)
    out, compiles = [], []
    for i in range(1, min(cfg.steps, 8) + 1):
        batch = [t.to(tr.device) for t in tr.task.batch(i)]
        ce, _ = tr.step_fn(*batch, device.scalar(optim.lr_at(i, cfg.lr, cfg.warmup, 8), tr.device))
        torch_xla.sync()
        out.append(ce.item())
        compiles.append(met.metric_data("CompileTime")[0])
    print(json.dumps({"losses": out, "compiles": compiles}))


@pytest.mark.parametrize("mode,scan", [("graph", False), ("graph", True)])
def test_xla_compiles_one_program_per_step_shape(mode, scan, corpus, tmp_path):
    # (Not asserted for --mode eager: there, on a loaded machine, a step now and then compiles a new
    # program (6 of 12 runs with two at once); see README, Known limits.)
    args = [*TINY, "--data", corpus, "--ckpt-interval", "0", "--eval-batches", "0", "--out-dir", str(tmp_path / "x"),
            *(["--scan"] if scan else [])]
    proc = subprocess.run([sys.executable, "test_all.py", "child_xla_graph_steps", *args, "--mode", mode, "--device", "xla"],
                          cwd=HERE, capture_output=True, text=True, timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # Step 1 compiles the step program (after one small program that materializes the initial
    # state); no step compiles again, also not step 2, whose bias correction (1 - 0.9 = 0.1) equals
    # the weight decay: per-step scalars enter as inputs that torch_xla does not merge by value.
    assert res["compiles"][0] == res["compiles"][-1] == 2, res["compiles"]
    want = _train_losses(_trainer(corpus, tmp_path), steps=8)
    _near(want, res["losses"], atol=1e-4)


# ------------------------------------------------------------------------------------------------
# graph_passes.py. Oracles: the untransformed graph (bit for bit), the graph's structure

@pytest.mark.parametrize("flags", [["--remat"], ["--offload"], ["--split", "3"], ["--remat", "--offload", "--split", "2"]])
def test_graph_passes_keep_losses_and_do_their_job(flags, corpus, tmp_path):
    import graph_passes
    plain = _trainer(corpus, tmp_path, "--mode", "graph")
    passed = _trainer(corpus, tmp_path, "--mode", "graph", *flags)
    assert _train_losses(plain, steps=5) == _train_losses(passed, steps=5)  # bit for bit
    before, after = plain.step_fn.report, passed.step_fn.report
    assert before["saved_bytes"] == before["saved_bytes_captured"] > 0
    n_off, n_back = graph_passes.transfer_counts(passed.step_fn.gm)
    if "--remat" in flags:
        assert after["saved_bytes"] * 2 <= before["saved_bytes"]
    if "--offload" in flags:  # the graph holds the transfers; what stays on device shrinks
        assert n_off == n_back > 0 and after["offloaded_bytes"] > 0
        # Structure: an offloaded value's only post-forward reader is its reload, which the backward
        # reads instead (on TPU the offloaded copy lives in host memory: compute must never read it).
        gm = passed.step_fn.gm
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        end = graph_passes.forward_end_index(gm)
        for off in (n for n in gm.graph.nodes if n.target == torch.ops.minititan.offload.default):
            src = off.args[0]
            assert order[src] < order[off] < end and all(order[u] < end for u in src.users), src
            assert off.users and all(u.target == torch.ops.minititan.reload.default and order[u] > end for u in off.users)
        assert after["saved_bytes"] < (before["saved_bytes"] if "--remat" not in flags else after["saved_bytes_captured"])
    else:
        assert n_off == n_back == 0
    if "--split" in flags:
        assert len(passed.step_fn.compiled.stages) == int(flags[flags.index("--split") + 1])


def test_saved_activation_bytes_equal_what_autograd_keeps_beyond_the_inputs():
    """The graph report's (and the planner's) saved bytes: storage the step keeps from forward to
    backward that its inputs do not already hold. Oracle: autograd's own saved tensors (recorded by
    saved_tensors_hooks), each storage once, minus the inputs' storage. Transposed weights and
    detached copies are views: counting them (as before) doubled this figure."""
    import graph_passes
    import graph_trainer
    torch.manual_seed(0)
    w1, w2, x = torch.randn(256, 64), torch.randn(8, 256), torch.randn(4, 64)
    forward = lambda w1, w2, x: (torch.relu(x @ w1.t()) @ w2.t()).square().sum()

    def step(w1, w2, x):
        with torch.enable_grad():
            w1, w2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
            return torch.autograd.grad(graph_passes.forward_end(forward(w1, w2, x)), (w1, w2))
    gm = graph_trainer.capture(step, (w1, w2, x))
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    inputs = {t.untyped_storage().data_ptr() for t in (a, b, x)}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(a, b, x)
    assert sum(kept.values()) == 4 * 256 * 4 + 4 * 8 * 4  # relu(x w1^T) and the product squared
    assert graph_passes.saved_bytes(gm) == sum(kept.values())


# ------------------------------------------------------------------------------------------------
# fsdp_passes.py. Oracles: passes off (bit for bit), one process (under HSDP), live bytes on real tensors

def _gathers(side):
    return side.get("all_gather_into_tensor", 0) + side.get("all_gather_into_tensor_out", 0)


def test_graph_mode_with_simplefsdp_hsdp_is_one_graph_with_its_collectives(corpus, tmp_path):
    """HSDP (4 processes) in graph mode, with the SimpleFSDP passes on (the default under a mesh):
    equal to one process; one all-gather per block (+ embedding, + head) in each direction, the
    backward re-gathering what the forward gathered, no gathered weight saved in between."""
    common = [*DIST_TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "0"]
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    assert run_train([*common, "--out-dir", single])[0] == 0
    rc, out, err = torchrun(4, [*common, "--out-dir", multi, "--mesh", "dcn=2,ici=2", "--mode", "graph"])
    assert rc == 0, err[-3000:]
    for key in ("loss", "grad_norm"):
        want, got = _records(single, key), _records(multi, key)
        _near(want, got, atol=1e-5)
    graph = next(json.loads(line) for line in open(os.path.join(multi, "metrics.jsonl")) if '"graph"' in line)
    n_params = len(Transformer(dataclasses.replace(ModelArgs(), n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
                                                   ffn_dim=131)).state_dict())
    fwd, bwd = graph["collectives_by_side"]["forward"], graph["collectives_by_side"]["backward"]
    blocks = 2
    assert 1 <= _gathers(fwd) <= blocks + 2 and 1 <= _gathers(bwd) <= blocks + 2, graph["collectives_by_side"]
    assert 1 <= bwd["reduce_scatter_tensor"] <= blocks + 2
    # HSDP's gradient all-reduces over dcn, bucketed by block too (a gradient whose shard is padded
    # goes through a split and stays alone), plus the gradient norm's and the logged loss's
    assert 2 + blocks + 2 <= bwd["all_reduce"] <= n_params // 2, bwd
    assert graph["saved_gathered_bytes"] == 0
    # prefetch: every forward all-gather after the first is issued before the previous one's wait,
    # so before the previous block's first matmul (which reads that wait's result)
    assert graph["prefetched_gathers"] == _gathers(fwd) - 1 >= blocks


def test_simplefsdp_graph_passes_are_exact_and_free_the_gathered_model(corpus, tmp_path):
    """All passes on vs off, 2 processes: bit-identical losses, gradient norms and validation; off, the
    whole gathered model is saved for the backward (the fx backend frees values after their last
    use); on, none is, and the measured per-rank peak memory of a parameter-heavy model drops."""
    common = [*DIST_TINY, "--data", corpus, "--steps", "5", "--ckpt-interval", "0", "--eval-batches", "1",
              "--mode", "graph", "--mesh", "ici=2"]
    runs = {p: str(tmp_path / p) for p in ("none", "reshard,bucket,prefetch")}
    for passes, out in runs.items():
        rc, _, err = torchrun(2, [*common, "--fsdp-passes", passes, "--out-dir", out])
        assert rc == 0, err[-3000:]
    for key in ("loss", "grad_norm", "val_loss"):
        assert _records(runs["none"], key) == _records(runs["reshard,bucket,prefetch"], key), key
    graph = lambda d: next(json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if '"graph"' in line)
    full_bytes = 4 * sum(p.numel() for p in Transformer(dataclasses.replace(
        ModelArgs(), n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=131)).parameters())
    embedding = 4 * 256 * 64  # (its backward reads only the token ids: not saved)
    assert graph(runs["none"])["saved_gathered_bytes"] >= full_bytes - embedding  # (uneven shards gather padded rows)
    assert graph(runs["reshard,bucket,prefetch"])["saved_gathered_bytes"] == 0
    assert graph(runs["none"])["prefetched_gathers"] == 0
    # Memory, measured on the real tensors of a step (a parameter-heavy model, 4 blocks of 16.8M
    # parameters: 268 MB fp32 gathered, 67 MB a block): the peak of live intermediate bytes over the
    # forward and backward, run node by node, passes off vs on.
    heavy = ["--set", "n_layers=4", "--set", "dim=1024", "--set", "n_heads=8", "--set", "n_kv_heads=8",
             "--set", "ffn_dim=4096", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "0", "--steps", "1",
             "--data", corpus, "--mode", "graph", "--mesh", "ici=2", "--out-dir", str(tmp_path / "heavy")]
    peak = {}
    for passes in ("none", "reshard,bucket"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "test_all.py", "child_fsdp_live_bytes", *heavy, "--fsdp-passes", passes],
                              cwd=HERE, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        peak[passes] = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
    full, block = 4 * 67.6e6, 4 * 16.8e6
    # measured 300 -> 144 MB: the rest is one gathered block plus its full gradients before the
    # bucketed reduce-scatter, and the activations
    assert peak["none"] - peak["reshard,bucket"] > 0.6 * (full - block), peak


def child_fsdp_live_bytes(*argv):
    """(child process, torchrun) Peak live intermediate bytes of rank 0's step graph up to the
    optimizer (the first foreach op after the forward/backward marker)."""
    import graph_passes
    import train
    cfg = train.parse_config(argv)
    tr = train.Trainer(cfg)
    x, y = tr.task.batch(1)
    args = tr.step_fn.args((x, y), torch.tensor(1e-4))
    tr.step_fn(x, y, torch.tensor(1e-4))  # captures and transforms the graph
    gm = tr.step_fn.gm
    end = graph_passes.forward_end_index(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    peak = graph_passes.peak_live_bytes(gm, args, until=lambda n: order[n] > end and "_foreach" in str(n.target))
    if tr.parallel.writes_files:
        print(json.dumps({"peak": peak}))


# ------------------------------------------------------------------------------------------------
# layer_scan.py. Oracles: the unrolled loop (gradients), one process (under a mesh), HLO size

@pytest.mark.parametrize("flavor", ["llama3_debug", "qwen3_debug", "qwen3_moe_debug"])
def test_layer_scan_equals_the_unrolled_loop(flavor):
    import copy
    import layer_scan
    torch.manual_seed(0)
    unrolled = Transformer(dataclasses.replace(FLAVORS[flavor], moe_impl="gmm" if "moe" in flavor else "reference"))
    scanned = layer_scan.stack_layers(copy.deepcopy(unrolled))
    x, y = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
    ce, aux = unrolled(x, y)
    ce_s, aux_s = scanned(x, y)
    assert ce.item() == ce_s.item() and aux.item() == pytest.approx(aux_s.item(), rel=1e-6)
    ce, ce_s = ce + aux, ce_s + aux_s
    grads = dict(zip([n for n, _ in unrolled.named_parameters()], torch.autograd.grad(ce, list(unrolled.parameters()))))
    for name, g in zip([n for n, _ in scanned.named_parameters()], torch.autograd.grad(ce_s, list(scanned.parameters()))):
        if name.startswith("layers."):
            leaf = name[len("layers."):].replace("__", ".")
            want = torch.stack([grads[f"layers.{i}.{leaf}"] for i in range(len(unrolled.layers))])
        else:
            want = grads[name]
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def child_xla_scan_gradients():
    """(child process) Scan gradients on XLA vs the unrolled model on CPU; HLO size and While loops."""
    import copy
    import torch_xla
    import layer_scan
    xla = torch_xla.device()
    out = {}
    for flavor, layers in (("llama3_debug", 2), ("llama3_debug", 5), ("qwen3_moe_debug", 2)):
        torch.manual_seed(0)
        unrolled = Transformer(dataclasses.replace(FLAVORS[flavor], n_layers=layers,
                                                   moe_impl="gmm" if "moe" in flavor else "reference"))
        scanned = layer_scan.stack_layers(copy.deepcopy(unrolled)).to(xla)
        x, y = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
        want = torch.autograd.grad(sum(unrolled(x, y)), list(unrolled.parameters()))
        got = torch.autograd.grad(sum(scanned(x.to(xla), y.to(xla))), list(scanned.parameters()))
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(got))
        torch_xla.sync()  # one program for all gradients (reading them one by one would compile one each)
        by_name = dict(zip([n for n, _ in unrolled.named_parameters()], want))
        errs = []  # per gradient (a max() over them would skip a NaN)
        for name, g in zip([n for n, _ in scanned.named_parameters()], got):
            leaf = name[len("layers."):].replace("__", ".")
            w = (torch.stack([by_name[f"layers.{i}.{leaf}"] for i in range(layers)]) if name.startswith("layers.")
                 else by_name[name])
            errs.append((g.cpu() - w).abs().max().item())
        out[f"{flavor}/{layers}"] = {"errs": errs, "hlo_lines": len(hlo.splitlines()), "whiles": hlo.count(" while(")}
    print(json.dumps(out))


def test_layer_scan_on_xla_is_one_while_loop_with_the_unrolled_gradients():
    """On XLA the scan op lowers to XLA While loops (forward and backward): the program is the same
    size at 2 and 5 layers, and the gradients equal the unrolled model's on CPU (MoE: Pallas gmm
    inside the loop body, through call_jax)."""
    proc = subprocess.run([sys.executable, "test_all.py", "child_xla_scan_gradients"], cwd=HERE, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in res.values():
        assert r["errs"] and all(e < 1e-6 for e in r["errs"]) and r["whiles"] >= 2, res
    assert res["llama3_debug/2"]["hlo_lines"] == res["llama3_debug/5"]["hlo_lines"], res


def test_layer_scan_keeps_the_step_graph_constant_in_depth(corpus, tmp_path):
    sizes = {}
    for layers in (2, 8):
        for scan in (False, True):
            tr = _trainer(corpus, tmp_path, "--mode", "graph", "--set", f"n_layers={layers}", *(["--scan"] if scan else []))
            _train_losses(tr, steps=1)
            sizes[layers, scan] = len(tr.step_fn.gm.graph.nodes)
    # The optimizer's per-parameter ops grow with the parameter count; with scan there is one
    # parameter per block weight name whatever the depth, so the whole graph stays the same size.
    assert sizes[2, True] == sizes[8, True]
    assert sizes[8, False] > 3 * sizes[2, True]
    want = _train_losses(_trainer(corpus, tmp_path), steps=5)
    got = _train_losses(_trainer(corpus, tmp_path, "--mode", "graph", "--scan"), steps=5)
    moe = ["--flavor", "qwen3_moe_debug", "--kernels", "pallas", "--set", "moe_ffn_dim=32"]
    want += _train_losses(_trainer(corpus, tmp_path, *moe), steps=3)
    got += _train_losses(_trainer(corpus, tmp_path, "--mode", "graph", "--scan", *moe), steps=3)
    # Gradients agree to 1e-6 (above); the global norm sums stacked tensors in another order, so
    # the clip coefficient differs in the last bits and losses drift by ~2e-5 over 5 steps.
    _near(want, got, atol=1e-4)


@pytest.mark.parametrize("impl,mode,mesh", [("simple", "graph", "ici=2"), ("simple", "eager", "dcn=2,ici=2"),
                                            ("fsdp2", "eager", "ici=2")])
def test_layer_scan_under_a_mesh_matches_single_process(impl, mode, mesh, corpus, tmp_path):
    """SimpleFSDP: stacked (L, ...) weights sharded after the layer axis, one layer gathered per
    iteration inside the scan op, gradients reduce-scattered per layer (HSDP: and averaged over dcn).
    FSDP2: the stack is one unit. (The oracle is one process with --scan: scan vs unrolled is tested
    above, and its grad norm sums in another order, ~2e-5 over 6 steps.)"""
    common = [*DIST_TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "0", "--scan"]
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    assert run_train([*common, "--out-dir", single])[0] == 0
    nproc = 4 if mesh.startswith("dcn") else 2
    rc, out, err = torchrun(nproc, [*common, "--out-dir", multi, "--mesh", mesh, "--dp-impl", impl, "--mode", mode])
    assert rc == 0, err[-3000:]
    p_single = _ranks_equal_one_process(single, multi, 6, common, keys=("grad_norm",))
    assert any(p.dim() == 3 for p in p_single.values())  # (stacked)


def test_layer_scan_under_simplefsdp_holds_one_gathered_layer_not_the_stack(corpus, tmp_path):
    """Measured, per rank (VmHWM over a forward, and over forward + backward, minus the resident bytes
    before), on a parameter-heavy stack: 8 layers of 16.8M parameters, 537 MB fp32 gathered, 67 MB a
    layer. FSDP2, which gathers the stack as one unit, shows that the measurement sees a stack."""
    heavy = ["--scan", "--set", "n_layers=8", "--set", "dim=1024", "--set", "n_heads=8", "--set", "n_kv_heads=8",
             "--set", "ffn_dim=4096", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "0", "--steps", "2",
             "--data", corpus, "--mesh", "ici=2"]
    transient = {}
    for impl in ("simple", "fsdp2"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "test_all.py", "child_step_transient_bytes", *heavy, "--dp-impl", impl,
                               "--out-dir", str(tmp_path / impl)], cwd=HERE, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        # (a fixed mmap threshold: every tensor over 64 KiB is its own mapping, returned on free, so
        # RSS follows live bytes; glibc's adaptive threshold otherwise keeps freed 16 MB weights in
        # its heap, and the figure depended on the allocation history: 266 vs 442 MB in two runs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        transient[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    stack, layer = 8 * 4 * 16.8e6, 4 * 16.8e6
    assert transient["fsdp2"]["forward"] > stack and transient["fsdp2"]["transient"] > stack, transient
    # forward: the layer in use and the next one's all-gather in flight (prefetch); measured 2.5 layers
    assert transient["simple"]["forward"] < 3 * layer, transient
    # forward + backward: also one layer's full gradients and the flat buckets of two reduce-scatters
    # in flight (this one's and the one overlapping the next layer's vjp); measured 5.0 layers
    assert transient["simple"]["transient"] < 6 * layer < stack, transient


def child_step_transient_bytes(*argv):
    """(child process, torchrun) Rank 0's peak resident bytes during a forward + backward above what it
    held before, less the gradient shards it returns (the optimizer's own copies are not the point)."""
    import gc
    import device as dev
    import train
    cfg = train.parse_config(argv)
    tr = train.Trainer(cfg)
    for step in (1, 2):  # the first warms up (traces the block's vjp, fills the allocator's caches)
        x, y = tr.task.batch(step)
        gc.collect()
        dev.reset_peak_memory("cpu")
        before = _rss_bytes()
        ce, aux = tr.model(x, y)
        forward = dev.host_peak_rss_bytes() - before
        grads = tr.parallel.grads(ce + aux, tr.params)
        transient = dev.host_peak_rss_bytes() - before - sum(g.numel() * g.element_size() for g in grads)
        del ce, aux, grads
    if tr.parallel.writes_files:
        print(json.dumps({"transient": transient, "forward": forward}))


def _rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


# ------------------------------------------------------------------------------------------------
# dryrun.py. Oracle: a real run's allocation

def test_dry_run_bytes_equal_a_real_runs_allocation(corpus, tmp_path, capsys):
    import train
    assert train.main(["--dry-run", *TINY]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    real = _trainer(corpus, tmp_path)
    param_bytes = sum(p.numel() * p.element_size() for p in real.params)
    optim_bytes = sum(t.numel() * t.element_size() for k in ("exp_avg", "exp_avg_sq") for t in real.opt.state[k])
    assert report["memory_bytes"]["params (fp32 shard)"] == param_bytes
    assert report["memory_bytes"]["AdamW state (fp32 shard)"] == optim_bytes
    assert report["memory_bytes"]["saved activations (bf16)"] > 0 and report["fits"]


def test_plan_ranks_every_layout_of_the_chips_fast_and_refuses_impossible_ones():
    """--plan for the largest MoE flavor: under 2 minutes; every row a layout of exactly N chips that
    the model allows (ep divides the experts and the data-parallel ranks, no tp on MoE blocks);
    fitting layouts first, each group ordered by step time; the row for a layout equals that
    layout's own dry run; an impossible request is one line, exit 2."""
    import time
    t0 = time.time()
    flags = ["--dry-run", "--flavor", "qwen3_235b_a22b", "--batch-size", "256", "--seq-len", "4096"]
    rc, out, err = run_train([*flags, "--plan", "--chips", "256"], timeout=120)
    assert rc == 0 and time.time() - t0 < 120, err[-2000:]
    rows = json.loads(out.strip().splitlines()[-1])
    dims = [{k: int(v) for k, v in (p.split("=") for p in r["mesh"].split(","))} for r in rows]
    assert all(d.get("dcn", 1) * d["ici"] * d.get("tp", 1) == 256 and d.get("tp", 1) == 1 for d in dims)
    assert all(128 % d.get("ep", 1) == 0 and (d.get("dcn", 1) * d["ici"]) % d.get("ep", 1) == 0 for d in dims)
    assert any(d.get("ep", 1) > 1 for d in dims) and len({r["mesh"] for r in rows}) == len(rows) // 2
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits)
    for group in (True, False):
        steps = [r["step_s"] for r in rows if r["fits"] == group]
        assert steps == sorted(steps)
    # Every row equals its layout's own dry run (in this process; the activation bytes a sequence,
    # the one traced figure, traced once per remat setting as a single dry run does)
    import dryrun
    import mesh as mesh_lib
    import model
    import train
    args = train.model_args(train.parse_config(flags))
    per_sequence = {r: dryrun.saved_bytes_per_sequence(model.tpu_config(args), 4096, r) for r in (False, True)}
    assert any(r["remat"] for r in rows) and not all(r["remat"] for r in rows)
    for row in rows:
        own = dryrun.dry_run(args, "qwen3_235b_a22b", mesh_lib.mesh_dims(row["mesh"]), 256, 4096, "tpu_v5p",
                             row["remat"], per_sequence[row["remat"]])
        assert {k: own[k] for k in row} == row, (row, {k: own[k] for k in row})
    rc, out, err = run_train([*flags, "--plan", "--chips", "3"], timeout=120)
    assert rc == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flavor,mesh", [("llama3_405b", "dcn=2,ici=128"), ("qwen3_235b_a22b", "dcn=2,ici=128")])
def test_dry_run_of_the_largest_flavors_is_fast_and_says_whether_it_fits(flavor, mesh):
    import time
    t0 = time.time()
    rc, out, err = run_train(["--dry-run", "--flavor", flavor, "--mesh", mesh, "--batch-size", "256",
                              "--seq-len", "4096", "--remat"], timeout=120)
    assert rc == 0, err[-2000:]
    assert time.time() - t0 < 120
    report = json.loads(out.strip().splitlines()[-1])
    import dryrun
    whole, _ = dryrun.param_groups(FLAVORS[flavor])  # experts over all 256 data-parallel ranks, the rest over ici
    shard = math.ceil(whole["tp"] / 128) + math.ceil(whole["experts"] / 256) + math.ceil(whole["rest"] / 128)
    assert report["memory_bytes"]["params (fp32 shard)"] == 4 * shard
    # The verdict is the published HBM (95 GiB a v5p chip) against the sum of the parts, and the text
    # says the same ("fits" is also a key of the JSON line, so look at the text's total line).
    assert report["total_bytes"] == sum(report["memory_bytes"].values())
    assert report["fits"] == (report["total_bytes"] <= 95 * 2**30), report
    total_line = next(l for l in out.splitlines() if l.strip().startswith("total per device"))
    assert total_line.endswith("GiB HBM: fits") if report["fits"] else "GiB HBM: DOES NOT FIT: short by" in total_line, total_line
    assert report["flops_per_device"] == flops_per_token(FLAVORS[flavor], 4096) * 4096  # 1 sequence/device


def test_flux_dry_run_at_1024_through_the_task_seam_flops_shards_plan_and_a_bad_image_size(capsys):
    """flux_dev at 1024 x 1024 on 8 v5p chips under FSDP (ici=8), planned through Task.plan_workload:
    FLOPs per device are flux.py's formula (checked against FlopCounterMode and the published sizes in
    the FLUX section) for 4096 image + 512 text tokens, times the local batch; parameter, gradient and
    AdamW bytes per device are the published 11,901,408,320 parameters x 4 / 4 / 8 bytes over 8 chips;
    the gathered unit is one double block, counted here from the published config. --plan offers
    data-parallel layouts only (dcn x ici = 8, no tp / ep), its row for ici=8 equals the dry run.
    An image size the VAE (8x) and 2 x 2 packing cannot divide is one error line, exit 2."""
    import dryrun
    import flux
    import train
    flags = ["--task", "flux", "--flavor", "flux_dev", "--dry-run", "--image-size", "1024", "--batch-size", "16"]
    assert train.main([*flags, "--mesh", "ici=8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    published, chips, local = 11_901_408_320, 8, 2
    mem = report["memory_bytes"]
    assert report["params"] == published and report["local_batch"] == local and report["seq_len"] == 4096 + 512
    assert mem["params (fp32 shard)"] == mem["grads (fp32 shard)"] == 4 * published / chips
    assert mem["AdamW state (fp32 shard)"] == 8 * published / chips
    assert report["flops_per_device"] == flux.flops_per_sample(flux.FLAVORS["flux_dev"], 4096, 512) * local
    hd = FLUX_DEV_CONFIG["attention_head_dim"]
    h = FLUX_DEV_CONFIG["num_attention_heads"] * hd
    lin = lambda i, o: i * o + o
    double = 2 * (lin(h, 6 * h) + lin(h, 3 * h) + 2 * hd + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h))
    assert mem["gathered layer (bf16, x2 prefetch)"] == 2 * 2 * double
    # (flash attention traced: a sample's S x S probabilities, 24 heads x 4608^2 fp32 = 2 GB a block,
    # are not saved; the 57 blocks together keep less than that of 57 blocks)
    assert 0 < mem["saved activations (bf16)"] / local < 57 * 24 * 4608**2 * 4
    task = train.TASKS["flux"](train.parse_config([*flags, "--plan", "--chips", "8"]))
    per_sample = mem["saved activations (bf16)"] / local
    workload = dataclasses.replace(task.plan_workload(task.args), saved_bytes=lambda remat: per_sample)
    rows = dryrun.plan(workload, 8, 16, "tpu_v5p")
    assert sorted(r["mesh"] for r in rows if not r["remat"]) == ["dcn=2,ici=4", "dcn=4,ici=2", "dcn=8,ici=1", "ici=8"]
    assert len(rows) == 8 and next(r for r in rows if r["mesh"] == "ici=8" and not r["remat"]) == report
    for size in ("1000", "8"):  # (8: a FLUX VAE latent of 1 x 1 cannot be packed 2 x 2)
        assert train.main([*flags, "--image-size", size]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --image-size {size} is not a positive multiple of 16") and "\n" not in err, err



# ------------------------------------------------------------------------------------------------
# cli.py + task.py + train.py: the seams. Oracles: the dataclass's own fields, a plain PyTorch loop
# with torch.optim.AdamW and clip_grad_norm_ on a workload the trainer has never seen

def test_every_config_field_is_a_flag_with_its_type_and_help():
    import cli
    parser, fields = cli.build_parser(), dataclasses.fields(cli.TrainConfig)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert set(helps) == {f.name for f in fields} and all(helps.values())
    assert all(name in helps["fsdp_passes"] for name in __import__("fsdp_passes").PASSES)  # (prefetch was missing)
    cfg = cli.parse_config(["--steps", "7", "--lr", "0.5", "--set", "dim=8", "--set", "n_layers=1", "--scan"])
    assert (cfg.steps, cfg.lr, cfg.set, cfg.scan, cfg.init_from) == (7, 0.5, ["dim=8", "n_layers=1"], True, None)
    assert isinstance(cfg, cli.TrainConfig) and cli.parse_config([]) == cli.TrainConfig(set=[], flavor="llama3_debug")


class LinearRegression(task_lib.Task):
    """A workload the trainer was not written for, against the Task interface: the whole of it."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.args = (4, 1)  # nn.Linear(4, 1): a matrix (decayed) and a bias (not)

    def setup_data(self, dp_rank, dp_size):
        self.val_batches = [self.batch(10**6)]

    def build_model(self, args):
        return torch.nn.Linear(*args)

    def batch(self, step):  # a pure function of (seed, step)
        x = torch.randn(self.cfg.batch_size, 4, generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + step))
        return x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.25

    def loss(self, model, batch):
        mse = F.mse_loss(model(batch[0]), batch[1])
        return mse, mse

    units_per_step = property(lambda self: self.cfg.batch_size)
    flops_per_step = lambda self, args: 6 * 5 * self.cfg.batch_size


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_new_workload_trains_through_the_task_interface_like_a_plain_loop(mode, tmp_path):
    """The shared loop (schedule, clipping, AdamW with its decay mask, checkpoints, metrics) on a
    regression task of ~20 lines: losses equal a plain PyTorch loop with torch.optim.AdamW; eager and
    graph mode alike; it checkpoints, and validation runs through the task."""
    import train
    out = str(tmp_path / "run")
    cfg = train.parse_config(["--steps", "12", "--batch-size", "8", "--lr", "0.05", "--warmup", "3", "--clip", "0.5",
                              "--mode", mode, "--eval-interval", "6", "--ckpt-interval", "6", "--log-interval", "1",
                              "--out-dir", out])
    tr = train.Trainer(cfg, task=LinearRegression(cfg))
    assert tr.run() == 0
    task = tr.task
    torch.manual_seed(cfg.seed)  # the trainer seeds, then builds: the same initial weights
    ref = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW([{"params": [ref.weight], "weight_decay": cfg.weight_decay},
                             {"params": [ref.bias], "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    expected = {}
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * step / cfg.warmup if step <= cfg.warmup else cfg.lr * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / (cfg.steps - cfg.warmup))))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = task.batch(step)
        loss = F.mse_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip)
        opt.step()
        expected[step] = loss.item()
    got = losses(out)
    assert got.keys() == expected.keys()
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)]), torch.tensor([expected[k] for k in sorted(expected)]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tr.model.weight.detach(), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    assert sorted(_records(out, "val_loss")) == [0, 6, 12]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000006", "step_000012"]


# ------------------------------------------------------------------------------------------------
# hf.py + generate.py. Oracles: transformers' logits and greedy generate() on tiny random
# checkpoints (fixtures/make_hf_fixtures.py), full recomputation (KV cache), sort-based filters

HF_FIXTURES = os.path.join(HERE, "fixtures", "hf")


def _expected(name):
    from safetensors.torch import load_file
    return load_file(os.path.join(HF_FIXTURES, name, "expected.safetensors"))


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe"])
def test_hf_checkpoint_logits_and_greedy_text_equal_transformers(name, tmp_path):
    """Every module's arithmetic (norms, llama3 rope scaling, q/k norm, tied embeddings, MoE routing)
    against transformers' own forward and generate(); export -> import is bit for bit."""
    import generate
    import hf
    want = _expected(name)
    model = hf.load(os.path.join(HF_FIXTURES, name))
    with torch.no_grad():
        got = model(want["input_ids"])
    scale = want["logits"].abs().max().item()
    torch.testing.assert_close(got, want["logits"], rtol=1e-4, atol=1e-4 * scale)
    assert generate.generate(model, want["prompt"][0].tolist(), 16) == want["greedy"][0].tolist()
    out = hf.save(model, str(tmp_path / "export"), max_shard_bytes=200_000)  # small: a sharded index
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    again = hf.load(out)
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(p, q), n
    from safetensors.torch import load_file
    original = load_file(os.path.join(HF_FIXTURES, name, "model.safetensors"))
    exported = {k: v for f in os.listdir(out) if f.endswith(".safetensors") for k, v in load_file(os.path.join(out, f)).items()}
    assert exported.keys() == original.keys() - {"lm_head.weight"} if model.args.tie_embeddings else exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in exported)


def test_hf_bf16_checkpoints_load_converted_and_generation_stops_at_eos(tmp_path):
    import generate
    import hf
    from safetensors.torch import load_file, save_file
    src = os.path.join(HF_FIXTURES, "qwen3_moe")
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    save_file({k: v.bfloat16() for k, v in load_file(os.path.join(src, "model.safetensors")).items()},
              str(bf16 / "model.safetensors"))
    full, half = hf.load(src), hf.load(str(bf16))
    for (name, p), (_, q) in zip(full.named_parameters(), half.named_parameters()):
        assert q.dtype == torch.float32 and torch.equal(q, p.bfloat16().float()), name
    prompt = _expected("qwen3_moe")["prompt"][0].tolist()
    first = generate.generate(full, prompt, 5)
    assert generate.generate(full, prompt, 5, eos_id=first[1]) == first[:2]  # stops after the EOS token


@pytest.mark.parametrize("flavor", ["llama3_debug", "qwen3_debug", "qwen3_moe_debug"])
def test_kv_cache_decoding_equals_full_recomputation(flavor):
    import generate
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS[flavor], n_layers=2))
    tokens = torch.randint(0, 256, (1, 20))
    cache = generate.KVCache(model.args, 1, 20, "cpu")
    with torch.no_grad():
        full = model(tokens)[0]
        steps = [model(tokens[:, :8], kv_cache=cache)[0]]  # prefill 8, then one token at a time
        cache.pos += 8
        for t in range(8, 20):
            steps.append(model(tokens[:, t:t + 1], kv_cache=cache)[0])
            cache.pos += 1
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-5, atol=1e-5)
    ids = generate.generate(model, tokens[0, :5].tolist(), 10)  # greedy with the cache == argmax of full recompute
    seq = tokens[0, :5].tolist()
    for _ in range(10):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert ids == seq[5:]


def test_top_k_and_top_p_filters_match_a_sort_based_reference():
    import generate
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50) * 3
        k, p = int(torch.randint(1, 50, ())), float(torch.rand(()))
        kept = set(torch.argsort(logits, descending=True)[:k].tolist())
        assert set(torch.isfinite(generate.top_k_filter(logits, k)).nonzero().flatten().tolist()) == kept
        order = torch.argsort(logits, descending=True).tolist()
        probs, total, nucleus = torch.softmax(logits, -1), 0.0, set()
        for i in order:  # the smallest prefix of the sorted tokens whose mass reaches p
            nucleus.add(i)
            total += float(probs[i])
            if total >= p:
                break
        assert set(torch.isfinite(generate.top_p_filter(logits, p)).nonzero().flatten().tolist()) == nucleus


def test_sampling_same_seed_same_text_and_the_cli(tmp_path, capsys):
    import generate
    import hf
    model = hf.load(os.path.join(HF_FIXTURES, "qwen3"))
    draw = lambda seed: generate.generate(model, [5, 6, 7], 24, temperature=1.0, top_k=40, top_p=0.9, seed=seed)
    assert draw(1) == draw(1) and draw(1) != draw(2)
    assert generate.main(["--hf", os.path.join(HF_FIXTURES, "qwen3"), "def main(", "--max-new-tokens", "8",
                          "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("def main(")


def test_bad_hf_and_generation_inputs_are_one_line(tmp_path, capsys):
    import shutil
    import generate
    import hf
    broken = {}
    for label, edit in [("model_type", {"model_type": "gpt2"}), ("norm_topk_prob", {"norm_topk_prob": False}),
                        ("attention_bias", {"attention_bias": True}), ("shape", {"moe_intermediate_size": 30})]:
        d = tmp_path / label
        shutil.copytree(os.path.join(HF_FIXTURES, "qwen3_moe"), d)
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **edit}))
        broken[label] = str(d)
    for label, message in [("model_type", "model_type 'gpt2' is not supported"),
                           ("norm_topk_prob", "norm_topk_prob=false is not implemented"),
                           ("attention_bias", "attention_bias=True is not implemented"),
                           ("shape", "gate_proj.weight has shape [32, 64], config.json implies [30, 64]")]:
        with pytest.raises(hf.HFError, match=re.escape(message)):
            hf.load(broken[label])
    with pytest.raises(hf.HFError, match="config.json: missing or unreadable"):
        hf.load(str(tmp_path))
    mixed = tmp_path / "mixed"  # a 300-token tokenizer on a 256-token model
    shutil.copytree(os.path.join(HF_FIXTURES, "llama"), mixed)
    shutil.copy(os.path.join(HF_FIXTURES, "qwen3", "tokenizer.json"), mixed / "tokenizer.json")
    for argv, message in [(["--hf", str(mixed), "x"], "the tokenizer has 300 tokens, the model only 256"),
                          (["--hf", os.path.join(HF_FIXTURES, "qwen3"), ""], "the prompt is empty"),
                          (["--run", str(tmp_path), "x"], "holds no checkpoint to read")]:
        assert generate.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


def test_generate_on_a_tokenizer_run_picks_its_tokenizer_and_checkpoint_and_refuses_in_one_line(
        corpus, tmp_path, monkeypatch, capsys):
    """A run trained with --tokenizer records it, and generate.py --run writes that tokenizer's text
    (oracle: the tokenizers library's encode / decode around a greedy argmax over the full sequence,
    on weights DCP loads straight from the checkpoint). A broken newest checkpoint names the good
    one to pass instead, which generate and hf.py export both accept; a model_args key from another
    version, a NaN or infinite temperature and a vanished tokenizer are one line; an error after
    the prompt was echoed starts on its own line; a character split between tokens prints whole."""
    import shutil
    import generate
    import hf
    import train
    from tokenizers import Tokenizer
    monkeypatch.setenv("MINITITAN_CACHE", str(tmp_path / "cache"))
    tok_dir, run = tmp_path / "tok", tmp_path / "run"
    tok_dir.mkdir()
    shutil.copy(os.path.join(HF_FIXTURES, "qwen3", "tokenizer.json"), tok_dir)
    args = [*TINY, "--set", "vocab_size=320"]
    assert _main([*args, "--data", corpus, "--tokenizer", str(tok_dir), "--steps", "2", "--ckpt-interval", "1",
                  "--eval-batches", "0", "--out-dir", str(run)]) == 0
    tok, prompt = Tokenizer.from_file(str(tok_dir / "tokenizer.json")), "def main("
    split = [tok.token_to_id("Ã"), tok.token_to_id("©")]  # "é" as its two byte tokens: printed whole
    show = generate.HFTokenizer(str(tok_dir)).stream()
    assert "".join(map(show, split)) + show(None) == tok.decode(split) == "é"

    def greedy_text(step_name):  # 6 tokens by argmax over the whole sequence, no KV cache
        model = Transformer(train.model_args(train.parse_config(args)))
        model.load_state_dict(_full_params(str(run / "checkpoints"), args, step_name))
        seq = tok.encode(prompt, add_special_tokens=False).ids
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        return prompt + tok.decode(seq[-6:]) + "\n"

    def one_line(argv, message, tool=generate.main):
        assert tool(argv) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
        return captured.out

    sample = ["--max-new-tokens", "6", "--temperature", "0"]
    capsys.readouterr()
    assert generate.main(["--run", str(run), prompt, *sample]) == 0
    assert capsys.readouterr().out == greedy_text("step_000002")
    future = tmp_path / "future"  # the same run, its meta.json as a later version might write it
    shutil.copytree(run, future)
    meta_file = future / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["model_args"]["sliding_window"] = 128
    meta_file.write_text(json.dumps(meta))
    one_line(["--run", str(future), "x"], "model_args sliding_window unknown to this version")
    one_line(["export", str(future), str(tmp_path / "exported")], "model_args sliding_window unknown", hf.main)
    for bad in ("nan", "inf"):
        one_line(["--run", str(run), "x", "--temperature", bad], "a finite --temperature >= 0")
    out = one_line(["--run", str(run), "hi", "--max-new-tokens", "100000"], "exceeds the model's max_seq_len")
    assert out == "hi\n"  # (the echoed prompt, then the error on a line of its own)
    newest, good = run / "checkpoints" / "step_000002", run / "checkpoints" / "step_000001"
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    hint = f"the newest good one is {good}: pass it in place of {run}"
    for argv, tool in ((["--run", str(run), "x"], generate.main), (["export", str(run), str(tmp_path / "e")], hf.main)):
        one_line(argv, hint, tool)
    assert generate.main(["--run", str(good), prompt, *sample]) == 0
    assert capsys.readouterr().out == greedy_text("step_000001")
    shutil.rmtree(tok_dir)
    one_line(["--run", str(good), "x"], f"this run trained on the tokenizer in {tok_dir}, which is gone")


# config.json key -> (ModelArgs field, the value model.py must get), written out from HF's documentation
HF_FIELDS = {"rope_theta": ("rope_theta", float), "rms_norm_eps": ("norm_eps", float), "head_dim": ("head_dim", int),
             "max_position_embeddings": ("max_seq_len", int), "tie_word_embeddings": ("tie_embeddings", bool),
             "num_key_value_heads": ("n_kv_heads", int),
             "rope_scaling": ("rope_scaling", lambda r: r and (r["factor"], r["low_freq_factor"], r["high_freq_factor"],
                                                         r["original_max_position_embeddings"])),
             "num_experts": ("n_experts", int), "num_experts_per_tok": ("top_k", int),
             "moe_intermediate_size": ("moe_ffn_dim", int), "router_aux_loss_coef": ("aux_loss_coef", float)}


def test_every_config_field_reaches_the_model():
    """Each config.json field hf.py reads is set in some fixture away from the value a loader that
    ignored it would use (ModelArgs' default, HF's num_key_value_heads = heads), and arrives in
    ModelArgs. The logits test above then shows each one is also used as transformers uses it."""
    import hf
    shown = set()
    for name in ("llama", "qwen3", "qwen3_moe"):
        cfg = json.load(open(os.path.join(HF_FIXTURES, name, "config.json")))
        args = hf.args_from_config(hf.read_config(os.path.join(HF_FIXTURES, name)))
        for key, (field, value) in HF_FIELDS.items():
            if key in cfg:
                assert getattr(args, field) == value(cfg[key]), (name, key)
                fallback = cfg["num_attention_heads"] if key == "num_key_value_heads" else getattr(ModelArgs(), field)
                shown |= {key} if value(cfg[key]) != fallback else set()
        shown |= {f"rope_scaling.{k}" for k, v in (cfg.get("rope_scaling") or {}).items()
                  if k != "rope_type" and v != dict(zip(["factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings"], (8.0, 1.0, 4.0, 8192)))[k]}
    assert shown == {*HF_FIELDS, "rope_scaling.factor", "rope_scaling.low_freq_factor",
                     "rope_scaling.high_freq_factor", "rope_scaling.original_max_position_embeddings"}, shown


def _hf_copy(tmp_path, label, name, tensors=None, drop=()):
    """A copy of fixture `name` with tensors added / replaced (`tensors(weights)`) or dropped."""
    from safetensors.torch import load_file, save_file
    import shutil
    d = tmp_path / label
    d.mkdir()
    shutil.copy(os.path.join(HF_FIXTURES, name, "config.json"), d / "config.json")
    weights = load_file(os.path.join(HF_FIXTURES, name, "model.safetensors"))
    save_file({**{k: v for k, v in weights.items() if k not in drop}, **(tensors(weights) if tensors else {})},
              str(d / "model.safetensors"))
    if os.path.exists(os.path.join(HF_FIXTURES, name, "tokenizer.json")):
        os.symlink(os.path.join(HF_FIXTURES, name, "tokenizer.json"), d / "tokenizer.json")
    return str(d)


def test_hf_config_of_the_wrong_type_is_one_line_in_train_and_generate(corpus, tmp_path, capsys):
    """JSON has one number type and `true` is not a layer count: each wrong type is refused naming the
    field (never a 1-layer model from `true`, never a traceback), in train.py --init-from and generate --hf."""
    import generate
    import train
    cases = [({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got true"),
             ({"hidden_size": "64"}, 'hidden_size must be an integer, got "64"'),
             ({"num_hidden_layers": 4.5}, "num_hidden_layers must be an integer, got 4.5"),
             ({"hidden_size": None}, "hidden_size must be an integer, got null"),
             ({"rope_scaling": "llama3"}, 'rope_scaling must be an object or null, got "llama3"'),
             ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps must be a number, got "1e-5"'),
             ({"tie_word_embeddings": "false"}, 'tie_word_embeddings must be true or false, got "false"'),
             ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}}, 'rope_scaling: factor must be a number'),
             ({"head_dim": 0}, "head_dim must be positive"),
             (lambda cfg: [cfg], "config.json must be a JSON object, got list")]
    for i, (edit, message) in enumerate(cases):
        d = tmp_path / f"c{i}"
        d.mkdir()
        cfg = json.load(open(os.path.join(HF_FIXTURES, "qwen3", "config.json")))
        (d / "config.json").write_text(json.dumps(edit(cfg) if callable(edit) else {**cfg, **edit}))
        for f in ("model.safetensors", "tokenizer.json"):
            os.symlink(os.path.join(HF_FIXTURES, "qwen3", f), d / f)
        out_dir = str(tmp_path / f"run{i}")
        for main, argv in [(train.main, ["--init-from", str(d), "--data", corpus, "--seq-len", "32", "--out-dir", out_dir]),
                           (generate.main, ["--hf", str(d), "x"])]:
            assert main(argv) == 2, (edit, main)
            err = capsys.readouterr().err.strip()
            assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, (edit, err)
        assert not os.path.exists(out_dir)


def test_hf_loader_uses_every_tensor_and_finds_every_one_it_needs(tmp_path, capsys):
    """A weight the config does not describe would be dropped silently, a missing one left at its
    initialization, an int8 one cast to a meaningless float: each refused naming the tensors. Floats
    of any width convert; a tied model may carry its head if it is the embedding; a directory with
    both a model.safetensors and an index is ambiguous. Oracle for the TP / FSDP reads: any block of
    any parameter, read alone, is that block of the whole parameter."""
    import generate
    import hf
    layer = lambda w, i, j: {k.replace(f"layers.{i}.", f"layers.{j}."): v.clone() for k, v in w.items() if f"layers.{i}." in k}
    bad = [("four_layers", "llama", lambda w: {**layer(w, 0, 2), **layer(w, 1, 3)}, (),
            "the checkpoint holds 18 tensors config.json does not describe (they would be dropped): "
            "model.layers.2.*, model.layers.3.*"),
           ("stray", "llama", lambda w: {"model.layers.7.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"].clone()}, (),
            "does not describe (they would be dropped): model.layers.7.mlp.up_proj.weight"),
           ("missing", "qwen3_moe", None, ("model.layers.1.mlp.experts.3.down_proj.weight",),
            "the checkpoint lacks 1 tensors config.json implies: model.layers.1.mlp.experts.3.down_proj.weight"),
           ("int8", "llama", lambda w: {"model.norm.weight": w["model.norm.weight"].to(torch.int8)}, (),
            "model.norm.weight is I8: only floating-point weights load"),
           ("untied_head", "qwen3", lambda w: {"lm_head.weight": w["model.embed_tokens.weight"] + 1}, (),
            "does not describe (they would be dropped): lm_head.weight")]
    for label, name, tensors, drop, message in bad:
        with pytest.raises(hf.HFError, match=re.escape(message)):
            hf.load(_hf_copy(tmp_path, label, name, tensors, drop))
    assert generate.main(["--hf", str(tmp_path / "untied_head"), "x"]) == 2  # the CLI: one line
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("dropped): lm_head.weight"), err
    want = hf.load(os.path.join(HF_FIXTURES, "qwen3"))
    half = hf.load(_hf_copy(tmp_path, "f16", "qwen3", tensors=lambda w: {k: v.half() for k, v in w.items()}))
    tied = hf.load(_hf_copy(tmp_path, "tied", "qwen3", tensors=lambda w: {"lm_head.weight": w["model.embed_tokens.weight"].clone()}))
    for (n, p), (_, q), (_, r) in zip(want.named_parameters(), half.named_parameters(), tied.named_parameters()):
        assert q.dtype == torch.float32 and torch.equal(q, p.half().float()) and torch.equal(r, p), n
    both = tmp_path / "both"  # a sharded export, then an unsharded one beside it (made by hand: hf.save refuses)
    hf.save(want, str(both), max_shard_bytes=200_000)
    os.symlink(os.path.join(HF_FIXTURES, "qwen3", "model.safetensors"), both / "model.safetensors")
    with pytest.raises(hf.HFError, match="holds both model.safetensors and model.safetensors.index.json"):
        hf.load(str(both))
    os.remove(both / "model.safetensors")
    index = json.loads((both / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]  # its shard still holds it: the index leaves it out
    (both / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf.HFError, match="and model.safetensors.index.json disagree on model.norm.weight"):
        hf.load(str(both))
    for name in ("llama", "qwen3_moe"):  # each parameter's blocks: 2 pieces per dim, as TP x FSDP cut them
        path = os.path.join(HF_FIXTURES, name)
        full, reader = hf.load(path), hf.Reader(path)
        for pname, p in full.named_parameters():
            for corner in range(2 ** p.dim()):
                box = [(0, n // 2) if corner >> d & 1 else (n // 2, n) for d, n in enumerate(p.shape)]
                piece = hf.read_param(reader, pname, tuple(p.shape), box)
                assert torch.equal(piece, p[tuple(slice(a, b) for a, b in box)]), (pname, box)


def test_export_never_clobbers_and_a_failed_write_keeps_the_old_files(corpus, tmp_path, capsys):
    """hf.py export writes a whole directory or nothing: a non-empty target is refused (a user's files
    there stay), --overwrite replaces it whole (an old sharded export's index does not survive to be
    loaded instead), and a write that fails (a 256 KiB file-size limit) leaves the previous export
    bit for bit, no temporary directory behind, one line, exit 5. Oracle: the run's own weights."""
    import checkpoint
    import hf
    run = str(tmp_path / "run")
    assert _main([*TINY, "--data", corpus, "--steps", "1", "--eval-batches", "0", "--sample-tokens", "0",
                  "--out-dir", run]) == 0
    model = checkpoint.load_run(run)
    hf.save(Transformer(model.args), str(tmp_path / "out"), max_shard_bytes=100_000)  # an older export: other
    # weights, sharded with an index that a loader would prefer to a new model.safetensors beside it
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text("mine")
    (tmp_path / "file").write_text("mine")
    capsys.readouterr()
    for target, message in [(user, "is not empty (config.json); an export writes a whole directory: pass --overwrite"),
                            (tmp_path / "out", "is not empty"), (tmp_path / "file", "exists and is not a directory"),
                            (tmp_path / "file" / "sub", "cannot write")]:
        assert hf.main(["export", run, str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert (user / "config.json").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert hf.main(["export", run, str(tmp_path / "out"), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    for (n, p), (_, q) in zip(model.named_parameters(), hf.load(str(tmp_path / "out")).named_parameters()):
        assert torch.equal(p, q), n
    before = {f: checkpoint.sha256_of(tmp_path / "out" / f) for f in os.listdir(tmp_path / "out")}
    proc = subprocess.run(["bash", "-c", 'ulimit -f 256 && exec "$@"', "-", sys.executable, "hf.py", "export", run,
                           str(tmp_path / "out"), "--overwrite"], cwd=HERE, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip()
    assert proc.returncode == 5 and len(err.splitlines()) == 1 and err.startswith("error: a write failed"), err
    assert {f: checkpoint.sha256_of(tmp_path / "out" / f) for f in os.listdir(tmp_path / "out")} == before
    assert sorted(os.listdir(tmp_path)) == ["file", "out", "run", "user"]  # no temporary directory left


def test_fine_tuning_starts_from_the_hf_weights_on_one_process_and_under_a_mesh(corpus, tmp_path):
    """--init-from: the step-0 validation loss is the HF model's own loss on that batch (one process),
    and 2 ranks, each reading only its own piece (FSDP rows; under tp=2 column blocks too), train
    exactly like one process. The run also draws its loss plot and ends with a sample."""
    import hf
    llama = os.path.join(HF_FIXTURES, "llama")
    common = ["--init-from", llama, "--data", corpus, "--steps", "4", "--batch-size", "4", "--seq-len", "32",
              "--eval-batches", "1", "--log-interval", "1", "--ckpt-interval", "0"]
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    rc, out, err = run_train([*common, "--out-dir", single])
    assert rc == 0, err
    _, val = data.load_corpus(corpus)
    (x, y), = data.eval_batches(val, 4, 32, 0, 1)
    with torch.no_grad():
        want = hf.load(llama)(x, y)[0].item()
    assert abs(_records(single, "val_loss")[0] - want) < 1e-5
    assert "sample (64 bytes" in out
    assert open(os.path.join(single, "loss.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for mesh, out_dir in [("ici=2", multi), ("ici=1,tp=2", str(tmp_path / "tp"))]:
        rc, _, err = torchrun(2, [*common, "--out-dir", out_dir, "--mesh", mesh])
        assert rc == 0, err[-3000:]
        for key in ("loss", "val_loss", "grad_norm"):
            _near(_records(single, key), _records(out_dir, key), atol=1e-5)


def test_training_on_a_hf_tokenizer_caches_its_ids_and_writes_tensorboard(corpus, tmp_path, monkeypatch, capsys):
    """--tokenizer: the corpus becomes the tokenizer's ids (decoding them gives the text back), made
    once and cached by content; the model's vocab must hold them; --tensorboard writes the scalars."""
    from tokenizers import Tokenizer
    monkeypatch.setenv("MINITITAN_CACHE", str(tmp_path / "cache"))  # not the real ~/.cache/minititan
    qwen = os.path.join(HF_FIXTURES, "qwen3")
    common = [*TINY, "--data", corpus, "--tokenizer", qwen, "--set", "vocab_size=320", "--steps", "3"]
    assert _main([*common, "--out-dir", str(tmp_path / "a"), "--tensorboard"]) == 0
    cached = sorted((tmp_path / "cache" / "tokens").iterdir())
    assert len(cached) == 4  # train and val ids, each with its checksum
    train_ids = data.np.load(next(p for p in cached if p.name.endswith("train.npy")))
    text, _ = data.load_corpus(corpus)
    assert Tokenizer.from_file(os.path.join(qwen, "tokenizer.json")).decode(train_ids.tolist()) == text.tobytes().decode()
    assert len(train_ids) < 0.8 * len(text)  # real merges: fewer tokens than bytes
    mtimes = [p.stat().st_mtime_ns for p in cached]
    assert _main([*common, "--out-dir", str(tmp_path / "b")]) == 0  # second run: from the cache
    assert [p.stat().st_mtime_ns for p in cached] == mtimes and _records(str(tmp_path / "a"), "loss") == _records(str(tmp_path / "b"), "loss")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "a" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([v for _, v in sorted(_records(str(tmp_path / "a"), "loss").items())])
    capsys.readouterr()
    assert _main([*common[:-4], "--set", "vocab_size=256", "--steps", "3", "--out-dir", str(tmp_path / "c")]) == 2
    assert "--tokenizer has 300 tokens, the model's vocab_size is 256" in capsys.readouterr().err


def child_xla_generate():
    """(child process) Greedy generation on XLA:CPU: ids, and compile counts after each token."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import generate
    xla = torch_xla.device()
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS["qwen3_debug"], n_layers=2)).to(xla)
    counts = []
    ids = generate.generate(model, [1, 2, 3, 4, 5], 12, on_token=lambda t: counts.append(met.metric_data("CompileTime")[0]))
    print(json.dumps({"ids": ids, "compiles": counts}))


def test_decoding_on_xla_compiles_the_step_once_and_equals_cpu():
    proc = subprocess.run([sys.executable, "test_all.py", "child_xla_generate"], cwd=HERE, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # token 1 comes from the prefill program, token 2 from the first decode step: no compile after it
    assert res["compiles"][1] == res["compiles"][-1], res["compiles"]
    import generate
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(FLAVORS["qwen3_debug"], n_layers=2))
    assert generate.generate(model, [1, 2, 3, 4, 5], 12) == res["ids"]


# ------------------------------------------------------------------------------------------------
# flux.py + flux_sample.py + flux_hf.py + digits.py + flux_task.py. Oracles: diffusers' FluxTransformer2DModel outputs on
# tiny random checkpoints (fixtures/make_flux_fixtures.py), the published FLUX.1 config counted tensor by
# tensor, torch's FlopCounterMode, the flow formulas and the Euler loop written out here, sklearn's raw digits

FLUX_FIXTURES = os.path.join(HERE, "fixtures", "flux")
# FLUX.1-dev's published transformer/config.json (schnell: the same with guidance_embeds false)
FLUX_DEV_CONFIG = {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0.dev0", "attention_head_dim": 128,
                   "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24,
                   "num_layers": 19, "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768,
                   "axes_dims_rope": [16, 56, 56]}


def _flux_expected(name):
    from safetensors.torch import load_file
    return load_file(os.path.join(FLUX_FIXTURES, name, "expected.safetensors"))


def _flux_call(model, e):
    B = e["hidden_states"].shape[0]
    return model(e["hidden_states"], e["img_ids"].expand(B, -1, -1), e["encoder_hidden_states"],
                 e["txt_ids"].expand(B, -1, -1), e["timestep"], e["pooled_projections"], e.get("guidance"))


@pytest.mark.parametrize("name", ["guidance", "plain"])
def test_flux_output_equals_diffusers_and_export_import_is_bit_for_bit(name, tmp_path):
    """Every module (embedders, 3-axis RoPE, joint attention, q/k RMSNorm, modulation order, fused
    single-block linear1, the final adaLN's swapped halves) against diffusers' own forward."""
    import flux_hf
    from safetensors.torch import load_file
    want = _flux_expected(name)
    model = flux_hf.load(os.path.join(FLUX_FIXTURES, name))
    with torch.no_grad():
        got = _flux_call(model, want)
    scale = want["sample"].abs().max().item()
    torch.testing.assert_close(got, want["sample"], rtol=1e-4, atol=1e-4 * scale)
    out = flux_hf.save(model, str(tmp_path / "export"))
    original = load_file(os.path.join(FLUX_FIXTURES, name, "diffusion_pytorch_model.safetensors"))
    exported = load_file(os.path.join(out, "diffusion_pytorch_model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in exported)
    again = flux_hf.load(out)
    assert again.args == model.args
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n == m and torch.equal(p, q), n


def test_flux_published_sizes_parameter_count_and_flops():
    """flux-dev / flux-schnell on the meta device: the parameter count equals the published config's
    tensors counted one by one (11,901,408,320 for dev: "12B"); torchtitan's FLOP formula is within 1%
    of torch's FlopCounterMode over a real forward + backward at 1024x1024 (4096 image + 512 text tokens)."""
    import flux
    import flux_hf
    from torch.utils.flop_counter import FlopCounterMode
    c = FLUX_DEV_CONFIG
    h = c["num_attention_heads"] * c["attention_head_dim"]
    lin = lambda i, o: i * o + o  # a Linear with bias
    embed = lin(256, h) + lin(h, h)  # timestep / guidance MLP
    double = 2 * (lin(h, 6 * h) + 3 * lin(h, h) + 2 * c["attention_head_dim"] + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h))
    single = lin(h, 3 * h) + 3 * lin(h, h) + lin(h, 4 * h) + 2 * c["attention_head_dim"] + lin(5 * h, h)
    schnell = (lin(c["in_channels"], h) + lin(c["joint_attention_dim"], h) + embed + lin(c["pooled_projection_dim"], h)
               + lin(h, h) + c["num_layers"] * double + c["num_single_layers"] * single + lin(h, 2 * h) + lin(h, c["in_channels"]))
    assert flux_hf.args_from_config(c) == flux.FLAVORS["flux_dev"]
    assert flux_hf.args_from_config({**c, "guidance_embeds": False}) == flux.FLAVORS["flux_schnell"]
    assert flux.param_count(flux.FLAVORS["flux_schnell"]) == schnell
    assert flux.param_count(flux.FLAVORS["flux_dev"]) == schnell + embed == 11_901_408_320
    a = flux.FLAVORS["flux_dev"]
    with torch.device("meta"):
        model = flux.Flux(a)
        S, T = 4096, 512
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(1, S, 64), torch.zeros(1, S, 3), torch.randn(1, T, 4096), torch.zeros(1, T, 3),
                  torch.rand(1), torch.randn(1, 768), torch.rand(1)).sum().backward()
    measured = counter.get_total_flops()
    assert abs(flux.flops_per_sample(a, S, T) / measured - 1) < 0.01, (flux.flops_per_sample(a, S, T), measured)


def test_flux_rectified_flow_targets_loss_timesteps_schedule_and_packing():
    import flux
    import flux_sample
    g = torch.Generator().manual_seed(0)
    x0, eps, t = torch.randn(3, 1, 8, 8, generator=g), torch.randn(3, 1, 8, 8, generator=g), torch.tensor([0.0, 0.25, 1.0])
    xt, target = flux_sample.flow_pair(x0, eps, t)
    for b in range(3):
        assert torch.allclose(xt[b], (1 - t[b].item()) * x0[b] + t[b].item() * eps[b]) and torch.equal(target[b], eps[b] - x0[b])
    v = torch.randn(3, 1, 8, 8, generator=g)
    assert torch.allclose(flux_sample.flow_loss(v, x0, eps), sum(((v - (eps - x0)) ** 2).flatten()) / v.numel())
    u = flux_sample.sample_timesteps(4000, torch.Generator().manual_seed(1))
    assert torch.equal(u, torch.rand(4000, generator=torch.Generator().manual_seed(1)))
    ln = flux_sample.sample_timesteps(4000, torch.Generator().manual_seed(1), "logit_normal", 0.5, 2.0)
    assert torch.allclose(ln, 1 / (1 + torch.exp(-(0.5 + 2.0 * torch.randn(4000, generator=torch.Generator().manual_seed(1))))))
    assert flux_sample.validation_timesteps(8) == [0.0625, 0.1875, 0.3125, 0.4375, 0.5625, 0.6875, 0.8125, 0.9375]
    for tokens in (16, 256, 4096):  # BFL's get_schedule: mu on the line (256, 0.5) - (4096, 1.15)
        mu = 0.5 + (tokens - 256) * 0.65 / 3840
        want = [1.0] + [math.exp(mu) / (math.exp(mu) + 1 / (1 - i / 10) - 1) for i in range(1, 10)] + [0.0]
        assert flux_sample.schedule(10, tokens) == pytest.approx(want, rel=1e-12)
    assert flux_sample.schedule(4, 256, shift=False) == [1.0, 0.75, 0.5, 0.25, 0.0]
    img = torch.randn(2, 3, 4, 6, generator=g)  # packing: token (i, j) holds channel c's 2x2 patch at c*4 + di*2 + dj
    packed, ids = flux.patchify(img), flux.image_ids(2, 4, 6)
    for i in range(2):
        for j in range(3):
            assert ids[1, i * 3 + j].tolist() == [0, i, j]
            for c in range(3):
                for di in range(2):
                    for dj in range(2):
                        assert packed[1, i * 3 + j, c * 4 + di * 2 + dj] == img[1, c, 2 * i + di, 2 * j + dj]
    assert torch.equal(flux.unpatchify(packed, 4, 6), img)


def test_flux_euler_sampler_with_guidance_equals_a_direct_loop():
    """sample() (shifted schedule, classifier-free guidance u + s (c - u), seeded noise)
    against the Euler loop written out; a fresh model is zero-initialised at its modulation and
    final layer (predicts 0), so the weights are randomised first."""
    import flux
    import flux_sample
    torch.manual_seed(0)
    model = flux.Flux(flux.FLAVORS["flux_debug"])
    assert all((p == 0).all() for n, p in model.named_parameters() if "mod" in n or n.startswith("final_layer"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    txt, y, utxt, uy = torch.randn(2, 4, 32), torch.randn(2, 32), torch.randn(1, 4, 32), torch.randn(1, 32)
    got = flux_sample.sample(model, txt, y, (1, 8, 8), steps=5, seed=7, cfg_scale=3.0, uncond=(utxt, uy))
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    x = x.reshape(2, 1, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 16, 4)
    rr, cc = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    ids = torch.stack([torch.zeros_like(rr), rr, cc], -1).reshape(1, 16, 3).float().expand(2, -1, -1)
    mu = 0.5 + (16 - 256) * 0.65 / 3840
    ts = [1.0, *[math.exp(mu) / (math.exp(mu) + 1 / (1 - i / 5) - 1) for i in range(1, 5)], 0.0]
    with torch.no_grad():
        for i in range(5):
            tt = torch.full((2,), ts[i])
            c = model(x, ids, txt, torch.zeros(2, 4, 3), tt, y)
            u = model(x, ids, utxt.expand(2, -1, -1), torch.zeros(2, 4, 3), tt, uy.expand(2, -1))
            x = x + (ts[i + 1] - ts[i]) * (u + 3.0 * (c - u))
    want = x.reshape(2, 4, 4, 1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(2, 1, 8, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1


def test_flux_refuses_unimplemented_diffusers_configs_and_bad_calls_in_one_line(tmp_path):
    import flux
    import flux_hf
    import flux_sample
    from safetensors.torch import load_file, save_file
    src = os.path.join(FLUX_FIXTURES, "plain")
    cfg = json.load(open(os.path.join(src, "config.json")))
    weights = load_file(os.path.join(src, "diffusion_pytorch_model.safetensors"))
    extra = {**weights, "pos_embed.extra": torch.zeros(2)}
    short = {k: v for k, v in weights.items() if not k.endswith("attn.to_k.bias")}
    wrong = {**weights, "x_embedder.weight": torch.zeros(32, 9)}
    cases = [({**cfg, "patch_size": 2}, weights, "patch_size=2"), ({**cfg, "use_rope": True}, weights, "use_rope"),
             ({**cfg, "_class_name": "SD3Transformer2DModel"}, weights, "SD3Transformer2DModel"),
             ({**cfg, "axes_dims_rope": [4, 4, 6]}, weights, "axes_dim"), (cfg, extra, "pos_embed.extra"),
             (cfg, short, "to_k.bias"), (cfg, wrong, "x_embedder.weight"),
             ({**cfg, "guidance_embeds": True}, weights, "guidance_embedder")]
    for i, (c, w, needle) in enumerate(cases):
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        save_file(w, str(d / "diffusion_pytorch_model.safetensors"))
        with pytest.raises(flux_hf.FluxHFError) as e:
            flux_hf.load(str(d))
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    for bad in (tmp_path / "missing", tmp_path / "case0" / "config.json"):
        with pytest.raises(flux_hf.FluxHFError):
            flux_hf.load(str(bad))
    model = flux_hf.load(src)
    with pytest.raises(flux_hf.FluxHFError, match="not an empty directory"):
        flux_hf.save(model, src)
    with pytest.raises(flux_hf.FluxHFError, match="qkv_bias"):
        flux_hf.save(flux.Flux(dataclasses.replace(flux.FLAVORS["flux_debug"], qkv_bias=False)), str(tmp_path / "nobias"))
    assert not (tmp_path / "nobias").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".flux_hf")]
    e = _flux_expected("plain")
    with pytest.raises(ValueError, match="guidance"):
        _flux_call(model, {**e, "guidance": torch.ones(2)})
    with pytest.raises(ValueError, match="guidance"):
        _flux_call(flux_hf.load(os.path.join(FLUX_FIXTURES, "guidance")), e)
    with pytest.raises(ValueError, match="unconditional"):
        flux_sample.sample(model, torch.zeros(1, 5, 24), torch.zeros(1, 12), (1, 8, 6), cfg_scale=2.0)
    with pytest.raises(ValueError, match="not divisible"):
        flux.patchify(torch.zeros(1, 1, 7, 8))
    with pytest.raises(ValueError, match="axes_dim"):
        flux.Flux(dataclasses.replace(flux.FLAVORS["flux_debug"], axes_dim=(8, 8, 8)))


def test_digits_split_is_seeded_disjoint_stratified_and_the_judge_is_accurate():
    """The real digits (sklearn's bundled copy, counted here as a multiset of (pixels, label)) split into
    train / held-out: disjoint, complete, every class in proportion, scaled 0..16 -> [-1, 1]; the
    independent SVC judge scores >= 97% on held-out digits it never saw."""
    import collections
    import digits
    from sklearn.datasets import load_digits
    raw = load_digits()
    (tx, ty), (hx, hy) = digits.load("train"), digits.load("held_out")
    assert tx.shape == (1437, 1, 8, 8) and hx.shape == (360, 1, 8, 8) and tx.dtype == torch.float32
    assert tx.min() == -1 and tx.max() == 1 and torch.equal((tx + 1) * 8, ((tx + 1) * 8).round())
    key = lambda x, y: (tuple(((x.flatten() + 1) * 8).round().int().tolist()), int(y))
    parts = [collections.Counter(key(x, y) for x, y in zip(px, py)) for px, py in ((tx, ty), (hx, hy))]
    want = collections.Counter((tuple(int(v) for v in img.flatten()), int(t)) for img, t in zip(raw.images, raw.target))
    assert parts[0] + parts[1] == want and not set(parts[0]) & set(parts[1]) - {k for k, n in want.items() if n > 1}
    per_class = torch.bincount(hy, minlength=10).float() / torch.bincount(torch.tensor(raw.target), minlength=10)
    assert ((per_class - 0.2).abs() < 0.01).all(), per_class
    assert torch.equal(digits.load("held_out")[0], hx) and not torch.equal(digits.load("held_out", seed=1)[0], hx)
    judge, accuracy = digits.classifier()
    pred = judge.predict(((hx + 1) * 8).reshape(-1, 64).numpy())
    assert accuracy == sum(int(p) == int(y) for p, y in zip(pred, hy)) / len(hy) >= 0.97, accuracy
    assert torch.equal(digits.classify(judge, hx * 1.5), digits.classify(judge, hx.clamp(-1, 1)))  # overshoot clipped



def test_flux_jax_forward_and_adamw_steps_equal_torch():
    """flux_jax.py (pure JAX from BFL's layers, the competitor bench.py races) against flux.py and
    torch.optim.AdamW + clip_grad_norm_, on one set of random weights (every modulation and gate
    non-zero, so every path carries signal): the forward (with flux-dev's guidance embedder) to 1e-5;
    the digits workload's rectified-flow loss (t < 0.01, see below), pre-clip gradient norm and the weights after 2
    clipped AdamW steps (decay on matrices that are not norms or biases) to 1e-5."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import flux
    import flux_jax
    import flux_task

    def randomized(module):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.1 * torch.randn_like(p))
        return module

    to_jax = lambda module: {k: jnp.array(v.detach().numpy()) for k, v in module.state_dict().items()}
    torch.manual_seed(0)
    a = dataclasses.replace(flux.FLAVORS["flux_debug"], guidance_embed=True)
    model = randomized(flux.Flux(a))
    B = 3
    # Times are embedded as sin / cos of 1000 t x freq: a 1-ulp difference between JAX's and torch's
    # fp32 exp in the frequency table (14 of 128 entries) moves the angle by ~1000 t ulps. So 1e-5 is
    # asserted for t, guidance < 0.01, and the whole range t < 1, guidance < 4 to 5e-4 (measured: 9e-5).
    forward = jax.jit(lambda p, *x: flux_jax.forward(p, dataclasses.asdict(a), *x))  # one compile, not one per op
    for scale, tol in ((0.01, 1e-5), (1.0, 5e-4)):
        inputs = (torch.randn(B, 16, 4), flux.image_ids(B, 8, 8), torch.randn(B, 4, 32), flux.text_ids(B, 4),
                  scale * torch.rand(B), torch.randn(B, 32), scale * 4 * torch.rand(B))
        with torch.no_grad():
            want = model(*inputs).numpy()
        got = forward(to_jax(model), *(jnp.asarray(x.numpy()) for x in inputs))
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)

    a = flux.FLAVORS["flux_debug"]
    model = randomized(flux_task.ConditionedFlux(a))
    params = to_jax(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(params)  # every trained tensor is a parameter on both sides
    decay = lambda n, p: p.dim() >= 2 and "norm" not in n and not n.endswith("bias")
    # lr: the FLUX run's. eps 1e-6: Adam's g / (sqrt(v) + eps) turns an fp32 rounding difference dg in a
    # near-zero gradient element into lr dg / eps (at eps 1e-8, 1 of 98304 elements moved by 1.6e-5)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-6)
    opt = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if decay(n, p)], "weight_decay": 0.1},
                             {"params": [p for n, p in model.named_parameters() if not decay(n, p)], "weight_decay": 0.0}],
                            **hyper, foreach=False)
    step = flux_jax.make_train_step(dataclasses.asdict(a), betas=hyper["betas"], eps=hyper["eps"], weight_decay=0.1, clip=1.0)
    state = flux_jax.init_opt(params)
    for i in range(1, 3):
        x0, eps, t, cls = torch.randn(8, 16, 4), torch.randn(8, 16, 4), 0.01 * torch.rand(8), torch.randint(0, 11, (8,))
        x_t = (1 - t)[:, None, None] * x0 + t[:, None, None] * eps
        loss = F.mse_loss(model(x_t, t, cls), eps - x0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        params, state, jloss, jnorm = step(params, state, tuple(jnp.asarray(x.numpy()) for x in (x0, eps, t, cls)),
                                           jnp.float32(hyper["lr"]), jnp.float32(i))
        assert abs(float(jloss) - loss.item()) < 1e-5 * loss.item() and abs(float(jnorm) - norm.item()) < 1e-5 * norm.item()
        assert norm.item() > 1.0  # clipping was active
    for n, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(params[n]), p.detach().numpy(), rtol=1e-5, atol=1e-5, err_msg=n)



# ------------------------------------------------------------------------------------------------
# arithmetic.py + grpo.py + weight_sync.py + rollout.py (GRPO's pieces). Oracles: Python arithmetic on the
# prompt text, the per-group formula (statistics.stdev), a per-token loop of the loss and its
# analytic gradient, generate.generate (one sequence at a time), the trainer's own forward, the
# in-process engine (vs the engine process), the trainer's weights (bit for bit)

GRPO_TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def test_arith_task_prompts_held_out_split_and_a_reward_that_survives_junk():
    import arithmetic
    task = arithmetic.get_task("arith", seed=3, format_credit=0.1)
    assert task.prompts(7, 32) == arithmetic.get_task("arith", seed=3).prompts(7, 32)   # (seed, step) -> prompts
    assert task.prompts(7, 32) != task.prompts(8, 32) != arithmetic.get_task("arith", seed=4).prompts(8, 32)

    def pair(prompt):  # the oracle reads the numbers off the text
        m = re.fullmatch(rb"(\d\d)\+(\d\d)=", bytes(prompt))
        assert m, prompt
        return int(m[1]), int(m[2])
    test = {pair(p) for p in task.test_set()}
    drawn = {pair(p) for step in range(200) for p in task.prompts(step, 32)}
    assert len(test) == 500 and not test & drawn and len(drawn) > 3000
    for line in task.train_text(50, seed=1).decode().splitlines():
        lhs, rhs = line.split("=")
        assert sum(int(x) for x in lhs.split("+")) == int(rhs) and pair(lhs.encode() + b"=") not in test
    p = list(b"12+34=")
    cases = {b"46\n": 1.0, b"46\n\xff junk after the end": 1.0, b"046\n": 0.1, b"47\n": 0.1, b"46": 0.0,
             b"": 0.0, b"\n": 0.0, b"4a\n": 0.0, b"\xff\xfe\n": 0.0, b"\x00\n": 0.0, b"9" * 1000 + b"\n": 0.0,
             b"1000\n": 0.0, b" 46\n": 0.0, b"-46\n": 0.0}
    for completion, want in cases.items():
        assert task.reward(p, list(completion)) == want, completion
        assert arithmetic.get_task("arith").reward(p, completion) == (1.0 if want == 1.0 else 0.0), completion
    with pytest.raises(ValueError, match="unknown reward task 'gsm8k'; known: arith"):
        arithmetic.get_task("gsm8k")


def test_group_advantages_equal_the_per_group_formula():
    import statistics
    import grpo
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (5 * 4,), generator=g).float() / 2
    rewards[4:8] = 1.0  # one group all the same: advantage 0, not NaN
    for std_norm in (True, False):
        got = grpo.group_advantages(rewards, 4, std_norm=std_norm).tolist()
        for i in range(5):
            r = rewards[4 * i:4 * i + 4].tolist()
            for j in range(4):
                want = r[j] - statistics.mean(r)
                if std_norm:
                    want /= statistics.stdev(r) + 1e-6
                assert abs(got[4 * i + j] - want) < 1e-5, (std_norm, i, j)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        grpo.group_advantages(rewards, 3)
    for bad, msg in [(dict(group_size=1), "G must be >= 2"), (dict(eps_low=0.0), "clip bounds must be > 0"),
                     (dict(eps_high=-0.1), "clip bounds must be > 0"), (dict(aggregation="bnpo"), "unknown loss aggregation 'bnpo'")]:
        with pytest.raises(ValueError, match=msg):
            grpo.GRPOConfig(**bad).check()


@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_loss_and_gradient_equal_a_per_token_loop(aggregation, beta):
    """min(rho A, clip(rho) A) per token, k3 KL, the aggregation's weights, and the gradient worked out
    by hand (d rho / d logp = rho; a clipped token has none; d k3 / d logp = 1 - exp(ref - logp))."""
    import grpo
    cfg = grpo.GRPOConfig(eps_low=0.2, eps_high=0.28, aggregation=aggregation, beta=beta).check()
    g = torch.Generator().manual_seed(1)
    B, C = 6, 5
    logp = (-torch.rand(B, C, generator=g, dtype=torch.float64) * 3).requires_grad_()
    engine = logp.detach() + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.4
    ref = logp.detach() + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3
    engine[1, :2] = logp.detach()[1, :2] + torch.tensor([0.7, -0.7], dtype=torch.float64)  # rho 0.50, 2.01 at A < 0
    adv = torch.tensor([1.5, -0.7, 0.0, 0.9, -1.2, 0.4], dtype=torch.float64)
    lengths = [5, 3, 1, 4, 2, 5]
    mask = torch.tensor([[t < n for t in range(C)] for n in lengths])
    loss, stats = grpo.policy_loss(logp, engine, adv, mask, cfg, logp_ref_BxC=ref)
    loss.backward()

    n_all = sum(lengths)
    want_loss, want_grad, kinds = 0.0, [[0.0] * C for _ in range(B)], set()
    for b in range(B):
        for t in range(lengths[b]):
            lp, le, lr, A = float(logp.detach()[b, t]), float(engine[b, t]), float(ref[b, t]), float(adv[b])
            rho = math.exp(lp - le)
            clipped_rho = min(max(rho, 1 - 0.2), 1 + 0.28)
            term = -min(rho * A, clipped_rho * A)
            d_term = 0.0 if clipped_rho * A < rho * A else -rho * A
            kinds.add(("clipped" if clipped_rho * A < rho * A else "free", A > 0, rho != clipped_rho))
            if beta:
                term += beta * (math.exp(lr - lp) - (lr - lp) - 1)
                d_term += beta * (1 - math.exp(lr - lp))
            w = {"grpo": 1 / (lengths[b] * B), "dapo": 1 / n_all, "dr_grpo": 1 / (B * C)}[aggregation]
            want_loss += w * term
            want_grad[b][t] = w * d_term
    # the case list: clipped tokens of both signs, and tokens outside the clip range min() keeps
    assert {("clipped", True, True), ("clipped", False, True), ("free", True, True), ("free", False, True),
            ("free", True, False)} <= kinds, kinds
    assert abs(float(loss.detach()) - want_loss) < 1e-12
    assert torch.allclose(logp.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-12, rtol=0)
    assert 0 < stats["clip_frac"] < 1 and ("kl" in stats) == (beta > 0)


def test_batched_sampling_equals_one_sequence_decoding_and_bf16_mismatch_is_measured():
    """Greedy rows of one batch equal generate.generate() prompt by prompt; the mask ends at the first
    eos; a bf16 engine's logprobs vs the fp32 trainer's: ratio statistics printed (the RL mismatch)."""
    import copy
    import generate
    import grpo
    import rollout
    import arithmetic
    torch.manual_seed(0)
    model = Transformer(GRPO_TINY)
    prompts = arithmetic.get_task("arith").prompts(0, 6)
    want = [generate.generate(model, p, 8) for p in prompts]
    eos = want[0][2]  # row 0 ends by its third token
    got, logp, mask = rollout.sample_batch(model, torch.tensor(prompts), 8, 0.0, None, eos_id=eos)
    for i, w in enumerate(want):
        end = w.index(eos) + 1 if eos in w else 8
        assert got[i, :end].tolist() == w[:end] and mask[i].tolist() == [t < end for t in range(8)], i
    assert mask[0].sum() <= 3 and not mask.all()

    engine = rollout.Engine(copy.deepcopy(model).to(torch.bfloat16))
    ro = engine.generate(arithmetic.get_task("arith").prompts(1, 16), 4, 6, temperature=1.0, seed=0)
    full = torch.cat([ro.prompts_BxP, ro.completions_BxC], 1)
    with torch.no_grad():
        log_ratio = (grpo.completion_logprobs(model, full, 6, 1.0) - ro.logprobs_BxC)[ro.mask_BxC]
    ratio = log_ratio.exp()
    print(f"\nbf16 engine vs fp32 trainer over {ratio.numel()} tokens: ratio mean {ratio.mean():.5f} "
          f"std {ratio.std():.5f} min {ratio.min():.4f} max {ratio.max():.4f} mean|log ratio| {log_ratio.abs().mean():.5f}")
    assert 0 < log_ratio.abs().mean() < 0.05 and ro.completions_BxC.shape == (64, 6)


def test_engine_process_sync_in_place_bit_equal_logprobs_and_failures_in_one_line():
    """One engine process: weights bit-equal to the trainer's after each sync, copied into the same
    buffers (data_ptr unchanged), rollouts carry the version, equal the in-process engine, and their
    logprobs equal the trainer's forward (fp32: ratio 1 within 1e-5); a stalled and then a dead engine
    raise one-line EngineErrors within the timeout."""
    import copy
    import signal
    import time
    import grpo
    import rollout
    import arithmetic
    torch.manual_seed(0)
    trainer = Transformer(GRPO_TINY)
    engine = rollout.EngineProcess(GRPO_TINY, timeout_s=30)
    try:
        before = engine.state()
        with pytest.raises(rollout.EngineError, match="no weights synced yet"):
            engine.generate([[1, 2]], 2, 2)
        prompts = arithmetic.get_task("arith").prompts(0, 4)
        for version in (1, 2):
            stats = engine.sync(trainer.named_parameters(), version)
            print(f"\nsync v{version}: {stats['bytes']} bytes in {stats['seconds'] * 1e3:.2f} ms")
            assert stats["bytes"] == 4 * sum(p.numel() for p in trainer.parameters())
            state = engine.state()
            assert state["version"] == version and state["ptrs"] == before["ptrs"]
            assert all(torch.equal(state["weights"][n], p) for n, p in trainer.named_parameters())
            ro = engine.generate(prompts, 3, 5, temperature=0.8, seed=version, eos_id=10)
            local = rollout.Engine(copy.deepcopy(trainer)).generate(prompts, 3, 5, temperature=0.8, seed=version, eos_id=10)
            assert ro.version == version and torch.equal(ro.completions_BxC, local.completions_BxC)
            full = torch.cat([ro.prompts_BxP, ro.completions_BxC], 1)
            with torch.no_grad():
                oracle = F.log_softmax(trainer(full)[:, 5:-1] / 0.8, -1).gather(-1, full[:, 6:, None])[..., 0]
                assert torch.equal(grpo.completion_logprobs(trainer, full, 6, 0.8), oracle)
            assert (oracle - ro.logprobs_BxC)[ro.mask_BxC].exp().sub(1).abs().max() < 1e-5
            with torch.no_grad():  # an "update": the next sync must carry it
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
        engine.timeout_s = 1.0
        os.kill(engine.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(rollout.EngineError, match=r"^rollout engine stalled: no reply to generate within 1 s$"):
            engine.generate(prompts, 3, 5, eos_id=10)
        assert time.monotonic() - t0 < 5
        with pytest.raises(rollout.EngineError, match=r"^rollout engine process died \(exit code -9\)"):
            engine.sync(trainer.named_parameters(), 3)
    finally:
        engine.close()



def test_sft_loss_is_the_cross_entropy_of_the_answer_bytes_only_and_ranks_split_it_exactly(tmp_path, capsys):
    """sft_task.py (GRPO's warm start): the batch is the problems GRPO's prompts(step) draws, and its
    loss equals F.cross_entropy over the answer positions only, sliced by hand from the unpadded
    `ab+cd=` + the sum computed here + newline (the prompt bytes and padding carry no loss). Two
    ranks' slices: their losses average to the one-process loss, and so do their gradients. Bad
    input: one `error:` line, exit 2, nothing written."""
    import arithmetic
    import train
    tiny = [x for kv in ("dim=32", "n_layers=2", "n_heads=4", "n_kv_heads=2", "ffn_dim=64", "max_seq_len=16")
            for x in ("--set", kv)]
    cfg = train.parse_config(["--task", "sft", *tiny, "--batch-size", "6", "--seed", "3"])
    one = train.TASKS["sft"](cfg)
    one.setup_data(0, 1)
    torch.manual_seed(0)
    model = Transformer(one.args)
    inputs_BxS, _, _ = batch = one.batch(5)
    prompts = [bytes(r[:6].tolist()) for r in inputs_BxS]
    assert prompts == [bytes(p) for p in arithmetic.get_task("arith", 3).prompts(5, 6)]
    logits, targets = [], []
    for p in prompts:
        a, b = (int(x) for x in p[:-1].split(b"+"))
        row = list(p + f"{a + b}\n".encode())
        out_SxV = model(torch.tensor([row]))[0]
        logits.append(out_SxV[len(p) - 1:len(row) - 1])  # the positions that predict the answer's bytes
        targets += row[len(p):]
    want = F.cross_entropy(torch.cat(logits), torch.tensor(targets))
    loss, _ = one.loss(model, batch)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    want.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ranks = []
    for rank in range(2):
        t = train.TASKS["sft"](cfg)
        t.setup_data(rank, 2)
        ranks.append(t.loss(model, t.batch(5))[0] / 2)
    sum(ranks).backward()
    torch.testing.assert_close(sum(ranks), want, rtol=1e-6, atol=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
    out = str(tmp_path / "bad")
    for extra, msg in [(["--reward-task", "gsm8k"], "unknown reward task 'gsm8k'"),
                       (["--set", "max_seq_len=8"], "exceeds the model's max_seq_len 8"),
                       (["--scan"], "--task sft trains a byte-level policy unstacked")]:
        assert _main(["--task", "sft", "--out-dir", out, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1, (extra, err)
        assert not os.path.exists(out)


# GRPO as a workload of the trainer (grpo_task.py): a tiny supervised warm start on solved problems
# (train.py --task sft, sft_task.py), then 4 GRPO steps, two per rollout batch. Oracles: the eager
# single process (for graph mode and 2 SimpleFSDP ranks), the straight run (for resume).
GRPO_WARM = ["--set", "dim=32", "--set", "n_layers=2", "--set", "n_heads=4", "--set", "n_kv_heads=2",
             "--set", "ffn_dim=64", "--set", "max_seq_len=32", "--batch-size", "16",
             "--lr", "1e-2", "--warmup", "5", "--eval-interval", "0", "--log-interval", "20"]


@pytest.fixture(scope="session")
def grpo_warm(tmp_path_factory):
    """A run directory of 40 supervised steps on the answers of solved problems: digits and newlines,
    rarely right (with --format-credit its groups' rewards differ, so the GRPO gradient is not zero).
    Its held-out accuracy is recorded at steps 0 and 40. (arithmetic.py's text writer checked here too.)"""
    import arithmetic
    root = tmp_path_factory.mktemp("grpo_warm")
    assert arithmetic.main(["write", str(root / "arith.txt"), "--problems", "2000"]) == 0
    text = (root / "arith.txt").read_bytes()
    assert text.count(b"\n") == 2000 and not list(root.glob("*.tmp*"))
    assert _main(["--task", "sft", *GRPO_WARM, "--steps", "40", "--out-dir", str(root / "warm")]) == 0
    assert sorted(_records(str(root / "warm"), "held_out_accuracy")) == [0, 40]
    return str(root / "warm")


def _grpo_args(warm, out_dir, *extra):
    return ["--task", "grpo", "--init-from", warm, "--steps", "4", "--updates-per-batch", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--format-credit", "0.1", "--kl-beta", "0.05", "--lr", "1e-3",
            "--warmup", "0", "--eval-interval", "0", "--log-interval", "1", "--ckpt-interval", "0",
            "--out-dir", out_dir, *extra]


def _grpo_weights(run_dir):
    import checkpoint
    return checkpoint.load_run(run_dir).state_dict()


def test_grpo_through_the_trainer_graph_mode_simplefsdp_and_resume_equal_one_eager_process(grpo_warm, tmp_path):
    """The trainer path end to end: rollouts from the engine process every second step (policy version
    = optimizer steps in the synced weights), reward per step and held-out accuracy at the first and
    last evaluation in metrics.jsonl and the plot, completions in the log. Graph mode and 2 torchrun
    ranks (SimpleFSDP, each its own rows, one engine) equal the eager process on the same global
    batches (k3 KL to the warm start on: each rank scores its own rows against the reference): losses,
    pre-clip gradient norms, rewards, final weights. Halted at step 2 and resumed
    equals the straight run bit for bit."""
    runs = {name: str(tmp_path / name) for name in ("eager", "graph", "fsdp", "part")}
    assert _main(_grpo_args(grpo_warm, runs["eager"])) == 0
    assert _main(_grpo_args(grpo_warm, runs["graph"], "--mode", "graph")) == 0
    rc, _, err = torchrun(2, _grpo_args(grpo_warm, runs["fsdp"], "--mesh", "ici=2"))
    assert rc == 0, err[-3000:]
    assert _main(_grpo_args(grpo_warm, runs["part"], "--halt-at", "2")) == 0
    assert _main(_grpo_args(grpo_warm, runs["part"], "--resume")) == 0

    oracle = runs["eager"]
    assert _records(oracle, "policy_version") == {1: 0, 2: 0, 3: 2, 4: 2}
    assert sorted(_records(oracle, "held_out_accuracy")) == [0, 4]
    assert all(g > 0 for g in _records(oracle, "grad_norm").values())  # the groups' rewards differ
    with open(os.path.join(oracle, "metrics.jsonl")) as f:
        shown = [json.loads(line) for line in f if '"completions"' in line]
    assert [r["step"] for r in shown] == [0, 4] and all(len(r["text"]) == 4 for r in shown)
    assert os.path.getsize(os.path.join(oracle, "loss.png")) > 0
    for name in ("graph", "fsdp"):
        for key in ("loss", "grad_norm", "reward"):
            _near(_records(oracle, key), _records(runs[name], key), atol=1e-6, rtol=1e-5)
        mine = _grpo_weights(runs[name])
        for k, w in _grpo_weights(oracle).items():
            torch.testing.assert_close(mine[k], w, rtol=1e-5, atol=1e-5, msg=f"{name} {k}")
    for key in ("loss", "grad_norm", "reward"):
        assert _records(runs["part"], key) == _records(oracle, key), key
    assert all(torch.equal(a, b) for a, b in zip(_grpo_weights(runs["part"]).values(), _grpo_weights(oracle).values()))


def test_grpo_bad_input_is_one_error_line_exit_2_and_a_dead_engine_exit_4(grpo_warm, tmp_path, capsys):
    """G < 2, clip <= 0, an unknown aggregation or reward task, a step count off the rollout-batch
    boundary: one `error:` line, exit 2, nothing written. The engine process killed mid-run: one
    line naming it, exit 4, within seconds."""
    import signal
    import time
    out = str(tmp_path / "bad")
    for extra, msg in [(["--group-size", "1"], "group size G must be >= 2"),
                       (["--clip-eps", "0"], "clip bounds must be > 0"),
                       (["--aggregation", "bnpo"], "unknown loss aggregation 'bnpo'"),
                       (["--reward-task", "gsm8k"], "unknown reward task 'gsm8k'"),
                       (["--steps", "3"], "--steps 3 is not a multiple of --updates-per-batch 2"),
                       (["--halt-at", "1"], "--halt-at 1 is not a multiple")]:
        assert _main(_grpo_args(grpo_warm, out, *extra)) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1, (extra, err)
        assert not os.path.exists(out)

    run = str(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"),
                             *_grpo_args(grpo_warm, run, "--steps", "400")], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(os.path.join(run, "metrics.jsonl")) and _records(run, "reward")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        engines = []  # the trainer's children started by multiprocessing's spawn (not its resource tracker)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if ppid == proc.pid and b"spawn_main" in cmd:
                engines.append(int(pid))
        assert len(engines) == 1, engines
        os.kill(engines[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 4, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rollout engine process died (exit code -9)" in lines[0] and "at step" in lines[0], err


if __name__ == "__main__":  # child processes: python test_all.py <child function> [args...]
    globals()[sys.argv[1]](*sys.argv[2:])


def _flux_weights(run_dir, task=None, scan=False):
    """The final weights; a --scan run's (L, ...) stacks unstacked into the plain model's names."""
    import checkpoint
    import flux
    import flux_task
    import layer_scan
    model = task.build_model(task.args) if task else flux_task.ConditionedFlux(flux.FLAVORS["flux_debug"])
    if scan:
        layer_scan.stack_layers(model, model.flux.pack_for_scan(flux_task.PROMPT_TOKENS))
    path, _ = checkpoint.find_resumable(os.path.join(run_dir, "checkpoints"))
    state, plain = checkpoint.load(path, {"model": model.state_dict()})["model"], {}
    for name, w in state.items():
        stack = re.fullmatch(r"(flux\.(?:double|single)_blocks)\.block__(.+)", name)
        plain.update({f"{stack[1]}.{i}.{stack[2].replace('__', '.')}": w[i] for i in range(len(w))} if stack else {name: w})
    return plain


def test_flux_trains_through_the_shared_trainer_eager_graph_and_simplefsdp_alike(tmp_path, monkeypatch):
    """FLUX as a Task (flux_task.py) on the one trainer: graph mode (one traced step with AdamW) and
    HSDP on 4 processes (SimpleFSDP, dcn=2 x ici=2, graph mode, its passes on) equal the eager single process on the same
    global batches: losses, pre-clip gradient norms, validation MSE at the fixed times, final weights.
    So does --scan (each block stack one scan over stacked weights; the weights compared unstacked).
    The SimpleFSDP passes bucket by FLUX's blocks (the Task's `blocks`): one all-gather per double /
    single block (+ one for the rest) each way, each issued before the previous one's wait.
    So do --mode compile with --kernels pallas (one run: inductor-compiled blocks around the non-causal
    splash kernel; losses and norms to 1e-4) and graph mode on XLA:CPU (a child process: the step
    compiled once). A halted run resumed equals the uninterrupted one bit for bit; the end writes a
    sample grid."""
    common = ["--task", "flux", "--steps", "4", "--batch-size", "8", "--log-interval", "1", "--eval-batches", "2",
              "--eval-interval", "2", "--ckpt-interval", "0", "--sample-images", "0"]
    runs = {name: str(tmp_path / name) for name in ("eager", "graph", "fsdp", "part", "compiled", "xla", "scan")}
    # (XLA in its own process, started first: it runs while this one trains)
    xla = subprocess.Popen([sys.executable, "test_all.py", "child_xla_graph_steps", *common, "--eval-batches", "0",
                            "--mode", "graph", "--device", "xla", "--out-dir", runs["xla"]], cwd=HERE, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert _main([*common, "--out-dir", runs["eager"], "--sample-images", "2"]) == 0
    import kernels_pallas  # the table names "kernels_pallas:splash_full_attention": count that it is what runs
    splash_calls, splash = [], kernels_pallas.splash_full_attention
    monkeypatch.setattr(kernels_pallas, "splash_full_attention", lambda *a: splash_calls.append(1) or splash(*a))
    assert _main([*common, "--mode", "compile", "--kernels", "pallas", "--eval-batches", "0",
                  "--out-dir", runs["compiled"]]) == 0
    assert splash_calls
    for key in ("loss", "grad_norm"):
        _near(_records(runs["eager"], key), _records(runs["compiled"], key), atol=1e-4)
    out, err = xla.communicate(timeout=300)
    assert xla.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["compiles"][0] == res["compiles"][-1] == 2, res["compiles"]  # (as the LM's XLA graph test)
    _near(_records(runs["eager"], "loss"), dict(zip(range(1, 5), res["losses"])), atol=1e-4)
    assert _main([*common, "--mode", "graph", "--out-dir", runs["graph"]]) == 0
    assert _main([*common, "--scan", "--out-dir", runs["scan"]]) == 0
    rc, _, err = torchrun(4, [*common, "--mode", "graph", "--mesh", "dcn=2,ici=2", "--out-dir", runs["fsdp"]])  # HSDP
    assert rc == 0, err[-3000:]
    assert _main([*common, "--halt-at", "2", "--out-dir", runs["part"]]) == 0
    assert _main([*common, "--resume", "--out-dir", runs["part"]]) == 0
    oracle = runs["eager"]
    for name in ("graph", "fsdp", "scan"):
        for key in ("loss", "grad_norm", "val_loss"):
            mine, ref = _records(runs[name], key), _records(oracle, key)
            assert mine.keys() == ref.keys() and len(ref) >= 3, (name, key)
            torch.testing.assert_close(torch.tensor([mine[k] for k in sorted(mine)]),
                                       torch.tensor([ref[k] for k in sorted(ref)]), rtol=1e-5, atol=1e-6)
        mine = _flux_weights(runs[name], scan=name == "scan")
        assert mine.keys() == _flux_weights(oracle).keys(), name
        for k, w in _flux_weights(oracle).items():
            torch.testing.assert_close(mine[k], w, rtol=1e-5, atol=1e-5, msg=k)  # (as the LM tests)
    graph = next(json.loads(line) for line in open(os.path.join(runs["fsdp"], "metrics.jsonl")) if '"graph"' in line)
    fwd, bwd, blocks = graph["collectives_by_side"]["forward"], graph["collectives_by_side"]["backward"], 2 + 2
    assert _gathers(fwd) == _gathers(bwd) == bwd["reduce_scatter_tensor"] == blocks + 1, graph["collectives_by_side"]
    assert graph["prefetched_gathers"] == blocks and graph["saved_gathered_bytes"] == 0
    assert losses(runs["part"]) == losses(oracle)
    assert all(torch.equal(a, b) for a, b in zip(_flux_weights(runs["part"]).values(), _flux_weights(oracle).values()))
    with open(os.path.join(oracle, "metrics.jsonl")) as f:
        judged = [json.loads(line) for line in f if '"samples"' in line]
    assert os.path.getsize(os.path.join(oracle, "samples.png")) > 0 and 0 <= judged[0]["accuracy"] <= 1
    assert all(os.path.getsize(os.path.join(oracle, f"samples_step_00000{i}.png")) > 0 for i in (0, 2, 4))  # per evaluation
    import flux_task  # the sampling CLI on the run: a grid per scale; a run of another task refused in one line
    assert flux_task.main([oracle, "--per-class", "1", "--guidance", "1,3"]) == 0
    assert all(os.path.getsize(os.path.join(oracle, f"samples_g{g}.png")) > 0 for g in (1, 3))
    assert flux_task.main([oracle, "--guidance", "nan"]) == 2


def _latent_file(path, n=20, chw=(1, 4, 4), te=(3, 32), v=32, seed=0, **replace):
    """A small precomputed-latents file (flux_latents.py's schema) of random tensors; `replace` swaps or
    adds tensors (None drops one)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    t = {"latents": torch.randn(n, *chw, generator=g), "txt": torch.randn(n, *te, generator=g),
         "pooled": torch.randn(n, v, generator=g), "labels": torch.arange(n) % 3,
         "empty_txt": torch.randn(*te, generator=g), "empty_pooled": torch.randn(v, generator=g)}
    t.update(replace)
    save_file({k: v.contiguous() for k, v in t.items() if v is not None}, str(path))
    return str(path)


def _pack_by_loop(lat_NxCxHxW):
    """FLUX's 2x2 packing written out: token r * W/2 + c holds channels (ch, i, j) of patch (r, c)."""
    N, C, H, W = lat_NxCxHxW.shape
    out = torch.empty(N, (H // 2) * (W // 2), 4 * C)
    for r in range(H // 2):
        for c in range(W // 2):
            for ch in range(C):
                for i in range(2):
                    for j in range(2):
                        out[:, r * (W // 2) + c, ch * 4 + i * 2 + j] = lat_NxCxHxW[:, ch, 2 * r + i, 2 * c + j]
    return out


def test_flux_latent_file_batches_are_its_rows_loss_is_the_flow_mse_and_a_run_trains_with_grids(tmp_path):
    """--data FILE.safetensors (cached latents + T5 / CLIP outputs): a batch's rows are the file's training
    rows (packed as the loop above packs them) with their own embeddings or the empty prompt's; the
    task's loss equals the rectified-flow MSE computed here from those tensors; validation holds out the
    last tenth, unconditional; a 2-step run trains and draws a grid per evaluation, named by step."""
    import cli
    import flux_task
    path = _latent_file(tmp_path / "cache.safetensors")
    from safetensors.torch import load_file
    f = load_file(path)
    cfg = cli.parse_config(["--task", "flux", "--data", path, "--batch-size", "16", "--eval-batches", "2"])
    task = flux_task.FluxDigits(cfg)
    task.setup_data(0, 1)
    packed = _pack_by_loop(f["latents"])
    x0, eps, t, txt, y = task.batch(3)
    dropped = 0
    for b in range(16):  # each batch row is one of the 18 training rows (the last 2 of 20 are held out)
        row = [n for n in range(18) if torch.equal(packed[n], x0[b])]
        assert len(row) == 1, b
        own = torch.equal(txt[b], f["txt"][row[0]]) and torch.equal(y[b], f["pooled"][row[0]])
        empty = torch.equal(txt[b], f["empty_txt"]) and torch.equal(y[b], f["empty_pooled"])
        assert own or empty, b
        dropped += empty
    assert dropped < 8 and 0 < t.min() and t.max() < 1
    torch.manual_seed(0)
    model = task.build_model(task.args)
    with torch.no_grad():  # (random weights everywhere: the zero-initialised last layer would predict 0 for any x_t)
        for p in model.parameters():
            p.normal_(0, 0.2)
    with torch.no_grad():  # the flow written out: x_t = (1 - t) x0 + t eps, target eps - x0, mean of squares
        tt = t[:, None, None]
        want = ((model(((1 - tt) * x0 + tt * eps), t, txt, y) - (eps - x0)) ** 2).mean()
        got, _ = task.loss(model, (x0, eps, t, txt, y))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    vx0, _, vt, vtxt, vy = task.val_batches[1]
    assert torch.equal(vx0, packed[18:]) and (vt == 0.1875).all()
    assert torch.equal(vtxt, f["empty_txt"].expand(2, -1, -1)) and torch.equal(vy, f["empty_pooled"].expand(2, -1))
    out = str(tmp_path / "run")
    assert _main(["--task", "flux", "--data", path, "--steps", "2", "--batch-size", "8", "--eval-interval", "2",
                  "--eval-batches", "1", "--log-interval", "1", "--sample-images", "1", "--out-dir", out]) == 0
    assert len(losses(out)) == 2 and all(math.isfinite(v) for v in losses(out).values())
    assert sorted(p for p in os.listdir(out) if p.startswith("samples")) == [
        "samples.png", "samples_step_000000.png", "samples_step_000002.png"]
    trained = _flux_weights(out, task)
    torch.manual_seed(0)
    init = task.build_model(task.args).state_dict()
    assert trained.keys() == init.keys() and not torch.equal(trained["flux.img_in.weight"], init["flux.img_in.weight"])
    assert flux_task.main([out]) == 2  # the sampling CLI is for digits runs: refused in one line


def test_flux_init_from_a_diffusers_directory_fills_the_transformer(tmp_path):
    """--init-from (fine-tuning) on a latent file: the trainer's transformer holds the fixture's weights
    bit for bit, and its output with --distilled-guidance 3.5, through the task's own conditioning
    (image ids from the file's 8x6 latents), equals diffusers' stored output for that sample. Under
    SimpleFSDP on 2 processes (each rank loads its own shard) the first step's loss, gradient norm
    and validation MSE equal the one-process run's."""
    import flux_hf
    import train
    fixture = os.path.join(FLUX_FIXTURES, "guidance")
    want = _flux_expected("guidance")
    path = _latent_file(tmp_path / "cache.safetensors", n=20, chw=(2, 8, 6), te=(5, 24), v=12)
    common = ["--task", "flux", "--data", path, "--init-from", fixture, "--distilled-guidance", "3.5", "--steps", "1",
              "--batch-size", "4", "--eval-batches", "1", "--sample-images", "0", "--ckpt-interval", "0"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    trainer = train.Trainer(train.parse_config([*common, "--out-dir", one]))
    ref = flux_hf.load(fixture)
    mine = dict(trainer.model.flux.named_parameters())
    assert mine.keys() == dict(ref.named_parameters()).keys()
    assert all(torch.equal(mine[n], p) for n, p in ref.named_parameters())
    with torch.no_grad():
        got = trainer.model(want["hidden_states"][:1], want["timestep"][:1], want["encoder_hidden_states"][:1],
                            want["pooled_projections"][:1])
    assert want["guidance"][0] == 3.5
    torch.testing.assert_close(got, want["sample"][:1], rtol=1e-4, atol=1e-4 * want["sample"].abs().max().item())
    assert trainer.meta["flavor"] == f"hf:{os.path.abspath(fixture)}" and not os.path.exists(one)
    assert trainer.run() == 0
    rc, _, err = torchrun(2, [*common, "--mesh", "ici=2", "--out-dir", two])
    assert rc == 0, err[-3000:]
    for key in ("loss", "grad_norm", "val_loss"):
        mine, ref = _records(two, key), _records(one, key)
        assert mine.keys() == ref.keys() and len(ref) >= 1, key
        torch.testing.assert_close(torch.tensor(list(mine.values())), torch.tensor(list(ref.values())), rtol=1e-5, atol=0)


def _flux_bad_inputs(tmp_path):
    """(argv, message) per bad input of the flux task; the files they name are written here."""
    import shutil
    lat = lambda name, **kw: _latent_file(tmp_path / f"{name}.safetensors", **kw)
    patch2 = tmp_path / "patch2"
    shutil.copytree(os.path.join(FLUX_FIXTURES, "guidance"), patch2)
    c = json.loads((patch2 / "config.json").read_text())
    (patch2 / "config.json").write_text(json.dumps({**c, "patch_size": 2}))
    return {
        "image_shape": (["--data", lat("shape", chw=(2, 4, 4))], "latents has shape (20, 2, 4, 4)"),
        "odd_side": (["--data", lat("odd", chw=(1, 5, 4))], "H, W even"),
        "label_range": (["--data", lat("label", labels=torch.tensor([0] * 19 + [12]))], "labels must be classes 0..9 (a grid row each), got 12"),
        "txt_width": (["--data", lat("width", te=(3, 16))], "txt has shape (20, 3, 16)"),
        "no_txt": (["--data", lat("notxt", txt=None)], "no tensor 'txt'"),
        "nan": (["--data", lat("nan", pooled=torch.full((20, 32), float("nan")))], "finite"),
        "guidance": (["--distilled-guidance", "3.5"], "has no guidance embedding"),
        "diffusers_config": (["--init-from", str(patch2)], "patch_size=2 is not implemented"),
        "out_channels": (["--init-from", os.path.join(FLUX_FIXTURES, "plain"), "--data", lat("plain", chw=(2, 4, 4),
                          te=(3, 24), v=12)], "predicts 4 channels a token from 8"),
        "missing_file": (["--data", str(tmp_path / "nowhere.safetensors")], "no such file"),
        "not_safetensors": (["--data", str(patch2 / "config.json")], "not a readable safetensors file"),
    }


@pytest.mark.parametrize("case", ["image_shape", "odd_side", "label_range", "txt_width", "no_txt", "nan", "guidance",
                                  "diffusers_config", "out_channels", "missing_file", "not_safetensors"])
def test_flux_bad_input_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    args, message = _flux_bad_inputs(tmp_path)[case]
    out_dir = str(tmp_path / "run")
    rc = _main(["--task", "flux", "--steps", "1", "--batch-size", "4", "--sample-images", "0", "--out-dir", out_dir, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out_dir)
