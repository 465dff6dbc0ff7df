"""rl/engine.py: the one contract of a rollout engine handle, whichever engine sits behind it (ours,
rl/rollout.py, or vLLM, rl/vllm_engine.py): what the trainer calls and how every call is bounded.

    engine = SomeEngine(model_args, dtype, timeout_s)   # start: spawn the process, await its "ok"
    engine.sync(model.named_parameters(), version)      # push: the policy in bounded buckets (weight_sync.Buckets)
    ro = engine.generate(prompts, G, C, temperature, seed, eos_id)   # a Rollout
    engine.close()                                      # stop politely, else kill; safe twice

The trainer talks to the engine process over one socket pair. In RL post-training (torchtitan's
experiments/rl, verl) the engine is a peer: it can die, stall, or fill a disk, and none of that may
hang the trainer. So every send and every receive here waits at most timeout_s, in short polls that
also watch the process (a blocking write into a full socket buffer is what hung the trainer when a
vLLM engine was stopped). The framing is multiprocessing.connection's (a 4-byte length,
then the bytes), so the engine side reads it with a plain Connection. The outcomes, each one line:

    dead process          EngineError  "<engine> process died (exit code N) during <what>"   exit 4
    no progress in time   EngineError  "<engine> stalled: no reply to <what> within T s"     exit 4
    the engine refused    EngineError  "<engine> failed during <what>: <its line>"           exit 4
    a write failed there  EngineWriteFailed (errors.WriteFailed)                             exit 5

A subclass spawns its process (`_spawn`) and says how to see it (`_exit_code`) and end it (`_kill`);
everything else, including the start's failure handling, is here.
"""
import pickle
import select
import socket
import struct
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

from errors import PeerGone, WriteFailed


class EngineError(PeerGone):
    pass


class EngineWriteFailed(WriteFailed):
    """The engine could not write a file (a full disk, a file-size limit): the run ends with exit 5."""


@dataclass
class Rollout:
    prompts_BxP: torch.Tensor       # long; rows grouped: prompt i's G samples are rows i*G .. i*G+G-1
    completions_BxC: torch.Tensor   # long; C = max_new_tokens
    logprobs_BxC: torch.Tensor      # float32: the engine's log softmax(logits / T) of each sampled token
    mask_BxC: torch.Tensor          # bool: tokens through the first eos_id
    version: int                    # the policy version (weight sync) that sampled it
    seconds: float = 0.0


def through_first_eos(out_BxC, eos_id):
    """The mask of the tokens a row wrote, through its first eos_id (every token if eos_id is None)."""
    if eos_id is None:
        return torch.ones(out_BxC.shape, dtype=torch.bool)
    is_eos = (out_BxC == eos_id).int()
    return (torch.cumsum(is_eos, 1) - is_eos) == 0


def check_prompts(prompts):
    if not prompts or len({len(p) for p in prompts}) != 1 or not prompts[0]:
        raise ValueError("prompts must be a non-empty list of non-empty token lists of one length")


