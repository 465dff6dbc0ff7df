"""parallel.py: the one interface between the trainer and how a model is spread over devices.

The trainer holds a `Parallel` and calls its methods (it reads `mesh_spec` to record it with a
checkpoint, to run the watchdog's peer check only under a mesh, and to skip what needs the whole
weights in one process: the end-of-run preview, the evaluation's pictures). Three
implementations, one per way of running:

    Parallel      one process, one device (this class: every method is the identity / a local sum)
    TorchrunMesh  one process per device under torchrun: DTensor shards (SimpleFSDP or FSDP2), with
                  tensor and expert parallelism (mesh.py)
    XlaSpmd       one process driving every XLA device: partition specs, GSPMD inserts the
                  collectives (spmd.py)

What a layout must answer, and nothing more:
  - where: `device`, `n_devices`, `hosts` (the processes' machines: torchrun's nodes, SPMD's processes),
    `mesh_spec` (recorded in checkpoints; None for one device);
  - who: `dp_rank` / `dp_size` (which slice of each global batch this process reads) and
    `writes_files` (the ONE process that writes notes, metrics and renames: global rank 0);
  - the model: `model_args(args, family)` (the family's config for the layout, e.g. TP's split loss),
    `parallelize(model, units, family)` (the family's own tensor / expert split, ModelFamily.split, then
    data parallel; `units` are the model's repeated modules as the trainer gets them from the workload;
    a model on the meta device comes back allocated, each process holding only its own shards) and
    `fill(param, whole)` (this process's block of a whole tensor into `param`: materialize.py);
  - checkpoints: `checkpoint_shards()` (None: DCP through host copies; or how run/checkpoint.py writes and
    reads this layout's state shard by shard on its devices: spmd_checkpoint.DeviceShards);
  - the step: `local(params)` (what the elementwise optimizer updates), `like(shards, params)` (back
    to the parameters' form for checkpoints and the traced step), `place_state`, `place_batch`,
    `grads(loss, params, last)`, `global_sq_norm(sq_N)` (clipping), `mean_over_dp(x)` (logged losses);
  - bookkeeping: `param_split` (a device's share of a weight: 1 / param_split), `grad_sum_split` (of
    the gradients' sum over microbatches), `seq_split` (of a sequence's activations), `local_bytes(tensors)`,
    `graph_passes` (the passes graph mode applies by default), `close()`.
`layout_kind(mesh, device)` is the one decision of which implementation a command line gets: run/cli.py
validates the flags against it and train.choose_parallel builds it.
"""
import os

import torch

import device as dev
from errors import ConfigError


def launched_by_torchrun():
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def layout_kind(mesh_spec, device):
    """"spmd": --mesh on XLA (--device xla, or PJRT_DEVICE=TPU) without torchrun: one process drives
    every device; "torchrun": --mesh, or any torchrun launch; "one": one device."""
    if mesh_spec and not launched_by_torchrun() and (device == "xla" or dev.pjrt_is_tpu()):
        return "spmd"
    return "torchrun" if mesh_spec or launched_by_torchrun() else "one"


def local_tensor(t):
    """What this rank holds of `t`: a DTensor's local shard (sharing its storage), else `t` itself."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def local_block(full, like):
    """This rank's block of the whole tensor `full`, placed as the (maybe DTensor) parameter `like` is:
    how a checkpoint read whole (Hugging Face, diffusers, a warm-start run) fills sharded weights, each
    rank copying only its own block. DTensor's own split rule (public API; src_data_rank=None: every
    rank splits its own copy, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def local_box(like):
    """[(start, stop)] per dim of the block of a whole tensor that this rank holds for parameter `like`
    (all of it for a plain tensor): what a reader that reads only a block from disk (interop/hf.py) needs. No
    public API gives a DTensor's offset, so this is the one place that asks torch's own helper."""
    from torch.distributed.tensor import DTensor
    if not isinstance(like, DTensor):
        return [(0, n) for n in like.shape]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    size, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return [(o, o + n) for o, n in zip(offset, size)]


