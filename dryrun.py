"""dryrun.py: will this configuration fit and how fast could it be? Answered without any hardware.

    python train.py --dry-run --flavor llama3_405b --mesh dcn=2,ici=128 --chip tpu_v5p

The whole step (graph_trainer.build_step_fn) is traced by make_fx on meta tensors, at full width and
with the TPU kernels (the config rewrite), so the graph's saved activations are exact for one and two
layers; the per-layer difference extrapolates to the full depth (every block is the same). Nothing is
allocated. Parameters, gradients and AdamW state follow from the parameter count and the mesh
(fp32, sharded over ici, replicated over dcn); FSDP collectives from the same. The step time is a
roofline: max(compute at peak, ICI traffic, DCN traffic), i.e. perfect overlap, so it is a lower bound
and the MFU an upper bound.
"""
import dataclasses
import math

import torch

import device as dev
import graph_passes
import graph_trainer
import optim
from model import Transformer, flops_per_token, param_counts, tpu_config

GiB = 2**30
# Per chip, published (cloud.google.com/tpu/docs/<generation>): HBM bytes, HBM bandwidth, ICI
# bandwidth (bytes/s; the listed Gbps / 8); the bf16 peak FLOP/s from device.py's table. DCN: an
# assumption of 25 GB/s per chip.
TPU_SPECS = {
    "tpu_v4": dict(hbm=32 * GiB, hbm_bw=1228e9, ici_bw=2400e9 / 8),
    "tpu_v5e": dict(hbm=16 * GiB, hbm_bw=819e9, ici_bw=1600e9 / 8),
    "tpu_v5p": dict(hbm=95 * GiB, hbm_bw=2765e9, ici_bw=4800e9 / 8),
    "tpu_v6e": dict(hbm=32 * GiB, hbm_bw=1640e9, ici_bw=3584e9 / 8),
    "tpu_v7": dict(hbm=192 * GiB, hbm_bw=7370e9, ici_bw=9600e9 / 8),
}
for _chip, _spec in TPU_SPECS.items():
    _spec["peak"] = dev.PEAK_BF16_FLOPS[_chip]
DCN_BW = 25e9


def traced_saved_bytes(args, local_batch, seq_len, remat):
    """Saved-activation bytes of the traced step for `args` (bf16 compute), on meta tensors."""
    with torch.device("meta"):
        model = Transformer(args).to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    state = [torch.zeros_like(p) for p in params]
    step_fn = graph_trainer.build_step_fn(model, names, 1.0, (0.9, 0.95), 1e-8, 0.1,
                                          optim.decay_mask(names, params), lambda: torch.autocast("cpu", enabled=False))
    tokens = torch.zeros(local_batch, seq_len, dtype=torch.long, device="meta")
    one = torch.ones((), device="meta")
    gm = graph_trainer.capture(step_fn, (params, list(model.buffers()), state, state, one, one, tokens, tokens))
    if remat:
        gm = graph_passes.remat(gm)
    return graph_passes.saved_bytes(gm)


def dry_run(args, flavor, mesh, batch_size, seq_len, chip, remat):
    dcn, ici = mesh
    devices = dcn * ici
    if batch_size % devices:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the {devices} devices of the mesh")
    spec = TPU_SPECS[chip]
    local_batch = batch_size // devices
    args = tpu_config(args)
    total, _, _ = param_counts(args)
    shard = math.ceil(total / ici)
    one, two = (traced_saved_bytes(dataclasses.replace(args, n_layers=n), local_batch, seq_len, remat) for n in (1, 2))
    activations = one + (args.n_layers - 1) * (two - one)
    layer_params = (param_counts(dataclasses.replace(args, n_layers=2))[0] - param_counts(dataclasses.replace(args, n_layers=1))[0])
    mem = {"params (fp32 shard)": 4 * shard, "grads (fp32 shard)": 4 * shard, "AdamW state (fp32 shard)": 8 * shard,
           "gathered layer (bf16, x2 prefetch)": 2 * 2 * layer_params, "saved activations (bf16)": activations}
    flops = flops_per_token(args, seq_len) * local_batch * seq_len          # model FLOPs per device per step
    ici_bytes = (2 * 2 + 4) * total * (ici - 1) / ici                       # all-gather fwd+bwd (bf16), reduce-scatter (fp32)
    dcn_bytes = 2 * 4 * shard * (dcn - 1) / dcn                             # ring all-reduce of fp32 grad shards
    compute_s = flops * (4 / 3 if remat else 1) / spec["peak"]             # remat replays ~one forward
    step_s = max(compute_s, ici_bytes / spec["ici_bw"], dcn_bytes / DCN_BW)
    need = sum(mem.values())
    return {"flavor": flavor, "chip": chip, "mesh": f"dcn={dcn},ici={ici}", "devices": devices, "params": total,
            "local_batch": local_batch, "seq_len": seq_len, "memory_bytes": mem, "total_bytes": need,
            "hbm_bytes": spec["hbm"], "fits": need <= spec["hbm"], "flops_per_device": flops,
            "ici_bytes": ici_bytes, "dcn_bytes": dcn_bytes, "compute_s": compute_s, "step_s": step_s,
            "mfu": flops / (step_s * spec["peak"])}


def main(args, cfg):
    """train.py --dry-run: print the report and its JSON (ValueError: bad mesh / batch / chip)."""
    import json
    import mesh
    if cfg.chip not in TPU_SPECS:
        raise ValueError(f"--chip {cfg.chip!r}: choose one of {', '.join(TPU_SPECS)}")
    report = dry_run(args, cfg.flavor, mesh.parse_mesh(cfg.mesh or "ici=1"), cfg.batch_size, cfg.seq_len,
                     cfg.chip, cfg.remat)
    print(format_report(report))
    print(json.dumps(report), flush=True)
    return 0


def format_report(r):
    lines = [f"dry run: {r['flavor']} ({r['params'] / 1e9:.2f}B params) on {r['devices']} x {r['chip']} "
             f"({r['mesh']}), {r['local_batch']} x {r['seq_len']} tokens per device"]
    for name, b in r["memory_bytes"].items():
        lines.append(f"  {name:<36} {b / GiB:10.2f} GiB")
    verdict = "fits" if r["fits"] else f"DOES NOT FIT: short by {(r['total_bytes'] - r['hbm_bytes']) / GiB:.2f} GiB"
    lines.append(f"  {'total per device':<36} {r['total_bytes'] / GiB:10.2f} GiB of {r['hbm_bytes'] / GiB:.0f} GiB HBM: {verdict}")
    lines.append(f"  FLOPs per device per step {r['flops_per_device']:.3e}; collectives per device per step: "
                 f"ICI {r['ici_bytes'] / GiB:.2f} GiB, DCN {r['dcn_bytes'] / GiB:.2f} GiB")
    lines.append(f"  roofline step time {r['step_s'] * 1e3:.1f} ms (compute {r['compute_s'] * 1e3:.1f} ms), "
                 f"MFU <= {100 * r['mfu']:.1f}% (perfect overlap assumed)")
    return "\n".join(lines)
