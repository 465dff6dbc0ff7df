"""compile_column.py: the calibration table's compiler column. `python -m planner.dryrun --calibrate --compile
[RUN_ID ...]` compiles each published run of calibration.json that a family here can express, at its
published layout, global batch and sequence, for its chip's pod topology, with the real TPU compiler
(`train.py --dry-run --compile --scan --kernels pallas --dtype bf16`, one child process a run, one at a
time), and prints, per device (Ironwood: per chip): the compiler's HBM and verdict beside the planner's for the same
program, and the compiler's estimated step beside the planner's and the published step.

What is compiled is minititan's program, not the published one: fp32 master weights and AdamW moments
sharded over every chip (FSDP), cast to bf16 for the forward (--dtype bf16: bf16 activations, as the
published runs keep them), the blocks under --scan (each layer's input kept, its forward replayed in
the backward: MaxText's "full" remat; with --offload, where the run offloads an activation (theirs
`decoder_layer_input`, or others such as `context` and `mlpwo`: ours offloads only the layer input),
that input in host memory), and our Pallas kernels for the attention and the loss (splash and the
fused loss under shard_map: tpu_pod/sharded_kernels.py), as the published runs use splash attention. FLUX
is compiled the same way, its two block stacks scanned (each block's input kept, its forward replayed,
where FLUX_OPTIMIZED keeps some matmul outputs).
Several slices (dcn > 1) are compiled as that many slices of the topology, joined by DCN: a run
published as FSDP over DCN (MaxText's dcn_fsdp) with one FSDP axis over all their chips (`--topology
SLICE --mesh ici=ALL`), else as train.py's HSDP (the weights replicated across slices). The compiler's
cost model does not see inside a Mosaic kernel,
so its step and MFU are the program outside the kernels' (their FLOPs left out on both sides).
So the planner's HBM beside it is for that same program (remat "full"); the published layout's own
planner figures (its remat policy, precision and kernels) are in `python -m planner.dryrun --calibrate`.
An MoE's experts are our grouped-matmul kernel (one routing group a device: step_compile.lm_program),
whatever the run's dispatch (MaxText's capacity-padded "dropped" einsums included): dropless, but
under ep a run's published capacity factor bounds the exchange's buffers (ep_buffer_factor: each
peer a device's E / ep experts, so MaxText's per-expert cap is ours per peer: the same slots, fewer
drops).
A run is skipped, with the reason, where the compile cannot express it: DDP, tensor parallelism
(compiled, but not under --scan or with our kernels, as this column compiles). Expert parallelism
is compiled at the run's ep (--mesh ...,ep=E).
Ironwood compiles with its jax / libtpu pair first on PYTHONPATH (tpu_target.step_environment), its
figures a chip (two devices to the compiler).
"""
import json
import os
import subprocess
import sys
import time

from planner import calibrate
from tpu_pod import target as tpu_target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 900
# Published architectures with no model.py flavor, as a flavor with overrides (shapes.PLANNER_MODELS)
# (Llama 3's rope scaling changes the rotary table's values, not a shape)
FLAVOR_OF = {"llama2_70b": ("llama3_70b", ["--set", "vocab_size=32000"]),
             "mixtral_8x7b": ("llama3_8b", ["--set", "vocab_size=32000", "--set", "rope_theta=1000000.0", "--set", "n_experts=8",
                                            "--set", "top_k=2", "--set", "moe_ffn_dim=14336"]),
             "mixtral_8x22b": ("llama3_8b", ["--set", "dim=6144", "--set", "n_layers=56", "--set", "n_heads=48",
                                             "--set", "vocab_size=32768", "--set", "rope_theta=1000000.0",
                                             "--set", "n_experts=8", "--set", "top_k=2", "--set", "moe_ffn_dim=16384"])}


def skip_reason(run):
    """Why a run cannot be compiled here (None: it can)."""
    if run.get("dp_mode") == "ddp":
        return "DDP (parameters replicated): the compile lays out FSDP"
    if run.get("tp", 1) > 1:  # (none of the published runs here)
        return f"tp={run['tp']}: the column compiles --scan with our kernels, which the tp compile does not take"
    return None


