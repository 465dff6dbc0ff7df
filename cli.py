"""cli.py: the training configuration as one typed dataclass, its command line, and its validation:
bad input becomes one `error:` line and exit code 2 before anything is touched.

Each field of `TrainConfig` is a shared flag (`batch_size` -> `--batch-size`), with its type, default
and help declared once, here. Each workload declares its own flags beside it (its `Flags` dataclass,
task.py) with its own checks (`check_flags`); `build_parser()` shows them as the workload's group, and
a flag of another workload than --task's is refused. Checks of one layer's flags live with that layer
(mesh.mesh_dims, fsdp_passes.chosen, parallel.layout_kind); this module calls them all, in one place.
"""
import argparse
import dataclasses
import math
import sys
import types
import typing
from typing import Optional

import fsdp_passes
import mesh
import parallel
import task as workloads
from errors import EXIT_BAD_INPUT, ConfigError, error_line

# What --resume compares with the checkpoint's run (changing one needs --allow-change NAME):
RESUME_CHECKED = ("seed", "batch_size", "seq_len", "lr", "warmup", "clip", "weight_decay", "dtype", "steps")
RESHARD = "mesh"  # --allow-change mesh: resume on another layout (DCP reshards the checkpoint on load)
# (and what a workload's meta() records beside them: its `resume_changeable`, task.py)


# `--set FIELD=VALUE`: a model config (model.ModelArgs, flux.FluxArgs) with fields replaced by name

def parse_as(kind, text):
    """`text` as the declared type of a config field: int, float, str, bool (true/false/1/0),
    tuple (comma-separated numbers, e.g. rope_scaling=8,1,4,8192); Optional[...] also takes 'none'."""
    if typing.get_origin(kind) is typing.Union:
        if text.lower() == "none":
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(text)
        return text.lower() in ("true", "1")
    if kind is tuple:
        return tuple(float(x) if any(c in x for c in ".eE") else int(x) for x in text.split(","))
    return kind(text)


def with_overrides(args, items):
    """A config dataclass (ModelArgs, flux.FluxArgs) with `FIELD=VALUE` strings applied (train.py
    --set), each parsed by its declared type."""
    kinds = typing.get_type_hints(type(args))
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in kinds:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(kinds)}")
        try:
            args = dataclasses.replace(args, **{key: parse_as(kinds[key], value)})
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not a {getattr(kinds[key], '__name__', kinds[key])}") from None
    return args


def flag(default, help, **argparse_kw):
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kw})


