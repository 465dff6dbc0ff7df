"""hf.py: Hugging Face checkpoints in and out (Llama 3, Qwen 3, Qwen 3-MoE), like torchtitan's
state-dict adapters.

    model = hf.load("Qwen3-0.6B/")           # config.json + model.safetensors(.index.json) -> Transformer
    hf.save(model, "out/")                   # the other way: loads back bit for bit
    python hf.py export runs/X out/          # a training run's newest checkpoint as a HF directory

model.py already uses Hugging Face's parameter names, so the mapping is short: a `model.` prefix, and
Qwen 3-MoE's per-expert Linear weights (F, D) stacked into our (E, D, F) grouped-matmul tensors
(transposed). A config value our model does not implement (biases, un-normalized top-k, dense layers
inside a MoE model, another rope type, ...) is refused in one line, never loaded as a different model.
Weights are read tensor by tensor with `safetensors` (never the whole file at once); under a mesh
each rank reads only the rows of its own shard (`load_into`).
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import ModelArgs, Transformer, check_args


class HFError(ValueError):
    """An HF directory we cannot load exactly: one line, exit 2."""


MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
EXPERT_WEIGHTS = {"w_gate_ExDxF": "gate_proj", "w_up_ExDxF": "up_proj", "w_down_ExFxD": "down_proj"}


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelArgs

def _refuse_unsupported(cfg):
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFError(f"model_type {mt!r} is not supported; choose one of {', '.join(MODEL_TYPES)}")
    unsupported = [("attention_bias", True), ("mlp_bias", True), ("use_sliding_window", True)]
    for key, bad in unsupported:
        if cfg.get(key) == bad:
            raise HFError(f"config.json: {key}={bad} is not implemented by model.py")
    if cfg.get("hidden_act", "silu") != "silu":
        raise HFError(f"config.json: hidden_act={cfg['hidden_act']!r} is not implemented (SwiGLU with silu only)")
    rope = cfg.get("rope_scaling")
    if rope is not None and rope.get("rope_type", rope.get("type")) != "llama3":
        raise HFError(f"config.json: rope_scaling type {rope.get('rope_type', rope.get('type'))!r} is not "
                      f"implemented (llama3 only)")
    if mt == "qwen3_moe":
        if not cfg.get("norm_topk_prob", False):
            raise HFError("config.json: norm_topk_prob=false is not implemented (top-k weights are renormalized)")
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise HFError("config.json: dense layers inside a MoE model (mlp_only_layers / decoder_sparse_step) "
                          "are not implemented")


def args_from_config(cfg):
    """ModelArgs for a HF config dict (raises HFError for what model.py does not implement)."""
    _refuse_unsupported(cfg)
    mt, rope = cfg["model_type"], cfg.get("rope_scaling")
    try:
        args = ModelArgs(
            dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]), head_dim=cfg.get("head_dim"),
            vocab_size=cfg["vocab_size"], ffn_dim=cfg["intermediate_size"], norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg.get("rope_theta", 10000.0), max_seq_len=cfg.get("max_position_embeddings", 2048),
            rope_scaling=None if rope is None else (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                                                    rope["original_max_position_embeddings"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=mt in ("qwen3", "qwen3_moe"),
            n_experts=cfg.get("num_experts", 0) if mt == "qwen3_moe" else 0,
            top_k=cfg.get("num_experts_per_tok", 0) if mt == "qwen3_moe" else 0,
            moe_ffn_dim=cfg.get("moe_intermediate_size", 0) if mt == "qwen3_moe" else 0,
            aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001))
        check_args(args)
    except KeyError as e:
        raise HFError(f"config.json has no {e.args[0]!r}") from None
    except ValueError as e:
        raise HFError(f"config.json describes no valid model: {e}") from None
    return args


def config_from_args(args):
    """The HF config dict for our ModelArgs (model_type from the architecture)."""
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
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise HFError(f"{os.path.join(path, 'config.json')}: missing or unreadable ({type(e).__name__})") from None


# ------------------------------------------------------------------------------------------------
# Weights: which HF tensors make each of our parameters

def _hf_keys(name, n_experts):
    """Our parameter name -> the HF keys it is made of (one, or one per expert)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in EXPERT_WEIGHTS:  # layers.i.mlp.w_gate_ExDxF <- model.layers.i.mlp.experts.e.gate_proj.weight
        prefix = name.rsplit(".", 1)[0]
        return [f"model.{prefix}.experts.{e}.{EXPERT_WEIGHTS[leaf]}.weight" for e in range(n_experts)]
    return [name if name == "lm_head.weight" else f"model.{name}"]


