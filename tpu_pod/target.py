"""tpu_pod/target.py: the real TPU compiler, on a machine with no TPU (JAX's compile-only devices).

libtpu, the TPU's compiler and runtime library, describes a named TPU topology on a host that has no
chip: `jax.experimental.topologies.get_topology_desc("v5p:2x2x1", platform="tpu")` gives devices that
can be compiled for, never run on. `jax.jit(f).lower(<ShapeDtypeStructs sharded on them>).compile()`
then runs XLA:TPU and Mosaic (the Pallas TPU compiler) for real: a program that does not lower, a
kernel whose blocks exceed VMEM, or temporaries that exceed HBM fail here as on the chip (MaxText's
train_compile.py checks a pod run this way). Nothing is allocated and nothing runs.

What a compile tells: the program lowers and Mosaic accepts its kernels; per device, the HBM of the
arguments, outputs and temporaries, and the peak that must fit (`memory_analysis`; with host buffers,
the HBM its buffer assignment reserves: `_hbm_allocated`); the cost model's
FLOPs, bytes and `optimal_seconds` (`cost_analysis`). What it does not: numerics or speed on a chip, and the cost
model does not see inside a Mosaic kernel (an opaque custom call: no FLOPs, ~0 s).

The jax / libtpu pair matters: jax serializes a Mosaic kernel in a versioned format that libtpu
must read, and each libtpu knows only the chips of its day.
  - jax 0.7.1 (.venv) with libtpu 0.0.24 (requirements-libtpu.txt): v5p, v6e. libtpu 0.0.20 (what
    jax[tpu] 0.7.1 pins) and 0.0.21 refuse every Mosaic kernel ("Unsupported version: expected <= 7
    but got 8"); 0.0.24 does not know Ironwood ("Invalid TPU external name: TPU7x").
  - jax 0.10.2 with libtpu 0.0.51 (.venv-tpu, requirements-tpu.txt): Ironwood (tpu7x); 0.0.52 also
    knows it, but aborts on Llama 3.1 70B's published Ironwood layout (docs/planning.md). The training
    step (torchax, on .venv's torch) compiles for Ironwood with that pair first on PYTHONPATH:
    .jax-tpu7x, links to .venv-tpu's jax, jaxlib, libtpu and ml_dtypes (step_jax_path makes it).
libtpu 0.0.24 is kept out of .venv, in a directory of its own (.libtpu, made by .ci/run, or
$MINITITAN_LIBTPU): importable, it makes every jax process look for a chip first (errors on stderr,
seconds of waiting). It is loaded here as jax's TPU plugin when a target is first asked for, after
jax's own backends are up, so that nothing else in the process ever looks for a chip.

    .venv/bin/python -m tpu_pod.target tpu_v5p v5p:2x2x1      # a matmul compiled: the environment works
    .venv-tpu/bin/python -m tpu_pod.target tpu_v7 8           # (a chip count: the topology of 8 chips)
    PYTHONPATH=.jax-tpu7x .venv/bin/python -m tpu_pod.target tpu_v7 8   # (the pair the step compile uses)
"""
import collections
import contextlib
import dataclasses
import glob
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp

import kernels_pallas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


@dataclasses.dataclass(frozen=True)
class TpuKind:
    prefix: str          # libtpu's topology name: "<prefix>:<dims>"
    torus_dims: int      # 2 (a 2D torus: v6e) or 3 (v5p, Ironwood)
    python: str          # the environment whose jax / libtpu pair compiles for it (above)
    jax_path: str = ""   # for .venv's torch (the step compile: torchax): a directory put first on
                         # PYTHONPATH that gives that pair, where .venv's does not know the chip


# Names as planner/chips.py gives them. The smallest topology is one host's chips (2x2x1: libtpu
# refuses less, "not divisible by ... chips_per_host_bounds 2x2x1").
KINDS = {"tpu_v5p": TpuKind("v5p", 3, ".venv"),
         "tpu_v6e": TpuKind("v6e", 2, ".venv"),
         "tpu_v7": TpuKind("tpu7x", 3, ".venv-tpu", ".jax-tpu7x")}  # (2 devices a chip: planner/chips.py)
