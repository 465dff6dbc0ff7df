"""chips.py: what the planner knows about each accelerator, every number with its source.

Two kinds of constants. Published ones (peak bf16 FLOP/s, HBM bytes and bandwidth, ICI and DCN
bandwidth, torus shape, host memory) come from the vendors' pages cited beside each. Assumed ones
(host-link bandwidth, DCN where no per-chip figure is published, collective latency, H100's host)
are marked "assumed". The achievable fractions of peak (`matmul_efficiency`, `moe_efficiency`) are not
published anywhere: they are the few free constants `python -m planner.dryrun --calibrate` fits on the
published runs in calibration.json (calibrate.py), recorded here as `FITTED` so the planner uses the
same numbers everywhere. A chip without a fitted value uses `DEFAULT_EFFICIENCY` (said in the report).

Sources:
  TPU v4  cloud.google.com/tpu/docs/v4       275 TFLOP/s, 32 GiB HBM2 1228 GB/s, ICI 2400 Gbps, 3D torus
  TPU v5e cloud.google.com/tpu/docs/v5e      197 TFLOP/s, 16 GiB HBM2 819 GB/s, ICI 1600 Gbps, 2D torus
  TPU v5p cloud.google.com/tpu/docs/v5p      459 TFLOP/s, 95 GiB HBM2e 2765 GB/s, ICI 4800 Gbps, 3D torus
  TPU v6e cloud.google.com/tpu/docs/v6e      918 TFLOP/s, 32 GiB HBM 1640 GB/s, ICI 3584 Gbps, 2D torus
  Ironwood cloud.google.com/tpu/docs/tpu7x   4614 TFLOP/s fp8 (2307 bf16), 192 GiB HBM3e 7.37 TB/s,
                                             ICI 9.6 Tbps, 3D torus
  H100 SXM NVIDIA H100 datasheet             989 TFLOP/s dense bf16, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s
  Host memory a chip: the TPU VM's memory over its chips (v4: 407 GB / 4; v5p ct5p-hightpu-4t: 448 GB / 4;
  v6e ct6e-standard-8t: 1440 GB / 8; v5e ct5lp-hightpu-8t: 1536 GB / 8 (cloud.google.com/tpu/docs/*);
  Ironwood: 960 GB a 4-chip VM (cloud.google.com/tpu/docs/tpu7x, whose table also gives v5p 448 and
  v6e 720 GB a 4-chip VM). H100: a DGX H100's 2 TB over 8 GPUs (assumed: hosts vary). `host_source`
  names each; the dry run marks an assumed one.
  DCN a chip: cloud.google.com/tpu/docs/tpu7x's table: v5p 50 Gb/s, v6e 100 Gb/s, Ironwood 100 Gb/s
  (v4, v5e: assumed 25 GB/s, the old default).
  Peak below bf16 (MATMUL_PEAKS): int8 v5e 394 TOPS, v5p 918 TOPS, v6e 1836 TOPS (each chip's page
  above); fp8 Ironwood 4614 TFLOP/s (its page); H100 SXM fp8 and int8 1979 dense (its datasheet). v4
  lists no faster int8 rate, v5e / v5p / v6e no fp8, Ironwood no int8: refused there, not guessed.
"""
import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float          # dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bw: float              # bytes/s
    ici_bw: float              # bytes/s a chip, all its ICI links together (the listed Gbps / 8)
    torus_dims: int            # 2 (v5e, v6e) or 3 (v4, v5p, Ironwood): links a chip has per axis = 2
    mxu_tile: int              # the systolic array's side: a matmul dim pads up to a multiple of it
    host_bytes: float          # host DRAM a chip (offload target)
    host_bw: float = 32e9      # bytes/s a chip to/from host (assumed: PCIe Gen4 x16 ~ 32 GB/s)
    dcn_bw: float = 25e9       # bytes/s a chip across slices (assumed: ~200 Gbps NIC a host of 8 chips)
    ici_latency_s: float = 2e-6    # per ring step of a collective (assumed; ~1-2 us a hop on TPU ICI)
    dcn_latency_s: float = 30e-6   # per DCN collective step (assumed)
    host_overhead_s: float = 0.03  # a step's fixed host cost (assumed; see HOST_OVERHEAD_S)
    host_source: str = "assumed"   # where host_bytes comes from
    devices: int = 1               # devices a chip shows (Ironwood: two TensorCores, each a JAX device
                                   # running its own program in half the HBM, as libtpu describes tpu7x;
                                   # each gathers its own FSDP block and loss head: stepmodel.memory_terms)


