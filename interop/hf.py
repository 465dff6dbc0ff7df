"""interop/hf.py: Hugging Face checkpoints in and out (Llama 3, Qwen 3, Qwen 3-MoE), like torchtitan's
state-dict adapters.

    model = hf.load("Qwen3-0.6B/")           # config.json + model.safetensors(.index.json) -> Transformer
    hf.save(model, "out/")                   # the other way: loads back bit for bit
    python -m interop.hf export runs/X out/          # a training run's newest checkpoint as a HF directory

model.py already uses Hugging Face's parameter names, so the mapping is short: a `model.` prefix, and
Qwen 3-MoE's per-expert Linear weights (F, D) stacked into our (E, D, F) grouped-matmul tensors
(transposed). Nothing is loaded as a different model than the files describe: config.json's fields
are type-checked (`true` is not a layer count), a value model.py does not implement (biases,
un-normalized top-k, dense layers inside a MoE model, another rope type, ...) is refused, and every
tensor of the files must be one the config implies, and each one it implies present, floating point,
of its shape; each refusal is one line. Weights are read tensor by tensor with `safetensors` (never
the whole file at once); under a mesh each rank reads only its own block of each weight, which
tensor parallelism cuts by columns as well as rows (`load_into`). An export is all or nothing: it is
written beside its target and renamed into place, and never mixes with files already there (`save`).
It carries the run's tokenizer, so that transformers' AutoTokenizer and `generate.py --hf` read it:
the files of the directory the run trained on (`--tokenizer`), else our bytes as a tokenizer.json
(`tokenizer.export_files`).
"""
import json
import math
import os
import re
import shutil
import sys

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import atomic
from run import checkpoint
from errors import BadInput
from parallel import local_box, local_tensor
from model import KIND, ModelArgs, Transformer, check_args
from interop import tokenizer
class HFError(BadInput):
    """An HF directory we cannot load exactly: one line, exit 2."""


MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
EXPERT_WEIGHTS = {"w_gate_ExDxF": "gate_proj", "w_up_ExDxF": "up_proj", "w_down_ExFxD": "down_proj"}


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelArgs

REQUIRED = object()
# Every config.json field we read: (type, default). JSON has one number type and true is not a
# layer count: an int field takes ints only (not true, 4.5 or "4"), a float field ints or floats,
# a bool field true / false. None in the type: null is allowed (HF's "derive it": head_dim).
FIELDS = {
    "hidden_size": (int, REQUIRED), "num_hidden_layers": (int, REQUIRED), "num_attention_heads": (int, REQUIRED),
    "num_key_value_heads": ((int, None), None), "head_dim": ((int, None), None), "vocab_size": (int, REQUIRED),
    "intermediate_size": (int, REQUIRED), "rms_norm_eps": (float, REQUIRED), "rope_theta": (float, 10000.0),
    "max_position_embeddings": (int, 2048), "tie_word_embeddings": (bool, False), "rope_scaling": ((dict, None), None),
    "hidden_act": (str, "silu"), "attention_bias": (bool, False), "mlp_bias": (bool, False),
    "use_sliding_window": (bool, False),
}
MOE_FIELDS = {"num_experts": (int, REQUIRED), "num_experts_per_tok": (int, REQUIRED),
              "moe_intermediate_size": (int, REQUIRED), "router_aux_loss_coef": (float, 0.001),
              "norm_topk_prob": (bool, False), "decoder_sparse_step": (int, 1), "mlp_only_layers": (list, [])}
ROPE_FIELDS = {"factor": (float, REQUIRED), "low_freq_factor": (float, REQUIRED), "high_freq_factor": (float, REQUIRED),
               "original_max_position_embeddings": (int, REQUIRED)}


def _is(v, kind):
    if kind is None or kind is bool:
        return v is None if kind is None else isinstance(v, bool)
    if isinstance(v, bool):  # (a bool is a Python int; here it is not a number)
        return False
    return isinstance(v, (int, float)) and math.isfinite(v) if kind is float else isinstance(v, kind)