MIN_CHIPS = 4
# XLA's exec_time_optimization_effort (-1 to 1; 0, its default, is what a run's compile uses): how hard
# its backend passes work for speed, which is most of a compile's time (21 of 25 s on a 4096-wide
# block). At -1 the same program compiles up to ~6x quicker: its FLOPs and argument bytes the same, its
# temporaries those of a less-worked schedule (docs/planning.md, "A quicker compile")
EFFORTS = (-1.0, 1.0)


class TargetError(ValueError):
    """A chip, topology or compile environment that cannot work, said in one line (exit 2)."""
    exit_code = 2


class CompileFailed(RuntimeError):
    """The TPU compiler refused the program for a reason other than HBM (a lowering, a Mosaic kernel,
    VMEM): `str()` is the line that says why, `.text` the compiler's whole message."""

    def __init__(self, text):
        super().__init__(_compiler_line(text))
        self.text = text


def topology_name(chip, topology=MIN_CHIPS):
    """libtpu's name for `chip`'s topology: `topology` as given ("v5p:2x2x1") or a chip count (1 to 4:
    one host's 2x2(x1); 8, 16, ...: its torus grown as Cloud TPU's slices are, 2x2x2, 2x2x4, 2x4x4)."""
    kind = _kind(chip)
    if isinstance(topology, str) and ":" in topology:
        if not topology.startswith(kind.prefix + ":"):
            raise TargetError(f"topology {topology!r} is not a {chip} one ({kind.prefix}:...)")
        return topology
    if not str(topology).isdigit():
        raise TargetError(f"topology {topology!r}: give libtpu's name ({kind.prefix}:2x2x1, ...) or a chip count")
    n = int(topology)
    if n < 1 or n > MIN_CHIPS and n & (n - 1):
        raise TargetError(f"a {chip} topology has 1-{MIN_CHIPS} chips (one host's) or a power of two, not {n}")
    dims = [2, 2] + [1] * (kind.torus_dims - 2)
    while _product(dims) < n:  # double the smallest axis (the last of equals): 2x2x1, 2x2x2, 2x2x4, 2x4x4, ...
        axis = max(a for a in range(len(dims)) if dims[a] == min(dims))
        dims[axis] *= 2
    return f"{kind.prefix}:{'x'.join(map(str, dims))}"


def topology_chips(chip, topology):
    """The chips of `chip`'s topology name ("v5p:2x2x1": 4) or count (topology_name's rules)."""
    dims = topology_name(chip, topology).split(":")[1].split("x")
    if not all(d.isdigit() and int(d) > 0 for d in dims):
        raise TargetError(f"topology {topology!r}: its dims are positive integers joined by x (e.g. 2x2x1)")
    return _product(int(d) for d in dims)


def _product(dims):
    out = 1
    for d in dims:
        out *= d
    return out


def _kind(chip):
    if chip not in KINDS:
        raise TargetError(f"no compile-only target for chip {chip!r}: one of {', '.join(KINDS)}")
    return KINDS[chip]


def python_for(chip):
    """The interpreter of the environment that compiles for `chip` (for a child process)."""
    return os.path.join(ROOT, _kind(chip).python, "bin", "python")


