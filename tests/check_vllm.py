# rl/vllm_engine.py + rl/vllm_server.py (--engine vllm: vLLM in the torch 2.13 environment, .venv-tpu).
# Oracles: our policy's own forward (grpo.completion_logprobs: the logprobs vLLM must return), our
# in-process engine's greedy decode (rollout.Engine), the weights saved by the trainer, /proc (no
# process left behind).
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import os
import shutil
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
    """The pids of running vLLM engine processes (rl.vllm_server) started under this pytest worker of this
    run (its PYTEST_XDIST_WORKER and _TESTRUNUID are in their environment, inherited through any trainer
    between): another worker's or another run's engines are theirs to check."""
    mine = [f"{k}={os.environ[k]}\0".encode() for k in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID")
            if k in os.environ]
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"rl.vllm_server" not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
                if not all(m in environ for m in mine):
                    continue
            with open(f"/proc/{pid}/stat") as s:
                if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def _described(pids):
    """What a failed no-process-left check prints of each pid: state, parent, group, age, command line."""
    ticks, uptime = os.sysconf("SC_CLK_TCK"), float(open("/proc/uptime").read().split()[0])
    out = []
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:200]
            out.append(f"pid {pid} state {fields[0]} ppid {fields[1]} pgid {fields[2]} "
                       f"age {uptime - int(fields[19]) / ticks:.1f}s: {cmd}")
        except OSError:
            out.append(f"pid {pid} (gone since)")
    return "; ".join(out)


def _left_after(processes, grace_s=10.0):
    """The processes `processes()` still lists after up to grace_s: a killed group's members other than
    the reaped leader (vLLM's forked helpers, whose command line is the engine's) go a moment after the
    kill, longer on a loaded machine (a check made at once failed under load; none was left 10 s on)."""
    deadline = time.monotonic() + grace_s
    while processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes()


@pytest.fixture(autouse=True)
def no_engine_left_by_this_test(request):
    """After each of this file's tests, no vLLM engine that started during it is still running (checked
    for each test, so that a leak is named by the test that made it, with what the process is)."""
    if request.node.function.__module__ != __name__:  # (autouse reaches test_all's every test: only ours)
        yield
        return
    before = set(_engine_pids())
    yield
    left = _left_after(lambda: [p for p in _engine_pids() if p not in before])
    assert not left, f"vLLM engine processes left by {request.node.name}: {_described(left)}"


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
    (SIGSTOP), then killed: one line each; nothing left running, and its run's files, its log and vLLM's own temporary files removed."""
    import glob
    import tempfile
    from rl import arithmetic, grpo, rollout, vllm_engine
    left_in_tmp = lambda: set(glob.glob(os.path.join(tempfile.gettempdir(), "vllm_dist_*")))  # (vLLM's own files)
    before = left_in_tmp()
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
    assert engine.proc.pid not in _engine_pids() and not os.path.exists(engine.tmp_dir) and left_in_tmp() <= before


# Llama-style (untied, no q/k norms), 4.1 M parameters: 15.5x the push's 1 MiB bucket; max_seq_len 160 for
# prompts longer than one of vLLM's KV blocks (128 tokens on CPU), the length from which its prefix cache
# serves a prompt's KV again
VLLM_LONG = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, ffn_dim=1024, max_seq_len=160)


def test_vllm_push_streams_buckets_in_place_resets_the_prefix_cache_and_a_stall_is_one_line():
    """One vLLM engine, one policy 15.5x the push's bucket (rl/weight_sync.Buckets over the socket, vLLM's
    reload_weights per bucket; q/k/v and gate/up split over buckets wait for their fused module):
    - after the push of version 0 and of version 1 (other weights), the logprobs of the same 130-token
      prompts equal that version's own forward to 1e-4: every bucket reached vLLM whole, and the prefix
      cache did not serve version 0's KV to version 1 (without reset_prefix_cache: off by ~1);
    - the peak resident memory a push adds (/proc VmHWM) is about one bucket in the trainer; in the
      engine, less than 2 policies at the first push (whole-policy staging, the design before, added
      the bytes received and the tensors loaded from them, plus vLLM's first reload), half a policy later;
    - the engine stopped (SIGSTOP) before a push: "stalled" within the timeout, not a blocking write;
      afterwards no process of the engine's group is left."""
    from rl import grpo, vllm_engine
    from rl.engine import EngineError
    from tests.common import peak_extra_rss

    def hang(*_):
        raise TimeoutError("the push blocked past the engine timeout")
    previous = signal.signal(signal.SIGALRM, hang)
    engine = vllm_engine.VLLMEngineProcess(VLLM_LONG, timeout_s=300, bucket_bytes=1 << 20)
    pid = engine.proc.pid
    try:
        prompts = torch.randint(0, 256, (3, 130), generator=torch.Generator().manual_seed(0)).tolist()
        for version in (0, 1):
            policy = _policy(VLLM_LONG, seed=version)
            policy_bytes = 4 * sum(p.numel() for p in policy.parameters())
            stats, extra = peak_extra_rss((os.getpid(), pid), lambda: engine.sync(policy.named_parameters(), version))
            print(f"\nvLLM push v{version}: {len(engine.buckets.plan)} buckets of <= 1 MiB, policy "
                  f"{policy_bytes / 2**20:.1f} MiB, {stats['seconds']:.2f} s; peak extra resident memory: trainer "
                  f"{extra[os.getpid()] / 2**20:.2f} MiB, engine {extra[pid] / 2**20:.2f} MiB")
            assert len(engine.buckets.plan) >= 15 and policy_bytes < stats["bytes"] < policy_bytes + 2**16
            # (the engine's first push also pays vLLM's first reload, code and allocator: 11-15 MiB measured;
            # the second 0.0-4 MiB, as the allocator settles)
            assert extra[os.getpid()] < 2 << 20 and extra[pid] < policy_bytes * (2 if version == 0 else 0.5), extra
            ro = engine.generate(prompts, 2, 4, temperature=0.8, seed=3)
            assert ro.version == version and ro.mask_BxC.all()
            with torch.no_grad():
                want = grpo.completion_logprobs(policy, torch.cat([ro.prompts_BxP, ro.completions_BxC], 1), 130, 0.8)
            err = (want - ro.logprobs_BxC).abs().max().item()
            assert err < 1e-4, (version, err)

        engine.timeout_s = 2.0
        os.kill(pid, signal.SIGSTOP)
        signal.alarm(60)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=r"^vLLM engine stalled: no reply to push within 2 s$"):
            engine.sync(policy.named_parameters(), 2)
        signal.alarm(0)
        assert time.monotonic() - t0 < 15 and engine.proc.returncode == -9
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        engine.close()
    assert not _left_after(lambda: _group(pid)) and not os.path.exists(engine.tmp_dir)


