# rl/arithmetic.py + rl/grpo.py + rl/weight_sync.py + rl/rollout.py (GRPO's pieces). Oracles: Python arithmetic on the
# prompt text, the per-group formula (statistics.stdev), a per-token loop of the loss and its
# analytic gradient, generate.generate (one sequence at a time), the trainer's own forward, the
# in-process engine (vs the engine process), the trainer's weights (bit for bit)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import math
import os
import re

import torch.nn.functional as F
import pytest
import torch

from model import ModelArgs, Transformer

from tests import launch
from tests.common import HERE, _main, assert_close, _near, _records, ran_on, torchrun


GRPO_TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def test_arith_task_prompts_held_out_split_and_a_reward_that_survives_junk():
    from rl import arithmetic
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


@pytest.mark.fast
def test_group_advantages_equal_the_per_group_formula():
    import statistics
    from rl import grpo
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


@pytest.mark.fast
@pytest.mark.parametrize("aggregation", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_grpo_loss_and_gradient_equal_a_per_token_loop(aggregation, beta):
    """min(rho A, clip(rho) A) per token, k3 KL, the aggregation's weights, and the gradient worked out
    by hand (d rho / d logp = rho; a clipped token has none; d k3 / d logp = 1 - exp(ref - logp))."""
    from rl import grpo
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
    from rl import grpo
    from rl import rollout
    from rl import arithmetic
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
    from rl import grpo
    from rl import rollout
    from rl import arithmetic
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


def test_an_engine_killed_after_it_sent_a_rollout_is_a_dead_engine_not_a_failed_write():
    """A rollout's tensors cross as file descriptors that the trainer fetches from the engine while it
    reads the reply (torch's sharing through multiprocessing's resource sharer). The engine killed after
    sending one and before the trainer reads it: "process died", an EngineError (exit 4); before, the
    fetch's ConnectionRefusedError (an OSError) reached train.main as "a write failed" (exit 5: seen under
    load, with the engine killed mid-run)."""
    import select
    import signal
    from rl import rollout
    torch.manual_seed(0)
    engine = rollout.EngineProcess(GRPO_TINY, timeout_s=30)
    try:
        engine.sync(Transformer(GRPO_TINY).named_parameters(), 1)
        engine._send("generate", dict(prompts=[[1, 2]], group_size=2, max_new_tokens=3, temperature=1.0, seed=0,
                                      eos_id=None, batch_size=256))
        assert select.select([engine.sock], [], [], 30)[0], "no reply"
        os.kill(engine.proc.pid, signal.SIGKILL)
        engine.proc.join(10)
        with pytest.raises(rollout.EngineError, match=r"^rollout engine process died \(exit code -9\) during generate$"):
            engine._reply("generate")
    finally:
        engine.close()



# A policy 15.5x the push's bucket: 4.07 M parameters (15.5 MiB fp32), buckets of 1 MiB (its largest tensor)
PUSH_POLICY = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=1024, max_seq_len=32)
PUSH_BUCKET = 1 << 20


def test_a_push_streams_the_policy_in_buckets_its_peak_extra_memory_is_a_bucket_not_the_policy():
    """rl/weight_sync.py's buckets through our engine process: a policy 15.5x the bucket arrives bit-equal
    in the engine's own buffers (state: weights, data_ptrs), in >= 15 gloo broadcasts; the peak resident
    memory a push adds, measured in the trainer and in the engine process (/proc VmHWM), is about one
    bucket in each, never the policy (whole-policy staging, the design before, added 17 MB on each
    side); the second push adds nothing (the buffers are reused)."""
    from rl import rollout, weight_sync
    from tests.common import peak_extra_rss
    torch.manual_seed(0)
    trainer = Transformer(PUSH_POLICY)
    policy_bytes = 4 * sum(p.numel() for p in trainer.parameters())
    engine = rollout.EngineProcess(PUSH_POLICY, timeout_s=60, bucket_bytes=PUSH_BUCKET)
    try:
        ptrs = engine.state()["ptrs"]
        pids = (os.getpid(), engine.proc.pid)
        for version in (1, 2):
            stats, extra = peak_extra_rss(pids, lambda: engine.sync(trainer.named_parameters(), version))
            buckets = engine.sender.buckets
            print(f"\npush v{version}: {len(buckets.plan)} buckets of <= {PUSH_BUCKET >> 20} MiB, policy "
                  f"{policy_bytes / 2**20:.1f} MiB; peak extra resident memory: trainer "
                  f"{extra[pids[0]] / 2**20:.2f} MiB, engine {extra[pids[1]] / 2**20:.2f} MiB, {stats['seconds']:.2f} s")
            assert policy_bytes >= 15 * PUSH_BUCKET and len(buckets.plan) >= 15 and stats["bytes"] == policy_bytes
            limit = 2 * PUSH_BUCKET if version == 1 else PUSH_BUCKET  # (v1 allocates the buffer: one bucket)
            assert all(e < limit for e in extra.values()), (version, extra)
            state = engine.state()
            assert state["version"] == version and state["ptrs"] == ptrs
            assert all(torch.equal(state["weights"][n], p) for n, p in trainer.named_parameters())
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
    finally:
        engine.close()
    assert issubclass(weight_sync.SyncError, __import__("errors").PeerGone)  # (an errors.py kind, exit 4)


