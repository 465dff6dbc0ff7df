"""flux/shape.py: FLUX's transformer as the planner's step model sees it (planner/shapes.Shape): its
matmuls, its joint attention, and the activations each kind of block's backward reads, under the
names MaxDiffusion's remat policies use (models/flux/transformers/transformer_flux_flax.py's
checkpoint names; models/gradient_checkpoint.py's FLUX_OPTIMIZED takes one policy for the double
blocks and another for the single ones). The FLUX family hands it to the planner through
ModelFamily.plan (flux/task.plan_workload): the planner itself imports no workload.
"""
from flux import model as flux
from planner.shapes import Matmul, Shape


def flux_shape(f, img_tokens, txt_tokens, label="flux"):
    """FLUX's transformer on cached latents: `depth` double blocks (separate image and text weights,
    joint attention) and `depth_single_blocks` single blocks (one fused linear in, one out), all
    attending non-causally over img + txt tokens. Modulation matmuls run once a sample (on `vec`)."""
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
    # the MLP's hidden pre- and post-GELU. A double block's out_proj is the attention branch's output
    # (the MLP's norm reads the residual it makes); a single block's linear2 output only joins the
    # residual, the next block's input: nothing reads it.
    double = {"decoder_layer_input": h, "norms": 2 * h, "query_proj": h, "key_proj": h, "value_proj": h,
              "context": h, "out_proj": h, "mlpwi_0": r * h, "mlp_act": r * h}
    single = {"decoder_layer_input": h, "norms": h, "query_proj": h, "key_proj": h, "value_proj": h,
              "mlpwi_0": r * h, "context": h, "mlp_act": r * h, "lin2_hidden_states": h}
    redo_double = {"query_proj": ["img_qkv", "txt_qkv"], "context": ["attention"], "out_proj": ["img_proj", "txt_proj"],
                   "mlpwi_0": ["img_mlp_in", "txt_mlp_in"]}
    redo_single = {"query_proj": ["single_in"], "context": ["attention"]}   # (linear1 makes q, k, v, mlp_in)
    qkv = ("query_proj", "key_proj", "value_proj")
    aliases = {"qkv_proj": qkv, "img_qkv_proj": qkv, "txt_qkv_proj": qkv, "attn_output": ("context",),
               "lin1_norm_hidden_states": qkv + ("mlpwi_0",)}
    # two modulated LayerNorms (read + write, plus scale/shift), gates, residuals, RoPE on q and k,
    # GELU over r*h
    elementwise = 2 * 3 * h + 2 * 3 * h + 2 * 2 * h + 2 * r * h
    return Shape(label, S, L, {"tp": total, "experts": 0, "rest": 0}, {"tp": per_block, "experts": 0, "rest": 0},
                 tuple(mm), dict(heads=H, head_dim=hd, seq=S, causal=False, layers=L), double, redo_double,
                 elementwise, dim=h, model_flops=flux.flops_per_sample(f, img_tokens, txt_tokens),
                 aliases=aliases, internal=("norms", "mlp_act"), unread=("lin2_hidden_states",),
                 kinds=(("double", Ld, double, redo_double), ("single", Ls, single, redo_single)))