def step_jax_path(chip):
    """The directory that gives the training step's compile (torchax, on .venv's torch 2.9) `chip`'s
    jax / libtpu pair when put first on PYTHONPATH, or None where .venv's own pair serves. For Ironwood:
    .jax-tpu7x, links to .venv-tpu's jax, jaxlib, libtpu and ml_dtypes (the pins of
    requirements-tpu.txt; both environments are Python 3.11), made here when first asked for. (torchax
    does not import on .venv-tpu's torch 2.13: "aten.prod has no overload name dim_Dimname", with
    torchax 0.0.7 and 0.0.13.) Made again where a link no longer leads anywhere: .venv-tpu rebuilt
    with other pins (its versioned dist-info folders renamed), so never a new jax beside an old libtpu's
    metadata."""
    kind = _kind(chip)
    if not kind.jax_path:
        return None
    where = os.path.join(ROOT, kind.jax_path)
    if os.path.isdir(where) and not all(os.path.exists(os.path.join(where, n)) for n in os.listdir(where)):
        shutil.rmtree(where, ignore_errors=True)  # (removes the links, not what they lead to)
    if not os.path.isdir(where):
        found = glob.glob(os.path.join(ROOT, kind.python, "lib", "python3*", "site-packages", "libtpu"))
        if not found:
            raise TargetError(f"no {kind.python} to take {chip}'s jax / libtpu pair from: build it (the README's "
                              f"test command, or .ci/run)")
        packages = os.path.dirname(found[0])
        links = [p for name in ("jax", "jaxlib", "libtpu", "ml_dtypes")
                 for p in [os.path.join(packages, name), *glob.glob(os.path.join(packages, f"{name}-*.dist-info"))]]
        staging = tempfile.mkdtemp(prefix=kind.jax_path + ".", dir=ROOT)
        for p in links:
            os.symlink(p, os.path.join(staging, os.path.basename(p)))
        with contextlib.suppress(OSError):  # (another process made it first: theirs serves)
            os.rename(staging, where)
        shutil.rmtree(staging, ignore_errors=True)
    return where


def step_environment(chip):
    """The environment variables a child of .venv's python needs to compile a training step for `chip`."""
    where = step_jax_path(chip)
    return {"PYTHONPATH": os.pathsep.join(p for p in (where, os.environ.get("PYTHONPATH")) if p)} if where else {}


def libtpu_path():
    """The libtpu this jax compiles with: jax's own choice ($TPU_LIBRARY_PATH, an importable libtpu:
    .venv-tpu's), else $MINITITAN_LIBTPU or .libtpu (a `pip install --target` directory, or the .so)."""
    from jax._src import cloud_tpu_init
    found = cloud_tpu_init.get_tpu_library_path()  # ($TPU_LIBRARY_PATH, or an importable libtpu)
    if found:
        return found
    where = os.environ.get("MINITITAN_LIBTPU") or os.path.join(ROOT, ".libtpu")
    path = where if where.endswith(".so") else os.path.join(where, "libtpu", "libtpu.so")
    if not os.path.isfile(path) and os.environ.get("MINITITAN_LIBTPU"):
        raise TargetError(f"MINITITAN_LIBTPU={where} names no libtpu (no file {path}): point it at a libtpu.so or "
                          f"a pip --target directory holding libtpu, or unset it to use .libtpu")
    if not os.path.isfile(path):
        raise TargetError(f"no libtpu at {path}: the TPU compiler's environment is not built "
                          f"(.ci/run builds it; or pip install --no-deps --target .libtpu "
                          f"-r requirements-libtpu.txt)")
    return path


