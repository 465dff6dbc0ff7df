"""The suite's shared helpers: the tiny configurations, the corpus fixture, train.py in this process
or a fresh one, on torchrun's ranks (both started by tests/launch.py), a trainer driven step by step,
the comparisons."""
import dataclasses
import json
import os
import signal

import pytest
import torch

import data
from tests import launch
from model import ModelArgs, Transformer

HERE = launch.HERE  # the repository root
TINY = ["--set", "n_layers=2", "--set", "dim=64", "--set", "n_heads=4", "--set", "n_kv_heads=2",
        "--set", "ffn_dim=128", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2",
        "--log-interval", "1", "--warmup", "2", "--no-plot"]  # (loss.png: drawn where a test reads it)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus made from stdlib sources (no ../shared needed)."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    with open(os.path.join(data.stdlib_dir(), "argparse.py"), "rb") as f:
        path.write_bytes(f.read())
    return str(path)


def xla_flags(*flags):
    """XLA_FLAGS for a child that needs its own: the suite's (conftest.py: XLA:CPU at -O0) and `flags`."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


def run_train(args, env=None, timeout=300):
    """`python train.py ARGS` in a fresh process (a fork of one that has imported torch: tests/launch.py):
    (returncode, stdout, stderr)."""
    return launch.python(["train.py", *args], env, timeout=timeout)


@pytest.fixture(scope="session", autouse=True)
def fork_server():
    """The server every child process is forked from starts importing torch now, beside the first tests."""
    launch.warm()


@pytest.fixture
def ctrl_c_as_in_a_terminal():
    """SIGINT turned into KeyboardInterrupt in this process for the test, as in a terminal's foreground
    job, and so in the processes it starts (a handler is reset to the default across exec; a fork keeps
    it). Python does that only if SIGINT was not ignored when the interpreter started, and a script's
    background job (`pytest ... &`) starts with it ignored, which a run rightly keeps, and its engine
    too (the signal would be ignored: exit 0, or no exit at all). Restored after the test."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def background(fn, *args, **kw):
    """fn(*args, **kw) in a thread, for a call that waits on a child process: the child runs while this
    process does other work (an oracle, another child). On 2 cores, with children started as fresh
    interpreters, two such runs took 0.68x (XLA:CPU) to 0.81x (2-rank torchrun) of one after the other
    (much of a run was importing, on one core); forked children (tests/launch.py) import less, and an
    XLA child still imports torch_xla and compiles. `.result()` waits for it."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kw)
    pool.shutdown(wait=False)
    return future


_SHARED_RUNS = {}


def shared_run(args, tmp_path_factory, nproc=1):
    """The run of `args` on `nproc` torchrun ranks (1: one process, this one), run once per distinct
    (nproc, args) and read only by its callers: several tests compare against the same run (the
    one-process oracle of the multi-process tests; a multi-process run another test resumes)."""
    key = (nproc, tuple(args))
    if key not in _SHARED_RUNS:
        out = str(tmp_path_factory.mktemp("shared_run"))
        if nproc == 1:
            assert _main([*args, "--out-dir", out]) == 0  # (in this process: no second start of torch)
        else:
            rc, _, err = torchrun(nproc, [*args, "--out-dir", out])
            assert rc == 0, err[-3000:]
        _SHARED_RUNS[key] = out
    return _SHARED_RUNS[key]


def _records(out_dir, key):
    """{step: value of `key`} from a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in recs if key in r and "step" in r}


def start_record(out_dir):
    """The run's "start" event: where it ran ("device", "devices": ranks or SPMD devices), its sizes."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return next(r for r in map(json.loads, f) if r.get("event") == "start")


def ran_on(out_dir):
    """(device, devices) of a run, e.g. ("xla:0", 2) for XLA SPMD on 2 devices: a layout test's check that
    the run it compares is the layout it names (a silent fallback to one CPU process would match too)."""
    start = start_record(out_dir)
    return start["device"], start["devices"]


def losses(out_dir):
    return _records(out_dir, "loss")


def tiny_args(**kw):
    return dataclasses.replace(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128), **kw)


def _near(want, got, atol, rtol=0.0):
    """Every |got - want| <= atol + rtol |want|, and a NaN or Inf fails (torch.testing.assert_close):
    Python's max() over differences skips a NaN (max(0.0, nan) is 0.0). Lists compare in order,
    {step: value} dicts by step, with the same steps."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), (sorted(want), sorted(got))
        want, got = [want[k] for k in sorted(want)], [got[k] for k in sorted(want)]
    assert len(got) == len(want), (want, got)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=rtol, atol=atol)


