"""spmd.py: every chip of a TPU VM from ONE process, through XLA's GSPMD partitioner.

    train.py --device xla --mesh ici=4                 # FSDP over 4 devices (CPU_NUM_DEVICES=4 here)
    train.py --device xla --mesh dcn=2,ici=2           # HSDP: 2 replicas x 2 shards
    train.py --device xla --mesh ici=2,cp=2            # each sequence over 2 devices (context parallel)

simplefsdp.py shards with DTensor and one process per device (torchrun, collectives issued by
PyTorch). On torch_xla the way to use many chips is SPMD (Xu et al., "GSPMD", arXiv 2105.04663;
torch_xla's SPMD user guide; torchprime and MaxText train this way): the program is written for
one big device, each tensor carries a partition spec over a named device mesh, and the XLA
compiler partitions the one step program, inserting the all-gathers, reduce-scatters and
all-reduces itself. So the trainer does not change: parameters are marked sharded over `ici`
(replicated over `dcn`), AdamW's state like its parameter, the batch over all data-parallel
devices; eager mode, graph mode (the make_fx step graph on XLA tensors) and --scan (the While
loop over stacked weights) run as they are, and XLA sees the whole step.

What needs care, found on torch_xla 2.9: `zeros_like` drops the partition spec (AdamW's state is
marked explicitly), an in-place copy from an unannotated tensor makes a parameter replicated, and a
parameter filled by an in-place copy loses its spec after the first update (`fill` sets its data, as
`model.to` does). The model comes built on the meta device (materialize.py): `parallelize` allocates
it and `fill` sends each whole parameter, one at a time, to its shards. The mesh is `Mesh` here and
`HybridMesh` on a TPU pod slice (ICI inside a slice, DCN across). Checkpoints are written and read
shard by shard (`checkpoint_shards`: spmd_checkpoint.py), each distinct device shard once, in DCP's
format, so one process or a torchrun mesh resumes from them (--allow-change mesh); what a multi-host
pod adds (a process group for DCP across hosts) is not run here (docs/tpu.md).
The Pallas kernels under SPMD would need manual sharding around the custom call: refused for now.
Context parallelism (cp): the batch's sequence dim carries a partition spec over `cp`, each sequence
first put in head-tail order (context_parallel.HeadTailOrder: each device's block is its two chunks),
and the model gets those positions; GSPMD inserts the gather of keys and values that attention needs.
The weights shard over ici x cp.
"""
import numpy as np

import context_parallel
import device as dev
import mesh as mesh_lib
from layer_scan import StackedLayers
from parallel import Parallel
import spmd_checkpoint


def partition_spec(shape, ici, stacked=False, cp=1, inner="cp"):
    """A parameter's partition spec: one dim over ici x cp (FSDP: the cp ranks are data-parallel for
    the weights), the rest whole; replicated over dcn. Dim 0, unless another divides evenly where it
    does not. A --scan weight (L, out, in) is never split on the layer axis (as scanned JAX models shard
    their weights): each layer's slice is then itself sharded, and XLA gathers one layer inside the
    While body, not the whole stack before it. (Also the shardings of the step compiled for a TPU
    topology: tpu_pod/step_compile.py, where `inner` names ep's axis: ep borrows data-parallel devices too.)"""
    dims = range(1 if stacked else 0, len(shape))
    dim = next((d for d in dims if shape[d] % (ici * cp) == 0), dims[0])
    axes = ("ici", inner) if cp > 1 else "ici"
    return tuple(axes if d == dim else None for d in range(len(shape)))


