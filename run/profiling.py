"""run/profiling.py: where a step's time goes. `--profile 5,6` traces those steps into the run directory and,
at the end of the run, prints their time by category (matmuls, attention, elementwise / memory-bound,
collectives, optimizer, host / idle) and draws it as a bar chart.

The tracer is the library's, as torchtitan's profiling.py uses it (torchtitan/tools/profiling.py:
`torch.profiler.profile` with `tensorboard_trace_handler`, a trace every N steps):
- eager, compile and graph mode: `torch.profiler` writes `profile/rankR.<ns>.pt.trace.json` through
  `tensorboard_trace_handler`: Chrome / Perfetto JSON (ui.perfetto.dev opens it) named as TensorBoard's
  PyTorch profiler plugin reads it (`tensorboard --logdir RUN/profile`). Each step is a
  `ProfilerStep#N` range, the name `torch.profiler.profile.step()` gives one, so the plugin's step view
  works; a JAX kernel called through jax_op.py is its custom op's range (`minititan::splash`);
- `--device xla`: torch_xla 2.9's own profiler (`torch_xla.debug.profiler.start_trace` / `stop_trace`,
  a TSL profiler session in this process; no server needed) writes `profile/plugins/profile/<time>/
  <host>.xplane.pb` (TensorBoard's profile plugin / XProf) and `<host>.trace.json.gz` beside it. On
  XLA:CPU the xplane holds the host side (tracing, compilation, `StepMarker`) and the program's
  thunks, one event per HLO fusion / dot, a JAX kernel inside them (jax_op's `call_jax`). It is read
  back with jax's `jax.profiler.ProfileData` (the same TSL XSpace format).

The breakdown is read from the written trace, not from the profiler object: each event's self time
(its span less its children's, on the step's own thread) goes to one category by its name (CATEGORIES)
or, for the optimizer, by the `minititan/optimizer` range it runs in (optim.py names it); the gaps
between events (Python, the loop) are host / idle. The sum is compared with the step's wall time
measured by the loop's own clock, read inside the step's range and around it. Under torchrun every
rank writes its own trace; rank 0 prints.
"""
import contextlib
import glob
import gzip
import json
import os
import re
import time

import torch

OPTIMIZER_RANGE = re.compile(r"^(minititan/(optimizer|clip)|Optimizer\.(step|zero_grad))")  # (ours; torch.optim's)

# Self time goes to the first category whose patterns match the event's name (case-insensitive);
# the autograd engine's node ranges first (their own time is the engine's, their aten ops are children).
CATEGORIES = (
    ("host / idle", (r"^autograd::engine", r"Backward\d*$", r"^ProfilerStep#")),
    ("collectives", (r"c10d", r"gloo", r"nccl", r"all[-_]?gather", r"reduce[-_]?scatter", r"all[-_]?reduce",
                     r"all[-_]?to[-_]?all", r"wait_tensor", r"record_param_comms", r"collective")),
    ("attention", (r"scaled_dot_product", r"flash_attention", r"efficient_attention", r"splash", r"attention")),
    ("matmuls", (r"^aten::(mm|addmm|bmm|baddbmm|_addmm_activation|linear|matmul)$", r"gmm", r"^dot", r"fused_linear",
                 r"gemm", r"convolution")),
    ("optimizer", (OPTIMIZER_RANGE.pattern,)),
    ("elementwise", (r"^aten::", r"^(cpp|triton)_", r"CompiledFxGraph", r"Torch-Compiled Region", r"fusion",
                     r"^minititan::", r"^[a-z][\w-]*(\.\d+)?$")),   # (the last: an HLO instruction's name)
)
ORDER = ("matmuls", "attention", "elementwise", "collectives", "optimizer", "host / idle")


def parse_steps(text, total_steps):
    """'5,6' or '5-8' or '3,10-12' -> the sorted steps; a ValueError saying what is wrong."""
    steps = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"--profile {text!r}: expected steps >= 1 such as 5,6 or 5-8")
        steps.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    if max(steps) > total_steps:
        raise ValueError(f"--profile {text!r}: step {max(steps)} is past --steps {total_steps}")
    return sorted(steps)


def category(name, in_optimizer=False):
    for cat, patterns in CATEGORIES:
        if cat == "optimizer" and in_optimizer:
            return cat
        if any(re.search(p, name, re.IGNORECASE) for p in patterns):
            return cat
    return "host / idle"   # (Python-level ranges, ours or the library's: host work)


def self_times(events):
    """[(name, start, duration)] of one thread -> {category: summed self time}, nesting by time
    (a range inside another is its child; a child's optimizer range is inherited)."""
    totals, stack = dict.fromkeys(ORDER, 0.0), []   # stack: [end, name, span, child time, in optimizer]

    def pop():
        end_, name, dur, child, opt = stack.pop()
        totals[category(name, opt)] += max(dur - child, 0.0)
    for name, start, dur in sorted(events, key=lambda e: (e[1], -e[2])):
        while stack and start >= stack[-1][0]:
            pop()
        if stack:
            stack[-1][3] += dur
        opt = bool(OPTIMIZER_RANGE.match(name) or (stack and stack[-1][4]))
        stack.append([start + dur, name, dur, 0.0, opt])
    while stack:
        pop()
    return totals