class _Reader:
    """Tensors by HF key across the files of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path):
        index = os.path.join(path, "model.safetensors.index.json")
        try:
            if os.path.exists(index):
                with open(index) as f:
                    self.where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
            else:
                single = os.path.join(path, "model.safetensors")
                with safe_open(single, "pt") as f:
                    self.where = {k: single for k in f.keys()}
        except Exception as e:  # missing, truncated, not JSON / safetensors
            raise HFError(f"{path}: no readable model.safetensors or model.safetensors.index.json "
                          f"({str(e).splitlines()[0][:120]})") from None
        self.files = {}

    def _part(self, key):
        if key not in self.where:
            raise HFError(f"the checkpoint has no tensor {key!r}")
        path = self.where[key]
        if path not in self.files:
            try:
                self.files[path] = safe_open(path, "pt")
            except Exception as e:  # missing, truncated, not safetensors
                raise HFError(f"{path}: unreadable ({str(e).splitlines()[0][:120]})") from None
        return self.files[path].get_slice(key)

    def shape(self, key):
        return list(self._part(key).get_shape())

    def slice(self, key, rows=None):
        """Rows [a, b) of tensor `key` (all rows when None), read from disk without the rest."""
        part = self._part(key)
        return part[:] if rows is None else part[rows[0]:rows[1]]


def _read_param(reader, name, shape, rows):
    """Our parameter `name` (full `shape`), rows [a, b) of dim 0, built from its HF tensors."""
    keys = _hf_keys(name, shape[0])
    if len(keys) == 1:
        if reader.shape(keys[0]) != list(shape):
            raise HFError(f"{keys[0]} has shape {reader.shape(keys[0])}, config.json implies {list(shape)}")
        return reader.slice(keys[0], rows)
    experts = []  # (E, D, F) from E tensors of (F, D): one expert per row of dim 0, transposed
    for e in range(rows[0], rows[1]):
        w = reader.slice(keys[e])
        if tuple(w.T.shape) != tuple(shape[1:]):
            raise HFError(f"{keys[e]} has shape {list(w.shape)}, config.json implies {list(shape[1:])[::-1]}")
        experts.append(w.T)
    return torch.stack(experts) if experts else torch.empty(0, *shape[1:])


@torch.no_grad()
def load_into(model, path):
    """Fill `model` (ours, maybe sharded by SimpleFSDP / FSDP2 on dim 0) with the HF weights at
    `path`; a sharded parameter reads only its own rows. Dtypes convert to the parameter's."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    reader = _Reader(path)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if isinstance(p, DTensor):
            local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            rows, target = (offset[0], offset[0] + local_shape[0]), p.to_local()
        else:
            rows, target = (0, p.shape[0]), p
        target.copy_(_read_param(reader, name, tuple(p.shape), rows).to(target.dtype))
    return model


def load(path, device="cpu"):
    """A Transformer with the weights of the HF directory `path` (fp32)."""
    args = args_from_config(read_config(path))
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()  # buffers (rope frequencies); every parameter is overwritten below
    return load_into(model, path)


@torch.no_grad()
def hf_state_dict(model):
    """Our parameters under HF names (experts unstacked), contiguous, as stored."""
    out = {}
    for name, p in model.named_parameters():
        keys = _hf_keys(name, p.shape[0])
        if len(keys) == 1:
            out[keys[0]] = p.detach().contiguous()
        else:
            out.update({k: p[e].detach().T.contiguous() for e, k in enumerate(keys)})
    return out


def save(model, path, max_shard_bytes=5 * 2**30):
    """Write config.json and safetensors (sharded with an index above `max_shard_bytes`)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_from_args(model.args), f, indent=2)
    tensors, shards, size = hf_state_dict(model), [{}], 0
    for key, t in tensors.items():
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.numel() * t.element_size()
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                   "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}, f, indent=2)
    return path


def main(argv):
    """python hf.py export RUN_DIR OUT_DIR: a training run's newest checkpoint as a HF directory."""
    import generate
    if len(argv) != 3 or argv[0] != "export":
        print("usage: python hf.py export RUN_DIR OUT_DIR", file=sys.stderr)
        return 2
    try:
        model = generate.load_run(argv[1])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {save(model, argv[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
