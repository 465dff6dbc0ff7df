"""stepmodel.py: the step time and the memory of one training step of a `shapes.Shape` on a `Layout`
of chips, from named parts. Read top to bottom: every term is one function of the shape, the layout
and the chip's constants (chips.py), and `predict` adds them up.

Time. The chip's cores do, one after another (they are the same cores):
  matmuls      forward + backward (dX and dW: 3x the forward FLOPs) + whatever the remat policy
               recomputes, each at `matmul_efficiency` x peak, lowered where a dim is not a multiple
               of the MXU tile (padding) or shorter than 4 tiles (pipeline fill); the MoE experts'
               grouped (or capacity-padded) matmuls at `moe_efficiency` instead;
  attention    flash / splash attention: QK^T and PV (4 S^2 H hd a sample-layer) forward, 2.5x that
               backward (it recomputes the scores: 5 contractions against 2), only the blocks on or
               below the diagonal when causal (splash skips the rest), at the matmul efficiency x
               ATTENTION_RELATIVE_EFFICIENCY;
  HBM-bound    every non-matmul op (norms, RoPE, residuals, SwiGLU / GELU: forward, backward 2x,
               recompute 1x), the optimizer's bytes a parameter, the copies of FSDP's gathered
               weights (written by the gather, read by the matmul), the loss's logits, each at the
               chip's published HBM bandwidth.
Beside them, on the interconnect: FSDP's all-gathers and reduce-scatters (or DDP's all-reduce) on
ICI as latency x ring steps + bytes / bandwidth; the cross-slice traffic on DCN; host offload's
transfers on the host link. A share OVERLAP of those hides behind the compute, the rest is exposed.
Tensor parallelism's activation collectives and expert parallelism's all-to-all (times a
load-imbalance factor) sit between a layer's matmuls: exposed. So does context parallelism's
all-gather of a layer's keys and values before its attention (and their gradients' reduce-scatter
after it), on ICI: a cp group splits each sample's tokens (its compute, saved activations and
logits cp ways, like tp's samples) and is data-parallel for the weights (FSDP over ici x cp). Plus a
fixed host overhead a step.

The matmuls run at the chip's peak for their precision (`Precision.matmul`: bf16; int8 or fp8 where a
recipe quantizes them, e.g. MaxText's `quantization=int8` on v6e and `fp8_full` on Ironwood, over
fp32 master weights; chips.matmul_peak: each chip's published figure, a chip without one refused).
The fitted efficiency is the bf16 one, assumed to hold at the lower precision; attention stays bf16.

Memory (a chip): parameters, gradients and optimizer state at their dtypes (`Precision`: fp32
master weights as torchtitan / minititan keep them, or bf16 as MaxText's weight_dtype), sharded as
the layout says; FSDP's gathered block (bf16, double-buffered); the activations the remat policy
keeps on device; the largest of three transient peaks (one layer's full activations while its
backward runs, the logits and their gradient, or the fused loss's gathered head and its gradient);
the loss's two outside the layers, where no block is gathered (so they share the block's bytes);
the block and the head once for each device a chip shows (Ironwood's two TensorCores); with gradient accumulation (`microbatches`) the
activations of one microbatch and a second gradient buffer (the running sum beside the microbatch's
own), while FSDP's gathers and reduce-scatters repeat every microbatch (time and bytes). Host
memory (a chip's process): its parameter shards at start, then the checkpoint's staging copy, the
weight push's bucket and the offloaded activations (`host_terms`). `fits` is the one verdict on
both, for the dry run, --plan and calibrate.
"""
import dataclasses
import math

from planner import chips as chips_lib
from planner.shapes import policy_split

BYTES_BF16 = 2
MOE_IMBALANCE = 1.3     # assumed: the busiest expert rank's share over the mean (all-to-all waits for it)
ROW_PARALLEL = ("out_proj", "mlpwo", "img_proj", "txt_proj", "img_mlp_out", "txt_mlp_out", "single_out")
ATTENTION_BLOCK = 512   # splash attention's default q / kv block (causal skipping is per block)


