"""bench_flux.py: FLUX's training step under each way train.py can run it, beside the pure-JAX step
(flux/jax_step.py), for bench.py (`bench.py --flux`, and part of the full run; its markdown there).

Every configuration is a warm process of its own (`serve_steps`: compiled once), and the parent times
them in turn, A B C D A B C D, so the ratios are measured inside one run on a noisy machine. What
bench.py shares (the trainer a row builds, the measured GEMM peak) comes in as arguments: bench.py
imports this file, not the other way round.
"""
import json
import os
import statistics
import subprocess
import sys
import time
import device as dev
import optim
from flux import jax_step as flux_jax

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "bench.py")  # (its `--child flux CONFIG` runs serve_steps)

# flux_debug widened to 256 (8 heads, 2 + 2 blocks): 7.06M parameters (3.9x), 32 digits a step
FLUX_FLAGS = ["--task", "flux", "--batch-size", "32", "--set", "hidden_size=256", "--set", "num_heads=8",
              "--watchdog", "0"]  # (inductor compiling this step on a loaded 2-core machine took > 300 s)
FLUX_CONFIGS = ["plain", "--mode graph --backend inductor", "--mode graph --device xla",
                "--mode graph --device xla --backend openxla", "jax"]


def serve_steps(config, bench_trainer):
    """Serve timed FLUX steps of one configuration: compile (2 warm-up steps), print {"ready"}, then for
    each line N on stdin time N more steps and print their seconds. The parent keeps all configurations
    warm and alternates them, so none pays a recompile per repeat. `jax`: flux/jax_step.py's jitted step from
    the same init (the eager trainer's weights) on the same batches."""
    import tempfile  # (a run directory each: the four run at once, and a run directory admits one run)
    trainer, step = bench_trainer("plain" if config == "jax" else config,
                                   [*FLUX_FLAGS, "--out-dir", tempfile.mkdtemp(prefix="minititan-bench-")])
    lr = lambda i: optim.lr_at(i, 1e-3, 5, 100)
    if config == "jax":
        import dataclasses
        import jax.numpy as jnp
        state = [{k: jnp.array(v.detach().numpy()) for k, v in trainer.model.state_dict().items()}]
        state.append(flux_jax.init_opt(state[0]))
        jstep = flux_jax.make_train_step(dataclasses.asdict(trainer.model_args), weight_decay=trainer.cfg.weight_decay,
                                         clip=trainer.cfg.clip)

        def run(i):
            batch = tuple(jnp.asarray(x.numpy()) for x in trainer.task.batch(i))
            t0 = time.perf_counter()
            state[0], state[1], loss, _ = jstep(state[0], state[1], batch, jnp.float32(lr(i)), jnp.float32(i))
            t1 = time.perf_counter()  # (jit dispatches asynchronously: the call returns before the step ran)
            float(loss)  # waits for the step
            return t1 - t0, 0.0
    else:
        def run(i):
            batch = trainer.parallel.place_batch(trainer.task.batch(i))
            t0 = time.perf_counter()
            loss, _ = step(*batch, dev.scalar(lr(i), trainer.device))
            t1 = time.perf_counter()  # (XLA: the step recorded as a lazy graph, nothing run yet; CPU: all of it)
            dev.sync(trainer.device)  # (XLA: the graph hashed, its compiled program found and launched)
            t2 = time.perf_counter()
            loss.item()
            return t1 - t0, t2 - t1
    t0 = time.perf_counter()
    run(1), run(2)
    print(json.dumps({"ready": True, "warmup_s": time.perf_counter() - t0, "flops_per_step": trainer.flops_per_step,
                      "units_per_step": trainer.task.units_per_step}), flush=True)
    i = 2
    for line in sys.stdin:
        times, phases = [], []
        for _ in range(int(line)):
            i += 1
            t0 = time.perf_counter()
            phases.append(run(i))
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times, "phases": phases}), flush=True)


def flux_table(peak_flops, repeats=3, steps=4):
    """FLUX training steps (FLUX_FLAGS), every configuration a warm process (serve_steps), timed in turn
    A B C D A B C D; ms/step is the median of all timed steps; MFU from flux/model.py's FLOP formula over
    the CPU's measured GEMM peak; `x_jax`: throughput over the pure-JAX step's (1.0 = as fast). Where a
    step's time goes (medians): `call_ms` until the step function returns (eager: the whole step; XLA:
    recording the step as a lazy graph, nothing run yet; JAX: the asynchronous dispatch), `launch_ms`
    (XLA: the graph hashed, its compiled program found and launched), `wait_ms` the rest (waiting for
    the program to finish and the loss to reach the host)."""
    import tempfile
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    logs = {c: tempfile.TemporaryFile("w+") for c in FLUX_CONFIGS}
    procs = {c: subprocess.Popen([sys.executable, BENCH, "--child", "flux", c], cwd=HERE, env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[c]) for c in FLUX_CONFIGS}

    def reply(c):  # the child's next JSON line (its stdout may also carry the trainer's log lines)
        for line in procs[c].stdout:
            if line.startswith("{"):
                return json.loads(line)
        return None

    ready = {c: reply(c) for c in FLUX_CONFIGS}  # (all four compile at once)
    times, phases = {c: [] for c in FLUX_CONFIGS}, {c: [] for c in FLUX_CONFIGS}
    for _ in range(repeats):
        for c in FLUX_CONFIGS:
            if ready[c]:
                procs[c].stdin.write(f"{steps}\n")
                procs[c].stdin.flush()
                got = reply(c)
                times[c] += got["times"] if got else []
                phases[c] += got["phases"] if got else []
                ready[c] = ready[c] if got else None
    for c in FLUX_CONFIGS:
        procs[c].stdin.close()
        procs[c].wait(timeout=120)
    peak = peak_flops()
    rows = []
    for c in FLUX_CONFIGS:
        if not times[c]:
            logs[c].seek(0)
            said = [line for line in logs[c].read().splitlines() if "Error" in line or line.startswith("error")]
            rows.append({"mode": c, "error": (said or ["failed"])[-1]})
            continue
        med = statistics.median(times[c])
        call, launch = (1000 * statistics.median(p[k] for p in phases[c]) for k in (0, 1))
        rows.append({"mode": c, "ms_per_step": 1000 * med, "images_per_s": ready[c]["units_per_step"] / med,
                     "tflops": ready[c]["flops_per_step"] / med / 1e12, "mfu": ready[c]["flops_per_step"] / med / peak,
                     "warmup_s": ready[c]["warmup_s"], "timed_steps": len(times[c]),
                     "call_ms": call, "launch_ms": launch, "wait_ms": 1000 * med - call - launch})
    jax_ms = next((r["ms_per_step"] for r in rows if r["mode"] == "jax" and "error" not in r), None)
    for r in rows:
        if jax_ms and "error" not in r:
            r["x_jax"] = jax_ms / r["ms_per_step"]
    return rows
