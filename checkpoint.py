"""checkpoint.py: atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

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


def save(ckpt_dir, step, state, meta, planner=None):
    """Write `state` (a nested dict of tensors / picklable values) as checkpoint `step`, atomically:
    the four steps of the protocol in the module docstring, one function each. Tensors are copied to
    the host first (to_cpu), unless a layout's DCP `planner` copies them shard by shard (spmd_checkpoint.py)."""
    state = state if planner is not None else to_cpu(state)
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
            raise  # interrupted, or a peer died mid-save: process.py's own one-line errors
        raise _write_error(ckpt_dir, name, e) from None
    if _rank() == 0:
        _commit(tmp, final)                                    # 3.
        _point_latest(ckpt_dir, name)                          # 4.
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


def _point_latest(ckpt_dir, name):
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


def find_resumable(ckpt_dir, fall_back=False):
    """(path, note) of the newest checkpoint to resume from, or (None, note) if there is none.

    The newest `step_N` must verify: if it does not, the run is refused with the newest good one
    named (resume from it explicitly with --resume-from), rather than silently going back in time.
    `fall_back` (--resume auto: a restart nobody watches) takes that good one instead, saying so in
    the note; the trainer then sets the broken newer ones aside (set_aside_newer), as --resume-from
    does. With no good one left it refuses all the same: starting over would overwrite them.
    """
    found = step_dirs(ckpt_dir)
    if not found:
        return None, f"no checkpoint in {ckpt_dir}: starting at step 0"
    newest, problem = newest_verified([p for _, p in found], lambda good: f"the newest good checkpoint is {good}: "
                                      f"pass --resume-from {os.path.basename(good)}", fall_back)
    if problem:
        return newest, (f"checkpoint {found[0][1]} is broken: {problem}; --resume auto resumes from the newest good "
                        f"one, {os.path.basename(newest)} (the newer ones are set aside as *.superseded)")
    note = None
    try:
        with open(os.path.join(ckpt_dir, "latest"), encoding="utf-8") as f:
            pointer = f.read().strip()
    except (OSError, UnicodeDecodeError):
        pointer = None
    if pointer != os.path.basename(newest):
        note = (f"{os.path.join(ckpt_dir, 'latest')} is missing or does not name the newest checkpoint; "
                f"resuming from {os.path.basename(newest)}, which verifies")
    return newest, note


def choose(ckpt_dir, resume, resume_from, meta, allow_change=(), refusal=lambda key, saved, now: None):
    """(checkpoint to resume from or None, a note or None), refusing what would lose data or silently
    change the run: checkpoints without --resume, a broken newest one (--resume auto: the newest good
    one), another model, mesh, layout or training config, a checkpoint already at or past --steps.
    `resume`: None, "newest" (--resume) or "auto"."""
    path, note = resume_path(ckpt_dir, resume, resume_from)
    if path is not None:
        check_compatible(path, meta, allow_change, refusal, complete_ok=resume == "auto")
    return path, note


def resume_path(ckpt_dir, resume, resume_from):
    """(the checkpoint a resume takes or None, a note or None): the one decision of which, for `choose` and
    for what a workload reads of it before the trainer checks it (GRPO's recorded warm start)."""
    if not (resume or resume_from):
        if holds_checkpoints(ckpt_dir):
            raise CheckpointError(f"{os.path.dirname(ckpt_dir)} already holds checkpoints; pass --resume or "
                                  f"another --out-dir")
        return None, None
    return (resolve(ckpt_dir, resume_from), None) if resume_from else find_resumable(ckpt_dir, resume == "auto")


