"""flux/hf.py: diffusers `FluxTransformer2DModel` directories in and out (config.json + safetensors),
like torchtitan's flux state_dict_adapter.

    model = flux_hf.load("FLUX.1-dev/transformer/")   # -> flux.Flux, BFL's layout
    args = flux_hf.read_args(d); state = flux_hf.read_state(d, args)   # the pieces (train.py --init-from)
    flux_hf.save(model, "out/")                       # the other way: loads back bit for bit
    python -m flux.hf export RUN_DIR PIPE_COPY/transformer   # a run's transformer, for FluxPipeline

diffusers renames every module, and differs in layout in three places, mapped both ways here:
- a double block's fused `qkv` (per stream) is three Linears: to_q / to_k / to_v (image),
  add_q_proj / add_k_proj / add_v_proj (text);
- a single block's fused `linear1` (q | k | v | mlp in) is to_q, to_k, to_v and proj_mlp;
- the final adaLN (`norm_out.linear`, AdaLayerNormContinuous) emits (scale, shift) where BFL's
  LastLayer emits (shift, scale): the two halves of its rows swap.
A config value flux/model.py does not implement (another patch size, an unknown key) is refused in one
line (FluxHFError), never loaded as a different model; every tensor of the checkpoint must be used
and every expected one present, with its shape.
"""
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import atomic
from errors import BadInput
from flux.model import Flux, FluxArgs, check_args
from interop import hf
from run import checkpoint
from flux.model import KIND

WEIGHTS = "diffusion_pytorch_model.safetensors"
CONFIG_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "patch_size", "in_channels", "out_channels",
               "num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "pooled_projection_dim", "guidance_embeds", "axes_dims_rope"}


class FluxHFError(BadInput):
    """A diffusers directory we cannot load (or a model we cannot write) exactly: one line, exit 2."""


# ------------------------------------------------------------------------------------------------
# config.json <-> FluxArgs

# config.json's fields flux/model.py reads: (JSON type(s), diffusers' default); typed as interop/hf.py types a
# language model's ("false" is not a bool, 2.9 not a layer count: refused, never coerced)
CONFIG_FIELDS = {"patch_size": (int, 1), "in_channels": (int, 64), "out_channels": ((int, None), None),
                 "num_layers": (int, 19), "num_single_layers": (int, 38), "attention_head_dim": (int, 128),
                 "num_attention_heads": (int, 24), "joint_attention_dim": (int, 4096),
                 "pooled_projection_dim": (int, 768), "guidance_embeds": (bool, False),
                 "axes_dims_rope": (list, [16, 56, 56])}


def args_from_config(cfg):
    if not isinstance(cfg, dict):
        raise FluxHFError(f"config.json must be a JSON object, got {type(cfg).__name__}")
    if cfg.get("_class_name") != "FluxTransformer2DModel":
        raise FluxHFError(f"config.json: _class_name {cfg.get('_class_name')!r} is not FluxTransformer2DModel")
    unknown = sorted(set(cfg) - CONFIG_KEYS)
    if unknown:
        raise FluxHFError(f"config.json: {', '.join(unknown)} not implemented by flux/model.py")
    try:
        f = hf._typed(cfg, CONFIG_FIELDS)
    except hf.HFError as e:
        raise FluxHFError(str(e)) from None
    if not all(hf._is(d, int) for d in f["axes_dims_rope"]):
        raise FluxHFError(f"config.json: axes_dims_rope must be a list of integers, got {json.dumps(cfg['axes_dims_rope'])}")
    if f["patch_size"] != 1:
        raise FluxHFError(f"config.json: patch_size={cfg['patch_size']} is not implemented (latents are packed "
                          f"2x2 outside the transformer; patch_size 1 only)")
    heads, head_dim = f["num_attention_heads"], f["attention_head_dim"]
    a = FluxArgs(in_channels=f["in_channels"],
                 out_channels=f["in_channels"] if f["out_channels"] is None else f["out_channels"],
                 vec_in_dim=f["pooled_projection_dim"], context_in_dim=f["joint_attention_dim"],
                 hidden_size=heads * head_dim, num_heads=heads, depth=f["num_layers"],
                 depth_single_blocks=f["num_single_layers"], axes_dim=tuple(f["axes_dims_rope"]),
                 guidance_embed=f["guidance_embeds"])
    try:
        if head_dim <= 0:
            raise ValueError(f"attention_head_dim must be positive (got {head_dim})")
        check_args(a)
    except (TypeError, ValueError) as e:
        raise FluxHFError(f"config.json: {str(e).splitlines()[0]}") from None
    return a


