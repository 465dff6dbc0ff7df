"""run/checkpoint.py: atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

DCP writes each rank's shards in parallel, so the same code serves one process and a sharded
(SimpleFSDP) run; XLA SPMD writes its devices' shards through its own planners (spmd_checkpoint.py).
A checkpoint is loaded on the mesh it was saved on; another layout (one process, a torchrun mesh, XLA
SPMD) only with --allow-change mesh, and DCP reshards it on load.

The write protocol, in order (a crash between any two steps leaves the previous checkpoint usable):
  1. DCP writes every rank's files into `step_N.tmp/` (a failed write removes it again);
  2. rank 0 writes `meta.json` there: the model config, the training config, and a sha256 of every
     file DCP wrote (so a flipped or truncated byte is found at resume, not as a NaN loss later);
  3. `step_N.tmp` is renamed to `step_N` (atomic on POSIX): a `step_N` directory is always complete;
  4. the one-line `latest` file is replaced (os.replace, atomic) to name `step_N`.
`latest` is a hint for people and tools; resuming trusts the directories: it takes the newest
`step_N` and verifies it, so a missing or garbage `latest` cannot hide the checkpoints.
"""
import copy
import json
import os
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import layer_scan
import task
from atomic import fsync, replace_dir, sha256_of, write
from errors import BadInput, WriteFailed, interrupted, peer_failure


class CheckpointError(BadInput):
    """A checkpoint that cannot be used (broken, another model, another config): one line, exit 2."""


class CheckpointWriteError(WriteFailed):
    """Writing a checkpoint failed (disk full, size limit): partial files removed, previous kept."""


# DCP's notes for single-process use and its internal TypedStorage call: expected, not actionable.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")

STEP_DIR = re.compile(r"^step_(\d+)$")