def resolve(ckpt_dir, name):
    """An explicitly named checkpoint (--resume-from): it must verify."""
    path = name if os.path.isdir(name) else os.path.join(ckpt_dir, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume-from {name}: no such checkpoint in {ckpt_dir}")
    problem = verify(path)
    if problem:
        raise CheckpointError(f"--resume-from {name}: {problem}")
    return path


def set_aside_newer(ckpt_dir, step):
    """Rename checkpoints newer than `step` to `step_N.superseded` (kept, not resumed from; a second
    time `.superseded.2`, ...), after `latest` names `step`: a crash half-way leaves a consistent
    directory, and doing it again is harmless (one process does it: train.py's writer)."""
    newer = [path for s, path in step_dirs(ckpt_dir) if s > step]
    if newer:
        _point_latest(ckpt_dir, f"step_{step:06d}")
    for path in newer:
        target, n = path + ".superseded", 1
        while os.path.exists(target):
            n += 1
            target = f"{path}.superseded.{n}"
        os.rename(path, target)


def newest_name(ckpt_dir):
    """The newest complete checkpoint's directory name, or None (for one-line error messages)."""
    found = step_dirs(ckpt_dir)
    return os.path.basename(found[0][1]) if found else None


class RunComplete(Exception):
    """--resume auto on a run whose newest checkpoint is its final one (a restart that came after the
    end): nothing to train, and nothing wrong. process.run says so in one line and exits 0."""


def check_compatible(path, meta, allow_change=(), refusal=lambda key, saved, now: None, complete_ok=False):
    """Refuse a checkpoint of another model, mesh, layer layout or training config (one-line reason).
    Training-config keys named in `allow_change` may differ (a deliberate change), unless the
    workload's `refusal(key, saved, now)` says why that change cannot be (Workload.resume_refusal).
    `complete_ok` (--resume auto): the run's own final checkpoint is RunComplete, not a refusal."""
    saved = read_meta(path)
    was, now = saved.get("task", "lm"), meta.get("task", "lm")  # (a record without one: an lm run's)
    if was != now:  # named first: every setting of the two workloads would differ, none --allow-change's
        raise CheckpointError(f"checkpoint {path} is from a --task {was} run, this run is --task {now}: a run "
                              f"resumes with its own workload (resume it with --task {was}, or give --task {now} "
                              f"another --out-dir)")
    for key in ("flavor", "model_args"):
        if saved.get(key) != meta.get(key):
            raise CheckpointError(f"checkpoint {path} is from another model ({key}: saved "
                                  f"{saved.get(key)!r}, this run {meta.get(key)!r})")
    if saved.get("mesh") != meta.get("mesh") and "mesh" not in allow_change:  # (DCP reshards on load)
        raise CheckpointError(f"checkpoint {path} was saved on mesh {saved.get('mesh')!r}, this run "
                              f"uses {meta.get('mesh')!r} (pass --allow-change mesh to reshard it on load)")
    if saved.get("layers", "per-layer") != meta.get("layers", "per-layer"):  # parameter names differ
        raise CheckpointError(f"checkpoint {path} holds {saved.get('layers', 'per-layer')} layer weights, this "
                              f"run {meta.get('layers', 'per-layer')}: resume with{'out' if meta.get('layers') else ''} --scan")
    old, new = saved.get("train", {}), meta.get("train", {})
    if saved.get("step", 0) >= new.get("steps", float("inf")):
        if complete_ok and saved.get("step") == new["steps"] == old.get("steps"):
            raise RunComplete(f"{path} is the run's final checkpoint (step {saved['step']} of --steps "
                              f"{new['steps']}): the run is complete, nothing to train")
        raise CheckpointError(f"{path} is at step {saved.get('step')}, --steps is {new['steps']}: nothing to "
                              f"train (raise --steps, with --allow-change steps)")
    diffs = []  # (name, saved, now); a record of settings (grpo's, sft's) differs setting by setting, each
    for k in new:  # named as its flag, so that the --allow-change offered is one cli.py accepts
        if old.get(k) == new[k]:
            continue
        if isinstance(old.get(k), dict) and isinstance(new[k], dict):
            diffs += [(f, old[k].get(f), new[k].get(f)) for f in sorted({**old[k], **new[k]})
                      if old[k].get(f) != new[k].get(f)]
        else:
            diffs.append((k, old.get(k), new[k]))
    fixed = [(d, refusal(*d)) for d in diffs]
    fixed = [(d, why) for d, why in fixed if why]
    if fixed:  # not a deliberate change: the checkpoint would not fit the run (or not resume exactly)
        what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for (k, a, b), _ in fixed)
        raise CheckpointError(f"--resume with a different training config ({what}): "
                              f"{' and '.join(sorted({why for _, why in fixed}))}; it cannot change on a resume")
    changed = [d for d in diffs if d[0] not in allow_change]
    if changed:
        what = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in changed)
        raise CheckpointError(f"--resume with a different training config ({what}); pass "
                              f"--allow-change {','.join(k for k, _, _ in changed)} to continue with the new values")
    return saved


def load(path, state, planner=None):
    """Fill `state` (same structure as saved, tensors preallocated) in place from `path` (through a
    layout's DCP `planner`, if it has one: spmd_checkpoint.py)."""
    try:
        dcp.load(state, checkpoint_id=path, planner=planner)
    except (Exception, dcp.api.CheckpointException) as e:  # verified files DCP still cannot read (written by
        # another version, or a state of other names: a model of another layout). DCP's CheckpointException
        # is a BaseException, which `except Exception` would let through as a traceback.
        if isinstance(e, dist.DistError) or peer_failure(e) or interrupted(e):
            raise  # a dead peer, SIGINT / SIGTERM mid-load: process.py's own lines
        raise CheckpointError(f"checkpoint {path} could not be loaded ({str(e).strip().splitlines()[-1][:200]})") from None
    return state


# ------------------------------------------------------------------------------------------------
# A run's checkpoint as a model (generate.py samples from it, hf.py exports it)

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
