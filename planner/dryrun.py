"""planner/dryrun.py: will this configuration fit and how fast could it be? Answered without any hardware.

    python train.py --dry-run --flavor llama3_405b --mesh dcn=2,ici=128 --chip tpu_v5p
    python train.py --task flux --flavor flux_dev --dry-run --image-size 1024 --batch-size 4 --mesh ici=4

A model family describes its model to the planner as a `Workload` (ModelFamily.plan: parameters
grouped by how a layout splits them, FLOPs and tokens of a sample, saved activations); `estimate` and
`plan` work on that alone (a language model's Workload is built here, `lm_workload`; FLUX's in
flux/task.py). The whole step (graph_trainer.build_step_fn with the task's loss) is traced by make_fx
on meta tensors, at full width and with the TPU kernels (a language model's config rewrite; FLUX's
flash attention), so the graph's saved activations are exact for one block of each kind and one
more; the per-block differences extrapolate to the full depths (blocks of a kind are the same:
planner/activations.py). Nothing is allocated. Memory, host memory, the verdict and the step time are
planner/stepmodel.py's, one model for the dry run, --plan and the calibration: parameters, gradients
and AdamW state from the family's parameter groups and the layout (fp32; the TP-split weights over
ici x tp, the experts over all data-parallel ranks, the rest over ici; replicated over dcn), as
train.py places them, the traced activations in place of the step model's table; the host memory a
chip's process needs (its shards at start, checkpoint staging, the push bucket, offloaded
activations) against chips.py's host figure. The step time is stepmodel's sum of named parts (matmuls at a
shape-dependent fraction of peak, splash attention with causal blocks skipped, HBM-bound ops, FSDP /
DCN collectives hidden up to an overlap fraction, TP / EP exposed, a host overhead), with the few
free constants fitted on published TPU runs (planner/calibration.json, planner/calibrate.py):

    python -m planner.dryrun --calibrate [--breakdown]   # predicted vs published for every run, and the fit
    python -m planner.anchor [--flux]            # this CPU as the chip: predicted vs measured step

Layouts (mesh dims dcn, ici, tp, ep as in train.py): tensor parallelism splits the attention and
dense-MLP matmuls, the compute and (sequence parallel) the saved activations tp ways and adds its
activation all-gathers / reduce-scatters on ICI; expert parallelism splits the experts over ep and
adds two all-to-alls of the routed rows per MoE layer, forward and backward. `--plan --chips N`
enumerates them all (each uses exactly N chips) and ranks them, the layouts that fit first; when none fits it says so in one
line with the cheapest change that would (`cheapest_fix`). Ignored: the gathered inputs that TP
saves whole, fragmentation and XLA's own buffers, and DCN topology (one number per chip).
"""
import dataclasses
import math
import sys

import mesh as mesh_lib
from planner import chips as chips_lib
from planner import shapes
from planner import stepmodel
from planner.activations import saved_bytes_per_sequence
from planner.report import format_plan, format_report, judged, remat_label
from model import flops_per_token, param_counts, tpu_config
import expert_parallel
import tensor_parallel
from planner import calibrate

GiB = 2**30
# Per chip (chips.py: published HBM bytes and bandwidth, ICI bandwidth, bf16 peak), in the older dict
# form callers read
TPU_SPECS = {name: dict(hbm=c.hbm_bytes, hbm_bw=c.hbm_bw, ici_bw=c.ici_bw, peak=c.peak_flops, devices=c.devices)
             for name, c in chips_lib.CHIPS.items()}


param_groups = shapes.lm_param_groups   # (the one count: the step model's shapes use it too)
# stepmodel's memory terms under the dry run's labels (minititan's layout: fp32 state)
MEMORY_LABELS = {"parameters": "params (fp32 shard)", "gradients": "grads (fp32 shard)",
                 "optimizer state": "AdamW state (fp32 shard)", "gradient accumulator": "grad sum (fp32 shard, --grad-accum)",
                 "gathered block (bf16, x2)": "gathered layer (bf16, x2 prefetch)",
                 "saved activations": "saved activations (bf16)", "transient peak": "transient peak (beyond the block)"}