@contextlib.contextmanager
def _libtpu_log_dropped():
    """libtpu logs a page of warnings to fd 2 when it starts on a host with no chip (no accelerator
    type, no worker hostnames, nothing to act on): dropped. A failure still raises, with its message."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_TOPOLOGIES = {}


def devices(chip, topology=MIN_CHIPS, slices=1):
    """The compile-only devices of `chip`'s topology (a name or a chip count), in libtpu's order;
    `slices` > 1: that many slices of it, joined by DCN (slice by slice, as MaxText's
    compile_topology_num_slices)."""
    name = topology_name(chip, topology)
    if (name, slices) not in _TOPOLOGIES:
        from jax._src import xla_bridge
        from jax.experimental import topologies
        from jax._src import hardware_utils
        if not xla_bridge.backends_are_initialized() and jax.config.jax_platforms is None \
                and hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
            jax.config.update("jax_platforms", "cpu")  # (no chip here: none to look for)
        jax.devices()  # jax's own backends first: with a libtpu in view they would look for a chip
        path = libtpu_path()
        # libtpu takes /tmp/libtpu_lockfile (one process a TPU host); compile-only processes share none
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            with _libtpu_log_dropped():
                if not xla_bridge.xla_client.pjrt_plugin_loaded("tpu"):
                    xla_bridge.xla_client.load_pjrt_plugin_dynamically("tpu", path)
                _TOPOLOGIES[name, slices] = topologies.get_topology_desc(
                    topology_name=name, platform="tpu", **({"num_slices": slices} if slices > 1 else {}))
        except Exception as e:  # (an XlaRuntimeError: a name this libtpu does not know)
            hint = (f"; this jax is {jax.__version__}: compile for {chip} with PYTHONPATH="
                    f"{os.path.relpath(step_jax_path(chip))} (its jax / libtpu pair)" if _kind(chip).jax_path else "")
            raise TargetError(f"libtpu cannot describe {name}: {_first_line(e)}{hint}") from None
    return list(_TOPOLOGIES[name, slices].devices)


def one_device_sharding(chip, topology=MIN_CHIPS):
    """A replicated sharding on a one-device mesh: where a Mosaic kernel compiles (the compiler does
    not partition a kernel by itself: several devices need shard_map)."""
    mesh = jax.sharding.Mesh(devices(chip, topology)[:1], ("one",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@dataclasses.dataclass
class Compiled:
    """What the TPU compiler says of a program, per device (bytes)."""
    chip: str
    topology: str
    fits: bool                # the compiler's verdict: room in HBM for its program (temporaries);
                              # arguments and outputs it does not check (a 48 GiB output compiled for
                              # v6e's 32 GiB): compare hbm_bytes with the chip's HBM for those
    message: str              # its out-of-memory message ("" when it fits)
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    alias_bytes: int = 0      # outputs that reuse an argument's buffer (donation)
    flops: float = None       # the cost model's; a Mosaic kernel counts none
    bytes_accessed: float = None
    optimal_seconds: float = None
    compile_s: float = 0.0
    mosaic_calls: int = 0     # Mosaic kernels in the compiled program (tpu_custom_call)
    host_bytes: int = 0       # host memory the program's temporaries take (offloaded activations)
    all_to_alls: int = 0      # all-to-alls in the program (ep's exchanges: tpu_pod/expert_exchange.py)
    peak_bytes: int = 0       # the program's peak, arguments included (memory_analysis's
                              # peak_memory_in_bytes; 0: not given); with host buffers it can count them
    hbm_allocated_bytes: int = 0  # with host buffers: the HBM its buffer assignment reserves (_hbm_allocated)
    uncounted: str = ""       # why FLOPs and seconds are not given (a scanned step's: step_compile), or ""

    @property
    def summed_bytes(self):
        """memory_analysis's sizes added up. Not what must fit: on a scanned step its temporaries
        exceed the buffer assignment's heap (Mixtral 8x7B on v5p-128: 117.1 GiB against 79.2, a
        program libtpu compiles for 95 GiB devices; docs/planning.md, "Which figure must fit")."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def hbm_bytes(self):
        """The device's HBM at the program's peak: the compiler's own figure where it gives one for
        HBM alone (no host buffers); with host buffers, the HBM its buffer assignment reserves;
        else the sizes added up."""
        if not self.host_bytes:
            return self.peak_bytes or self.summed_bytes
        # (the same buffers packed: never more than their sizes added up on libtpu 0.0.24's rows; more
        # is a dump not read as it is meant: libtpu 0.0.52's, 2.5x the HBM of a program it fits)
        return min(self.hbm_allocated_bytes or self.summed_bytes, self.summed_bytes)

    def line(self):
        if not self.fits:
            return f"{self.chip} {self.topology}: does not fit: {self.message}"
        mib = lambda b: f"{b / 2**20:,.1f} MiB"
        return (f"{self.chip} {self.topology}: compiles in {self.compile_s:.1f} s; per device "
                f"arguments {mib(self.argument_bytes)}, outputs {mib(self.output_bytes)}, temporaries "
                f"{mib(self.temp_bytes)}; {self.mosaic_calls} Mosaic kernel(s); cost model: "
                f"{self.flops or 0:.3g} FLOPs, {self.optimal_seconds or 0:.3g} s")


