"""mesh.py: process groups and the device mesh (dcn, ici, tp) for data, tensor and expert
parallelism; torchrun launches.

    torchrun --nproc-per-node 2 train.py --mesh ici=2             # FSDP: shard over 2
    torchrun --nproc-per-node 4 train.py --mesh dcn=2,ici=2       # HSDP: 2 replicas x 2 shards
    torchrun --nproc-per-node 4 train.py --mesh ici=2,tp=2        # FSDP x tensor parallel (the family's plan)
    torchrun --nproc-per-node 2 train.py --mesh ici=2,ep=2 --flavor qwen3_moe_debug   # experts over 2 (the family's routing)
    torchrun --nproc-per-node 4 train.py --mesh ici=2,cp=2        # each sequence over 2 ranks (context_parallel.py)
    torchrun --nnodes 2 --node-rank N --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        train.py --mesh dcn=2,ici=4                               # HSDP over 2 hosts, one launcher each (README)

Names follow TPU pods: `ici` is the fast inter-chip interconnect inside a slice (shard there: the
all-gathers and reduce-scatters of FSDP run on it), `dcn` the data-center network between slices
(replicate there: only one gradient all-reduce per step crosses it). torchrun numbers ranks host by
host, so with ici x tp = the ranks of a host, dcn is the hosts. `tp` is the innermost dim (its
ranks are neighbours: TP's collectives sit on the critical path); `ep`, as in torchtitan, borrows
data-parallel ranks and adds none. `cp` (context parallel) sits between ici and tp: its ranks share
a batch slice and split its sequences; for the weights they are data-parallel ranks (FSDP shards over
ici x cp, one mesh dim named ici here). The backend is gloo on CPU, nccl on CUDA; on TPU, TorchTPU
provides its own backend for torch.distributed (not run here). Every collective has a timeout, so a
dead peer ends the run instead of hanging it.

Data: every data-parallel rank (dcn x ici of them) reads its own slice of each global batch; the tp
ranks of one group read the same slice.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import device as dev
from errors import BadInput
import context_parallel
import fsdp_passes
import simplefsdp
from parallel import Parallel, launched_by_torchrun, local_block, local_tensor


class MeshError(BadInput):
    pass


class SaidAlready(MeshError):
    """A refusal of torchrun's restarted worker that its first attempt already said: exit 2, no line."""


def mesh_dims(spec):
    """'dcn=2,ici=2,tp=2' -> {"dcn": 2, "ici": 2, "tp": 2, "ep": 1, "cp": 1}. World size: dcn x ici x
    cp x tp; ep borrows data-parallel ranks (it must divide dcn x ici) and adds none."""
    sizes = {"dcn": 1, "ici": None, "tp": 1, "ep": 1, "cp": 1}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if key not in sizes or not sep or not value.isdigit() or int(value) <= 0:
            raise MeshError(f"--mesh {spec!r}: expected dims dcn=R,ici=S,cp=C,tp=T,ep=E (ici required) with positive integers")
        sizes[key] = int(value)
    if sizes["ici"] is None:
        raise MeshError(f"--mesh {spec!r}: ici=N is required")
    if (sizes["dcn"] * sizes["ici"]) % sizes["ep"]:
        raise MeshError(f"--mesh {spec!r}: ep={sizes['ep']} must divide the data-parallel ranks dcn x ici "
                        f"= {sizes['dcn'] * sizes['ici']}")
    return sizes


def parse_mesh(spec):
    """'ici=4' -> (1, 4, 1); 'dcn=2,ici=2,cp=2' -> (2, 2, 2): the data-parallel dims and cp (XLA SPMD)."""
    sizes = mesh_dims(spec)
    if sizes["tp"] > 1 or sizes["ep"] > 1:
        raise MeshError(f"--mesh {spec!r}: tp and ep are built for torchrun meshes, not XLA SPMD")
    return sizes["dcn"], sizes["ici"], sizes["cp"]


