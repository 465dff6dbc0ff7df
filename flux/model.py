"""flux/model.py: the FLUX.1 transformer (Black Forest Labs), a rectified-flow diffusion model on packed latents.

    model = Flux(FLAVORS["flux_debug"])
    v_BxSxC = model(img_BxSxC, img_ids_BxSx3, txt_BxTxE, txt_ids_BxTx3, t_B, y_BxV, guidance_B)

The network, as BFL's `flux/src/flux/modules/layers.py` writes it (and torchtitan's
`torchtitan/models/flux/model` copies it); parameter names are BFL's, so their checkpoints map 1:1:
- inputs: image latents packed 2x2 into tokens (`patchify`: C channels -> 4C per token) through
  `img_in`; T5 token embeddings through `txt_in`; one conditioning vector per sample
  `vec = time_in(sinusoid(1000 t)) [+ guidance_in(sinusoid(1000 g))] + vector_in(pooled CLIP)`.
- positions: every token has 3 position ids (text: 0,0,0; image: 0,row,col); `rope_freqs` gives
  each of the 3 axes its own slice of the head dim (16 + 56 + 56 = 128 for the published models).
- DoubleStreamBlock: image and text keep separate weights (modulation, qkv, MLP) but attend
  jointly over cat(text, image); each sub-layer is adaLN: LayerNorm, then (1 + scale) x + shift
  from `vec`, its output multiplied by a gate from `vec`; q and k get a per-head RMSNorm.
- SingleStreamBlock: one stream over cat(text, image); one fused `linear1` gives q|k|v|mlp
  (attention and MLP in parallel, ViT-22B style) and `linear2` projects cat(attention, gelu(mlp)).
- LastLayer: adaLN (shift, scale) and a linear back to the patch channels, image tokens only.
Modulation and final layers start at zero (torchtitan's init_weights): each block starts as the
identity and the model predicts 0, so training starts from a stable point.

Attention (`attention(q_BxHxSxD, k, v) -> BxHxSxD`, non-causal) is chosen by name, `attn_impl`, from
ATTENTION_IMPLS as model.py chooses its kernels (model.lookup_impl; each entry a function that
returns the implementation, the kernel's importing JAX on first use): "sdpa" (torch's), or "splash" (kernels_splash.py's block-sparse flash
attention with every block live: `--kernels pallas`). Sampling and the flow-matching loss are in flux/sample.py; diffusers
checkpoints in flux/hf.py.
"""
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from model import lookup_impl
import materialize


KIND = "a FLUX diffusion model"  # ModelFamily.kind of these models (checkpoint.load_run names other runs)


@dataclasses.dataclass
class FluxArgs:
    in_channels: int = 64          # per token: 16 latent channels x 2 x 2 patch
    out_channels: int = 64
    vec_in_dim: int = 768          # pooled CLIP-L vector
    context_in_dim: int = 4096     # T5-XXL token embeddings
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19                # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple = (16, 56, 56)  # RoPE dims per position axis; sums to the head dim
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = False   # flux-dev: distilled guidance scale as an extra input
    attn_impl: str = "sdpa"        # a name in ATTENTION_IMPLS ("splash": the Pallas kernel)


FLAVORS = {
    # digits: 1 channel 8x8 images -> 16 tokens of 4 channels; class prompt as 4 learned tokens
    "flux_debug": FluxArgs(in_channels=4, out_channels=4, vec_in_dim=32, context_in_dim=32, hidden_size=128,
                           num_heads=4, depth=2, depth_single_blocks=2, axes_dim=(8, 12, 12)),
    "flux_schnell": FluxArgs(),
    "flux_dev": FluxArgs(guidance_embed=True),
}


