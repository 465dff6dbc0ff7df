"""model_args.py: a decoder's config (ModelArgs), the published flavors, and what the config alone
says: its parameter counts and training FLOPs a token (torchtitan's formula), the TPU rewrite
(`tpu_config`: the Pallas kernels by name) and whether its step has data-dependent shapes.

model.py builds the modules from a ModelArgs and re-exports these names; the planner and the
checkpoint readers need only this file's arithmetic, not the modules.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int = 2
    head_dim: Optional[int] = None          # default dim // n_heads
    vocab_size: int = 256
    ffn_dim: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple] = None    # Llama 3.1: (factor, low_freq, high_freq, original_ctx)
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    qk_norm: bool = False                   # Qwen 3
    n_experts: int = 0                      # > 0: every block's MLP is a MoE (Qwen 3-MoE)
    top_k: int = 0
    moe_ffn_dim: int = 0
    aux_loss_coef: float = 0.001            # Qwen 3-MoE router_aux_loss_coef
    attn_impl: str = "sdpa"                 # "sdpa" | "splash" (Pallas)
    loss_impl: str = "plain"                # "plain" | "fused" (Pallas)
    moe_impl: str = "reference"             # "reference" | "gmm" (Pallas)
    moe_groups: int = 1                     # tokens routed in this many equal groups, each sorted alone
    #                                         (fewer where the batch's tokens are not a multiple)
    ep_buffer_factor: float = 0.0           # > 0: ep's exchange sends a peer at most this x a balanced
    #                                         share of a rank's rows, dropping the rest (expert_parallel.py;
    #                                         MaxText's ragged_buffer_factor); 0: dropless
    sliding_window: Optional[int] = None    # a query sees itself and the window-1 keys before it
    doc_sep: Optional[int] = None           # packed documents: this token ends one; attention stays inside

    @property
    def hd(self):
        return self.head_dim or self.dim // self.n_heads


_L31 = (8.0, 1.0, 4.0, 8192)  # Llama 3.1 rope scaling (factor, low_freq_factor, high_freq_factor, ctx)
_LLAMA = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, rope_scaling=_L31,
              max_seq_len=131072, n_kv_heads=8)
_QWEN = dict(vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, head_dim=128, qk_norm=True,
             max_seq_len=40960)
FLAVORS = {
    # Debug flavors: byte-level (vocab 256), small enough to train on 2 CPU cores in minutes.
    "llama3_debug": ModelArgs(),
    "qwen3_debug": ModelArgs(head_dim=32, qk_norm=True, norm_eps=1e-6, tie_embeddings=True),
    "qwen3_moe_debug": ModelArgs(head_dim=32, qk_norm=True, norm_eps=1e-6, n_experts=8, top_k=2,
                                 moe_ffn_dim=128),
    # Published architectures (Meta's params.json / Qwen's config.json).
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, **_LLAMA),
    "llama3_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **_LLAMA),
    "llama3_405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248, **_LLAMA),
    "qwen3_0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072,
                            tie_embeddings=True, **_QWEN),
    "qwen3_1.7b": ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144,
                            tie_embeddings=True, **_QWEN),
    "qwen3_8b": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN),
    "qwen3_32b": ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600, **_QWEN),
    "qwen3_30b_a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                               n_experts=128, top_k=8, moe_ffn_dim=768, **_QWEN),
    "qwen3_235b_a22b": ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                                 n_experts=128, top_k=8, moe_ffn_dim=1536, **_QWEN),
}


def dynamic_shapes_reason(args):
    """Why this config's step has data-dependent shapes (so it cannot be traced ahead of time:
    graph mode, --scan), or None. The reference MoE dispatch reads per-expert group sizes on the host."""
    if args.n_experts and args.moe_impl == "reference":
        return ("the reference MoE dispatch reads group sizes on the host (data-dependent shapes): "
                "add --kernels pallas (the grouped-matmul kernel has static shapes)")
    return None


def tpu_config(args):
    """The config rewrite for TPU: same model, Pallas kernels for attention, loss and experts."""
    return dataclasses.replace(args, attn_impl="splash", loss_impl="fused",
                               moe_impl="gmm" if args.n_experts else args.moe_impl)


# --------------------------------------------------------------------------------------------------
# Counts from the config alone

def param_counts(args):
    """(total, embedding, active matmul) parameter counts, from the config alone. `active matmul`:
    the weights one token multiplies (the MoE router and its top_k experts; the output head, tied
    or not), i.e. all active parameters except the embedding lookup, which is no matmul."""
    D, hd, L = args.dim, args.hd, args.n_layers
    attn = D * hd * (2 * args.n_heads + 2 * args.n_kv_heads) + (2 * hd if args.qk_norm else 0)
    if args.n_experts:
        mlp_total = D * args.n_experts + 3 * args.n_experts * D * args.moe_ffn_dim
        mlp_active = D * args.n_experts + 3 * args.top_k * D * args.moe_ffn_dim
    else:
        mlp_total = mlp_active = 3 * D * args.ffn_dim
    per_layer_norms = 2 * D
    emb = args.vocab_size * D
    head = 0 if args.tie_embeddings else emb
    total = emb + head + L * (attn + mlp_total + per_layer_norms) + D
    active_matmul = L * (attn + mlp_active + per_layer_norms) + D + emb  # (+ emb: the output head)
    return total, emb, active_matmul


def flops_per_token(args, seq_len):
    """Training FLOPs per token, torchtitan's formula: 6 * (N - N_embedding) + 12 * L * H * Dh * S.

    6N: forward 2N + backward 4N for every weight a token multiplies (the embedding lookup is not a
    matmul, but the output projection is, tied or not); MoE counts only the router and the top_k
    active experts. 12*L*H*Dh*S: QK^T and PV, forward and backward, over the full (not causal) S.
    """
    _, _, active = param_counts(args)
    return 6 * active + 12 * args.n_layers * args.n_heads * args.hd * seq_len