def config_from_args(a: FluxArgs):
    """diffusers hard-codes what FluxArgs leaves open: say so rather than write a different model."""
    for field, want in (("mlp_ratio", 4.0), ("theta", 10_000), ("qkv_bias", True)):
        if getattr(a, field) != want:
            raise FluxHFError(f"{field}={getattr(a, field)} has no FluxTransformer2DModel equivalent ({want} only)")
    return {"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.37.1", "patch_size": 1,
            "in_channels": a.in_channels, "out_channels": a.out_channels, "num_layers": a.depth,
            "num_single_layers": a.depth_single_blocks, "attention_head_dim": a.hidden_size // a.num_heads,
            "num_attention_heads": a.num_heads, "joint_attention_dim": a.context_in_dim,
            "pooled_projection_dim": a.vec_in_dim, "guidance_embeds": a.guidance_embed,
            "axes_dims_rope": list(a.axes_dim)}


# ------------------------------------------------------------------------------------------------
# Names: our parameter -> the diffusers tensors it is made of

RENAMES = {  # (our module prefix, diffusers module prefix); `{}` is the block index
    "img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "double_blocks.{}.img_mod.lin": "transformer_blocks.{}.norm1.linear",
    "double_blocks.{}.txt_mod.lin": "transformer_blocks.{}.norm1_context.linear",
    "double_blocks.{}.img_attn.norm.query_norm": "transformer_blocks.{}.attn.norm_q",
    "double_blocks.{}.img_attn.norm.key_norm": "transformer_blocks.{}.attn.norm_k",
    "double_blocks.{}.txt_attn.norm.query_norm": "transformer_blocks.{}.attn.norm_added_q",
    "double_blocks.{}.txt_attn.norm.key_norm": "transformer_blocks.{}.attn.norm_added_k",
    "double_blocks.{}.img_attn.proj": "transformer_blocks.{}.attn.to_out.0",
    "double_blocks.{}.txt_attn.proj": "transformer_blocks.{}.attn.to_add_out",
    "double_blocks.{}.img_mlp.0": "transformer_blocks.{}.ff.net.0.proj",
    "double_blocks.{}.img_mlp.2": "transformer_blocks.{}.ff.net.2",
    "double_blocks.{}.txt_mlp.0": "transformer_blocks.{}.ff_context.net.0.proj",
    "double_blocks.{}.txt_mlp.2": "transformer_blocks.{}.ff_context.net.2",
    "single_blocks.{}.modulation.lin": "single_transformer_blocks.{}.norm.linear",
    "single_blocks.{}.norm.query_norm": "single_transformer_blocks.{}.attn.norm_q",
    "single_blocks.{}.norm.key_norm": "single_transformer_blocks.{}.attn.norm_k",
    "single_blocks.{}.linear2": "single_transformer_blocks.{}.proj_out",
}
FUSED = {  # our fused Linear -> the diffusers Linears its output rows split into, in order
    "double_blocks.{}.img_attn.qkv": ["transformer_blocks.{}.attn.to_q", "transformer_blocks.{}.attn.to_k",
                                      "transformer_blocks.{}.attn.to_v"],
    "double_blocks.{}.txt_attn.qkv": ["transformer_blocks.{}.attn.add_q_proj", "transformer_blocks.{}.attn.add_k_proj",
                                      "transformer_blocks.{}.attn.add_v_proj"],
    "single_blocks.{}.linear1": ["single_transformer_blocks.{}.attn.to_q", "single_transformer_blocks.{}.attn.to_k",
                                 "single_transformer_blocks.{}.attn.to_v", "single_transformer_blocks.{}.proj_mlp"],
}
SWAPPED = "final_layer.adaLN_modulation.1"  # -> norm_out.linear, (shift, scale) rows as (scale, shift)


def _parts(name, a: FluxArgs):
    """Our parameter name -> (diffusers keys, row counts each holds): one key, or the rows of a fused
    tensor split in order. The swapped adaLN is two halves listed in diffusers' order."""
    module, leaf = name.rsplit(".", 1)
    if module == SWAPPED:
        return [f"norm_out.linear.{leaf}"], None
    parts = module.split(".")
    idx = parts[1] if parts[0] in ("double_blocks", "single_blocks") else None
    pattern = ".".join(parts[:1] + ["{}"] + parts[2:]) if idx is not None else module
    d, m = a.hidden_size, int(a.hidden_size * a.mlp_ratio)
    if pattern in FUSED:
        rows = [d, d, d, m][:len(FUSED[pattern])]
        return [f"{p.format(idx)}.{leaf}" for p in FUSED[pattern]], rows
    if pattern in RENAMES:
        leaf = "weight" if leaf == "scale" else leaf  # BFL's RMSNorm calls its weight `scale`
        return [f"{RENAMES[pattern].format(idx)}.{leaf}"], None
    raise FluxHFError(f"no diffusers name for parameter {name!r}")  # a flux/model.py change not mapped here


def _swap_halves(t):
    return torch.cat(t.chunk(2, dim=0)[::-1])


