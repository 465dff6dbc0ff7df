"""bench.py: measurements, not tests. Speed, MFU and memory, side by side, as ratios within one run.

    .venv/bin/python bench.py --quick        # < 5 min on 2 cores
    .venv/bin/python bench.py                # the full set
    .venv/bin/python bench.py --rollout      # only the rollout engines (ours vs vLLM, .venv-tpu)
    .venv/bin/python bench.py --flux         # only FLUX's training step (bench_flux.py)

Each configuration runs in its own process (so peak memory is its own), configurations alternate
A B A B across repeats, and each figure is the median of several timed steps after warm-up. Ratios
to the baseline (a plain PyTorch loop with torch.optim.AdamW(foreach=True), as a nanoGPT user writes
it) are computed inside the same run, because machines here are noisy. Writes bench_results/*.md and
*.json; docs/measured.md keeps the tables it quotes, each with its command.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import atomic
import bench_flux
from bench_rollout import rollout_table
from model import plain_cross_entropy
import train
import device as dev
import optim
from run import profiling
import data
import device

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------
# Child side: one configuration, printed as one JSON line.

def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _child_memory(kind, size):
    """Peak RSS growth of one (warmed-up) forward + backward of a kernel vs its plain PyTorch path."""
    import gc
    import torch
    import kernels_pallas as kp  # noqa: F401 (jit caches, imports: part of the baseline)
    torch.manual_seed(0)
    if kind.startswith("loss"):
        N, D = 4096, 256
        h, w = torch.randn(N, D, requires_grad=True), torch.randn(size, D, requires_grad=True)
        t = torch.randint(0, size, (N,))
        fn = (lambda: kp.fused_linear_cross_entropy(h, w, t)) if kind == "loss_fused" else (lambda: plain_cross_entropy(h, w, t))
        args = (h, w)
    else:
        H, D = 4, 64
        q, k, v = (torch.randn(1, H, size, D, requires_grad=True) for _ in range(3))
        fn = (lambda: kp.splash_attention(q, k, v)) if kind == "attn_splash" else (lambda: _dense_attention(q, k, v))
        args = (q, k, v)
    torch.autograd.grad(fn().float().sum(), args)  # warm-up: JAX compilation is a one-off, not the step
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:   # reset the RSS high-water mark (Linux)
        f.write("5")
    base = _status_kib("VmRSS")
    out = fn()
    torch.autograd.grad(out.float().sum(), args)
    peak = _status_kib("VmHWM")
    return {"kind": kind, "size": size, "peak_growth_mib": (peak - base) / 1024}


def _dense_attention(q, k, v):
    """The textbook formula: softmax(QK^T / sqrt(d) + causal mask) V, with its S x S scores."""
    S = q.shape[2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v


def bench_trainer(config, argv):
    """(trainer, step(*batch, lr) -> (reported loss, pre-clip norm)) for one configuration: `plain` (a
    torch.optim loop, what a nanoGPT user writes) or train.py flags such as "--mode graph --backend inductor"."""
    cfg = train.parse_config(["--eval-batches", "0", "--ckpt-interval", "0", "--out-dir", "/tmp/minititan-bench",
                              *argv, *([] if config == "plain" else config.split())])
    trainer = train.Trainer(cfg)  # (--device xla --mesh: one process over CPU_NUM_DEVICES XLA devices)
    params = trainer.params
    torch_opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def plain_step(*batch_and_lr):
        reported, loss = trainer.task.loss(trainer.model, batch_and_lr[:-1])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        torch_opt.step()
        torch_opt.zero_grad(set_to_none=True)
        return reported.detach(), norm

    return trainer, plain_step if config == "plain" else trainer.step_fn


def _child_train(config, steps, extra="", profile_dir=""):
    """Tokens/s of the bench model for one configuration (see bench_trainer); with `profile_dir`, one
    more step traced there and its time by category (run/profiling.py)."""
    trainer, step = bench_trainer(config, ["--steps", str(steps), "--data", _bench_data(), *extra.split()])
    cfg = trainer.cfg
    times = []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        ce, _ = step(*trainer.parallel.place_batch(trainer.task.batch(i)), dev.scalar(optim.lr_at(i, 1e-3, 5, steps), trainer.device))
        dev.sync(trainer.device)
        ce.item()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[max(2, steps // 3):])
    tokens = cfg.batch_size * cfg.seq_len
    flops = trainer.flops_per_step / med
    peak = dev.measure_cpu_matmul_peak()
    result = {"mode": config, "tokens_per_s": tokens / med, "tflops": flops / 1e12, "mfu": flops / peak,
              "first_step_s": times[0], "peak_rss_mib": dev.host_peak_rss_bytes() / 2**20}
    if profile_dir:
        one = lambda: step(*trainer.parallel.place_batch(trainer.task.batch(steps + 1)),  # noqa: E731
                           dev.scalar(optim.lr_at(steps, 1e-3, 5, steps), trainer.device))[0].item()
        result["profile"] = profiling.profile_call(one, profile_dir, "bench", trainer.device)
    if dev.is_xla(trainer.device):  # XLA's own compile clock, apart from tracing and running step 1
        import torch_xla.debug.metrics as met
        _, _, samples = met.metric_data("CompileTime")
        result["xla_compile_s"] = max(v for _, v in samples) / 1e9  # the step program (the largest)
    return result


def _bench_data():
    """The default corpus (this Python's stdlib sources): every clone has it, nothing to download.
    Throughput does not depend on which text the random windows come from."""
    return data.stdlib_dir()


# ------------------------------------------------------------------------------------------------
# Parent side

def cpu_peak_flops():
    """This CPU's measured fp32 GEMM peak (a process of its own): every row's MFU is over it."""
    return _spawn("peak")["flops"]


def _spawn(*args):
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    if any("--mesh" in str(a) for a in args):  # an XLA SPMD mesh: 4 virtual devices in one process
        env["CPU_NUM_DEVICES"] = "4"
    proc = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], cwd=HERE,
                          capture_output=True, text=True, timeout=1200, env=env)
    results = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not results:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(results[-1])


def memory_tables(quick):
    vocabs = [4096, 32768] if quick else [4096, 16384, 32768, 65536]
    seqs = [1024, 4096] if quick else [1024, 2048, 4096, 8192]
    rows = []
    for v in vocabs:
        plain, fused = _spawn("mem", "loss_plain", v), _spawn("mem", "loss_fused", v)
        rows.append(("loss", v, plain.get("peak_growth_mib"), fused.get("peak_growth_mib")))
    for s in seqs:
        dense, splash = _spawn("mem", "attn_dense", s), _spawn("mem", "attn_splash", s)
        rows.append(("attention", s, dense.get("peak_growth_mib"), splash.get("peak_growth_mib")))
    return rows


def speed_table(modes, repeats, steps, extra=""):
    results = {m: [] for m in modes}
    for _ in range(repeats):  # A B A B: drift hits every configuration alike
        for m in modes:
            results[m].append(_spawn("train", m, steps, extra))
    table = []
    for m in modes:
        ok = [r for r in results[m] if "error" not in r]
        if not ok:
            table.append({"mode": m, "error": results[m][0]["error"]})
            continue
        table.append({k: statistics.median(r[k] for r in ok) if k != "mode" else m for k in ok[0]})
    base = next((r["tokens_per_s"] for r in table if r["mode"] == "plain" and "error" not in r), None)
    peak = cpu_peak_flops()  # one measurement of this CPU's GEMM peak for every row
    for r in table:
        if base and "error" not in r:
            r["ratio_to_plain"] = r["tokens_per_s"] / base
            r["mfu"] = r["tflops"] * 1e12 / peak
    return table


QUICK_CONFIGS = ["plain", "--mode eager", "--mode compile", "--mode graph --backend inductor",
                 "--mode graph --device xla"]
FULL_CONFIGS = ["--mode graph", "--mode eager --device xla", "--mode graph --backend inductor --remat",
                "--mode graph --backend inductor --scan", "--mode eager --kernels pallas",
                "--mode graph --backend inductor --split 4", "--mode graph --device xla --scan",
                "--mode graph --device xla --mesh ici=4"]


def markdown_table(header, rows, cells):
    """Markdown lines: the header, its rule, then `cells(r)` per row (a row with an "error" says it)."""
    lines = ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    for r in rows:
        row = ([r["mode"], f"failed: {r['error'][:80]}"] + [""] * (len(header) - 2)) if "error" in r else cells(r)
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return lines


def flux_markdown(rows):
    return "\n".join([f"Machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; FLUX "
                      f"`{' '.join(bench_flux.FLUX_FLAGS[:8])}` (hidden 256, 8 heads, 2 double + 2 single blocks, 32 images x 20 tokens)",
                      ""] + markdown_table(
        ["FLUX step", "ms/step", "images/s", "x JAX step (throughput)", "TFLOP/s", "MFU (vs measured fp32 GEMM peak)",
         "ms: call / launch / wait (bench_flux.flux_table)", "warm-up s (2 steps, compiling alongside the others)"], rows,
        lambda r: [r["mode"], f"{r['ms_per_step']:.1f}", f"{r['images_per_s']:.0f}", f"{r.get('x_jax', float('nan')):.2f}",
                   f"{r['tflops']:.3f}", f"{100 * r['mfu']:.0f}%",
                   f"{r['call_ms']:.1f} / {r['launch_ms']:.1f} / {r['wait_ms']:.1f}", f"{r['warmup_s']:.1f}"]))


def rollout_markdown(rows):
    ours = {r["policy"]: r for r in rows if r["engine"] == "ours"}
    return "\n".join([f"Machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}; rollout "
                      f"engines on the same weights, 32 prompts x 8 samples, fp32, calls alternating", ""] + markdown_table(
        ["policy", "engine", "new tokens", "push ms (MiB)", "rollout s", "samples/s", "x ours", "engine start s"], rows,
        lambda r: [r["policy"], r["engine"], r["new_tokens"], f"{r['push_ms']:.1f} ({r['push_mib']:.2f})",
                   f"{r['rollout_s']:.3f}", f"{r['samples_per_s']:.0f}",
                   f"{r['samples_per_s'] / ours[r['policy']]['samples_per_s']:.2f}",
                   "" if r["start_s"] is None else f"{r['start_s']:.0f}"]))


def compile_vs_depth():
    """First-step (trace + compile + run) seconds against depth, with and without scan; on XLA also
    the compile of the step program alone, by torch_xla's CompileTime metric."""
    rows = []
    for layers in (2, 4, 8, 16):
        row = {"layers": layers}
        for name, config in (("inductor", "--mode graph --backend inductor"),
                             ("inductor+scan", "--mode graph --backend inductor --scan"),
                             ("xla", "--mode graph --device xla"), ("xla+scan", "--mode graph --device xla --scan")):
            r = _spawn("train", config, 3, f"--set n_layers={layers}")
            row[name] = r.get("first_step_s")
            if "xla" in name:
                row[name + " compile"] = r.get("xla_compile_s")
        rows.append(row)
    return rows


def dist_table(repeats, steps, only=None):
    """2 processes SimpleFSDP vs FSDP2 vs one process, through train.py (torchrun), same global batch;
    tensor parallel rows; expert parallel vs one process on the MoE debug flavor."""
    import tempfile
    moe = ["--flavor", "qwen3_moe_debug"]
    configs = [("1 process", 1, []), ("2 proc SimpleFSDP", 2, ["--mesh", "ici=2"]),
               ("2 proc SimpleFSDP graph, passes off", 2, ["--mesh", "ici=2", "--mode", "graph", "--fsdp-passes", "none"]),
               ("2 proc SimpleFSDP graph, passes on", 2, ["--mesh", "ici=2", "--mode", "graph"]),
               ("2 proc SimpleFSDP graph + inductor, passes on", 2, ["--mesh", "ici=2", "--mode", "graph",
                                                                     "--backend", "inductor"]),
               ("2 proc FSDP2", 2, ["--mesh", "ici=2", "--dp-impl", "fsdp2"]),
               ("2 proc tp=2 (+ SP)", 2, ["--mesh", "ici=1,tp=2"]),
               ("4 proc ici=2,tp=2", 4, ["--mesh", "ici=2,tp=2"]),
               ("MoE: 1 process", 1, moe), ("MoE: 2 proc SimpleFSDP", 2, [*moe, "--mesh", "ici=2"]),
               ("MoE: 2 proc ici=2,ep=2", 2, [*moe, "--mesh", "ici=2,ep=2"])]
    configs = [c for c in configs if only is None or c[0] in only]  # (only: re-measure some rows)
    results = {name: [] for name, _, _ in configs}
    for _ in range(repeats):
        for name, nproc, extra in configs:
            out = tempfile.mkdtemp(prefix="minititan-bench-")
            cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                   if nproc > 1 else [sys.executable]) + [os.path.join(HERE, "train.py"), "--steps", str(steps),
                   "--log-interval", "1", "--eval-batches", "0", "--ckpt-interval", "0", "--data", _bench_data(),
                   "--out-dir", out, *extra]
            subprocess.run(cmd, cwd=HERE, capture_output=True, timeout=1200)
            try:
                recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            except OSError:
                continue
            start = next(r for r in recs if r.get("event") == "start")
            steady = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r][2:]
            results[name].append({"tokens_per_s": statistics.median(steady), "param_mib": start["param_bytes_local"] / 2**20,
                                  "optim_mib": start["optim_bytes_local"] / 2**20,
                                  "rss_mib": max(r["mem_bytes"] for r in recs if "mem_bytes" in r) / 2**20})
    rows = []
    for name, _, _ in configs:
        if results[name]:
            rows.append({"config": name, **{k: statistics.median(r[k] for r in results[name]) for k in results[name][0]}})
    return rows


