"""rl/weight_sync.py: the trainer's weights into the rollout engine's own buffers, with a policy version.

In RL post-training the trainer and the inference engine hold separate copies of the policy, each in
its own layout (torchtitan's experiments/rl: the trainer's DTensor shards, the generator's TP layout).
After every update the engine must see the new weights before it samples again, and every rollout must
say which weights made it (the policy version), or the importance ratio compares the wrong policies.
This file is that pipe, over a 2-rank gloo group of its own (trainer rank 0, engine rank 1), separate
from the trainer's process group so torchrun's world is untouched:

    trainer (every rank)                               engine process
    Buckets: the policy in buckets of whole tensors     Receiver(pg, model): the same plan, one staging
      (<= bucket_bytes of fp32), one staging buffer       buffer of the largest bucket
    rank 0: broadcast header [version, numel, crc, bucket_bytes]
                                                  --> header checked (same parameter names and shapes)
    per bucket: full(p) per tensor (a DTensor shard:
      an all-gather on the trainer's mesh) copied in,
      rank 0: broadcast the bucket                --> copy_ into each parameter in place
                                                       (cast to the engine's dtype; data_ptr unchanged:
                                                        no reallocation, nothing to recompile)

One collective per bucket, not one per tensor (gloo's per-call latency dominates small tensors), nor
one for the whole policy (a policy larger than a host's memory must still reach the engine):
no process holds more than its own shards plus one bucket (and the one tensor being gathered). The
wire carries the trainer's fp32 master weights; a bf16 engine rounds them on copy_. Bytes and seconds
of every sync are returned for logging. rl/vllm_engine.py sends the same buckets over its socket.
"""
import datetime
import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from errors import PeerGone


class SyncError(PeerGone):
    """The push failed: the engine is gone or stalled, or it holds another architecture (exit 4)."""


BUCKET_BYTES = 64 << 20  # a push's bucket: fp32 bytes of whole tensors (one larger tensor is a bucket alone)


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


class Buckets:
    """The policy cut into buckets of whole tensors in order, at most bucket_bytes of fp32 each (a tensor
    larger than that is a bucket of its own), and one staging buffer of the largest bucket, allocated once:

        plan[i] = [(name, shape, offset), ...]    offsets in elements into the bucket's buffer

    `fill` walks the buckets: each tensor is gathered (a DTensor: its all-gather on the trainer's mesh,
    every rank in the same order), copied into the buffer and dropped; the buffer is sent, then reused.
    So a push holds the rank's own shards, one bucket and one gathered tensor in flight, never the policy."""

    def __init__(self, named_shapes, bucket_bytes=BUCKET_BYTES):
        self.plan, size = [[]], 0
        for name, shape in named_shapes:
            k = torch.Size(shape).numel()
            if self.plan[-1] and (size + k) * 4 > bucket_bytes:
                self.plan.append([])
                size = 0
            self.plan[-1].append((name, tuple(shape), size))
            size += k
        self.sizes = [off + torch.Size(shape).numel() for *_, (_, shape, off) in self.plan]  # elements per bucket
        self.numel, self.bucket_bytes = sum(self.sizes), bucket_bytes
        self.flat = torch.empty(max(self.sizes), dtype=torch.float32)

    @torch.no_grad()
    def fill(self, named_params):
        """Yield (plan entries, the filled buffer's view) bucket by bucket."""
        params = iter(named_params)
        for entries, n in zip(self.plan, self.sizes):
            for name, shape, off in entries:
                got, p = next(params, (None, None))
                if got != name or tuple(p.shape) != shape:
                    raise SyncError(f"the trainer's parameters changed: {got} where {name} {shape} was at start")
                self.flat[off:off + p.numel()].view(shape).copy_(full(p.detach()))  # (the gathered copy: freed here)
            yield entries, self.flat[:n]

    def receive(self, params, get):
        """The engine's side: for each bucket, `get(buffer)` fills it; copied into `params` in place."""
        params = iter(params)
        for entries, n in zip(self.plan, self.sizes):
            get(self.flat[:n])
            for _, shape, off in entries:
                next(params).copy_(self.flat[off:off + torch.Size(shape).numel()].view(shape))


class Sender:
    """The trainer's side. `send` runs on every trainer rank (gathering shards is collective on the
    trainer's mesh); only the rank given `pg` (trainer rank 0) broadcasts to the engine, one bucket per
    broadcast."""

    def __init__(self, pg, named_params, bucket_bytes=BUCKET_BYTES):
        shapes = [(n, tuple(p.shape)) for n, p in named_params]
        self.pg, self.crc = pg, layout_crc(shapes)
        self.buckets = Buckets(shapes, bucket_bytes)

    @torch.no_grad()
    def send(self, named_params, version):
        """Push the weights as policy `version`; {"version", "bytes", "seconds"} (gather + broadcast)."""
        t0, b = time.perf_counter(), self.buckets
        try:
            if self.pg is not None:
                header = torch.tensor([version, b.numel, self.crc, b.bucket_bytes], dtype=torch.int64)
                self.pg.broadcast(header, 0).wait()
            for _, flat in b.fill(named_params):
                if self.pg is not None:
                    self.pg.broadcast(flat, 0).wait()
        except RuntimeError as e:  # gloo: the peer is gone or the timeout passed
            if isinstance(e, SyncError):
                raise
            raise SyncError(f"weight sync to the engine failed: {str(e).splitlines()[0]}") from None
        return {"version": version, "bytes": b.numel * 4, "seconds": time.perf_counter() - t0}


class Receiver:
    """The engine's side: receives bucket by bucket into one staging buffer, copied into the model's
    parameters in place."""

    def __init__(self, pg, model):
        self.pg = pg
        self.named = [(n, p) for n, p in model.named_parameters()]
        self.crc = layout_crc([(n, tuple(p.shape)) for n, p in self.named])
        self.numel = sum(p.numel() for _, p in self.named)
        self.ptrs = [p.data_ptr() for _, p in self.named]
        self.buckets = None  # (planned at the first push: the trainer's bucket size is in its header)
        self.version = -1

    @torch.no_grad()
    def recv(self):
        """Receive one sync; the new policy version."""
        header = torch.zeros(4, dtype=torch.int64)
        self.pg.broadcast(header, 0).wait()
        version, numel, crc, bucket_bytes = header.tolist()
        if (numel, crc) != (self.numel, self.crc):
            raise SyncError(f"the trainer sends {numel} elements (layout crc {crc}), this engine's model has "
                            f"{self.numel} (crc {self.crc}): not the same architecture")
        if self.buckets is None or self.buckets.bucket_bytes != bucket_bytes:
            self.buckets = Buckets([(n, p.shape) for n, p in self.named], bucket_bytes)
        self.buckets.receive([p for _, p in self.named], lambda buf: self.pg.broadcast(buf, 0).wait())
        if [p.data_ptr() for _, p in self.named] != self.ptrs:
            raise SyncError("a parameter was reallocated during the sync")
        self.version = version
        return version
