"""flux/jax_step.py: the FLUX.1 training step in pure JAX, the competitor bench.py measures our PyTorch step against.

    step = make_train_step(cfg)                       # cfg: FluxArgs' fields as a dict
    params, opt, loss, norm = step(params, opt, (x0, eps, t, cls), lr, count)

TorchTitan's FLUX headline is "99% of JAX MaxDiffusion". MaxDiffusion is a Flax code base; the part
that matters for the comparison is what XLA sees: forward + loss + backward + the AdamW update as
ONE jax.jit'd program. This file is that program, written from Black Forest Labs' reference
(`flux/src/flux/modules/layers.py`, `math.py`, `model.py`) directly in jax.numpy, with no flax:
  - params: a flat dict of arrays named as flux/model.py's state_dict (torch layout: a Linear's weight is
    (out, in)), so one torch init feeds both; this file never imports flux/model.py (it is the oracle
    the tests hold flux/model.py to, and the competitor bench.py races it against);
  - RoPE in BFL's own form: a 2 x 2 rotation matrix per (token, pair), `pe @ (x[2i], x[2i+1])`;
  - attention written out, softmax(q k^T / sqrt(d)) v over cat(text, image), non-causal;
  - the workload flux/task.py trains: a learned prompt per class (`prompt.*` params, row 10 is the
    empty prompt), rectified flow x_t = (1 - t) x0 + t eps, target eps - x0, MSE;
  - the update: global-norm clipping (torch's clip_grad_norm_ rule), then AdamW (decoupled weight
    decay on matrices that are not norms or biases: the trainer's rule), all inside the jit.
"""
import math

import jax
import jax.numpy as jnp


# ------------------------------------------------------------------------------------------------
# Layers (BFL names; `p` is the flat param dict, `name` a module path in it)

def linear(p, name, x):
    y = x @ p[name + ".weight"].T  # torch layout (out, in)
    return y + p[name + ".bias"] if name + ".bias" in p else y