def _typed(cfg, fields, where="config.json"):
    """{key: value} for `fields`, each present with its type or absent with a default; else HFError."""
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
             list: "a list", None: "null"}
    out = {}
    for key, (kind, default) in fields.items():
        kinds, v = kind if isinstance(kind, tuple) else (kind,), cfg.get(key, default)
        if v is REQUIRED:
            raise HFError(f"{where} has no {key!r}")
        if key in cfg and not any(_is(v, k) for k in kinds):
            raise HFError(f"{where}: {key} must be {' or '.join(names[k] for k in kinds)}, got {json.dumps(v)}")
        out[key] = float(v) if float in kinds and v is not None else v
    return out


def _read_fields(cfg):
    """config.json's fields we use, typed, after refusing what model.py does not implement."""
    if not isinstance(cfg, dict):
        raise HFError(f"config.json must be a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFError(f"model_type {mt!r} is not supported; choose one of {', '.join(MODEL_TYPES)}")
    f = _typed(cfg, {**FIELDS, **(MOE_FIELDS if mt == "qwen3_moe" else {})})
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if f[key]:
            raise HFError(f"config.json: {key}=True is not implemented by model.py")
    if f["hidden_act"] != "silu":
        raise HFError(f"config.json: hidden_act={f['hidden_act']!r} is not implemented (SwiGLU with silu only)")
    rope = f["rope_scaling"]
    if rope is not None:
        kind = rope.get("rope_type", rope.get("type"))
        if kind != "llama3":
            raise HFError(f"config.json: rope_scaling type {kind!r} is not implemented (llama3 only)")
        f["rope_scaling"] = _typed(rope, ROPE_FIELDS, "config.json: rope_scaling")
    if mt == "qwen3_moe":
        if not f["norm_topk_prob"]:
            raise HFError("config.json: norm_topk_prob=false is not implemented (top-k weights are renormalized)")
        if f["mlp_only_layers"] or f["decoder_sparse_step"] != 1:
            raise HFError("config.json: dense layers inside a MoE model (mlp_only_layers / decoder_sparse_step) "
                          "are not implemented")
    return mt, f


def args_from_config(cfg):
    """ModelArgs for a HF config dict (raises HFError for what model.py does not implement)."""
    mt, f = _read_fields(cfg)
    rope, moe = f["rope_scaling"], mt == "qwen3_moe"
    args = ModelArgs(
        dim=f["hidden_size"], n_layers=f["num_hidden_layers"], n_heads=f["num_attention_heads"],
        n_kv_heads=f["num_key_value_heads"] or f["num_attention_heads"], head_dim=f["head_dim"],
        vocab_size=f["vocab_size"], ffn_dim=f["intermediate_size"], norm_eps=f["rms_norm_eps"],
        rope_theta=f["rope_theta"], max_seq_len=f["max_position_embeddings"],
        rope_scaling=None if rope is None else (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                                rope["original_max_position_embeddings"]),
        tie_embeddings=f["tie_word_embeddings"], qk_norm=mt in ("qwen3", "qwen3_moe"),
        n_experts=f["num_experts"] if moe else 0, top_k=f["num_experts_per_tok"] if moe else 0,
        moe_ffn_dim=f["moe_intermediate_size"] if moe else 0,
        aux_loss_coef=f["router_aux_loss_coef"] if moe else ModelArgs.aux_loss_coef)
    try:
        check_args(args)
    except ValueError as e:
        raise HFError(f"config.json describes no valid model: {e}") from None
    return args


def config_from_args(args):
    """The HF config dict for our ModelArgs (model_type from the architecture)."""
    if args.sliding_window is not None:  # (doc_sep is how a run packed its data: the weights export as they are)
        raise HFError(f"sliding_window={args.sliding_window}: a windowed model has no Llama / Qwen 3 config here")
    mt = "qwen3_moe" if args.n_experts else "qwen3" if args.qk_norm else "llama"
    cfg = {"model_type": mt, "architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                                "qwen3_moe": "Qwen3MoeForCausalLM"}[mt]],
           "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
           "num_key_value_heads": args.n_kv_heads, "head_dim": args.hd, "vocab_size": args.vocab_size,
           "intermediate_size": args.ffn_dim, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
           "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
           "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32"}
    if args.rope_scaling is not None:
        f, lo, hi, ctx = args.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
                               "original_max_position_embeddings": ctx}
    if args.n_experts:
        cfg.update(num_experts=args.n_experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_ffn_dim,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=args.aux_loss_coef)
    return cfg


