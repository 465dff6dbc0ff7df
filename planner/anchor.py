"""anchor.py: the planner's one prediction that can be checked here. This CPU becomes the chip (its
measured fp32 GEMM rate at the step's own matmul and attention shapes, forward and backward; the
memory bandwidth eager PyTorch reaches on the layer's own non-matmul blocks, forward and backward;
an op's host cost through autograd), the default `llama3_debug` run (batch 32 x 128, eager, fp32) the workload; the
planner's predicted step is set beside the step measured in the same process. Eager fuses nothing,
so the non-matmul bytes are counted on the step as it runs (EagerBytes), not taken from the shape's
fused table.

    python -m planner.anchor [--flux]   # measure rates and the step; print predicted / measured (--flux: FLUX too)
    python -m planner.anchor --profile  # also each term beside a traced step's category (run/profiling.py),
                                        # drawn into ./<flavor>_profile.png

Everything is measured in one process, one after the other, because the machine is shared and noisy:
a ratio of numbers taken together means more than any one of them. The arithmetic (`predict_step`)
is pure: tests check it against a hand computation on recorded inputs (RECORDED), not against a live
timing. Nothing here is a TPU figure.
"""
import statistics
import time

from planner import chips as chips_lib
from planner import stepmodel
from planner.shapes import lm_shape
import optim
from planner.calibrate import family_shape
from model import FLAVORS
import data
import device as dev
import train
from run import profiling

# One measurement (python -m planner.anchor on the 2-core development machine: docs/profiling.md's CPU
# anchor, its first llama3_debug row), kept so
# tests can hold the arithmetic to it without timing anything.
RECORDED = {"measured_step_s": 9.062, "peak_flops": 2.183e10, "mem_bw": 8.996e8, "eager_bytes": 2329494464,
            "eager_ops": 1241, "forward_ops": 357, "autograd_op_s": 9.580e-05,
            "matmul_rates": {(4096, 192, 192): 8.503e9, (4096, 192, 64): 3.331e9, (4096, 192, 512): 1.300e10,
                             (4096, 512, 192): 1.402e10, (4096, 192, 256): 9.148e9},
            "attention_rate": 5.713e9}


def gemm_rate(n=1024):
    """FLOP/s of one fp32 n x n GEMM (what device.measure_cpu_matmul_peak takes the best of)."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    t0 = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - t0)


def bandwidth(cfg):
    """Bytes/s eager PyTorch moves through the layer's own non-matmul blocks, forward AND backward
    (autograd's backward of a norm or a gated activation is most of the step's non-matmul ops:
    reductions for the broadcast weights' gradients, products with the saved inputs), bytes counted
    as EagerBytes counts the step's (each op's inputs and outputs). The LM's blocks: the RMSNorm
    (square, mean, add, rsqrt, two multiplies) of a (batch, seq, dim) fp32 activation and the SwiGLU
    (silu(gate) * up) of a (batch, seq, ffn_dim) one; FLUX's: the adaLN (LayerNorm, then
    (1 + scale) x + shift) and the tanh GELU of its MLP. On this CPU that is several times below a
    large streaming add: small inner dims, broadcasts and reductions, each op unfused."""
    import torch
    F = torch.nn.functional
    x = torch.randn(cfg["batch_size"], cfg["tokens"], cfg["width"], requires_grad=True)
    w = torch.ones(cfg["width"], requires_grad=True)
    gate, up = (torch.randn(cfg["batch_size"], cfg["tokens"], cfg["ffn"], requires_grad=True) for _ in range(2))
    if cfg["task"] == "flux":
        shift = torch.zeros(cfg["batch_size"], 1, cfg["width"], requires_grad=True)
        outs = lambda: ((1 + w) * F.layer_norm(x, x.shape[-1:], eps=1e-6) + shift, F.gelu(gate, approximate="tanh"))
    else:
        outs = lambda: (rms_norm(x, w), F.silu(gate) * up)
    grads = [torch.randn_like(x), torch.randn(gate.shape)]

    def blocks():
        for t in (x, w, gate, up):
            t.grad = None
        torch.autograd.backward(outs(), grads)
    counter = EagerBytes()
    with counter:
        blocks()
    t0 = time.perf_counter()
    blocks()
    return counter.total / (time.perf_counter() - t0)


def dispatch_latency(repeats=200):
    """Seconds the host spends on one eager op whose work is nothing (a 1-element add): PyTorch's
    dispatch, allocation and Python overhead, paid by every op the step runs."""
    import torch
    a, b = torch.ones(1), torch.ones(1)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.add(a, b)
    return (time.perf_counter() - t0) / repeats


def shape_matmul_rates(cfg, shape):
    """FLOP/s of each of the step's own matmuls, forward and backward (dX and dW) through autograd as
    nn.Linear runs them (`F.linear` on (batch x rows, k) by an (n, k) weight), keyed by (rows, k, n):
    3 x the forward FLOPs over the time of all three. Small dims (the debug model's 64-192) run far
    below the 1024^3 rate on this CPU, and the backward's transposed operands differ from the forward."""
    import torch
    rates = {}
    for mm in shape.matmuls:
        key = (int(mm.rows * cfg["batch_size"]), int(mm.k), int(mm.n))
        if key in rates:
            continue
        rows, k, n = key
        x = torch.randn(rows, k, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True)
        g = torch.randn(rows, n)
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w).backward(g)
        rates[key] = 3 * 2 * rows * k * n / (time.perf_counter() - t0)
    return rates