def layer_norm(x, eps=1e-6):
    """LayerNorm without affine weights (BFL's norm1 / norm2 / pre_norm / norm_final)."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * scale


def mlp_embedder(p, name, x):
    return linear(p, name + ".out_layer", jax.nn.silu(linear(p, name + ".in_layer", x)))


def modulation(p, name, vec_BxD, n):
    """n (shift, scale, gate) triples, each (B, 1, D), from silu(vec)."""
    return jnp.split(linear(p, name, jax.nn.silu(vec_BxD))[:, None], 3 * n, axis=-1)


def timestep_embedding(t_B, dim=256, max_period=10_000, time_factor=1000.0):
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    args_BxH = (time_factor * t_B)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(args_BxH), jnp.sin(args_BxH)], axis=-1)


def embed_nd(ids_BxLx3, axes_dim, theta):
    """BFL's EmbedND: per axis, angles pos x omega; a 2x2 rotation [[cos, -sin], [sin, cos]] per pair.
    Returns (B, 1, L, D/2, 2, 2)."""
    mats = []
    for a, dim in enumerate(axes_dim):
        omega = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
        ang = ids_BxLx3[..., a][..., None] * omega  # (B, L, dim/2)
        c, s = jnp.cos(ang), jnp.sin(ang)
        mats.append(jnp.stack([c, -s, s, c], axis=-1).reshape(*ang.shape, 2, 2))
    return jnp.concatenate(mats, axis=-3)[:, None]


def apply_rope(x_BxHxLxD, pe):
    x = x_BxHxLxD.reshape(*x_BxHxLxD.shape[:-1], -1, 1, 2)
    out = pe[..., 0] * x[..., 0] + pe[..., 1] * x[..., 1]  # row i of the 2x2 matrix times (x0, x1)
    return out.reshape(x_BxHxLxD.shape)


def attention(q, k, v, pe):
    """RoPE on q and k, then non-causal softmax attention; (B, H, L, Dh) -> (B, L, H Dh)."""
    q, k = apply_rope(q, pe), apply_rope(k, pe)
    scores_BxHxLxL = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores_BxHxLxL, axis=-1), v)
    B, H, L, Dh = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, L, H * Dh)


def split_heads(qkv_BxLx3D, heads):
    """'B L (K H D) -> K B H L D'."""
    B, L, _ = qkv_BxLx3D.shape
    return qkv_BxLx3D.reshape(B, L, 3, heads, -1).transpose(2, 0, 3, 1, 4)


def double_block(p, name, img, txt, vec, pe, heads):
    i_sh1, i_sc1, i_g1, i_sh2, i_sc2, i_g2 = modulation(p, name + ".img_mod.lin", vec, 2)
    t_sh1, t_sc1, t_g1, t_sh2, t_sc2, t_g2 = modulation(p, name + ".txt_mod.lin", vec, 2)
    qkv = {}
    for s, x, sh, sc in (("img", img, i_sh1, i_sc1), ("txt", txt, t_sh1, t_sc1)):
        q, k, v = split_heads(linear(p, f"{name}.{s}_attn.qkv", (1 + sc) * layer_norm(x) + sh), heads)
        qkv[s] = (rms_norm(q, p[f"{name}.{s}_attn.norm.query_norm.scale"]),
                  rms_norm(k, p[f"{name}.{s}_attn.norm.key_norm.scale"]), v)
    q, k, v = (jnp.concatenate([a, b], axis=2) for a, b in zip(qkv["txt"], qkv["img"]))
    attn = attention(q, k, v, pe)
    T = txt.shape[1]
    img = img + i_g1 * linear(p, name + ".img_attn.proj", attn[:, T:])
    img = img + i_g2 * _mlp(p, name + ".img_mlp", (1 + i_sc2) * layer_norm(img) + i_sh2)
    txt = txt + t_g1 * linear(p, name + ".txt_attn.proj", attn[:, :T])
    txt = txt + t_g2 * _mlp(p, name + ".txt_mlp", (1 + t_sc2) * layer_norm(txt) + t_sh2)
    return img, txt


def _mlp(p, name, x):
    """nn.Sequential(Linear, GELU(tanh), Linear): torch names its members .0 and .2."""
    return linear(p, name + ".2", jax.nn.gelu(linear(p, name + ".0", x), approximate=True))


def single_block(p, name, x, vec, pe, heads):
    shift, scale, gate = modulation(p, name + ".modulation.lin", vec, 1)
    D = x.shape[-1]
    h = linear(p, name + ".linear1", (1 + scale) * layer_norm(x) + shift)
    q, k, v = split_heads(h[..., :3 * D], heads)
    q = rms_norm(q, p[name + ".norm.query_norm.scale"])
    k = rms_norm(k, p[name + ".norm.key_norm.scale"])
    out = linear(p, name + ".linear2", jnp.concatenate(
        [attention(q, k, v, pe), jax.nn.gelu(h[..., 3 * D:], approximate=True)], axis=-1))
    return x + gate * out


def _count(p, prefix):
    return len({k.split(".")[1] for k in p if k.startswith(prefix + ".")})


def forward(p, cfg, img_BxSxC, img_ids_BxSx3, txt_BxTxE, txt_ids_BxTx3, t_B, y_BxV, guidance_B=None):
    """BFL's Flux.forward. `p`: flux/model.py's state_dict as arrays; `cfg`: num_heads, axes_dim, theta."""
    heads = cfg["num_heads"]
    img = linear(p, "img_in", img_BxSxC)
    vec = mlp_embedder(p, "time_in", timestep_embedding(t_B))
    if "guidance_in.in_layer.weight" in p:
        vec = vec + mlp_embedder(p, "guidance_in", timestep_embedding(guidance_B))
    vec = vec + mlp_embedder(p, "vector_in", y_BxV)
    txt = linear(p, "txt_in", txt_BxTxE)
    pe = embed_nd(jnp.concatenate([txt_ids_BxTx3, img_ids_BxSx3], axis=1), cfg["axes_dim"], cfg["theta"])
    for i in range(_count(p, "double_blocks")):
        img, txt = double_block(p, f"double_blocks.{i}", img, txt, vec, pe, heads)
    x = jnp.concatenate([txt, img], axis=1)
    for i in range(_count(p, "single_blocks")):
        x = single_block(p, f"single_blocks.{i}", x, vec, pe, heads)
    x = x[:, txt.shape[1]:]
    shift, scale = jnp.split(linear(p, "final_layer.adaLN_modulation.1", jax.nn.silu(vec))[:, None], 2, axis=-1)
    return linear(p, "final_layer.linear", (1 + scale) * layer_norm(x) + shift)


# ------------------------------------------------------------------------------------------------
# The digits workload (flux/task.py's): prompt lookup, position ids, rectified-flow MSE

def positions(B, rows, cols, T):
    """Image tokens at (0, row, col) row-major, text tokens all at (0, 0, 0)."""
    r, c = jnp.meshgrid(jnp.arange(rows), jnp.arange(cols), indexing="ij")
    img = jnp.stack([jnp.zeros_like(r), r, c], axis=-1).reshape(1, rows * cols, 3).astype(jnp.float32)
    return jnp.broadcast_to(img, (B, rows * cols, 3)), jnp.zeros((B, T, 3), jnp.float32)


def flow_loss(params, cfg, x0_BxSxC, eps_BxSxC, t_B, cls_B):
    """MSE of the predicted velocity against eps - x0 at x_t = (1 - t) x0 + t eps (square images)."""
    txt, y = params["prompt.tokens_CxTxE"][cls_B], params["prompt.pooled_CxV"][cls_B]
    B, S, _ = x0_BxSxC.shape
    side = math.isqrt(S)
    img_ids, txt_ids = positions(B, side, side, txt.shape[1])
    x_t = (1 - t_B)[:, None, None] * x0_BxSxC + t_B[:, None, None] * eps_BxSxC
    flux_p = {k[len("flux."):]: v for k, v in params.items() if k.startswith("flux.")}
    guidance = jnp.ones((B,), jnp.float32) if cfg.get("guidance_embed") else None
    v = forward(flux_p, cfg, x_t, img_ids, txt, txt_ids, t_B, y, guidance)
    return jnp.mean((v - (eps_BxSxC - x0_BxSxC)) ** 2)


# ------------------------------------------------------------------------------------------------
# The update: clip by global norm, AdamW; the whole step one jit

def decays(name, x):
    return x.ndim >= 2 and "norm" not in name and not name.endswith("bias")


@jax.jit  # one program for all the zeros (op by op, JAX would compile one per tensor shape)
def init_opt(params):
    return {"m": {k: jnp.zeros_like(v) for k, v in params.items()},
            "v": {k: jnp.zeros_like(v) for k, v in params.items()}}


def adamw(params, grads, opt, lr, count, betas, eps, weight_decay):
    """One AdamW update number `count` (from 1): decoupled decay, bias-corrected moments."""
    b1, b2 = betas
    new_p, new_m, new_v = {}, {}, {}
    for k, p in params.items():
        g = grads[k]
        m = b1 * opt["m"][k] + (1 - b1) * g
        v = b2 * opt["v"][k] + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** count), v / (1 - b2 ** count)
        p = p * (1 - lr * weight_decay) if decays(k, p) else p
        new_p[k], new_m[k], new_v[k] = p - lr * m_hat / (jnp.sqrt(v_hat) + eps), m, v
    return new_p, {"m": new_m, "v": new_v}


def make_train_step(cfg, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0):
    """jit(params, opt, (x0, eps, t, cls), lr, count) -> (params, opt, loss, pre-clip grad norm);
    params and opt are donated (updated in place, as an optimizer step does) except on CPU: with
    jax/jaxlib 0.7.1 on XLA:CPU a donated step fed the previous donated step's outputs returned a wrong
    gradient (test_flux_jax_forward_and_adamw_steps_equal_torch, step 2: norm 88.947 against 89.381, the
    loss still equal; the same jit without donation gives 89.381). CPU memory is not what donation saves."""
    cfg = dict(cfg)

    def step(params, opt, batch, lr, count):
        loss, grads = jax.value_and_grad(flow_loss)(params, cfg, *batch)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads.values()))
        if clip and clip > 0:
            coef = jnp.minimum(clip / (norm + 1e-6), 1.0)
            grads = {k: g * coef for k, g in grads.items()}
        params, opt = adamw(params, grads, opt, lr, count, betas, eps, weight_decay)
        return params, opt, loss, norm

    return jax.jit(step, donate_argnums=() if jax.default_backend() == "cpu" else (0, 1))