class XlaSpmd(Parallel):
    """One process driving every XLA device (parallel.Parallel's interface): global tensors carry
    partition specs, so gradients, norms and losses are already global and need no reduction."""

    def __init__(self, spec):
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        dcn, ici, cp = mesh_lib.parse_mesh(spec)
        dev.default_to_xla_cpu()
        xr.use_spmd()  # before any XLA tensor exists: from here on there is one logical device
        n = dev.xla_start(xr.global_runtime_device_count)
        if dcn * ici * cp != n:
            hint = " (set CPU_NUM_DEVICES on XLA:CPU)" if not dev.pjrt_is_tpu() else ""
            raise mesh_lib.MeshError(f"--mesh {spec!r} has {dcn * ici * cp} devices but XLA sees {n}{hint}")
        if dev.pjrt_is_tpu() and dcn > 1:  # ICI inside each slice, DCN across slices
            self.mesh = xs.HybridMesh(ici_mesh_shape=(1, ici, cp), dcn_mesh_shape=(dcn, 1, 1),
                                      axis_names=("dcn", "ici", "cp"))
        else:
            self.mesh = xs.Mesh(np.arange(n), (dcn, ici, cp), ("dcn", "ici", "cp"))
        super().__init__(torch_xla.device())
        self.xs = xs
        self.mesh_spec, self.n_devices, self.ici, self.cp = f"xla-spmd {spec}", n, ici, cp
        self.param_split, self.seq_split = ici * cp, cp
        self.sequence = context_parallel.HeadTailOrder(cp) if cp > 1 else None
        self.hosts = xr.process_count()  # (one process a host on a pod; always 1 on XLA:CPU: docs/tpu.md)

    def spec(self, t, stacked=False):
        return partition_spec(t.shape, self.ici, stacked, self.cp)

    def parallelize(self, model, units=(), family=None):
        """Every parameter gets a partition spec; a parameter of a --scan stack (a StackedLayers unit)
        keeps its layer axis whole. A model on the meta device is allocated on the XLA device (its
        values set by `fill`)."""
        stacked = {id(p) for u in units if isinstance(u, StackedLayers) for p in u.parameters()}
        specs = [self.spec(p, stacked=id(p) in stacked) for p in model.parameters()]
        model = Parallel.parallelize(self, model)
        if self.sequence is not None:
            family.parallelize(model, sequence=self.sequence)
        names, params = zip(*model.named_parameters())
        self.specs, self.spec_of = specs, {id(p): s for p, s in zip(params, specs)}
        self.spec_of_name = dict(zip(names, specs))
        self.mark(params)
        return model

    def fill(self, param, whole):
        """The whole tensor to the device as the parameter's data (as `model.to` does: an in-place copy
        would leave a pending, unannotated value), then its partition spec. One process drives every
        device here: on a pod each host's process would transfer only its addressable shards (not built;
        docs/tpu.md)."""
        param.data = whole.to(self.device)
        self.xs.mark_sharding(param, self.mesh, self.spec_of[id(param)])

    def mark(self, tensors):
        """Mark tensors that correspond, in order, to the model's parameters (or AdamW's moments)."""
        for t, spec in zip(tensors, self.specs):
            self.xs.mark_sharding(t, self.mesh, spec)
        return tensors

    def checkpoint_shards(self):
        """Each distinct device shard written once and read back into its device, every tensor of the
        state with its parameter's partition spec around both (spmd_checkpoint.py)."""
        return spmd_checkpoint.DeviceShards(lambda t, spec: self.xs.mark_sharding(t, self.mesh, spec), self.spec_of_name)

    def place_state(self, state):
        """AdamW's moments like their parameters (zeros_like does not carry the spec)."""
        for tensors in state.values():
            self.mark(tensors)

    def place_batch(self, batch):
        """The global batch split over every data-parallel device (dcn x ici), the rest whole; under cp
        each sequence in head-tail order, split over cp."""
        if self.sequence is not None:  # (run/cli.py: a language model's (inputs, targets))
            batch = tuple(self.sequence.split(t) for t in batch)
        batch = tuple(t.to(self.device) for t in batch)
        for t in batch:
            if t.dim():  # (a 0-d entry, e.g. a workload's token normalizer, is one value: replicated)
                seq = ("cp",) if self.sequence is not None else (None,)
                self.xs.mark_sharding(t, self.mesh, (("dcn", "ici"),) + (seq + (None,) * (t.dim() - 2) if t.dim() > 1 else ()))
        return batch

    def local_bytes(self, tensors):
        """Bytes one device holds of `tensors`, from the live shards' shapes."""
        import torch_xla
        dev.wait(self.device)  # the shards must exist: reading them during an async transfer fails
        shards = torch_xla._XLAC._get_local_shards(list(tensors))
        return sum(s[0][0].numel() * s[0][0].element_size() for s in shards)
