"""dryrun.py: will this configuration fit and how fast could it be? Answered without any hardware.

    python train.py --dry-run --flavor llama3_405b --mesh dcn=2,ici=128 --chip tpu_v5p
    python train.py --task flux --flavor flux_dev --dry-run --image-size 1024 --batch-size 4 --mesh ici=4

A task describes its model to the planner as a `Workload` (Task.plan_workload: parameters grouped by
how a layout splits them, FLOPs and tokens of a sample, saved activations); `estimate` and `plan`
work on that alone (a language model's Workload is built here, `lm_workload`; FLUX's in
flux_task.py). The whole step (graph_trainer.build_step_fn with the task's loss) is traced by make_fx
on meta tensors, at full width and with the TPU kernels (a language model's config rewrite; FLUX's
flash attention), so the graph's saved activations are exact for one block of each kind and one
more; the per-block differences extrapolate to the full depths (blocks of a kind are the same:
`extrapolate`). Nothing is allocated. Parameters, gradients and AdamW state follow from the
parameter counts and the layout (fp32; the TP-split weights over ici x tp, the experts over all
data-parallel ranks, the rest over ici; replicated over dcn), as train.py places them; FSDP
collectives from the same. The step time is a roofline: max(compute at peak, FSDP's ICI traffic,
DCN traffic), i.e. FSDP overlapped with compute, plus the TP/EP collectives, which sit on the
critical path; a lower bound, the MFU an upper bound.

Layouts (mesh dims dcn, ici, tp, ep as in train.py): tensor parallelism splits the attention and
dense-MLP matmuls, the compute and (sequence parallel) the saved activations tp ways and adds its
activation all-gathers / reduce-scatters on ICI; expert parallelism splits the experts over ep and
adds two all-to-alls of the routed rows per MoE layer, forward and backward. `--plan --chips N`
enumerates them all and ranks them. Ignored: collective latency and imperfect overlap, the
all-to-all's load imbalance, attention FLOPs outside the 12*L*H*hd*S term, the gathered inputs
that TP saves whole, fragmentation and XLA's own buffers, and DCN topology (one number per chip).
"""
import dataclasses
import math

import torch

import device as dev
import graph_passes
import graph_trainer
import optim
from model import Transformer, flops_per_token, next_token_loss, param_counts, tpu_config

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


def step_saved_bytes(model, loss, batch, remat):
    """Saved-activation bytes of the whole training step of `model` (on meta, cast to bf16) with a
    task's `loss(model, batch)` on an example `batch` of meta tensors: traced, nothing allocated."""
    model = model.to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    params = [p.detach() for p in model.parameters()]
    state = [torch.zeros_like(p) for p in params]
    step_fn = graph_trainer.build_step_fn(model, names, loss, 1.0, (0.9, 0.95), 1e-8, 0.1,
                                          optim.decay_mask(names, params), lambda: torch.autocast("cpu", enabled=False))
    one = torch.ones((), device="meta")
    gm = graph_trainer.capture(step_fn, (params, list(model.buffers()), state, state, one, one, *batch))
    if remat:
        gm = graph_passes.remat(gm)
    return graph_passes.saved_bytes(gm)


def extrapolate(saved_at, depths):
    """Saved bytes at full depth from traces at one block of each kind (`saved_at({field: n})`), plus
    one more block of each kind in turn: blocks of a kind are equal, so bytes are linear in each depth."""
    ones = {field: 1 for field in depths}
    base = saved_at(ones)
    return base + sum((n - 1) * (saved_at({**ones, field: 2}) - base) for field, n in depths.items())


def traced_saved_bytes(args, local_batch, seq_len, remat):
    """Saved-activation bytes of the traced language-model step for `args` (bf16 compute), on meta tensors."""
    with torch.device("meta"):
        model = Transformer(args)
    tokens = torch.zeros(local_batch, seq_len, dtype=torch.long, device="meta")
    return step_saved_bytes(model, next_token_loss, (tokens, tokens), remat)


