"""run/rundir.py: the run directory as a guarded resource: one run at a time, strict metrics, no hangs.

A run directory holds what a user cannot afford to lose (checkpoints, metrics.jsonl), so:
  - `RunDir.open` checks the path before anything is written and takes an exclusive lock per rank
    (fcntl.flock on `.lock.rankN`): a second run on the same directory is refused in one line. The
    kernel drops the lock when the process dies, so a crashed run leaves no stale lock.
  - metrics.jsonl is strict JSON, one record a line: a non-finite float is written as null.
  - `Watchdog` ends a process that makes no progress for `timeout_s` (a peer stopped without dying
    leaves the others waiting in a collective forever: no timeout of ours fires inside a functional
    collective's wait) with one line naming where it stalled, and exit code 4. It is a Python thread:
    collectives and XLA waits release the GIL, so it runs while the main thread is blocked.
"""
import fcntl
import json
import math
import os
import socket
import sys
import threading
import time

import atomic
from errors import BadInput


class RunDirError(BadInput):
    """The run directory cannot be used (a file, not writable, in use): one line, exit 2."""


def check_writable(path, folders=()):
    """Refuse, before anything is written, a path that is a file or lies under one or under a
    directory this user cannot write; likewise the run's own `folders` inside it (its checkpoints, its
    profile), which a file in the way would otherwise fail only at the first save or the traced step."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"--out-dir {path} exists and is not a directory")
    for name in folders:
        inside = os.path.join(path, name)
        if os.path.exists(inside) and not os.path.isdir(inside):
            raise RunDirError(f"--out-dir {path}: {inside} is a file where the run writes its {name} folder")
        if os.path.isdir(inside) and not os.access(inside, os.W_OK | os.X_OK):
            raise RunDirError(f"--out-dir {path}: {inside} is not writable")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise RunDirError(f"--out-dir {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"--out-dir {path}: {parent} is not writable")


def strict(value):
    """JSON-safe copy: NaN/Inf become None (json.dumps would write bare NaN, which is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def read_metrics(path):
    """The records of path/metrics.jsonl; a last line cut by a crash mid-write is skipped (the
    records before it are whole: each line is written in one write)."""
    recs = []
    with open(os.path.join(path, "metrics.jsonl")) as f:
        for line in f:
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
    return recs


class RunDir:
    def __init__(self, path, rank=0, tensorboard=False):
        self.path, self.rank, self._lock = path, rank, None
        self.tensorboard, self._tb = tensorboard, None

    def open(self):
        """Create the directory and take this rank's lock (RunDirError if another run holds it)."""
        try:
            os.makedirs(self.path, exist_ok=True)
            fd = os.open(os.path.join(self.path, f".lock.rank{self.rank}"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"--out-dir {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"{self.path} is in use by another run ({holder}); wait for it to end "
                              f"or choose another --out-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._lock = fd
        return self

    def append_metrics(self, record):
        line = json.dumps(strict(record), allow_nan=False)
        with open(os.path.join(self.path, "metrics.jsonl"), "a") as f:
            f.write(line + "\n")
        if self.tensorboard and "step" in record:  # --tensorboard: the same numbers as scalars
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(self.path, "tensorboard"))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()

    def plot(self, extra=()):
        """loss.png beside metrics.jsonl: train and validation loss against step, learning rate on a
        second axis (matplotlib, no display needed); the `extra` metric keys (a task's, e.g. reward
        and held-out accuracy) in a second panel below."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        recs = read_metrics(self.path)
        series = {k: [(r["step"], r[k]) for r in recs if r.get(k) is not None and "step" in r]
                  for k in ("loss", "val_loss", "lr", *extra)}
        shown = [k for k in extra if series[k]]
        fig, axes = plt.subplots(1 + bool(shown), 1, figsize=(7, 4 + 3 * bool(shown)), squeeze=False)
        ax = axes[0, 0]
        if shown:
            for key in shown:
                axes[1, 0].plot(*zip(*series[key]), ".-", label=key.replace("_", " "))
            axes[1, 0].set_xlabel("step")
            axes[1, 0].legend(loc="lower right")
        for key, style in (("loss", "-"), ("val_loss", "o-")):
            if series[key]:
                ax.plot(*zip(*series[key]), style, label=key.replace("_", " "))
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        if series["loss"] or series["val_loss"]:
            ax.legend(loc="upper right")
        if series["lr"]:
            lr_ax = ax.twinx()
            lr_ax.plot(*zip(*series["lr"]), color="grey", alpha=0.4)
            lr_ax.set_ylabel("learning rate", color="grey")
        fig.tight_layout()
        path = os.path.join(self.path, "loss.png")
        try:
            with atomic.written(path) as tmp:
                fig.savefig(tmp, format="png", dpi=100)
        except OSError as e:  # (matplotlib's errors may not name the file: name it)
            raise OSError(e.errno, e.strerror or str(e), path) from None
        finally:
            plt.close(fig)

    def close(self):
        if self._tb is not None:
            self._tb.close()
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None


class Watchdog:
    """`beat(where)` after every unit of progress; no beat for timeout_s -> one line, exit code."""

    def __init__(self, timeout_s, rank, exit_code=4, peers=True):
        self.timeout_s, self.rank, self.exit_code, self.peers = timeout_s, rank, exit_code, peers
        self.where, self.last = "start-up", time.monotonic()
        self._stop = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="minititan-watchdog").start()

    def beat(self, where):
        self.where, self.last = where, time.monotonic()

    def _watch(self):
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self.last
            if stalled > self.timeout_s:
                who, why = ((f"rank {self.rank}: ", "a peer is probably stalled") if self.peers else
                            ("", "the process is stuck or too slow (raise --watchdog for long compiles)"))
                took = f"{stalled:.0f}" if stalled >= 10 else f"{stalled:.2g}"  # (a short --watchdog: not "0 s")
                sys.stderr.write(f"error: {who}no progress for {took} s in {self.where} "
                                 f"(--watchdog {self.timeout_s:g}); {why}; stopping\n")
                sys.stderr.flush()
                os._exit(self.exit_code)  # the main thread is stuck in C++: no unwinding possible

    def stop(self):
        self._stop.set()
