"""cli.py: the training configuration as one typed dataclass, its command line, and the one place
where it is validated: bad input becomes one `error:` line and exit code 2 before anything is touched.

Each field of `TrainConfig` is a flag (`batch_size` -> `--batch-size`), with its type, default and
help declared once, here; `build_parser()` is made from the fields, so `--help` is complete.
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

EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_PEER_FAILED, EXIT_WRITE_FAILED = 2, 3, 4, 5
EXIT_OWN_FAILURE = 1  # this process failed by itself (out of memory, a bug): named in one line
# What --resume compares with the checkpoint's run (changing one needs --allow-change NAME):
RESUME_CHECKED = ("seed", "batch_size", "seq_len", "lr", "warmup", "clip", "weight_decay", "dtype", "steps")
# ...and what a task records beside them that may change deliberately too (grpo_task / sft_task / flux_task's
# meta(); a grpo run's --updates-per-batch may not: checkpoint.FIXED_ON_RESUME)
RESUME_ALSO = ("data", "init_from", "reward_task", "format_credit", "group_size", "prompts_per_step", "clip_eps",
               "aggregation", "kl_beta", "max_new_tokens", "temperature", "engine_dtype")


def error_line(message):
    """One `error:` line in ONE write: print() writes text and newline separately, and the ranks of a
    run share stderr, so their lines would interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


class ConfigError(ValueError):
    pass


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


DEFAULT_FLAVOR = {"lm": "llama3_debug", "flux": "flux_debug", "grpo": "llama3_debug", "sft": "llama3_debug"}  # per task (train.TASKS)


def flag(default, help, **argparse_kw):
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kw})