def autograd_op_latency(repeats=200):
    """Seconds one eager op costs the host when it goes through autograd, forward and backward: a chain
    of 1-element multiplies recorded on the graph, then its backward (each node run by the engine)."""
    import torch
    x, w = torch.ones(1, requires_grad=True), torch.ones(1)
    t0 = time.perf_counter()
    y = x
    for _ in range(repeats):
        y = y * w
    y.backward()
    return (time.perf_counter() - t0) / repeats


STEP_KINDS = (("matmul", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
              ("attention", ("scaled_dot_product", "flash_attention")),
              ("autograd engine", ("autograd::", "Backward")),
              ("optimizer", ("Optimizer", "_foreach", "adam")),
              ("aten other", ("aten::",)))


def step_profile(run_step):
    """Self-CPU seconds (and op counts) of one step by kind (torch.profiler): the step's matmuls, its
    attention, the autograd engine's own work (graph nodes), the optimizer, every other aten op
    (elementwise, reductions, copies), and the rest (Python, module calls); plus the step's wall time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run_step()
        wall = time.perf_counter() - t0
    secs, counts, top = {}, {}, []
    for e in prof.key_averages():
        top.append((e.self_cpu_time_total / 1e6, e.count, e.key))
        kind = next((k for k, pats in STEP_KINDS if any(p in e.key for p in pats)), "rest")
        secs[kind] = secs.get(kind, 0.0) + e.self_cpu_time_total / 1e6
        counts[kind] = counts.get(kind, 0) + e.count
    return wall, secs, counts, sorted(top, reverse=True)[:14]


def host_overhead(forward_ops, autograd_op_s):
    """The step's host cost: each op its forward records on the autograd graph (counted by EagerBytes:
    the ops run with grad mode on) costs what a 1-element op costs forward and backward through
    autograd (autograd_op_latency: dispatch, recording the node, the engine running it). The
    backward's and the optimizer's own ops are in that cost or in the bandwidth probe's."""
    return forward_ops * autograd_op_s


def rms_norm(x, w):
    """The model's RMSNorm written out in eager ops (model.py's norm, as the CPU step runs it)."""
    import torch
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


MATMUL_OPS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten._scaled_dot_product", "aten.embedding.")
ZERO_COPY = ("view", "reshape", "transpose", "permute", "expand", "aten.t.", "alias", "slice", "select",
             "unsqueeze", "squeeze", "detach", "split", "unbind", "as_strided", "_unsafe_view")


