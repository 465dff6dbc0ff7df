"""run/cli.py: the training configuration as one typed dataclass, its command line, and its validation:
bad input becomes one `error:` line and exit code 2 before anything is touched.

Each field of `TrainConfig` is a shared flag (`batch_size` -> `--batch-size`), with its type, default
and help declared once, here. Each workload declares its own flags beside it (its `Flags` dataclass,
task.py; declared with run/flags.py, as these are) with its own checks (`check_flags`); `build_parser()`
shows them as the workload's group, and a flag of another workload than --task's is refused. A parse
imports --task's workload only (the others only for --help, or to name a flag's owner); the run's
config is one flat dataclass of both, TrainConfig's fields and the workload's (`config_class`). Checks of one layer's flags live with that layer
(mesh.mesh_dims, fsdp_passes.chosen, parallel.layout_kind); this module calls them all, in one place.
"""
import argparse
import dataclasses
import math
import os
import sys
import types
from typing import Optional

from step import check_grad_accum
import device as dev
import fsdp_passes
import mesh
import parallel
from run import profiling
import task as workloads
from errors import EXIT_BAD_INPUT, ConfigError, error_line
from run.flags import finite_float, flag, with_overrides  # noqa: F401  (with_overrides: also reached as cli's)
from run.resume import RESHARD, RESUME_CHECKED, check_allow_change

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
    grad_accum: int = flag(1, "gradient accumulation: each step's global batch (--batch-size) as N microbatches, "
                           "a forward + backward each, one update (a count, not a microbatch size: the batch a "
                           "step trains on stays --batch-size; step.py)", metavar="N")
    seq_len: int = flag(128, "tokens (bytes) per sequence (--task lm: the others' rows have lengths of their own)")
    lr: float = flag(3e-3, "peak learning rate")
    warmup: int = flag(30, "linear warmup steps, then cosine decay to lr/10")
    clip: float = flag(1.0, "global gradient-norm clip (0: off)")
    weight_decay: float = flag(0.1, "AdamW decoupled weight decay (matrices only)")
    dtype: str = flag("fp32", "compute dtype (bf16: autocast)", choices=["fp32", "bf16"])
    seed: int = flag(0, "seed for init and batch order")
    # how it runs
    device: str = flag("auto", "auto | tpu | xla | cuda | cpu")
    mode: str = flag("eager", "optimization ladder", choices=["eager", "compile", "graph"])
    backend: Optional[str] = flag(None, "graph mode backend (default: xla on XLA devices, else fx); openxla: "
                                  "xla through torch_xla's dynamo bridge (the step not recorded again each step)",
                                  choices=["fx", "inductor", "xla", "openxla"])
    remat: bool = flag(False, "graph mode: recompute all but matmul outputs in the backward")
    offload: bool = flag(False, "graph mode: saved activations to host memory and back (--dry-run --compile "
                         "--scan: each layer's input)")
    scan: bool = flag(False, "run the blocks as one scan over stacked weights (XLA: a While loop; MoE needs --kernels pallas)")
    split: int = flag(0, "graph mode: cut the step graph into N stages run in order")
    fsdp_passes: str = flag("auto", "graph mode under a SimpleFSDP mesh: comma list of reshard, bucket, prefetch, "
                            "or none (auto: all of them under --mesh in graph mode)")
    kernels: str = flag("reference", "pallas: the TPU config rewrite (splash attention, fused loss, grouped matmul)",
                        choices=["reference", "pallas"])
    mesh: Optional[str] = flag(None, "device mesh: ici=N (FSDP), dcn=R,ici=S (HSDP); under torchrun also tp=T "
                               "(tensor parallel), ep=E (experts), cp=C (sequences split: context parallel)")
    dp_impl: str = flag("simple", "how parameters are sharded over the mesh: SimpleFSDP (ours) or torch's FSDP2",
                        choices=["simple", "fsdp2"])
    # the run directory
    eval_interval: int = flag(50, "validate every N steps (0: only at the end)")
    eval_batches: int = flag(8, "validation batches per evaluation")
    log_interval: int = flag(10, "log every N steps")
    out_dir: Optional[str] = flag(None, "run directory (default runs/<flavor>-<time>)")
    ckpt_interval: int = flag(250, "checkpoint every N steps (0: only at the end)")
    resume: Optional[str] = flag(None, "continue from the newest checkpoint in --out-dir (refused if it does not "
                                 "verify); --resume auto: from the newest one that verifies (broken newer ones "
                                 "set aside), or start at step 0 if there is none: one command line for the first "
                                 "start and every restart (torchrun --max-restarts)", nargs="?", const="newest",
                                 choices=["newest", "auto"])
    resume_from: Optional[str] = flag(None, "continue from this checkpoint (e.g. step_000010; newer ones are set "
                                      "aside as *.superseded)", metavar="STEP_DIR")
    allow_change: str = flag("", f"on resume, accept these changed settings (comma list of "
                             f"{', '.join(RESUME_CHECKED)}, {RESHARD} (another layout), and the "
                             f"workload's own: lm, flux: data; sft, grpo: init_from and their flags but "
                             f"--updates-per-batch; run/resume.py)", metavar="NAMES")
    watchdog: float = flag(300.0, "end the run (exit 4) after this many seconds without progress, e.g. a stalled "
                           "peer (0: off; raise it for long first-step compiles)")
    halt_at: int = flag(0, "stop after this step as if preempted (tests resume)")
    tensorboard: bool = flag(False, "also write the metrics as TensorBoard scalars (out-dir/tensorboard)")
    profile: Optional[str] = flag(None, "trace these steps (e.g. 5,6 or 5-8) into out-dir/profile (torch.profiler; "
                                  "--device xla: torch_xla's) and print their time by category (run/profiling.py)",
                                  metavar="STEPS")
    no_plot: bool = flag(False, "do not draw loss.png at each evaluation (metrics.jsonl has the same numbers; "
                         "drawing costs ~1-2 s of matplotlib per run, a third of a short test run)")
    # planning without running
    dry_run: bool = flag(False, "trace at full scale on meta tensors; print memory/FLOPs/step-time estimates")
    chip: str = flag("tpu_v5p", "TPU generation for --dry-run: tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, tpu_v7")
    plan: bool = flag(False, "with --dry-run: rank every mesh layout of --chips N (dcn x ici x tp, ep; remat)")
    chips: Optional[int] = flag(None, "chips for --plan, or for --compile without --mesh (the layout --plan ranks first)")
    compile: bool = flag(False, "with --dry-run: compile the training step for the --chip topology of the mesh with "
                         "the real TPU compiler (compile-only devices, no chip): HBM, fits, FLOPs, estimated step")
    topology: Optional[str] = flag(None, "with --compile: libtpu's topology name, e.g. v5p:2x2x1 (default: the mesh's "
                                   "device count); a --mesh ici=N of k times its chips: k slices, FSDP over all of them")
    compile_effort: float = flag(0.0, "with --compile: XLA's exec_time_optimization_effort, -1 to 1 (0: XLA's "
                                 "default): -1 compiles up to ~6x quicker, the same FLOPs and arguments, temporaries "
                                 "of a less-worked schedule", metavar="E")