def check_args(a):
    """ValueError (one line) for a FluxArgs the model cannot be built from."""
    for f in ("in_channels", "out_channels", "vec_in_dim", "context_in_dim", "hidden_size", "num_heads", "theta"):
        if getattr(a, f) <= 0:
            raise ValueError(f"{f} must be positive (got {getattr(a, f)})")
    if a.depth < 0 or a.depth_single_blocks < 0:
        raise ValueError("depth / depth_single_blocks must be >= 0")
    if not (math.isfinite(a.mlp_ratio) and a.mlp_ratio > 0):  # (NaN and inf pass a `<= 0` test)
        raise ValueError(f"mlp_ratio must be a positive finite number (got {a.mlp_ratio})")
    if int(a.hidden_size * a.mlp_ratio) < 1:  # the MLP's width is int(hidden_size x mlp_ratio)
        raise ValueError(f"mlp_ratio {a.mlp_ratio} x hidden_size {a.hidden_size} rounds to an MLP of "
                         f"{int(a.hidden_size * a.mlp_ratio)} hidden units")
    if a.hidden_size % a.num_heads:
        raise ValueError(f"hidden_size {a.hidden_size} is not divisible by num_heads {a.num_heads}")
    if len(a.axes_dim) != 3 or any(d % 2 for d in a.axes_dim) or sum(a.axes_dim) != a.hidden_size // a.num_heads:
        raise ValueError(f"axes_dim {tuple(a.axes_dim)} must be 3 even sizes summing to the head dim "
                         f"{a.hidden_size // a.num_heads}")
    lookup_impl(ATTENTION_IMPLS, a.attn_impl, "attention")  # ValueError naming the choices


def sdpa(q_BxHxSxD, k_BxHxSxD, v_BxHxSxD):
    """Non-causal attention over the joint text + image sequence."""
    return F.scaled_dot_product_attention(q_BxHxSxD, k_BxHxSxD, v_BxHxSxD)