def read_config(path):
    """config.json as a dict (HFError if missing, not JSON, or not an object)."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        if os.path.isdir(os.path.join(path, "checkpoints")):  # (a train.py run: no HF directory yet)
            raise HFError(f"{path} is a train.py run, not a Hugging Face directory: `python -m interop.hf export "
                          f"{path} OUT_DIR` makes one") from None
        raise HFError(f"{file}: missing or unreadable ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{file} must be a JSON object, got {type(cfg).__name__}")
    return cfg


# ------------------------------------------------------------------------------------------------
# Weights: which HF tensors make each of our parameters

def _hf_keys(name, n_experts):
    """Our parameter name -> the HF keys it is made of (one, or one per expert)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in EXPERT_WEIGHTS:  # layers.i.mlp.w_gate_ExDxF <- model.layers.i.mlp.experts.e.gate_proj.weight
        prefix = name.rsplit(".", 1)[0]
        return [f"model.{prefix}.experts.{e}.{EXPERT_WEIGHTS[leaf]}.weight" for e in range(n_experts)]
    return [name if name == "lm_head.weight" else f"model.{name}"]


IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")  # a derived buffer older exports carry (transformers skips it too)
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")        # safetensors' names; an int8 / fp8 weight needs its scales


def _summary(keys, n=4):
    """A short, readable list of tensor names in natural order; many become whole layers (`model.layers.7.*`)."""
    groups = set(keys) if len(keys) <= n else {re.sub(r"^(model\.layers\.\d+)\..*", r"\1.*", k) for k in keys}
    ordered = sorted(groups, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])
    return ", ".join(ordered[:n]) + (f" and {len(ordered) - n} more" if len(ordered) > n else "")


class Reader:
    """Tensors by HF key across the files of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path):
        index, single = (os.path.join(path, f) for f in ("model.safetensors.index.json", "model.safetensors"))
        if os.path.exists(index) and os.path.exists(single):  # e.g. an unsharded export over a sharded one
            raise HFError(f"{path} holds both model.safetensors and model.safetensors.index.json: which one is "
                          f"the model is ambiguous; remove the stale one")
        self.files = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    self.where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
            except Exception as e:  # unreadable, not JSON, no weight_map of names
                raise HFError(f"{index}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
        elif os.path.exists(single):
            self.where = dict.fromkeys(self._file(single).keys(), single)
        else:
            raise HFError(f"{path} has no model.safetensors or model.safetensors.index.json")
        for file in set(self.where.values()):  # the index and its shards agree (no tensor the index omits)
            listed = {k for k, v in self.where.items() if v == file}
            if set(self._file(file).keys()) != listed:
                raise HFError(f"{file} and model.safetensors.index.json disagree on "
                              f"{_summary(set(self._file(file).keys()) ^ listed)}")

    def _file(self, file):
        if file not in self.files:
            try:
                self.files[file] = safe_open(file, "pt")
            except Exception as e:  # missing, truncated, not safetensors
                raise HFError(f"{file}: unreadable ({str(e).splitlines()[0][:120]})") from None
        return self.files[file]

    def info(self, key):
        """(shape, safetensors dtype name) of tensor `key`, from the file's header."""
        part = self._file(self.where[key]).get_slice(key)
        return list(part.get_shape()), part.get_dtype()

    def read(self, key, box):
        """The block of tensor `key` given by `box`, [start, stop) per dim, read without the rest."""
        return self._file(self.where[key]).get_slice(key)[tuple(slice(a, b) for a, b in box)]


def _expected_tensors(params):
    """{HF key: the shape config.json implies} for our parameters (expert tensors (F, D), unstacked)."""
    want = {}
    for name, p in params.items():
        keys = _hf_keys(name, p.shape[0])
        want.update({k: list(p.shape) if len(keys) == 1 else list(p.shape[1:])[::-1] for k in keys})
    return want