@dataclasses.dataclass
class TrainConfig:
    # what to train
    task: str = flag("lm", "workload: lm (language-model pretraining), flux (FLUX.1 diffusion on the digits or a "
                     "latent file), grpo (GRPO post-training on a verifiable task), sft (its warm start: the "
                     "answers' bytes only)", choices=list(DEFAULT_FLAVOR))
    flavor: Optional[str] = flag(None, "model flavor (model.FLAVORS, flux.FLAVORS; default: the task's debug flavor)")
    init_from: Optional[str] = flag(None, "start from a Hugging Face checkpoint (config.json + safetensors) "
                                    "instead of --flavor: fine-tuning; grpo: also a train.py run directory "
                                    "(its newest checkpoint: the warm start)", metavar="DIR")
    set: list = flag((), "override a model config field (ModelArgs, flux.FluxArgs), e.g. --set n_layers=2 "
                     "(repeatable)", metavar="FIELD=VALUE")
    data: Optional[str] = flag(None, "lm: text file or directory (default: this Python's stdlib sources); flux: a "
                               ".safetensors file of latents + text embeddings (flux_latents.py; default: the digits)")
    tokenizer: Optional[str] = flag(None, "train on the ids of a HF tokenizer.json (default: bytes)", metavar="HF_DIR")
    # the optimization
    steps: int = flag(400, "optimizer steps")
    batch_size: int = flag(32, "global batch size, sequences")
    seq_len: int = flag(128, "tokens (bytes) per sequence")
    image_size: int = flag(0, "flux: image side in pixels (0: the task's, 8 for the digits, 1024 for the "
                           "published flavors' --dry-run)")
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
                             f"{', '.join(RESUME_CHECKED + RESUME_ALSO)})", metavar="NAMES")
    watchdog: float = flag(300.0, "end the run (exit 4) after this many seconds without progress, e.g. a stalled "
                           "peer (0: off; raise it for long first-step compiles)")
    halt_at: int = flag(0, "stop after this step as if preempted (tests resume)")
    halt_at_accuracy: float = flag(0.0, "sft / grpo: stop at the first evaluation after step 0 whose held-out "
                                   "accuracy is >= this, saving that checkpoint (the newest: what --init-from RUN "
                                   "takes); 0: off")
    sample_tokens: int = flag(64, "lm: at the end, print this many sampled bytes (0: off)")
    sample_images: int = flag(10, "flux: at the end, sample this many images per class into samples.png, "
                              "judged by a classifier; at each evaluation a quick grid samples_step_N.png (0: off)")
    distilled_guidance: Optional[float] = flag(None, "flux: the guidance value given to a model with a guidance "
                                               "embedding (flux-dev's distilled scale; default 1)")
    tensorboard: bool = flag(False, "also write the metrics as TensorBoard scalars (out-dir/tensorboard)")
    # grpo (--task grpo): rollouts from an engine process, the clipped loss (grpo.py), a reward (arithmetic.py)
    reward_task: str = flag("arith", "grpo: the verifiable task that draws prompts and scores completions")
    format_credit: float = flag(0.0, "grpo: reward of a well-formed wrong answer (the exact answer scores 1)")
    group_size: int = flag(8, "grpo: G, completions sampled per prompt (>= 2)")
    prompts_per_step: int = flag(32, "grpo: prompts per rollout batch (G x this rows; divisible over ranks)")
    updates_per_batch: int = flag(1, "grpo: optimizer steps on each rollout batch (--steps, --ckpt-interval, "
                                  "--halt-at must be multiples)")
    clip_eps: float = flag(0.2, "grpo: the ratio's clip range, clip(rho, 1 - eps, 1 + eps)")
    aggregation: str = flag("dapo", "grpo: loss aggregation, grpo | dapo | dr_grpo")
    kl_beta: float = flag(0.0, "grpo: k3 KL coefficient to the frozen warm-start policy (0: none)")
    max_new_tokens: int = flag(4, "grpo: tokens sampled per completion")
    temperature: float = flag(1.0, "grpo: sampling temperature")
    engine_dtype: str = flag("fp32", "grpo: the rollout engine's weights", choices=["fp32", "bf16"])
    engine_timeout: float = flag(120.0, "grpo: seconds without a reply before the engine counts as stalled (exit 4)")
    # planning without running
    dry_run: bool = flag(False, "trace at full scale on meta tensors; print memory/FLOPs/step-time estimates")
    chip: str = flag("tpu_v5p", "TPU generation for --dry-run: tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, tpu_v7")
    plan: bool = flag(False, "with --dry-run: rank every mesh layout of --chips N (dcn x ici x tp, ep; remat)")
    chips: int = flag(0, "chips for --plan")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block + error -> one line, same exit code
        error_line(message)
        sys.exit(EXIT_BAD_INPUT)


def _kind(annotation):
    """The flag's value type from the field's annotation (Optional[X] -> X)."""
    if isinstance(annotation, types.UnionType) or getattr(annotation, "__origin__", None) is not None:
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


