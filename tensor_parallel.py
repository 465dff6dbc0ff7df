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
dim does exactly that). The embedding and the output head are split on the vocabulary, as
torchtitan does: the embedding row-wise (each rank looks up its rows, a reduce-scatter sums and
splits the sequence), the head's logits stay split (B*S, V/tp) and the cross-entropy is computed
on the pieces (`vocab_parallel_cross_entropy`: an all-reduce of the max, of the sum of exponentials
and of the target's logit; Megatron's "parallel cross-entropy"), so no rank holds full logits.

SimpleFSDP composes on top (simplefsdp.py): a parameter's 2-D placement is (FSDP shard over the
data-parallel dims, its TP placement over tp), the FSDP shard on a different dim than the TP one.
"""
import dataclasses

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)



def config(args):
    """The config rewrite for tp > 1 (as model.tpu_config is for the Pallas kernels): the loss over
    the head's vocabulary split, `vocab_parallel_cross_entropy` below (model.LOSS_IMPLS names it)."""
    return dataclasses.replace(args, loss_impl="vocab_parallel")


def check(args, tp):
    """Refusals, one line each: the layout must split heads and the FFN evenly."""
    if args.n_experts:
        return "tp with MoE blocks is not built (experts use ep=E)"
    if args.loss_impl != "plain":
        return f"tp splits the output head over the vocabulary; the {args.loss_impl!r} loss needs it whole (drop --kernels pallas)"
    if args.vocab_size % tp:
        return f"vocab_size={args.vocab_size} is not divisible by tp={tp}"
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
    return out.redistribute(placements=[Replicate()])  # (B, S/tp, D) -> (B, S, D), still a DTensor


def vocab_parallel_cross_entropy(h_NxD, w_VxD, targets_N, ignore_index=-100):
    """Cross-entropy over logits split on the vocabulary: h replicated, w Shard(0) over tp (DTensors).
    Each rank has logits for its V/tp classes; three all-reduces make the softmax's statistics."""
    local_NxV = (h_NxD @ w_VxD.t()).to_local().float()  # (N, V/tp); DTensor's matmul backward sums h's grad
    mesh, (v0, v1) = w_VxD.device_mesh, _rows(w_VxD)
    total = lambda x, op: DTensor.from_local(x, mesh, [Partial(op)], run_check=False).full_tensor()
    m_N = total(local_NxV.max(1).values.detach(), "max")  # (a constant shift: no gradient needed)
    lse_N = total(torch.exp(local_NxV - m_N[:, None]).sum(1), "sum").log() + m_N
    mine_N = (targets_N >= v0) & (targets_N < v1)
    picked_N = local_NxV.gather(1, (targets_N - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0] * mine_N
    target_logit_N = total(picked_N, "sum")
    keep_N = targets_N != ignore_index
    return ((lse_N - target_logit_N) * keep_N).sum() / keep_N.sum()


def _rows(w):
    """The global row range [v0, v1) of this rank's Shard(0) piece of w (even split: checked)."""
    rows = w.shape[0] // w.device_mesh.size()
    rank = w.device_mesh.get_local_rank()
    return rank * rows, (rank + 1) * rows



def top_plan(model):
    """The plan outside the blocks: the embedding split on the vocabulary, the final norm on the sequence,
    the head on the vocabulary."""
    return {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            **({} if model.lm_head is None else {"lm_head": ColwiseParallel()})}  # (only its weight is read)


def split_dims(model):
    """{parameter name: the dim tp splits it on}, read from the same plans parallelize applies (a name
    not there is replicated over tp): a column-wise Linear's output rows (dim 0), a row-wise one's input
    columns (dim 1), the embedding's vocabulary rows. The compiled step gives these to GSPMD as each
    weight's tp axis (tpu_pod/step_compile.py), which then splits the activations as the styles' hooks do here."""
    plans = [("", top_plan(model))] + [(f"layers.{i}.", block_plan(model.args.qk_norm)) for i in range(len(model.layers))]
    dims = {}
    for prefix, plan in plans:
        for path, style in plan.items():
            if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
                continue
            dim = 0 if isinstance(style, ColwiseParallel) else 1  # a Linear's weight is (out, in)
            if isinstance(model.get_submodule(prefix + path), torch.nn.Embedding):
                dim = 1 - dim  # an Embedding's is (vocabulary, dim): row-wise splits the vocabulary
            dims[f"{prefix}{path}.weight"] = dim
    return dims


def parallelize(model, tp_mesh):
    """Apply the plan in place; weights become DTensors on tp_mesh (each rank keeps its own block of the
    same whole weight, or of a meta one: src_data_rank=None, no communication). Returns the model."""
    parallelize_module(model, tp_mesh, top_plan(model), src_data_rank=None)
    model.norm.register_forward_hook(_gather_sequence)  # the loss sees the whole sequence
    assert model.args.loss_impl == "vocab_parallel", "build the model from tensor_parallel.config(args)"
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan(model.args.qk_norm), src_data_rank=None)
    return model
