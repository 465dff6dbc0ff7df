"""task.py: what one kind of training brings to the shared trainer, and language-model pretraining.

The trainer (train.py) owns what every workload shares: the loop, AdamW, the schedule, clipping,
checkpoints, the run directory, the watchdog, logging, MFU and the parallel layout. A `Task` owns
what is specific to one kind of training, in the spirit of torchtitan's model families (each with
its own model, data and loss; its FluxTrainer overrides one step method, its RL loop another):

    __init__(cfg)           read the config; `args`: the model's config (flavors, --set, --init-from's)
    setup_data(rank, size)  load this data-parallel rank's data (not for a dry run)
    build_model(args)       the model, initialized (the trainer seeds first, then stacks / shards it)
    load_pretrained(model)  fill weights from elsewhere (--init-from), after sharding: each rank its piece
    batch(step)             this rank's slice of global batch `step`: a tuple of CPU tensors, a pure
                            function of (seed, step), so resuming and N ranks see what one process would
    val_batches             a fixed list of validation batches (the same at every evaluation)
    loss(model, batch)      (loss to report, loss to differentiate); traced whole in graph mode
    units_per_step, unit    what the throughput line counts (tokens, images, ...)
    flops_per_step(args)    model FLOPs of one global step (forward + backward), for MFU
    meta()                  what a checkpoint records of the data, and a resume must match
    label(), model_record(args), param_count(args)   naming and sizing the model (defaults given)
    preview(model, log, out_dir, step, final)   something to look at: a quick one after each evaluation,
                            the full one after the last step (a text sample, an image grid)
    plan_workload(args)     what the dry run (dryrun.py) needs at full scale: a dryrun.Workload (parameter
                            groups, FLOPs and tokens of a sample, its saved activations traced on meta)

Four seams for a workload that keeps state beside the model (GRPO: a rollout engine it feeds with
the live policy's weights); their defaults do nothing, so lm and flux do not see them:
    attach(model)           the live model, once built, sharded, loaded or restored (before step 1)
    step_metrics()          numbers of the last batch for the logged step (reward mean, sync seconds)
    evaluate(model, step, log)  numbers for an evaluation's record (held-out accuracy); `evaluates`:
                            evaluations run even without val_batches; `plotted`: keys drawn in the
                            run's plot beside the loss
    close()                 release what the task holds (an engine process), on every way out

Adding a workload is one subclass and one entry in train.TASKS.
"""
import dataclasses
import os

import torch

import data
import hf
from cli import ConfigError, with_overrides
from model import (FLAVORS, Transformer, check_args, dynamic_shapes_reason, flops_per_token, next_token_loss,
                   param_counts, tpu_config)


class Task:
    """The interface (see the module docstring); subclasses implement what raises here."""
    unit = "samples"
    notes = ()           # one-line remarks printed at start by the writing process
    val_batches = ()
    evaluates = False    # True: evaluate() runs at evaluations even with no val_batches
    plotted = ()         # metric keys (step records) drawn in the run's plot beside the loss

    def __init__(self, cfg):
        self.cfg = cfg
        self.args = None

    def setup_data(self, dp_rank, dp_size):
        raise NotImplementedError

    def build_model(self, args):
        raise NotImplementedError

    def load_pretrained(self, model):
        """Nothing to load unless the task says so."""

    def param_count(self, args):
        """Parameters of the model `args` describes (the trainer's memory check): built on the meta
        device, where nothing is allocated."""
        with torch.device("meta"):
            return sum(p.numel() for p in self.build_model(args).parameters())

    def scan_stacks(self, model):
        """What --scan stacks (layer_scan.stack_layers): (owner module, attribute) of each ModuleList
        of identical blocks mapping (h, cos, sin) -> (h, aux); none (the default): --scan refused.
        Called once, on the freshly built model, which it may prepare for that contract."""
        return []

    def blocks(self, model):
        """The model's repeated modules: what --mode compile compiles one by one, and what the
        SimpleFSDP bucket pass (fsdp_passes.py) gathers one at a time (default: the whole model)."""
        return [model]

    def label(self):
        """What the start line and meta.json call the model."""
        return self.cfg.task

    def model_record(self, args):
        """The model config as meta.json records it (a resume must build the same model)."""
        return dataclasses.asdict(args) if dataclasses.is_dataclass(args) else repr(args)

    def batch(self, step):
        raise NotImplementedError

    def loss(self, model, batch):
        raise NotImplementedError

    def flops_per_step(self, args):
        raise NotImplementedError

    def dynamic_shapes_reason(self, args):
        """Why the step cannot be traced ahead of time (graph mode, --scan), or None."""
        return None

    def activation_bytes(self, args, local_batch, free_bytes):
        """An estimate of the activation memory of one step on `local_batch` samples (for refusing a
        batch that cannot fit before anything is allocated); 0 where the task does not estimate."""
        return 0

    def meta(self):
        return {}

    def plan_workload(self, args):
        """dryrun.Workload for `args` at full scale (--dry-run, --plan); nothing is allocated."""
        raise NotImplementedError

    def preview(self, model, log, out_dir, step, final):
        """Called by the writing process where the weights are whole (one device), with the trainer's
        `log` and the run directory: after each evaluation (final=False: something quick), and once after
        the last step (final=True)."""

    def attach(self, model):
        """The live (possibly sharded) model the trainer updates, before its first step."""

    def step_metrics(self):
        """{name: number} about the last step's batch, added to a logged step's record."""
        return {}

    def evaluate(self, model, step, log):
        """{name: number} added to the evaluation record at `step` (called on every rank)."""
        return {}

    def close(self):
        """Release what the task holds; called once however the run ends."""


