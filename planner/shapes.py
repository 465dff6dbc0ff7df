"""shapes.py: a model as the step-time model sees it: its matmuls, its attention, the activations its
backward reads, and how a remat policy treats each of those.

`Shape` lists, per sample, every matmul (rows x k x n, how many layers have it, whether tensor or
expert parallelism splits it), the attention (heads, head dim, sequence, causal), the named
activations a layer's backward reads (elements per token; the names are MaxText's checkpoint names,
`decoder_layer_input`, `query_proj`, ..., so a MaxText recipe's remat policy reads as written), and
the bytes its non-matmul ops move. `lm_shape` builds one from a model.ModelArgs, `flux_shape` from
a flux.FluxArgs; PLANNER_MODELS adds the published architectures model.py has no flavor for
(Llama 2 70B, Mixtral 8x7B), described only for the planner.

Remat policies (`policy_of`) map each named activation to "device" (saved in HBM), "offload" (saved
in host memory) or "remat" (recomputed in the backward). What a policy recomputes is charged in
FLOPs (the matmuls whose outputs are rematerialized; the attention forward when its output is) and
in HBM bytes (the norms and activations are recomputed whenever anything is), so a policy's memory
and its time come from the same table. Sources: MaxText's `remat_policy` options (base.yml:
"full", "save_dot_except_mlpwi", "save_qkv_proj", "custom" with per-name device/offload/remat);
minititan's own `--remat` (graph_passes.remat) keeps every matmul output: "save_matmul_outputs".
"""
import dataclasses

from model import ModelArgs, param_counts

# Published configs (Meta's Llama 2 params.json; Mistral's Mixtral-8x7B config.json).
PLANNER_MODELS = {
    "llama2_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000),
    "mixtral_8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                              n_experts=8, top_k=2, moe_ffn_dim=14336),
}


@dataclasses.dataclass(frozen=True)
class Matmul:
    name: str         # the activation it writes
    rows: float       # rows per sample through it (tokens; x top_k x capacity for experts)
    k: int
    n: int
    layers: int       # how many layers have it
    split: str        # "tp": tensor parallelism splits it; "experts": grouped over the experts; "none"

    @property
    def flops(self):
        """Forward FLOPs of one sample through every layer that has it."""
        return 2 * self.rows * self.k * self.n * self.layers


@dataclasses.dataclass(frozen=True)
class Shape:
    label: str
    tokens: int                 # tokens per sample
    layers: int                 # blocks (the unit of FSDP's gather and of remat)
    params: dict                # parameters by how a layout splits them: tp / experts / rest
    layer_params: dict          # the same for the largest block
    matmuls: tuple              # Matmul, forward
    attention: dict             # heads, head_dim, seq, causal, layers
    acts: dict                  # name -> elements a token a layer that the backward reads (bf16)
    recompute_of: dict          # name -> matmul names (and "attention") recomputing it costs
    elementwise: float          # elements a token a layer the forward's non-matmul ops read + write
    vocab: int = 0              # > 0: the loss's logits (tokens x vocab) are materialized
    dim: int = 0
    n_experts: int = 0
    top_k: int = 0
    model_flops: float = 0.0    # the usual count (6N + attention), for MFU


def _lm_param_groups(a):
    """tp: attention and dense-MLP matmuls, embedding and head; experts; rest (norms, routers)."""
    emb = param_counts(a)[1] * (1 if a.tie_embeddings else 2)
    attn = a.dim * a.hd * (2 * a.n_heads + 2 * a.n_kv_heads)
    layer_tp = attn + (0 if a.n_experts else 3 * a.dim * a.ffn_dim)
    layer_experts = 3 * a.n_experts * a.dim * a.moe_ffn_dim if a.n_experts else 0
    layer_rest = 2 * a.dim + (a.dim * a.n_experts) + (2 * a.hd if a.qk_norm else 0)
    whole = {"tp": a.n_layers * layer_tp + emb, "experts": a.n_layers * layer_experts,
             "rest": a.n_layers * layer_rest + a.dim}
    return whole, {"tp": layer_tp, "experts": layer_experts, "rest": layer_rest}