def test_sft_loss_is_the_cross_entropy_of_the_answer_bytes_only_and_ranks_split_it_exactly(tmp_path, capsys):
    """rl/sft_task.py (GRPO's warm start): the batch is the problems GRPO's prompts(step) draws, and its
    loss equals F.cross_entropy over the answer positions only, sliced by hand from the unpadded
    `ab+cd=` + the sum computed here + newline (the prompt bytes and padding carry no loss). Two
    ranks' slices: their losses average to the one-process loss, and so do their gradients. Bad
    input: one `error:` line, exit 2, nothing written."""
    from rl import arithmetic
    import train
    tiny = [x for kv in ("dim=32", "n_layers=2", "n_heads=4", "n_kv_heads=2", "ffn_dim=64", "max_seq_len=16")
            for x in ("--set", kv)]
    cfg = train.parse_config(["--task", "sft", *tiny, "--batch-size", "6", "--seed", "3"])
    one = train.make_workload(cfg)
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
        t = train.make_workload(cfg)
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


# GRPO as a workload of the trainer (rl/grpo_task.py): a tiny supervised warm start on solved problems
# (train.py --task sft, rl/sft_task.py), then 4 GRPO steps, two per rollout batch. Oracles: the eager
# single process (for graph mode and 2 SimpleFSDP ranks), the straight run (for resume).
GRPO_WARM = ["--set", "dim=32", "--set", "n_layers=2", "--set", "n_heads=4", "--set", "n_kv_heads=2",
             "--set", "ffn_dim=64", "--set", "max_seq_len=32", "--batch-size", "16",
             "--lr", "1e-2", "--warmup", "5", "--eval-interval", "0", "--log-interval", "20"]


@pytest.fixture(scope="session")
def grpo_warm(tmp_path_factory):
    """A run directory of 40 supervised steps on the answers of solved problems: digits and newlines,
    rarely right (with --format-credit its groups' rewards differ, so the GRPO gradient is not zero).
    Its held-out accuracy is recorded at steps 0 and 40. (rl/arithmetic.py's text writer checked here too.)"""
    from rl import arithmetic
    root = tmp_path_factory.mktemp("grpo_warm")
    assert arithmetic.main(["write", str(root / "arith.txt"), "--problems", "2000"]) == 0
    text = (root / "arith.txt").read_bytes()
    assert text.count(b"\n") == 2000 and not list(root.glob("*.tmp*"))
    assert _main(["--task", "sft", *GRPO_WARM, "--steps", "40", "--out-dir", str(root / "warm")]) == 0
    assert sorted(_records(str(root / "warm"), "held_out_accuracy")) == [0, 40]
    return str(root / "warm")