def test_vllm_engine_interrupted_during_its_start_leaves_no_process_of_its_group(ctrl_c_as_in_a_terminal, tmp_path):
    """Ctrl-C while vLLM starts (its model registry's subprocess running, ~15 s in: a first start, with
    an empty cache root): the handle kills the engine's whole process group before the KeyboardInterrupt
    goes on, and nothing of it comes back (no process; its cache root, removed here, not recreated, as
    an orphan did; its run's files removed). A timeout during the start takes the same path."""
    import threading
    from rl import vllm_engine
    seen, cold = {}, str(tmp_path / "cold-cache")

    def interrupt_when_vllm_has_a_helper():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            mine = [p for p in _engine_pids() if _parent(p) == os.getpid()]
            helpers = [c for p in mine for c in _children(p)]
            if helpers:
                with open(f"/proc/{mine[0]}/cmdline", "rb") as f:  # (... rl.vllm_server FD PARENT RUN_FOLDER)
                    run = f.read().split(b"\0")[5].decode()
                seen.update(engine=mine[0], helpers=helpers, cache=_cache_dir_of(mine[0]), run=run)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)
    watcher = threading.Thread(target=interrupt_when_vllm_has_a_helper, daemon=True)
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        vllm_engine.VLLMEngineProcess(VLLM_QWEN, timeout_s=300, cache_root=cold)
    watcher.join()
    assert seen, "vLLM started no helper process"
    assert seen["cache"] == cold and not os.path.exists(seen["run"]), seen
    shutil.rmtree(cold, ignore_errors=True)
    time.sleep(2)  # (what an orphan would do meanwhile: recreate the cache directory)
    assert _parent(seen["engine"]) is None and not _left_after(lambda: _group(seen["engine"])), "the engine outlived its start"
    assert not any(_parent(p) for p in seen["helpers"]), "vLLM's helper outlived the engine"
    assert not os.path.exists(cold)


