"""tensor_parallel.py: Megatron-style tensor parallelism with sequence parallelism, through PyTorch's
own torch.distributed.tensor.parallel (Shoeybi et al., arXiv 1909.08053; Korthikanti et al., arXiv
2205.05198; the plan follows torchtitan's Llama plan).

Inside a block the matmuls are split so that only two collectives per sub-layer are needed:

    x (B, S/tp, D) --norm--> all-gather S --> q,k,v / gate,up: column-wise, (B, S, H/tp * hd): local heads
                                         --> o / down: row-wise, partial sums --> reduce-scatter S --> (B, S/tp, D)

Between sub-layers the residual stream is split on the sequence (SequenceParallel): the norms and
the residual adds run on S/tp tokens, and the all-reduce of plain TP becomes a reduce-scatter plus
an all-gather (same bytes, 1/tp of the activation memory). The styles install forward hooks that
convert a module's inputs and outputs between local tensors and DTensors; the weights become
DTensors on the tp mesh (Shard(0) column-wise, Shard(1) row-wise, Replicate for the norms), so their
gradient reductions come from DTensor's autograd. Qwen 3's per-head q/k norms run on the local
heads: their weight is replicated and their gradient summed over tp (SequenceParallel on the head
dim does exactly that). The embedding and the output head stay whole on every tp rank (their
outputs are identical there, so are their gradients): the embedding's output is split on the
sequence, the final norm's output gathered, and the loss computed on the full sequence. (torchtitan
shards both, with a loss-parallel cross-entropy; that saves memory on large vocabularies.)

SimpleFSDP composes on top (simplefsdp.py): a parameter's 2-D placement is (FSDP shard over the
data-parallel dims, its TP placement over tp), the FSDP shard on a different dim than the TP one.
"""
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)


def check(args, tp):
    """Refusals, one line each: the layout must split heads and the FFN evenly."""
    if args.n_experts:
        return "tp with MoE blocks is not built (experts use ep=E)"
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(args, name) % tp:
            return f"{name}={getattr(args, name)} is not divisible by tp={tp}"
    return None


def block_plan(qk_norm):
    seq = Shard(1)  # (B, S, D): the residual stream is split on S between sub-layers
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_layouts=(seq, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None), use_local_output=True),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=seq),
    }
    if qk_norm:  # (B, S, H/tp, hd): the local heads are a shard of dim 2
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _gather_sequence(module, inputs, out):
    return out.redistribute(placements=[Replicate()]).to_local()  # (B, S/tp, D) shards -> (B, S, D)


def parallelize(model, tp_mesh):
    """Apply the plan in place; weights become DTensors on tp_mesh. Returns the model."""
    parallelize_module(model, tp_mesh, {
        "embed_tokens": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    })
    model.norm.register_forward_hook(_gather_sequence)  # the loss sees the whole sequence
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan(model.args.qk_norm))
    return model
