"""run/resume.py: may this checkpoint resume this run? The one home of that decision.

A run records what it is in each checkpoint's meta.json (`run_record`): its workload, model, mesh, layer
layout and training settings. A resume (--resume, --resume auto, --resume-from) takes a checkpoint that
verifies (`resume_path`), then refuses it if it is another run (`check_compatible`), in one line:

  - another --task, model or layer layout: never (the weights would not fit);
  - another mesh: only with --allow-change mesh (DCP reshards on load);
  - another shared setting (RESUME_CHECKED), or a model setting that leaves the weights as they are
    (the family's `resume_settings`: ep's buffer factor): only with --allow-change NAME, a deliberate change;
  - another workload setting: as the workload's `resume_policy` says (task.py): True (with
    --allow-change), a reason it never may, or a function of (saved, now) giving one or None.

Without --resume, a directory that holds checkpoints is refused (starting over would overwrite them).
run/checkpoint.py writes, verifies and loads checkpoints; this file only decides which one, if any.
"""
import functools
import json
import os

from run import checkpoint
from run.checkpoint import CheckpointError
from errors import ConfigError

# What --resume compares with the checkpoint's run (changing one needs --allow-change NAME):
RESUME_CHECKED = ("seed", "batch_size", "grad_accum", "seq_len", "lr", "warmup", "clip", "weight_decay", "dtype", "steps")
RESHARD = "mesh"  # --allow-change mesh: resume on another layout (DCP reshards the checkpoint on load)
# (and what a workload's meta() records beside them, as its `resume_policy` says: task.py)


def run_record(cfg, workload, model_args, mesh_spec):
    """What a checkpoint records of the run (meta.json), and a resume must match (check_compatible)."""
    family = workload.family
    settings = {**{k: getattr(cfg, k) for k in RESUME_CHECKED},
                **{k: getattr(model_args, k) for k in family.resume_settings}, **workload.meta()}
    meta = {"flavor": family.label(), "task": cfg.task, "model_args": family.record(model_args),
            "mesh": mesh_spec, "train": settings}
    if cfg.scan:
        meta["layers"] = "stacked"
    if workload.eos_id is not None:  # (beside the settings: what ends a sample, not a resume's concern)
        meta["eos_id"] = workload.eos_id
    return json.loads(json.dumps(meta))  # as meta.json will hold it (tuples become lists), so it compares


def refusal_for(cls, key, saved, now):
    """Why a resume of workload class `cls` cannot change setting `key` from `saved` to `now`, not even
    with --allow-change (the checkpoint would not fit the run), or None: the shared settings may change,
    the workload's as its `resume_policy` says."""
    if key in RESUME_CHECKED or key in cls.family_class.resume_settings:
        return None
    rule = cls.resume_policy.get(key, "this version does not take a change of it")
    return None if rule is True else rule(saved, now) if callable(rule) else rule


def changeable(cls):
    """What --allow-change may name for workload class `cls` (a refusal never offers another)."""
    return (RESUME_CHECKED + cls.family_class.resume_settings + (RESHARD,)
            + tuple(k for k, rule in cls.resume_policy.items() if not isinstance(rule, str)))


def check_allow_change(allow_change, cls):
    """--allow-change NAMES names only what may change (cli.validate: before anything is read)."""
    unknown = set(filter(None, allow_change.split(","))) - set(changeable(cls))
    if unknown:
        raise ConfigError(f"--allow-change {allow_change!r}: unknown {sorted(unknown)}; choose from "
                          f"{', '.join(changeable(cls))}")


def choose(ckpt_dir, cfg, meta, cls):
    """(checkpoint to resume from or None, a note or None) for the run `cfg` of workload class `cls`,
    whose record is `meta`, refusing what would lose data or silently change the run: checkpoints without
    --resume, a broken newest one (--resume auto: the newest good one), another model, mesh, layout or
    training config, a checkpoint already at or past --steps."""
    path, note = resume_path(ckpt_dir, cfg.resume, cfg.resume_from)
    if path is not None:
        check_compatible(path, meta, set(cfg.allow_change.split(",")), functools.partial(refusal_for, cls),
                         complete_ok=cfg.resume == "auto")
    return path, note


def find_resumable(ckpt_dir, fall_back=False):
    """(path, note) of the newest checkpoint to resume from, or (None, note) if there is none.

    The newest `step_N` must verify: if it does not, the run is refused with the newest good one
    named (resume from it explicitly with --resume-from), rather than silently going back in time.
    `fall_back` (--resume auto: a restart nobody watches) takes that good one instead, saying so in
    the note; the trainer then sets the broken newer ones aside (set_aside_newer), as --resume-from
    does. With no good one left it refuses all the same: starting over would overwrite them.
    """
    found = checkpoint.step_dirs(ckpt_dir)
    if not found:
        return None, f"no checkpoint in {ckpt_dir}: starting at step 0"
    newest, problem = checkpoint.newest_verified(
        [p for _, p in found], lambda good: f"the newest good checkpoint is {good}: pass --resume-from "
                                            f"{os.path.basename(good)}", fall_back)
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