def test_a_policy_run_samples_and_exports_ending_at_its_newline(grpo_warm, tmp_path, capsys):
    """An SFT run records the token its answers end with (the workload's eos_id: a newline), so that
    generate.py --run stops after it, and python -m interop.hf export writes it as config.json's eos_token_id, which
    generate.py --hf and transformers' generate() stop at. Oracles: our greedy ids with no end token,
    cut after their first newline; transformers' greedy generate() on the export. Before, a sample ran
    on past its answer to --max-new-tokens, and an export named no end token."""
    from run import checkpoint
    import generate
    from interop import hf
    from transformers import AutoModelForCausalLM
    model, meta = checkpoint.load_run(grpo_warm)
    assert meta["eos_id"] == ord("\n"), meta.get("eos_id")
    prompt, n = "12+34=", 24
    ids = generate.generate(model, list(prompt.encode()), n)  # (greedy, no end token)
    assert ord("\n") in ids, ids  # (the warm start writes digits and newlines)
    answer = ids[:ids.index(ord("\n")) + 1]
    want = prompt + bytes(answer).decode("utf-8", errors="replace") + "\n"  # (print's own newline after it)
    sample = [prompt, "--max-new-tokens", str(n), "--temperature", "0"]
    out = str(tmp_path / "export")
    capsys.readouterr()
    assert generate.main(["--run", grpo_warm, *sample]) == 0
    assert capsys.readouterr().out == want
    assert hf.main(["export", grpo_warm, out]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == ord("\n")
    capsys.readouterr()
    assert generate.main(["--hf", out, *sample]) == 0
    assert capsys.readouterr().out == want
    theirs = AutoModelForCausalLM.from_pretrained(out)
    got = theirs.generate(torch.tensor([list(prompt.encode())]), max_new_tokens=n, do_sample=False,
                          pad_token_id=ord("\n"))[0, len(prompt):].tolist()
    assert got == answer, (got, answer)


def _grpo_args(warm, out_dir, *extra):
    return ["--task", "grpo", "--init-from", warm, "--steps", "4", "--updates-per-batch", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--format-credit", "0.1", "--kl-beta", "0.05", "--lr", "1e-3",
            "--warmup", "0", "--eval-interval", "0", "--log-interval", "1", "--ckpt-interval", "0",
            "--out-dir", out_dir, *extra]


def _grpo_weights(run_dir):
    from run import checkpoint
    return checkpoint.load_run(run_dir)[0].state_dict()


# Where each layout's run must say it ran (its start record's device, devices): SFT's and GRPO's tests alike.
_RAN_ON = {"graph": ("cpu", 1), "fsdp": ("cpu", 2), "fsdp2": ("cpu", 2), "spmd": ("xla:0", 2)}


def _xla_spmd_run(argv, devices=2):
    """train.py on XLA SPMD over `devices` XLA:CPU devices (`--mesh ici=N`), in a process of its own,
    started in the background."""
    return launch.Child(["train.py", *argv, "--device", "xla", "--mesh", f"ici={devices}"],
                        env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)})


def policy_layouts_equal_one_process(args, tmp_path, accumulate=False):
    """`args(out_dir)`'s run in graph mode (and with --grad-accum 2 where `accumulate`), on SimpleFSDP and
    FSDP2 (2 torchrun ranks) and on XLA SPMD (2 devices, eager) equals one eager process: losses,
    gradient norms, final weights (XLA to 1e-4: its own kernels)."""
    runs = {name: str(tmp_path / name) for name in ("one", "graph", "accum", "fsdp", "fsdp2", "spmd")}
    spmd = _xla_spmd_run(args(runs["spmd"]))  # (it runs while this process trains)
    assert _main(args(runs["one"])) == 0
    assert _main([*args(runs["graph"]), "--mode", "graph"]) == 0
    if accumulate:
        assert _main([*args(runs["accum"]), "--grad-accum", "2"]) == 0
    for name, extra in (("fsdp", []), ("fsdp2", ["--dp-impl", "fsdp2"])):
        rc, _, err = torchrun(2, [*args(runs[name]), "--mesh", "ici=2", *extra])
        assert rc == 0, err[-3000:]
    rc, _, err = spmd.result(timeout=600)
    assert rc == 0, err[-3000:]
    for name, tol in (("graph", 1e-5), ("accum", 1e-5), ("fsdp", 1e-5), ("fsdp2", 1e-5), ("spmd", 1e-4)):
        if name == "accum" and not accumulate:
            continue
        assert name == "accum" or ran_on(runs[name]) == _RAN_ON[name], name
        for key in ("loss", "grad_norm"):
            _near(_records(runs["one"], key), _records(runs[name], key), atol=tol / 10, rtol=tol)
        mine = _grpo_weights(runs[name])
        for k, w in _grpo_weights(runs["one"]).items():
            assert_close(mine[k], w, f"{name} {k}", rtol=tol, atol=1e-5)