def flash_sdpa(q_BxHxSxD, k_BxHxSxD, v_BxHxSxD):
    """The same attention through PyTorch's flash-attention op (its CPU kernel; shape functions on
    meta): the backward keeps the output and the log-sum-exp, never the S x S probabilities, as a
    TPU flash kernel (splash attention) does. What the dry run traces at full scale."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_BxHxSxD, k_BxHxSxD, v_BxHxSxD)[0]


def _splash_full_attention():
    from kernels_splash import splash_full_attention
    return splash_full_attention


ATTENTION_IMPLS = {"sdpa": lambda: sdpa, "flash": lambda: flash_sdpa, "splash": _splash_full_attention}


# ------------------------------------------------------------------------------------------------
# Embeddings: timesteps, RoPE over 3 position axes

def timestep_embedding(t_B, dim=256, max_period=10_000, time_factor=1000.0):
    """Sinusoid of 1000 t (t in [0, 1] -> the DDPM-like range 0..1000): [cos | sin], `dim` wide."""
    half = dim // 2
    freqs_H = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    args_BxH = (time_factor * t_B.float())[:, None] * freqs_H[None]
    return torch.cat([torch.cos(args_BxH), torch.sin(args_BxH)], dim=-1)


def rope_freqs(ids_BxSxA, axes_dim, theta):
    """Rotation per (token, head-dim pair): cos and sin, (B, S, D/2) each; axis a owns axes_dim[a] of
    the head dim and rotates by its own position id. (Computed in float32: BFL uses float64, which
    TPUs lack; positions are small integers, so the two agree to ~1e-7.)"""
    angles = []
    for a, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=ids_BxSxA.device) / dim)
        angles.append(ids_BxSxA[..., a].float()[..., None] * omega)
    ang_BxSxP = torch.cat(angles, dim=-1)
    return torch.cos(ang_BxSxP), torch.sin(ang_BxSxP)


def apply_rope(x_BxHxSxD, cos_BxSxP, sin_BxSxP):
    """Rotate adjacent pairs (x[2i], x[2i+1]) (BFL's layout, not Llama's half split)."""
    x = x_BxHxSxD.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    cos, sin = cos_BxSxP[:, None], sin_BxSxP[:, None]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).type_as(x_BxHxSxD)


# ------------------------------------------------------------------------------------------------
# Layers (BFL names)

class MLPEmbedder(nn.Module):
    def __init__(self, in_dim, hidden):
        super().__init__()
        self.in_layer, self.out_layer = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale).type_as(x)


class QKNorm(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.query_norm, self.key_norm = RMSNorm(head_dim), RMSNorm(head_dim)


class SelfAttention(nn.Module):
    """The double block's per-stream attention weights (the attention itself runs jointly)."""

    def __init__(self, dim, heads, qkv_bias):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.norm = QKNorm(dim // heads)
        self.proj = nn.Linear(dim, dim)

    def qkv_heads(self, x_BxSxD):
        """q, k (RMS-normalized per head), v: (B, H, S, D/H) each."""
        q, k, v = self.qkv(x_BxSxD).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return self.norm.query_norm(q), self.norm.key_norm(k), v


class Modulation(nn.Module):
    """vec -> n x (shift, scale, gate), each (B, 1, D): adaLN-Zero's conditioning."""

    def __init__(self, dim, n):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(dim, 3 * n * dim)

    def forward(self, vec_BxD):
        return self.lin(F.silu(vec_BxD))[:, None].chunk(3 * self.n, dim=-1)


def _modulate(x_BxSxD, shift, scale):
    return (1 + scale) * F.layer_norm(x_BxSxD, x_BxSxD.shape[-1:], eps=1e-6) + shift


def _joint_attention(attention, qkv_parts, rope):
    """Attention over the concatenation of the streams' q/k/v (sequence dim), RoPE applied to q, k."""
    q, k, v = (torch.cat(t, dim=2) for t in zip(*qkv_parts))
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return attention(q, k, v).transpose(1, 2).flatten(2)  # (B, S, D)


class DoubleStreamBlock(nn.Module):
    def __init__(self, a: FluxArgs):
        super().__init__()
        d, m = a.hidden_size, int(a.hidden_size * a.mlp_ratio)
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", Modulation(d, 2))
            setattr(self, f"{s}_attn", SelfAttention(d, a.num_heads, a.qkv_bias))
            setattr(self, f"{s}_mlp", nn.Sequential(nn.Linear(d, m), nn.GELU(approximate="tanh"), nn.Linear(m, d)))

    def forward(self, img_BxSxD, txt_BxTxD, vec_BxD, rope, attention):
        T = txt_BxTxD.shape[1]
        im = self.img_mod(vec_BxD)  # shift1, scale1, gate1, shift2, scale2, gate2
        tm = self.txt_mod(vec_BxD)
        attn_Bx_TplusS_xD = _joint_attention(attention, [
            self.txt_attn.qkv_heads(_modulate(txt_BxTxD, tm[0], tm[1])),
            self.img_attn.qkv_heads(_modulate(img_BxSxD, im[0], im[1]))], rope)
        img = img_BxSxD + im[2] * self.img_attn.proj(attn_Bx_TplusS_xD[:, T:])
        img = img + im[5] * self.img_mlp(_modulate(img, im[3], im[4]))
        txt = txt_BxTxD + tm[2] * self.txt_attn.proj(attn_Bx_TplusS_xD[:, :T])
        txt = txt + tm[5] * self.txt_mlp(_modulate(txt, tm[3], tm[4]))
        return img, txt


class SingleStreamBlock(nn.Module):
    def __init__(self, a: FluxArgs):
        super().__init__()
        d, self.mlp_dim, self.heads = a.hidden_size, int(a.hidden_size * a.mlp_ratio), a.num_heads
        self.linear1 = nn.Linear(d, 3 * d + self.mlp_dim)  # q | k | v | mlp in
        self.linear2 = nn.Linear(d + self.mlp_dim, d)      # attention out | mlp out
        self.norm = QKNorm(d // a.num_heads)
        self.modulation = Modulation(d, 1)

    def forward(self, x_BxLxD, vec_BxD, rope, attention):
        shift, scale, gate = self.modulation(vec_BxD)
        qkv, mlp = self.linear1(_modulate(x_BxLxD, shift, scale)).split([3 * x_BxLxD.shape[-1], self.mlp_dim], -1)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        attn = _joint_attention(attention, [(self.norm.query_norm(q), self.norm.key_norm(k), v)], rope)
        return x_BxLxD + gate * self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))


