# rl/vllm_engine.py + rl/vllm_server.py (--engine vllm: vLLM in the torch 2.13 environment, .venv-tpu).
# Oracles: our policy's own forward (grpo.completion_logprobs: the logprobs vLLM must return), our
# in-process engine's greedy decode (rollout.Engine), the weights saved by the trainer, /proc (no
# process left behind).
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from model import ModelArgs, Transformer

from tests.common import HERE, _main, _records

# head_dim 32 (vLLM's CPU attention needs >= 32); Qwen3-style (q/k norms, tied embeddings) here,
# Llama-style (untied) in the trainer's runs below: both of vLLM's model classes we feed
VLLM_QWEN = ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=96, max_seq_len=16,
                      qk_norm=True, tie_embeddings=True)
VLLM_POLICY = ["--set", "dim=64", "--set", "n_layers=2", "--set", "n_heads=2", "--set", "n_kv_heads=1",
               "--set", "ffn_dim=96", "--set", "max_seq_len=16"]


def _engine_pids():
    """The pids of running vLLM engine processes (rl.vllm_server), anyone's."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"rl.vllm_server" in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            pids.append(int(pid))
        except OSError:
            continue
    return pids


def _policy(args, seed):
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():  # (init_weights leaves the norms at 1: move them so that a wrong norm shows)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_vllm_engine_logprobs_and_greedy_equal_our_policy_after_each_push_and_failures_are_one_line():
    """One vLLM engine process (its own torch 2.13 interpreter): before any push it refuses to sample;
    after a push of a tied Qwen3-style policy its sampling logprobs (T = 0.8) equal our policy's forward
    to 1e-4 and a seed reproduces a rollout, no two rows sharing a random stream (two copies of one
    prompt: all rows differ); after a second push (version 1, same prompts: the prefix cache must not
    serve the old weights' KV) the logprobs equal the new policy's and greedy completions equal our
    own engine's; a push of another architecture is refused in one line and changes nothing. Stalled
    (SIGSTOP), then killed: one line each; nothing left running, and its caches and log removed."""
    from rl import arithmetic, grpo, rollout, vllm_engine
    engine = vllm_engine.VLLMEngineProcess(VLLM_QWEN, timeout_s=300)
    try:
        assert engine.info["vllm"] == "0.32.0"
        prompts = arithmetic.get_task("arith").prompts(3, 6)
        with pytest.raises(rollout.EngineError, match="^vLLM engine failed during generate: RuntimeError: no weights"):
            engine.generate(prompts, 2, 4)
        for version in (0, 1):
            policy = _policy(VLLM_QWEN, seed=version)
            stats = engine.sync(policy.named_parameters(), version)
            assert stats["version"] == version and stats["bytes"] > 4 * sum(p.numel() for p in policy.parameters())
            ro = engine.generate(prompts, 3, 5, temperature=0.8, seed=7, eos_id=10)
            assert ro.version == version and ro.completions_BxC.shape == (18, 5)
            tokens = torch.cat([ro.prompts_BxP, ro.completions_BxC], 1)
            with torch.no_grad():
                want = grpo.completion_logprobs(policy, tokens, ro.prompts_BxP.shape[1], 0.8)
            err = ((want - ro.logprobs_BxC).abs() * ro.mask_BxC).max().item()
            assert err < 1e-4, (version, err)
            assert ro.mask_BxC[:, 0].all()
            after_eos = torch.cumsum((ro.completions_BxC == 10).int(), 1) - (ro.completions_BxC == 10).int() > 0
            assert not (ro.mask_BxC & after_eos).any() and (ro.mask_BxC | after_eos).all()
            again = engine.generate(prompts, 3, 5, temperature=0.8, seed=7, eos_id=10)
            assert torch.equal(again.completions_BxC, ro.completions_BxC)
        twins = engine.generate([prompts[0]] * 2, 4, 5, temperature=1.0, seed=7)
        assert len({tuple(r) for r in twins.completions_BxC.tolist()}) == 8
        ours = rollout.Engine(policy)
        greedy = engine.generate(arithmetic.get_task("arith").test_set()[:64], 1, 4, temperature=0.0, eos_id=10)
        mine = ours.generate(arithmetic.get_task("arith").test_set()[:64], 1, 4, temperature=0.0, eos_id=10)
        assert torch.equal(greedy.completions_BxC * greedy.mask_BxC, mine.completions_BxC * mine.mask_BxC)
        assert greedy.version == 1

        other = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128,
                                      max_seq_len=16, qk_norm=True, tie_embeddings=True))
        with pytest.raises(rollout.EngineError) as e:
            engine.sync(other.named_parameters(), 2)
        line = str(e.value)
        assert "not this engine's architecture" in line and "mlp.down_proj.weight (64, 128) != (64, 96)" in line, line
        assert "nothing was loaded" in line and "\n" not in line
        same = engine.generate(arithmetic.get_task("arith").test_set()[:64], 1, 4, temperature=0.0, eos_id=10)
        assert same.version == 1 and torch.equal(same.completions_BxC, greedy.completions_BxC)

        engine.timeout_s = 2.0
        os.kill(engine.proc.pid, signal.SIGSTOP)
        with pytest.raises(rollout.EngineError, match=r"^vLLM engine stalled: no reply to generate within 2 s$"):
            engine.generate(prompts, 2, 4)
        assert engine.proc.returncode == -9  # (killed by the handle, reaped)
        with pytest.raises(rollout.EngineError, match=r"^vLLM engine process died \(exit code -9\) during push"):
            engine.sync(policy.named_parameters(), 3)
    finally:
        engine.close()
    assert engine.proc.pid not in _engine_pids() and not os.path.exists(engine.cache_dir)


def test_vllm_engine_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys):
    """--engine vllm with no vLLM environment at --vllm-python, a policy whose heads vLLM's CPU attention
    refuses (head_dim 16), --vllm-python without --engine vllm: one `error:` line, exit 2, nothing written."""
    out = str(tmp_path / "run")
    base = ["--task", "grpo", *VLLM_POLICY, "--steps", "2", "--out-dir", out]
    for extra, msg in ((["--engine", "vllm", "--vllm-python", str(tmp_path / "nope")], "no vLLM environment at"),
                       (["--engine", "vllm", "--set", "n_heads=4"], "head_dim 16 < 32"),
                       (["--vllm-python", sys.executable], "--vllm-python is for --engine vllm")):
        assert _main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1, (extra, err)
        assert not os.path.exists(out)


@pytest.fixture(scope="session")
def vllm_warm(tmp_path_factory):
    """A warm start of the vLLM-shaped policy (head_dim 32): 30 supervised steps."""
    out = str(tmp_path_factory.mktemp("vllm_warm") / "warm")
    assert _main(["--task", "sft", *VLLM_POLICY, "--batch-size", "16", "--lr", "1e-2", "--warmup", "5",
                  "--steps", "30", "--eval-interval", "0", "--log-interval", "10", "--out-dir", out]) == 0
    return out


def _vllm_grpo(warm, out, *extra):
    return ["--task", "grpo", "--engine", "vllm", "--init-from", warm, "--steps", "4", "--updates-per-batch", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--format-credit", "0.1", "--lr", "1e-3", "--warmup", "0",
            "--eval-interval", "4", "--log-interval", "1", "--ckpt-interval", "0", "--engine-timeout", "300", "--no-plot",
            "--out-dir", out, *extra]


def test_grpo_through_vllm_trains_and_its_greedy_evaluation_equals_our_engine_on_the_saved_weights(vllm_warm, tmp_path):
    """`--task grpo --engine vllm` through the trainer: rollouts from the vLLM process every second step
    with the policy version of the pushed weights, rewards and gradients logged, and the held-out
    completions it shows at steps 0 and 4 equal our own engine's greedy decode of the warm start's
    and the final saved weights (so each push reached vLLM whole); the engine is gone at the end."""
    import checkpoint
    from rl import arithmetic, rollout
    out = str(tmp_path / "run")
    assert _main(_vllm_grpo(vllm_warm, out)) == 0
    assert _records(out, "policy_version") == {1: 0, 2: 0, 3: 2, 4: 2}
    assert len(_records(out, "reward")) == 4 and all(v > 0 for v in _records(out, "sync_mib").values())
    with open(os.path.join(out, "metrics.jsonl")) as f:
        shown = {r["step"]: r["text"] for r in map(json.loads, f) if r.get("event") == "completions"}
    assert sorted(shown) == [0, 4]
    test = arithmetic.get_task("arith").test_set()[:4]
    for step, run in ((0, vllm_warm), (4, out)):
        ours = rollout.Engine(checkpoint.load_run(run)[0])
        comp = ours.generate(test, 1, 4, temperature=0.0, eos_id=10).completions_BxC.tolist()
        want = [bytes(p).decode() + repr(bytes(c).split(b"\n")[0].decode("utf-8", "replace")) for p, c in zip(test, comp)]
        assert shown[step] == want, (step, shown[step], want)
    assert not _engine_pids()


def test_grpo_through_vllm_a_killed_engine_is_exit_4_and_ctrl_c_exit_130_leaving_no_process(vllm_warm, tmp_path,
                                                                                            ctrl_c_as_in_a_terminal):
    """The vLLM engine SIGKILLed mid-run: one line naming it, exit 4. Ctrl-C (SIGINT to the whole process
    group, as a terminal sends it): exit 130. The trainer SIGKILLed (nothing of it runs to clean up): the
    engine dies with it (PR_SET_PDEATHSIG). In each case no engine process is left. The three runs start
    together (each pays ~40 s of vLLM start, mostly imports on one core); a trainer that has logged a
    reward is stopped (SIGSTOP) until all three have, so that none trains while the others start."""
    hows = ("engine killed", "Ctrl-C", "trainer killed")
    runs = {how: str(tmp_path / how.replace(" ", "_")) for how in hows}
    procs = {how: subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"),
                                    *_vllm_grpo(vllm_warm, runs[how], "--steps", "400", "--eval-interval", "0")],
                                   cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True) for how in hows}
    errs, engines = {}, {}
    try:
        deadline = time.monotonic() + 420
        while len(engines) < len(hows):
            for how, proc in procs.items():
                run = runs[how]
                if how not in engines and os.path.exists(os.path.join(run, "metrics.jsonl")) and _records(run, "reward"):
                    os.kill(proc.pid, signal.SIGSTOP)
                    engines[how] = [p for p in _engine_pids() if _parent(p) == proc.pid]
                    assert len(engines[how]) == 1, (how, engines[how])
                assert proc.poll() is None and time.monotonic() < deadline, (how, proc.communicate())
            time.sleep(0.2)
        for how, proc in procs.items():
            if how == "engine killed":
                os.kill(engines[how][0], signal.SIGKILL)
                os.kill(proc.pid, signal.SIGCONT)
            elif how == "Ctrl-C":
                os.kill(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.kill()
        for how, proc in procs.items():
            errs[how] = proc.communicate(timeout=120)[1]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    lines = [line for line in errs["engine killed"].splitlines() if line.startswith("error:")]
    assert procs["engine killed"].returncode == 4, errs["engine killed"][-2000:]
    assert len(lines) == 1 and "vLLM engine process died (exit code -9)" in lines[0], errs["engine killed"][-2000:]
    assert procs["Ctrl-C"].returncode == 130, errs["Ctrl-C"][-2000:]
    assert procs["trainer killed"].returncode == -9
    left = lambda: {pid for how in hows for pid in engines[how]} & set(_engine_pids())
    deadline = time.monotonic() + 10  # (the kernel delivers the engine's SIGKILL as the trainer exits)
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left()


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