def test_sft_on_every_layout_equals_one_process(tmp_path):
    """The warm start's loss (a 0-d token normalizer in its batch) on every layout equals one eager
    process (policy_layouts_equal_one_process). (One XLA device: not run here, to keep the suite's time;
    the SPMD run is the same eager step on XLA, plus the mesh.)"""
    policy_layouts_equal_one_process(lambda out: ["--task", "sft", *GRPO_WARM, "--steps", "3", "--log-interval", "1",
                                                  "--eval-batches", "0", "--ckpt-interval", "0", "--out-dir", out], tmp_path)


def test_grpo_through_the_trainer_on_every_layout_and_resume_equal_one_eager_process(grpo_warm, tmp_path):
    """The trainer path end to end: rollouts from the engine process every second step (policy version
    = optimizer steps in the synced weights), reward per step and held-out accuracy at the first and
    last evaluation in metrics.jsonl and the plot, completions in the log. Graph mode, 2 torchrun
    ranks (SimpleFSDP and FSDP2, each its own rows, one engine) and XLA SPMD on 2 XLA:CPU devices (eager,
    to 1e-4: XLA's kernels) equal the eager process on the same global
    batches (k3 KL to the warm start on: each rank scores its own rows against the reference): losses,
    pre-clip gradient norms, rewards, final weights. (One XLA device: not run here, to keep the suite's
    time; the SPMD run is the same eager step on XLA, plus the mesh.) Halted at step 2
    and resumed equals the straight run bit for bit."""
    runs = {name: str(tmp_path / name) for name in ("eager", "graph", "fsdp", "fsdp2", "spmd", "part")}
    spmd = _xla_spmd_run(_grpo_args(grpo_warm, runs["spmd"], "--no-plot"))  # (it runs while this process trains)
    assert _main(_grpo_args(grpo_warm, runs["eager"])) == 0
    assert _main(_grpo_args(grpo_warm, runs["graph"], "--mode", "graph")) == 0
    for name, extra in (("fsdp", []), ("fsdp2", ["--dp-impl", "fsdp2"])):
        rc, _, err = torchrun(2, _grpo_args(grpo_warm, runs[name], "--mesh", "ici=2", "--no-plot", *extra))
        assert rc == 0, err[-3000:]
    rc, _, err = spmd.result(timeout=600)
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
    for name in ("graph", "fsdp", "fsdp2", "spmd"):
        assert ran_on(runs[name]) == _RAN_ON[name], name
        tol = 1e-4 if name == "spmd" else 1e-5  # (XLA's own kernels)
        for key in ("loss", "grad_norm", "reward"):
            _near(_records(oracle, key), _records(runs[name], key), atol=tol / 10, rtol=tol)
        mine = _grpo_weights(runs[name])
        for k, w in _grpo_weights(oracle).items():
            assert_close(mine[k], w, f"{name} {k}", rtol=tol, atol=1e-5)
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
    proc = launch.Child(["train.py", *_grpo_args(grpo_warm, run, "--steps", "400")])
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(os.path.join(run, "metrics.jsonl")) and _records(run, "reward")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
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
        rc, _, err = proc.result(timeout=60)
    finally:
        proc.close()
    assert rc == 4, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rollout engine process died (exit code -9)" in lines[0] and "at step" in lines[0], err


def test_grpo_init_from_a_hf_directory_of_nan_weights_stops_before_training_naming_them(tmp_path, capsys):
    """--task grpo --init-from a HF directory whose weights hold a NaN: one line naming the tensor, exit 2,
    nothing written (not a NaN held-out evaluation, a trained step and exit 3)."""
    import shutil
    from safetensors.torch import load_file, save_file
    d = tmp_path / "llama_nan"
    shutil.copytree(os.path.join(HERE, "fixtures", "hf", "llama"), d)
    weights = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    weights[key][2, 3] = float("inf")
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    out = str(tmp_path / "run")
    rc = _main(["--task", "grpo", "--init-from", str(d), "--steps", "2", "--prompts-per-step", "2",
                "--group-size", "2", "--out-dir", out])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and key in err and "non-finite" in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out)


