"""checkpoint.py: atomic checkpoints with torch.distributed.checkpoint (DCP).

DCP writes each rank's shards in parallel and reshards on load, so the same code serves one process
and a sharded (SimpleFSDP) run. Atomicity is ours: a checkpoint is written into `step_N.tmp`, renamed
to `step_N` only when complete, and only then does the one-line `latest` file (replaced with
os.replace, atomic on POSIX) point at it. A crash at any moment leaves `latest` naming the previous
complete checkpoint. meta.json records the model config so a checkpoint of another model is refused.
"""
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


class CheckpointError(ValueError):
    pass


# DCP's notes for single-process use and its internal TypedStorage call: expected, not actionable.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def latest(ckpt_dir):
    """Path of the newest complete checkpoint, or None."""
    pointer = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(ckpt_dir, f.read().strip())
    return path if os.path.isdir(path) else None


def save(ckpt_dir, step, state, meta):
    """Write `state` (a nested dict of tensors / picklable values) as checkpoint `step`, atomically."""
    name = f"step_{step:06d}"
    final, tmp = os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, name + ".tmp")
    if _rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed write
    _barrier()
    # per_thread_copy_ahead=0: our state is already on the host; it also keeps DCP off its
    # stream-overlapping loader, which breaks once torchax (imported by call_jax) claims PrivateUse1.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, per_thread_copy_ahead=0))
    _barrier()
    if _rank() == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(dict(meta, step=step), f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        pointer_tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(pointer_tmp, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, os.path.join(ckpt_dir, "latest"))
    _barrier()
    return final


def read_meta(path):
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def check_compatible(path, meta):
    """Refuse a checkpoint whose model config differs from this run's (one-line reason)."""
    saved = read_meta(path)
    for key in ("flavor", "model_args"):
        if saved.get(key) != meta.get(key):
            raise CheckpointError(f"checkpoint {path} is from another model ({key}: saved "
                                  f"{saved.get(key)!r}, this run {meta.get(key)!r})")
    for key in ("mesh",):
        if key in meta and saved.get(key, meta[key]) != meta[key]:
            raise CheckpointError(f"checkpoint {path} was saved on mesh {saved.get(key)!r}, this run "
                                  f"uses {meta[key]!r}")
    if saved.get("layers", "per-layer") != meta.get("layers", "per-layer"):  # parameter names differ
        raise CheckpointError(f"checkpoint {path} holds {saved.get('layers', 'per-layer')} layer weights, this "
                              f"run {meta.get('layers', 'per-layer')}: resume with{'out' if meta.get('layers') else ''} --scan")
    return saved


def load(path, state):
    """Fill `state` (same structure as saved, tensors preallocated) in place from `path`."""
    dcp.load(state, checkpoint_id=path)
    return state


def to_cpu(tree):
    """Host copies of a nested dict/list of tensors (XLA tensors cannot be written by DCP directly)."""
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [to_cpu(v) for v in tree]
    if isinstance(tree, torch.Tensor) and tree.device.type not in ("cpu", "meta"):
        return tree.detach().cpu()
    return tree
