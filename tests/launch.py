"""tests/launch.py: how the suite starts a script in a fresh process without paying for torch's import
each time: every child is a fork of one process that has already imported it.

Why: a fresh `python train.py` spends ~3.5 s of CPU importing torch before a line of ours runs, and
torchrun imports it in its launcher and again in every rank (a 4-rank run on 2 cores: ~12 s before the
first step). The suite starts well over a hundred such processes (101 in its first half, measured).
multiprocessing's "forkserver" start method is the tool: one server process imports torch and our
core once (no op runs and no thread starts on import, so it is safe to fork), and each child is a fork.

A child is a process of its own (pid, memory, signal handlers, exit code) and sees what `python SCRIPT
ARGS` shows a script: sys.argv, the whole environment (os.environ replaced, so C++ getenv sees it
too), the working directory, `__name__ == "__main__"`, stdout and stderr, atexit handlers at exit, and
the exit code of SystemExit / os._exit / a signal (negative, as subprocess reports it): checked against
a real subprocess by tests/check_launch.py. What it cannot see differently from its server is what a
library read from the environment while it was imported: torch's intra-op thread count (so it is set
here where the child's OMP_NUM_THREADS is), glibc's malloc tunables (the memory test that needs one sets it with
mallopt) and torch._dynamo's and inductor's config (TORCHDYNAMO_* / TORCHINDUCTOR_*, which no test sets
for a child: PRELOAD). torch_xla and jax are imported by the child, after its environment is set, as in a fresh
process (torch_xla's import changes torch's dynamo settings: it must not be in the server).

`ranks(n, argv)` is torchrun's worker contract without its launcher: RANK, LOCAL_RANK, WORLD_SIZE, ...,
OMP_NUM_THREADS=1, and the rendezvous store hosted by the launcher (here), as torchrun's agent hosts it
(TORCHELASTIC_USE_AGENT_STORE); when one rank fails, the others get SIGTERM, then SIGKILL after 30 s,
as from torchrun's agent. The real torchrun stays in the stalled-rank test (tests/check_parallel.py),
which runs its whole launch path; the README's torchrun commands are what `ranks` stands in for.
"""
import atexit
import multiprocessing
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from errors import EXIT_PEER_FAILED

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
# train imports the core (model, mesh, checkpoint, ...); scikit-learn is the FLUX digits' reader (its import
# is ~1.2 s of every FLUX child's start, measured). torch._dynamo (and sympy, inductor's config: torch.compile,
# make_fx's fake tensors, torch_xla's import all need it) is imported by 234 of the suite's 258 children:
# a 2-step train.py child 1.37 s -> 0.58 s, measured; it starts no thread and reads no variable the suite
# sets (its config's are TORCHDYNAMO_* / TORCHINDUCTOR_*). Nothing runs on import; none of ours outside the core.
PRELOAD = ["torch", "train", "torch._dynamo", "sklearn.datasets", "sklearn.model_selection"]


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm():
    """Start the server now: it imports PRELOAD in the background while the first tests run."""
    from multiprocessing import forkserver
    _context()
    forkserver.ensure_running()


