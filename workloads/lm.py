"""workloads/lm.py: the language-model family (Llama 3 / Qwen 3 / Qwen 3-MoE, model.py) and its
pretraining workload, next-token prediction on bytes or a Hugging Face tokenizer's ids (task.py's
two interfaces).

    python train.py                                   # llama3_debug on this Python's stdlib sources
    python train.py --data FILE --tokenizer HF_DIR    # a text corpus through a tokenizer.json

`LanguageModelFamily` is what GRPO and its supervised warm start (rl/) reuse: the same model, sizing,
records, pretrained loading and dry-run plan, with their own data and loss.
"""
import dataclasses
import os
from typing import Optional

import data
from interop import hf
from run.checkpoint import CheckpointError
from run.flags import flag, with_overrides
from errors import ConfigError
from model import (FLAVORS, KIND, ModelArgs, MoE, Transformer, check_args, dynamic_shapes_reason, flops_per_token,
                   init_value, next_token_loss, param_counts, tpu_config)
from task import ModelFamily, Workload
import expert_parallel
import tensor_parallel
import layer_scan
from planner.activations import saved_bytes_per_sequence
from planner import dryrun
import generate


class LanguageModelFamily(ModelFamily):
    """model.Transformer from a flavor (or a Hugging Face directory's config) with --set applied and,
    for --kernels pallas, the TPU kernels swapped in by a config rewrite."""
    model_parallel, kind = ("tp", "ep"), KIND
    # (no weight changes with these: the load-balancing loss's weight, how tokens are grouped for routing,
    # and which rows ep's exchange may drop, MaxText's capacity factor; a run may retune them between restarts)
    resume_settings = ("aux_loss_coef", "moe_groups", "ep_buffer_factor")

    def __init__(self, cfg, args=None, byte_vocab=True):
        self.cfg = cfg  # (None for a family made from a checkpoint's record)
        super().__init__(args if args is not None else self.args_from_cli(cfg, byte_vocab))

    @classmethod
    def from_record(cls, meta, where):
        saved = meta.get("model_args")
        if not isinstance(saved, dict):
            raise CheckpointError(f"{where} records no model_args")
        train = meta.get("train") if isinstance(meta.get("train"), dict) else {}
        saved = {**saved, **{k: train[k] for k in cls.resume_settings if k in train}}  # (run_record keeps them there)
        unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(ModelArgs)})
        if unknown:
            raise CheckpointError(f"{where}: model_args {', '.join(unknown)} unknown to this version (a checkpoint "
                                  f"written by another version)")
        try:
            args = ModelArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
            check_args(args)
        except (TypeError, ValueError) as e:  # a value of the wrong type or out of range
            raise CheckpointError(f"{where}: model_args describe no model "
                                  f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
        return LanguageModelFamily(None, args)  # (a policy run too: its model is this family's)

    @staticmethod
    def args_from_cli(cfg, byte_vocab):
        if cfg.init_from:
            args = hf.args_from_config(hf.read_config(cfg.init_from))
        elif cfg.flavor not in FLAVORS:
            raise ConfigError(f"unknown flavor {cfg.flavor!r}; choose one of {', '.join(FLAVORS)}")
        else:
            args = FLAVORS[cfg.flavor]
        try:
            args = with_overrides(args, cfg.set)
            if byte_vocab and args.vocab_size < data.BYTE_VOCAB:
                raise ValueError(f"vocab_size {args.vocab_size} is smaller than the data's {data.BYTE_VOCAB} byte values")
            args = tpu_config(args) if cfg.kernels == "pallas" else args
            check_args(args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return args

    def build(self, args):
        return Transformer(args)

    def param_count(self, args):
        return param_counts(args)[0]

    def initializer(self, model):
        return lambda name, shape, generator: init_value(model.args, name, shape, generator)

    def init_buffers(self, model):
        model.init_buffers()

    def layout_args(self, args, tp, ep):
        """Refuse what tensor / expert parallelism cannot split, and a setting only ep uses without it;
        under tp, the loss over the vocabulary split."""
        for refusal in (tensor_parallel.check(args, tp) if tp > 1 else None,
                        expert_parallel.check(args, ep) if ep > 1 else None, expert_parallel.check_buffer_factor(args, ep)):
            if refusal:
                raise ValueError(refusal)
        return tensor_parallel.config(args) if tp > 1 else args

    def parallelize(self, model, tp_mesh=None, ep_mesh=None, sequence=None):
        """Llama / Qwen 3 / Qwen 3-MoE's whole parallelization, in order (torchtitan's parallelize_llama);
        the layout then shards what this returns data-parallel (SimpleFSDP or FSDP2, mesh.py; GSPMD, spmd.py):
          1. tensor parallel over tp_mesh: Megatron's column / row split of attention and the MLP, the
             norms' activations split by sequence between them (tensor_parallel.py); the loss runs over
             the vocabulary split (the config's loss, which layout_args chose);
          2. expert parallel over ep_mesh: each MoE's rows routed to the ranks that own their experts
             (expert_parallel.py); the experts are returned, for the data-parallel shards to split over ep;
          3. context parallel: the model runs this process's chunks of every `sequence`
             (context_parallel.py)."""
        if tp_mesh is not None:
            tensor_parallel.parallelize(model, tp_mesh)
        if ep_mesh is not None:
            for block in self._blocks_with_experts(model):
                expert_parallel.parallelize(block, ep_mesh)
        if sequence is not None:
            model.split_sequence(sequence)
        return self.moe_modules(model) if ep_mesh is not None else []

    @staticmethod
    def _blocks_with_experts(model):
        """The model and, under --scan, each stack's one block, which all its layers run (so its MoE is
        routed once for all of them): the modules that hold every MoE."""
        return [model, *(m.block() for m in model.modules() if isinstance(m, layer_scan.StackedLayers))]

    def moe_modules(self, model):
        """Every MoE module of `model` (under --scan: of its stacks' blocks)."""
        return [m for block in self._blocks_with_experts(model) for m in block.modules() if isinstance(m, MoE)]

    def scan_stacks(self, model):
        return [(model, "layers")]

    def blocks(self, model):
        return list(model.layers)

    def label(self):
        return f"hf:{os.path.abspath(self.cfg.init_from)}" if self.cfg.init_from else self.cfg.flavor

    def record(self, args):
        """Implementations (attention, loss, experts) may change across resumes: not recorded."""
        d = super().record(args)
        for key in ("attn_impl", "loss_impl", "moe_impl"):
            d.pop(key)
        return d

    def load_pretrained(self, model):
        if self.cfg.init_from:
            hf.load_into(model, self.cfg.init_from)

    def dynamic_shapes_reason(self, args):
        return dynamic_shapes_reason(args)

    def activation_bytes(self, args, local_batch, seq_len, free_bytes):
        """A cheap upper bound first (fp32: ~16 D + 4 F values saved per token and layer, the S x S
        scores per head, three copies of the logits); only if that could come near the free memory,
        the dry run's traced figure (planner/activations.py, bf16, so doubled for fp32)."""
        B, S, L, a = local_batch, seq_len, args.n_layers, args
        ffn = a.top_k * a.moe_ffn_dim if a.n_experts else a.ffn_dim
        bound = 4 * (B * S * L * (16 * a.dim + 4 * ffn) + B * a.n_heads * S * S * L + 3 * B * S * a.vocab_size)
        if free_bytes is None or bound < free_bytes / 4:
            return bound
        return 2 * B * saved_bytes_per_sequence(args, S, remat=False)

    def plan(self, args, cfg):
        return dryrun.lm_workload(args, cfg.flavor, cfg.seq_len)


@dataclasses.dataclass
class PretrainingFlags:
    data: Optional[str] = flag(None, "lm: a text file or directory (default: this Python's stdlib sources)")
    tokenizer: Optional[str] = flag(None, "lm: train on the ids of a HF tokenizer.json (default: bytes)", metavar="HF_DIR")
    sample_tokens: int = flag(64, "lm: at the end, print this many sampled bytes (0: off)")


class Pretraining(Workload):
    """Next-token prediction on a text corpus: the batches are data.Batches, the loss model.next_token_loss."""
    name, default_flavor, Flags, unit = "lm", "llama3_debug", PretrainingFlags, "tok"
    family_class, resume_policy = LanguageModelFamily, {"data": True, "tokenizer": True}
    splits_sequences = True  # (next_token_loss: every target counts)

    @classmethod
    def check_flags(cls, cfg):
        if cfg.sample_tokens < 0:
            raise ConfigError(f"--sample-tokens must be >= 0, got {cfg.sample_tokens}")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.notes = []
        self.family = LanguageModelFamily(cfg, byte_vocab=not cfg.tokenizer)
        if cfg.seq_len > self.args.max_seq_len:
            raise ConfigError(f"--seq-len {cfg.seq_len} exceeds the model's max_seq_len {self.args.max_seq_len}")

    @classmethod
    def loss_reduction(cls, cfg):
        """Every position of every row is a target: microbatches of equal rows average (step.py)."""
        return "mean"

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

    def batch(self, step):
        return self.batches.get(step, self.dp_rank)  # (inputs, targets), each (B / dp, S)

    loss = staticmethod(next_token_loss)

    @property
    def units_per_step(self):
        return self.cfg.batch_size * self.cfg.seq_len

    def flops_per_step(self, args):
        return flops_per_token(args, self.cfg.seq_len) * self.units_per_step

    def attach(self, model, parallel):
        self.moes, self.device = self.family.moe_modules(model), parallel.device

    def step_metrics(self):
        """ep_dropped: the share of the routed rows ep's exchange dropped (a buffer factor) since the last
        logged step, over every rank (a collective: every rank logs the same steps); absent where
        nothing was counted (no factor, or a traced step or --scan block: their counts stay in the graph)."""
        share = expert_parallel.dropped_share(self.moes, self.device)
        return {} if share is None else {"ep_dropped": share}

    def meta(self):
        return {"data": self.fingerprint,
                "tokenizer": os.path.abspath(self.cfg.tokenizer) if self.cfg.tokenizer else None}

    def preview(self, model, log, out_dir, step, final):
        """At the end, a few bytes sampled from the trained model (not for stacked blocks, which take no
        KV cache, nor for a vocabulary that is not bytes)."""
        n = self.cfg.sample_tokens
        if not final or not n or self.cfg.scan or self.cfg.tokenizer or model.args.vocab_size != data.BYTE_VOCAB:
            return
        text, count = generate.byte_sample(model, n, self.cfg.seed)
        log({"event": "sample", "text": text}, f"sample ({count} bytes, temperature 0.8):\n{text}")