class Parallel:
    """One device. The base class is also the interface: subclasses override what differs."""
    dp_rank, dp_size, global_rank, n_devices, hosts, mesh_spec = 0, 1, 0, 1, 1, None
    param_split = 1  # the ways a parameter is split for one device (its shard: 1 / param_split of it)
    seq_split = 1  # the ways a sequence is split (context parallel: a process holds 1 / seq_split of it)
    graph_passes = ()  # the graph passes (fsdp_passes.py) --fsdp-passes auto applies

    def __init__(self, device):
        self.device = device

    @property
    def writes_files(self):
        """True in exactly one process of the run: it prints notes and writes metrics and renames."""
        return self.global_rank == 0

    def model_args(self, args, family=None):
        """The family's config on one device: no tp or ep (ModelFamily.layout_args refuses a setting
        that needs them: one line)."""
        try:
            return family.layout_args(args, 1, 1) if family is not None else args
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def parallelize(self, model, units=(), family=None):
        """`units`: the model's repeated modules (the workload's blocks, or --scan's stacks), which a
        layout may shard one by one; the layout never looks into the model for them itself. A model on
        the meta device is allocated on the device, its values unset (`fill` sets them)."""
        if any(p.is_meta for p in model.parameters()):
            return model.to_empty(device=self.device)
        return model.to(self.device)

    @staticmethod
    def checkpoint_shards():
        """None: run/checkpoint.py copies the state to the host and DCP writes each process's shards."""
        return None

    @staticmethod
    def fill(param, whole):
        """The whole tensor's values into `param` (one device: all of it). Its data is replaced, not
        copied into: an in-place copy into an XLA tensor from to_empty made step 2 compile a second
        program (test_xla_compiles_one_program_per_step_shape)."""
        param.data = whole.to(param.device)

    @staticmethod
    def local(tensors):
        return list(tensors)

    @staticmethod
    def like(shards, params):
        return list(shards)

    def place_state(self, state):
        """Give optimizer-state tensors (lists parallel to the parameters) the parameters' layout."""

    def place_batch(self, batch):
        return tuple(t.to(self.device) for t in batch)

    def grads(self, loss, params, last=True):
        """d loss / d params, this process's part, reduced over the ranks that share it. `last`: False
        for a step's microbatches before its last (--grad-accum, step.loss_and_grads): a layout that
        keeps the running sum itself, to reduce it once at the last, returns None for them."""
        return list(torch.autograd.grad(loss, params))

    @staticmethod
    def after_microbatch(grads_sum, micro):
        """The next microbatch (--grad-accum, step.loss_and_grads), given the gradients' running sum
        so far: as it is, where the microbatches run in turn (eager; one graph's ops run in the traced
        order). A compiler that schedules one graph freely ties the two (compile_graph.GradsLikeParams)."""
        return micro

    @property
    def grad_sum_split(self):
        """The ways the gradients' running sum over microbatches is split (--grad-accum: check_memory)."""
        return self.param_split

    def global_sq_norm(self, sq_N):
        """Per-tensor squared norms of what `local` returned -> the squared norm of the whole model."""
        return sq_N.sum()

    def mean_over_dp(self, x):
        return x.detach()

    def local_bytes(self, tensors):
        return sum(t.numel() * t.element_size() for t in self.local(tensors))

    # A workload's own exchanges (GRPO: what rank 0 alone draws from its rollout engine)
    def broadcast_from_first(self, x):
        """`x` as global rank 0 holds it, on every process (filled in place)."""
        return x

    def scatter_from_first(self, chunks, out):
        """`out` filled with this process's chunk: `chunks` (one tensor per data-parallel rank, `out`'s
        shape) is given on global rank 0 only (None elsewhere); ranks of one dp rank get the same."""
        return out.copy_(chunks[self.dp_rank])

    def close(self):
        pass