class EngineHandle:
    """The trainer's handle on an engine process: bounded messages over `self.sock`, one failure vocabulary."""
    name = "engine"
    POLL_S = 0.05

    def __init__(self, timeout_s):
        self.timeout_s, self.bytes_sent = timeout_s, 0
        self.mid_message = False  # a message half sent or half read (an interrupt in between): the stream
                                  # is out of step, so close() kills instead of asking the engine to stop
        self.sock, child = socket.socketpair()
        try:
            self._spawn(child)  # (sets self.proc; the child end is the engine's)
        finally:
            child.close()
        self.sock.setblocking(False)

    # what a subclass provides --------------------------------------------------------------------
    def _spawn(self, child_sock):
        raise NotImplementedError

    def _exit_code(self, wait_s=0.0):
        """None while the process runs (after waiting up to wait_s for it to end), else its exit code."""
        raise NotImplementedError

    def _kill(self):
        """End the engine and everything it started, now; reap it. Safe twice."""
        raise NotImplementedError

    def _last_words(self):
        """A line from the engine's own log that says why it died ("" if none)."""
        return ""

    # the contract ----------------------------------------------------------------------------------
    def _start(self, message=None):
        """Send the start message (if any) and await the engine's "ok"; any failure, Ctrl-C included,
        kills it first: nothing of a half-started engine stays behind."""
        try:
            if message is not None:
                self._send_obj(message, "start")
            return self._reply("start")
        except BaseException:
            self._kill()
            raise

    def generate(self, prompts, group_size, max_new_tokens, temperature=1.0, seed=0, eos_id=None, batch_size=256):
        """G completions of each prompt (token lists of one length) as a Rollout."""
        check_prompts(prompts)
        kw = dict(prompts=prompts, group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature,
                  seed=seed, eos_id=eos_id, batch_size=batch_size)
        self._send("generate", kw)
        return self._rollout(self._reply("generate"), kw)

    def _rollout(self, reply, kw):
        return reply

    def close(self):
        """Stop the server loop (or kill it if it does not answer); safe to call twice."""
        if self._exit_code() is None and self.sock.fileno() >= 0 and not self.mid_message:
            try:
                self._send("stop", {}, timeout_s=min(self.timeout_s, 10))
                self._reply("stop", timeout_s=min(self.timeout_s, 10))
                self._exit_code(wait_s=10)
            except EngineError:
                pass
        self._kill()

    # bounded messages ------------------------------------------------------------------------------
    def _send(self, cmd, kw, what=None, timeout_s=None):
        self._send_obj((cmd, kw), what or cmd, timeout_s)

    def _send_obj(self, obj, what, timeout_s=None):
        self._send_bytes(ForkingPickler.dumps(obj), what, timeout_s)

    def _send_bytes(self, data, what, timeout_s=None):
        """One message (Connection's framing) written within timeout_s; `data` any buffer (not copied)."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self.bytes_sent += len(header) + n
        self.mid_message = True
        for part in (memoryview(header), view):
            while part.nbytes:
                if self._wait(False, deadline, what, timeout_s):
                    try:
                        part = part[self.sock.send(part[:1 << 20]):]
                    except BlockingIOError:
                        pass
                    except OSError:
                        self._died(what)
        self.mid_message = False

    def _reply(self, what, timeout_s=None):
        """The engine's answer to `what`: its value, or the failure raised as above."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self.mid_message = True
        (n,) = struct.unpack("!i", self._read(4, deadline, what, timeout_s))
        if n == -1:
            (n,) = struct.unpack("!Q", self._read(8, deadline, what, timeout_s))
        data = self._read(n, deadline, what, timeout_s)
        try:
            status, value = pickle.loads(data)
        except (OSError, EOFError):  # a reply's tensors come as file descriptors fetched from the engine while
            # unpickling (torch's sharing over multiprocessing's resource sharer): an engine killed since it
            # sent them refuses or resets that fetch (OSError), or closes it mid-handshake (EOFError, seen
            # in the suite): its death, not a failed write of ours
            if self._exit_code(wait_s=2.0) is not None:
                self._died(what)
            raise
        self.mid_message = False
        if status == "write_failed":  # (what failed may have left the engine wedged: it is stopped)
            self._kill()
            raise EngineWriteFailed(f"{self.name} could not write a file during {what}: {value}")
        if status == "error":
            if what == "start":
                self._kill()
            raise EngineError(f"{self.name} failed during {what}: {value}")
        return value

    def _read(self, n, deadline, what, timeout_s):
        buf, got = bytearray(n), 0
        view = memoryview(buf)
        while got < n:
            if self._wait(True, deadline, what, timeout_s):
                try:
                    k = self.sock.recv_into(view[got:])
                except BlockingIOError:
                    continue
                except OSError:
                    k = 0
                if k == 0:  # the engine's end is closed: it died (or is dying)
                    self._died(what)
                got += k
        return buf

    def _wait(self, readable, deadline, what, timeout_s):
        """True once the socket is ready; meanwhile the process must live and the deadline must not pass."""
        if self.sock.fileno() < 0:  # (closed by an earlier failure: the process is gone)
            self._died(what)
        r, w, _ = select.select([self.sock] if readable else [], [] if readable else [self.sock], [], self.POLL_S)
        if r or w:
            return True
        if self._exit_code() is not None:
            self._died(what)
        if time.monotonic() > deadline:
            self._kill()
            raise EngineError(f"{self.name} stalled: no reply to {what} within {timeout_s or self.timeout_s:g} s")
        return False

    def _died(self, what):
        code = self._exit_code(wait_s=2.0)  # (a killed engine closes its socket a moment before it is reaped)
        said = self._last_words() if code and code > 0 else ""  # (a signal's victim said nothing useful)
        self._kill()
        raise EngineError(f"{self.name} process died (exit code {code}) during {what}"
                          + (f"; its log ends: {said}" if said else "")) from None

    def _close_socket(self):
        self.sock.close()