def _eager_bytes_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class EagerBytesMode(TorchDispatchMode):
        """Counts, for every aten op that runs (forward, autograd's backward, the optimizer), the bytes
        of its tensor inputs and outputs, except matmuls, attention and zero-copy views: what eager
        PyTorch, which fuses nothing, moves through memory outside the FLOP terms."""
        total = 0
        ops = 0      # every aten op dispatched, views and matmuls included: each pays the host's dispatch
        forward_ops = 0   # of them, those run with grad mode on (the forward, recorded on the autograd graph)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch
            from torch.utils._pytree import tree_leaves
            out = func(*args, **(kwargs or {}))
            self.ops += 1
            self.forward_ops += torch.is_grad_enabled()
            name = str(func)
            if not any(m in name for m in MATMUL_OPS + ZERO_COPY):
                self.total += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                  if isinstance(t, torch.Tensor))
            return out
    return EagerBytesMode


def EagerBytes():
    """A fresh counting mode (`with EagerBytes() as c: ...; c.total, c.ops`); the class is built on
    first use so importing anchor does not import torch."""
    return _eager_bytes_mode()()


def optimizer_bytes(trainer):
    """Bytes the eager step's clipping and AdamW move (EagerBytes on one call of each, on zero gradients
    of the trainer's parameters; pure functions, nothing updated): a part of the step's counted bytes
    that stepmodel's optimizer term prices on its own."""
    import torch
    params = [p.detach() for p in trainer.parallel.local(trainer.params)]
    grads = [torch.zeros_like(p) for p in params]
    counter = EagerBytes()
    with counter, torch.no_grad():
        clipped, _ = optim.clip_by_global_norm(grads, 1.0)
        optim.adamw(params, clipped, trainer.opt.state, 1, 1e-3, mask=trainer.opt.mask)
    return counter.total


def anchor_layout(cfg):
    """A debug run as the planner sees it: one device, fp32 everything, nothing recomputed, no causal
    block skipping (the CPU's SDPA computes the whole S x S)."""
    return stepmodel.Layout(ici=1, local_batch=cfg["batch_size"], remat="none", precision=stepmodel.PRECISIONS["fp32"],
                            act_bytes=4, attention_block=cfg["tokens"])


def run_shape(cfg):
    """The Shape of a debug run: llama3_debug at its sequence length, or flux_debug on 8 x 8 digits
    (16 packed image tokens beside 4 learned prompt tokens)."""
    if cfg["task"] == "flux":
        shape = family_shape("flux", ["--flavor", cfg["flavor"]])
        assert shape.tokens == cfg["tokens"], (shape.tokens, cfg)
        return shape
    return lm_shape(FLAVORS[cfg["flavor"]], cfg["tokens"], cfg["flavor"])


