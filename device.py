"""device.py: pick and set up the device; sync, seeding, memory figures and peak FLOP/s for MFU.

Everything that differs between backends lives here, so model.py and the trainers stay device-free.
Order for `--device auto` (the TPU branch first, one switch each):

  1. TorchTPU   - `torch_tpu` importable and `torch.accelerator` reports "tpu"  (native PyTorch on TPU,
                  torch_tpu 0.2.0 on torch 2.11-2.15: its own environment, requirements-tpu.txt). On a
                  machine without TPU chips torch_tpu imports but registers no device (it scans PCI for
                  Google TPUs at import), so torch.accelerator reports none; test_torch_tpu.py checks
                  that and every torch_tpu name used here, in that environment, on CPU. Never run on a TPU.
  2. torch_xla  - PJRT_DEVICE names TPU (lazy tensors, one XLA program per step)
  3. cuda       - torch.cuda.is_available()
  4. cpu

`--device xla` forces torch_xla and sets PJRT_DEVICE=CPU when unset, so the XLA path (trace -> HLO ->
compiled program) runs and is tested on XLA:CPU here.

Peak FLOP/s are the vendors' published dense bf16 numbers per chip; on CPU we measure an fp32 matmul
peak instead and say so in the log line (MFU on CPU is "fraction of what this CPU's GEMM reaches";
`utilization` measures it again when a run outpaces it, and never reports a fraction above 1).
"""
import importlib.util
import os
import random
import resource
import time

import numpy as np

from errors import BadInput
import torch


class DeviceUnavailable(BadInput, RuntimeError):
    """The requested device is not present; train.py turns this into one line and exit code 2."""


# Published dense bf16 peak FLOP/s per chip (vendor datasheets / cloud docs).
PEAK_BF16_FLOPS = {
    "tpu_v4": 275e12,    # cloud.google.com/tpu/docs/v4
    "tpu_v5e": 197e12,   # cloud.google.com/tpu/docs/v5e
    "tpu_v5p": 459e12,   # cloud.google.com/tpu/docs/v5p
    "tpu_v6e": 918e12,   # cloud.google.com/tpu/docs/v6e (Trillium)
    "tpu_v7": 2307e12,   # Ironwood: 4614 TFLOP/s fp8, half of it in bf16
    "a100": 312e12,      # NVIDIA A100 datasheet, dense
    "h100": 989e12,      # NVIDIA H100 SXM datasheet, dense
    "h200": 989e12,      # NVIDIA H200 SXM datasheet, dense (same compute as H100)
}


def torchtpu_status():
    """(True, "") where torch_tpu registered a TPU device; else (False, what is missing).

    torch_tpu 0.2.0 imports on any machine; only where its PCI scan finds TPU chips does it rename
    PyTorch's PrivateUse1 backend to "tpu" and make `torch.accelerator` report it."""
    try:
        import torch_tpu  # noqa: F401  (registers the "tpu" device with PyTorch where chips are found)
    except ImportError:
        return False, "torch_tpu is not installed (pip install -r requirements-tpu.txt)"
    except Exception as e:  # e.g. a torch outside 2.11-2.15: its version-dispatched .so files fail
        return False, f"torch_tpu failed to import ({type(e).__name__}: {e})"
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != "tpu":
        from importlib.metadata import version
        return False, (f"torch_tpu {version('torch_tpu')} is installed but found no TPU chip "
                       f"(torch.accelerator reports {acc.type if acc is not None else 'no accelerator'})")
    return True, ""


def pjrt_is_tpu():
    """torch_xla is (to be) pointed at TPU chips: the one test of 'real TPU behind XLA'."""
    return os.environ.get("PJRT_DEVICE", "").upper() == "TPU"


def is_xla(device):
    """A torch_xla lazy-tensor device (XLA:CPU here, TPU on a TPU VM)."""
    return torch.device(device).type == "xla"


def is_tpu(device):
    """A device that is a TPU chip: TorchTPU's native device, or torch_xla with PJRT_DEVICE=TPU."""
    return torch.device(device).type == "tpu" or (is_xla(device) and pjrt_is_tpu())


