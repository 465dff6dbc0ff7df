"""errors.py: every way a run can fail that is not a bug, as a kind with the exit code it ends in.

Every module's own errors subclass one of these kinds, so process.run catches by kind and prints one
`error:` line, importing no workload to do it (a rollout engine's death is a PeerGone like a dead
torchrun rank). The lowest layer: it imports nothing. The table below is the exit codes' one home
(the README, train.py and docs/promises.md point here):

    exit 0               the run finished
    exit 1  OwnFailure   this process failed by itself (out of memory: named in one line)
    exit 2  BadInput     a flag, file, checkpoint or mesh that cannot work; nothing was written
    exit 3  (NonFinite)  a NaN / Inf loss, gradient norm or validation loss: the trainer's own return
    exit 4  PeerGone     another process the run needs died or stalled (a torchrun rank, an engine)
    exit 5  WriteFailed  a write failed (disk full, file-size limit); the last good checkpoint stays
    130 / 143            Interrupted (or KeyboardInterrupt): SIGINT / SIGTERM (128 + the signal's number)

Under torchrun bad input is said once, by rank 0, and every rank exits 2; torchrun itself then exits 1,
its code for any failed worker.
"""
import signal
import sys

EXIT_OWN_FAILURE, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_PEER_FAILED, EXIT_WRITE_FAILED = 1, 2, 3, 4, 5


class MinititanError(Exception):
    """A failure the user can act on, said in one line; `exit_code` is how the run ends."""
    exit_code = EXIT_OWN_FAILURE


class BadInput(MinititanError, ValueError):
    """Input that cannot work (a ValueError too, so code that validates with ValueError catches it)."""
    exit_code = EXIT_BAD_INPUT


class PeerGone(MinititanError, RuntimeError):
    """A process the run depends on died or stopped answering."""
    exit_code = EXIT_PEER_FAILED


class WriteFailed(MinititanError, OSError):
    """A file could not be written; what was on disk before is intact."""
    exit_code = EXIT_WRITE_FAILED


class ConfigError(BadInput):
    """A flag or a combination of flags (run/cli.py, a workload's own flags, a model config)."""


class Interrupted(BaseException):
    """SIGTERM (or SIGINT, as KeyboardInterrupt): end like a shell does, 128 + the signal number. Not an
    Exception, so no `except Exception` on the way swallows it; here, so that a layer that must let it
    through (run/checkpoint.py) knows it by its class."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum

    def __str__(self):
        return signal.Signals(self.signum).name


def interruption(e):
    """The signal number if `e` is SIGINT / SIGTERM or wraps it, else None. Wrapped: DCP gathers what its
    writers raised into a CheckpointException's `failures` ({rank: (exception, traceback)}); Python
    chains it as the cause of its own RuntimeError when the signal lands in a descriptor's __set_name__
    (a class being created: a lazy import, say torch._dynamo's dataclasses, when torchrun stops a rank)."""
    if isinstance(e, (KeyboardInterrupt, Interrupted)):
        return getattr(e, "signum", signal.SIGINT)
    failures = getattr(e, "failures", None)
    inner = [pair[0] for pair in failures.values()] if isinstance(failures, dict) else []
    found = [interruption(x) for x in inner + ([e.__cause__] if e.__cause__ is not None else [])]
    return next((signum for signum in found if signum is not None), None)


def interrupted(e):
    """True if `e` is SIGINT / SIGTERM, or wraps it (interruption)."""
    return interruption(e) is not None


def error_line(message):
    """One `error:` line in ONE write: print() writes text and newline separately, and the ranks of a
    run share stderr, so their lines would interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def describe_write_failure(e):
    """A failed write (an OSError or a WriteFailed) in words, naming the file (OSError's fields are None
    for some writers)."""
    if isinstance(e, MinititanError) or not (e.strerror or e.filename):
        return str(e) or type(e).__name__
    return f"{e.strerror or type(e).__name__}: {e.filename or 'a file'}"


# What a collective raises when the process at the other end died or stalled (gloo / NCCL / the
# store), as opposed to this process's own failure (out of memory, a shape error): told apart so
# that a rank's own error is not reported as a peer's.
PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
                      "Timed out", "timed out", "NCCL", "Gloo", "gloo", "ProcessGroup", "recvBytes", "sendBytes")


def peer_failure(e):
    """True if exception `e` (or what DCP wrapped into it) says a peer process died or stalled."""
    import torch.distributed as dist  # (torch's, not ours: this module imports nothing of ours)
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return any(sign in text for sign in PEER_FAILURE_SIGNS)