def torch_breakdown(path):
    """{step: {category: seconds}} of the ProfilerStep#N ranges in a torch.profiler Chrome trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = {}
    for e in events:
        m = re.fullmatch(r"ProfilerStep#(\d+)", e["name"])
        if m:
            lo, hi = e["ts"], e["ts"] + e["dur"]
            inside = [(x["name"], x["ts"] / 1e6, x["dur"] / 1e6) for x in events
                      if (x["pid"], x["tid"]) == (e["pid"], e["tid"]) and lo <= x["ts"] and x["ts"] + x["dur"] <= hi]
            steps[int(m.group(1))] = self_times(inside)
    return steps


def xla_breakdown(path):
    """{step: {category: seconds}} from torch_xla's xplane (read with jax.profiler.ProfileData): the
    ProfilerStep#N range on the Python thread; inside it the XLA program's run (PjRt's execute) split
    over its thunks' self times by HLO name; the rest of the step (tracing, the loop) host / idle."""
    from jax.profiler import ProfileData
    lines = [(line.name, [(e.name, e.start_ns / 1e9, e.duration_ns / 1e9) for e in line.events])
             for plane in ProfileData.from_file(path).planes if plane.name == "/host:CPU" for line in plane.lines]
    steps = {}
    for _, events in lines:
        for name, lo, dur in events:
            m = re.fullmatch(r"ProfilerStep#(\d+)", name)
            if not m:
                continue
            within = lambda e: lo <= e[1] and e[1] + e[2] <= lo + dur
            program = sum(d for ln, evs in lines for n, s, d in evs
                          if n == "PjRtCpuExecutable::ExecuteHelper" and within((n, s, d)))
            thunks = dict.fromkeys(ORDER, 0.0)
            for ln, evs in lines:
                if "PjRtCpuClient" in ln or "XLAEigen" in ln:   # the program's threads
                    inner = [e for e in evs if within(e) and not e[0].startswith(("ThreadpoolListener", "end: ", "ThunkExecutor"))]
                    for k, v in self_times(inner).items():
                        thunks[k] += v
            total = sum(thunks.values()) or 1.0
            steps[int(m.group(1))] = {k: program * v / total for k, v in thunks.items()}
            steps[int(m.group(1))]["host / idle"] += dur - program
    return steps


class Profiler:
    """The hook train.py calls: `with profiler.step(n):` around each training step; `close()` at the
    end of the run exports nothing more and prints the breakdown of the traced steps."""

    def __init__(self, steps, out_dir, rank, device, prints=True):
        self.steps, self.rank, self.xla, self.prints = set(steps), rank, torch.device(device).type == "xla", prints
        self.dir = os.path.join(out_dir, "profile")
        self.wall, self.bracket, self.traces, self.session = {}, {}, [], None

    def skipped_notes(self, start):
        """A run resumed at step `start` never runs the --profile steps up to it: a `note:` naming them
        (and saying when that leaves nothing traced), rather than a trace that silently never comes."""
        gone = sorted(n for n in self.steps if n <= start)
        if not gone:
            return []
        self.steps -= set(gone)
        named = f"{gone[0]}-{gone[-1]}" if len(gone) > 1 and gone[-1] - gone[0] == len(gone) - 1 else ",".join(map(str, gone))
        return [f"note: --profile step{'s' * (len(gone) > 1)} {named} {'are' if len(gone) > 1 else 'is'} not traced: the "
                f"run resumes at step {start + 1}{'' if self.steps else '; nothing is traced'}"]

    @contextlib.contextmanager
    def step(self, n):
        if n not in self.steps:
            yield
            return
        if self.session is None:
            self.session = self._start()
        # The clock read twice: inside the range (the step itself: `measured`) and around it (the step
        # with the range's opening and closing). The traced span lies between the two, whatever a GC
        # pause or a preemption while the range opens or closes adds to it (that is in the outer only).
        outer0 = time.perf_counter()
        with self._range(f"ProfilerStep#{n}"):
            t0 = time.perf_counter()
            yield
            self.wall[n] = time.perf_counter() - t0
        self.bracket[n] = time.perf_counter() - outer0
        if n + 1 not in self.steps:   # the end of a block of consecutive steps: one trace file
            self._stop()

    def _start(self):
        os.makedirs(self.dir, exist_ok=True)
        if self.xla:
            import torch_xla.debug.profiler as xp
            xp.start_trace(self.dir)
            return xp
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:  # (a CUDA build of torch without a GPU: kineto's "gpuGetDeviceCount failed" line, not ours)
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        handler = torch.profiler.tensorboard_trace_handler(self.dir, worker_name=f"rank{self.rank}")
        prof = torch.profiler.profile(activities=activities, on_trace_ready=handler)
        prof.start()
        return prof

    def _range(self, name):
        if self.xla:   # a TraceMe without torch_xla's IR scope: the step's sync must see no open scope
            import torch_xla
            return torch_xla._XLAC.profiler.TraceMe(name)
        return torch.profiler.record_function(name)

    def _stop(self):
        before = set(self._trace_files())
        if self.xla:
            self.session.stop_trace()
        else:
            self.session.stop()
        self.session = None
        self.traces += sorted(set(self._trace_files()) - before)

    def _trace_files(self):
        if self.xla:
            return glob.glob(os.path.join(self.dir, "plugins", "profile", "*", "*.xplane.pb"))
        return glob.glob(os.path.join(self.dir, f"rank{self.rank}.*.pt.trace.json"))

    def abandon(self):
        """A run that fails or is stopped inside a traced block: the trace so far is written (kept for
        the user) and the profiler stopped, since a profiler left running crashes the interpreter's
        teardown (SIGSEGV in record_function's callbacks) instead of the run's own exit code. A trace
        that cannot be written (the disk that failed the run) is dropped: the run's error is the one said."""
        if self.session is not None:
            with contextlib.suppress(Exception):
                self._stop()
            self.session = None

    def close(self):
        """Stop a trace still open (the run ended inside a block), then print and draw the breakdown."""
        if self.session is not None:
            self._stop()
        if not self.traces:
            return None
        read = xla_breakdown if self.xla else torch_breakdown
        per_step = {}
        for path in self.traces:
            per_step.update(read(path))
        steps = sorted(set(per_step) & set(self.wall))
        report = summarize({n: per_step[n] for n in steps}, {n: self.wall[n] for n in steps},
                           {n: self.bracket[n] for n in steps})
        report.update(traces=self.traces, logdir=self.dir)
        with open(os.path.join(self.dir, f"breakdown_rank{self.rank}.json"), "w") as f:
            json.dump(report, f, indent=1)
        if self.prints:
            print(describe(report), flush=True)
            chart(report, os.path.join(self.dir, "breakdown.png"))
        return report