def command(run):
    if run["model"].startswith("flux"):  # (both block stacks scanned, as the LM's layers)
        return [sys.executable, os.path.join(ROOT, "train.py"), "--task", "flux", "--flavor", run["model"],
                "--image-size", str(run["image_size"]), "--dry-run", "--compile", "--kernels", "pallas", "--dtype",
                "bf16", "--scan", "--chip", run["chip"], "--mesh", f"ici={run['ici']}",
                "--batch-size", str(run["global_batch"])]
    flavor, extra = FLAVOR_OF.get(run["model"], (run["model"], []))
    # (FSDP over DCN: one ici axis over every slice's chips, the slice named; else dcn slices of HSDP)
    over_dcn = run["dcn"] > 1 and run.get("dcn_mode") == "fsdp"
    slice_ = ["--topology", tpu_target.topology_name(run["chip"], run["ici"])] if over_dcn else []
    # (--offload where the run offloads any activation: ours can offload only each layer's input)
    offload = isinstance(run["remat"], dict) and "offload" in run["remat"].values()
    return [sys.executable, os.path.join(ROOT, "train.py"), "--dry-run", "--compile", "--scan", "--kernels", "pallas",
            "--dtype", "bf16", *(["--offload"] if offload else []), "--chip", run["chip"],
            "--flavor", flavor, *extra, "--set", f"max_seq_len={run['seq_len']}",
            *(["--set", f"ep_buffer_factor={run.get('capacity_factor', 0.0)}"] if run.get("ep", 1) > 1 else []),
            *slice_, "--mesh", ",".join([*([f"dcn={run['dcn']}"] if run["dcn"] > 1 and not over_dcn else []),
                                         f"ici={run['ici'] * (run['dcn'] if over_dcn else 1)}",
                                         *([f"ep={run['ep']}"] if run.get("ep", 1) > 1 else [])]),
            "--batch-size", str(run["global_batch"]), "--seq-len", str(run["seq_len"])]


def compile_run(run):
    """The compile's JSON line (step_compile.compare), or {"error": one line}."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(command(run), capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                              env={**os.environ, **tpu_target.step_environment(run["chip"])})
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {TIMEOUT_S} s"}
    lines = proc.stdout.strip().splitlines()
    figures = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}  # (printed fit or not)
    if proc.returncode == 0 and figures:
        return {**figures, "wall_s": time.perf_counter() - start}
    if proc.returncode < 0 or "Fatal Python error" in proc.stderr:  # (a crash inside libtpu's compile)
        fatal = [ln.split("] ", 1)[-1] for ln in proc.stderr.splitlines() if "Check failed" in ln] or \
            [ln for ln in proc.stderr.splitlines() if ln.startswith("Fatal Python error")]  # (libtpu's own check first)
        return {"error": f"the process died in the compile: {(fatal or [f'signal {-proc.returncode}'])[0][:240]}"}
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    return {**figures, "error": (errors or proc.stderr.strip().splitlines()[-1:] or ["(no message)"])[-1][:300]}


def row(run, r):
    gib = lambda b: b / 2**30
    published = calibrate.published_step(run, calibrate.run_shape(run))
    head = f"{run['id']:<38} {run['chip']:<8} {r.get('topology', ''):<11}"
    if "error" in r and "planned_total_bytes" not in r:
        return head + f" {r['error']}"
    ratio = r["total_bytes"] / r["planned_total_bytes"] - 1
    counted = bool(r["flops"])  # (not when the second, 2-layer-an-iteration compile ran out of HBM)
    step, mfu = (f"{r['rescaled_step_s']:8.2f}s", f"{100 * r['cost_model_mfu']:5.1f}%") if counted else ("-", "-")
    if not r["compiler_fits"]:
        return head + f" does not fit: {r['message'][:200]}"
    return (head + f" {gib(r['total_bytes']):7.1f} {'yes' if r['fits'] else 'NO':<4} {gib(r['planned_total_bytes']):7.1f} "
            f"{100 * ratio:+6.0f}%{'' if abs(ratio) <= 0.15 else '!'} {step:>9} {r['planned_step_s']:8.2f}s "
            f"{published:8.2f}s {mfu:>6} {r['compile_s']:6.0f}s {gib(r.get('summed_bytes', r['total_bytes'])):7.1f}")


def main(ids=()):
    by_id = {r["id"]: r for r in calibrate.load()}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(f"no calibration run {', '.join(unknown)}; have {', '.join(by_id)}")
    runs = [by_id[i] for i in ids] if ids else list(by_id.values())  # (in the order asked for)
    print("compiler column (train.py --dry-run --compile --scan --kernels pallas --dtype bf16 [--offload] at each published layout and batch; "
          "XLA:TPU on compile-only devices, no chip; the planner's figures for the same program: FSDP, bf16 forward, remat full)")
    print(f"{'run':<38} {'chip':<8} {'topology':<11} {'HBM GiB':>7} {'fits':<4} {'planner':>7} {'diff':>7} "
          f"{'est step':>9} {'planner':>9} {'published':>9} {'MFU':>6} {'compile':>7} {'summed':>7}")
    print("(est step: the cost model's seconds at the chip's bf16 peak, in units of its own matmul rate, outside the "
          "Mosaic kernels; MFU: flops_per_step outside the kernels over that step and peak; HBM: the compiler's peak (with host buffers: the HBM its buffer assignment reserves); "
          "diff: it over the planner's; summed: memory_analysis's sizes added up)")
    results = {}
    for run in runs:
        why = skip_reason(run)
        results[run["id"]] = {"error": f"skipped: {why}"} if why else compile_run(run)
        print(row(run, results[run["id"]]), flush=True)
    print(json.dumps(results), flush=True)
    return 0
