"""test_all.py: every concept checked against an independent oracle. Run: .venv/bin/python -m pytest test_all.py

Oracles: straightforward formulas written out loop by loop (RoPE, GQA attention, MoE per token),
torch.optim.AdamW and clip_grad_norm_, the uninterrupted run (resume), eager CPU (XLA:CPU), JAX's
production Pallas kernels, FSDP2, the unrolled loop (scan). Runs on CPU only, ~minutes on 2 cores.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import data
import optim
from model import (FLAVORS, ModelArgs, Transformer, apply_rope, attention_mask, check_args,
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


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "step" in r}


def tiny_args(**kw):
    return dataclasses.replace(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128), **kw)


# ------------------------------------------------------------------------------------------------
# model.py

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
# optim.py

def test_functional_adamw_equals_torch_adamw_over_20_steps():
    torch.manual_seed(0)
    params = [torch.randn(8, 5), torch.randn(5), torch.randn(3, 4, 2)]
    ref = [p.clone().requires_grad_() for p in params]
    mask = optim.decay_mask(params)
    torch_opt = torch.optim.AdamW([{"params": [p for p, m in zip(ref, mask) if m], "weight_decay": 0.1},
                                   {"params": [p for p, m in zip(ref, mask) if not m], "weight_decay": 0.0}],
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


def test_adamw_is_pure():
    params, grads = [torch.ones(3, 3)], [torch.full((3, 3), 0.5)]
    state = optim.init_state(params)
    before = [params[0].clone(), state["exp_avg"][0].clone()]
    optim.adamw(params, grads, state, 1, 0.1)
    assert torch.equal(params[0], before[0]) and torch.equal(state["exp_avg"][0], before[1])


def test_clipping_matches_torch():
    torch.manual_seed(0)
    grads = [torch.randn(10, 10) * 3, torch.randn(7)]
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    clipped, norm = optim.clip_by_global_norm(grads, 1.0)
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
# data.py

def test_data_is_deterministic_and_rank_dependent(corpus):
    train, val = data.load_corpus(corpus)
    assert len(train) > 0 and len(val) > 0 and len(train) > 10 * len(val)
    a, b = data.Batches(train, 4, 16, seed=1), data.Batches(train, 4, 16, seed=1)
    x1, y1 = a.get(7)
    x2, y2 = b.get(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])            # targets are inputs shifted by one
    assert not torch.equal(a.get(7, rank=1)[0], x1)       # ranks read different data
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


# ------------------------------------------------------------------------------------------------
# train.py: resume, bad input, non-finite loss, XLA:CPU

def test_resume_equals_uninterrupted_bit_for_bit(corpus, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = [*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "0"]
    assert run_train([*common, "--out-dir", full])[0] == 0
    assert run_train([*common, "--out-dir", part, "--halt-at", "4"])[0] == 0
    assert sorted(losses(part)) == [1, 2, 3, 4]
    rc, out, err = run_train([*common, "--out-dir", part, "--resume"])
    assert rc == 0, err
    assert "start at step 4" in out
    assert losses(part) == losses(full)  # exact float equality, steps 1..8


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


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    import train
    out_dir = str(tmp_path / "run")
    real_step = train.Trainer.eager_step

    def poisoned(self, inputs, targets, lr):
        ce, norm = real_step(self, inputs, targets, lr)
        return (ce * float("nan") if self.step == 5 else ce), norm

    monkeypatch.setattr(train.Trainer, "eager_step", poisoned)
    rc = train.main([*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "3", "--out-dir", out_dir])
    assert rc == 3 and "loss is nan at step 5" in capsys.readouterr().out
    ckpts = os.path.join(out_dir, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["latest", "step_000003"]
    import checkpoint
    assert checkpoint.latest(ckpts).endswith("step_000003")


def test_xla_cpu_matches_eager_over_10_steps(corpus, tmp_path):
    common = [*TINY, "--data", corpus, "--steps", "10", "--ckpt-interval", "0", "--eval-interval", "0"]
    rc, _, err = run_train([*common, "--device", "cpu", "--out-dir", str(tmp_path / "cpu")])
    assert rc == 0, err
    rc, out, err = run_train([*common, "--device", "xla", "--out-dir", str(tmp_path / "xla")],
                             env={"PJRT_DEVICE": "CPU"})
    assert rc == 0, err
    assert "on xla" in out
    eager, xla = losses(str(tmp_path / "cpu")), losses(str(tmp_path / "xla"))
    assert sorted(eager) == list(range(1, 11)) and sorted(xla) == sorted(eager)
    for step in eager:
        assert abs(eager[step] - xla[step]) < 1e-4, (step, eager[step], xla[step])