def build_parser():
    p = _Parser(description="train.py: " + __doc__.split("\n")[0].split(": ", 1)[1],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        name, kw = "--" + f.name.replace("_", "-"), dict(f.metadata)
        kind = _kind(f.type)
        if kind is bool:
            p.add_argument(name, action="store_true", **kw)
        elif kind is list:
            p.add_argument(name, action="append", default=[], **kw)
        else:
            p.add_argument(name, type=kind, default=f.default, **kw)
    return p


def parse_config(argv=None):
    """The command line -> a validated TrainConfig (ConfigError: one line, exit 2)."""
    cfg = TrainConfig(**vars(build_parser().parse_args(argv)))
    validate(cfg)
    return cfg


def validate(cfg):
    """Every check on the flags and their combinations, before anything is read or written; fills
    the task's default flavor."""
    cfg.flavor = cfg.flavor or DEFAULT_FLAVOR[cfg.task]
    for name in ("steps", "batch_size", "seq_len", "log_interval"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    for name in ("warmup", "eval_interval", "eval_batches", "ckpt_interval", "halt_at", "seed", "split", "image_size",
                 "sample_tokens", "sample_images"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive finite number, got {cfg.lr}")
    for name in ("clip", "weight_decay", "watchdog"):
        if not (getattr(cfg, name) >= 0 and math.isfinite(getattr(cfg, name))):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0{' seconds' if name == 'watchdog' else ''}, "
                              f"got {getattr(cfg, name)}")
    g = cfg.distilled_guidance
    if g is not None and (cfg.task != "flux" or not (g >= 0 and math.isfinite(g))):
        raise ConfigError(f"--distilled-guidance {g}: a finite value >= 0, for --task flux only")
    unknown = set(filter(None, cfg.allow_change.split(","))) - set(RESUME_CHECKED) - set(RESUME_ALSO)
    if unknown:
        raise ConfigError(f"--allow-change {cfg.allow_change!r}: unknown {sorted(unknown)}; choose from "
                          f"{', '.join(RESUME_CHECKED + RESUME_ALSO)}")
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
    if cfg.task in ("grpo", "sft"):
        _validate_grpo(cfg)
    if cfg.halt_at_accuracy and not (cfg.task in ("grpo", "sft") and 0 < cfg.halt_at_accuracy <= 1):
        raise ConfigError(f"--halt-at-accuracy {cfg.halt_at_accuracy}: a held-out accuracy in (0, 1], for --task "
                          f"sft / grpo (the tasks that measure one)")
    if cfg.scan and cfg.mode == "compile":
        raise ConfigError("--scan has no per-block modules for --mode compile to compile: use eager or graph")
    _validate_mesh(cfg)


def _validate_grpo(cfg):
    """GRPO's flags: the algorithm's (grpo.GRPOConfig.check), the reward task's name, and checkpoints
    on rollout-batch boundaries (a resume then starts a fresh batch: no rollout needs replaying)."""
    import arithmetic
    import grpo
    try:
        grpo.GRPOConfig(group_size=cfg.group_size, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps,
                        aggregation=cfg.aggregation, beta=cfg.kl_beta, temperature=cfg.temperature).check()
        arithmetic.get_task(cfg.reward_task, format_credit=cfg.format_credit)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in ("prompts_per_step", "updates_per_batch", "max_new_tokens"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if not (cfg.engine_timeout > 0 and math.isfinite(cfg.engine_timeout)):
        raise ConfigError(f"--engine-timeout must be a positive number of seconds, got {cfg.engine_timeout}")
    u = cfg.updates_per_batch
    for name in ("steps", "ckpt_interval", "halt_at"):
        if getattr(cfg, name) % u:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is not a multiple of "
                              f"--updates-per-batch {u} (checkpoints fall on rollout-batch boundaries)")
    if cfg.scan or cfg.dry_run or cfg.tokenizer:
        raise ConfigError(f"--task {cfg.task} trains a byte-level policy unstacked: --scan, --dry-run, --tokenizer are not built for it")


def _validate_mesh(cfg):
    """The layout's flags: the mesh spec itself, and what each runtime (XLA SPMD, torchrun) supports."""
    if not cfg.mesh:
        return
    sizes = mesh.mesh_dims(cfg.mesh)  # (MeshError: a one-line refusal too)
    if cfg.task != "lm" and (sizes["tp"] > 1 or sizes["ep"] > 1):
        raise ConfigError(f"--mesh {cfg.mesh!r}: tp and ep split language models' heads and experts; the "
                          f"{cfg.task} task runs data parallel (dcn / ici) only")
    spmd = not mesh.launched_by_torchrun() and cfg.device == "xla"
    if spmd:
        if sizes["tp"] > 1 or sizes["ep"] > 1:
            raise ConfigError(f"--mesh {cfg.mesh!r}: tp and ep are built for torchrun meshes, not XLA SPMD")
        if cfg.kernels == "pallas" or cfg.dp_impl != "simple":
            raise ConfigError("XLA SPMD (--device xla --mesh) runs the reference kernels and its own sharding: "
                              "drop --kernels pallas / --dp-impl (README, Known limits)")
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