def summarize(per_step, wall, bracket):
    """Mean seconds a step by category over the traced steps, beside the loop's measured wall time
    (inside the step's range) and the time around the range (`bracket_s`: the same, plus opening and
    closing the range)."""
    n = max(len(per_step), 1)
    mean = {k: sum(s[k] for s in per_step.values()) / n for k in ORDER}
    return {"steps": sorted(per_step), "category_s": mean, "traced_s": sum(mean.values()),
            "measured_s": sum(wall.values()) / n, "bracket_s": sum(bracket.values()) / n}


def describe(report):
    """The printed breakdown: one line per category, then how the sum compares with the clock."""
    total, wall = report["traced_s"], report["measured_s"]
    lines = [f"profile: steps {','.join(map(str, report['steps']))} traced to {', '.join(report['traces'])}"
             f" (open it in TensorBoard: tensorboard --logdir {report['logdir']}; or its .json / .trace.json.gz in"
             " ui.perfetto.dev)",
             f"profile: a step by category (mean over {len(report['steps'])}):"]
    lines += [f"  {k:<13} {v * 1e3:9.2f} ms {100 * v / max(total, 1e-12):5.1f}%" for k, v in report["category_s"].items()]
    lines.append(f"  {'sum':<13} {total * 1e3:9.2f} ms; step measured {wall * 1e3:.2f} ms ({100 * total / wall:.1f}%)")
    return "\n".join(lines)


def chart(report, path, title=None, predicted=None):
    """A horizontal bar per category (ms a step), the measured step time in the title; with `predicted`
    ({category: seconds}, planner.anchor) the prediction's bar beside each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats = list(report["category_s"])[::-1]
    fig, ax = plt.subplots(figsize=(6.4, 2.8 if predicted is None else 3.4))
    bars = [("measured (trace)", report["category_s"], "tab:blue")]
    bars += [("predicted (planner)", predicted, "tab:orange")] if predicted is not None else []
    h = 0.8 / len(bars)
    for i, (label, values, color) in enumerate(bars):
        ys = [y + (i - (len(bars) - 1) / 2) * h for y in range(len(cats))]
        ms = [values.get(k, 0.0) * 1e3 for k in cats]
        ax.barh(ys, ms, height=h, color=color, label=label)
        for y, v in zip(ys, ms):
            ax.text(v, y, f" {v:.0f}" if v >= 10 else f" {v:.1f}", va="center", fontsize=7)
    ax.set_yticks(range(len(cats)), cats)
    ax.set_xlabel("ms per step")
    if predicted is not None:
        ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title or f"steps {','.join(map(str, report['steps']))}: measured {report['measured_s'] * 1e3:.1f} ms, "
                 f"traced {report['traced_s'] * 1e3:.1f} ms", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def profile_call(fn, out_dir, name="step", device="cpu"):
    """One call of `fn` traced into out_dir/profile (planner.anchor, bench.py's rows): its report."""
    prof = Profiler([1], out_dir, name, device, prints=False)
    with prof.step(1):
        fn()
    return prof.close()