def predict_step(peak_flops, mem_bw, cfg, eager_bytes, host_s=0.0, matmul_rates=None, attention_rate=None,
                 optimizer_bytes=None):
    """The planner's step for a debug run on a chip with this peak and bandwidth: matmuls at the
    measured peak (it was measured on a matmul) less stepmodel's short-dim law, the non-matmul bytes
    the eager step moves (`eager_bytes`, counted as it ran: it replaces the shape's fused count,
    because eager PyTorch fuses nothing) at the measured eager bandwidth; the host overhead `host_s`.
    With `matmul_rates` ({(rows, k, n): FLOP/s}, shape_matmul_rates) each matmul runs forward and
    backward at its own measured rate instead of the short-dim law; with `attention_rate`
    (FLOP/s, attention_rate) attention runs at it instead of peak x ATTENTION_RELATIVE_EFFICIENCY.
    With `optimizer_bytes` (optimizer_bytes: the clipping's and AdamW's share of `eager_bytes`) those
    bytes are the optimizer term at the eager bandwidth and leave the elementwise term (without it they
    are in both: the elementwise term counts every op of the step, AdamW's too)."""
    import dataclasses
    if optimizer_bytes is not None:
        eager_bytes -= optimizer_bytes
    shape = run_shape(cfg)
    tokens_layers = shape.tokens * cfg["batch_size"] * shape.layers
    lay = anchor_layout(cfg)
    shape = dataclasses.replace(shape, elementwise=eager_bytes / (lay.act_bytes * 3 * tokens_layers), vocab=0)
    chip = dataclasses.replace(chips_lib.measured_chip(peak_flops, mem_bw, hbm_bytes=float("inf")), host_overhead_s=host_s)
    pred = stepmodel.predict(shape, lay, chip, {"matmul_efficiency": 1.0, "moe_efficiency": 1.0})
    c, b = pred["compute"], cfg["batch_size"]
    before = c["matmul"] + c["attention"]
    if matmul_rates:
        c["matmul"] = sum(3 * mm.flops * b / matmul_rates[(int(mm.rows * b), int(mm.k), int(mm.n))]
                          for mm in shape.matmuls)
    if attention_rate:
        a = shape.attention
        c["attention"] = 3.5 * 4 * a["seq"] ** 2 * a["heads"] * a["head_dim"] * a["layers"] * b / attention_rate
    pred["step_s"] += c["matmul"] + c["attention"] - before
    if optimizer_bytes is not None:
        pred["step_s"] += optimizer_bytes / mem_bw - c["optimizer"]
        c["optimizer"] = optimizer_bytes / mem_bw
    return pred


def attention_rate(cfg, shape):
    """FLOP/s of the step's own attention (F.scaled_dot_product_attention at its batch, heads, sequence
    and head dim, causal for the LM), forward and backward through autograd, counted as stepmodel
    counts it: 4 S^2 H hd a sample forward, 3.5x that forward + backward."""
    import torch
    a = shape.attention
    q, k, v, g = (torch.randn(cfg["batch_size"], a["heads"], a["seq"], a["head_dim"], requires_grad=i < 3)
                  for i in range(4))
    t0 = time.perf_counter()   # backward from a dense gradient, as the step's (a .sum()'s is a stride-0 one)
    torch.autograd.backward(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=a["causal"]), g)
    return 3.5 * 4 * a["seq"] ** 2 * a["heads"] * a["head_dim"] * cfg["batch_size"] / (time.perf_counter() - t0)


def measure(cfg, steps=12, profile=False):
    """Medians of a debug run's eager training step and, between its steps (so under the same load),
    of the GEMM rate, the step's own matmuls' and attention's rates, the eager bandwidth, the dispatch
    latency of an empty op and the per-op cost through autograd (3 warm-up steps not counted); the
    non-matmul bytes and the ops of one more step, counted as it runs (EagerBytes); and one more,
    profiled by kind (step_profile)."""
    flags = ["--task", cfg["task"], "--flavor", cfg["flavor"], "--batch-size", str(cfg["batch_size"]),
             "--steps", str(steps), "--eval-batches", "0", "--ckpt-interval", "0", "--out-dir", "/tmp/minititan-anchor"]
    flags += ["--seq-len", str(cfg["tokens"]), "--data", data.stdlib_dir()] if cfg["task"] == "lm" else ["--watchdog", "0"]
    trainer = train.Trainer(train.parse_config(flags))
    shape = run_shape(cfg)
    run = lambda i: trainer.step_fn(*trainer.parallel.place_batch(trainer.task.batch(i)),
                                    dev.scalar(optim.lr_at(min(i, steps), 1e-3, 5, steps), trainer.device))[0].item()
    times, peaks, bws, lats, autograd_lats, mm_rates, att_rates = [], [], [], [], [], [], []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t0)
        peaks += [gemm_rate() for _ in range(3)]
        bws += [bandwidth(cfg) for _ in range(3)]
        lats.append(dispatch_latency())
        autograd_lats.append(autograd_op_latency())
        mm_rates.append(shape_matmul_rates(cfg, shape))
        att_rates.append(attention_rate(cfg, shape))
    counter = EagerBytes()
    with counter:   # one more step, counted (not timed)
        run(steps + 1)
    wall, secs, counts, top = step_profile(lambda: run(steps + 2))
    if profile:   # three more steps traced, each into a file, broken down by category (run/profiling.py):
        breakdown = min((profiling.profile_call(lambda: run(steps + 3 + i), trainer.out_dir, f"{cfg['flavor']}{i}")
                         for i in range(3)), key=lambda r: r["measured_s"])
    opt_bytes = optimizer_bytes(trainer)
    med = statistics.median
    return {"measured_step_s": med(times[3:]), "peak_flops": med(peaks[9:]),
            "mem_bw": med(bws[9:]), "eager_bytes": counter.total,
            "host_s": counter.ops * med(lats[3:]), "eager_ops": counter.ops, "optimizer_bytes": opt_bytes,
            "forward_ops": counter.forward_ops, "dispatch_s": med(lats[3:]), "autograd_op_s": med(autograd_lats[3:]),
            "matmul_rates": {key: med(r[key] for r in mm_rates[3:]) for key in mm_rates[0]},
            "attention_rate": med(att_rates[3:]),
            "profile": {"wall_s": wall, "self_s": secs, "ops": counts, "top": top},
            **({"breakdown": breakdown} if profile else {})}


