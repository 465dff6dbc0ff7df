"""rl/rollout.py: the rollout engine: its own copy of the policy, in its own process, sampling G
completions per prompt with their per-token logprobs and the policy version that wrote them.

In torchtitan's experiments/rl (and VeRL) the samples come from a separate inference engine (vLLM),
not from the trainer: different process, different layout, different precision. This is ours, small:

    engine = EngineProcess(model_args, dtype=torch.bfloat16, timeout_s=60)   # spawns the server loop
    engine.sync(model.named_parameters(), version=step)     # rl/weight_sync.py: gloo broadcasts, bucket by bucket
    ro = engine.generate(prompts, group_size=8, max_new_tokens=4, temperature=1.0, seed=step, eos_id=10)
    ro.completions_BxC, ro.logprobs_BxC, ro.mask_BxC, ro.version
    engine.close()

Decoding reuses generate.py's static KV cache: a batch of B rows (prompts x G, group after group)
is prefilled once, then one token per step for every row; a row that has written eos_id keeps
decoding (static shapes: on XLA one decode program) but its later tokens are masked out. Prompts
of one call must have the same length (no padding: the arithmetic task's prompts all do). Sampling
is at temperature T from one seeded generator on the host, so a seed reproduces the rollout; the
logprob returned is log softmax(logits / T) of the sampled token, the quantity the trainer's
grpo.completion_logprobs recomputes for the importance ratio.

The handle (EngineProcess) is rl/engine.py's contract, shared with the vLLM engine: every message to
and from the process is bounded by timeout_s while watching it; a dead or stalled engine raises
EngineError with one line (the caller exits 4).
"""
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import device as dev
from rl import weight_sync
from rl.engine import EngineError, EngineHandle, Rollout, check_prompts, through_first_eos  # (Rollout, EngineError: re-exported)
from generate import KVCache
from model import Transformer