def param_groups(args):
    """Parameter counts by how a layout splits them: (tp: the attention and dense-MLP matmuls, the
    embedding and head (vocabulary-split), experts: the MoE experts, rest: norms, routers; MoE
    models have no tp, so their embedding is `rest`), whole model and one layer."""
    D, hd, L = args.dim, args.hd, args.n_layers
    emb = param_counts(args)[1] * (1 if args.tie_embeddings else 2)
    attn = D * hd * (2 * args.n_heads + 2 * args.n_kv_heads)
    layer_tp = attn + (0 if args.n_experts else 3 * D * args.ffn_dim)
    layer_experts = 3 * args.n_experts * D * args.moe_ffn_dim if args.n_experts else 0
    total = param_counts(args)[0]
    layer_total = param_counts(dataclasses.replace(args, n_layers=2))[0] - param_counts(dataclasses.replace(args, n_layers=1))[0]
    whole = {"tp": L * layer_tp + (0 if args.n_experts else emb), "experts": L * layer_experts}
    whole["rest"] = total - whole["tp"] - whole["experts"]
    layer = {"tp": layer_tp, "experts": layer_experts, "rest": layer_total - layer_tp - layer_experts}
    return whole, layer


def saved_bytes_per_sequence(args, seq_len, remat):
    """Saved activations of one sequence (bf16), traced at 1 and 2 layers, extrapolated to the depth."""
    return extrapolate(lambda depth: traced_saved_bytes(dataclasses.replace(args, **depth), 1, seq_len, remat),
                       {"n_layers": args.n_layers})


@dataclasses.dataclass
class Workload:
    """What a task tells the planner about one training sample at full scale (Task.plan_workload):
    the only seam between dryrun.py and a model. Parameters are grouped by how a layout splits them:
    "tp" (the matmuls tensor parallelism splits), "experts" (split over ep), "rest" (FSDP over ici only)."""
    label: str                 # the flavor, for the report
    whole: dict                # parameters of the model, by group
    layer: dict                # parameters of its largest block (the unit FSDP gathers), by group
    flops_per_sample: float    # model FLOPs of one sample, forward + backward
    tokens: int                # tokens per sample
    saved_bytes: object        # remat -> saved-activation bytes of one sample (bf16), traced
    check: object              # dims -> a refusal (one line) of the layout, or None
    dim: int = 0               # activation width, blocks and top-k: what TP and EP move per token
    n_layers: int = 0
    n_experts: int = 0         # > 0: the planner also tries ep
    top_k: int = 0


def lm_workload(args, flavor, seq_len):
    """A language model's Workload: the TPU config rewrite, then its parameter groups and FLOPs."""
    import expert_parallel
    import tensor_parallel
    args = tpu_config(args)
    whole, layer = param_groups(args)
    plain_loss = dataclasses.replace(args, loss_impl="plain")  # (under tp the loss is the vocab-parallel one)

    def check(dims):
        for size, refusal_of in ((dims["tp"], tensor_parallel.check), (dims["ep"], expert_parallel.check)):
            refusal = refusal_of(plain_loss, size) if size > 1 else None
            if refusal:
                return refusal
        return None
    return Workload(flavor, whole, layer, flops_per_token(args, seq_len) * seq_len, seq_len,
                    lambda remat: saved_bytes_per_sequence(args, seq_len, remat), check, dim=args.dim,
                    n_layers=args.n_layers, n_experts=args.n_experts, top_k=args.top_k)


def dry_run(args, flavor, dims, batch_size, seq_len, chip, remat, per_sequence=None):
    """A language model's dry run for one layout (see `estimate`)."""
    return estimate(lm_workload(args, flavor, seq_len), dims, batch_size, chip, remat, per_sequence)