class TorchrunMesh(Parallel):
    """One process per device under torchrun; parameters become DTensor shards on the mesh."""

    def __init__(self, spec, dp_impl="simple", param_dtype=None, timeout_s=60):
        sizes = mesh_dims(spec)
        dcn, ici, tp, ep, cp = sizes["dcn"], sizes["ici"], sizes["tp"], sizes["ep"], sizes["cp"]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if dcn * ici * cp * tp != world:
            raise MeshError(f"--mesh {spec!r} has {dcn * ici * cp * tp} devices but the world size is {world} "
                            f"(torchrun --nproc-per-node {dcn * ici * cp * tp})")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        super().__init__(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        if not dist.is_initialized():
            dist.init_process_group(dev.dist_backend(self.device),
                                    timeout=datetime.timedelta(seconds=timeout_s))
        check_same_on_every_rank(spec, sizes, dp_impl)
        # tp innermost: the ranks of one tp group are neighbours (one host's fastest links); the weights'
        # mesh dim "ici" holds ici x cp ranks (FSDP shards over both)
        self.mesh = init_device_mesh(self.device.type, (dcn, ici * cp, tp), mesh_dim_names=("dcn", "ici", "tp"))
        self.mesh_spec, self.dcn, self.ici, self.tp, self.ep, self.cp = spec, dcn, ici, tp, ep, cp
        # a tp group and a cp group read one batch slice: data-parallel rank = position on (dcn, ici)
        self.global_rank, self.dp_rank, self.dp_size = dist.get_rank(), dist.get_rank() // (cp * tp), world // (cp * tp)
        self.n_devices, self.param_split, self.seq_split = world, ici * cp * tp, cp  # (replicated over dcn; experts split further)
        self.context = context_parallel.ContextParallel(cp, (self.global_rank // tp) % cp, sequence_group(
            self.device.type, (dcn, ici, cp, tp))) if cp > 1 else None
        self.hosts = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))  # (torchrun: ranks per node)
        self.dp_impl, self.param_dtype = dp_impl, param_dtype
        self.sq_weights = None  # per parameter: 1 / (ranks holding the same copy), set by parallelize
        self.graph_passes = fsdp_passes.PASSES if dp_impl == "simple" else ()  # (graph mode's default; FSDP2's
        # hooks do not trace: cli.validate refuses graph mode with it)

    @classmethod
    def from_cli(cls, spec, device, dp_impl, param_dtype):
        """train.py's --mesh / --device / --dp-impl (flag combinations were checked by cli.validate)."""
        if not launched_by_torchrun():
            shown = spec or "ici=2"
            d = mesh_dims(shown)
            ranks = d["dcn"] * d["ici"] * d["tp"] * d["cp"]  # (ep adds no ranks)
            raise MeshError(f"--mesh {shown} runs one process a rank ({ranks}): launch it with torchrun, e.g. "
                            f"torchrun --nproc-per-node {ranks} train.py --mesh {shown} ...")
        end_with_the_launcher()
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and \
                os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Measured here: the restarted ranks read the dead attempt's gloo addresses (connection refused, exit 4).
            # torchrun restarts a refused worker too: its restarts end quietly (the first attempt said it).
            first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            raise (MeshError if first else SaidAlready)(
                "torchrun --max-restarts with the rendezvous store shared with the ranks: a restarted job "
                "would read the first attempt's addresses from it and fail (torch 2.9, pytorch#135712); "
                "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d (or --standalone)")
        return cls(spec or f"ici={os.environ['WORLD_SIZE']}", dp_impl, param_dtype)

    def model_args(self, args, family):
        """The family's config for this layout's tp / ep (a refusal is one line: MeshError)."""
        try:
            return family.layout_args(args, self.tp, self.ep)
        except ValueError as e:
            raise MeshError(f"--mesh {self.mesh_spec!r}: {e}") from None

    def parallelize(self, model, units=(), family=None):
        """What the mesh does to a model, in order (docs/layouts.md): the family's own parallelization
        (tensor parallel, expert parallel, its sequence over cp: ModelFamily.parallelize), then data parallel
        (SimpleFSDP, or FSDP2: the oracle, one fully_shard unit per block of `units`, then the rest).
        A model on the meta device stays there until the shards are placed, then each rank allocates
        only its own (materialize.py fills them)."""
        meta = any(p.is_meta for p in model.parameters())
        model = model if meta else model.to(self.device)
        tp_mesh = self.mesh["tp"] if self.tp > 1 else None
        ep_mesh = expert_mesh(self.device.type, dist.get_world_size(), self.ep) if self.ep > 1 else None
        experts = family.parallelize(model, tp_mesh, ep_mesh, self.context) if family is not None else []
        dp_mesh = self.mesh["dcn", "ici"] if self.dcn > 1 else self.mesh["ici"]  # 1-D: nothing to replicate
        if self.dp_impl == "fsdp2":
            model = self._fsdp2(model, dp_mesh, units)
        else:
            if tp_mesh is not None:
                dp_mesh = self.mesh["dcn", "ici", "tp"] if self.dcn > 1 else self.mesh["ici", "tp"]
            model = simplefsdp.data_parallel(model, dp_mesh, param_dtype=self.param_dtype, tp_mesh=tp_mesh,
                                             expert_mesh=ep_mesh, experts=experts)
            self.sq_weights = [1.0 / _copies(p) for p in model.parameters()]
        return model.to_empty(device=self.device) if meta else model

    @property
    def grad_sum_split(self):
        """FSDP2 sums a step's gradients unsharded (grads): whole on every rank."""
        return 1 if self.dp_impl == "fsdp2" else self.param_split

    def fill(self, param, whole):
        """This rank's block of the whole tensor into its shard (parallel.local_block: DTensor's split)."""
        local_tensor(param).copy_(local_block(whole, param))

    def _fsdp2(self, model, dp_mesh, units):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        return_freed_host_memory()
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for unit in units:
            if unit is not model:  # (with --scan: a stack of all the blocks is one unit)
                fully_shard(unit, mesh=dp_mesh, mp_policy=mp)
        # (FSDP2 re-points uneven local shards at each reshard: take fresh `local()` views per step.)
        self.fsdp_root = fully_shard(model, mesh=dp_mesh, mp_policy=mp)
        return self.fsdp_root

    @staticmethod
    def local(tensors):
        """Local shards (plain tensors sharing storage) of DTensors: the optimizer is elementwise,
        so it runs on shards alone; only the gradient norm needs a collective. Inverse: `like`."""
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

    @staticmethod
    def like(shards, params):
        """Local shards back into DTensors placed like `params` (for DCP and for the traced step)."""
        return [DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride()) for t, p in zip(shards, params)]

    def place_batch(self, batch):
        """Each rank already read only its rows; under cp, only its chunks of their sequences."""
        if self.context is not None:
            return tuple(self.context.split(t.to(self.device)) for t in batch)
        return tuple(t.to(self.device) for t in batch)

    def grads(self, loss, params, last=True):
        """d loss / d params as this rank's averaged gradient shards. SimpleFSDP: ordinary autograd
        (the reduce-scatter is in the graph: once a microbatch in eager mode, each call's own).
        FSDP2: backward() fires its reduce-scatter hooks, only at a step's `last` microbatch: before
        it the gradient sync is off (FSDP2's no_sync), FSDP2 adds each microbatch's unsharded
        gradients into its own sum, and the last backward reduce-scatters (HSDP: and all-reduces over
        dcn) that sum once; None for the microbatches before it."""
        if self.dp_impl != "fsdp2":
            return self.local(torch.autograd.grad(loss, params))
        self.fsdp_root.set_requires_gradient_sync(last)
        loss.backward()
        if not last:
            return None
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return self.local(grads)

    # Functional collectives (return new tensors): the same code runs eagerly and traces into graphs.
    def global_sq_norm(self, sq_N):
        """Per-tensor squared norms of local shards -> the global sum, over all ranks, each tensor's
        weighted 1/(ranks holding the same copy): dcn replicas, tp ranks of an unsplit weight."""
        if self.sq_weights is None:  # FSDP2: every weight sharded over ici, replicated over dcn
            return funcol.all_reduce(sq_N.sum(), "sum", self.mesh.get_group("ici"))
        # (the weights made here, not kept as a tensor: a graph capture sees them made)
        sq_N = sq_N * torch.tensor(self.sq_weights, dtype=sq_N.dtype, device=sq_N.device)
        return funcol.all_reduce(sq_N.sum(), "sum", dist.group.WORLD)

    def mean_over_dp(self, x):
        """The mean over data-parallel ranks (a tp group's ranks hold the same value, a cp group's their
        tokens' mean, as many each: all ranks count)."""
        return funcol.all_reduce(x.detach(), "sum", dist.group.WORLD) / self.n_devices

    def broadcast_from_first(self, x):
        dist.broadcast(x, 0)
        return x

    def scatter_from_first(self, chunks, out):
        """(dist.scatter over every rank: a tp group's ranks each get their dp rank's chunk)"""
        per_slice = self.n_devices // self.dp_size  # (the tp x cp ranks of one batch slice)
        dist.scatter(out, [chunks[r // per_slice] for r in range(self.n_devices)] if self.global_rank == 0
                     else None, src=0)
        return out

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def end_with_the_launcher():
    """This rank is killed when its launcher dies (Linux's parent-death signal, prctl PR_SET_PDEATHSIG):
    a SIGKILLed torchrun otherwise leaves its ranks training as orphans, saving checkpoints and holding
    the run directory's locks against the relaunched host. SIGKILL, not SIGTERM: a rank interrupted in
    the middle of a step was seen to wait forever in the process group's teardown for its peer, and a
    killed rank loses nothing (checkpoints are atomic, the kernel drops its lock); its peers then see a
    collective fail (exit 4). (torchrun starts its workers from its main thread, whose end the kernel
    watches.)"""
    import ctypes
    import signal
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() == 1:  # (the launcher died before the call: re-parented to init already)
            os.kill(os.getpid(), signal.SIGKILL)


def check_same_on_every_rank(spec, sizes, dp_impl):
    """Refuse, right after the process group exists, launchers that disagree on the layout (torchrun on
    each host runs its own command line): ranks building different meshes would create different
    sub-groups and wait on each other forever. One all_gather of each rank's parsed --mesh and
    --dp-impl on the default group (bounded by its timeout); every rank then says the same line."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (spec, sorted(sizes.items()), dp_impl))
    other = next((r for r, entry in enumerate(every) if entry[1:] != every[0][1:]), None)
    if other is not None:
        said = lambda r: f"rank {r} has --mesh {every[r][0]!r} --dp-impl {every[r][2]}"
        dist.destroy_process_group()  # (now, while every peer is still there: none is left to tear down at exit)
        raise MeshError(f"the launchers disagree on the layout: {said(0)}, {said(other)} (every host's "
                        f"torchrun must pass the same --mesh and --dp-impl)")


def expert_mesh(device_type, world, ep):
    """(efsdp, ep) over all ranks: ep groups are neighbours; efsdp pairs equal positions across them."""
    return DeviceMesh(device_type, torch.arange(world).view(world // ep, ep), mesh_dim_names=("efsdp", "ep"))


def sequence_group(device_type, dims):
    """The process group of this rank's cp ranks, on the (dcn, ici, cp, tp) layout of all ranks."""
    world = dims[0] * dims[1] * dims[2] * dims[3]
    mesh = DeviceMesh(device_type, torch.arange(world).view(*dims), mesh_dim_names=("dcn", "ici", "cp", "tp"))
    return mesh.get_group("cp")


def _copies(p):
    """How many ranks hold the same local piece of DTensor p: the sizes of its Replicate dims."""
    n = 1
    for size, placement in zip(p.device_mesh.shape, p.placements):
        n *= size if isinstance(placement, Replicate) else 1
    return n


def return_freed_host_memory():
    """glibc's malloc (Linux): every block of 128 KiB or more (glibc's own starting threshold) mapped by
    itself, so freeing it returns it to the system. By default glibc raises that threshold to the
    largest block freed so far (up to 32 MiB) and serves such blocks from its heap, which keeps freed
    pages resident: FSDP2 allocates and frees each unit's gathered weights and unsharded gradients at
    every block of every step, and a rank's resident memory grew to several times its live bytes
    (tests/check_parallel.py's memory test). Set by an FSDP2 rank alone: every other run allocates the
    same blocks step after step and reuses them from the heap, and mapping each anew halved the default
    one-process run's throughput (12.0k against 6.1k tokens/s, measured). A MALLOC_MMAP_THRESHOLD_ the
    user set is left as it is."""
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        import ctypes
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):  # (another C library: nothing to set)
            pass