def default_to_xla_cpu():
    """The one place PJRT_DEVICE gets its default: XLA:CPU unless the user named another runtime. XLA:CPU's
    device count, CPU_NUM_DEVICES, must be a positive integer (torch_xla crashes on another value: a
    segmentation fault)."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    count = os.environ.get("CPU_NUM_DEVICES")
    if os.environ["PJRT_DEVICE"] == "CPU" and count is not None and not (count.strip().isdigit() and int(count) > 0):
        raise DeviceUnavailable(f"CPU_NUM_DEVICES={count!r}: XLA:CPU's device count is a positive integer")


def _xla_device():
    default_to_xla_cpu()
    try:
        import torch_xla
    except ImportError as e:
        raise DeviceUnavailable(f"--device xla needs torch_xla ({e})") from None
    return xla_start(torch_xla.device)


def xla_start(first_call):
    """`first_call()`, torch_xla's first touch of the runtime PJRT_DEVICE names, with a runtime that cannot
    start here (no libtpu; no such plugin) as DeviceUnavailable: torch_xla raises an OSError (which
    would read as a failed write, exit 5) or a RuntimeError (a traceback)."""
    try:
        return first_call()
    except (OSError, RuntimeError) as e:
        why = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else type(e).__name__
        raise DeviceUnavailable(f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}: torch_xla cannot start that runtime "
                                f"here ({why})") from None


def pick_device(name="auto"):
    """Return a torch.device for `name` in auto|tpu|xla|cuda|cpu, or raise DeviceUnavailable."""
    if name in ("auto", "tpu"):
        native, why_not = torchtpu_status()
        if native:
            return torch.device("tpu")
        if pjrt_is_tpu():
            if importlib.util.find_spec("torch_xla") is None:  # (e.g. in the TorchTPU environment)
                raise DeviceUnavailable(f"--device {name}: {why_not}; and PJRT_DEVICE=TPU needs torch_xla, "
                                        f"which is not installed (requirements.txt)")
            return _xla_device()
        if name == "tpu":
            raise DeviceUnavailable(f"--device tpu: no TPU here: {why_not}; and PJRT_DEVICE is not TPU "
                                    f"(the torch_xla route)")
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "xla":
        return _xla_device()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("--device cuda: no CUDA device is visible on this machine")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise DeviceUnavailable(f"--device {name!r}: choose one of auto, tpu, xla, cuda, cpu")


def compile_backend(device):
    """torch.compile's backend for `device`: torch_xla's "openxla", TorchTPU's "tpu" (torch_tpu
    refuses "inductor" on TPU tensors), inductor elsewhere."""
    kind = getattr(device, "type", device)  # a device or its type name ("tpu" exists only with chips)
    return {"xla": "openxla", "tpu": "tpu"}.get(kind, "inductor")


def dist_backend(device):
    """torch.distributed backend for `device`: TorchTPU registers "tpu" when it finds chips."""
    return {"cuda": "nccl", "tpu": "tpu"}.get(getattr(device, "type", device), "gloo")


def scalar(value, device):
    """A 0-d float tensor on `device` for a per-step input (lr, step number). On XLA it is uploaded
    as a 1-element array and indexed: torch_xla caches scalar uploads by value and feeds inputs
    holding the same data through one HLO parameter, so a step whose lr or step number equals
    another scalar input would get a program of its own and recompile (pytorch/xla#3604)."""
    if is_xla(device):
        return torch.tensor([float(value)], device=device)[0]
    return torch.tensor(float(value), device=device)


def autocast_type(device):
    """The device_type string torch.autocast wants for this device."""
    return torch.device(device).type


def sync(device):
    """Step boundary. XLA: cut the lazy graph and launch it; accelerators: wait; CPU: nothing."""
    kind = torch.device(device).type
    if kind == "xla":
        import torch_xla
        torch_xla.sync()
    elif kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "tpu":
        torch.accelerator.synchronize()


def wait(device):
    """Block until queued device work is done (for timing): XLA waits on the launched programs."""
    sync(device)
    if is_xla(device):
        import torch_xla.core.xla_model as xm
        xm.wait_device_ops()


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA; XLA and TorchTPU seed from it too


def host_peak_rss_bytes():
    """The process's resident-memory high-water mark (VmHWM: resettable, see reset_peak_memory)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak_memory(device):
    """Start the peak-memory figure afresh (after model building, which may hold a full copy)."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats()
    elif kind == "tpu":
        torch.accelerator.reset_peak_memory_stats()
    elif kind == "cpu" or not is_tpu(device):
        try:
            with open("/proc/self/clear_refs", "w") as f:  # Linux: resets VmHWM to the current RSS
                f.write("5")
        except OSError:
            pass


def memory_stats(device):
    """{'peak_bytes', 'kind'}: device peak where the backend reports one, else host peak RSS."""
    kind = torch.device(device).type
    if kind == "cuda":
        return {"peak_bytes": torch.cuda.max_memory_allocated(), "kind": "cuda peak allocated"}
    if kind == "tpu":
        return {"peak_bytes": torch.accelerator.max_memory_allocated(), "kind": "tpu peak allocated"}
    if is_xla(device) and is_tpu(device):
        import torch_xla.core.xla_model as xm
        info = xm.get_memory_info(device)
        return {"peak_bytes": info.get("peak_bytes_used", info.get("bytes_used", 0)),
                "kind": "tpu hbm peak"}
    return {"peak_bytes": host_peak_rss_bytes(), "kind": "host peak rss"}


def free_memory_bytes(device):
    """Memory free for a new model on `device`: MemAvailable of this host for CPU and XLA:CPU (the
    model is built on the host first), free device memory for CUDA; None where we cannot tell."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.mem_get_info()[0]
    if kind == "cpu" or (is_xla(device) and not is_tpu(device)):
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration):
            return None
    return None


def check_fits(need_bytes, device, what):
    """Refuse (DeviceUnavailable: one line, exit 2), before allocating it, what cannot fit."""
    free = free_memory_bytes(device)
    if free is not None and need_bytes > free:
        raise DeviceUnavailable(f"{what} need ~{need_bytes / 2**30:.1f} GiB per process; {free / 2**30:.1f} GiB "
                                f"is free here: use a smaller model or more ranks")


def _device_name(device):
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name(device).lower()
    if kind == "tpu":  # TorchTPU names the chip from its PCI id: "TPU v5e", "TPU v6e", "TPU v7"
        return torch.tpu.get_device_name().lower()
    if is_tpu(device):
        return os.environ.get("TPU_ACCELERATOR_TYPE", "").lower()  # e.g. "v5litepod-8", "v6e-8"
    return ""


def _lookup_published_peak(name):
    aliases = {"v5litepod": "tpu_v5e", "v5e": "tpu_v5e", "v5p": "tpu_v5p", "v6e": "tpu_v6e",
               "v4": "tpu_v4", "v7": "tpu_v7", "a100": "a100", "h100": "h100", "h200": "h200"}
    for key, table_key in aliases.items():
        if key in name:
            return table_key, PEAK_BF16_FLOPS[table_key]
    return None, None


_CPU_PEAK_CACHE = {}
MEASURED_CPU_PEAK = "this CPU's measured fp32 matmul peak"  # peak_flops' label when it measured, not looked up


def measure_cpu_matmul_peak(n=1024, repeats=5, fresh=False):
    """Best-of-`repeats` fp32 GEMM throughput of this CPU, in FLOP/s (cached per process; `fresh`:
    measured again, the larger of the two kept)."""
    if n in _CPU_PEAK_CACHE and not fresh:
        return _CPU_PEAK_CACHE[n]
    gen = torch.Generator().manual_seed(0)  # its own generator: the global RNG state is the run's
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b  # warm-up: thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    _CPU_PEAK_CACHE[n] = max(2 * n**3 / best, _CPU_PEAK_CACHE.get(n, 0.0))
    return _CPU_PEAK_CACHE[n]


def utilization(flops_per_device, peak, label):
    """(MFU or None, the peak it is over). A published peak is a ceiling. A measured CPU peak is only
    what the GEMM reached while it was measured: taken under another job's load it is low, and a run
    reads as faster than its own CPU's peak. A window of training above it measures the peak again
    (the larger kept); still above, the window has no MFU (None), never a utilization above 1."""
    if flops_per_device > peak and label == MEASURED_CPU_PEAK:
        peak = max(peak, measure_cpu_matmul_peak(fresh=True))
    return (flops_per_device / peak if flops_per_device <= peak else None), peak


def peak_flops(device, chip=None):
    """(FLOP/s, label): the published bf16 peak for accelerators, a measured fp32 GEMM peak on CPU.

    `chip` (a PEAK_BF16_FLOPS key) overrides detection, e.g. for a dry run of a TPU generation.
    """
    if chip:
        return PEAK_BF16_FLOPS[chip], f"{chip} bf16 peak (published)"
    key, peak = _lookup_published_peak(_device_name(device))
    if peak:
        return peak, f"{key} bf16 peak (published)"
    if torch.device(device).type in ("cuda", "tpu"):
        return PEAK_BF16_FLOPS["h100"], "unknown accelerator, assuming h100 bf16 peak"
    return measure_cpu_matmul_peak(), MEASURED_CPU_PEAK