def estimate(w, dims, batch_size, chip, remat, per_sample=None):
    """Memory per chip, traffic per link, roofline step time of Workload `w` on one layout (dims:
    mesh.mesh_dims); ValueError (one line) for a layout the model or batch does not allow."""
    dcn, ici, tp, ep = dims["dcn"], dims["ici"], dims["tp"], dims["ep"]
    dp, devices = dcn * ici, dcn * ici * tp
    if batch_size % dp:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the {dp} data-parallel ranks of the mesh")
    refusal = w.check(dims)
    if refusal:
        raise ValueError(refusal)
    spec, local_batch = TPU_SPECS[chip], batch_size // dp
    whole, layer = w.whole, w.layer
    total = sum(whole.values())
    # 1. parameters per chip: matmuls split over ici x tp, experts over all dp ranks (ep x their FSDP
    #    group), the rest over ici (replicated over dcn and tp)
    shard = math.ceil(whole["tp"] / (ici * tp)) + math.ceil(whole["experts"] / dp) + math.ceil(whole["rest"] / ici)
    gathered = layer["tp"] / tp + layer["experts"] / ep + layer["rest"]  # one block, after FSDP's gather
    # 2. saved activations: linear in the batch; sequence parallelism splits them over tp
    per_sample = per_sample if per_sample is not None else w.saved_bytes(remat)
    mem = {"params (fp32 shard)": 4 * shard, "grads (fp32 shard)": 4 * shard, "AdamW state (fp32 shard)": 8 * shard,
           "gathered layer (bf16, x2 prefetch)": 2 * 2 * gathered,
           "saved activations (bf16)": per_sample * local_batch / tp}
    flops = w.flops_per_sample * local_batch / tp     # model FLOPs per device per step
    # 3. traffic per chip per step. FSDP: all-gather fwd + bwd (bf16), reduce-scatter (fp32)
    fsdp = 8 * (whole["tp"] / tp + whole["rest"]) * (ici - 1) / ici + 8 * whole["experts"] / ep * (dp // ep - 1) / (dp // ep)
    act = 2 * local_batch * w.tokens * w.dim  # one (B, S, D) activation, bf16
    # TP + SP: per layer 2 all-gathers + 2 reduce-scatters forward, the same backward
    tp_bytes = w.n_layers * 8 * act * (tp - 1) / tp
    # EP: per MoE layer, the routed rows (top_k per token) out and back, forward and backward
    ep_bytes = (w.n_layers * 4 * act * w.top_k * (ep - 1) / ep) if w.n_experts else 0
    ici_bytes = fsdp + tp_bytes + ep_bytes
    dcn_bytes = 2 * 4 * (shard - math.ceil(whole["experts"] / dp)) * (dcn - 1) / dcn  # grads all-reduce
    compute_s = flops * (4 / 3 if remat else 1) / spec["peak"]             # remat replays ~one forward
    # FSDP's and DCN's collectives overlap compute (prefetch); TP's and EP's sit between a layer's
    # matmuls, on the critical path: exposed
    times = {"compute": compute_s, "ici": fsdp / spec["ici_bw"], "dcn": dcn_bytes / DCN_BW}
    exposed_s = (tp_bytes + ep_bytes) / spec["ici_bw"]
    step_s = max(times.values()) + exposed_s
    need = sum(mem.values())
    mesh = ",".join(f"{k}={v}" for k, v in dims.items() if v > 1 or k == "ici")
    return {"flavor": w.label, "chip": chip, "mesh": mesh, "devices": devices, "params": total, "remat": remat,
            "local_batch": local_batch, "seq_len": w.tokens, "memory_bytes": mem, "total_bytes": need,
            "hbm_bytes": spec["hbm"], "fits": need <= spec["hbm"], "flops_per_device": flops,
            "ici_bytes": ici_bytes, "ici_split": {"fsdp": fsdp, "tp": tp_bytes, "ep": ep_bytes}, "dcn_bytes": dcn_bytes,
            "compute_s": compute_s, "exposed_s": exposed_s, "step_s": step_s, "bound": max(times, key=times.get),
            "mfu": flops / (step_s * spec["peak"])}


def _powers_of_two(limit):
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def plan(w, chips, batch_size, chip):
    """Every layout of `chips` (dcn x ici x tp, ep borrowing dp ranks; remat on/off) that the model
    and batch allow, ranked: fitting ones first, then by roofline step time."""
    per_sample = {r: w.saved_bytes(r) for r in (False, True)}
    rows = []
    for dcn in (d for d in (1, 2, 4, 8) if chips % d == 0):
        for tp in (t for t in _powers_of_two(chips // dcn) if t <= 16):
            ici = chips // (dcn * tp)
            for ep in (_powers_of_two(min(dcn * ici, w.n_experts)) if w.n_experts else [1]):
                dims = {"dcn": dcn, "ici": ici, "tp": tp, "ep": ep}
                for remat in (False, True):
                    try:
                        rows.append(estimate(w, dims, batch_size, chip, remat, per_sample[remat]))
                    except ValueError:
                        continue
    rows.sort(key=lambda r: (not r["fits"], r["step_s"], r["total_bytes"]))
    return rows


def main(w, cfg):
    """train.py --dry-run [--plan --chips N]: print the report (or the ranked layouts) of the task's
    Workload `w` and its JSON."""
    import json
    import mesh
    if cfg.chip not in TPU_SPECS:
        raise ValueError(f"--chip {cfg.chip!r}: choose one of {', '.join(TPU_SPECS)}")
    if cfg.plan:
        if not cfg.chips or cfg.chips < 1:
            raise ValueError("--plan needs --chips N (N >= 1)")
        rows = plan(w, cfg.chips, cfg.batch_size, cfg.chip)
        if not rows:
            raise ValueError(f"no layout of {cfg.chips} chips fits the model's heads/experts and --batch-size {cfg.batch_size}")
        print(format_plan(rows, cfg))
        print(json.dumps([{k: r[k] for k in ("mesh", "remat", "local_batch", "total_bytes", "fits", "step_s", "mfu", "bound")}
                          for r in rows]), flush=True)
        return 0
    report = estimate(w, mesh.mesh_dims(cfg.mesh or "ici=1"), cfg.batch_size, cfg.chip, cfg.remat)
    print(format_report(report))
    print(json.dumps(report), flush=True)
    return 0


def format_plan(rows, cfg, top=15):
    lines = [f"plan: {rows[0]['flavor']} on {cfg.chips} x {cfg.chip}, global batch {cfg.batch_size} x "
             f"{rows[0]['seq_len']} tokens; "
             f"{len(rows)} layouts, best {min(top, len(rows))} (roofline: FSDP overlapped, TP/EP exposed)",
             f"  {'mesh':<28} {'remat':<5} {'batch/dp':>8} {'HBM GiB':>8} {'fits':<4} {'step ms':>9} "
             f"{'TP/EP ms':>9} {'MFU':>6}  bound"]
    for r in rows[:top]:
        lines.append(f"  {r['mesh']:<28} {'on' if r['remat'] else 'off':<5} {r['local_batch']:>8} "
                     f"{r['total_bytes'] / GiB:>8.1f} {'yes' if r['fits'] else 'NO':<4} {r['step_s'] * 1e3:>9.1f} "
                     f"{r['exposed_s'] * 1e3:>9.1f} {100 * r['mfu']:>5.1f}%  {r['bound']}")
    return "\n".join(lines)


def format_report(r):
    lines = [f"dry run: {r['flavor']} ({r['params'] / 1e9:.2f}B params) on {r['devices']} x {r['chip']} "
             f"({r['mesh']}), {r['local_batch']} x {r['seq_len']} tokens per device"]
    for name, b in r["memory_bytes"].items():
        lines.append(f"  {name:<36} {b / GiB:10.2f} GiB")
    verdict = "fits" if r["fits"] else f"DOES NOT FIT: short by {(r['total_bytes'] - r['hbm_bytes']) / GiB:.2f} GiB"
    lines.append(f"  {'total per device':<36} {r['total_bytes'] / GiB:10.2f} GiB of {r['hbm_bytes'] / GiB:.0f} GiB HBM: {verdict}")
    split = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["ici_split"].items() if v)
    lines.append(f"  FLOPs per device per step {r['flops_per_device']:.3e}; collectives per device per step: "
                 f"ICI {r['ici_bytes'] / GiB:.2f} GiB ({split or 'none'}), DCN {r['dcn_bytes'] / GiB:.2f} GiB")
    lines.append(f"  roofline step time {r['step_s'] * 1e3:.1f} ms (compute {r['compute_s'] * 1e3:.1f} ms, TP/EP exposed "
                 f"{r['exposed_s'] * 1e3:.1f} ms), MFU <= {100 * r['mfu']:.1f}% (FSDP overlap assumed; bound by {r['bound']})")
    return "\n".join(lines)
