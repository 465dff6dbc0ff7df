"""shapes.py: a model as the step-time model sees it: its matmuls, its attention, the activations its
backward reads, and how a remat policy treats each of those.

`Shape` lists, per sample, every matmul (rows x k x n, how many layers have it, whether tensor or
expert parallelism splits it), the attention (heads, head dim, sequence, causal), the named
activations a layer's backward reads (elements per token; the names are MaxText's checkpoint names,
`decoder_layer_input`, `query_proj`, ..., so a MaxText recipe's remat policy reads as written), and
the bytes its non-matmul ops move. `lm_shape` builds one from a model.ModelArgs; another model family
describes its own through ModelFamily.plan (FLUX: flux/shape.py), so nothing here imports a workload;
PLANNER_MODELS adds the published architectures model.py has no flavor for (Llama 2 70B, Mixtral
8x7B), described only for the planner. A shape with several kinds of block (FLUX's double and single)
lists each kind's activations (`kinds`), and a policy may differ by kind.

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
from model import flops_per_token

# Published configs (Meta's Llama 2 params.json; Mistral's Mixtral-8x7B and -8x22B config.json).
PLANNER_MODELS = {
    "llama2_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000),
    "mixtral_8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                              n_experts=8, top_k=2, moe_ffn_dim=14336),
    "mixtral_8x22b": ModelArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384, vocab_size=32768,
                               n_experts=8, top_k=2, moe_ffn_dim=16384),
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
    loss_head: int = 0          # > 0: the fused loss's head elements, whole on every device under FSDP
    #                             (minititan's kernel reads all of it: sharded_kernels.mean_over_rows)
    aliases: dict = dataclasses.field(default_factory=dict)  # a published name -> the acts it stands for
    internal: tuple = ()        # acts no policy can name (norms, the MLP's activation): kept only by "none"
    unread: tuple = ()          # acts the backward never reads (mlpwo: its output only joins the residual,
    #                             the next layer's input): a policy may name them, they cost nothing (JAX
    #                             keeps only residuals the backward reads, whatever the policy says)
    kinds: tuple = ()           # (kind, layers, acts, recompute_of) a kind of block; () = one "decoder"
    dim: int = 0
    n_experts: int = 0
    top_k: int = 0
    ep_buffer_factor: float = 0.0  # ep's exchange buffers: f / ep of a device's rows a peer (0: all of them)
    model_flops: float = 0.0    # the usual count (6N + attention), for MFU


def lm_param_groups(a):
    """Parameter counts by how a layout splits them, whole model and one layer: tp (the attention and
    dense-MLP matmuls, the embedding and head, vocabulary-split), experts (split over ep), rest (norms,
    routers: FSDP over ici only). An MoE model has no tp (tensor_parallel refuses its blocks), so its
    embedding is `rest`. The one count the dry run and the step model both use."""
    D, hd, L = a.dim, a.hd, a.n_layers
    emb = param_counts(a)[1] * (1 if a.tie_embeddings else 2)
    attn = D * hd * (2 * a.n_heads + 2 * a.n_kv_heads)
    layer_tp = attn + (0 if a.n_experts else 3 * D * a.ffn_dim)
    layer_experts = 3 * a.n_experts * D * a.moe_ffn_dim if a.n_experts else 0
    total = param_counts(a)[0]
    layer_total = (param_counts(dataclasses.replace(a, n_layers=2))[0]
                   - param_counts(dataclasses.replace(a, n_layers=1))[0])
    whole = {"tp": L * layer_tp + (0 if a.n_experts else emb), "experts": L * layer_experts}
    whole["rest"] = total - whole["tp"] - whole["experts"]
    return whole, {"tp": layer_tp, "experts": layer_experts, "rest": layer_total - layer_tp - layer_experts}


def lm_shape(a, seq, label="", capacity_factor=1.0, moe_dispatch="gmm", fused_loss=False):
    """A decoder-only language model at sequence length `seq`. MoE: `capacity_factor` > 1 pads every
    expert to that many slots a routed token ("dropped", MaxText's default MoE); `moe_dispatch`
    "einsum" adds the one-hot dispatch and combine contractions (tokens x experts x capacity x dim)
    that the dropped path runs as matmuls, "gmm" (megablox / kernels_gmm) has none."""
    D, H, KV, hd, L, S = a.dim, a.n_heads, a.n_kv_heads, a.hd, a.n_layers, seq
    whole, layer = lm_param_groups(a)
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
            "mlpwi_1": F * per_token, "mlp_act": F * per_token, "mlpwo": D * per_token}
    recompute_of = {"query_proj": ["query_proj"], "key_proj": ["key_proj"], "value_proj": ["value_proj"],
                    "context": ["attention"], "out_proj": ["out_proj"], "mlpwi_0": ["mlpwi_0"],
                    "mlpwi_1": ["mlpwi_1"]}
    # MaxText's names for fused projections (and its MoE layers' second names) -> this table's
    aliases = {"qkv_proj": ("query_proj", "key_proj", "value_proj"), "kv_proj": ("key_proj", "value_proj"),
               "mlpwi": ("mlpwi_0", "mlpwi_1")}
    if a.n_experts:
        aliases.update(moe_mlpwi_0=("mlpwi_0",), moe_mlpwi_1=("mlpwi_1",), moe_mlpwo=("mlpwo",))
    # norms (read + write D, twice), RoPE on q and k, two residual adds (read 2, write 1), SwiGLU
    # (read 2F, write F), qk-norm where the model has it
    elementwise = 10 * D + 2 * (H + KV) * hd * (2 if a.qk_norm else 1) + 3 * F * per_token
    return Shape(label, S, L, whole, layer, tuple(mm), dict(heads=H, head_dim=hd, seq=S, causal=True, layers=L, kv_heads=KV),
                 acts, recompute_of, elementwise, vocab=0 if fused_loss else a.vocab_size,
                 loss_head=a.vocab_size * D if fused_loss else 0, dim=D,
                 n_experts=a.n_experts, top_k=a.top_k, ep_buffer_factor=a.ep_buffer_factor,
                 model_flops=flops_per_token(a, S) * S,
                 aliases=aliases, internal=("norms", "mlp_act"), unread=("mlpwo",))


# Remat policies as MaxText writes them (src/maxtext/layers/decoders.py get_remat_policy and
# utils/maxtext_utils.get_save_and_offload_names): the names each saves (or offloads); every other named
# tensor is recomputed, and each layer's input is always kept (it is the checkpoint). A preset lists
# MaxText's fused-projection variants too (kv_proj, qkv_proj, mlpwi); a shape resolves them by its aliases.
_QKV = ("query_proj", "key_proj", "value_proj", "kv_proj", "qkv_proj")
_MINIMAL = _QKV + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
_saving = lambda names, place="device": {n: place for n in names}
POLICIES = {
    "none": None,   # no remat: every tensor the backward reads stays in HBM
    # minititan's --remat (graph_passes.remat): every matmul output the backward reads kept
    "save_matmul_outputs": _saving(("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1")),
    "minimal": _saving(_MINIMAL),
    "minimal_with_context": _saving(_MINIMAL + ("context",)),
    "save_dot_with_context_except_mlp": _saving(_QKV + ("context", "out_proj")),
    "save_dot_except_mlpwi": _saving(_QKV + ("out_proj", "mlpwo")),
    "save_dot_except_mlp": _saving(_QKV + ("out_proj",)),
    "save_qkv_proj": _saving(_QKV),
    "save_out_proj": _saving(("out_proj",)),
    "qkv_proj_offloaded": _saving(("query_proj", "value_proj", "key_proj", "kv_proj"), "offload"),
    "minimal_offloaded": _saving(_MINIMAL, "offload"),
    "full": {},     # only each layer's input: the whole forward of a layer again in its backward
    # MaxDiffusion's FLUX_OPTIMIZED (models/gradient_checkpoint.py): double blocks save every named
    # tensor but the two qkv projections, single blocks only the attention output and linear1's output
    "flux_optimized": {"double": "save_any_but:img_qkv_proj,txt_qkv_proj",
                       "single": _saving(("attn_output", "lin1_norm_hidden_states"))},
}
PLACES = ("device", "offload", "remat")


def block_kinds(shape):
    """(kind, layers, acts, recompute_of) of each kind of block: one "decoder" kind unless the shape
    lists several (FLUX: "double", "single")."""
    return shape.kinds or (("decoder", shape.layers, shape.acts, shape.recompute_of),)


def known_names(shape, acts):
    return sorted(set(acts) - set(shape.internal) | set(shape.aliases))


def _by_kind(policy):
    return isinstance(policy, dict) and bool(policy) and set(policy) <= {"decoder", "double", "single"}


def _resolve(shape, acts, policy):
    """A policy for one block kind -> {name in acts: place}; refuses a name the shape does not know."""
    preset = isinstance(policy, str)
    if preset and policy.startswith("save_any_but:"):      # every named tensor saved, but these
        spared = policy.split(":", 1)[1].split(",")
        policy = {**{n: "device" for n in known_names(shape, acts) if n not in spared}, **{n: "remat" for n in spared}}
    elif preset:
        if policy not in POLICIES or _by_kind(POLICIES[policy]):
            raise ValueError(f"remat policy {policy!r}: choose one of {', '.join(POLICIES)} or a custom mapping")
        policy = POLICIES[policy]
    if policy is None:                                     # "none": what the backward reads, on device
        return {n: "device" for n in acts if n not in shape.unread}
    return _places(shape, acts, policy, preset)


def _places(shape, acts, policy, preset):
    bad = sorted({v for v in policy.values()} - set(PLACES))
    if bad:
        raise ValueError(f"remat policy values must be device / offload / remat, got {bad}")
    known = known_names(shape, acts)
    unknown = sorted(n for n in policy if n not in known)
    if unknown and not preset:   # (a preset names every variant; a custom policy must name this model's)
        raise ValueError(f"remat policy names {', '.join(unknown)}, which {shape.label or 'this model'} does not "
                         f"have; the planner knows: {', '.join(known)}")
    where = {n: "remat" for n in acts}
    for name, place in policy.items():
        for n in shape.aliases.get(name, (name,)):
            if n in where:
                where[n] = place
    if where.get("decoder_layer_input") == "remat":   # the checkpoint itself: saved, never recomputed
        where["decoder_layer_input"] = "device"
    return where


def policy_of(shape, policy):
    """{kind: {name: "device" | "offload" | "remat"}} for each of the shape's block kinds. `policy`:
    a POLICIES name, a MaxText "custom" mapping {name: place} (unnamed: "remat", as there; a name the
    model does not have is refused, listing the ones it has), or {kind: either} for a model whose
    kinds take different policies (FLUX's "double" and "single" blocks)."""
    kinds = block_kinds(shape)
    per_kind = POLICIES.get(policy) if isinstance(policy, str) else policy
    if _by_kind(per_kind):
        if set(per_kind) != {k[0] for k in kinds}:
            raise ValueError(f"remat policy by block kind names {', '.join(sorted(per_kind))}; {shape.label or 'this model'} "
                             f"has {', '.join(k[0] for k in kinds)}")
        return {kind: _resolve(shape, acts, per_kind[kind]) for kind, _, acts, _ in kinds}
    return {kind: _resolve(shape, acts, policy) for kind, _, acts, _ in kinds}


def policy_split(shape, policy):
    """(device, offload, remat) elements a token averaged over the layers, the names recomputed, and
    what recomputing them costs: {matmul name or "attention": share of the layers}, under `policy`."""
    totals = {"device": 0.0, "offload": 0.0, "remat": 0.0}
    names, redo = [], {}
    places = policy_of(shape, policy)
    for kind, layers, acts, recompute_of in block_kinds(shape):
        share = layers / shape.layers
        for name, elems in acts.items():
            if name in shape.unread:          # nothing reads it: never a residual, whatever the policy
                continue
            place = places[kind].get(name, "remat")
            totals[place] += elems * share
            if place == "remat":
                names += [] if name in names else [name]
                for m in recompute_of.get(name, []):
                    redo[m] = redo.get(m, 0) + share
    return totals["device"], totals["offload"], totals["remat"], names, redo