class PackedBlock(nn.Module):
    """A block on layer_scan.py's contract, (h, cos, sin) -> (h, aux), for --scan: h packs both
    streams and the conditioning vector along the sequence, [txt (T) | img | vec (1)], which is
    also a single block's [x | vec]. vec rides in the carry unchanged, so the scan's backward, pulling
    h back layer by layer, sums vec's gradient over the blocks as the unrolled loop does."""

    def __init__(self, block, n_txt, attention):
        super().__init__()
        self.block, self.n_txt, self.attention = block, n_txt, attention

    def forward(self, h_Bx_TplusSplus1_xD, cos, sin):
        x, vec_BxD = h_Bx_TplusSplus1_xD[:, :-1], h_Bx_TplusSplus1_xD[:, -1]
        if isinstance(self.block, DoubleStreamBlock):
            img, txt = self.block(x[:, self.n_txt:], x[:, :self.n_txt], vec_BxD, (cos, sin), self.attention)
            x = torch.cat([txt, img], dim=1)
        else:
            x = self.block(x, vec_BxD, (cos, sin), self.attention)
        return torch.cat([x, vec_BxD[:, None]], dim=1), x.new_zeros((), dtype=torch.float32)


class LastLayer(nn.Module):
    def __init__(self, d, out):
        super().__init__()
        self.linear = nn.Linear(d, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))

    def forward(self, x_BxSxD, vec_BxD):
        shift, scale = self.adaLN_modulation(vec_BxD)[:, None].chunk(2, dim=-1)  # BFL order: shift first
        return self.linear(_modulate(x_BxSxD, shift, scale))


def initializer(root):
    """init(name, shape, generator) for the parameters of `root` (a Flux, or a module holding one),
    torchtitan's scheme: Xavier for the blocks' linears, N(0, 0.02) for the embedders (and anything
    else: a prompt stand-in), zero biases, RMSNorm scales 1; modulation and the final layer zero. The
    rule is read off the module types once; the values come from the generator alone."""
    kinds, zero = {}, set()
    for prefix, mod in root.named_modules():
        if isinstance(mod, (Modulation, LastLayer)):
            zero.add(prefix + ".")
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            if any(name.startswith(z) for z in zero):
                kinds[name] = "zeros"
            elif isinstance(mod, RMSNorm) or (isinstance(mod, nn.Linear) and pname == "bias"):
                kinds[name] = "ones" if isinstance(mod, RMSNorm) else "zeros"
            elif isinstance(mod, nn.Linear) and ("double_blocks." in name or "single_blocks." in name):
                kinds[name] = "xavier"

    def init(name, shape, generator):
        kind = kinds.get(name, "normal")
        if kind in ("zeros", "ones"):
            return torch.zeros(shape) if kind == "zeros" else torch.ones(shape)
        if kind == "xavier":  # (out, in): U(-a, a), a = sqrt(6 / (fan_in + fan_out))
            a = math.sqrt(6.0 / (shape[0] + shape[1]))
            return torch.empty(shape).uniform_(-a, a, generator=generator)
        return torch.empty(shape).normal_(0.0, 0.02, generator=generator)
    return init


class Flux(nn.Module):
    def __init__(self, args: FluxArgs):
        super().__init__()
        check_args(args)
        self.args, self.attention = args, lookup_impl(ATTENTION_IMPLS, args.attn_impl, "attention")
        d = args.hidden_size
        self.img_in = nn.Linear(args.in_channels, d)
        self.time_in = MLPEmbedder(256, d)
        self.vector_in = MLPEmbedder(args.vec_in_dim, d)
        self.guidance_in = MLPEmbedder(256, d) if args.guidance_embed else None
        self.txt_in = nn.Linear(args.context_in_dim, d)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(args) for _ in range(args.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(args) for _ in range(args.depth_single_blocks))
        self.final_layer = LastLayer(d, args.out_channels)
        self.packed = False  # pack_for_scan() sets it
        if self.img_in.weight.device.type != "meta":
            self.init_weights()

    def init_weights(self):
        """Each parameter from its own (torch.initial_seed(), name) stream (materialize.py), by `initializer`."""
        materialize.init_module(self, initializer(self))

    def pack_for_scan(self, n_txt):
        """Wrap every block as a PackedBlock (text length n_txt) and return the two stacks, as
        ModelFamily.scan_stacks names them for layer_scan.py."""
        self.double_blocks = nn.ModuleList(PackedBlock(b, n_txt, self.attention) for b in self.double_blocks)
        self.single_blocks = nn.ModuleList(PackedBlock(b, n_txt, self.attention) for b in self.single_blocks)
        self.packed = True
        return [(self, "double_blocks"), (self, "single_blocks")]

    def forward(self, img_BxSxC, img_ids_BxSx3, txt_BxTxE, txt_ids_BxTx3, t_B, y_BxV, guidance_B=None):
        if (guidance_B is None) == (self.guidance_in is not None):
            raise ValueError("a guidance value is required by, and only by, a model with guidance_embed "
                             f"(this one has guidance_embed={self.args.guidance_embed})")
        img = self.img_in(img_BxSxC)
        vec_BxD = self.time_in(timestep_embedding(t_B).to(img.dtype))
        if self.guidance_in is not None:
            vec_BxD = vec_BxD + self.guidance_in(timestep_embedding(guidance_B).to(img.dtype))
        vec_BxD = vec_BxD + self.vector_in(y_BxV)
        txt = self.txt_in(txt_BxTxE)
        rope = rope_freqs(torch.cat([txt_ids_BxTx3, img_ids_BxSx3], dim=1), self.args.axes_dim, self.args.theta)
        if self.packed:  # both stacks on the packed carry (PackedBlock), maybe stacked by layer_scan.py
            h = torch.cat([txt, img, vec_BxD[:, None]], dim=1)
            for stack in (self.double_blocks, self.single_blocks):
                for block in (stack if isinstance(stack, nn.ModuleList) else [stack]):
                    h, _ = block(h, *rope)
            return self.final_layer(h[:, txt.shape[1]:-1], vec_BxD)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec_BxD, rope, self.attention)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            x = block(x, vec_BxD, rope, self.attention)
        return self.final_layer(x[:, txt.shape[1]:], vec_BxD)


