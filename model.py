"""model.py: Llama 3, Qwen 3 and Qwen 3-MoE as plain nn.Modules, with no device code.

One decoder covers the three families (Llama 3: arXiv 2407.21783; Qwen 3: arXiv 2505.09388):
pre-norm RMSNorm blocks, rotary position embeddings (Hugging Face "rotate-half" layout), grouped-query
attention (Qwen 3 adds RMSNorm on q and k per head), and a SwiGLU MLP or, for Qwen 3-MoE, a softmax
top-k router over stacked experts. Parameter names follow the Hugging Face checkpoints
(embed_tokens, layers.N.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, mlp.gate = router, norm,
lm_head), so released weights load without permutation (MoE experts are stored stacked, w_ExDxF).

Which implementation runs the three hot spots is chosen by name in ModelArgs (attn_impl, loss_impl,
moe_impl), looked up in the tables below (the Pallas kernels of kernels_splash.py, kernels_pallas.py and kernels_gmm.py are named there);
`tpu_config(args)` (model_args.py, with the config and its flavors) rewrites a config to use them.
The model and trainer never change.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from context_parallel import WholeSequence, position_mask
# the config, its published flavors and its accounting live in model_args.py; they are this model's
# names too, for the many callers that import them from here
from model_args import FLAVORS, ModelArgs, dynamic_shapes_reason, flops_per_token, param_counts, tpu_config  # noqa: F401
from tensor_parallel import vocab_parallel_cross_entropy
import materialize


KIND = "a language model"  # ModelFamily.kind of this file's models (checkpoint.load_run refuses other runs)


def check_args(args):
    """Raise ValueError with a one-line reason if the config cannot describe a model."""
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
    for f in dataclasses.fields(args):  # NaN passes every `x <= 0` below (a config.json may hold one)
        value = getattr(args, f.name)
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,))):
            raise ValueError(f"{f.name} must be finite, got {value}")
    if args.rope_scaling is not None:  # rope_inv_freq divides by factor, low and high - low
        if len(args.rope_scaling) != 4 or not (args.rope_scaling[0] > 0 and 0 < args.rope_scaling[1] <
                                               args.rope_scaling[2] and args.rope_scaling[3] > 0):
            raise ValueError(f"rope_scaling is (factor, low_freq_factor, high_freq_factor, original_ctx) with "
                             f"factor > 0, 0 < low < high, original_ctx > 0; got {args.rope_scaling}")
    if args.n_heads % args.n_kv_heads:
        raise ValueError(f"n_heads ({args.n_heads}) must be divisible by n_kv_heads ({args.n_kv_heads})")
    hd = args.hd if args.head_dim is None else args.head_dim  # (a given 0 is refused, not read as the default)
    if hd <= 0 or hd % 2:
        raise ValueError(f"head_dim must be positive and even for rotary embeddings (none: dim // n_heads), got {hd}")
    if args.aux_loss_coef < 0:
        raise ValueError(f"aux_loss_coef must be >= 0, got {args.aux_loss_coef}")
    if args.n_experts and not (0 < args.top_k <= args.n_experts and args.moe_ffn_dim > 0):
        raise ValueError(f"MoE needs 0 < top_k <= n_experts and moe_ffn_dim > 0, got top_k="
                         f"{args.top_k}, n_experts={args.n_experts}, moe_ffn_dim={args.moe_ffn_dim}")
    if args.moe_groups < 1:
        raise ValueError(f"moe_groups must be >= 1, got {args.moe_groups}")
    if not (args.ep_buffer_factor >= 0 and math.isfinite(args.ep_buffer_factor)):
        raise ValueError(f"ep_buffer_factor must be >= 0 (0: dropless), got {args.ep_buffer_factor}")
    if args.sliding_window is not None and args.sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive (or none), got {args.sliding_window}")
    if args.doc_sep is not None and not 0 <= args.doc_sep < args.vocab_size:
        raise ValueError(f"doc_sep must be a token id in [0, {args.vocab_size}), got {args.doc_sep}")
    for name in ("norm_eps", "rope_theta"):  # RMSNorm's eps keeps 1/sqrt finite; theta is a log base
        if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
            raise ValueError(f"{name} must be a positive number, got {getattr(args, name)}")
    for registry, name, kind in ((ATTENTION_IMPLS, args.attn_impl, "attention"), (LOSS_IMPLS, args.loss_impl, "loss"),
                                 (GMM_IMPLS, args.moe_impl, "grouped matmul")):
        lookup_impl(registry, name, kind)  # ValueError naming the choices for an unknown name


# --------------------------------------------------------------------------------------------------
# Reference implementations and the tables naming every implementation

def attention_mask(seq_len, window=None, segment_ids=None, device=None):
    """Boolean (S, S) or (B, S, S) mask, True = may attend: causal, optional sliding window (a query
    sees itself and the window-1 keys before it), optional packed documents (same segment id)."""
    pos = torch.arange(seq_len, device=device)
    return position_mask(pos, pos, window, segment_ids, segment_ids)


def sdpa_attention(q_BxHxSxD, k_BxKxTxD, v_BxKxTxD, window=None, segment_ids=None):
    """Reference causal attention (materializes the S x S scores): GQA by repeating kv heads."""
    groups = q_BxHxSxD.shape[1] // k_BxKxTxD.shape[1]
    k = k_BxKxTxD.repeat_interleave(groups, dim=1)
    v = v_BxKxTxD.repeat_interleave(groups, dim=1)
    if window is None and segment_ids is None:
        return F.scaled_dot_product_attention(q_BxHxSxD, k, v, is_causal=True)
    mask = attention_mask(q_BxHxSxD.shape[2], window, segment_ids, q_BxHxSxD.device)
    if mask.dim() == 3:
        mask = mask[:, None]  # broadcast over heads
    return F.scaled_dot_product_attention(q_BxHxSxD, k, v, attn_mask=mask)


def plain_cross_entropy(h_NxD, w_VxD, targets_N, ignore_index=-100):
    """Reference final projection + loss: writes the full (N, V) logits."""
    logits_NxV = h_NxD @ w_VxD.t()
    return F.cross_entropy(logits_NxV.float(), targets_N, ignore_index=ignore_index)


def gmm_reference(x_MxK, w_GxKxN, group_sizes_G):
    """Grouped matmul: rows [start_g, start_g + size_g) of x times w[g]. Plain PyTorch, one matmul
    per group (reads group sizes on the host: eager only; the Pallas gmm has static shapes).
    (R, G) sizes: x is R equal blocks of rows, block r grouped by group_sizes_G[r]."""
    if group_sizes_G.dim() == 2:
        blocks_RxBxK = x_MxK.view(group_sizes_G.shape[0], -1, x_MxK.shape[-1])
        return torch.cat([gmm_reference(x, w_GxKxN, sizes) for x, sizes in zip(blocks_RxBxK, group_sizes_G)])
    pieces = torch.split(x_MxK, group_sizes_G.tolist(), dim=0)
    out = [p @ w_GxKxN[g] for g, p in enumerate(pieces)]
    return torch.cat(out, dim=0) if out else x_MxK.new_zeros(0, w_GxKxN.shape[-1])


# Every implementation by name, as a function that returns it. The ones living in other files are
# imported when a run first asks for them: the Pallas kernels (kernels_splash.py, kernels_pallas.py,
# kernels_gmm.py) load JAX, and tensor_parallel.py (the loss over a vocabulary split across tp ranks,
# which tensor_parallel.config picks) loads torch's tensor-parallel API; a run without them pays for
# neither. No file writes into another's table.
def _splash_attention():
    from kernels_splash import splash_attention
    return splash_attention


def _fused_linear_cross_entropy():
    from kernels_pallas import fused_linear_cross_entropy
    return fused_linear_cross_entropy


def _vocab_parallel_cross_entropy():
    return vocab_parallel_cross_entropy


def _pallas_gmm():
    from kernels_gmm import gmm
    return gmm


ATTENTION_IMPLS = {"sdpa": lambda: sdpa_attention, "splash": _splash_attention}
LOSS_IMPLS = {"plain": lambda: plain_cross_entropy, "fused": _fused_linear_cross_entropy,
              "vocab_parallel": _vocab_parallel_cross_entropy}
GMM_IMPLS = {"reference": lambda: gmm_reference, "gmm": _pallas_gmm}


def lookup_impl(registry, name, kind):
    if name not in registry:
        raise ValueError(f"unknown {kind} implementation {name!r}; have {sorted(registry)}")
    return registry[name]()


# --------------------------------------------------------------------------------------------------
# Modules

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_inv_freq(args):
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.hd, 2, dtype=torch.float32) / args.hd))
    if args.rope_scaling is None:
        return inv_freq
    factor, low, high, ctx = args.rope_scaling  # Llama 3.1: stretch only the low frequencies
    wavelen = 2 * math.pi / inv_freq
    smooth = (ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > ctx / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= ctx / high) & (wavelen <= ctx / low)
    return torch.where(is_mid, mid, scaled)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BxHxSxD, cos_SxD, sin_SxD):
    # fp32 tables; the result keeps x's dtype so q, k and v agree under autocast (XLA's autocast
    # does not cast scaled_dot_product_attention's inputs to one dtype, CUDA's does)
    return (x_BxHxSxD * cos_SxD + rotate_half(x_BxHxSxD) * sin_SxD).type_as(x_BxHxSxD)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        hd = args.hd
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x_BxSxD, cos, sin, attend=None):
        """`attend(q, k, v)`: how these tokens attend, the view of their sequence Transformer.hidden was
        given (a window or packed documents as a mask, a cp rank's chunks, a KV cache); None: the
        attention the config names, over whole causal sequences."""
        a = self.args
        B, S, _ = x_BxSxD.shape
        # (-1 heads: under tensor parallelism the projections hold this rank's heads only)
        q = self.q_proj(x_BxSxD).view(B, S, -1, a.hd)  # (B, S, H, hd)
        k = self.k_proj(x_BxSxD).view(B, S, -1, a.hd)  # (B, S, Hkv, hd)
        v = self.v_proj(x_BxSxD).view(B, S, -1, a.hd)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, S, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, S, hd)
        attend = attend or lookup_impl(ATTENTION_IMPLS, a.attn_impl, "attention")
        out = attend(q, k, v.transpose(1, 2))  # (B, H, S, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        """(SwiGLU output, aux loss 0): the same (output, aux) contract as MoE, so Block need not ask."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), x.new_zeros((), dtype=torch.float32)


def run_here(experts, x_MxD, group_sizes_E):
    """MoE dispatch without expert parallelism: every expert is local."""
    return experts(x_MxD, group_sizes_E)


def autocast_rows(x):
    """`x` in autocast's dtype under autocast (--dtype bf16 on fp32 weights): the grouped-matmul kernel
    is a custom op, which autocast does not cast as it does the reference's matmuls."""
    try:
        on = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # (a device autocast does not know: meta)
        return x
    return x.to(torch.get_autocast_dtype(x.device.type)) if on else x


class MoE(nn.Module):
    """Qwen 3-MoE block: softmax router, top-k, renormalized top-k weights, Switch-style load-balancing
    loss (arXiv 2101.03961). Dispatch: sort the T*k (token, expert) pairs by expert, run each expert's
    SwiGLU as one grouped matmul over its contiguous rows, scatter-add back weighted."""

    def __init__(self, args):
        super().__init__()
        self.args = args
        E, D, F_ = args.n_experts, args.dim, args.moe_ffn_dim
        self.gate = nn.Linear(D, E, bias=False)  # router
        self.w_gate_ExDxF = nn.Parameter(torch.empty(E, D, F_))
        self.w_up_ExDxF = nn.Parameter(torch.empty(E, D, F_))
        self.w_down_ExFxD = nn.Parameter(torch.empty(E, F_, D))
        self.dispatch = run_here

    def route_through(self, dispatch):
        """The declared seam for expert parallelism: `dispatch(experts, x_MxD, group_sizes_E)` gets the
        rows sorted by expert and this module's `experts` (the local grouped matmuls), and returns the
        rows' outputs in the same order; where the rows are computed is its business
        (expert_parallel.AllToAll sends them to the ranks that own their experts)."""
        self.dispatch = dispatch

    def forward(self, x_BxSxD):
        a = self.args
        # G routing groups of N tokens, each sorted by expert on its own: under SPMD one group a
        # data-parallel device (MaxText's per-shard routing), so no sort or gather crosses devices.
        # A token's experts and weights do not depend on its group: any G gives the same output, so
        # a batch that moe_groups does not divide (a decode step's one token) takes the largest that does.
        E, K, D = a.n_experts, a.top_k, x_BxSxD.shape[-1]
        G = math.gcd(a.moe_groups, x_BxSxD.shape[:-1].numel())
        x_GxNxD = x_BxSxD.reshape(G, -1, D)
        probs_GxNxE = F.softmax(self.gate(x_GxNxD).float(), dim=-1)
        top_w_GxNxK, top_e_GxNxK = probs_GxNxE.topk(K, dim=-1)
        top_w_GxNxK = top_w_GxNxK / top_w_GxNxK.sum(-1, keepdim=True)
        expert_GxM = top_e_GxNxK.reshape(G, -1)              # M = N*K rows a group, one per (token, expert)
        order_GxM = torch.argsort(expert_GxM, dim=-1, stable=True)
        group_GxM, token_GxM = torch.arange(G, device=x_BxSxD.device)[:, None].expand_as(order_GxM), order_GxM // K
        # (bincount's output size depends on the data; scatter_add's does not, so it traces)
        sizes_GxE = expert_GxM.new_zeros(G, E).scatter_add(1, expert_GxM, torch.ones_like(expert_GxM))
        x_MxD = autocast_rows(x_GxNxD[group_GxM, token_GxM].reshape(-1, D))  # the groups one after another
        y_MxD = self.dispatch(self.experts, x_MxD, sizes_GxE[0] if G == 1 else sizes_GxE)
        w_GxM = top_w_GxNxK.reshape(G, -1).gather(1, order_GxM)
        y_GxMxD = y_MxD.view(G, -1, D) * w_GxM[..., None].to(y_MxD.dtype)
        out_GxNxD = torch.zeros_like(x_GxNxD).index_put((group_GxM, token_GxM), y_GxMxD.to(x_GxNxD.dtype), accumulate=True)
        # load balance: E * sum_e (fraction of routed rows to e) * (mean router prob of e)
        aux = E * (sizes_GxE.sum(0).float() / expert_GxM.numel() * probs_GxNxE.reshape(-1, E).mean(0)).sum()
        return out_GxNxD.view_as(x_BxSxD), aux

    def experts(self, x_MxD, group_sizes_E):
        """Each row through its expert's SwiGLU; rows sorted by expert, group_sizes_E rows each (one
        grouped matmul per weight; (G, E) sizes: G routing groups' rows one after another, each
        sorted). Under expert parallelism: this rank's experts, on the rows sent to it."""
        gmm = lookup_impl(GMM_IMPLS, self.args.moe_impl, "grouped matmul")
        w_gate, w_up, w_down = (autocast_rows(w) for w in (self.w_gate_ExDxF, self.w_up_ExDxF, self.w_down_ExFxD))
        h_MxF = F.silu(gmm(x_MxD, w_gate, group_sizes_E)) * gmm(x_MxD, w_up, group_sizes_E)
        return gmm(h_MxF, w_down, group_sizes_E)


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MoE(args) if args.n_experts else MLP(args.dim, args.ffn_dim)

    def forward(self, x_BxSxD, cos, sin, attend=None):
        h = x_BxSxD + self.self_attn(self.input_layernorm(x_BxSxD), cos, sin, attend)
        out, aux = self.mlp(self.post_attention_layernorm(h))
        return h + out, aux


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        check_args(args)
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.sequence = WholeSequence()
        if not self.inv_freq.is_meta:  # (on the meta device the trainer fills it later: materialize.py)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Each parameter from its own (torch.initial_seed(), name) stream by `init_value`: the values the
        trainer's seed fill gives every layout (materialize.py); and the rope frequencies (a buffer)."""
        self.init_buffers()
        materialize.init_module(self, lambda name, shape, g: init_value(self.args, name, shape, g))

    @torch.no_grad()
    def init_buffers(self):
        """What is not a parameter: the rope frequencies (after to_empty they are unset)."""
        self.inv_freq.copy_(rope_inv_freq(self.args))

    def output_weight(self):
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def split_sequence(self, sequence):
        """The declared seam for how tokens sit in their sequence: `sequence.view(tokens_BxS, args)`
        gives each forward's view, its tokens' `positions` (RoPE's) and `layer(i)`, layer i's attention
        (None: the config's, over whole causal sequences). Default WholeSequence; context parallelism
        gives each process its chunks (context_parallel.py)."""
        self.sequence = sequence

    def rope(self, positions_S):
        """cos, sin (S, hd) at the tokens' positions in their sequence."""
        freqs = torch.outer(positions_S.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd): rotate-half layout
        return emb.cos(), emb.sin()

    def hidden(self, tokens_BxS, sequence=None):
        """Final-norm hidden states (B, S, D) and the summed MoE auxiliary loss. `sequence`: what the
        tokens continue (a KV cache while decoding: generate.py); by default the model's own."""
        view = (sequence or self.sequence).view(tokens_BxS, self.args)
        cos, sin = self.rope(view.positions)
        h, aux = self.run_layers(self.embed_tokens(tokens_BxS), cos, sin, view)
        return self.norm(h), aux

    def run_layers(self, h, cos, sin, view):
        """The layer loop. layer_scan.py may swap self.layers for one module that scans them (whole
        causal sequences only: its blocks take the config's attention)."""
        if not isinstance(self.layers, nn.ModuleList):
            if view.layer(0) is not None:
                raise NotImplementedError("--scan with a sliding window, packed documents or context parallelism")
            return self.layers(h, cos, sin)
        aux = h.new_zeros((), dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            h, layer_aux = layer(h, cos, sin, view.layer(i))
            aux = aux + layer_aux
        return h, aux

    def forward(self, tokens_BxS, targets_BxS=None, sequence=None):
        """Logits (B, S, V) without targets; with targets (cross-entropy, coef * aux loss). With a KV
        cache as `sequence` (generate.py) the tokens continue the cached ones."""
        h, aux = self.hidden(tokens_BxS, sequence)
        if targets_BxS is None:
            return h @ self.output_weight().t()
        loss_fn = lookup_impl(LOSS_IMPLS, self.args.loss_impl, "loss")
        ce = loss_fn(h.reshape(-1, h.shape[-1]), self.output_weight(), targets_BxS.reshape(-1))
        return ce, self.args.aux_loss_coef * aux


def init_value(args, name, shape, generator):
    """Parameter `name`'s initial values (GPT-2 style): norms 1; N(0, 0.02) with the residual output
    projections scaled by 1/sqrt(2 * layers); drawn from `generator` alone (fp32, on the host)."""
    if len(shape) == 1:
        return torch.ones(shape)  # norm weights
    std = 0.02 / math.sqrt(2 * args.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight", "w_down_ExFxD")) else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def next_token_loss(model, batch):
    """The language-model task's loss of a Transformer on batch (inputs, targets), each (B, S):
    (cross-entropy to report, cross-entropy + MoE load-balancing loss to differentiate)."""
    ce, aux = model(*batch)  # aux is 0 for dense models
    return ce, ce + aux