def diffusers_state_dict(model):
    """Our parameters under diffusers names and layout, contiguous."""
    out = {}
    for name, p in model.named_parameters():
        keys, rows = _parts(name, model.args)
        t = p.detach()
        if name.startswith(SWAPPED):
            t = _swap_halves(t)
        for key, piece in zip(keys, t.split(rows) if rows else [t]):
            out[key] = piece.contiguous()
    return out


# ------------------------------------------------------------------------------------------------
# Directories

def _open_tensors(path):
    """diffusers key -> open safetensors file holding it (one file, or a sharded index)."""
    index = os.path.join(path, WEIGHTS + ".index.json")
    try:
        if os.path.exists(index):
            with open(index) as f:
                files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            with safe_open(os.path.join(path, WEIGHTS), "pt") as f:
                files = {k: os.path.join(path, WEIGHTS) for k in f.keys()}
        handles = {fn: safe_open(fn, "pt") for fn in set(files.values())}
    except Exception as e:  # missing, truncated, not JSON / safetensors
        raise FluxHFError(f"{path}: no readable {WEIGHTS} or its index ({str(e).splitlines()[0][:120]})") from None
    return {k: handles[fn] for k, fn in files.items()}


def read_args(path):
    """The FluxArgs of a diffusers directory's config.json (refusing what flux/model.py does not implement)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise FluxHFError(f"{os.path.join(path, 'config.json')}: missing or unreadable ({type(e).__name__})") from None
    return args_from_config(cfg)


def read_state(path, args):
    """{our parameter name: float32 CPU tensor} from the directory's safetensors, for a model of
    `args`: every expected tensor present with its shape, every tensor of the files used."""
    tensors = _open_tensors(path)
    with torch.device("meta"):
        model = Flux(args)
    state, used = {}, set()
    for name, p in model.named_parameters():
        keys, rows = _parts(name, args)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise FluxHFError(f"{path}: the checkpoint has no tensor {missing[0]!r}")
        parts = []
        for k, n in zip(keys, rows or [p.shape[0]]):  # each part checked before a fused tensor is joined
            t = tensors[k].get_tensor(k)
            want = (n, *p.shape[1:]) if rows or name.startswith(SWAPPED) else tuple(p.shape)
            if tuple(t.shape) != tuple(want):
                raise FluxHFError(f"{path}: {k} has shape {tuple(t.shape)}, config.json implies {tuple(want)}")
            if not t.dtype.is_floating_point:  # int weights would be cast to float as if they were values
                raise FluxHFError(f"{path}: {k} is {t.dtype}: only floating-point weights load (a quantized "
                                  f"checkpoint is not supported)")
            if not torch.isfinite(t).all():  # would train on from a NaN loss (or sample NaN)
                raise FluxHFError(f"{path}: {k} holds non-finite values (NaN or Inf): these weights cannot be "
                                  f"trained from")
            parts.append(t)
        t = torch.cat(parts) if len(parts) > 1 else parts[0]  # a fused tensor's parts, in row order
        if name.startswith(SWAPPED):
            t = _swap_halves(t)
        state[name] = t.float()
        if not torch.isfinite(state[name]).all():  # (finite in float64, beyond float32's range)
            raise FluxHFError(f"{path}: {' + '.join(keys)} overflows float32 (values beyond 3.4e38)")
        used.update(keys)
    unused = sorted(set(tensors) - used)
    if unused:
        raise FluxHFError(f"{path}: {len(unused)} tensor(s) flux/model.py does not use, e.g. {unused[0]!r}")
    return state


def load(path, device="cpu"):
    """A diffusers FluxTransformer2DModel directory as a flux.Flux (float32)."""
    args = read_args(path)
    state = read_state(path, args)
    with torch.device("meta"):
        model = Flux(args)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    return model


def save(model, path):
    """Write config.json + diffusion_pytorch_model.safetensors, atomically (a temp dir, then rename)."""
    if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise FluxHFError(f"{path}: exists and is not an empty directory (not overwritten)")
    cfg, tensors = config_from_args(model.args), diffusers_state_dict(model)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".flux_hf.", dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic.replace_dir(tmp, path)
    return path


def main(argv=None):
    """python -m flux.hf export RUN_DIR OUT_DIR: a FLUX run's transformer as a diffusers FluxTransformer2DModel
    directory (e.g. a FLUX pipeline's transformer/, in a copy of the pipeline: FluxPipeline loads it)."""
    import sys
    if not argv or argv[0] != "export" or len(argv) != 3:
        sys.stderr.write(f"usage: {main.__doc__.splitlines()[0]}\n")
        return 2
    try:
        model, _ = checkpoint.load_run(argv[1], kind=KIND)
        save(model.flux, argv[2])
    except (ValueError, OSError) as e:  # (FluxHFError, CheckpointError: BadInput)
        sys.stderr.write(f"error: {e}\n")
        return 2
    print(f"{argv[1]} -> {argv[2]}")
    return 0


if __name__ == "__main__":
    import sys
    raise SystemExit(main(sys.argv[1:]))
