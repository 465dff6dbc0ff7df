"""cli.py: train.py's command line: the flags, the model config they select, and the checks that turn
bad input into one `error:` line and exit code 2 before anything is touched (train.py runs it).
"""
import argparse
import math
import sys

import data
import fsdp_passes
import hf
from model import FLAVORS, check_args, tpu_config, with_overrides

EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_PEER_FAILED, EXIT_WRITE_FAILED = 2, 3, 4, 5
# What --resume compares with the checkpoint's run (changing one needs --allow-change NAME):
RESUME_CHECKED = ("seed", "batch_size", "seq_len", "lr", "warmup", "clip", "weight_decay", "dtype", "steps")


def error_line(message):
    """One `error:` line in ONE write: print() writes text and newline separately, and the ranks of a
    run share stderr, so their lines would interleave."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


class ConfigError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block + error -> one line, same exit code
        error_line(message)
        sys.exit(EXIT_BAD_INPUT)


def build_parser():
    p = _Parser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--flavor", default="llama3_debug", help=f"model flavor: {', '.join(FLAVORS)}")
    a("--init-from", default=None, metavar="HF_DIR",
      help="start from a Hugging Face checkpoint (config.json + safetensors) instead of --flavor: fine-tuning")
    a("--set", action="append", default=[], metavar="FIELD=VALUE",
      help="override a ModelArgs field, e.g. --set n_layers=2 (repeatable)")
    a("--steps", type=int, default=400, help="optimizer steps")
    a("--batch-size", type=int, default=32, help="global batch size, sequences")
    a("--seq-len", type=int, default=128, help="tokens (bytes) per sequence")
    a("--lr", type=float, default=3e-3, help="peak learning rate")
    a("--warmup", type=int, default=30, help="linear warmup steps, then cosine decay to lr/10")
    a("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    a("--weight-decay", type=float, default=0.1, help="AdamW decoupled weight decay (matrices only)")
    a("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype (bf16: autocast)")
    a("--device", default="auto", help="auto | tpu | xla | cuda | cpu")
    a("--mode", choices=["eager", "compile", "graph"], default="eager", help="optimization ladder")
    a("--backend", choices=["fx", "inductor", "xla"], default=None,
      help="graph mode backend (default: xla on XLA devices, else fx)")
    a("--remat", action="store_true", help="graph mode: recompute all but matmul outputs in the backward")
    a("--offload", action="store_true", help="graph mode: saved activations to host memory and back")
    a("--scan", action="store_true", help="run the blocks as one scan over stacked weights (XLA: a While loop; MoE needs --kernels pallas)")
    a("--split", type=int, default=0, help="graph mode: cut the step graph into N stages run in order")
    a("--fsdp-passes", default="auto", help="graph mode under a SimpleFSDP mesh: comma list of reshard, bucket, "
      "or none (auto: all of them under --mesh in graph mode)")
    a("--kernels", choices=["reference", "pallas"], default="reference",
      help="pallas: the TPU config rewrite (splash attention, fused loss, grouped matmul)")
    a("--mesh", default=None, help="device mesh: ici=N (FSDP), dcn=R,ici=S (HSDP); under torchrun also tp=T (tensor parallel), ep=E (experts)")
    a("--dp-impl", choices=["simple", "fsdp2"], default="simple",
      help="how parameters are sharded over the mesh: SimpleFSDP (ours) or torch's FSDP2")
    a("--seed", type=int, default=0, help="seed for init and batch order")
    a("--data", default=None, help="text file or directory (default: this Python's stdlib sources)")
    a("--tokenizer", default=None, metavar="HF_DIR", help="train on the ids of a HF tokenizer.json (default: bytes)")
    a("--eval-interval", type=int, default=50, help="validate every N steps (0: only at the end)")
    a("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    a("--log-interval", type=int, default=10, help="log every N steps")
    a("--out-dir", default=None, help="run directory (default runs/<flavor>-<time>)")
    a("--ckpt-interval", type=int, default=250, help="checkpoint every N steps (0: only at the end)")
    a("--resume", action="store_true", help="continue from the newest verified checkpoint in --out-dir")
    a("--resume-from", default=None, metavar="STEP_DIR",
      help="continue from this checkpoint (e.g. step_000010; newer ones are set aside as *.superseded)")
    a("--allow-change", default="", metavar="NAMES",
      help=f"on resume, accept these changed settings (comma list of {', '.join(RESUME_CHECKED)}, data)")
    a("--watchdog", type=float, default=300, help="end the run (exit 4) after this many seconds without "
      "progress, e.g. a stalled peer (0: off; raise it for long first-step compiles)")
    a("--dry-run", action="store_true", help="trace at full scale on meta tensors; print memory/FLOPs/step-time estimates")
    a("--chip", default="tpu_v5p", help="TPU generation for --dry-run: tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, tpu_v7")
    a("--plan", action="store_true", help="with --dry-run: rank every mesh layout of --chips N (dcn x ici x tp, ep; remat)")
    a("--chips", type=int, default=0, help="chips for --plan")
    a("--halt-at", type=int, default=0, help="stop after this step as if preempted (tests resume)")
    a("--sample-tokens", type=int, default=64, help="at the end, print this many sampled bytes (0: off)")
    a("--tensorboard", action="store_true", help="also write the metrics as TensorBoard scalars (out-dir/tensorboard)")
    return p


def model_args_from(cfg):
    if cfg.init_from:
        args = hf.args_from_config(hf.read_config(cfg.init_from))
    elif cfg.flavor not in FLAVORS:
        raise ConfigError(f"unknown flavor {cfg.flavor!r}; choose one of {', '.join(FLAVORS)}")
    else:
        args = FLAVORS[cfg.flavor]
    try:
        args = with_overrides(args, cfg.set)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.vocab_size < data.BYTE_VOCAB and not cfg.tokenizer:
        raise ConfigError(f"vocab_size {args.vocab_size} is smaller than the data's {data.BYTE_VOCAB} byte values")
    if cfg.kernels == "pallas":
        args = tpu_config(args)
    try:
        check_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.seq_len > args.max_seq_len:
        raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {args.max_seq_len}")
    return args


def validate(cfg):
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    for name in ("warmup", "eval_interval", "eval_batches", "ckpt_interval", "halt_at"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.log_interval <= 0:
        raise ConfigError(f"--log-interval must be positive, got {cfg.log_interval}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive finite number, got {cfg.lr}")
    if cfg.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {cfg.seed}")
    if not (cfg.watchdog >= 0 and math.isfinite(cfg.watchdog)):
        raise ConfigError(f"--watchdog must be >= 0 seconds, got {cfg.watchdog}")
    unknown = set(filter(None, cfg.allow_change.split(","))) - set(RESUME_CHECKED) - {"data"}
    if unknown:
        raise ConfigError(f"--allow-change {cfg.allow_change!r}: unknown {sorted(unknown)}; choose from "
                          f"{', '.join(RESUME_CHECKED)}, data")
    graph_only = [f for f, on in (("--remat", cfg.remat), ("--offload", cfg.offload), ("--split", cfg.split),
                                  ("--backend", cfg.backend)) if on]
    if graph_only and cfg.mode != "graph" and not cfg.dry_run:
        raise ConfigError(f"{', '.join(graph_only)} transform(s) the step graph: add --mode graph")
    try:
        fsdp_passes.chosen(cfg.fsdp_passes, None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.split < 0:
        raise ConfigError(f"--split must be >= 0, got {cfg.split}")
    if cfg.scan and cfg.mode == "compile":
        raise ConfigError("--scan has no per-block modules for --mode compile to compile: use eager or graph")