def _check_tensors(reader, want, tied):
    """Refuse before reading a weight: a tensor of the files the config does not describe (it would
    be dropped), one it implies that is missing, a shape that differs, a non-float dtype."""
    have = {k for k in reader.where if not IGNORED.search(k)}
    extra = have - want.keys()
    if tied and "lm_head.weight" in extra:  # a tied model's copy of the head: fine if it IS the embedding
        box = [(0, n) for n in reader.info("lm_head.weight")[0]]
        if reader.info("lm_head.weight")[0] == want["model.embed_tokens.weight"] and torch.equal(
                reader.read("lm_head.weight", box), reader.read("model.embed_tokens.weight", box)):
            extra.discard("lm_head.weight")
    if extra:
        raise HFError(f"the checkpoint holds {len(extra)} tensors config.json does not describe (they would be "
                      f"dropped): {_summary(extra)}")
    missing = want.keys() - have
    if missing:
        raise HFError(f"the checkpoint lacks {len(missing)} tensors config.json implies: {_summary(missing)}")
    for key, shape in want.items():
        got, dtype = reader.info(key)
        if got != shape:
            raise HFError(f"{key} has shape {got}, config.json implies {shape}")
        if dtype not in FLOAT_DTYPES:
            raise HFError(f"{key} is {dtype}: only floating-point weights load ({', '.join(FLOAT_DTYPES)}); a "
                          f"quantized checkpoint is not supported")


def read_param(reader, name, shape, box):
    """The block `box` ([start, stop) per dim) of our parameter `name` (full `shape`) from its HF tensors."""
    keys = _hf_keys(name, shape[0])
    if len(keys) == 1:
        return reader.read(keys[0], box)
    # experts: ours (E, D, F) [e, i, j] is expert e's HF (F, D) [j, i]: one tensor per expert, transposed
    experts = [reader.read(keys[e], box[:0:-1]).T for e in range(*box[0])]
    return torch.stack(experts) if experts else torch.empty([b - a for a, b in box])


@torch.no_grad()
def load_into(model, path):
    """Fill `model` (ours, plain or sharded: SimpleFSDP / FSDP2 / tensor parallel DTensors) with the HF
    weights at `path`. A sharded parameter reads only its own block, an offset and a size in every
    dim: tensor parallelism splits columns, and under FSDP x TP a weight is split in two dims. Every
    tensor of the files is used and every one the config implies is there. Dtypes convert."""
    reader = Reader(path)
    params = dict(model.named_parameters())
    _check_tensors(reader, _expected_tensors(params), model.args.tie_embeddings)
    for name, p in params.items():
        target = local_tensor(p)
        block = read_param(reader, name, tuple(p.shape), local_box(p))
        if not torch.isfinite(block).all():  # NaN weights would log a NaN loss only after a step trained
            keys = _hf_keys(name, p.shape[0])
            raise HFError(f"{path}: {keys[0] if len(keys) == 1 else name} holds non-finite values (NaN or Inf): "
                          f"these weights cannot be trained from")
        target.copy_(block.to(target.dtype))
        if not torch.isfinite(target).all():  # (finite in float64, beyond the parameter's dtype)
            raise HFError(f"{path}: {name}'s values overflow {target.dtype} (its largest is {block.abs().max().item():g})")
    return model


def load(path, device="cpu"):
    """A Transformer with the weights of the HF directory `path` (fp32)."""
    args = args_from_config(read_config(path))
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_buffers()  # the rope frequencies; every parameter is overwritten below
    return load_into(model, path)


@torch.no_grad()
def hf_tensors(named_params):
    """(name, full tensor) pairs of our parameters -> {HF name: tensor} (experts unstacked), contiguous."""
    out = {}
    for name, p in named_params:
        keys = _hf_keys(name, p.shape[0])
        if len(keys) == 1:
            out[keys[0]] = p.detach().contiguous()
        else:
            out.update({k: p[e].detach().T.contiguous() for e, k in enumerate(keys)})
    return out


def hf_state_dict(model):
    """Our parameters under HF names (experts unstacked), contiguous, as stored."""
    return hf_tensors(model.named_parameters())