def test_grpo_resume_keeps_its_warm_start_checkpoint_and_offers_only_accepted_changes(grpo_warm, tmp_path, capsys):
    """A GRPO run records the warm-start checkpoint it started from (path and a checksum of its meta.json,
    which holds every file's sha256). Resumed after the warm-start run gained a newer checkpoint, it
    takes the recorded one again (its KL reference; it used to take the newest silently); if that one
    is gone, one line, exit 2. A changed --temperature names `temperature` and offers
    --allow-change temperature, which run/cli.py accepts and the resume then takes (it used to offer
    `grpo`, refused as unknown); --updates-per-batch cannot change on a resume (not offered)."""
    import shutil
    from run import checkpoint
    import train
    from tests.common import _files
    warm = str(tmp_path / "warm")
    shutil.copytree(grpo_warm, warm)
    out = str(tmp_path / "grpo")
    args = _grpo_args(warm, out, "--ckpt-interval", "2")
    assert _main([*args, "--halt-at", "2"]) == 0
    started, meta = checkpoint.run_checkpoint(warm)
    want = checkpoint.load_run(started)[0].state_dict()
    # the warm-start run gains a newer checkpoint (other weights), which --init-from RUN now resolves to
    newer = {k: v + 0.01 for k, v in want.items()}
    checkpoint.save(os.path.join(warm, "checkpoints"), 50, {"model": newer},
                    {k: v for k, v in meta.items() if k not in ("files", "step")})
    assert checkpoint.run_checkpoint(warm)[0].endswith("step_000050")
    capsys.readouterr()

    trainer = train.Trainer(train.parse_config([*args, "--resume"]))
    assert trainer.step == 2 and trainer.meta["train"]["init_from"].startswith(os.path.abspath(started) + " sha256:")
    for name, w in trainer.task._reference().state_dict().items():  # the KL reference: the warm start it began from
        assert torch.equal(w, want[name]), name

    before = _files(out)
    for extra, needles in ((["--temperature", "0.7"], ["temperature: saved 1.0, now 0.7", "--allow-change temperature"]),
                           (["--updates-per-batch", "1"], ["updates_per_batch: saved 2, now 1", "cannot change"])):
        assert _main([*args, "--resume", *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and len(err.splitlines()) == 1 and all(n in err for n in needles), err
        assert ("--allow-change" in err) == (extra[0] == "--temperature"), err
    trainer = train.Trainer(train.parse_config([*args, "--resume", "--temperature", "0.7", "--allow-change", "temperature"]))
    assert trainer.step == 2 and trainer.task.algo.temperature == 0.7
    os.rename(started, started + ".moved")  # the recorded warm start is gone: refused, not replaced by step_50
    assert _main([*args, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --init-from") and f"started from {os.path.abspath(started)}, which is gone" in err, err
    assert len(err.splitlines()) == 1 and _files(out) == before


@pytest.mark.parametrize("how", ["SIGINT", "trainer gone"])
def test_the_engine_process_ends_without_a_word_on_ctrl_c_or_when_its_trainer_is_gone(how, capfd, ctrl_c_as_in_a_terminal):
    """Ctrl-C reaches the whole process group: the trainer says it in one line (exit 130), the engine
    process ends by the signal, without a traceback; a trainer that is gone (SIGKILLed: its end of
    the pipe closed) leaves an engine that ends without an EOFError traceback. (The engine process
    writes to this process's stderr, which capfd captures at the file descriptor.)"""
    import signal
    from rl import rollout
    engine = rollout.EngineProcess(GRPO_TINY, timeout_s=60)
    try:
        if how == "SIGINT":
            os.kill(engine.proc.pid, signal.SIGINT)
        else:
            engine.sock.close()  # what the engine sees of a SIGKILLed trainer
        engine.proc.join(60)
        assert engine.proc.exitcode == (-signal.SIGINT if how == "SIGINT" else 0), engine.proc.exitcode
    finally:
        engine._kill()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err


def test_ctrl_c_ends_the_engine_at_once_while_it_waits_in_the_gloo_handshake(monkeypatch, ctrl_c_as_in_a_terminal):
    """Ctrl-C reaching the engine while it waits in gloo's handshake for the trainer (a C++ call, which
    a Python SIGINT handler waits out: to the handshake's timeout if the trainer never joins) ends it
    within 5 s, by the signal; the trainer then reports an engine that did not join, in one line.
    Fails where the engine takes Ctrl-C as a KeyboardInterrupt (measured: alive 10 s after it)."""
    import signal
    import time
    from rl import rollout
    from rl.engine import EngineError
    spawned, ended, spawn = [], {}, rollout.EngineProcess._spawn

    def recording_spawn(self, child_sock):
        spawn(self, child_sock)
        spawned.append(self.proc)

    def trainer_late(rank, timeout_s, store=None, port=None):  # (the trainer's join: the engine's is under way)
        engine = spawned[-1]
        time.sleep(2)  # (the engine sent "built" and called its join: it waits for this side's)
        start = time.monotonic()
        os.kill(engine.pid, signal.SIGINT)
        engine.join(10)
        ended.update(code=engine.exitcode, seconds=time.monotonic() - start)
        raise RuntimeError("the trainer did not join")
    monkeypatch.setattr(rollout.EngineProcess, "_spawn", recording_spawn)
    monkeypatch.setattr(rollout.weight_sync, "join", trainer_late)
    with pytest.raises(EngineError, match="did not join the sync group: the trainer did not join"):
        rollout.EngineProcess(GRPO_TINY, timeout_s=30)
    assert ended["code"] == -signal.SIGINT and ended["seconds"] < 5, ended


def test_a_warm_start_halts_at_its_first_evaluation_meeting_the_accuracy_and_grpo_takes_that_checkpoint(
        tmp_path, monkeypatch, capsys):
    """--halt-at-accuracy A: the run ends (exit 0) at its first evaluation after step 0 whose held-out
    accuracy is >= A, saving that checkpoint, whatever --ckpt-interval says; --init-from RUN (GRPO)
    then starts from exactly it, and its meta.json records it. The held-out accuracies are scripted
    here (the task's evaluation replaced: no engine, and the criterion is the thing tested): 0.9 at
    step 0 (not a checkpoint: ignored), 0.2, 0.4 below, 0.5 meets 0.5 at step 6, 0.8 after it is never
    reached. Bad values and tasks without a held-out accuracy: one line, exit 2."""
    from run import checkpoint
    from rl import sft_task
    import train
    scripted = {0: 0.9, 2: 0.2, 4: 0.4, 6: 0.5, 8: 0.8}
    monkeypatch.setattr(sft_task.SFTArithmetic, "evaluate",
                        lambda self, model, step, log: {"held_out_accuracy": scripted[step]})
    out = str(tmp_path / "sft")
    warm = ["--task", "sft", *GRPO_WARM, "--steps", "20", "--eval-interval", "2", "--log-interval", "1"]
    assert _main([*warm, "--halt-at-accuracy", "0.5", "--out-dir", out]) == 0
    log = capsys.readouterr().out
    assert "held-out accuracy 0.5000 >= --halt-at-accuracy 0.5: halted, checkpoint step_000006 saved" in log, log
    assert sorted(_records(out, "held_out_accuracy")) == [0, 2, 4, 6] and max(_records(out, "loss")) == 6
    assert _records(out, "accuracy") == {6: 0.5}  # the "halted" record
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000006"]
    task = train.make_workload(train.parse_config(["--task", "grpo", "--init-from", out, "--steps", "2"]))
    step6 = os.path.abspath(os.path.join(out, "checkpoints", "step_000006"))
    assert task.warm_record.startswith(step6 + " sha256:")
    assert all(torch.equal(w, v) for w, v in zip(task.warm.state_dict().values(),
                                                  checkpoint.load_run(step6)[0].state_dict().values()))
    for extra, msg in ((["--halt-at-accuracy", "1.5"], "--halt-at-accuracy 1.5: a held-out accuracy in (0, 1]"),
                       (["--halt-at-accuracy", "nan"], "--halt-at-accuracy: 'nan' is not a finite number"),
                       (["--task", "lm", "--halt-at-accuracy", "0.5"], "is a flag of --task sft, grpo, dpo, not of --task lm")):
        bad = str(tmp_path / "bad")
        assert _main([*warm, *extra, "--out-dir", bad]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1 and not os.path.exists(bad), err
