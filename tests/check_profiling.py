# profiling.py (--profile). Oracles: the trace file itself, read here without profiling.py (its events,
# their nesting), the loop's own clock (the breakdown's sum), the unprofiled run (losses), torchrun's
# ranks each with its own file
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import glob
import gzip
import json
import os

import pytest

from tests.common import (DIST_TINY, TINY, _main, _near, background, losses, ran_on, run_train, shared_run,
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


def _sums_to_the_clock(report):
    """The categories, read from the trace, add up to the step time the loop measured, within 10%."""
    assert set(report["category_s"]) == {"matmuls", "attention", "elementwise", "collectives", "optimizer", "host / idle"}
    assert abs(report["traced_s"] - report["measured_s"]) <= 0.1 * report["measured_s"], report
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


@pytest.mark.parametrize("value", ["0", "x", "3-2", "9"])
def test_bad_profile_value_is_refused_in_one_line(value, corpus, tmp_path, capsys):
    assert _main([*_base(corpus), "--profile", value, "--out-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --profile"), err
    assert not os.path.exists(tmp_path / "bad")


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