@dataclasses.dataclass(frozen=True)
class Precision:
    weight: int = 4       # bytes a parameter (fp32 master weights)
    grad: int = 4
    optimizer: int = 8    # AdamW's two moments
    matmul: str = "bf16"  # what the MXU multiplies in (chips.MATMUL_PEAKS): bf16, int8, fp8


# A run's `precision`: its master weights' dtype (fp32, bf16), or a quantized recipe's matmuls over fp32
# master weights (MaxText's quantization=int8 / fp8_full: weights, gradients, AdamW and activations stored
# as without it; the matmuls' inputs quantized on the fly)
PRECISIONS = {"fp32": Precision(4, 4, 8), "bf16": Precision(2, 2, 4),
              "int8": Precision(4, 4, 8, "int8"), "fp8_full": Precision(4, 4, 8, "fp8")}
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2}


def precision(name="fp32", mu_dtype=None):
    """State bytes a parameter and the matmuls' precision of a run's `precision` (PRECISIONS): weights
    and gradients at its weight dtype; AdamW's first moment at `mu_dtype` (MaxText's mu_dtype; default:
    the weights' dtype, as optax keeps it), the second at the weights'. One-line ValueError otherwise."""
    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    base = PRECISIONS[name]
    if mu_dtype is not None and mu_dtype not in DTYPE_BYTES:
        raise ValueError(f"mu_dtype {mu_dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    w = base.weight
    return Precision(w, w, (DTYPE_BYTES[mu_dtype] if mu_dtype else w) + w, base.matmul)


@dataclasses.dataclass(frozen=True)
class Layout:
    """dcn slices x ici chips a slice x cp x tp; ep borrows data-parallel ranks; a cp group splits its
    samples' sequences (context_parallel.py), sharing its samples' work as a tp group does. `dp_mode`: "fsdp" shards
    parameters over the ici ranks, "ddp" replicates them (MaxDiffusion's default); `dcn_mode`:
    "replicate" (HSDP: one gradient all-reduce crosses DCN) or "fsdp" (shards across slices too)."""
    dcn: int = 1
    ici: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    local_batch: int = 1          # samples a data-parallel rank
    remat: object = "none"        # shapes.POLICIES name or a custom {name: device|offload|remat}
    precision: Precision = PRECISIONS["fp32"]
    dp_mode: str = "fsdp"
    dcn_mode: str = "replicate"
    attention_block: int = ATTENTION_BLOCK
    act_bytes: int = BYTES_BF16   # bytes an activation element (bf16 on TPU; 4 for the fp32 CPU anchor)
    vocab_tiles: int = 1          # MaxText's num_vocab_tiling: the logits live one tile of the vocabulary at a time
    microbatches: int = 1         # gradient accumulation (--grad-accum): local_batch in this many forward +
    #                               backward passes; activations are one microbatch's, FSDP gathers and
    #                               reduce-scatters (and their latencies) once a microbatch, compute unchanged


def sharing(lay):
    """Chips that share one sample's work: its tp group x its cp group."""
    return lay.tp * lay.cp


def shard_counts(shape, lay):
    """Parameters a chip holds (by group) and the parameters of one block after FSDP's gather."""
    fsdp = lay.ici * lay.cp * (lay.dcn if lay.dcn_mode == "fsdp" else 1) if lay.dp_mode == "fsdp" else 1
    dp = lay.dcn * lay.ici
    expert_group = max(dp // lay.ep, 1) if lay.dp_mode == "fsdp" else 1
    p = shape.params   # (a group that does not divide pads up, as the sharded tensors do)
    shard = {"tp": math.ceil(p["tp"] / (fsdp * lay.tp)), "experts": math.ceil(p["experts"] / (lay.ep * expert_group)),
             "rest": math.ceil(p["rest"] / fsdp)}
    lp = shape.layer_params
    gathered = lp["tp"] / lay.tp + lp["experts"] / lay.ep + lp["rest"]
    return shard, gathered, fsdp, expert_group


def matmul_efficiency(k, n, chip, base):
    """`base` lowered by the MXU tile's padding of k and n and by dims shorter than 4 tiles."""
    tile = chip.mxu_tile
    pad = lambda d: d / (math.ceil(d / tile) * tile)
    short = lambda d: min(1.0, d / (4 * tile))
    return base * pad(k) * pad(n) * short(k) * short(n)


def causal_fraction(seq, block):
    """Share of the S x S score blocks splash computes when causal: the diagonal and below."""
    nb = max(math.ceil(seq / block), 1)
    return (nb + 1) / (2 * nb)


def compute_terms(shape, lay, chip, eff, redo):
    """Seconds of matmuls, recomputed matmuls, attention, each a chip a step. `redo`: the share of the
    layers whose backward recomputes each matmul (or "attention"), shapes.policy_split's."""
    samples = lay.local_batch / sharing(lay)      # a tp (cp) group shares its samples' work
    peak = chips_lib.matmul_peak(chip, lay.precision.matmul)
    matmul_s = recompute_s = 0.0
    for mm in shape.matmuls:
        # tensor parallelism splits a row-parallel matmul's k (out_proj, mlpwo), the others' n
        k, n = mm.k, mm.n
        if mm.split == "tp":
            k, n = (k / lay.tp, n) if mm.name in ROW_PARALLEL else (k, n / lay.tp)
        base = eff["moe_efficiency"] if mm.split == "experts" else eff["matmul_efficiency"]
        rate = peak * matmul_efficiency(k, n, chip, base)
        flops = mm.flops * samples
        matmul_s += 3 * flops / rate
        if redo.get(mm.name):   # (a share of all the layers; of its own layers, capped at 1)
            recompute_s += flops / rate * min(1.0, redo[mm.name] * shape.layers / mm.layers)
    a = shape.attention
    fwd = 4 * a["seq"] ** 2 * a["heads"] * a["head_dim"] * a["layers"] * samples
    if a["causal"]:
        fwd *= causal_fraction(a["seq"], lay.attention_block)
    att_rate = chip.peak_flops * eff["matmul_efficiency"] * chips_lib.ATTENTION_RELATIVE_EFFICIENCY
    attention_s = (fwd * 3.5 + fwd * redo.get("attention", 0.0)) / att_rate
    return {"matmul": matmul_s, "recompute": recompute_s, "attention": attention_s}


def hbm_terms(shape, lay, chip, shard, gathered, fsdp, any_recompute):
    """Seconds of HBM-bound work a chip a step: non-matmul ops, optimizer, gathered copies, logits."""
    tokens = shape.tokens * lay.local_batch / sharing(lay)
    passes = 3 + (1 if any_recompute else 0)       # forward 1, backward 2, recompute 1
    elementwise = shape.elementwise * shape.layers * tokens * lay.act_bytes * passes
    pr = lay.precision
    optimizer = sum(shard.values()) * (2 * pr.weight + pr.grad + 2 * pr.optimizer)  # read w g m v, write w m v
    # gathered bf16 copies: written by the all-gather, read by the matmul; forward and backward
    copies = 2 * 2 * BYTES_BF16 * gathered * shape.layers * lay.microbatches if fsdp > 1 else 0.0
    logits = tokens * shape.vocab * (lay.act_bytes + 8 + 2) if shape.vocab else 0.0   # write, fp32 softmax r/w, grad
    bw = chip.hbm_bw
    return {"elementwise": elementwise / bw, "optimizer": optimizer / bw, "gathered copies": copies / bw,
            "logits": logits / bw}


def ring_steps(n, chip):
    """Steps of a ring collective over n chips laid on the chip's torus (each axis its own ring)."""
    if n <= 1:
        return 0
    side = n ** (1 / chip.torus_dims)
    return chip.torus_dims * (side - 1)


def comm_terms(shape, lay, chip, shard, fsdp, expert_group, offload_bytes):
    """Seconds on ICI (FSDP / DDP), DCN, host link (hidden up to OVERLAP) and TP / EP (exposed)."""
    pr, p = lay.precision, shape.params
    per_coll = 2 * BYTES_BF16 + pr.grad             # all-gather forward + backward, reduce-scatter
    if lay.dp_mode == "fsdp":
        ici_group = lay.ici * lay.cp
        ici_bytes = per_coll * ((p["tp"] / lay.tp + p["rest"]) * (ici_group - 1) / ici_group
                                + p["experts"] / lay.ep * (expert_group - 1) / max(expert_group, 1))
        collectives = 3 * shape.layers
    else:                                            # DDP: one all-reduce of the gradients
        ici_group = lay.ici * lay.cp
        ici_bytes = 2 * pr.grad * sum(p.values()) / lay.tp * (ici_group - 1) / ici_group
        collectives = shape.layers
    if lay.dp_mode == "fsdp":  # (a microbatch gathers and reduce-scatters every block again; DDP's one
        ici_bytes, collectives = ici_bytes * lay.microbatches, collectives * lay.microbatches  # all-reduce stays)
    ici_s = ici_bytes / chip.ici_bw + collectives * ring_steps(ici_group, chip) * chip.ici_latency_s
    if lay.dcn > 1:
        if lay.dcn_mode == "fsdp":   # each slice fetches the other slices' share of every gather
            dcn_bytes = per_coll * sum(p.values()) / (lay.ici * lay.cp * lay.tp) * (lay.dcn - 1) / lay.dcn
            dcn_collectives = collectives
        else:                        # HSDP: all-reduce of the shard's gradients across slices, a layer at a time
            dcn_bytes = 2 * pr.grad * sum(shard.values()) * (lay.dcn - 1) / lay.dcn
            dcn_collectives = shape.layers
        dcn_bytes, dcn_collectives = dcn_bytes * lay.microbatches, dcn_collectives * lay.microbatches
        dcn_s = dcn_bytes / chip.dcn_bw + dcn_collectives * 2 * (lay.dcn - 1) * chip.dcn_latency_s
    else:
        dcn_s = 0.0
    offload_s = 2 * offload_bytes / chip.host_bw if offload_bytes else 0.0   # out forward, back backward
    act = lay.act_bytes * shape.tokens * lay.local_batch * shape.dim            # one (B, S, D) activation
    m = lay.microbatches  # (TP / EP move the same bytes in m times as many collectives)
    tp_s = (shape.layers * 8 * act * (lay.tp - 1) / lay.tp / chip.ici_bw
            + m * shape.layers * 8 * ring_steps(lay.tp, chip) * chip.ici_latency_s) if lay.tp > 1 else 0.0
    ep_s = (shape.layers * 4 * act * shape.top_k * (lay.ep - 1) / lay.ep * MOE_IMBALANCE / chip.ici_bw
            + m * shape.layers * 4 * ring_steps(lay.ep, chip) * chip.ici_latency_s) if lay.ep > 1 else 0.0
    return {"ici": ici_s, "dcn": dcn_s, "offload": offload_s, "tp": tp_s, "ep": ep_s, "cp": cp_terms(shape, lay, chip)}


def kv_bytes(shape, lay):
    """One layer's keys and values of the whole sequences of a chip's samples (what cp gathers; a
    step's, over all its microbatches)."""
    a = shape.attention
    return 2 * lay.act_bytes * a["seq"] * a.get("kv_heads", a["heads"]) * a["head_dim"] * lay.local_batch / lay.tp


def cp_terms(shape, lay, chip):
    """Context parallelism: each attention layer all-gathers K/V over the cp ranks (forward) and
    reduce-scatters their gradients (backward), (cp-1)/cp of the whole on ICI, between the layer's
    matmuls: exposed (the all-gather variant; a ring would overlap it: docs/limits.md); the same bytes
    in one collective a microbatch."""
    if lay.cp <= 1:
        return 0.0
    layers = shape.attention["layers"]
    return (layers * 2 * kv_bytes(shape, lay) * (lay.cp - 1) / lay.cp / chip.ici_bw
            + lay.microbatches * layers * 2 * ring_steps(lay.cp, chip) * chip.ici_latency_s)


EXCHANGE_COPIES = 4  # D-wide copies of a device's arrivals live at the exchange's peak: the send buffer, the
#                      received one, the sorted one, the way back's (fitted to the compiler, below)


def exchanged_elems(shape, ep):
    """Elements a token a layer that minititan's ep exchange adds to a layer's peak: its traced
    dispatch (expert_parallel.AllToAll's padded form, tpu_pod/expert_exchange.py in the compiled step) sends
    each peer a buffer of all the rows a device routes, so a device's experts run on ep x its routed
    rows (their activations ep - 1 more times), and the rows' D-wide copies in the exchange are ep x
    them too. Against the compiler's temporaries (bf16, --kernels pallas, v5p): Mixtral 8x7B's block
    at ep=8, 2 x 4096 tokens a device, 17.3 GiB, planner 20.3 GiB (+18%; 6.2 without this term);
    Qwen3-235B's (128 experts of 1536, top 8), 2 layers, 4096 tokens a device, ep=8 / 32: 16.9 / 55.5
    GiB, planner 14.9 / 50.9 (-12% / -8%; 6.9 / 18.9 without it). None for the capacity-padded
    einsum dispatch ("dispatch" matmuls: its slots are the capacity's) nor a dense model.
    A buffer factor f > 0 (shape.ep_buffer_factor: ModelArgs') has a peer's buffer hold f / ep of
    a device's rows, so the ep x above is min(ep, f)."""
    if ep == 1 or not shape.n_experts or any(m.name == "dispatch" for m in shape.matmuls):
        return 0.0
    experts = sum(shape.acts.get(name, 0.0) for name in ("mlpwi_0", "mlpwi_1", "mlp_act", "mlpwo"))
    routed_rows = shape.acts.get("mlpwo", 0.0) / shape.dim  # (rows a token: top_k x capacity)
    # the rows a device's experts run on, in units of its own routed rows
    copies = min(ep, shape.ep_buffer_factor) if shape.ep_buffer_factor > 0 else ep
    return (copies - 1) * experts + copies * EXCHANGE_COPIES * routed_rows * shape.dim


def memory_terms(shape, lay, shard, gathered, fsdp, device_elems, all_elems, devices=1):
    """Bytes a chip: state at its dtypes, gathered block, saved activations, the transient peak.
    `devices`: the devices a chip shows (Ironwood's two TensorCores): each runs the program on its
    half of the chip's tokens and gathers its own copy of the block and of the loss head."""
    pr, n = lay.precision, sum(shard.values())
    tokens = shape.tokens * lay.local_batch / lay.microbatches / sharing(lay)   # one microbatch's at a time
    saved = device_elems * lay.act_bytes * tokens * shape.layers
    layer_peak = all_elems * lay.act_bytes * tokens                     # one layer, everything live
    layer_peak += kv_bytes(shape, lay) / lay.microbatches if lay.cp > 1 else 0.0   # (+ its gathered K/V)
    layer_peak += exchanged_elems(shape, lay.ep) * lay.act_bytes * tokens            # (+ ep's padded exchange)
    logits_peak = 2 * lay.act_bytes * tokens * shape.vocab / lay.vocab_tiles if shape.vocab else 0.0  # logits + grad
    # the fused loss under FSDP: its head gathered whole (bf16) and that device's gradient of it, whole
    # until reduce-scattered (measured: Qwen3-8B on 256 v5p, two bf16 (151936, 4096) buffers at the peak)
    head_peak = devices * 2 * BYTES_BF16 * shape.loss_head if fsdp > 1 and lay.tp == 1 else 0.0
    block = devices * 2 * BYTES_BF16 * gathered if fsdp > 1 else 0.0
    # The loss runs outside the layers, where no block is gathered (measured: Qwen3-8B on 256 v5p,
    # the compiler's peak is the head's with no gathered block beside it, within 0.01 GiB): its peak
    # shares the block's bytes, so the transient term is what it needs beyond them
    return {"parameters": n * pr.weight, "gradients": n * pr.grad, "optimizer state": n * pr.optimizer,
            "gradient accumulator": n * pr.grad if lay.microbatches > 1 else 0.0,
            "gathered block (bf16, x2)": block, "saved activations": saved,
            "transient peak": max(layer_peak, max(logits_peak, head_peak) - block)}


def host_terms(lay, shard, offload_bytes, push_bucket_bytes=0):
    """Host bytes a chip's process needs: at start its parameter shards (filled on the host,
    then moved), then beside the step the checkpoint's staging copy of weights and optimizer state
    (DCP stages a save in host memory), the weight push's bucket (GRPO's streamed push; 0 for
    pretraining) and the offloaded activations. The need is the larger of the two moments."""
    n, pr = sum(shard.values()), lay.precision
    terms = {"shards at start": n * pr.weight, "checkpoint staging": n * (pr.weight + pr.optimizer),
             "push bucket": push_bucket_bytes, "offloaded activations": offload_bytes}
    need = max(terms["shards at start"], terms["checkpoint staging"] + push_bucket_bytes + offload_bytes)
    return terms, need


def fits(hbm_need, host_need, chip):
    """The one verdict (the dry run's, --plan's and the calibration's): HBM and host memory a chip."""
    return hbm_need <= chip.hbm_bytes and host_need <= chip.host_bytes


def predict(shape, lay, chip, constants=None, saved_bytes=None, push_bucket_bytes=0):
    """Step time (s), its parts, memory a chip and whether it fits, for `shape` on `lay` of `chip`
    (a chips.Chip); `constants` overrides the chip's fitted efficiencies (calibrate.fit);
    `saved_bytes` replaces the shape's saved-activation bytes a chip where a trace measured them
    (minititan's own dry run: its graph's exact figure)."""
    eff = chips_lib.efficiency(chip.name, constants)
    shard, gathered, fsdp, expert_group = shard_counts(shape, lay)
    device_elems, offload_elems, _, recomputed, redo = policy_split(shape, lay.remat)
    tokens = shape.tokens * lay.local_batch / sharing(lay)
    offload_bytes = offload_elems * lay.act_bytes * tokens * shape.layers  # (a step's: the link's time)
    compute = compute_terms(shape, lay, chip, eff, redo)
    compute.update(hbm_terms(shape, lay, chip, shard, gathered, fsdp, bool(recomputed)))
    comm = comm_terms(shape, lay, chip, shard, fsdp, expert_group, offload_bytes)
    compute_s = sum(compute.values())
    hideable = comm["ici"] + comm["dcn"] + comm["offload"]
    exposed = hideable - chips_lib.OVERLAP * min(hideable, compute_s)
    step = chip.host_overhead_s + compute_s + exposed + comm["tp"] + comm["ep"] + comm["cp"]
    live = sum(v for k, v in shape.acts.items() if k not in shape.unread)
    mem = memory_terms(shape, lay, shard, gathered, fsdp, device_elems, live, chip.devices)
    if saved_bytes is not None:
        mem["saved activations"] = saved_bytes
    total = sum(mem.values())
    host, host_need = host_terms(lay, shard, offload_bytes / lay.microbatches, push_bucket_bytes)  # (one microbatch's held)
    return {"step_s": step, "compute": compute, "comm": comm, "exposed_comm_s": exposed,
            "host_overhead_s": chip.host_overhead_s, "memory": mem, "total_bytes": total,
            "offload_bytes": offload_bytes, "host": host, "host_need": host_need,
            "fits": fits(total, host_need, chip),
            "mfu": shape.model_flops * lay.local_batch / sharing(lay) / (step * chip.peak_flops)}