def lm_shape(a, seq, label="", capacity_factor=1.0, moe_dispatch="gmm", fused_loss=False):
    """A decoder-only language model at sequence length `seq`. MoE: `capacity_factor` > 1 pads every
    expert to that many slots a routed token ("dropped", MaxText's default MoE); `moe_dispatch`
    "einsum" adds the one-hot dispatch and combine contractions (tokens x experts x capacity x dim)
    that the dropped path runs as matmuls, "gmm" (megablox / kernels_gmm) has none."""
    from model import flops_per_token
    D, H, KV, hd, L, S = a.dim, a.n_heads, a.n_kv_heads, a.hd, a.n_layers, seq
    whole, layer = _lm_param_groups(a)
    mm = [Matmul("query_proj", S, D, H * hd, L, "tp"), Matmul("key_proj", S, D, KV * hd, L, "tp"),
          Matmul("value_proj", S, D, KV * hd, L, "tp"), Matmul("out_proj", S, H * hd, D, L, "tp")]
    if a.n_experts:
        routed = S * a.top_k * capacity_factor
        F, split = a.moe_ffn_dim, "experts"
        mm.append(Matmul("router", S, D, a.n_experts, L, "none"))
        if moe_dispatch == "einsum":  # dispatch + combine: each token against experts x capacity slots
            slots = S * a.top_k * capacity_factor
            mm += [Matmul("dispatch", S, slots, D, L, "experts"), Matmul("combine", S, slots, D, L, "experts")]
    else:
        routed, F, split = S, a.ffn_dim, "tp"
    mm += [Matmul("mlpwi_0", routed, D, F, L, split), Matmul("mlpwi_1", routed, D, F, L, split),
           Matmul("mlpwo", routed, F, D, L, split), Matmul("logits", S, D, a.vocab_size, 1, "tp")]
    per_token = routed / S
    acts = {"decoder_layer_input": D, "norms": 2 * D, "query_proj": H * hd, "key_proj": KV * hd,
            "value_proj": KV * hd, "context": H * hd, "out_proj": D, "mlpwi_0": F * per_token,
            "mlpwi_1": F * per_token, "mlp_act": F * per_token}
    recompute_of = {"query_proj": ["query_proj"], "key_proj": ["key_proj"], "value_proj": ["value_proj"],
                    "context": ["attention"], "out_proj": ["out_proj"], "mlpwi_0": ["mlpwi_0"],
                    "mlpwi_1": ["mlpwi_1"]}
    # norms (read + write D, twice), RoPE on q and k, two residual adds (read 2, write 1), SwiGLU
    # (read 2F, write F), qk-norm where the model has it
    elementwise = 10 * D + 2 * (H + KV) * hd * (2 if a.qk_norm else 1) + 3 * F * per_token
    return Shape(label, S, L, whole, layer, tuple(mm), dict(heads=H, head_dim=hd, seq=S, causal=True, layers=L),
                 acts, recompute_of, elementwise, vocab=0 if fused_loss else a.vocab_size, dim=D,
                 n_experts=a.n_experts, top_k=a.top_k, model_flops=flops_per_token(a, S) * S)


