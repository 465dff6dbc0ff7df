"""spmd_checkpoint.py: XLA SPMD checkpoints written and read shard by shard, in DCP's own format.

Under SPMD (spmd.py) a parameter is one global XLA tensor whose pieces live on the devices; copying
it to the host whole (`tensor.cpu()`) builds the whole tensor, and doing that for the model's state
builds the whole model in host memory: what a pod host cannot hold. torch_xla ships DCP planners for
this (torch_xla.experimental.distributed_checkpoint, SPMDSavePlanner / SPMDLoadPlanner, as torchprime
uses); on torch 2.9 with torch_xla 2.9 (XLA:CPU) its save planner wrote a checkpoint whose metadata
lacked the sharded tensors (tried here), so these two planners are our own, on the same idea and the
same torch_xla calls:

  save   every XLA tensor of the state is described to DCP as the distinct shards this process's
         devices hold (`_get_local_shard_replica_and_indices`: replicas over dcn share offsets and are
         written once); a shard's data is copied to the host only when DCP asks for it, one tensor's
         shards at a time. DCP's metadata records each shard as a chunk of the global tensor, the same
         format a torchrun DTensor checkpoint has, so one process or any torchrun layout reads it
         (DCP reshards on load: resume.check_compatible lets the mesh change with --allow-change mesh).
  load   each distinct local shard is a host buffer DCP reads into (from whatever chunks the files
         hold: another layout's); when a tensor's shards are complete they are loaded into the live
         sharded tensor on its devices (`_load_local_shards`, the partition spec kept) and dropped; a
         replicated tensor (whole on every device anyway) is copied in whole.

On a pod each host's process holds only its addressable devices' shards, and DCP's global plan keeps
one copy of shards that several hosts hold; that needs a process group beside SPMD (not run here:
one host, XLA:CPU; docs/tpu.md).
"""
import math

import torch
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_load_plan)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import device as dev


def _is_xla(t):
    return isinstance(t, torch.Tensor) and dev.is_xla(t.device)


def distinct_shards(t):
    """[(offsets, sizes, [local device positions holding it])] of XLA tensor `t`, each distinct shard once
    (a replicated tensor: one shard, the whole)."""
    import torch_xla
    found = {}
    for pos, (_, indices) in enumerate(torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]):
        box = [(0, n) for n in t.shape] if indices is Ellipsis else [(s.start, s.stop) for s in indices]
        key = tuple(box)
        found.setdefault(key, []).append(pos)
    return [(torch.Size(a for a, _ in box), torch.Size(b - a for a, b in box), where) for box, where in found.items()]


class DeviceShards:
    """What checkpoint.save / load_into need from XLA SPMD: the two planners below, and `place(state)`,
    which gives every tensor of the trainer's state keyed by a parameter's name (the weights, AdamW's
    moments) that parameter's partition spec. run/checkpoint.py places the state before a save (an in-place
    update can leave a tensor without its spec) and before and after a load (a copy from the host
    leaves a tensor replicated)."""

    def __init__(self, mark_sharding, spec_of_name):
        self.mark_sharding, self.spec_of_name = mark_sharding, spec_of_name

    @staticmethod
    def save_planner():
        return SaveShards()

    @staticmethod
    def load_planner():
        return LoadShards()

    def place(self, tree):
        for key, value in tree.items():
            if isinstance(value, dict):
                self.place(value)
            elif key in self.spec_of_name:
                self.mark_sharding(value, self.spec_of_name[key])


class SaveShards(DefaultSavePlanner):
    """DCP save planner: XLA tensors as their distinct shards, each copied to the host when written."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.xla = {k: v for k, v in self.state_dict.items() if _is_xla(v)}
        self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self.xla}

    def create_local_plan(self):
        plan = super().create_local_plan()
        for fqn, t in self.xla.items():
            props = TensorProperties(dtype=t.dtype)
            plan.items.extend(WriteItem(index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
                                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                                    properties=props, size=t.size()))
                              for i, (offsets, sizes, _) in enumerate(distinct_shards(t)))
        self.plan = plan
        return plan

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        if fqn not in self.xla:
            return super().resolve_data(write_item)
        import gc
        import torch_xla
        # (DCP's writer leaves the shards it wrote in reference cycles: free them before the next. The
        # young generations suffice, measured: a full collection per shard walked the whole heap, minutes
        # a save (3+ min for FLUX's 455 shards); the young ones: the same 8.8 MB peak on a 154 MB state)
        gc.collect(1)
        t = self.xla[fqn]
        offsets, sizes, where = distinct_shards(t)[write_item.index.index]
        data, _ = torch_xla._XLAC._get_local_shards([t])[0][where[0]]  # (this tensor's shards only)
        return data[tuple(slice(0, n) for n in sizes)].clone()  # (a shard may be padded at the end)


class LoadShards(DefaultLoadPlanner):
    """DCP load planner: reads into host buffers, one per distinct local shard of each XLA tensor, and
    loads a tensor's shards into its devices as soon as they are all read."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.xla = {k: v for k, v in self.state_dict.items() if _is_xla(v)}
        self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self.xla}
        self.buffers, self.pending = {}, {}

    def create_local_plan(self):
        # (not super(): DefaultLoadPlanner takes the XLA keys missing from self.state_dict for a pre-2.4
        # checkpoint's names and plans them again, as whole tensors)
        plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        for fqn, t in self.xla.items():
            md = self.metadata.state_dict_metadata[fqn]
            if md.size != t.size():
                raise ValueError(f"Size mismatch between saved {md.size} and current: {t.size()} for {fqn}")
            chunks = [ChunkStorageMetadata(o, s) for o, s, _ in distinct_shards(t)]
            plan.items.extend(create_read_items_for_chunk_list(fqn, md, chunks))
        return plan

    def lookup_tensor(self, index):
        fqn = index.fqn
        if fqn not in self.xla:
            return super().lookup_tensor(index)
        if fqn not in self.buffers:  # the first read of this tensor: its shards' host buffers
            shards = distinct_shards(self.xla[fqn])
            padded = [max(s[1][d] for s in shards) for d in range(self.xla[fqn].dim())]
            self.buffers[fqn] = [(torch.zeros(padded, dtype=self.xla[fqn].dtype), sizes, where)
                                 for _, sizes, where in shards]
            self.pending[fqn] = sum(math.prod(sizes) for _, sizes, _ in shards)
        buf, sizes, _ = self.buffers[fqn][index.index]
        return buf[tuple(slice(0, n) for n in sizes)]

    def commit_tensor(self, read_item, tensor):
        fqn = read_item.dest_index.fqn
        if fqn not in self.xla:
            return super().commit_tensor(read_item, tensor)
        self.pending[fqn] -= math.prod(read_item.lengths)
        if self.pending[fqn] == 0:
            import torch_xla
            t = self.xla[fqn]
            if torch_xla._XLAC._get_xla_sharding_spec(t) in ("", "{replicated}"):  # whole on every device
                t.copy_(self.buffers.pop(fqn)[0][0])  # (torch_xla refuses to load a replicated one by shards)
                return
            devices = torch_xla._XLAC._xla_get_runtime_devices()
            per_device = [None] * len(devices)
            for buf, _, where in self.buffers.pop(fqn):
                for pos in where:
                    per_device[pos] = buf
            torch_xla._XLAC._load_local_shards(t, per_device, devices)