@dataclasses.dataclass
class TrainConfig:
    # what to train
    task: str = flag("lm", "workload: lm (language-model pretraining), flux (FLUX.1 diffusion on the digits or a "
                     "latent file), grpo (GRPO post-training on a verifiable task), sft (its warm start: the "
                     "answers' bytes only); the choices are task.WORKLOADS")
    flavor: Optional[str] = flag(None, "model flavor (model.FLAVORS, flux.FLAVORS; default: the task's debug flavor)")
    init_from: Optional[str] = flag(None, "start from a Hugging Face checkpoint (config.json + safetensors) "
                                    "instead of --flavor: fine-tuning; grpo: also a train.py run directory "
                                    "(its newest checkpoint: the warm start)", metavar="DIR")
    set: list = flag((), "override a model config field (ModelArgs, flux.FluxArgs), e.g. --set n_layers=2 "
                     "(repeatable)", metavar="FIELD=VALUE")
    # the optimization
    steps: int = flag(400, "optimizer steps")
    batch_size: int = flag(32, "global batch size, sequences")
    seq_len: int = flag(128, "tokens (bytes) per sequence")
    lr: float = flag(3e-3, "peak learning rate")
    warmup: int = flag(30, "linear warmup steps, then cosine decay to lr/10")
    clip: float = flag(1.0, "global gradient-norm clip (0: off)")
    weight_decay: float = flag(0.1, "AdamW decoupled weight decay (matrices only)")
    dtype: str = flag("fp32", "compute dtype (bf16: autocast)", choices=["fp32", "bf16"])
    seed: int = flag(0, "seed for init and batch order")
    # how it runs
    device: str = flag("auto", "auto | tpu | xla | cuda | cpu")
    mode: str = flag("eager", "optimization ladder", choices=["eager", "compile", "graph"])
    backend: Optional[str] = flag(None, "graph mode backend (default: xla on XLA devices, else fx)",
                                  choices=["fx", "inductor", "xla"])
    remat: bool = flag(False, "graph mode: recompute all but matmul outputs in the backward")
    offload: bool = flag(False, "graph mode: saved activations to host memory and back")
    scan: bool = flag(False, "run the blocks as one scan over stacked weights (XLA: a While loop; MoE needs --kernels pallas)")
    split: int = flag(0, "graph mode: cut the step graph into N stages run in order")
    fsdp_passes: str = flag("auto", "graph mode under a SimpleFSDP mesh: comma list of reshard, bucket, prefetch, "
                            "or none (auto: all of them under --mesh in graph mode)")
    kernels: str = flag("reference", "pallas: the TPU config rewrite (splash attention, fused loss, grouped matmul)",
                        choices=["reference", "pallas"])
    mesh: Optional[str] = flag(None, "device mesh: ici=N (FSDP), dcn=R,ici=S (HSDP); under torchrun also tp=T "
                               "(tensor parallel), ep=E (experts)")
    dp_impl: str = flag("simple", "how parameters are sharded over the mesh: SimpleFSDP (ours) or torch's FSDP2",
                        choices=["simple", "fsdp2"])
    # the run directory
    eval_interval: int = flag(50, "validate every N steps (0: only at the end)")
    eval_batches: int = flag(8, "validation batches per evaluation")
    log_interval: int = flag(10, "log every N steps")
    out_dir: Optional[str] = flag(None, "run directory (default runs/<flavor>-<time>)")
    ckpt_interval: int = flag(250, "checkpoint every N steps (0: only at the end)")
    resume: bool = flag(False, "continue from the newest verified checkpoint in --out-dir")
    resume_from: Optional[str] = flag(None, "continue from this checkpoint (e.g. step_000010; newer ones are set "
                                      "aside as *.superseded)", metavar="STEP_DIR")
    allow_change: str = flag("", f"on resume, accept these changed settings (comma list of "
                             f"{', '.join(RESUME_CHECKED)}, {RESHARD} (another layout), and the workload's own: lm, flux: "
                             f"data; sft, grpo: init_from and their flags but --updates-per-batch)", metavar="NAMES")
    watchdog: float = flag(300.0, "end the run (exit 4) after this many seconds without progress, e.g. a stalled "
                           "peer (0: off; raise it for long first-step compiles)")
    halt_at: int = flag(0, "stop after this step as if preempted (tests resume)")
    tensorboard: bool = flag(False, "also write the metrics as TensorBoard scalars (out-dir/tensorboard)")
    no_plot: bool = flag(False, "do not draw loss.png at each evaluation (metrics.jsonl has the same numbers; "
                         "drawing costs ~1-2 s of matplotlib per run, a third of a short test run)")
    # planning without running
    dry_run: bool = flag(False, "trace at full scale on meta tensors; print memory/FLOPs/step-time estimates")
    chip: str = flag("tpu_v5p", "TPU generation for --dry-run: tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, tpu_v7")
    plan: bool = flag(False, "with --dry-run: rank every mesh layout of --chips N (dcn x ici x tp, ep; remat)")
    chips: int = flag(0, "chips for --plan")
    # the chosen workload's own flags (its `Flags` dataclass), read as cfg.NAME like the fields above
    workload_flags: object = dataclasses.field(default=None, repr=False, metadata={"cli": False})

    def __getattr__(self, name):  # (only called for names that are not fields: a workload's flag)
        flags = self.__dict__.get("workload_flags")
        if flags is not None and name in {f.name for f in dataclasses.fields(flags)}:
            return getattr(flags, name)
        raise AttributeError(f"{type(self).__name__} has no flag {name!r} (for --task {self.__dict__.get('task')})")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block + error -> one line, same exit code
        error_line(message)
        sys.exit(EXIT_BAD_INPUT)


def _kind(annotation):
    """The flag's value type from the field's annotation (Optional[X] -> X)."""
    if isinstance(annotation, types.UnionType) or getattr(annotation, "__origin__", None) is not None:
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


def _add_flag(parser, field, **extra):
    name, kw = "--" + field.name.replace("_", "-"), {**field.metadata, **extra}
    kind = _kind(field.type)
    if kind is bool:
        parser.add_argument(name, action="store_true", **kw)
    elif kind is list:
        parser.add_argument(name, action="append", **{"default": [], **kw})
    else:
        parser.add_argument(name, type=kind, **{"default": field.default, **kw})


def workload_flags():
    """{flag name: [(workload, its dataclass field), ...]} over the registry."""
    owners = {}
    for name in workloads.WORKLOADS:
        for f in dataclasses.fields(workloads.workload_class(name).Flags):
            owners.setdefault(f.name, []).append((name, f))
    return owners