# The planner's terms (stepmodel.predict) as the trace's categories (profiling.ORDER) count them
AS_MEASURED = {"matmuls": ("matmul", "recompute"), "attention": ("attention",),
               "elementwise": ("elementwise", "logits", "gathered copies"), "optimizer": ("optimizer",)}


def predicted_by_category(pred):
    """{category: predicted seconds}: the compute terms grouped, the exposed collectives, the host."""
    out = {cat: sum(pred["compute"].get(t, 0.0) for t in terms) for cat, terms in AS_MEASURED.items()}
    return {**out, "collectives": pred["exposed_comm_s"], "host / idle": pred["host_overhead_s"]}


def beside(name, pred, report, step_s, chart_path=None):
    """Predicted terms beside the traced step's categories, each category scaled from the traced step
    to `step_s` (the median untraced step: the trace gives the shares, the clock the step; a traced
    step on this shared machine runs 1-2x the median): ms each, the ratio, and whether a term that is
    >= 10% of the step lands within +-30% (the goal); optionally the chart of both."""
    want = predicted_by_category(pred)
    scale = step_s / report["traced_s"]
    got = {k: v * scale for k, v in report["category_s"].items()}
    lines = [f"  {name}: predicted beside measured (the fastest of 3 traced steps, {report['measured_s'] * 1e3:.0f} ms, "
             f"its categories scaled x{scale:.2f} to the {step_s * 1e3:.0f} ms median step)",
             f"    {'category':<13} {'predicted':>10} {'measured':>10}  ratio  share  within 30%"]
    for cat in profiling.ORDER:
        p, m = want.get(cat, 0.0), got[cat]
        ratio = f"{p / m:5.2f}" if m > 0 else "    -"
        verdict = ("yes" if abs(p / m - 1) <= 0.3 else "NO") if m >= 0.1 * step_s else "(< 10%)"
        lines.append(f"    {cat:<13} {p * 1e3:8.1f}ms {m * 1e3:8.1f}ms  {ratio}  {100 * m / step_s:4.0f}%  {verdict}")
    lines.append(f"    {'step':<13} {pred['step_s'] * 1e3:8.1f}ms {step_s * 1e3:8.1f}ms  {pred['step_s'] / step_s:5.2f}")
    if chart_path:
        profiling.chart({**report, "category_s": got}, chart_path, predicted=want, title=f"{name} on this CPU: measured "
                        f"{step_s * 1e3:.0f} ms (median), predicted {pred['step_s'] * 1e3:.0f} ms")
    return "\n".join(lines)