def _write_files(model, out, max_shard_bytes, files, eos_id):
    """config.json (with `eos_id` as its eos_token_id, where not None) and safetensors into the directory
    `out` (sharded with an index above `max_shard_bytes`), and `files` ({name: bytes}) beside them."""
    tensors, shards, size = hf_state_dict(model), [{}], 0
    for key, t in tensors.items():
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.numel() * t.element_size()
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    config = config_from_args(model.args)
    jsons = {"config.json": config if eos_id is None else {**config, "eos_token_id": eos_id}}
    if len(shards) > 1:
        jsons["model.safetensors.index.json"] = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
    for name, shard in [*zip(names, shards), *jsons.items(), *files.items()]:
        file = os.path.join(out, name)
        try:
            if name in files:
                with open(file, "wb") as f:
                    f.write(shard)
            elif name in jsons:
                with open(file, "w") as f:
                    json.dump(shard, f, indent=2)
            else:
                save_file(shard, file, metadata={"format": "pt"})
            atomic.fsync(file)  # on disk before the rename makes it part of the export
        except (OSError, SafetensorError) as e:  # disk full, file-size limit (safetensors' Rust writer: its own error)
            raise OSError(f"writing {name} failed: {getattr(e, 'strerror', None) or e}") from None


def check_target(path, overwrite=False, source=None):
    """Refuse an export target that is a file, a non-empty directory unless `overwrite`, or part of the
    run `source` it reads (checkpoint.overlaps_run: --overwrite replaced the run's checkpoints)."""
    if source is not None and checkpoint.overlaps_run(path, source):
        raise HFError(f"{path} overlaps the run it would export ({source}): an export there would replace the "
                      f"run's checkpoints; choose a directory outside the run")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise HFError(f"{path} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise HFError(f"{path} is not empty ({_summary(os.listdir(path), 3)}); an export writes a whole "
                      f"directory: pass --overwrite to replace it, or choose a new one")


def save(model, path, max_shard_bytes=5 * 2**30, overwrite=False, files=None, eos_id=None):
    """Write `model` (and `files`, {name: bytes}: a tokenizer's; `eos_id`: the token its samples end
    with, as config.json's eos_token_id) as the HF directory `path`, all or nothing: the files go to
    a temporary directory beside it, fsynced, then renamed into place. A failed write removes it and
    leaves `path` as it was; a non-empty `path` is refused unless `overwrite`, which replaces the
    directory whole (no old shard or index survives to be loaded instead of the new weights)."""
    check_target(path, overwrite)
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    tmp = os.path.join(parent, f".{base}.tmp-{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        for stale in (tmp, tmp + ".old"):  # (left by a killed export with this pid)
            shutil.rmtree(stale, ignore_errors=True)
        os.mkdir(tmp)
    except OSError as e:
        raise HFError(f"cannot write {path}: {e.strerror}: {e.filename}") from None
    try:
        _write_files(model, tmp, max_shard_bytes, files or {}, eos_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic.replace_dir(tmp, path)  # (--overwrite: the old directory is replaced whole)
    return path


def main(argv):
    """python -m interop.hf export RUN_DIR OUT_DIR [--overwrite]: a training run's newest checkpoint as a HF
    directory. Exit 0 done, 2 bad input (nothing written), 5 a write failed (OUT_DIR as it was)."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m interop.hf", description="a training run's newest checkpoint as a HF directory")
    p.add_argument("command", choices=["export"])
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR (whole, atomically)")
    cfg = p.parse_args(argv)
    try:
        check_target(cfg.out_dir, cfg.overwrite, cfg.run_dir)  # before the (maybe large) checkpoint is read
        model, meta = checkpoint.load_run(cfg.run_dir, kind=KIND)
        tokenizer_files = tokenizer.export_files(meta, model.args.max_seq_len)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        print(f"wrote {save(model, cfg.out_dir, overwrite=cfg.overwrite, files=tokenizer_files, eos_id=meta.get('eos_id'))}")
        return 0
    except HFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, file-size limit: nothing of it is left, OUT_DIR is as it was
        what = f"{e.strerror}: {e.filename}" if e.filename else str(e)
        print(f"error: a write failed: {what}; {cfg.out_dir} is as it was", file=sys.stderr)
        return 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