def build_parser():
    """The shared flags, then one group per workload with the flags it declares (a flag several
    workloads declare is shown once, in the first one's group, with each one's help). Workload flags
    default to 'not given', so a flag of another workload can be told from a default."""
    p = _Parser(description="train.py: the one trainer, for every workload (--task) on every layout (--mesh)",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        if f.metadata.get("cli", True):
            _add_flag(p, f, **({"choices": list(workloads.WORKLOADS)} if f.name == "task" else {}))
    owners, shown = workload_flags(), set()
    for name in workloads.WORKLOADS:
        cls = workloads.workload_class(name)
        group = p.add_argument_group(f"--task {name}", (cls.__doc__ or "").strip().split("\n")[0])
        for f in dataclasses.fields(cls.Flags):
            if f.name in shown:
                continue
            shown.add(f.name)
            helps = dict.fromkeys(g.metadata["help"] for _, g in owners[f.name])
            users = ", ".join(w for w, _ in owners[f.name])
            _add_flag(group, f, default=argparse.SUPPRESS,
                      help=f"{'; '.join(helps)} (--task {users}; default: {f.default})")
    return p


def parse_config(argv=None):
    """The command line -> a validated TrainConfig (ConfigError: one line, exit 2)."""
    given = vars(build_parser().parse_args(argv))
    owners = workload_flags()
    core = {k: v for k, v in given.items() if k not in owners}
    cfg = TrainConfig(**core)
    cls = workloads.workload_class(cfg.task)
    own = {f.name for f in dataclasses.fields(cls.Flags)}
    foreign = [k for k in given if k in owners and k not in own]
    if foreign:
        k = foreign[0]
        raise ConfigError(f"--{k.replace('_', '-')} is a flag of --task {', '.join(w for w, _ in owners[k])}, "
                          f"not of --task {cfg.task}")
    cfg.workload_flags = cls.Flags(**{k: v for k, v in given.items() if k in own})
    validate(cfg)
    return cfg


def validate(cfg):
    """Every check on the shared flags and their combinations, then the workload's own
    (Workload.check_flags), before anything is read or written; fills the workload's default flavor."""
    cls = workloads.workload_class(cfg.task)
    cfg.flavor = cfg.flavor or cls.default_flavor
    for name in ("steps", "batch_size", "seq_len", "log_interval"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    for name in ("warmup", "eval_interval", "eval_batches", "ckpt_interval", "halt_at", "seed", "split"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive finite number, got {cfg.lr}")
    for name in ("clip", "weight_decay", "watchdog"):
        if not (getattr(cfg, name) >= 0 and math.isfinite(getattr(cfg, name))):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0{' seconds' if name == 'watchdog' else ''}, "
                              f"got {getattr(cfg, name)}")
    unknown = set(filter(None, cfg.allow_change.split(","))) - {*RESUME_CHECKED, RESHARD, *cls.resume_changeable}
    if unknown:
        raise ConfigError(f"--allow-change {cfg.allow_change!r}: unknown {sorted(unknown)}; choose from "
                          f"{', '.join(RESUME_CHECKED + (RESHARD,) + tuple(cls.resume_changeable))}")
    graph_only = [f for f, on in (("--remat", cfg.remat), ("--offload", cfg.offload), ("--split", cfg.split),
                                  ("--backend", cfg.backend)) if on]
    if graph_only and cfg.mode != "graph" and not cfg.dry_run:
        raise ConfigError(f"{', '.join(graph_only)} transform(s) the step graph: add --mode graph")
    if cfg.backend == "xla" and cfg.device in ("cpu", "cuda"):
        raise ConfigError(f"--backend xla needs --device xla (or a TPU), not --device {cfg.device}")
    try:
        fsdp_passes.chosen(cfg.fsdp_passes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.scan and cfg.mode == "compile":
        raise ConfigError("--scan has no per-block modules for --mode compile to compile: use eager or graph")
    _validate_mesh(cfg, cls.family_class.model_parallel)
    cls.check_flags(cfg)


def _validate_mesh(cfg, model_parallel):
    """The layout's flags: the mesh spec itself, and what the layout (parallel.layout_kind: the one
    decision, the trainer's too) and the model family support."""
    if not cfg.mesh:
        return
    sizes = mesh.mesh_dims(cfg.mesh)  # (MeshError: a one-line refusal too)
    split = [d for d in ("tp", "ep") if sizes[d] > 1 and d not in model_parallel]
    if split:
        raise ConfigError(f"--mesh {cfg.mesh!r}: the {cfg.task} workload's model splits over "
                          f"{', '.join(model_parallel) or 'data-parallel dims (dcn / ici) only'}, not {', '.join(split)}")
    if parallel.layout_kind(cfg.mesh, cfg.device) == "spmd":
        if sizes["tp"] > 1 or sizes["ep"] > 1:
            raise ConfigError(f"--mesh {cfg.mesh!r}: tp and ep are built for torchrun meshes, not XLA SPMD")
        if cfg.kernels == "pallas" or cfg.dp_impl != "simple":
            raise ConfigError("XLA SPMD (--device xla --mesh) runs the reference kernels and its own sharding: "
                              "drop --kernels pallas / --dp-impl (docs/limits.md)")
        return
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--mesh with --device {cfg.device} is not supported (use cpu or cuda)")
    if sizes["tp"] > 1 or sizes["ep"] > 1:
        if cfg.scan:
            raise ConfigError(f"--mesh {cfg.mesh!r}: --scan with tp or ep is not built")
        if cfg.dp_impl != "simple":
            raise ConfigError(f"--mesh {cfg.mesh!r}: tp and ep are built on --dp-impl simple")
    if cfg.mode == "graph" and cfg.dp_impl == "fsdp2":
        raise ConfigError("graph mode under a mesh needs --dp-impl simple (FSDP2's hooks do not trace)")