def _first_line(e):
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def interruptible(fn):
    """fn() run in a worker thread while the main thread waits on it: a compile spends minutes inside
    libtpu, where Python runs no signal handler, so Ctrl-C or SIGTERM would wait for its end; the main
    thread takes them at once (the worker, a daemon, is left to the process's exit)."""
    out = {}

    def work():
        try:
            out["value"] = fn()
        except BaseException as e:  # (handed to the main thread, raised there)
            out["error"] = e
    worker = threading.Thread(target=work, name="tpu-compile", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in out:
        raise out["error"]
    return out["value"]


def compile(fn, *args, chip, topology=MIN_CHIPS, donate_argnums=(), effort=0.0, lower_kernels=True):
    """Compile jax function `fn` on `args` (ShapeDtypeStructs; one without a sharding is placed on
    one device of the topology) for `chip`, with its Pallas kernels lowered by Mosaic. Returns a
    Compiled; an HBM overflow is `fits=False` with the compiler's message; any other refusal raises
    CompileFailed. `donate_argnums`: arguments whose buffers the outputs may reuse (a training step's
    weights and optimizer state, updated in place: alias_bytes). `effort`: XLA's
    exec_time_optimization_effort (EFFORTS), given here whatever $JAX_EXEC_TIME_OPTIMIZATION_EFFORT says.
    `lower_kernels`: the Pallas kernels lower for `chip` (kernels_pallas.lowering_for); False: as they
    would in a process running on a chip (kernels_pallas.running_chip), the training step's own path."""
    if not (EFFORTS[0] <= effort <= EFFORTS[1]):  # (NaN too; XLA took -5 and NaN without a word)
        raise ValueError(f"compile effort {effort}: XLA's exec_time_optimization_effort is in [-1, 1]")
    options = {"exec_time_optimization_effort": float(effort)}
    name = topology_name(chip, topology)
    one = one_device_sharding(chip, name)
    place = lambda a: (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)
                       if isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None else a)
    args = jax.tree.map(place, args)
    start = time.perf_counter()
    jax.clear_caches()  # (a trace cached in interpret mode must not be reused, nor this one after)
    try:  # (the default device: Pallas asks it which chip it lowers for, jax 0.10's tpu_info)
        with kernels_pallas.lowering_for(chip if lower_kernels else None), \
                jax.default_device(one.mesh.devices.flat[0]):
            lowered = jax.jit(lambda *a: fn(*a), donate_argnums=donate_argnums).lower(*args)
            compiled = interruptible(lambda: lowered.compile(compiler_options=options))
            seconds = time.perf_counter() - start
            mem = compiled.memory_analysis()
            host = getattr(mem, "host_temp_size_in_bytes", 0)
            hbm_allocated = _hbm_allocated(lowered, options, host) if host else 0
    except Exception as e:
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text and ("memory space hbm" in text or "HbmOom" in text  # (libtpu 0.0.24, 0.0.52;
                                             or "space=hbm" in text):  # one buffer larger than HBM, 0.0.24)
            return Compiled(chip, name, False, _first_line(text.split("RESOURCE_EXHAUSTED: ")[-1]),
                            compile_s=time.perf_counter() - start)
        if "allocation_size_words <= " in text:  # (libtpu's RET_CHECK on a buffer of 2^31 words or more)
            return Compiled(chip, name, False, "one buffer is larger than the compiler can allocate (2^31 words "
                                               "or more): far past HBM", compile_s=time.perf_counter() - start)
        raise CompileFailed(text) from None
    finally:
        jax.clear_caches()
    text = lowered.as_text()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    estimate = cost.get("optimal_seconds")  # (over DCN, libtpu 0.0.24 gives about -20 s plus the step: no
    estimate = estimate if estimate is None or estimate > 0 else None  # estimate, not a time; measured here)
    return Compiled(chip, name, True, "", mem.argument_size_in_bytes, mem.output_size_in_bytes,
                    mem.temp_size_in_bytes, mem.alias_size_in_bytes, cost.get("flops"),
                    cost.get("bytes accessed"), estimate, seconds,
                    # (counted in the lowered program: jax 0.10.2 cannot print some compiled ones,
                    # "RET_CHECK ... async-update instruction should have 1 operands but sees 2")
                    text.count("@tpu_custom_call"), host,
                    text.count("stablehlo.all_to_all"), getattr(mem, "peak_memory_in_bytes", 0), hbm_allocated)


HBM_COLOR, HOST_COLOR = 0, 5  # buffer assignment's memory colors on TPU: HBM, host (1: VMEM, 128 MiB on
                              # v6e; 2, 4, 6: a few KiB of scalar and sync memory)