# The default runs (train.py's defaults: batch 32; the LM at 128 tokens, FLUX on 8 x 8 digits), with
# the widths the bandwidth probe uses: llama3_debug's dim / ffn_dim, flux_debug's hidden / 4 x hidden.
RUNS = {
    "llama3_debug": {"task": "lm", "flavor": "llama3_debug", "batch_size": 32, "tokens": 128, "width": 192, "ffn": 512},
    "flux_debug": {"task": "flux", "flavor": "flux_debug", "batch_size": 32, "tokens": 20, "img_tokens": 16,
                   "width": 128, "ffn": 512},
}
DEFAULT_RUN = RUNS["llama3_debug"]


USAGE = ("usage: python -m planner.anchor [--flux] [--profile]\n  this CPU as the chip: the default llama3_debug step "
         "measured and predicted (~2 min); --flux: the flux_debug step too (~4.5 min); --profile: the predicted "
         "terms beside a traced step's categories, and a chart")


def main(argv=()):
    if set(argv) & {"-h", "--help"}:
        print(USAGE)
        return 0
    if set(argv) - {"--flux", "--profile"}:
        raise ValueError(f"python -m planner.anchor takes only --flux (the FLUX debug step too) and --profile "
                         f"(predicted terms beside a traced step's categories), got {' '.join(argv)}")
    for name in ["llama3_debug"] + (["flux_debug"] if "--flux" in argv else []):
        cfg = RUNS[name]
        m = measure(cfg, profile="--profile" in argv)
        old = predict_step(m["peak_flops"], m["mem_bw"], cfg, m["eager_bytes"], m["host_s"])
        host = host_overhead(m["forward_ops"], m["autograd_op_s"])
        pred = predict_step(m["peak_flops"], m["mem_bw"], cfg, m["eager_bytes"], host, m["matmul_rates"], m["attention_rate"],
                            m["optimizer_bytes"])
        print(f"CPU anchor, {name} (batch {cfg['batch_size']} x {cfg['tokens']} tokens, eager fp32): fp32 GEMM "
              f"{m['peak_flops'] / 1e9:.1f} GFLOP/s, eager bandwidth (norm + gated activation, forward + backward) {m['mem_bw'] / 1e9:.2f} GB/s, "
              f"{m['eager_bytes'] / 1e9:.3f} GB of non-matmul traffic and {m['eager_ops']} ops a step (measured now)")
        print(f"  measured {m['measured_step_s'] * 1e3:.1f} ms a step, predicted {pred['step_s'] * 1e3:.1f} ms, "
              f"ratio {pred['step_s'] / m['measured_step_s']:.2f} (before: 1024^3 GEMM rate under the short-dim law, "
              f"empty-op dispatch: {old['step_s'] * 1e3:.1f} ms, "
              f"ratio {old['step_s'] / m['measured_step_s']:.2f})")
        for k, v in pred["compute"].items():
            print(f"    {k:<16} {v * 1e3:8.2f} ms   (old {old['compute'][k] * 1e3:8.2f})")
        print(f"    host overhead    {pred['host_overhead_s'] * 1e3:8.2f} ms ({m['forward_ops']} forward ops x "
              f"{m['autograd_op_s'] * 1e6:.1f} us through autograd; old {old['host_overhead_s'] * 1e3:.2f})")
        p = m["profile"]
        print(f"  profiled step (torch.profiler, self CPU): wall {p['wall_s'] * 1e3:.1f} ms, "
              + ", ".join(f"{k} {v * 1e3:.1f} ms / {p['ops'][k]} ops" for k, v in sorted(p["self_s"].items())))
        print("  profiled step, top ops by self CPU: " + "; ".join(f"{k} {t * 1e3:.0f} ms x{n}" for t, n, k in p["top"]))
        if "--profile" in argv:
            print(beside(name, pred, m.pop("breakdown"), m["measured_step_s"], f"{cfg['flavor']}_profile.png"))
        print(f"  recorded inputs: {m}")
    return 0


if __name__ == "__main__":
    import sys
    try:
        sys.exit(main(sys.argv[1:]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
