"""anchor.py: the planner's one prediction that can be checked here. This CPU becomes the chip (its
measured fp32 GEMM peak and memory bandwidth), the default `llama3_debug` run (batch 32 x 128, eager,
fp32) the workload; the planner's predicted step is set beside the step measured in the same process.

    python dryrun.py --anchor          # measure peak, bandwidth and the step; print predicted / measured

Everything is measured in one process, one after the other, because the machine is shared and noisy:
a ratio of numbers taken together means more than any one of them. The arithmetic (`predict_step`)
is pure: tests check it against a hand computation on recorded inputs (RECORDED), not against a live
timing. Nothing here is a TPU figure.
"""
import statistics
import time

import chips as chips_lib
import stepmodel
from shapes import lm_shape

# One measurement (python dryrun.py --anchor on the 2-core development machine; see README), kept so
# tests can hold the arithmetic to it without timing anything.
RECORDED = {"peak_flops": 1.051e11, "mem_bw": 3.055e10, "measured_step_s": 2.132, "eager_bytes": 3405597636}


def gemm_rate(n=1024):
    """FLOP/s of one fp32 n x n GEMM (what device.measure_cpu_matmul_peak takes the best of)."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    t0 = time.perf_counter()
    a @ b
    return 2 * n**3 / (time.perf_counter() - t0)


def bandwidth(mib=8):
    """Bytes/s of an fp32 add into a fresh output (reads 2 arrays, writes 1), as eager runs every
    elementwise op: the allocation's first touch included."""
    import torch
    n = mib * 2**20 // 4
    a, b = torch.ones(n), torch.ones(n)
    t0 = time.perf_counter()
    a + b
    return 3 * 4 * n / (time.perf_counter() - t0)


MATMUL_OPS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm", "aten._scaled_dot_product", "aten.embedding")
ZERO_COPY = ("view", "reshape", "transpose", "permute", "expand", "aten.t.", "alias", "slice", "select",
             "unsqueeze", "squeeze", "detach", "split", "unbind", "as_strided", "getitem", "sym_", "_to_copy.default")


def traced_eager_bytes(cfg):
    """Bytes the eager step's non-matmul ops read and write, counted on its make_fx trace (fake
    tensors, nothing run): each aten op other than a matmul, attention or a zero-copy view reads its
    tensor inputs and writes its outputs to memory, unfused (eager PyTorch on a CPU fuses nothing,
    where XLA on a TPU fuses most; so on the CPU this replaces the shape's fused count)."""
    import torch
    import graph_trainer
    import optim
    from model import FLAVORS, Transformer, next_token_loss
    with torch.device("meta"):
        model = Transformer(FLAVORS[cfg["flavor"]])
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    state = [torch.zeros_like(p) for p in params]
    step_fn = graph_trainer.build_step_fn(model, names, next_token_loss, 1.0, (0.9, 0.95), 1e-8, 0.1,
                                          optim.decay_mask(names, params), lambda: torch.autocast("cpu", enabled=False))
    one = torch.ones((), device="meta")
    tokens = torch.zeros(cfg["batch_size"], cfg["seq_len"], dtype=torch.long, device="meta")
    gm = graph_trainer.capture(step_fn, (params, list(model.buffers()), state, state, one, one, tokens, tokens))
    nbytes = lambda v: v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
    total = 0
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op != "call_function" or any(m in target for m in MATMUL_OPS + ZERO_COPY):
            continue
        outs = node.meta.get("val")
        total += sum(nbytes(v) for v in (outs if isinstance(outs, (tuple, list)) else [outs]))
        total += sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    return total


def anchor_layout(cfg):
    """The default run as the planner sees it: one device, fp32 everything, nothing recomputed, no
    causal block skipping (the CPU's SDPA computes the whole S x S)."""
    return stepmodel.Layout(ici=1, local_batch=cfg["batch_size"], remat="none", precision=stepmodel.PRECISIONS["fp32"],
                            act_bytes=4, attention_block=cfg["seq_len"])


def predict_step(peak_flops, mem_bw, cfg, eager_bytes):
    """The planner's step for the default run on a chip with this peak and bandwidth: matmuls at the
    measured peak (it was measured on a matmul) less stepmodel's short-dim law, the non-matmul bytes
    the eager trace moves (`eager_bytes`, counted in place of the fused count: elementwise term)."""
    import dataclasses
    from model import FLAVORS
    shape = lm_shape(FLAVORS[cfg["flavor"]], cfg["seq_len"], cfg["flavor"])
    tokens_layers = shape.tokens * cfg["batch_size"] * shape.layers
    lay = anchor_layout(cfg)
    shape = dataclasses.replace(shape, elementwise=eager_bytes / (lay.act_bytes * 3 * tokens_layers), vocab=0)
    chip = chips_lib.measured_chip(peak_flops, mem_bw, hbm_bytes=float("inf"))
    return stepmodel.predict(shape, anchor_layout(cfg), chip, {"matmul_efficiency": 1.0, "moe_efficiency": 1.0})


def measure(cfg, steps=12):
    """Medians of the default eager training step and, between its steps (so under the same load),
    of the GEMM rate and the memory bandwidth; 3 warm-up steps not counted."""
    import data
    import device as dev
    import optim
    import train
    tc = train.parse_config(["--flavor", cfg["flavor"], "--batch-size", str(cfg["batch_size"]), "--seq-len",
                             str(cfg["seq_len"]), "--steps", str(steps), "--eval-batches", "0", "--ckpt-interval", "0",
                             "--out-dir", "/tmp/minititan-anchor", "--data", data.stdlib_dir()])
    trainer = train.Trainer(tc)
    times, peaks, bws = [], [], []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        loss, _ = trainer.step_fn(*trainer.parallel.place_batch(trainer.task.batch(i)),
                                  dev.scalar(optim.lr_at(i, 1e-3, 5, steps), trainer.device))
        loss.item()
        times.append(time.perf_counter() - t0)
        peaks += [gemm_rate() for _ in range(3)]
        bws += [bandwidth() for _ in range(3)]
    return statistics.median(times[3:]), statistics.median(peaks[9:]), statistics.median(bws[9:])


DEFAULT_RUN = {"flavor": "llama3_debug", "batch_size": 32, "seq_len": 128}


def main(argv=()):
    if argv:
        raise ValueError(f"--anchor takes no further flags, got {' '.join(argv)}")
    measured, peak, bw = measure(DEFAULT_RUN)
    eager_bytes = traced_eager_bytes(DEFAULT_RUN)
    pred = predict_step(peak, bw, DEFAULT_RUN, eager_bytes)
    print(f"CPU anchor: fp32 GEMM peak {peak / 1e9:.1f} GFLOP/s, memory bandwidth {bw / 1e9:.1f} GB/s (measured now)")
    print(f"  {DEFAULT_RUN['flavor']} batch {DEFAULT_RUN['batch_size']} x {DEFAULT_RUN['seq_len']}, eager fp32: "
          f"measured {measured * 1e3:.1f} ms a step, predicted {pred['step_s'] * 1e3:.1f} ms, ratio "
          f"{pred['step_s'] / measured:.2f}")
    for k, v in pred["compute"].items():
        print(f"    {k:<16} {v * 1e3:8.2f} ms")
    print(f"    host overhead    {pred['host_overhead_s'] * 1e3:8.2f} ms")
    print(f"  recorded inputs: {{'peak_flops': {peak:.4g}, 'mem_bw': {bw:.4g}, 'measured_step_s': {measured:.4g}, "
          f"'eager_bytes': {eager_bytes}}}")
    return 0