def profile_rows(configs, steps=8):
    """Each speed-table row `configs` names, timed as in the table, then one more step traced
    (bench_results/profile/<row>/): (markdown of its time by category, the rows)."""
    rows = []
    for c in configs:
        where = os.path.join(HERE, "bench_results", "profile", "_".join(c.replace("--", "").split()) or "plain")
        r = _spawn("train", c, steps, "", where)
        rows.append({"mode": c, **({"error": r["error"]} if "error" in r else r)})
    cells = lambda r: [r["mode"], f"{r['profile']['measured_s'] * 1e3:.0f}"] + [  # noqa: E731
        f"{r['profile']['category_s'][k] * 1e3:.0f} ({100 * r['profile']['category_s'][k] / r['profile']['measured_s']:.0f}%)"
        for k in profiling.ORDER] + [", ".join(os.path.relpath(t, HERE) for t in r["profile"]["traces"])]
    md = "\n".join([f"One traced step a row (ms, share of the measured step); {time.strftime('%Y-%m-%d')}", ""] + markdown_table(
        ["mode", "step ms", *profiling.ORDER, "trace"], rows, cells))
    return md, {"profile": rows}


def to_markdown(speed, memory, dist_rows=(), depth=()):
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d')}", ""]
    lines += markdown_table(["mode", "tokens/s", "x plain loop", "TFLOP/s", "MFU (vs measured fp32 GEMM peak)", "first step s",
                     "peak RSS MiB"], speed,
                    lambda r: [r["mode"], f"{r['tokens_per_s']:.0f}", f"{r.get('ratio_to_plain', float('nan')):.2f}",
                               f"{r['tflops']:.3f}", f"{100 * r['mfu']:.0f}%", f"{r['first_step_s']:.1f}",
                               f"{r['peak_rss_mib']:.0f}"])
    rounded = lambda x: x if x is None else round(x)  # noqa: E731
    lines += [""] + markdown_table(["kernel", "size (vocab / seq len)", "plain peak growth MiB", "Pallas peak growth MiB", "ratio"],
                           memory, lambda m: [m[0], m[1], rounded(m[2]), rounded(m[3]),
                                              f"{m[2] / m[3]:.1f}x" if m[2] and m[3] else "n/a"])
    if depth:
        keys = ("inductor", "inductor+scan", "xla", "xla+scan", "xla compile", "xla+scan compile")
        lines += [""] + markdown_table(["layers", "first step s: graph+inductor", "graph+inductor+scan", "graph on XLA",
                                "graph on XLA+scan", "XLA compile s: graph", "graph+scan"], depth,
                               lambda r: [r["layers"]] + [f"{r[k]:.1f}" if r.get(k) else "failed" for k in keys])
    if dist_rows:
        def base(r):  # the one-process row of the same family (dense or MoE)
            return next(b for b in dist_rows if b["config"].endswith("1 process") and
                        b["config"].startswith("MoE") == r["config"].startswith("MoE"))["tokens_per_s"]
        lines += [""] + markdown_table(["parallel (llama3_debug; MoE: qwen3_moe_debug; global batch 32 x 128)",
                                "tokens/s (all ranks)", "x 1 process", "params MiB / rank", "AdamW state MiB / rank",
                                "peak RSS MiB (rank 0, training)"], dist_rows,
                               lambda r: [r["config"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base(r):.2f}",
                                          f"{r['param_mib']:.2f}", f"{r['optim_mib']:.2f}", f"{r['rss_mib']:.0f}"])
    return "\n".join(lines)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, HERE)
        kind = sys.argv[2]
        if kind == "peak":
            result = {"flops": device.measure_cpu_matmul_peak(repeats=20)}
        elif kind == "flux":
            result = bench_flux.serve_steps(sys.argv[3], bench_trainer)
        else:
            result = (_child_memory(sys.argv[3], int(sys.argv[4])) if kind == "mem"
                      else _child_train(sys.argv[3], int(sys.argv[4]), *sys.argv[5:7]))
        print(json.dumps(result), flush=True)
        os._exit(0)  # skip interpreter teardown: JAX/XLA threads sometimes abort it after the work is done
    parser = argparse.ArgumentParser(description="minititan measurements")
    p = parser.add_mutually_exclusive_group()  # (one kind of run: with two, all but one was ignored)
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (< 5 min on 2 cores)")
    p.add_argument("--flux", action="store_true", help="only the FLUX training-step rows (< 2 min on 2 cores)")
    p.add_argument("--rollout", action="store_true", help="only the rollout engines' rows, ours vs vLLM (< 3 min)")
    p.add_argument("--profile", nargs="+", metavar="ROW", help="trace one step of each named speed-table row "
                   "(e.g. plain '--mode graph --device xla') into bench_results/profile/ and tabulate its time by category")
    args = parser.parse_args()
    if args.profile:
        unknown = [r for r in args.profile if r not in QUICK_CONFIGS + FULL_CONFIGS]
        if unknown:  # (it ran as train.py flags and wrote a failed row over bench_results/profile.md)
            print(f"error: --profile {unknown[0]!r} is not a speed-table row; the rows: "
                  f"{', '.join(map(repr, QUICK_CONFIGS + FULL_CONFIGS))}", file=sys.stderr)
            sys.exit(2)
        return _write("profile", *profile_rows(args.profile))
    tables = {"rollout": (rollout_table, rollout_markdown),
              "flux": (lambda: bench_flux.flux_table(cpu_peak_flops), flux_markdown)}
    for name, (table, markdown) in tables.items():
        if getattr(args, name):  # just these rows (also part of the full run)
            rows = table()
            return _write(name, markdown(rows), {name: rows})
    modes = QUICK_CONFIGS if args.quick else QUICK_CONFIGS + FULL_CONFIGS
    speed = speed_table(modes, repeats=1 if args.quick else 2, steps=10 if args.quick else 20)
    depth = [] if args.quick else compile_vs_depth()
    flux_rows = [] if args.quick else bench_flux.flux_table(cpu_peak_flops)
    rollout_rows = [] if args.quick else rollout_table()
    memory = memory_tables(args.quick)
    dist_rows = dist_table(repeats=1 if args.quick else 2, steps=6 if args.quick else 20)
    md = to_markdown(speed, memory, dist_rows, depth) + ("\n\n" + flux_markdown(flux_rows) if flux_rows else "") \
        + ("\n\n" + rollout_markdown(rollout_rows) if rollout_rows else "")
    _write("latest", md, {"speed": speed, "memory": memory, "data_parallel": dist_rows, "compile_vs_depth": depth,
                          "flux": flux_rows, "rollout": rollout_rows})


def _write(name, md, obj):
    """bench_results/NAME.md and .json, each written whole (tmp + rename) or not at all; md printed."""
    os.makedirs(os.path.join(HERE, "bench_results"), exist_ok=True)
    for ext, text in (("md", md + "\n"), ("json", json.dumps(obj, indent=1))):
        path = os.path.join(HERE, "bench_results", f"{name}.{ext}")
        atomic.write(path, text)
    print(md)


if __name__ == "__main__":
    main()