CONFIG_CLASSES = {}  # workload name -> its run's config class, TrainConfig_<name> (made by config_class)


def config_class(cls):
    """A run's configuration class: TrainConfig's fields and workload `cls`'s own flags (its `Flags`) as
    fields of its own, one flat declared dataclass (`TrainConfig_grpo`): `dataclasses.fields(cfg)` lists
    every flag the run has, and another workload's flag is no attribute of it."""
    if cls.name not in CONFIG_CLASSES:
        own = [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata))
               for f in dataclasses.fields(cls.Flags)]
        made = dataclasses.make_dataclass(f"TrainConfig_{cls.name}", own, bases=(TrainConfig,))
        made.__module__ = __name__
        CONFIG_CLASSES[cls.name] = made
    return CONFIG_CLASSES[cls.name]


def __getattr__(name):
    """cli.TrainConfig_<task>: how pickle finds a config's class by its name, as it finds TrainConfig."""
    task = name[len("TrainConfig_"):] if name.startswith("TrainConfig_") else None
    if task in workloads.WORKLOADS:
        return config_class(workloads.workload_class(task))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    kind = finite_float if kind is float else kind
    if kind is bool:
        parser.add_argument(name, action="store_true", **kw)
    elif kind is list:
        parser.add_argument(name, action="append", **{"default": [], **kw})
    else:
        parser.add_argument(name, type=kind, **{"default": field.default, **kw})


def workload_flags(names=None):
    """{flag name: [(workload, its dataclass field), ...]} over the workloads `names` (default: the
    registry's, each imported)."""
    owners = {}
    for name in names or workloads.WORKLOADS:
        for f in dataclasses.fields(workloads.workload_class(name).Flags):
            owners.setdefault(f.name, []).append((name, f))
    return owners