class LanguageModel(Task):
    """Next-token prediction on bytes (or a Hugging Face tokenizer's ids): Llama 3 / Qwen 3 / Qwen 3-MoE."""
    unit = "tok"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.notes = []
        self.args = self.model_args()
        if cfg.seq_len > self.args.max_seq_len:
            raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {self.args.max_seq_len}")

    def setup_data(self, dp_rank, dp_size):
        cfg = self.cfg
        train, val = data.load_corpus(cfg.data, notes=self.notes)
        if cfg.tokenizer:  # token ids instead of bytes (tokenized once, cached)
            train, val, vocab = data.tokenize(train, val, cfg.tokenizer, notes=self.notes)
            if vocab > self.args.vocab_size:
                raise ConfigError(f"--tokenizer has {vocab} tokens, the model's vocab_size is {self.args.vocab_size}")
        self.batches = data.Batches(train, cfg.batch_size, cfg.seq_len, cfg.seed, dp_size)
        self.dp_rank = dp_rank
        self.val_batches = data.eval_batches(val, cfg.batch_size, cfg.seq_len, cfg.seed, cfg.eval_batches,
                                             dp_rank, dp_size)
        if cfg.eval_batches and not self.val_batches:
            self.notes.append(f"note: validation skipped: the validation split has {len(val)} tokens, "
                              f"fewer than --seq-len + 2 = {cfg.seq_len + 2}")
        self.fingerprint = data.fingerprint(train, val)

    def model_args(self):
        cfg = self.cfg
        if cfg.init_from:
            args = hf.args_from_config(hf.read_config(cfg.init_from))
        elif cfg.flavor not in FLAVORS:
            raise ConfigError(f"unknown flavor {cfg.flavor!r}; choose one of {', '.join(FLAVORS)}")
        else:
            args = FLAVORS[cfg.flavor]
        try:
            args = with_overrides(args, cfg.set)
            if args.vocab_size < data.BYTE_VOCAB and not cfg.tokenizer:
                raise ValueError(f"vocab_size {args.vocab_size} is smaller than the data's {data.BYTE_VOCAB} byte values")
            args = tpu_config(args) if cfg.kernels == "pallas" else args
            check_args(args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return args

    def build_model(self, args):
        return Transformer(args)

    def param_count(self, args):
        return param_counts(args)[0]

    def scan_stacks(self, model):
        return [(model, "layers")]

    def blocks(self, model):
        return list(model.layers)

    def label(self):
        cfg = self.cfg
        return f"hf:{os.path.abspath(cfg.init_from)}" if cfg.init_from else cfg.flavor

    def model_record(self, args):
        """Implementations (attention, loss, experts) may change across resumes: not recorded."""
        d = dataclasses.asdict(args)
        for key in ("attn_impl", "loss_impl", "moe_impl"):
            d.pop(key)
        return d

    def load_pretrained(self, model):
        if self.cfg.init_from:
            hf.load_into(model, self.cfg.init_from)

    def batch(self, step):
        return self.batches.get(step, self.dp_rank)  # (inputs, targets), each (B / dp, S)

    loss = staticmethod(next_token_loss)

    @property
    def units_per_step(self):
        return self.cfg.batch_size * self.cfg.seq_len

    def flops_per_step(self, args):
        return flops_per_token(args, self.cfg.seq_len) * self.units_per_step

    def dynamic_shapes_reason(self, args):
        return dynamic_shapes_reason(args)

    def activation_bytes(self, args, local_batch, free_bytes):
        """A cheap upper bound first (fp32: ~16 D + 4 F values saved per token and layer, the S x S
        scores per head, three copies of the logits); only if that could come near the free memory,
        the dry run's traced figure (dryrun.saved_bytes_per_sequence, bf16, so doubled for fp32)."""
        B, S, L, a = local_batch, self.cfg.seq_len, args.n_layers, args
        ffn = a.top_k * a.moe_ffn_dim if a.n_experts else a.ffn_dim
        bound = 4 * (B * S * L * (16 * a.dim + 4 * ffn) + B * a.n_heads * S * S * L + 3 * B * S * a.vocab_size)
        if free_bytes is None or bound < free_bytes / 4:
            return bound
        import dryrun
        return 2 * B * dryrun.saved_bytes_per_sequence(args, S, remat=False)

    def plan_workload(self, args):
        import dryrun
        return dryrun.lm_workload(args, self.cfg.flavor, self.cfg.seq_len)

    def meta(self):
        return {"data": self.fingerprint,
                "tokenizer": os.path.abspath(self.cfg.tokenizer) if self.cfg.tokenizer else None}

    def preview(self, model, log, out_dir, step, final):
        """At the end, a few bytes sampled from the trained model (not for stacked blocks, which take no
        KV cache, nor for a vocabulary that is not bytes)."""
        n = self.cfg.sample_tokens
        if not final or not n or self.cfg.scan or self.cfg.tokenizer or model.args.vocab_size != data.BYTE_VOCAB:
            return
        import generate
        text, count = generate.byte_sample(model, n, self.cfg.seed)
        log({"event": "sample", "text": text}, f"sample ({count} bytes, temperature 0.8):\n{text}")

