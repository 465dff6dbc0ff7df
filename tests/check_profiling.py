# run/profiling.py (--profile). Oracles: the trace file itself, read here without run/profiling.py (its events,
# their nesting), the loop's own clock (the breakdown's sum), the unprofiled run (losses), torchrun's
# ranks each with its own file
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import glob
import gzip
import json
import os

import pytest

from tests.common import (DIST_TINY, HERE, TINY, _main, _near, background, losses, ran_on, run_train, shared_run,
                          torchrun)


def _base(corpus):
    return [*TINY, "--data", corpus, "--steps", "3", "--ckpt-interval", "0", "--eval-batches", "0"]


@pytest.fixture(scope="module")
def xla_profiled(corpus, tmp_path_factory):
    """An XLA:CPU run of the base with step 3 traced by torch_xla's profiler, started in the background
    by the first test that asks (it compiles while the eager runs go on in this process)."""
    out = str(tmp_path_factory.mktemp("xla_profiled"))
    args = [*_base(corpus), "--device", "xla", "--profile", "3", "--sample-tokens", "0", "--out-dir", out]
    return out, background(run_train, args, {"PJRT_DEVICE": "CPU"})


def _trace_events(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _step_events(events, n):
    """The complete events on the thread of range ProfilerStep#n, inside it."""
    step = next(e for e in events if e["name"] == f"ProfilerStep#{n}")
    return [e for e in events if e["tid"] == step["tid"] and step["ts"] <= e["ts"]
            and e["ts"] + e["dur"] <= step["ts"] + step["dur"]]


def _breakdown(out, rank=0):
    with open(os.path.join(out, "profile", f"breakdown_rank{rank}.json")) as f:
        return json.load(f)


# Two clocks (the trace's and the loop's perf_counter): the traced span may lie outside [measured,
# bracket] by their disagreement and the trace's microsecond timestamps. Measured here over 40 eager
# steps of 256^3 matmuls: never outside (traced - measured 125-300 us, bracket - traced 40-4100 us);
# CLOCKS_US is the allowance for the rounding (the check prints the size of a miss). The trace's
# clock also runs at its own rate: torch's profiler stamps events with the CPU's cycle counter, turned
# into wall time by a line fitted to (counter, clock) pairs read when the trace starts and ends, and
# on a busy machine (a whole suite's run) the fit's slope was off: both ranks of a 2-rank trace (~70 ms
# steps) spanned 0.6% more than the bracket around them (423 and 415 us). CLOCK_RATE bounds that, at
# 3x the worst seen (a trace missing a part of the step, the test's purpose, misses by far more: 18%
# when the step's own range lost its self time).
CLOCKS_US, CLOCK_RATE = 50, 0.02


def _sums_to_the_clock(report):
    """The categories, read from the trace, add up to the step time the loop measured: the traced span
    lies between the clock read inside the step's range and the clock read around it. (A fixed ratio
    failed on a busy machine: a preemption while the range closed put 2 ms, 17%, in the trace only.)"""
    assert set(report["category_s"]) == {"matmuls", "attention", "elementwise", "collectives", "optimizer", "host / idle"}
    traced, lo, hi = report["traced_s"], report["measured_s"], report["bracket_s"]
    lo, hi = lo * (1 - CLOCK_RATE), hi * (1 + CLOCK_RATE)
    assert lo - CLOCKS_US * 1e-6 <= traced <= hi + CLOCKS_US * 1e-6, \
        f"traced {traced * 1e3:.3f} ms is outside [measured, around the range] = [{lo * 1e3:.3f}, {hi * 1e3:.3f}] ms " \
        f"by {max(lo - traced, traced - hi) * 1e6:.0f} us: {report}"
    assert abs(sum(report["category_s"].values()) - report["traced_s"]) < 1e-9


def test_profile_writes_a_trace_of_the_steps_and_its_breakdown(corpus, tmp_path, tmp_path_factory, xla_profiled, capsys):
    out = str(tmp_path / "p")
    assert _main([*_base(corpus), "--profile", "2,3", "--out-dir", out]) == 0
    printed = capsys.readouterr().out
    traces = glob.glob(os.path.join(out, "profile", "rank0.*.pt.trace.json"))  # (TensorBoard's plugin's naming)
    assert len(traces) == 1 and traces[0] in printed and "profile: a step by category" in printed
    events = _trace_events(traces[0])  # Chrome / Perfetto JSON
    for n in (2, 3):
        names = [e["name"] for e in _step_events(events, n)]
        assert "aten::mm" in names or "aten::addmm" in names  # the step's matmuls
        optimizer = next(e for e in _step_events(events, n) if e["name"] == "minititan/optimizer")
        inside = {e["name"] for e in _step_events(events, n)
                  if optimizer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= optimizer["ts"] + optimizer["dur"]}
        assert {"aten::_foreach_lerp", "aten::_foreach_sqrt"} <= inside  # AdamW's ops, in its range
    report = _breakdown(out)
    assert report["steps"] == [2, 3]
    _sums_to_the_clock(report)
    # The matmul category is the matmul ops' own time, bounded from the file: at least most of the mm
    # spans, at most the outermost matmul-family spans (linear / matmul wrap mm; their own time counts)
    family = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
    spans = sum(e["dur"] for n in (2, 3) for e in _step_events(events, n) if e["name"] in family[:2])
    calls = [e for n in (2, 3) for e in _step_events(events, n) if e["name"] in family]
    outer = sum(e["dur"] for e in calls if not any(o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <=
                                                   o["ts"] + o["dur"] for o in calls))
    assert 0.8 * spans / 2e6 <= report["category_s"]["matmuls"] <= outer / 2e6 * 1.001
    assert report["category_s"]["optimizer"] > 0 and report["category_s"]["collectives"] == 0
    assert os.path.getsize(os.path.join(out, "profile", "breakdown.png")) > 1000
    # The rest of the run is unchanged: the same losses as the unprofiled run, bit for bit
    assert losses(out) == losses(shared_run(_base(corpus), tmp_path_factory))


def test_profile_in_graph_mode_traces_the_graph_step(corpus, tmp_path):
    out = str(tmp_path / "g")
    assert _main([*_base(corpus), "--steps", "2", "--mode", "graph", "--profile", "2", "--out-dir", out]) == 0
    (trace,) = glob.glob(os.path.join(out, "profile", "rank0.*.pt.trace.json"))
    names = {e["name"] for e in _step_events(_trace_events(trace), 2)}
    assert "aten::mm" in names or "aten::addmm" in names
    _sums_to_the_clock(_breakdown(out))


def test_profile_on_xla_writes_torch_xla_xplane(corpus, tmp_path_factory, xla_profiled):
    out, run = xla_profiled
    rc, stdout, err = run.result()
    assert rc == 0, err[-3000:]
    assert ran_on(out)[0].startswith("xla")
    (xplane,) = glob.glob(os.path.join(out, "profile", "plugins", "profile", "*", "*.xplane.pb"))
    assert xplane in stdout and os.path.getsize(xplane) > 0
    (trace,) = glob.glob(os.path.join(os.path.dirname(xplane), "*.trace.json.gz"))  # the same, as Perfetto JSON
    assert any(e["name"] == "ProfilerStep#3" for e in _trace_events(trace))
    report = _breakdown(out)
    _sums_to_the_clock(report)
    assert report["category_s"]["matmuls"] > 0   # the program's dot thunks
    _near(losses(shared_run(_base(corpus), tmp_path_factory)), losses(out), atol=1e-4)


def test_profile_under_torchrun_each_rank_writes_its_trace(corpus, tmp_path, tmp_path_factory):
    out = str(tmp_path / "d")
    plain = [*DIST_TINY, "--data", corpus, "--steps", "3", "--ckpt-interval", "0", "--eval-batches", "0"]
    multi = background(torchrun, 2, [*plain, "--mesh", "ici=2", "--profile", "3", "--out-dir", out])
    single = losses(shared_run(plain, tmp_path_factory))  # (the oracle, in this process, while the ranks run)
    rc, stdout, err = multi.result()
    assert rc == 0, err[-3000:]
    for rank in (0, 1):
        (trace,) = glob.glob(os.path.join(out, "profile", f"rank{rank}.*.pt.trace.json"))
        assert any(e["name"] == "ProfilerStep#3" for e in _trace_events(trace))
        report = _breakdown(out, rank)
        _sums_to_the_clock(report)
        assert report["category_s"]["collectives"] > 0  # the weights' all-gathers, the gradients' reduce-scatters
    assert stdout.count("profile: a step by category") == 1  # (rank 0 prints)
    _near(single, losses(out), atol=1e-5)


def test_profile_steps_a_resume_starts_past_are_said_in_one_note(corpus, tmp_path, capsys):
    """A run resumed at step 3: --profile 1-3 says steps 1-2 are not traced and traces step 3 (the trace
    file's own ProfilerStep#3); --profile 2 (all of it before the resume) says nothing is traced, and
    writes no trace."""
    out = str(tmp_path / "r")
    common = [*_base(corpus), "--steps", "4", "--ckpt-interval", "2", "--out-dir", out]
    assert _main([*common, "--halt-at", "2"]) == 0
    capsys.readouterr()
    assert _main([*common, "--resume", "--profile", "1-3", "--halt-at", "3"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: --profile steps 1-2 are not traced: the run resumes at step 3"], notes
    (trace,) = glob.glob(os.path.join(out, "profile", "rank0.*.pt.trace.json"))
    assert [e["name"] for e in _trace_events(trace) if e["name"].startswith("ProfilerStep#")] == ["ProfilerStep#3"]
    assert _main([*common, "--resume-from", "step_000002", "--profile", "2"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: --profile step 2 is not traced: the run resumes at step 3; nothing is traced"], notes
    assert glob.glob(os.path.join(out, "profile", "rank0.*.pt.trace.json")) == [trace]


@pytest.mark.parametrize("value", ["0", "x", "3-2", "9"])
def test_bad_profile_value_is_refused_in_one_line(value, corpus, tmp_path, capsys):
    assert _main([*_base(corpus), "--profile", value, "--out-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --profile"), err
    assert not os.path.exists(tmp_path / "bad")


def test_bench_refuses_a_profile_row_not_in_the_speed_table_and_two_kinds_of_run():
    """bench.py --profile ROW names a speed-table row; a misspelled one ran as train.py flags and wrote a
    failed row over bench_results/profile.md. Now one line, exit 2, and the file as it was. Two kinds
    of run at once (--flux --rollout: only the rollout rows ran) are argparse's refusal, exit 2."""
    from tests import launch
    path = os.path.join(HERE, "bench_results", "profile.md")
    before = open(path).read() if os.path.exists(path) else None
    rc, _, err = launch.python(["bench.py", "--profile", "plain", "--mode graf"], timeout=120)
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: --profile '--mode graf' is not a speed-table "
                                                                 "row; the rows: 'plain', "), err[-2000:]
    assert (open(path).read() if os.path.exists(path) else None) == before
    rc, _, err = launch.python(["bench.py", "--flux", "--rollout"], timeout=120)
    assert rc == 2 and err.strip().splitlines()[-1] == "bench.py: error: argument --rollout: not allowed with " \
                                                       "argument --flux", err[-2000:]


def test_anchor_prices_the_optimizer_bytes_once():
    """planner.anchor --profile's fix, by hand on the recorded inputs: the optimizer's bytes leave the
    elementwise term (which counted every op of the eager step, AdamW's too) and become the optimizer
    term at the same bandwidth; nothing else moves."""
    from planner import anchor
    rec, run, opt = anchor.RECORDED, anchor.DEFAULT_RUN, 1.5e8
    before = anchor.predict_step(rec["peak_flops"], rec["mem_bw"], run, rec["eager_bytes"])
    after = anchor.predict_step(rec["peak_flops"], rec["mem_bw"], run, rec["eager_bytes"], optimizer_bytes=opt)
    b, a = before["compute"], after["compute"]
    assert a["elementwise"] == pytest.approx(b["elementwise"] * (rec["eager_bytes"] - opt) / rec["eager_bytes"], rel=1e-9)
    assert a["optimizer"] == pytest.approx(opt / rec["mem_bw"], rel=1e-9)
    assert a["matmul"] == b["matmul"] and a["attention"] == b["attention"]
    assert after["step_s"] == pytest.approx(sum(a.values()) + after["host_overhead_s"], rel=1e-9)
    by_cat = anchor.predicted_by_category(after)
    assert by_cat["elementwise"] == pytest.approx(a["elementwise"]) and by_cat["optimizer"] == a["optimizer"]


@pytest.mark.parametrize("remeasured", [1e15, 1e3])
def test_mfu_is_never_above_1_when_the_cpu_peak_was_measured_under_load(remeasured, tmp_path, monkeypatch, capsys):
    """The CPU's peak is measured, at the start, under whatever else the machine runs: measured low
    (1e3 FLOP/s stands in for a peak taken while another job held the cores), a run reads faster than
    its own CPU, and the log printed an MFU above 100%. A window above the peak measures it again:
    the new measurement is the peak if it is above the window (1e15), else the window has no MFU (1e3)."""
    import re
    import device as dev
    import task as task_lib
    import train
    calls = []

    def measured(n=1024, repeats=5, fresh=False):  # the first measurement low; later ones `remeasured`
        calls.append(fresh)
        return 1e3 if len(calls) == 1 else remeasured
    monkeypatch.setattr(dev, "measure_cpu_matmul_peak", measured)
    monkeypatch.setitem(task_lib.WORKLOADS, "linreg", "tests.check_seams:LinearRegression")
    out = str(tmp_path / "run")
    cfg = train.parse_config(["--task", "linreg", "--steps", "4", "--batch-size", "8", "--eval-interval", "0",
                              "--ckpt-interval", "0", "--log-interval", "1", "--device", "cpu", "--out-dir", out])
    assert train.Trainer(cfg).run() == 0
    printed = [float(v) for v in re.findall(r"MFU ([0-9.]+)%", capsys.readouterr().out)]
    records = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "tflops" in r]
    assert all(v <= 100 for v in printed) and all(r.get("mfu", 0) <= 1 for r in records), (printed, records)
    assert len(records) == 4 and calls[0] is False and True in calls, calls
    if remeasured > 1e3:  # measured again once, then over the new peak: an MFU on every line
        assert len(printed) == 4 and all(r["peak_flops"] == remeasured and 0 < r["mfu"] for r in records), records
    else:  # the window is above every measurement: said, not a fraction above 1
        assert printed == [] and not any("mfu" in r for r in records), records
def child_train_signalled_at(step, sig, *argv):
    """(child process) train.py, except that signal `sig` arrives inside step `step`'s training, as from a
    `kill` while the step runs (inside a --profile range when it names the step)."""
    import signal
    import sys
    import train
    train_step = train.Trainer.train_step

    def train_step_signalled(self):
        if self.step == int(step):
            os.kill(os.getpid(), getattr(signal, sig))
        return train_step(self)
    train.Trainer.train_step = train_step_signalled
    sys.exit(train.main(list(argv)))  # (and the interpreter's teardown, as process.main)


def _real_python(argv, limits=None):
    """`python *argv` as a fresh interpreter (not a tests/launch.py fork, which leaves by os._exit: what is
    tested here happens in the interpreter's teardown): (returncode, stderr)."""
    import resource
    import subprocess
    import sys

    def set_limits():
        for kind, value in (limits or {}).items():
            resource.setrlimit(kind, (value, value))
    done = subprocess.run([sys.executable, *argv], cwd=HERE, capture_output=True, text=True, timeout=300,
                          preexec_fn=set_limits)
    return done.returncode, done.stderr


def test_a_run_stopped_inside_a_profile_range_ends_by_its_own_exit_code(corpus, tmp_path):
    """SIGTERM inside `--profile 2-40` and a full disk at a checkpoint inside `--profile 2-4` (a 256 KiB
    file-size limit), each in a real interpreter: the profiler is stopped on the way out, so the run
    ends as it promises, one line and 143 / 5, not in a crash of the profiler's teardown (SIGSEGV, 139)."""
    import resource
    args = [*TINY, "--data", corpus, "--eval-batches", "0", "--sample-tokens", "0"]
    term = background(_real_python, ["test_all.py", "child_train_signalled_at", "3", "SIGTERM", *args, "--steps", "40",
                                     "--ckpt-interval", "0", "--profile", "2-40", "--out-dir", str(tmp_path / "t")])
    rc, err = _real_python(["train.py", *args, "--steps", "4", "--ckpt-interval", "3", "--profile", "2-4",
                            "--out-dir", str(tmp_path / "f")], limits={resource.RLIMIT_FSIZE: 256 * 1024})
    assert rc == 5 and err.startswith("error: a write failed: writing checkpoint step_000003") and \
        err.count("\n") == 1, (rc, err[-3000:])
    rc, err = term.result()
    assert rc == 143 and err == "error: interrupted by SIGTERM at step 3; no checkpoint was written (a partial one " \
        "is removed)\n", (rc, err[-3000:])
    assert glob.glob(str(tmp_path / "t" / "profile" / "rank0.*.pt.trace.json"))  # (the steps traced so far: kept)
