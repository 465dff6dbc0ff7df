"""run/process.py: the process around a run. The Trainer trains; this file turns what ends a run into one
`error:` line and the exit code of its kind (the table: errors.py).

    process.run(body, argv)   # -> exit code; body(argv, at) builds and runs, `at` holds what it built
    process.main(body)        # `python train.py` (and every torchrun rank): run, then exit with that code

SIGTERM (torchrun stopping a rank, a scheduler's preemption) is raised as errors.Interrupted wherever
the run is, like SIGINT's KeyboardInterrupt; both end as a shell ends a killed command, 128 + the signal,
naming the checkpoint kept. A failure is told by kind, not by where it happened: bad input (2), a peer
or engine gone (4), a failed write (5), this process's own failure (1: out of memory, named); anything
else on one process is a bug and keeps its traceback.

Under torchrun every rank runs the same checks, so bad input is refused on every rank at once; rank 0
says it, and a rank > 0 waits silent for torchrun to stop it (the refusal grace). Still running after
the grace, rank 0 did not refuse (input that differs between ranks): that rank says it, named.
"""
import faulthandler
import os
import signal
import sys
import threading
import time

import torch
from torch.distributed.checkpoint.api import CheckpointException

from run import checkpoint
import mesh
from run import resume
from errors import (EXIT_BAD_INPUT, EXIT_OWN_FAILURE, EXIT_PEER_FAILED, EXIT_WRITE_FAILED, Interrupted,
                    MinititanError, PeerGone, describe_write_failure, error_line, interruption,
                    peer_failure)

REFUSAL_GRACE_S = 10.0  # how long a rank > 0 waits, silent, for rank 0 to say the same refusal


class Built:
    """What the run has built when it ends, for its last line: the layout (`parallel`: the rank, the
    mesh, close()) and the Trainer (`trainer`: the step reached, the checkpoint directory)."""
    parallel = trainer = None
    dry_run = False  # (a dry run writes nothing; a compile's worker thread may still run when it ends)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def run(body, argv=None):
    """body(argv, at) -> exit code, with SIGTERM raised as Interrupted; what it raises ends as one line
    and the exit code of its kind."""
    at = Built()
    signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        return body(argv, at)
    except resume.RunComplete as done:  # (--resume auto after the final checkpoint: a restart, not bad input)
        if _rank(at.parallel) == 0:
            print(f"note: {done}", file=sys.stderr, flush=True)
        at.parallel.close()
        return 0
    except MinititanError as e:  # bad input (2), a peer or engine gone (4), a failed write (5): by kind
        rank = _rank(at.parallel)
        if isinstance(e, mesh.SaidAlready):
            return e.exit_code
        if e.exit_code == EXIT_BAD_INPUT and rank != 0:
            return _refused_on_a_rank(e, rank)
        where = f" at step {_step(at)}" if isinstance(e, PeerGone) else ""
        error_line(f"a write failed: {describe_write_failure(e)}" if e.exit_code == EXIT_WRITE_FAILED else f"{e}{where}")
        return e.exit_code
    except (KeyboardInterrupt, Interrupted) as e:
        return _interrupted_by(interruption(e), at)
    except OSError as e:  # disk full, file-size limit, read-only disk: the checkpoint on disk is intact
        error_line(f"a write failed: {describe_write_failure(e)}")
        return EXIT_WRITE_FAILED
    except (RuntimeError, torch.distributed.DistError, CheckpointException) as e:  # (DCP's: a BaseException)
        return _runtime_failure(e, at)


def main(body):
    """`python train.py`'s whole life: run body on the command line, end with its exit code. A crash in
    C++ (gloo, XLA) still prints every thread's Python stack (faulthandler). After a peer's death gloo's
    threads and destructors can wait on the dead peer at interpreter teardown: the line is written, so
    that exit leaves without teardown."""
    faulthandler.enable()
    code = run(body)
    if code == EXIT_PEER_FAILED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _rank(parallel):
    """This process's global rank: the Parallel's, or torchrun's RANK before the process group exists."""
    return parallel.global_rank if parallel is not None else int(os.environ.get("RANK", "0"))


def _step(at):
    return at.trainer.step if at.trainer else 0


def _kept(at):
    return checkpoint.newest_name(at.trainer.ckpt_dir) if at.trainer else None


def _refused_on_a_rank(e, rank):
    """Bad input on torchrun's rank `rank` > 0 (exit 2): silent for the grace period (torchrun's SIGTERM
    ends it quietly with the same code), then said, named (the module docstring)."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(EXIT_BAD_INPUT))
    try:
        time.sleep(REFUSAL_GRACE_S)
    except KeyboardInterrupt:  # (Ctrl-C reaches every rank: rank 0 has said what happened)
        return EXIT_BAD_INPUT
    finally:
        signal.signal(signal.SIGTERM, previous)
    error_line(f"rank {rank}: {e}")
    return EXIT_BAD_INPUT


def _interrupted_by(signum, at):
    """SIGINT / SIGTERM: exit 128 + the signal, naming the checkpoint kept."""
    if at.trainer is None and _rank(at.parallel) != 0:
        return 128 + signum  # (before the trainer exists rank 0 speaks: torchrun stopping this rank as
        #                      rank 0 refused first, even before any process group, or a stop to all)
    if at.dry_run:
        error_line(f"interrupted by {signal.Signals(signum).name} during the dry run (it writes nothing)")
        if any(t.name == "tpu-compile" and t.is_alive() for t in threading.enumerate()):
            sys.stdout.flush()  # (the TPU compiler's thread is mid-compile, inside libtpu: end without waiting on it)
            os._exit(128 + signum)
        return 128 + signum
    kept = _kept(at)
    error_line(f"interrupted by {signal.Signals(signum).name} at step {_step(at)}; "
               f"{f'checkpoint {kept} is kept' if kept else 'no checkpoint was written'} (a partial one is removed)")
    return 128 + signum


def _runtime_failure(e, at):
    """A peer's death (exit 4) or this process's own failure (exit 1), told apart and said in one line;
    or a stop that Python wrapped in its own RuntimeError (errors.interruption), ended as the stop."""
    signum = interruption(e)
    if signum is not None:
        return _interrupted_by(signum, at)
    parallel = at.parallel
    rank = f"rank {parallel.global_rank}: " if parallel is not None and parallel.mesh_spec else ""
    where = f" at step {at.trainer.step}" if at.trainer else ""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    if peer_failure(e):
        error_line(f"{rank}a collective failed{where}: a peer process died or stalled ({first})")
        return EXIT_PEER_FAILED
    if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
        kept = _kept(at)
        error_line(f"{rank}out of memory{where} ({first}); "
                   f"{f'checkpoint {kept} is intact' if kept else 'nothing was saved'}: lower --batch-size or add ranks")
        return EXIT_OWN_FAILURE
    if parallel is None or not parallel.mesh_spec:
        raise e  # one process and not a known failure: a bug, keep its traceback
    error_line(f"{rank}failed{where}: {type(e).__name__}: {first}")
    return EXIT_OWN_FAILURE