def _hbm_allocated(lowered, options, host_bytes):
    """The HBM a program with host buffers reserves: its buffer assignment's allocations of HBM's color
    (arguments, outputs, the temporaries' heap), from XLA's dump of the program compiled again. Its
    peak can count host buffers (Llama 3.1 70B on v6e-64 with --offload: 32.3 GiB, where every HBM
    allocation adds up to 25.2). 0 (the sizes added up stand) unless the host color's allocations
    are memory_analysis's host temporaries, exactly."""
    with tempfile.TemporaryDirectory() as where:
        try:
            interruptible(lambda: lowered.compile(compiler_options={**options, "xla_dump_to": where}))  # (the same program's)
        except Exception:  # (a jax or libtpu without the option: no HBM figure, not a failed compile)
            return 0
        found = glob.glob(os.path.join(where, "*after_optimizations-buffer-assignment.txt"))
        if len(found) != 1:
            return 0
        with open(found[0]) as f:
            text = f.read()
    by_color = collections.Counter()
    for size, color in re.findall(r"^allocation \d+: size (\d+)(?:.*?, color (\d+))?", text, re.M):
        by_color[int(color or HBM_COLOR)] += int(size)  # (no color written: HBM's)
    return by_color.get(HBM_COLOR, 0) if by_color.get(HOST_COLOR) == host_bytes else 0


def per_chip(compiled, cores):
    """The compiler's figures a device, as a chip's (the planner's unit): bytes and FLOPs times the
    chip's devices; the step's seconds are each device's, the cores running side by side."""
    if cores == 1:
        return compiled
    times = lambda v: v * cores if v is not None else None
    return dataclasses.replace(compiled, argument_bytes=compiled.argument_bytes * cores,
                               output_bytes=compiled.output_bytes * cores, temp_bytes=compiled.temp_bytes * cores,
                               alias_bytes=compiled.alias_bytes * cores, host_bytes=compiled.host_bytes * cores,
                               peak_bytes=compiled.peak_bytes * cores, hbm_allocated_bytes=compiled.hbm_allocated_bytes * cores,
                               flops=times(compiled.flops), bytes_accessed=times(compiled.bytes_accessed))


def cost_model_rate(chip, topology, cores=1):
    """FLOP/s the compiler's cost model gives one chip (its devices) on a bf16 (8192 x 8192)^2 matmul: its
    `optimal_seconds` is not the chip's time (measured: 22.8 TFLOP/s a device for v5p and v6e alike, 5%
    and 2.5% of their published bf16 peaks; Ironwood 996, 86%), so a step's estimate is also read in units of this rate."""
    x = jax.ShapeDtypeStruct((8192, 8192), jax.numpy.bfloat16)
    # (at the least effort: one dot has one schedule, priced alike at every effort, measured; 0.1 s, not 1.2)
    mm = compile(lambda a, b: a @ b, x, x, chip=chip, topology=topology, effort=EFFORTS[0])
    return mm.flops / mm.optimal_seconds * cores  # (a chip's: its devices side by side)


def _compiler_line(text):
    """The line of a compiler error that says what is wrong (Mosaic puts it after a traceback-like
    preamble): the first naming an error, else the first."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if any(w in ln for w in ("rror", "must", "exceed", "Unsupported", "not ", "Ran out")):
            return ln[:400]
    return (lines or ["(no message)"])[0][:400]


def main(argv):
    """python -m tpu_pod.target CHIP [TOPOLOGY | CHIPS]: a bf16 matmul compiled, as a check of the
    environment; `error:` and exit 2 where it cannot be."""
    if not argv or argv[0] not in KINDS or len(argv) > 2:  # (a third word was ignored)
        print(f"usage: python -m tpu_pod.target {{{','.join(KINDS)}}} [TOPOLOGY | CHIPS]", file=sys.stderr)
        return 2
    chip, topology = argv[0], (argv[1] if len(argv) > 1 else MIN_CHIPS)
    try:
        x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        print(compile(lambda a, b: jnp.tanh(a @ b), x, x, chip=chip, topology=topology).line())
    except (TargetError, CompileFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