@torch.no_grad()
def sample_batch(model, prompts_BxP, max_new_tokens, temperature, generator, eos_id=None):
    """Decode max_new_tokens for every row at once with a static KV cache: (tokens, logprobs, mask)."""
    B, P = prompts_BxP.shape
    device = model.embed_tokens.weight.device
    if P + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"prompt + new tokens = {P + max_new_tokens} exceeds max_seq_len {model.args.max_seq_len}")
    cache = KVCache(model.args, B, P + max_new_tokens, device, model.embed_tokens.weight.dtype)
    step_in = prompts_BxP.to(device)
    tokens, logps = [], []
    done_B = torch.zeros(B, dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits_BxV = model(step_in, sequence=cache)[:, -1]
        cache.pos += step_in.shape[1]
        dev.sync(device)  # XLA: one decode program per step
        logits_BxV = logits_BxV.float().cpu()
        if temperature > 0:
            logits_BxV = logits_BxV / temperature
            tok_B = torch.multinomial(torch.softmax(logits_BxV, -1), 1, generator=generator).squeeze(1)
        else:
            tok_B = logits_BxV.argmax(-1)
        logps.append(F.log_softmax(logits_BxV, -1).gather(1, tok_B[:, None]).squeeze(1))
        tokens.append(tok_B)
        if eos_id is not None:
            done_B |= tok_B == eos_id
            if bool(done_B.all()):
                break  # every row has ended: the rest would be masked anyway
        step_in = tok_B[:, None].to(device)
    C = max_new_tokens
    out_BxC = torch.full((B, C), eos_id if eos_id is not None else 0, dtype=torch.long)
    logp_BxC = torch.zeros(B, C)
    out_BxC[:, :len(tokens)] = torch.stack(tokens, 1)
    logp_BxC[:, :len(logps)] = torch.stack(logps, 1)
    mask_BxC = through_first_eos(out_BxC, eos_id)
    mask_BxC[:, len(tokens):] = False
    return out_BxC, logp_BxC, mask_BxC


class Engine:
    """The engine's state in whatever process holds it: a policy copy and its version."""

    def __init__(self, model):
        self.model = model.eval()
        self.version = -1

    def generate(self, prompts, group_size, max_new_tokens, temperature=1.0, seed=0, eos_id=None, batch_size=256):
        """G completions of each prompt (lists of token ids, one length), in batches of batch_size rows."""
        check_prompts(prompts)
        if group_size < 1 or max_new_tokens < 1 or batch_size < 1 or temperature < 0:
            raise ValueError("need group_size, max_new_tokens, batch_size >= 1 and temperature >= 0")
        t0 = time.perf_counter()
        rows_BxP = torch.tensor(prompts, dtype=torch.long).repeat_interleave(group_size, 0)
        g = torch.Generator().manual_seed(seed)
        parts = [sample_batch(self.model, rows_BxP[i:i + batch_size], max_new_tokens, temperature, g, eos_id)
                 for i in range(0, len(rows_BxP), batch_size)]
        toks, logps, masks = (torch.cat(x) for x in zip(*parts))
        return Rollout(rows_BxP, toks, logps, masks, self.version, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------
# The engine as a separate process: a server loop, and the trainer's handle on it

def _serve(conn, model_args, dtype, port, timeout_s, sigint=None):
    """The engine process: build the policy copy, join the sync group, answer commands until 'stop'.
    It ends without a word when the trainer has already said what happened: Ctrl-C reaches the whole
    process group (the trainer prints the line and exits 130; the engine ends by the signal's default
    action, at once), and a trainer that died (SIGKILL) leaves a closed pipe (its caller reports the
    death; nobody reads a traceback from here). Not by a KeyboardInterrupt: Python runs a SIGINT
    handler only once the main thread is back in the interpreter, and gloo's handshake, a C++ call,
    holds it there until the trainer joins or the timeout (seen: an engine alive 60 s after Ctrl-C)."""
    if sigint is not None:  # started with Ctrl-C ignored (its bootstrap: the imports); now the trainer's disposition
        signal.signal(signal.SIGINT, sigint)
    try:
        _serve_loop(conn, model_args, dtype, port, timeout_s)
    # (KeyboardInterrupt still: an engine started from a trainer's other thread, whose SIGINT
    # disposition _spawn cannot set, has Python's default handler)
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        sys.stderr.flush()
        os._exit(0)  # (no interpreter teardown: gloo's threads may wait on the trainer that is gone)


def _serve_loop(conn, model_args, dtype, port, timeout_s):
    engine = Engine(Transformer(model_args).to(dtype))
    conn.send(("ok", "built"))
    receiver = weight_sync.Receiver(weight_sync.join(1, timeout_s, port=port), engine.model)
    while True:
        cmd, kw = conn.recv()
        try:
            if cmd == "sync":
                conn.send(("ok", "receiving"))
                engine.version = receiver.recv()
                conn.send(("ok", engine.version))
            elif cmd == "generate":
                if engine.version < 0:
                    raise EngineError("no weights synced yet")
                conn.send(("ok", engine.generate(**kw)))
            elif cmd == "state":  # for tests: the engine's own weights, their addresses, its version
                conn.send(("ok", {"weights": {n: p.detach().clone() for n, p in engine.model.named_parameters()},
                                  "ptrs": [p.data_ptr() for p in engine.model.parameters()],
                                  "version": engine.version}))
            elif cmd == "stop":
                conn.send(("ok", None))
                return
            else:
                raise EngineError(f"unknown command {cmd!r}")
        except Exception as e:  # reported to the caller as one line; the loop keeps serving
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


class EngineProcess(EngineHandle):
    """The trainer's handle on our engine process (rl/engine.py's contract); weights go over gloo."""
    name = "rollout engine"

    def __init__(self, model_args, dtype=torch.float32, timeout_s=60.0, bucket_bytes=weight_sync.BUCKET_BYTES):
        self.model_args, self.dtype, self.bucket_bytes = model_args, dtype, bucket_bytes
        self.store = weight_sync.host_store(timeout_s)
        super().__init__(timeout_s)
        self.sender = None
        self._start()
        try:
            self.pg = weight_sync.join(0, timeout_s, store=self.store)
        except RuntimeError as e:
            self._kill()
            raise EngineError(f"rollout engine did not join the sync group: {str(e).splitlines()[0]}") from None

    def _spawn(self, child_sock):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no state inherited from the trainer
        child_conn = Connection(child_sock.detach())
        # A Ctrl-C during the child's bootstrap (importing torch) would print a traceback from
        # multiprocessing's spawn_main: start it with SIGINT ignored, and let _serve take the signal's
        # default action (the end, silent) where the trainer takes Ctrl-C, or keep it ignored where the
        # trainer ignores it (a background job).
        try:
            sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # (not the main thread: dispositions cannot change here)
            sigint = None
        restore = signal.SIG_DFL if callable(sigint) else sigint
        self.proc = ctx.Process(target=_serve, args=(child_conn, self.model_args, self.dtype, self.store.port,
                                                     self.timeout_s, restore), daemon=True)
        try:
            self.proc.start()
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)
            child_conn.close()

    def sync(self, named_params, version):
        """Push the trainer's weights as policy `version`, bucket by bucket over gloo; the sync's
        {"version", "bytes", "seconds"}."""
        named_params = list(named_params)
        if self.sender is None:
            self.sender = weight_sync.Sender(self.pg, named_params, self.bucket_bytes)
        self._send("sync", {})
        self._reply("sync")  # the engine is alive and waiting in the broadcast
        try:
            stats = self.sender.send(named_params, version)
        except weight_sync.SyncError as e:
            # A killed engine resets the socket before the OS reaps it: give it a moment to show as
            # dead so that the line names the cause (the process), not the symptom (the socket).
            if self._exit_code(wait_s=2.0) is not None:
                self._died("sync")
            self._kill()
            raise EngineError(str(e)) from None
        got = self._reply("sync")
        if got != version:
            raise EngineError(f"engine reports policy version {got} after syncing {version}")
        return stats

    def state(self):
        self._send("state", {})
        return self._reply("state")

    def _exit_code(self, wait_s=0.0):
        if wait_s:
            self.proc.join(wait_s)
        return self.proc.exitcode

    def _kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self._close_socket()