def build_parser(names=None):
    """The shared flags, then one group per workload with the flags it declares (a flag several
    workloads declare is shown once, in the first one's group, with each one's help). Workload flags
    default to 'not given', so a flag of another workload can be told from a default. `names`: the
    workloads whose groups it holds (default: every one, as --help shows them)."""
    p = _Parser(description="train.py: the one trainer, for every workload (--task) on every layout (--mesh)",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        if f.metadata.get("cli", True):
            _add_flag(p, f, **({"choices": list(workloads.WORKLOADS)} if f.name == "task" else {}))
    owners, shown = workload_flags(names), set()
    for name in names or workloads.WORKLOADS:
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
    """The command line -> a validated TrainConfig (ConfigError: one line, exit 2). Parsed with --task's
    own flags only, so that a run imports only its own workload; a flag that parse does not know (another
    workload's, or none's) is parsed again with every workload's, which names its owner."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = _Parser(add_help=False)
    pre.add_argument("--task", default=TrainConfig.task)
    name = pre.parse_known_args(argv)[0].task
    names = [name] if name in workloads.WORKLOADS and not {"-h", "--help"} & set(argv) else None
    given, unknown = build_parser(names).parse_known_args(argv)
    if unknown:
        names, given = None, build_parser().parse_args(argv)
    given = vars(given)
    owners = workload_flags(names)
    core = {k: v for k, v in given.items() if k not in owners}
    cls = workloads.workload_class(core["task"])
    own = {f.name for f in dataclasses.fields(cls.Flags)}
    foreign = [k for k in given if k in owners and k not in own]
    if foreign:
        k = foreign[0]
        raise ConfigError(f"--{k.replace('_', '-')} is a flag of --task {', '.join(w for w, _ in owners[k])}, "
                          f"not of --task {core['task']}")
    cfg = config_class(cls)(**core, **{k: v for k, v in given.items() if k in own})
    validate(cfg)
    return cfg


def validate(cfg):
    """Every check on the shared flags and their combinations, then the workload's own
    (Workload.check_flags), before anything is read or written; fills the workload's default flavor."""
    cls = workloads.workload_class(cfg.task)
    if cfg.flavor and cfg.init_from:  # (the directory's config is the model: a flavor would be ignored)
        raise ConfigError(f"--flavor {cfg.flavor} and --init-from both name the model; --init-from "
                          f"{cfg.init_from} fixes it: drop --flavor (--set changes a field)")
    cfg.flavor = cfg.flavor or cls.default_flavor
    for name in ("steps", "batch_size", "grad_accum", "seq_len", "log_interval"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cls.sequence_from and cfg.seq_len != TrainConfig.seq_len:  # (it would be ignored)
        raise ConfigError(f"--seq-len sets --task lm's row length; --task {cfg.task}'s is {cls.sequence_from}: "
                          f"drop --seq-len")
    for name in ("warmup", "eval_interval", "eval_batches", "ckpt_interval", "halt_at", "seed", "split"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.halt_at > cfg.steps:  # (it would never stop the run: a test of a resume that tests nothing)
        raise ConfigError(f"--halt-at {cfg.halt_at} is past --steps {cfg.steps}: the run would end first")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive finite number, got {cfg.lr}")
    for name in ("clip", "weight_decay", "watchdog"):
        if not (getattr(cfg, name) >= 0 and math.isfinite(getattr(cfg, name))):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0{' seconds' if name == 'watchdog' else ''}, "
                              f"got {getattr(cfg, name)}")
    check_allow_change(cfg.allow_change, cls)
    graph_only = [f for f, on in (("--remat", cfg.remat), ("--offload", cfg.offload), ("--split", cfg.split),
                                  ("--backend", cfg.backend), ("--fsdp-passes", cfg.fsdp_passes != "auto")) if on]
    if graph_only and cfg.mode != "graph" and not cfg.dry_run:
        raise ConfigError(f"{', '.join(graph_only)} transform(s) the step graph: add --mode graph")
    # (on one device there are no parameters to shard: the flags would be ignored, as they were)
    one_device = not cfg.dry_run and parallel.layout_kind(cfg.mesh, cfg.device) == "one"
    if one_device and cfg.dp_impl != "simple":
        raise ConfigError(f"--dp-impl {cfg.dp_impl} shards the parameters over --mesh: add --mesh (one device shards nothing)")
    if one_device and cfg.fsdp_passes != "auto":
        raise ConfigError("--fsdp-passes transform SimpleFSDP's collectives: add --mesh (one device has none)")
    if (cfg.compile or cfg.topology or cfg.compile_effort) and not cfg.dry_run:
        raise ConfigError("--compile, --topology and --compile-effort compile the step for a TPU without running it: "
                          "add --dry-run")
    # --device auto / tpu is an XLA device only through torch_xla's TPU runtime (device.pick_device; torch_tpu,
    # the other TPU route, lives in an environment without torch_xla)
    if cfg.backend in ("xla", "openxla") and not (cfg.device == "xla" or (cfg.device in ("auto", "tpu") and dev.pjrt_is_tpu())):
        raise ConfigError(f"--backend {cfg.backend} needs an XLA device (--device xla, or a TPU with PJRT_DEVICE=TPU), "
                          f"not --device {cfg.device}")
    if cfg.backend == "openxla" and cfg.mesh:
        raise ConfigError("--backend openxla runs on one XLA device: under --mesh use --backend xla")
    try:
        fsdp_passes.chosen(cfg.fsdp_passes)
        if cfg.profile is not None:
            profiling.parse_steps(cfg.profile, cfg.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.scan and cfg.mode == "compile":
        raise ConfigError("--scan has no per-block modules for --mode compile to compile: use eager or graph")
    _validate_mesh(cfg, cls)
    cls.check_flags(cfg)
    _validate_grad_accum(cfg, cls)


def _validate_grad_accum(cfg, workload):
    """--grad-accum N: the workload says how its loss splits (Workload.loss_reduction), and each
    data-parallel rank's rows split into N equal microbatches."""
    dims = mesh.mesh_dims(cfg.mesh) if cfg.mesh else {"dcn": 1, "ici": 1}
    dp = dims["dcn"] * dims["ici"] if cfg.mesh or not parallel.launched_by_torchrun() else \
        int(os.environ["WORLD_SIZE"])
    rows, named = workload.global_rows(cfg)
    reduction = workload.loss_reduction(cfg) if cfg.grad_accum > 1 else None
    # (a dry run of --chips / --topology picks its layout later: here the whole batch, which must split
    # for any; the chosen layout's ranks are checked once it is picked)
    later = cfg.dry_run and not cfg.mesh and (cfg.chips or cfg.topology)
    where = f"{named} (on any layout)" if later else f"{named} over {dp} data-parallel rank(s)"
    why = check_grad_accum(cfg.grad_accum, reduction, rows // dp, where, cfg.task)
    if why:
        raise ConfigError(why)


def _validate_mesh(cfg, workload):
    """The layout's flags: the mesh spec itself, and what the layout (parallel.layout_kind: the one
    decision, the trainer's too), the workload's batch and its model family support."""
    if not cfg.mesh:
        return
    model_parallel = workload.family_class.model_parallel
    sizes = mesh.mesh_dims(cfg.mesh)  # (MeshError: a one-line refusal too)
    split = [d for d in ("tp", "ep") if sizes[d] > 1 and d not in model_parallel]
    if split:
        raise ConfigError(f"--mesh {cfg.mesh!r}: the {cfg.task} workload's model splits over "
                          f"{', '.join(model_parallel) or 'data-parallel dims (dcn / ici) only'}, not {', '.join(split)}")
    if sizes["cp"] > 1:
        _validate_context_parallel(cfg, workload, sizes)
    if parallel.layout_kind(cfg.mesh, cfg.device) == "spmd":
        if sizes["tp"] > 1 or sizes["ep"] > 1:
            raise ConfigError(f"--mesh {cfg.mesh!r}: tp and ep are built for torchrun meshes, not XLA SPMD")
        if cfg.kernels == "pallas" or cfg.dp_impl != "simple":
            raise ConfigError("XLA SPMD (--device xla --mesh) runs the reference kernels and its own sharding: "
                              "drop --kernels pallas / --dp-impl (docs/limits.md)")
        return
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--mesh with --device {cfg.device} is not supported (use cpu or cuda)")
    dp = sizes["dcn"] * sizes["ici"]  # torchrun ranks that each read a slice of the batch (tp ranks share one)
    rows, named = workload.global_rows(cfg)
    if rows % dp:
        raise ConfigError(f"{named} is not divisible by {dp} data-parallel ranks")
    if sizes["tp"] > 1 or sizes["ep"] > 1:
        if cfg.scan and sizes["tp"] > 1:
            raise ConfigError(f"--mesh {cfg.mesh!r}: --scan with tp is not built")
        if cfg.dp_impl != "simple":
            raise ConfigError(f"--mesh {cfg.mesh!r}: tp and ep are built on --dp-impl simple")
    if cfg.mode == "graph" and cfg.dp_impl == "fsdp2":
        raise ConfigError("graph mode under a mesh needs --dp-impl simple (FSDP2's hooks do not trace)")


def _validate_context_parallel(cfg, workload, sizes):
    """cp=C: what context_parallel.py is built for (eager and graph, beside SimpleFSDP / FSDP2 / HSDP)."""
    where = f"--mesh {cfg.mesh!r}"
    if not workload.splits_sequences:
        raise ConfigError(f"{where}: the {cfg.task} workload does not split its sequences over cp ranks "
                          f"({workload.no_split_reason}): cp is for --task lm")
    if sizes["tp"] > 1 or sizes["ep"] > 1 or cfg.scan:
        raise ConfigError(f"{where}: cp with tp, ep or --scan is not built")
    if cfg.mode == "compile":
        raise ConfigError(f"{where}: cp is built for --mode eager and graph")
    if cfg.seq_len % (2 * sizes["cp"]):
        raise ConfigError(f"{where}: --seq-len {cfg.seq_len} must be divisible by 2 x cp = {2 * sizes['cp']} "
                          f"(each rank holds a head and a tail chunk)")