def flux_shape(f, img_tokens, txt_tokens, label="flux"):
    """FLUX's transformer on cached latents: `depth` double blocks (separate image and text weights,
    joint attention) and `depth_single_blocks` single blocks (one fused linear in, one out), all
    attending non-causally over img + txt tokens. Modulation matmuls run once a sample (on `vec`)."""
    from flux import model as flux
    h, r, S = f.hidden_size, int(f.mlp_ratio), img_tokens + txt_tokens
    hd, H, Ld, Ls = h // f.num_heads, f.num_heads, f.depth, f.depth_single_blocks
    L = Ld + Ls
    mm = []
    for stream, rows in (("img", img_tokens), ("txt", txt_tokens)):
        mm += [Matmul(f"{stream}_qkv", rows, h, 3 * h, Ld, "tp"), Matmul(f"{stream}_proj", rows, h, h, Ld, "tp"),
               Matmul(f"{stream}_mlp_in", rows, h, r * h, Ld, "tp"), Matmul(f"{stream}_mlp_out", rows, r * h, h, Ld, "tp")]
    mm += [Matmul("single_in", S, h, (3 + r) * h, Ls, "tp"), Matmul("single_out", S, (1 + r) * h, h, Ls, "tp")]
    total = flux.param_count(f)
    per_block = total // max(L, 1)
    # the saved set a block's backward reads, a token: input, modulated norms, qkv, attention output,
    # the MLP's hidden pre- and post-GELU (single blocks: same sizes, fused)
    acts = {"decoder_layer_input": h, "norms": 2 * h, "query_proj": h, "key_proj": h, "value_proj": h,
            "context": h, "out_proj": h, "mlpwi_0": r * h, "mlp_act": r * h}
    recompute_of = {"query_proj": ["img_qkv", "txt_qkv", "single_in"], "key_proj": [], "value_proj": [],
                    "context": ["attention"], "out_proj": ["img_proj", "txt_proj"],
                    "mlpwi_0": ["img_mlp_in", "txt_mlp_in"]}
    # two modulated LayerNorms (read + write, plus scale/shift), gates, residuals, RoPE on q and k,
    # GELU over r*h
    elementwise = 2 * 3 * h + 2 * 3 * h + 2 * 2 * h + 2 * r * h
    return Shape(label, S, L, {"tp": total, "experts": 0, "rest": 0}, {"tp": per_block, "experts": 0, "rest": 0},
                 tuple(mm), dict(heads=H, head_dim=hd, seq=S, causal=False, layers=L), acts, recompute_of,
                 elementwise, dim=h, model_flops=flux.flops_per_sample(f, img_tokens, txt_tokens))


MATMUL_OUTPUTS = ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1")
POLICIES = {
    # everything the forward wrote stays in HBM
    "none": lambda name: "device",
    # minititan's --remat (graph_passes.remat): matmul outputs kept, the cheap ops recomputed
    "save_matmul_outputs": lambda name: "device" if name in MATMUL_OUTPUTS + ("decoder_layer_input",) else "remat",
    # MaxText: every dot except the MLP's two input projections
    "save_dot_except_mlpwi": lambda name: "device" if name in ("decoder_layer_input", "query_proj", "key_proj",
                                                               "value_proj", "context", "out_proj") else "remat",
    "save_qkv_proj": lambda name: "device" if name in ("decoder_layer_input", "query_proj", "key_proj",
                                                       "value_proj") else "remat",
    # only each layer's input: the whole forward of a layer again in its backward
    "full": lambda name: "device" if name == "decoder_layer_input" else "remat",
}


def policy_of(policy):
    """A remat policy -> name -> "device" | "offload" | "remat". `policy` is a POLICIES name or a
    MaxText "custom" mapping {name: "device" | "offload" | "remat"} (unnamed: "remat", as there)."""
    if isinstance(policy, dict):
        bad = {v for v in policy.values()} - {"device", "offload", "remat"}
        if bad:
            raise ValueError(f"remat policy values must be device / offload / remat, got {sorted(bad)}")
        return lambda name: policy.get(name, "remat")
    if policy not in POLICIES:
        raise ValueError(f"remat policy {policy!r}: choose one of {', '.join(POLICIES)} or a custom mapping")
    return POLICIES[policy]


def policy_split(shape, policy):
    """(device, offload, remat) elements a token a layer, and the names recomputed, under `policy`."""
    where = policy_of(policy)
    totals = {"device": 0.0, "offload": 0.0, "remat": 0.0}
    recomputed = []
    for name, elems in shape.acts.items():
        # a layer's input is the checkpoint itself: saved (or offloaded), never recomputed
        place = where(name)
        if name == "decoder_layer_input" and place == "remat":
            place = "device"
        totals[place] += elems
        if place == "remat":
            recomputed.append(name)
    return totals["device"], totals["offload"], totals["remat"], recomputed