def _rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dirs(ckpt_dir):
    """Complete checkpoint directories, newest first: [(step, path)]."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_dir, name))
             for name in os.listdir(ckpt_dir) if (m := STEP_DIR.match(name))]
    return sorted(found, reverse=True)


def holds_checkpoints(ckpt_dir):
    return bool(step_dirs(ckpt_dir)) or os.path.exists(os.path.join(ckpt_dir, "latest"))


def save(ckpt_dir, step, state, meta, shards=None):
    """Write `state` (a nested dict of tensors / picklable values) as checkpoint `step`, atomically:
    the four steps of the protocol in the module docstring, one function each. Tensors are copied to
    the host first (to_cpu), unless the layout writes them shard by shard from its devices
    (`shards`, Parallel.checkpoint_shards: spmd_checkpoint.DeviceShards)."""
    if shards is not None:
        shards.place(state)
    state, planner = (to_cpu(state), None) if shards is None else (state, shards.save_planner())
    name = f"step_{step:06d}"
    final, tmp = os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, name + ".tmp")
    if _rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed write
    _barrier()
    try:
        write_shards(tmp, state, planner)                     # 1.
        _barrier()
        if _rank() == 0:
            _write_meta(tmp, dict(meta, step=step))            # 2.
    except BaseException as e:  # disk full, size limit, I/O error, a dead peer, SIGINT / SIGTERM
        shutil.rmtree(tmp, ignore_errors=True)  # leave nothing half-written behind
        if isinstance(e, dist.DistError) or peer_failure(e) or interrupted(e) or \
                not isinstance(e, (Exception, dcp.api.CheckpointException)):  # (DCP's is a BaseException)
            raise  # interrupted, or a peer died mid-save: run/process.py's own one-line errors
        raise _write_error(ckpt_dir, name, e) from None
    if _rank() == 0:
        _commit(tmp, final)                                    # 3.
        point_latest(ckpt_dir, name)                          # 4.
    _barrier()
    return final


def write_shards(tmp, state, planner=None):
    # per_thread_copy_ahead=0: our state is already on the host; it also keeps DCP off its
    # stream-overlapping loader, which breaks once torchax (imported by call_jax) claims PrivateUse1.
    # A layout's planner (XLA SPMD) writes a file per shard: torch.save into one open file keeps what it
    # wrote in host memory until the file closes (measured, torch 2.9), which would be the whole state.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, per_thread_copy_ahead=0, single_file_per_rank=planner is None),
             planner=planner)


def _write_meta(tmp, meta):
    files = {f: sha256_of(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
    path = os.path.join(tmp, "meta.json")
    with open(path, "w") as f:  # (inside step_N.tmp/: the directory's rename is what commits it)
        json.dump(dict(meta, files=files), f)
    fsync(path)


def _commit(tmp, final):
    replace_dir(tmp, final)  # (a `final` already there: a re-run of its step, resumed from an older checkpoint)


def point_latest(ckpt_dir, name):
    write(os.path.join(ckpt_dir, "latest"), name, durable=True)


def _write_error(ckpt_dir, name, e):
    reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
    if "unexpected pos" in reason or "file write failed" in reason:  # torch.save's short-write check
        reason = "a short write: the disk is full or a file-size limit was hit"
    free = shutil.disk_usage(ckpt_dir).free / 2**20 if os.path.isdir(ckpt_dir) else float("nan")
    kept = step_dirs(ckpt_dir)
    return CheckpointWriteError(f"writing checkpoint {name} failed ({reason}; {free:.0f} MiB free on that "
                                f"disk); the partial files were removed, "
                                f"{os.path.basename(kept[0][1]) if kept else 'no earlier checkpoint'} is kept")


def read_meta(path):
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, 'meta.json')} is missing or unreadable "
                              f"({type(e).__name__})") from None


def verify(path):
    """None if every file of checkpoint `path` is there with the checksum meta.json recorded, else
    the first problem found, naming the file."""
    try:
        files = read_meta(path)["files"]
    except CheckpointError as e:
        return str(e)
    except (KeyError, TypeError):
        return f"{os.path.join(path, 'meta.json')} records no checksums"
    for name, digest in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{full} is missing"
        if sha256_of(full) != digest:
            return f"{full} does not match its checksum (corrupt or truncated)"
    return None


def newest_verified(paths, instead, fall_back=False):
    """(path, problem): the first of `paths` (checkpoints, newest first) and None if it verifies. If not:
    with `fall_back`, the newest one that verifies and the first one's problem; else refused in one line
    naming its problem and the newest one that verifies, with `instead(good)`: how to use that one instead."""
    problem = verify(paths[0])
    if not problem:
        return paths[0], None
    good = next((p for p in paths[1:] if verify(p) is None), None)
    if good and fall_back:
        return good, problem
    raise CheckpointError(f"checkpoint {paths[0]} is broken: {problem}; "
                          f"{instead(good) if good else 'no good checkpoint remains'}")


def newest_name(ckpt_dir):
    """The newest complete checkpoint's directory name, or None (for one-line error messages)."""
    found = step_dirs(ckpt_dir)
    return os.path.basename(found[0][1]) if found else None


def load(path, state, planner=None):
    """Fill `state` (same structure as saved, tensors preallocated) in place from `path` (through a
    layout's DCP `planner`, if it has one: spmd_checkpoint.py)."""
    try:
        dcp.load(state, checkpoint_id=path, planner=planner)
    except (Exception, dcp.api.CheckpointException) as e:  # verified files DCP still cannot read (written by
        # another version, or a state of other names: a model of another layout). DCP's CheckpointException
        # is a BaseException, which `except Exception` would let through as a traceback.
        if isinstance(e, dist.DistError) or peer_failure(e) or interrupted(e):
            raise  # a dead peer, SIGINT / SIGTERM mid-load: run/process.py's own lines
        raise CheckpointError(f"checkpoint {path} could not be loaded ({str(e).strip().splitlines()[-1][:200]})") from None
    return state


def load_into(path, live, shards=None):
    """Fill the live state (the trainer's own tensors, in the nested dict it saves) from `path` in
    place: DCP reads into host copies (to_cpu), each then copied into its live tensor, unless the
    layout reads into its devices shard by shard (`shards`, as in `save`)."""
    if shards is not None:
        shards.place(live)
    host = load(path, to_cpu(live), None) if shards is None else load(path, live, shards.load_planner())

    def copy_into(live_tree, host_tree):
        for key, value in live_tree.items():
            if isinstance(value, dict):
                copy_into(value, host_tree[key])
            elif isinstance(value, torch.Tensor) and host_tree[key] is not value:
                value.copy_(host_tree[key])
    with torch.no_grad():
        copy_into(live, host)
    if shards is not None:
        shards.place(live)
    return live