# Shared helpers: train.py in this process or a subprocess, torchrun, a trainer driven step by step

def _main(argv):
    import train
    try:
        return train.main(argv)
    except SystemExit as exit_:
        return exit_.code


def _trainer(corpus, tmp_path, *extra):
    import train
    cfg = train.parse_config([*TINY, "--data", corpus, "--steps", "20", "--ckpt-interval", "0",
                                           "--eval-batches", "0", "--out-dir", str(tmp_path / "r"), *extra])
    return train.Trainer(cfg)


def _train_losses(trainer, steps=20, norms=None):
    """Losses of `steps` steps (and their pre-clip gradient norms appended to `norms`, if given)."""
    import optim as o
    out = []
    for i in range(1, steps + 1):
        x, y = trainer.task.batch(i)
        ce, norm = trainer.step_fn(x, y, torch.tensor(o.lr_at(i, trainer.cfg.lr, trainer.cfg.warmup, steps)))
        out.append(ce.item())
        if norms is not None:
            norms.append(norm.item())
    return out


def _ops_of_one_more_step(trainer):
    """The names torch.profiler (a public hook) records during one more step: which code ran, e.g.
    dynamo's "Torch-Compiled Region", inductor's "## Call CompiledFxGraph", our "minititan::" ops."""
    from torch.profiler import ProfilerActivity, profile
    x, y = trainer.task.batch(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step_fn(x, y, torch.tensor(1e-4))
    return {e.key for e in prof.key_averages()}


DIST_TINY = [*TINY, "--set", "ffn_dim=131"]  # 131: an uneven first dimension for the shards

def torchrun(nproc, args, timeout=300):
    """train.py on `nproc` gloo ranks, launched as torchrun launches them (tests/launch.ranks). A rank
    that dies of SIGSEGV or SIGABRT (about one run in fifty: glibc's malloc finding its heap corrupted
    inside gloo's worker thread, read from a core dump: docs/limits.md; every rank's own line otherwise
    correct) is reported as a warning (with the crashed rank's Python stack: faulthandler) and the run
    is repeated once from the same starting files; a second crash fails the test."""
    import shutil
    out_dir = args[args.index("--out-dir") + 1] if "--out-dir" in args else None
    before = _snapshot(out_dir)
    try:
        for attempt in (1, 2):
            rc, out, err = launch.ranks(nproc, ["train.py", *args], timeout=timeout)
            if attempt == 2 or rc not in (-signal.SIGSEGV, -signal.SIGABRT):
                return rc, out, err
            import warnings
            warnings.warn(f"torchrun {' '.join(args)}: a rank died of {signal.Signals(-rc).name}; repeating once:\n"
                          f"{err[-4000:]}")
            _restore(out_dir, before)
    finally:
        if before:  # (the snapshot's own temporary folder: it was left in /tmp by every torchrun of a run folder)
            shutil.rmtree(os.path.dirname(before), ignore_errors=True)


def _snapshot(path):
    """A copy of directory `path` as it is (None if there is none), for _restore."""
    import shutil
    import tempfile
    if not path or not os.path.exists(path):
        return None
    copy = os.path.join(tempfile.mkdtemp(), "copy")
    shutil.copytree(path, copy, symlinks=True)
    return copy


def _restore(path, copy):
    import shutil
    if path and os.path.exists(path):
        shutil.rmtree(path)
    if copy:
        shutil.copytree(copy, path, symlinks=True)


def _full_params(ckpt_dir, args, name=None):
    """Load a (possibly sharded) checkpoint into full, plain tensors in this process."""
    from run import checkpoint
    from run import resume
    import train
    cfg = train.parse_config(args)
    model = Transformer(train.model_args(cfg))
    if cfg.scan:  # stacked (L, ...) block weights, as --scan saves them
        import layer_scan
        model = layer_scan.stack_layers(model)
    state = {"model": model.state_dict()}
    path = os.path.join(ckpt_dir, name) if name else resume.find_resumable(ckpt_dir)[0]
    return checkpoint.load(path, state)["model"]


def _ranks_equal_one_process(single, multi, steps, args, keys=("grad_norm", "val_loss"), weights_atol=1e-5,
                             norms_rtol=1e-5):
    """The oracle of every data-parallel test: N ranks' run equals one process's on the same global
    batch. Losses at every step; pre-clip gradient norms (a gradient scale, a sum for a mean over ranks,
    hides behind clipping and Adam in the losses) and validation; final weights gathered whole.
    Returns the one process's full parameters."""
    want, got = losses(single), losses(multi)
    assert sorted(got) == list(range(1, steps + 1))
    _near(want, got, atol=1e-5)
    for key in keys:
        want, got = _records(single, key), _records(multi, key)
        assert sorted(got) == sorted(want) and len(want) >= 2, key
        _near(want, got, atol=0, rtol=norms_rtol)
    p_single = _full_params(os.path.join(single, "checkpoints"), args)
    p_multi = _full_params(os.path.join(multi, "checkpoints"), args)
    assert sorted(p_single) == sorted(p_multi)
    for name in p_single:
        assert_close(p_multi[name], p_single[name], name, rtol=0, atol=weights_atol)
    return p_single


def assert_close(actual, expected, name, **tolerance):
    """torch.testing.assert_close, its report of the mismatch's size (the largest difference, where,
    how many elements) kept and prefixed with `name` (a plain `msg=` replaces that report)."""
    torch.testing.assert_close(actual, expected, msg=lambda report: f"{name}: {report}", **tolerance)


GRADIENT_ROUNDING = 1e-6  # the perturbation below, a fraction of each tensor's rms gradient (see adam_spread)
# Two losses, one a mean of microbatch or rank means and the other one mean, differ by fp32 rounding only:
# measured up to 2 ulps (9.5e-7 at ~5.5, where an ulp is 4.8e-7: the tolerance sweep, this CPU); bounded at
# 8 ulps, relative (a microbatch or rank weighted wrong moves a loss by 1e-3 or more)
LOSS_RTOL = 8 * torch.finfo(torch.float32).eps


def with_gradient_rounding(fn):
    """fn() with every step's gradients perturbed by noise of GRADIENT_ROUNDING x each tensor's rms
    gradient (before clipping and AdamW), from a generator of its own (not the run's RNG)."""
    from unittest import mock
    import optim
    clip, noise = optim.clip_by_global_norm, torch.Generator().manual_seed(0)

    def perturbed(grads, *a, **kw):
        grads = [g + (g != 0) * GRADIENT_ROUNDING * g.pow(2).mean().sqrt() * torch.randn(g.shape, generator=noise)
                 for g in grads]
        return clip(grads, *a, **kw)
    with mock.patch.object(optim, "clip_by_global_norm", perturbed):
        return fn()


def largest_gap(a, b):
    """The largest |a[name] - b[name]| over two {name: tensor} dicts of the same names."""
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def adam_spread(args, tmp_path_factory):
    """How far one process's final weights move when each gradient element is perturbed by noise of
    GRADIENT_ROUNDING x its tensor's rms gradient, every step (with_gradient_rounding): the largest
    |difference| over all weights. A multi-rank run's gradients differ from one process's by the order
    of their sums (ulps of the summed terms, hence also large relative errors where terms cancel), and
    AdamW's normalization m / (sqrt(v) + eps) carries a small gradient's error into a full-size
    update: this measures that amplification on the run itself, for a weight bound derived from it
    rather than one set at one machine's noise. Run once per `args`, in this process."""
    key = ("adam_spread", tuple(args))
    if key not in _SHARED_RUNS:
        out = str(tmp_path_factory.mktemp("adam_spread"))
        assert with_gradient_rounding(lambda: _main([*args, "--out-dir", out])) == 0
        plain = _full_params(os.path.join(shared_run(args, tmp_path_factory), "checkpoints"), args)
        _SHARED_RUNS[key] = largest_gap(_full_params(os.path.join(out, "checkpoints"), args), plain)
    return _SHARED_RUNS[key]


def _files(run_dir):
    """{relative path: sha256} of everything under run_dir/checkpoints: 'nothing lost' = unchanged."""
    from run import checkpoint
    root = os.path.join(run_dir, "checkpoints")
    return {os.path.relpath(os.path.join(d, f), root): checkpoint.sha256_of(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


def peak_extra_rss(pids, fn):
    """(fn(), {pid: bytes}): each process's peak resident memory during fn() above its resident memory
    before it (Linux: /proc/PID/clear_refs "5" resets the peak, VmHWM; VmRSS is the memory now), less
    the file-backed pages fn() faulted in (RssFile's growth: the code of a library called for the first
    time, e.g. gloo's broadcast on a first push, ~0.2-1 MiB, which is not memory the code under test
    allocated). What a process allocated and touched, torch's tensors and Python's bytes alike."""
    def kib(pid, field):
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    before, files = {}, {}
    for pid in pids:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        before[pid], files[pid] = kib(pid, "VmRSS"), kib(pid, "RssFile")
    out = fn()
    return out, {pid: (kib(pid, "VmHWM") - before[pid] - max(0, kib(pid, "RssFile") - files[pid])) * 1024
                 for pid in pids}
