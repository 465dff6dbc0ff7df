"""parallel.py: the one interface between the trainer and how a model is spread over devices.

The trainer never asks "am I under a mesh?": it holds a `Parallel` and calls its methods. Three
implementations, one per way of running:

    Parallel      one process, one device (this class: every method is the identity / a local sum)
    TorchrunMesh  one process per device under torchrun: DTensor shards (SimpleFSDP or FSDP2), with
                  tensor and expert parallelism (mesh.py)
    XlaSpmd       one process driving every XLA device: partition specs, GSPMD inserts the
                  collectives (spmd.py)

What a layout must answer, and nothing more:
  - where: `device`, `n_devices`, `mesh_spec` (recorded in checkpoints; None for one device);
  - who: `dp_rank` / `dp_size` (which slice of each global batch this process reads) and
    `writes_files` (the ONE process that writes notes, metrics and renames: global rank 0);
  - the model: `model_args(args)` (a config rewrite the layout needs, e.g. TP's split loss) and
    `parallelize(model)` (tensor parallel, then expert parallel, then data parallel, in that order);
  - the step: `local(params)` (what the elementwise optimizer updates), `like(shards, params)` (back
    to the parameters' form for checkpoints and the traced step), `place_state`, `place_batch`,
    `grads(loss, params)`, `global_sq_norm(sq_N)` (clipping), `mean_over_dp(x)` (logged losses);
  - bookkeeping: `local_bytes(tensors)`, `traceable` (None, or why graph mode cannot trace it),
    `graph_passes` (the passes graph mode applies by default), `close()`.
train.choose_parallel(cfg) picks the implementation: the one place that looks at --mesh and the launcher.
"""
import torch


class Parallel:
    """One device. The base class is also the interface: subclasses override what differs."""
    dp_rank, dp_size, global_rank, n_devices, mesh_spec = 0, 1, 0, 1, None
    traceable = None  # None: graph mode can trace the step; else the reason it cannot
    graph_passes = ()  # the graph passes (fsdp_passes.py) --fsdp-passes auto applies

    def __init__(self, device):
        self.device = device

    @property
    def writes_files(self):
        """True in exactly one process of the run: it prints notes and writes metrics and renames."""
        return self.global_rank == 0

    def model_args(self, args):
        return args

    def parallelize(self, model):
        return model.to(self.device)

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

    def grads(self, loss, params):
        return list(torch.autograd.grad(loss, params))

    def global_sq_norm(self, sq_N):
        """Per-tensor squared norms of what `local` returned -> the squared norm of the whole model."""
        return sq_N.sum()

    def mean_over_dp(self, x):
        return x.detach()

    def local_bytes(self, tensors):
        return sum(t.numel() * t.element_size() for t in self.local(tensors))

    def close(self):
        pass