def test_vllm_engine_a_full_disk_during_its_start_is_a_failed_write_exit_5_not_a_compiler_error(tmp_path):
    """vLLM compiles a kernel during a first start (its logprobs' count, warmed up there; an empty cache
    root: no compiled kernel to reuse): with the engine's
    file-size limit at 64 KiB (set on the running process, as `ulimit -f` would), the compiler's write
    fails, and the handle says so as EngineWriteFailed (errors.WriteFailed: exit 5, "a write failed"),
    one line, the engine's group gone; not "InductorError: CppCompileError" as an engine failure (exit 4)."""
    import resource
    import threading
    from rl import vllm_engine
    from rl.engine import EngineWriteFailed
    seen = {}

    def limit_its_writes():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not seen:
            for pid in (p for p in _engine_pids() if _parent(p) == os.getpid()):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
                seen["engine"] = pid
            time.sleep(0.01)
    cold = str(tmp_path / "cold-cache")
    warm_registry = os.path.join(vllm_engine.CACHE_ROOT, "modelinfos")  # (vLLM's model registry, if an earlier
    if os.path.isdir(warm_registry):  # start wrote it: spares the ~10 s registry subprocess; no kernel is in it)
        shutil.copytree(warm_registry, os.path.join(cold, "modelinfos"))
    watcher = threading.Thread(target=limit_its_writes, daemon=True)
    watcher.start()
    with pytest.raises(EngineWriteFailed) as e:
        vllm_engine.VLLMEngineProcess(VLLM_QWEN, timeout_s=300, cache_root=cold)
    watcher.join()
    line = str(e.value)
    assert line.startswith("vLLM engine could not write a file during start: ") and "\n" not in line, line
    assert e.value.exit_code == 5 and seen and not _left_after(lambda: _group(seen["engine"]))


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _group(pgid):
    """The live processes of process group pgid."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def _cache_dir_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return env[b"VLLM_CACHE_ROOT"].decode()
    except (OSError, KeyError):
        return None


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


def test_a_vllm_python_without_vllm_is_exit_2_before_anything_is_written_and_help_says_the_timeout_bounds_the_start(
        tmp_path, capsys):
    """--vllm-python naming a python without vLLM (this environment's, the system's) or a program that is
    not python (`true`): one `error:` line, exit 2, no run directory (it was an engine failure, exit 4,
    after the run directory was written). --help says that --engine-timeout bounds the engine's start."""
    import shutil
    out = str(tmp_path / "run")
    pythons = [sys.executable, shutil.which("true")] + [p for p in ("/usr/bin/python3",) if os.path.exists(p)]
    for python in pythons:
        assert _main(["--task", "grpo", *VLLM_POLICY, "--engine", "vllm", "--vllm-python", python, "--steps", "2",
                      "--out-dir", out]) == 2, python
        err = capsys.readouterr().err
        assert err.startswith(f"error: --engine vllm: {python} is not a python with vLLM") and err.count("\n") == 1, err
        assert not os.path.exists(out)
    assert _main(["--task", "grpo", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "stalled (exit 4); it also bounds the engine's start" in help_text, help_text


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
    and the final saved weights (so each push reached vLLM whole); no engine is left (the fixture above)."""
    from run import checkpoint
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


def test_grpo_through_vllm_a_killed_engine_is_exit_4_and_ctrl_c_exit_130_leaving_no_process(vllm_warm, tmp_path,
                                                                                            ctrl_c_as_in_a_terminal):
    """The vLLM engine SIGKILLed mid-run: one line naming it, exit 4. Ctrl-C (SIGINT to the whole process
    group, as a terminal sends it): exit 130. The trainer SIGKILLed (nothing of it runs to clean up): the
    engine dies with it (PR_SET_PDEATHSIG). In each case no engine process and no engine run folder is left. The three runs start
    together (each pays 15-40 s of vLLM start, mostly imports on one core); a trainer that has logged a
    reward is stopped (SIGSTOP) until all three have, so that none trains while the others start."""
    hows = ("engine killed", "Ctrl-C", "trainer killed")
    runs = {how: str(tmp_path / how.replace(" ", "_")) for how in hows}
    procs = {how: subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"),
                                    *_vllm_grpo(vllm_warm, runs[how], "--steps", "400", "--eval-interval", "0")],
                                   cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True) for how in hows}
    errs, engines, folders = {}, {}, {}
    try:
        deadline = time.monotonic() + 420
        while len(engines) < len(hows):
            for how, proc in procs.items():
                run = runs[how]
                if how not in engines and os.path.exists(os.path.join(run, "metrics.jsonl")) and _records(run, "reward"):
                    os.kill(proc.pid, signal.SIGSTOP)
                    engines[how] = [p for p in _engine_pids() if _parent(p) == proc.pid]
                    assert len(engines[how]) == 1, (how, engines[how])
                    log = os.readlink(f"/proc/{engines[how][0]}/fd/1")  # (its stdout: the run folder's engine.log)
                    folders[how] = os.path.dirname(log)
                    assert log.endswith("engine.log") and os.path.isdir(folders[how]), log
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
    left = _left_after(lambda: {pid for how in hows for pid in engines[how]} & set(_engine_pids()))
    assert not left, _described(left)  # (the kernel delivers the engine's SIGKILL as the trainer exits)
    assert not [folder for folder in folders.values() if os.path.exists(folder)], folders  # (the run's files)


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None
