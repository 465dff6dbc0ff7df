"""rl/weight_sync.py: the trainer's weights into the rollout engine's own buffers, with a policy version.

In RL post-training the trainer and the inference engine hold separate copies of the policy, each in
its own layout (torchtitan's experiments/rl: the trainer's DTensor shards, the generator's TP layout).
After every update the engine must see the new weights before it samples again, and every rollout must
say which weights made it (the policy version), or the importance ratio compares the wrong policies.
This file is that pipe, over a 2-rank gloo group of its own (trainer rank 0, engine rank 1), separate
from the trainer's process group so torchrun's world is untouched:

    trainer (every rank)                               engine process
    p.full_tensor() per parameter (a DTensor shard:    Receiver(pg, model): one flat fp32 staging buffer,
      an all-gather on the trainer's mesh)               allocated once
    packed into one flat fp32 buffer (allocated once)
    rank 0: broadcast header [version, numel, crc] --> header checked (same parameter names and shapes)
    rank 0: broadcast the flat buffer             --> copy_ into each parameter in place
                                                       (cast to the engine's dtype; data_ptr unchanged:
                                                        no reallocation, nothing to recompile)

One collective for the payload, not one per tensor (gloo's per-call latency dominates small tensors).
The wire carries the trainer's fp32 master weights; a bf16 engine rounds them on copy_. Bytes and
seconds of every sync are returned for logging.
"""
import datetime
import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class SyncError(RuntimeError):
    pass


def host_store(timeout_s):
    """The trainer's side of the rendezvous: a TCP store on a free port (read `.port`) for 2 ranks."""
    return dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join(rank, timeout_s, store=None, port=None):
    """The 2-rank gloo group (rank 0: the trainer, with the store from host_store; rank 1: the engine,
    with its port). Every collective on it fails after timeout_s instead of waiting forever."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def full(t):
    """The whole tensor: a DTensor (SimpleFSDP / TP shard) is gathered, a plain tensor is itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def layout_crc(named_shapes):
    """A checksum of the parameter names and shapes, in order: both sides must pack the same layout."""
    return zlib.crc32(";".join(f"{n}:{tuple(s)}" for n, s in named_shapes).encode()) & 0x7FFFFFFF


class Sender:
    """The trainer's side. `send` runs on every trainer rank (gathering shards is collective on the
    trainer's mesh); only the rank given `pg` (trainer rank 0) broadcasts to the engine."""

    def __init__(self, pg, named_params):
        shapes = [(n, tuple(p.shape)) for n, p in named_params]
        self.pg, self.crc = pg, layout_crc(shapes)
        self.numel = sum(torch.Size(s).numel() for _, s in shapes)
        self.flat = torch.empty(self.numel, dtype=torch.float32)  # the staging buffer, reused every sync

    @torch.no_grad()
    def send(self, named_params, version):
        """Push the weights as policy `version`; {"version", "bytes", "seconds"} (gather + broadcast)."""
        t0, off = time.perf_counter(), 0
        for _, p in named_params:
            w = full(p.detach()).reshape(-1)
            self.flat[off:off + w.numel()].copy_(w)
            off += w.numel()
        if off != self.numel:
            raise SyncError(f"the trainer's parameters changed size: {off} elements, {self.numel} at start")
        if self.pg is not None:
            header = torch.tensor([version, self.numel, self.crc], dtype=torch.int64)
            try:
                self.pg.broadcast(header, 0).wait()
                self.pg.broadcast(self.flat, 0).wait()
            except RuntimeError as e:  # gloo: the peer is gone or the timeout passed
                raise SyncError(f"weight sync to the engine failed: {str(e).splitlines()[0]}") from None
        return {"version": version, "bytes": self.numel * self.flat.element_size(),
                "seconds": time.perf_counter() - t0}


class Receiver:
    """The engine's side: receives into one staging buffer, copies into the model's parameters in place."""

    def __init__(self, pg, model):
        self.pg = pg
        self.params = [p for _, p in model.named_parameters()]
        self.crc = layout_crc([(n, tuple(p.shape)) for n, p in model.named_parameters()])
        self.numel = sum(p.numel() for p in self.params)
        self.flat = torch.empty(self.numel, dtype=torch.float32)
        self.ptrs = [p.data_ptr() for p in self.params]
        self.version = -1

    @torch.no_grad()
    def recv(self):
        """Receive one sync; the new policy version."""
        header = torch.zeros(3, dtype=torch.int64)
        self.pg.broadcast(header, 0).wait()
        version, numel, crc = header.tolist()
        if (numel, crc) != (self.numel, self.crc):
            raise SyncError(f"the trainer sends {numel} elements (layout crc {crc}), this engine's model has "
                            f"{self.numel} (crc {self.crc}): not the same architecture")
        self.pg.broadcast(self.flat, 0).wait()
        off = 0
        for p in self.params:
            p.copy_(self.flat[off:off + p.numel()].view(p.shape))
            off += p.numel()
        if [p.data_ptr() for p in self.params] != self.ptrs:
            raise SyncError("a parameter was reallocated during the sync")
        self.version = version
        return version