# ------------------------------------------------------------------------------------------------
# A run's checkpoint as a model (generate.py samples from it, python -m interop.hf exports it)

def run_checkpoint(path):
    """(checkpoint directory, its meta.json) to sample from: `path` is a train.py run directory (its
    newest checkpoint) or one of its checkpoints `step_N` (an older one, e.g. when the newest is
    broken). It must verify: a broken one is refused, naming the newest good one to pass instead."""
    found = step_dirs(os.path.join(path, "checkpoints"))
    if found:
        chosen, older = found[0][1], [p for _, p in found[1:]]
    elif os.path.isdir(path) and (STEP_DIR.match(os.path.basename(os.path.normpath(path)))
                                  or os.path.isfile(os.path.join(path, "meta.json"))):
        chosen, older = path, []
    else:
        raise CheckpointError(f"{path} holds no checkpoint to read (give a run directory "
                                         f"or one of its checkpoints/step_N)")
    chosen, _ = newest_verified([chosen, *older], lambda good: f"the newest good one is {good}: pass it in place of {path}")
    return chosen, read_meta(chosen)


def overlaps_run(path, source):
    """True where a directory written whole at `path` would replace part of the run `source` (a run
    directory or one of its checkpoints, as run_checkpoint takes): the run's directory or one above
    it, or its checkpoints directory or anything in it."""
    out, run = os.path.realpath(path), os.path.realpath(source)
    ckpt_dir = next((d for d in (run, os.path.dirname(run)) if os.path.basename(d) == "checkpoints"),
                    os.path.join(run, "checkpoints"))
    inside = lambda a, b: os.path.commonpath([a, b]) == b  # noqa: E731  (a is b, or below it)
    return inside(run, out) or inside(ckpt_dir, out) or inside(out, ckpt_dir)


def load_run(path, device="cpu", kind=None):
    """(model, meta) of a run's newest verified checkpoint, or of the checkpoint directory `path`, built
    by the model family of the workload that trained it (task.WORKLOADS; its `from_record`), also one
    saved sharded or stacked by --scan. `kind`: the kind of model the caller can use (ModelFamily.kind,
    e.g. "a language model"); a run of another kind is refused in one line that names what it is."""
    chosen, meta = run_checkpoint(path)
    name = meta.get("task", "lm")
    if name not in task.WORKLOADS:
        raise CheckpointError(f"{chosen} was trained by --task {name!r}, unknown to this version")
    cls = task.workload_class(name).family_class
    if kind is not None and cls.kind != kind:
        raise CheckpointError(f"{path} is a {name} run (--task {name}: {cls.kind}), not {kind}")
    where = os.path.join(chosen, "meta.json")
    made = cls.from_record(meta, where)
    try:
        model = made.build(made.args)
    except (TypeError, ValueError) as e:  # a value of the wrong type or out of range
        raise CheckpointError(f"{where}: model_args describe no model "
                              f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    if meta.get("layers") != "stacked":
        model.load_state_dict(load(chosen, {"model": model.state_dict()})["model"])
        return model.to(device), meta
    stacked = copy.deepcopy(model)  # saved with --scan: load the stacked layout, then copy it out
    stacked_pairs, plain_pairs = made.scan_stacks(stacked), made.scan_stacks(model)
    layer_scan.stack_layers(stacked, stacked_pairs)
    stacked.load_state_dict(load(chosen, {"model": stacked.state_dict()})["model"])
    layer_scan.unstack_into(stacked_pairs, plain_pairs)
    plain = model.state_dict()
    with torch.no_grad():  # the rest (embeddings, norms, heads) is named alike in both
        for name, tensor in stacked.state_dict().items():
            if name in plain:
                plain[name].copy_(tensor)
    return model.to(device), meta


def to_cpu(tree):
    """Host copies of a nested dict/list of tensors (XLA tensors cannot be written by DCP directly)."""
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [to_cpu(v) for v in tree]
    if isinstance(tree, torch.Tensor) and tree.device.type not in ("cpu", "meta"):
        return tree.detach().cpu()
    return tree