@dataclasses.dataclass
class Workload:
    """What a task tells the planner about one training sample at full scale (ModelFamily.plan):
    the only seam between planner/dryrun.py and a model. Parameters are grouped by how a layout splits them:
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
    shape: object = None       # shapes.Shape: the step-time model's view (matmuls, attention, activations)
    splits_sequences: bool = False  # the planner also tries cp (context parallel: the task's loss allows it)
    program: object = None     # (global batch, --kernels, data-parallel devices) -> step_compile.Program: the step to
    #                            compile (--compile)


def lm_workload(args, flavor, seq_len):
    """A language model's Workload: the TPU config rewrite, then its parameter groups and FLOPs."""
    from tpu_pod import step_compile
    args = tpu_config(args)
    whole, layer = param_groups(args)
    plain_loss = dataclasses.replace(args, loss_impl="plain")  # (under tp the loss is the vocab-parallel one)
    reference = dataclasses.replace(args, attn_impl="sdpa", loss_impl="plain")  # (--compile without --kernels pallas)

    def check(dims):
        cp = dims.get("cp", 1)
        refusal = expert_parallel.check_buffer_factor(args, dims["ep"])
        if refusal:
            return refusal
        if cp > 1 and (dims["tp"] > 1 or dims["ep"] > 1 or seq_len % (2 * cp)):
            return f"cp={cp} is built beside FSDP / HSDP only, on a --seq-len divisible by 2 x cp"
        for size, refusal_of in ((dims["tp"], tensor_parallel.check), (dims["ep"], expert_parallel.check)):
            refusal = refusal_of(plain_loss, size) if size > 1 else None
            if refusal:
                return refusal
        return None

    def program(batch_size, kernels, shards):  # (--compile: the Pallas kernels with --kernels pallas, else the reference)
        compiled = args if kernels == "pallas" else reference
        return step_compile.lm_program(compiled, batch_size, seq_len,
                                       lambda remat: saved_bytes_per_sequence(compiled, seq_len, remat), shards)
    return Workload(flavor, whole, layer, flops_per_token(args, seq_len) * seq_len, seq_len,
                    lambda remat: saved_bytes_per_sequence(args, seq_len, remat), check, dim=args.dim,
                    n_layers=args.n_layers, n_experts=args.n_experts, top_k=args.top_k,
                    shape=shapes.lm_shape(args, seq_len, flavor, fused_loss=True), splits_sequences=True,
                    program=program)


def shape_of(w):
    """The Workload's Shape; a task that gives none is one matmul a layer carrying all its FLOPs (so
    the step is FLOPs at the matmul efficiency plus the collectives: no attention or HBM terms)."""
    if w.shape is not None:
        return w.shape
    side = 4096
    rows = w.flops_per_sample / 3 / (2 * side * side * max(w.n_layers, 1))   # the forward: a third
    return shapes.Shape(w.label, w.tokens, max(w.n_layers, 1), dict(w.whole), dict(w.layer),
                        (shapes.Matmul("all", rows, side, side, max(w.n_layers, 1), "none"),),
                        dict(heads=0, head_dim=0, seq=0, causal=False, layers=0), {"decoder_layer_input": 0},
                        {}, 0.0, dim=w.dim, n_experts=w.n_experts, top_k=w.top_k, model_flops=w.flops_per_sample)


def dry_run(args, flavor, dims, batch_size, seq_len, chip, remat, per_sequence=None):
    """A language model's dry run for one layout (see `estimate`)."""
    return estimate(lm_workload(args, flavor, seq_len), dims, batch_size, chip, remat, per_sequence)