# ------------------------------------------------------------------------------------------------
# Latent packing and position ids (BFL's sampling.py `prepare` / `unpack`)

def patchify(x_BxCxHxW, p=2):
    """(B, C, H, W) -> (B, H/p * W/p, C p p): each p x p patch one token, row-major over patches."""
    B, C, H, W = x_BxCxHxW.shape
    if H % p or W % p:
        raise ValueError(f"image size {H}x{W} is not divisible by the patch size {p}")
    x = x_BxCxHxW.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)  # B, rows, cols, C, p, p
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def unpatchify(x_BxSxK, H, W, p=2):
    """The inverse of patchify for an H x W image."""
    B, S, K = x_BxSxK.shape
    C = K // (p * p)
    return x_BxSxK.reshape(B, H // p, W // p, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def image_ids(B, H, W, p=2, device=None):
    """(B, H/p * W/p, 3) position ids (0, row, col) of the patch tokens."""
    rows, cols = torch.meshgrid(torch.arange(H // p, device=device), torch.arange(W // p, device=device), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(1, -1, 3).float()
    return ids.expand(B, -1, -1)


def text_ids(B, T, device=None):
    """Text tokens all sit at position (0, 0, 0): RoPE does not order them (T5 already did)."""
    return torch.zeros(B, T, 3, device=device)


# ------------------------------------------------------------------------------------------------
# Size and FLOPs

def param_count(a: FluxArgs):
    """Parameters, from the module tree on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Flux(a).parameters())


def flops_per_sample(a: FluxArgs, img_tokens, txt_tokens):
    """Training FLOPs (forward + backward) of one sample, torchtitan's formula per token times tokens:
    6 N per token; less one stream of each double block (a token passes either the image or the
    text weights); less the modulation weights, applied once per sample (to `vec`), not per token;
    plus attention's two S x S contractions, 6 x heads x 2 head_dim x S per token per block."""
    S, h, r = img_tokens + txt_tokens, a.hidden_size, a.mlp_ratio
    per_token = 6 * param_count(a)
    per_token -= 6 * int(h * h * (4 + 2 * r)) * a.depth
    mod_per_sample = 12 * h * h * a.depth + 3 * h * h * a.depth_single_blocks + 2 * h * h
    per_token -= 6 * mod_per_sample * (S - 1) // S
    return per_token * S + attention_flops_per_sample(a, S)


def attention_flops_per_sample(a: FluxArgs, tokens):
    """Attention's two S x S contractions, forward + backward, over every block: 6 x heads x 2
    head_dim x S a token (what splash computes: step_compile leaves it out of the cost model's count)."""
    return 6 * a.num_heads * 2 * (a.hidden_size // a.num_heads) * tokens * (a.depth + a.depth_single_blocks) * tokens