CHIPS = {
    "tpu_v4": Chip("tpu_v4", 275e12, 32 * GiB, 1228e9, 2400e9 / 8, 3, 128, 407e9 / 4,
                   host_source="cloud.google.com/tpu/docs/v4: 407 GB a 4-chip VM"),
    "tpu_v5e": Chip("tpu_v5e", 197e12, 16 * GiB, 819e9, 1600e9 / 8, 2, 128, 1536e9 / 8,
                    host_source="cloud.google.com/tpu/docs/v5e: ct5lp-hightpu-8t, 1536 GB for 8 chips"),
    "tpu_v5p": Chip("tpu_v5p", 459e12, 95 * GiB, 2765e9, 4800e9 / 8, 3, 128, 448e9 / 4, dcn_bw=50e9 / 8,
                    host_source="cloud.google.com/tpu/docs/tpu7x (table): 448 GB a 4-chip v5p VM"),
    "tpu_v6e": Chip("tpu_v6e", 918e12, 32 * GiB, 1640e9, 3584e9 / 8, 2, 256, 720e9 / 4, dcn_bw=100e9 / 8,
                    host_source="cloud.google.com/tpu/docs/tpu7x (table): 720 GB a 4-chip v6e VM"),
    # Ironwood: host link assumed PCIe Gen5 x16 (64 GB/s)
    "tpu_v7": Chip("tpu_v7", 2307e12, 192 * GiB, 7370e9, 9600e9 / 8, 3, 256, 960e9 / 4, host_bw=64e9, dcn_bw=100e9 / 8,
                   host_source="cloud.google.com/tpu/docs/tpu7x (table): 960 GB a 4-chip VM", devices=2),
    # H100 SXM: NVLink 900 GB/s a GPU inside a node stands in for ICI (one "axis" of 8); tensor-core
    # tiles are smaller (64 assumed); host PCIe Gen5 64 GB/s
    "h100": Chip("h100", 989e12, 80e9, 3350e9, 900e9, 1, 64, 2e12 / 8, host_bw=64e9, dcn_bw=50e9),
}

# Dense matmul peak a chip at each precision below bf16 (published: the sources above); bf16 is peak_flops
MATMUL_PEAKS = {
    "tpu_v5e": {"int8": 394e12}, "tpu_v5p": {"int8": 918e12}, "tpu_v6e": {"int8": 1836e12},
    "tpu_v7": {"fp8": 4614e12}, "h100": {"int8": 1979e12, "fp8": 1979e12},
}


def matmul_peak(chip, matmul):
    """FLOP/s of `chip`'s dense matmuls in `matmul` (bf16, int8, fp8); one-line ValueError where the
    chip publishes no such rate."""
    if matmul == "bf16":
        return chip.peak_flops
    found = MATMUL_PEAKS.get(chip.name, {}).get(matmul)
    if found is None:
        raise ValueError(f"{chip.name} publishes no {matmul} matmul peak (it has: "
                         f"{', '.join(['bf16', *MATMUL_PEAKS.get(chip.name, {})])})")
    return found


# Achievable fraction of peak for large, tile-aligned dense matmuls and for the MoE experts' grouped
# (or capacity-padded) matmuls: fitted by `python -m planner.dryrun --calibrate` (calibrate.fit) on the
# runs marked "fit" in calibration.json; a chip with no fitted run uses DEFAULT_EFFICIENCY.
FITTED = {
    "tpu_v5p": {"matmul_efficiency": 0.84, "moe_efficiency": 0.695},   # (moe: one run, Mixtral 8x7B)
    "tpu_v6e": {"matmul_efficiency": 0.71, "moe_efficiency": 0.825},
}
# Not fitted (assumed): a chip with no fit run (v4, v5e, Ironwood, H100) uses these, and so does a
# constant left without a run in calibrate's leave-one-out
DEFAULT_EFFICIENCY = {"matmul_efficiency": 0.69, "moe_efficiency": 0.5}
# Fixed, not fitted (assumed): the share of a collective or host transfer the scheduler hides behind
# compute (XLA's async collectives overlap most, not all: the first gather and last reduce-scatter of a
# step have nothing to hide behind), the fraction of peak splash attention reaches relative to a plain
# matmul (its softmax runs on the VPU between the two MXU contractions), and the host's fixed cost a
# step (dispatch, the input pipeline's hand-off, the loss's readback).
OVERLAP = 0.85
ATTENTION_RELATIVE_EFFICIENCY = 0.6
HOST_OVERHEAD_S = 0.03   # (Chip.host_overhead_s's default)


def efficiency(chip_name, constants=None):
    """The fitted (or default) efficiencies of `chip_name`, overridden by `constants` if given."""
    found = dict(FITTED.get(chip_name, DEFAULT_EFFICIENCY))
    found.update(constants or {})
    return found


def measured_chip(peak_flops, hbm_bw, hbm_bytes, name="cpu"):
    """A chip from measured numbers (the CPU anchor: this machine's GEMM peak and memory bandwidth).
    One 'device', no interconnect, no host overhead beyond what is measured; its matmul efficiency
    is 1 by construction (peak was measured on a matmul). Its "tile" is 64: stepmodel's short-dim
    law (full rate from 4 tiles = 256 up) is only the fallback; the anchor measures each of the
    step's matmul shapes forward + backward (anchor.shape_matmul_rates), which on this CPU run at
    0.15-0.85 of the 1024^3 rate (4096 rows, k=192: n=64 ~0.16, n=192 0.4-0.46, n=512 0.6-0.85;
    the law says 0.19, 0.56, 0.75) and FLUX's 128-640-row shapes mostly at 0.03-0.25 (docs/planning.md)."""
    return Chip(name, peak_flops, hbm_bytes, hbm_bw, ici_bw=1e30, torus_dims=1, mxu_tile=64, host_bytes=0,
                host_overhead_s=0.0)