def _become(argv, env, cwd, folder, limits):
    """In the forked child: run `python *argv` and leave as that process would."""
    import resource
    for kind, value in limits.items():  # (as `ulimit` in the shell that starts it)
        resource.setrlimit(kind, (value, value))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # PYTHONPATH's directories ahead of the server's own path, as python puts them at its start (jax is
    # not imported by the server: a child's PYTHONPATH can still choose it, tpu_target.step_environment)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    for fd, name in ((1, "stdout"), (2, "stderr")):  # (appends: the ranks of a run share the two files)
        f = os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    import torch
    if "OMP_NUM_THREADS" in env:  # (OpenMP read the server's value on import; unset, both are the default)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if argv[0] == "-c":  # python -c CODE ARGS
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, cwd)
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":  # python -m MODULE ARGS
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT ARGS
            sys.argv = list(argv)
            path = os.path.join(cwd, argv[0])
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: B902  (as the interpreter does: the traceback, exit 1)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Child:
    """A started `python ARGV` fork: .pid, .poll(), .wait(timeout) -> exit code, .kill(sig), .result(timeout),
    .close().
    Its stdout and stderr go to files in `folder` (a new temporary one by default; ranks share one)."""

    def __init__(self, argv, env=None, cwd=HERE, limits=None, folder=None):
        self.folder, self.owns_folder = folder or tempfile.mkdtemp(prefix="child-"), folder is None
        env = {**os.environ, **(env or {})}
        self.process = _context().Process(target=_become, args=(list(argv), env, cwd, self.folder, limits or {}))
        self.process.start()
        self.pid = self.process.pid

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self, sig=signal.SIGKILL):
        if self.process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def close(self):
        """Kill it if it still runs, reap it, remove its own folder (a test's `finally`)."""
        self.kill()
        self.wait()
        if self.owns_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def result(self, timeout=300):
        """(returncode, stdout, stderr) once it ends, as subprocess.run(capture_output=True) gives them;
        subprocess.TimeoutExpired after `timeout` s, the child killed."""
        if self.wait(timeout) is None:
            self.kill()
            self.wait()
            raise subprocess.TimeoutExpired(self.process.name, timeout, *_read(self.folder))
        return (self.wait(), *_read(self.folder, remove=self.owns_folder))


def _read(folder, remove=False):
    """(stdout, stderr) as text from a child's folder; from a crash's faulthandler report, the stacks
    without its last line, the list of every extension module (thousands of characters: a failing
    test's message is the stderr's tail, and the list pushed the crashed threads' stacks out of it)."""
    out = tuple(re.sub(r"\nExtension modules: [^\n]*", "", open(os.path.join(folder, name), errors="replace").read())
                if os.path.exists(os.path.join(folder, name)) else "" for name in ("stdout", "stderr"))
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def python(argv, env=None, cwd=HERE, timeout=300, limits=None):
    """`python *argv` in a fresh (forked) process: (returncode, stdout, stderr). `limits`: {resource.RLIMIT_*:
    value} set in the child first, as `ulimit` would."""
    return Child(argv, env, cwd, limits).result(timeout)


def ranks(nproc, argv, env=None, timeout=300):
    """`torchrun --standalone --nproc-per-node NPROC *argv` (see the docstring): (returncode, stdout,
    stderr), the returncode the first failing rank's (a signal: negative), else 0."""
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's store
    folder, world = tempfile.mkdtemp(prefix="ranks-"), str(nproc)
    common = {**(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": world,
              "LOCAL_WORLD_SIZE": world, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
              "ROLE_WORLD_SIZE": world, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
              "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    children = [Child(argv, {**common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}, HERE,
                      folder=folder) for r in range(nproc)]
    deadline = time.time() + timeout
    while True:
        failed = next((c for c in children if c.poll() not in (None, 0)), None)
        if failed is not None or all(c.poll() == 0 for c in children):
            break
        if time.time() > deadline:
            for c in children:
                c.kill()
            raise subprocess.TimeoutExpired(["torchrun", *argv], timeout, *_read(folder))
        time.sleep(0.05)
    if failed is not None:  # as torchrun's agent: the others get SIGTERM, and SIGKILL after 30 s
        if failed.poll() == EXIT_PEER_FAILED:  # (a peer's death seen first: let a crashed rank finish its
            for c in children:                 #  faulthandler report and die of its own signal, not ours)
                c.wait(5)
        for c in children:
            c.kill(signal.SIGTERM)
        for c in children:
            if c.wait(30) is None:
                c.kill()
                c.wait()
        # a crash is the first cause even when its peer's exit 4 was seen before it
        failed = next((c for c in children if c.poll() in (-signal.SIGSEGV, -signal.SIGABRT)), failed)
    return (failed.poll() if failed is not None else 0, *_read(folder, remove=True))