def resume_path(ckpt_dir, resume, resume_from):
    """(the checkpoint a resume takes or None, a note or None): the one decision of which, for `choose` and
    for what a workload reads of it before the trainer checks it (GRPO's recorded warm start)."""
    if not (resume or resume_from):
        if checkpoint.holds_checkpoints(ckpt_dir):
            raise CheckpointError(f"{os.path.dirname(ckpt_dir)} already holds checkpoints; pass --resume or "
                                  f"another --out-dir")
        return None, None
    return (resolve(ckpt_dir, resume_from), None) if resume_from else find_resumable(ckpt_dir, resume == "auto")


def resolve(ckpt_dir, name):
    """An explicitly named checkpoint (--resume-from): it must verify."""
    path = name if os.path.isdir(name) else os.path.join(ckpt_dir, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume-from {name}: no such checkpoint in {ckpt_dir}")
    problem = checkpoint.verify(path)
    if problem:
        raise CheckpointError(f"--resume-from {name}: {problem}")
    return path


def set_aside_newer(ckpt_dir, step):
    """Rename checkpoints newer than `step` to `step_N.superseded` (kept, not resumed from; a second
    time `.superseded.2`, ...), after `latest` names `step`: a crash half-way leaves a consistent
    directory, and doing it again is harmless (one process does it: the run's writer)."""
    newer = [path for s, path in checkpoint.step_dirs(ckpt_dir) if s > step]
    if newer:
        checkpoint.point_latest(ckpt_dir, f"step_{step:06d}")
    for path in newer:
        target, n = path + ".superseded", 1
        while os.path.exists(target):
            n += 1
            target = f"{path}.superseded.{n}"
        os.rename(path, target)


class RunComplete(Exception):
    """--resume auto on a run whose newest checkpoint is its final one (a restart that came after the
    end): nothing to train, and nothing wrong. process.run says so in one line and exits 0."""


def check_compatible(path, meta, allow_change=(), refusal=lambda key, saved, now: None, complete_ok=False):
    """Refuse a checkpoint of another model, mesh, layer layout or training config (one-line reason).
    Training-config keys named in `allow_change` may differ (a deliberate change), unless the
    workload's `refusal(key, saved, now)` says why that change cannot be (refusal_for).
    `complete_ok` (--resume auto): the run's own final checkpoint is RunComplete, not a refusal."""
    saved = checkpoint.read_meta(path)
    was, now = saved.get("task", "lm"), meta.get("task", "lm")  # (a record without one: an lm run's)
    if was != now:  # named first: every setting of the two workloads would differ, none --allow-change's
        raise CheckpointError(f"checkpoint {path} is from a --task {was} run, this run is --task {now}: a run "
                              f"resumes with its own workload (resume it with --task {was}, or give --task {now} "
                              f"another --out-dir)")
    old, new = saved.get("train", {}), meta.get("train", {})
    moved = saved.get("model_args")  # (a version that recorded a resume setting among the model's: read it there)
    if isinstance(moved, dict) and isinstance(old, dict):
        for k in set(moved) & (set(new) - set(meta.get("model_args") or ())):
            old.setdefault(k, moved.pop(k))
    for key in ("flavor", "model_args"):
        was, now = saved.get(key), meta.get(key)
        if was != now:
            if isinstance(was, dict) and isinstance(now, dict):  # the fields that differ, not two whole configs
                differ = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
                was, now = [{k: d.get(k) for k in differ} for d in (was, now)]
            raise CheckpointError(f"checkpoint {path} is from another model ({key}: saved {was!r}, this run {now!r})")
    if saved.get("mesh") != meta.get("mesh") and "mesh" not in allow_change:  # (DCP reshards on load)
        layout = lambda mesh: f"mesh {mesh!r}" if mesh else "one device (no --mesh)"
        raise CheckpointError(f"checkpoint {path} was saved on {layout(saved.get('mesh'))}, this run uses "
                              f"{layout(meta.get('mesh'))} (pass --allow-change mesh to reshard it on load)")
    if saved.get("layers", "per-layer") != meta.get("layers", "per-layer"):  # parameter names differ
        raise CheckpointError(f"checkpoint {path} holds {saved.get('layers', 'per-layer')} layer weights, this "
                              f"run {meta.get('layers', 'per-layer')}: resume with{'out' if meta.get('layers') else ''} --scan")
    if saved.get("step", 0) >= new.get("steps", float("inf")):
        if complete_ok and saved.get("step") == new["steps"] == old.get("steps"):
            raise RunComplete(f"{path} is the run's final checkpoint (step {saved['step']} of --steps "
                              f"{new['steps']}): the run is complete, nothing to train")
        raise CheckpointError(f"{path} is at step {saved.get('step')}, --steps is {new['steps']}: nothing to "
                              f"train (raise --steps, with --allow-change steps)")
    diffs = []  # (name, saved, now); a record of settings (grpo's, sft's) differs setting by setting, each
    for k in new:  # named as its flag, so that the --allow-change offered is one run/cli.py accepts
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