def estimate(w, dims, batch_size, chip, remat, per_sample=None, microbatches=1):
    """Memory per chip, traffic per link, predicted step time (stepmodel.py) of Workload `w` on one
    layout (dims: mesh.mesh_dims) under `remat` (False, True = --remat, or a shapes policy), a rank's
    batch in `microbatches` passes (--grad-accum: one microbatch's activations, FSDP's collectives once
    a microbatch); ValueError (one line) for a layout the model or batch does not allow."""
    dcn, ici, tp, ep, cp = dims["dcn"], dims["ici"], dims["tp"], dims["ep"], dims.get("cp", 1)
    dp, devices, share = dcn * ici, dcn * ici * cp * tp, tp * cp  # (share: the chips of one sample)
    if cp > 1 and not w.splits_sequences:
        raise ValueError(f"cp={cp}: {w.label}'s loss is not split over a sequence's tokens (cp is for language models)")
    if batch_size % dp:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the {dp} data-parallel ranks of the mesh")
    if (batch_size // dp) % microbatches:
        raise ValueError(f"--grad-accum {microbatches}: the {batch_size // dp} samples a data-parallel rank do not "
                         f"split into {microbatches} equal microbatches")
    refusal = w.check(dims)
    if refusal:
        raise ValueError(refusal)
    spec, local_batch = TPU_SPECS[chip], batch_size // dp
    whole, total = w.whole, sum(w.whole.values())
    # saved activations: the trace's bytes a sample (exact for minititan's graph), linear in the batch;
    # sequence parallelism splits them over tp
    if per_sample is None:  # one trace: the policy's own (off / --remat), or --remat's for the others to scale
        with_remat = policy_name(remat) != "none"
        per_sample = saved_per_sample(w, remat, {with_remat: w.saved_bytes(with_remat)})
    flops = w.flops_per_sample * local_batch / share  # model FLOPs per device per step
    # memory, host memory, the verdict and the step time: stepmodel's, for minititan's own layout (fp32
    # master weights and AdamW, FSDP over ici, HSDP over dcn, --remat = keep the matmul outputs), on the
    # family's own parameter groups and the traced activations
    layout = stepmodel.Layout(dcn=dcn, ici=ici, tp=tp, ep=ep, cp=cp, local_batch=local_batch, remat=policy_name(remat),
                              microbatches=microbatches)
    shape = dataclasses.replace(shape_of(w), params=dict(w.whole), layer_params=dict(w.layer))
    pred = stepmodel.predict(shape, layout, chips_lib.CHIPS[chip],
                             saved_bytes=per_sample * local_batch / microbatches / share)
    mem = {MEMORY_LABELS[k]: v for k, v in pred["memory"].items()}
    # traffic per chip per step (stepmodel's bytes, reported): FSDP all-gather fwd + bwd (bf16),
    # reduce-scatter (fp32); TP + SP: per layer 2 all-gathers + 2 reduce-scatters forward, the same
    # backward; EP: per MoE layer, the routed rows out and back, forward and backward
    fsdp = 8 * (whole["tp"] / tp + whole["rest"]) * (ici * cp - 1) / (ici * cp) + 8 * whole["experts"] / ep * (dp // ep - 1) / (dp // ep)
    fsdp *= microbatches  # (every microbatch gathers and reduce-scatters again)
    act = 2 * local_batch * w.tokens * w.dim  # one (B, S, D) activation, bf16
    tp_bytes = w.n_layers * 8 * act * (tp - 1) / tp
    ep_bytes = (w.n_layers * 4 * act * w.top_k * (ep - 1) / ep) if w.n_experts else 0
    cp_bytes = w.n_layers * 2 * stepmodel.kv_bytes(shape, layout) * (cp - 1) / cp  # K/V gathered, grads scattered
    ici_bytes = fsdp + tp_bytes + ep_bytes + cp_bytes
    shard = stepmodel.shard_counts(shape, layout)[0]
    dcn_bytes = 2 * 4 * (shard["tp"] + shard["rest"]) * (dcn - 1) / dcn * microbatches  # grads all-reduce
    parts = {"matmuls": pred["compute"]["matmul"] + pred["compute"]["recompute"],
             "attention": pred["compute"]["attention"],
             "HBM-bound ops": sum(v for k, v in pred["compute"].items() if k not in ("matmul", "recompute", "attention")),
             "exposed ICI/DCN": pred["exposed_comm_s"], "TP/EP/CP": pred["comm"]["tp"] + pred["comm"]["ep"] + pred["comm"]["cp"]}
    need = pred["total_bytes"]
    mesh = ",".join(f"{k}={v}" for k, v in dims.items() if v > 1 or k == "ici")
    return {"flavor": w.label, "chip": chip, "mesh": mesh, "devices": devices, "params": total, "remat": remat,
            "local_batch": local_batch, "microbatches": microbatches, "seq_len": w.tokens, "memory_bytes": mem, "total_bytes": need,
            "hbm_bytes": spec["hbm"], "host_bytes": pred["offload_bytes"], "host_memory_bytes": pred["host"],
            "host_need": pred["host_need"], "host_capacity": chips_lib.CHIPS[chip].host_bytes,
            "fits": pred["fits"], "flops_per_device": flops,
            "ici_bytes": ici_bytes, "ici_split": {"fsdp": fsdp, "tp": tp_bytes, "ep": ep_bytes, "cp": cp_bytes}, "dcn_bytes": dcn_bytes,
            "compute_s": sum(pred["compute"].values()), "exposed_s": pred["comm"]["tp"] + pred["comm"]["ep"] + pred["comm"]["cp"],
            "step_parts_s": parts, "step_s": pred["step_s"], "bound": max(parts, key=parts.get),
            "mfu": flops / (pred["step_s"] * spec["peak"])}


def _powers_of_two(limit):
    return [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def policy_name(remat):
    """estimate's `remat`: False / True (minititan's --remat) or a shapes.POLICIES name / custom dict."""
    if remat is True:
        return "save_matmul_outputs"
    return "none" if remat is False else remat


def saved_per_sample(w, remat, traced):
    """Saved activation bytes a sample under `remat`: the trace where it was traced (off / --remat);
    another policy scales the traced --remat figure by the shape's device-kept elements under each."""
    name = policy_name(remat)
    if isinstance(name, str) and name in ("none", "save_matmul_outputs"):
        return traced[name == "save_matmul_outputs"]
    shape = shape_of(w)
    kept = shapes.policy_split(shape, name)[0]
    reference = shapes.policy_split(shape, "save_matmul_outputs")[0]
    return traced[True] * kept / reference if reference else 0.0


def layouts(w, chips, batch_size, chip, remats, traced, microbatches=1):
    """Every layout of exactly `chips` (dcn x ici x cp x tp, ep borrowing dp ranks; cp where the task
    splits sequences, up to 16) under each remat policy, a rank's batch in `microbatches` passes:
    a tp that does not divide the chips left by dcn is skipped, never rounded down to fewer chips."""
    rows = []
    for dcn in (d for d in (1, 2, 4, 8) if chips % d == 0):
        for tp, cp in ((t, c) for t in _powers_of_two(chips // dcn) if t <= 16 and chips % (dcn * t) == 0
                       for c in (_powers_of_two(min(chips // (dcn * t), 16)) if w.splits_sequences else [1])
                       if chips % (dcn * t * c) == 0):
            ici = chips // (dcn * tp * cp)
            for ep in ([e for e in _powers_of_two(min(dcn * ici, w.n_experts)) if (dcn * ici) % e == 0]
                       if w.n_experts else [1]):
                dims = {"dcn": dcn, "ici": ici, "tp": tp, "ep": ep, "cp": cp}
                for remat in remats:
                    try:
                        rows.append(estimate(w, dims, batch_size, chip, remat, saved_per_sample(w, remat, traced),
                                             microbatches))
                    except ValueError:
                        continue
    # fitting layouts first (a layout that does not fit never ranks above one that does), then by step
    rows.sort(key=lambda r: (not r["fits"], r["step_s"], r["total_bytes"]))
    return rows


# The memory policies --plan ranks beside the layouts: remat off / --remat (False / True), every named
# policy of planner/shapes.py (MaxText's remat_policy names; those of another model kind are skipped),
# and the layer inputs offloaded to host with the rest recomputed (MaxText's custom policy
# decoder_layer_input: offload, as published Ironwood / v6e recipes run it)
PLAN_POLICIES = (False, True, *(n for n in shapes.POLICIES if n not in ("none", "save_matmul_outputs")),
                 {"decoder_layer_input": "offload"})


def plan_policies(w):
    """The PLAN_POLICIES the Workload's model takes, each keeping something else: a preset that keeps,
    offloads and recomputes what an earlier one does (names another model kind has) is not a row."""
    shape, seen, kept = shape_of(w), set(), []
    for policy in PLAN_POLICIES:
        try:
            split = repr(shapes.policy_split(shape, policy_name(policy)))
        except ValueError:  # (another model kind's policy: FLUX's by block kind on a language model)
            continue
        if split not in seen or isinstance(policy, bool):  # (off / on: the two traced, always rows)
            seen.add(split)
            kept.append(policy)
    return kept


def plan(w, chips, batch_size, chip, traced=None, microbatches=1):
    """Every layout of `chips` under every memory policy the model takes (plan_policies) that the model
    and batch allow, a rank's batch in `microbatches` passes, ranked: fitting ones first, then by
    predicted step time."""
    traced = traced or {r: w.saved_bytes(r) for r in (False, True)}
    return layouts(w, chips, batch_size, chip, plan_policies(w), traced, microbatches)


def short_of(rows):
    """What the layouts that do not fit lack, in words: HBM a chip, or where the smallest fits HBM, the
    host memory a chip's process needs (its shards at start, the checkpoint's staging copy, offloaded
    activations: stepmodel.host_terms)."""
    small = min(rows, key=lambda r: r["total_bytes"])
    hbm = f"the smallest needs {small['total_bytes'] / GiB:.1f} of {small['hbm_bytes'] / GiB:.0f} GiB HBM a chip"
    in_hbm = [r for r in rows if r["total_bytes"] <= r["hbm_bytes"]]
    if not in_hbm:
        return hbm
    host = min(in_hbm, key=lambda r: r["host_need"])
    return (f"the smallest in HBM ({host['total_bytes'] / GiB:.1f} of {host['hbm_bytes'] / GiB:.0f} GiB a chip) needs "
            f"{host['host_need'] / 1e9:.0f} GB of host memory a chip, over its {host['host_capacity'] / 1e9:.0f} GB")


def cheapest_fix(w, chips, batch_size, chip, traced, microbatches=1):
    """When no layout fits under any policy: the change that does, cheapest in chip-seconds a sample.
    Tried: gradient accumulation (the same global batch in 2x, 4x, ... the microbatches: one
    microbatch's activations, the same update), 2-8x the chips, a batch halved (down to one sample a
    chip). Returns one line."""
    options = []
    more = microbatches * 2
    while more <= batch_size:  # (layouts whose ranks' batch does not split are skipped by estimate)
        fit = [r for r in plan(w, chips, batch_size, chip, traced, more) if r["fits"]]
        if fit:
            options.append((fit[0]["step_s"] * chips / batch_size, f"--grad-accum {more}", fit[0]))
            break
        more *= 2
    for factor in (2, 4, 8):
        fit = [r for r in plan(w, chips * factor, batch_size, chip, traced, microbatches) if r["fits"]]
        if fit:
            options.append((fit[0]["step_s"] * chips * factor / batch_size, f"{chips * factor} chips", fit[0]))
            break
    batch = batch_size // 2
    while batch >= 1:
        fit = [r for r in plan(w, chips, batch, chip, traced, microbatches) if r["fits"]]
        if fit:
            options.append((fit[0]["step_s"] * chips / batch, f"global batch {batch}", fit[0]))
            break
        batch //= 2
    if not options:
        return ("cheapest change that fits: none found (tried gradient accumulation, 8x the chips, smaller "
                "batches, every memory policy)")
    cost, label, r = min(options, key=lambda o: o[0])
    return (f"cheapest change that fits: {label} -> {r['mesh']}, remat {remat_label(r['remat'])}, {r['total_bytes'] / GiB:.1f} GiB, "
            f"step {r['step_s'] * 1e3:.0f} ms ({cost * 1e3:.1f} chip-ms a sample)")


def main(w, cfg):
    """train.py --dry-run [--plan --chips N | --compile]: print the report (the ranked layouts; the
    step compiled for a TPU beside its estimate) of the task's Workload `w` and its JSON."""
    import json
    if cfg.chip not in chips_lib.CHIPS:
        raise ValueError(f"--chip {cfg.chip!r}: choose one of {', '.join(chips_lib.CHIPS)}")
    accumulation = getattr(cfg, "grad_accum", 1)
    if cfg.chips is not None and cfg.chips < 1:  # (0 is no chip count, not "the default")
        raise ValueError(f"--chips must be >= 1, got {cfg.chips}")
    laid_out = math.prod(v for k, v in mesh_lib.mesh_dims(cfg.mesh).items() if k != "ep") if cfg.mesh else 0
    if cfg.chips and laid_out and laid_out != cfg.chips:  # (both name the chips: they must agree)
        raise ValueError(f"--mesh {cfg.mesh} lays out {laid_out} chips, --chips says {cfg.chips}: give one of them")
    if cfg.plan and cfg.mesh:  # (the ranking ignored it)
        raise ValueError(f"--plan ranks every layout of --chips; --mesh {cfg.mesh} is one layout: give one of them")
    if getattr(cfg, "topology", None) and not getattr(cfg, "compile", False):  # (the estimate ignored it: one chip)
        raise ValueError(f"--topology {cfg.topology} names the chips the compile targets: add --compile, or give "
                         f"the estimate's layout with --mesh / --plan --chips")
    effort = getattr(cfg, "compile_effort", 0.0)
    if effort and not getattr(cfg, "compile", False):  # (the estimate would ignore it)
        raise ValueError(f"--compile-effort {effort} is the TPU compiler's: add --compile")
    if cfg.chips and not (laid_out or cfg.plan or getattr(cfg, "compile", False)):
        raise ValueError(f"--chips {cfg.chips} is for --plan (rank its layouts) or --compile (compile the "
                         f"first): add one, or give the layout with --mesh")
    if getattr(cfg, "compile", False) and cfg.plan:  # (the compile takes --plan's first layout by itself)
        raise ValueError("--plan ranks the layouts, --compile compiles one (without --mesh: the one --plan ranks "
                         "first): give one of them")
    if getattr(cfg, "compile", False):  # (a namespace without the flag: the estimate)
        from tpu_pod import target as tpu_target
        if not tpu_target.EFFORTS[0] <= effort <= tpu_target.EFFORTS[1]:
            raise ValueError(f"--compile-effort {effort}: XLA's exec_time_optimization_effort is from -1 to 1")
        return compiled_report(w, cfg, compile_dims(w, cfg), cfg.remat)
    if cfg.plan:
        if not cfg.chips:
            raise ValueError("--plan needs --chips N (N >= 1)")
        traced = {r: w.saved_bytes(r) for r in (False, True)}
        rows = plan(w, cfg.chips, cfg.batch_size, cfg.chip, traced, accumulation)
        if not rows:
            raise ValueError(f"no layout of {cfg.chips} chips fits the model's heads/experts and --batch-size {cfg.batch_size}")
        if not rows[0]["fits"]:
            print(f"no layout of {cfg.chips} x {cfg.chip} fits at global batch {cfg.batch_size}: {short_of(rows)}; "
                  + cheapest_fix(w, cfg.chips, cfg.batch_size, cfg.chip, traced, accumulation))
            print(json.dumps([]), flush=True)
            return 0
        print(format_plan(rows, cfg))
        print(json.dumps([{k: r[k] for k in ("mesh", "remat", "local_batch", "total_bytes", "fits", "step_s", "mfu", "bound")}
                          for r in rows]), flush=True)
        return 0
    report = estimate(w, mesh_lib.mesh_dims(cfg.mesh or "ici=1"), cfg.batch_size, cfg.chip, cfg.remat,
                      microbatches=accumulation)
    print(format_report(report))
    print(json.dumps(report), flush=True)
    return 0


def compile_dims(w, cfg):
    """--compile's layout: --mesh; else, given --chips N (or --plan --chips N) or --topology's chips, the
    one --plan ranks first among those the compile lays out (dcn x ici x tp | cp: FSDP / HSDP, with tp or
    cp where the step has no --scan or Pallas kernels, which they do not compile; ep within a slice;
    one slice for a --topology) under the memory policy of the compiled program (--remat off or on; --scan: each
    layer's input kept, or offloaded with --offload); else one chip."""
    from tpu_pod import target as tpu_target
    topology = getattr(cfg, "topology", None)
    chips = cfg.chips or (tpu_target.topology_chips(cfg.chip, topology) if topology else 0)
    if cfg.mesh or not chips:
        return mesh_lib.mesh_dims(cfg.mesh or "ici=1")
    policy = compiled_policy(cfg, cfg.remat)
    traced_remat = policy_name(policy) != "none"  # (the one trace saved_per_sample reads for it)
    traced = {traced_remat: w.saved_bytes(traced_remat)}
    tp_compiles = not getattr(cfg, "scan", False) and getattr(cfg, "kernels", "reference") != "pallas"  # (cp's too)
    ep_compiles = lambda d: d["ep"] == 1 or (d["tp"] == d["cp"] == 1 and d["ici"] % d["ep"] == 0)
    lays_out = lambda d: ep_compiles(d) and (d["tp"] == d["cp"] == 1 or tp_compiles) and (d["dcn"] == 1 or not topology)
    rows = [r for r in layouts(w, chips, cfg.batch_size, cfg.chip, [policy], traced) if lays_out(mesh_lib.mesh_dims(r["mesh"]))]
    if not rows:
        raise ValueError(f"no FSDP / HSDP{' / tp / cp' if tp_compiles else ''} layout of {chips} chips takes --batch-size "
                         f"{cfg.batch_size}")
    print(f"--compile: the layout --plan ranks first of {chips} x {cfg.chip} among those it lays out (dcn x ici x tp | cp, ep), "
          f"remat {remat_label(policy)}: --mesh {rows[0]['mesh']}", flush=True)
    return mesh_lib.mesh_dims(rows[0]["mesh"])


def compiled_policy(cfg, remat):
    """The compiled program's memory policy: --scan keeps each layer's input (offloaded with --offload)
    and replays its forward; else `remat` (--remat off or on)."""
    if getattr(cfg, "scan", False):
        return {"decoder_layer_input": "offload"} if getattr(cfg, "offload", False) else "full"
    return remat


FAR_PAST_HBM = 4  # a step the planner puts at more than 4x HBM is refused before the compile


def compiled_report(w, cfg, dims, remat):
    """--compile: the step compiled by the TPU compiler (tpu_pod/step_compile.py) beside this layout's estimate,
    whose activations are traced for the same implementations as the compiled program."""
    from tpu_pod import step_compile
    if w.program is None:
        raise ValueError(f"--compile: the {w.label} workload gives no step to compile")
    shards = dims["dcn"] * dims["ici"] * TPU_SPECS[cfg.chip]["devices"]  # (the compiler's data-parallel devices)
    program = w.program(cfg.batch_size, getattr(cfg, "kernels", "reference"), shards)
    if getattr(cfg, "offload", False) and not getattr(cfg, "scan", False):
        raise ValueError("--compile --offload offloads --scan's layer inputs to host: add --scan")
    remat = compiled_policy(cfg, remat)
    traced = policy_name(remat) != "none"
    planned = estimate(w, dims, cfg.batch_size, cfg.chip, remat,
                       saved_per_sample(w, remat, {traced: program.saved_bytes(traced)}), getattr(cfg, "grad_accum", 1))
    if planned["total_bytes"] > FAR_PAST_HBM * planned["hbm_bytes"]:  # (the planner's error is within +-50%)
        raise ValueError(f"does not fit: the planner puts this step at {planned['total_bytes'] / GiB:,.0f} GiB a chip, "
                         f"{planned['total_bytes'] / planned['hbm_bytes']:.0f}x its {planned['hbm_bytes'] / GiB:.0f} GiB HBM "
                         f"(not compiled: the compiler would run minutes to say so); give more chips, "
                         f"--grad-accum or a smaller --batch-size (--plan ranks what fits)")
    return judged(step_compile.main(program, planned, cfg, TPU_SPECS[cfg.chip]), planned)


def cli(argv):
    """python -m planner.dryrun ARGS: the calibration table and its compiler column (the dry run itself is
    train.py --dry-run). The exit code: 0, or 2 with one `error:` line."""
    usage = ("python -m planner.dryrun --calibrate [--breakdown]: the planner against every published run of "
             "planner/calibration.json;\npython -m planner.dryrun --calibrate --compile [RUN_ID ...]: each run compiled "
             "by the TPU compiler (minutes a run).\nThe dry run itself is train.py --dry-run (--plan --chips N, "
             "--compile); the CPU anchor python -m planner.anchor.")
    if argv in (["-h"], ["--help"]):
        print(usage)
        return 0
    try:
        if argv[:1] == ["--calibrate"] and set(argv[1:]) <= {"--breakdown"}:
            return calibrate.main(argv[1:])
        if argv[:2] == ["--calibrate", "--compile"]:  # (the compiler column: minutes a run)
            from planner import compile_column
            return compile_column.main(argv[2:])
        raise ValueError(f"expected --calibrate [--breakdown] or --calibrate --compile [RUN_ID ...], got "
                         f"{' '.join(argv) or 'nothing'} (--help: the usage)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
