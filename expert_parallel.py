"""expert_parallel.py: the experts of each MoE layer spread over `ep` ranks, tokens sent to them
(GShard, Lepikhin et al., arXiv 2006.16668; torchtitan's expert parallel; MaxText's ragged
all-to-all).

    --mesh ici=2,ep=2         # 2 ranks: each holds E/2 experts and its own batch rows
    --mesh dcn=2,ici=2,ep=2   # 4 ranks: ep groups {0,1}, {2,3}; each expert FSDP-sharded over 2

As in torchtitan, ep adds no ranks: it borrows data-parallel ones. Every rank routes its own tokens;
the rows for expert e go to the rank that owns e, run through the local experts' grouped matmul,
and come back to be combined with the router weights:

    rows sorted by expert (M, D) --all-to-all--> rows for my experts --gmm--> --all-to-all--> (M, D)

1. counts: group_sizes (E,) viewed (ep, E/ep): the rows I route to each peer, per peer expert; an
   all-to-all of them tells each rank how many rows every peer sends it, per local expert;
2. the rows travel: eagerly with variable splits (the counts, read on the host); when traced
   (graph mode, XLA) shapes must be static, so each peer gets a buffer of C slots, padded with zero
   rows. By default C = M, all the rows a rank routes: the worst case, nothing dropped (MaxText's
   dropless ragged all-to-all). A buffer factor f > 0 (ModelArgs.ep_buffer_factor, MaxText's
   ragged_buffer_factor) makes C = min(M, ceil(f M / ep)), f times a balanced peer's share: a
   rank's rows for one peer past its first C, in expert order, are dropped (no expert output, the
   token keeps its residual and its other experts; no gradient), eagerly too, so both forms drop
   the same rows; the counts exchanged in 1 are the kept ones;
3. arrivals are ordered by source rank, then expert: a stable sort by local expert makes them
   expert-major for the grouped matmul (padding rows last, in the last expert's group, where zero
   rows add nothing to its gradient), and the inverse permutation undoes it;
4. the all-to-all back is the transpose of the first (autograd runs it in reverse for the backward).

The experts' gradient on their owner sums the ep ranks' losses; the data-parallel mean counts each
rank once, so it is scaled by 1/ep (simplefsdp.py places expert weights as Shard(expert) over ep
and FSDP-shards them over the remaining data-parallel ranks). The step compiled for a TPU pod runs
this exchange as JAX ops (tpu_pod/expert_exchange.py), with the same C and the same rows dropped.
"""
import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._guards import detect_fake_mode

from model import MoE


def check(args, ep):
    if not args.n_experts:
        return f"ep={ep} needs MoE blocks (n_experts > 0; e.g. --flavor qwen3_moe_debug)"
    if args.n_experts % ep:
        return f"n_experts={args.n_experts} is not divisible by ep={ep}"
    if args.moe_groups > 1:  # (each rank routes its own tokens already: one group a rank)
        return f"ep={ep} routes each rank's tokens as one group: moe_groups must be 1, got {args.moe_groups}"
    return None


def check_buffer_factor(args, ep):
    """The buffer factor sizes ep's exchange: without one (ep = 1) it would do nothing, silently."""
    if args.ep_buffer_factor > 0 and ep == 1:
        return f"ep_buffer_factor={args.ep_buffer_factor} sizes ep's exchange: it needs ep > 1"
    return None


def slots_a_peer(rows, ep, factor):
    """C (2): the slots each peer's buffer has for a rank's `rows` routed rows (factor 0: all of them)."""
    return rows if factor <= 0 else min(rows, math.ceil(factor * rows / ep))


def _rows_all_to_all(x, output_splits, input_splits, group):
    """The rows' all-to-all: differentiable where they need a gradient; the plain collective where they
    do not, as inside a custom op's kernel (--scan's layer loop, layer_scan.py), where autograd is
    already below the dispatcher and the differentiable op has no kernel to run."""
    if x.requires_grad:
        return funcol.all_to_all_single_autograd(x, output_splits, input_splits, group)
    return funcol.all_to_all_single(x, output_splits, input_splits, group)


class AllToAll:
    """An MoE dispatch (model.MoE.route_through) that sends rows to the ranks owning their experts;
    the module's `experts` then holds (and runs) only this rank's E/ep experts."""

    def __init__(self, ep_mesh, buffer_factor=0.0):
        self.mesh, self.group, self.ep = ep_mesh, ep_mesh.get_group("ep"), ep_mesh.size(1)
        self.buffer_factor = buffer_factor
        self.rows_routed = self.rows_dropped = 0  # by eager training forwards, since dropped_share read them

    def __call__(self, experts, x_MxD, group_sizes_E):
        (M, _), ep, E = x_MxD.shape, self.ep, group_sizes_E.shape[0]
        C = slots_a_peer(M, ep, self.buffer_factor)
        sent_RxL = group_sizes_E.view(ep, E // ep)                          # 1. rows I route, per peer expert
        # 2. of those, the ones inside the peer's first C (a peer's rows are in expert order: the running
        # count capped at C, differenced)
        kept_RxL = torch.diff(torch.cumsum(sent_RxL, 1).clamp(max=C), dim=1, prepend=torch.zeros_like(sent_RxL[:, :1]))
        from_peer_RxL = funcol.all_to_all_single(kept_RxL.reshape(-1), None, None, self.group).view(ep, E // ep)
        # my sorted row m: its peer r (its expert // L), its place among my rows for r; kept if place < C
        sent_R = sent_RxL.sum(1)
        first_R = torch.cumsum(sent_R, 0) - sent_R
        peer_M = torch.repeat_interleave(torch.arange(ep, device=x_MxD.device), sent_R, output_size=M)
        place_M = torch.arange(M, device=x_MxD.device) - first_R[peer_M]
        if detect_fake_mode(x_MxD) is None:
            return self._ragged(experts, x_MxD, kept_RxL, from_peer_RxL, None if C == M else place_M < C)
        return self._padded(experts, x_MxD, first_R, kept_RxL, from_peer_RxL, peer_M * C + place_M, place_M < C, C)

    @staticmethod
    def _local(experts, x_NxD, expert_N, sizes_L):
        """Rows (any order) of local experts expert_N through them; same order out."""
        order = torch.argsort(expert_N, stable=True)
        y = experts(x_NxD[order], sizes_L)
        return torch.empty_like(y).index_copy(0, order, y)  # (the inverse permutation)

    def _ragged(self, experts, x_MxD, kept_RxL, from_peer_RxL, kept_M):
        """kept_M: which rows stay (None: all of them, no buffer factor: no gather, no scatter back)."""
        send, recv = kept_RxL.sum(1).tolist(), from_peer_RxL.sum(1).tolist()  # (host sync: eager)
        if self.buffer_factor > 0 and torch.is_grad_enabled():  # a training forward that may drop rows
            # (not an evaluation: no_grad); a replay counts its layer again, routed and dropped alike
            self.rows_routed += x_MxD.shape[0]
            self.rows_dropped += x_MxD.shape[0] - sum(send)
        rows_K = None if kept_M is None else kept_M.nonzero().squeeze(1)
        x_NxD = _rows_all_to_all(x_MxD if rows_K is None else x_MxD[rows_K], recv, send, self.group)
        L = from_peer_RxL.shape[1]
        expert_N = torch.arange(L, device=x_MxD.device).repeat(self.ep).repeat_interleave(from_peer_RxL.reshape(-1))
        y_NxD = self._local(experts, x_NxD, expert_N, from_peer_RxL.sum(0))
        y_KxD = _rows_all_to_all(y_NxD, send, recv, self.group)
        if rows_K is None:
            return y_KxD
        return y_KxD.new_zeros(x_MxD.shape[0], y_KxD.shape[1]).index_copy(0, rows_K, y_KxD)  # dropped rows: 0

    def _padded(self, experts, x_MxD, first_R, kept_RxL, from_peer_RxL, slot_M, kept_M, C):
        (M, D), (ep, L) = x_MxD.shape, kept_RxL.shape
        # 2. peer r's slot j holds my row first_r + j while j < its kept count, else the zero row (index M)
        j_C = torch.arange(C, device=x_MxD.device)
        row_RxC = torch.where(j_C < kept_RxL.sum(1, keepdim=True), first_R[:, None] + j_C, M)
        buf = torch.cat([x_MxD, x_MxD.new_zeros(1, D)])[row_RxC.reshape(-1)]
        x_NxD = _rows_all_to_all(buf, None, None, self.group)  # (ep * C, D), equal splits
        # 3. arrival from peer r, slot j: valid if j < its count; its local expert from the counts
        ends_RxL = torch.cumsum(from_peer_RxL, 1)
        expert_RxC = torch.searchsorted(ends_RxL, j_C.expand(ep, C).contiguous(), right=True)  # L: padding
        expert_N = expert_RxC.clamp(max=L - 1).reshape(-1)  # padding joins the last expert's group
        sizes_L = from_peer_RxL.sum(0)
        sizes_L = torch.cat([sizes_L[:-1], sizes_L[-1:] + (ep * C - from_peer_RxL.sum())])
        y_NxD = self._local(experts, x_NxD, expert_N, sizes_L)
        y = _rows_all_to_all(y_NxD, None, None, self.group)
        # 4. my row m from its slot (peer r's slot place_m); a dropped row from the zero row (index ep C)
        return torch.cat([y, y.new_zeros(1, y.shape[1])])[torch.where(kept_M, slot_M, ep * C)]


def dropped_share(moe_modules, device):
    """The share of the rows routed through these MoE modules' exchanges, summed over every rank, that
    a buffer factor dropped since the last call (eager forwards: the counts are read on the host there
    anyway); None without a factor, or where nothing was counted (a traced exchange's counts are tensors
    inside the step's graph). A collective wherever a factor is set: every rank must call it alike."""
    exchanges = [m.dispatch for m in moe_modules if isinstance(m.dispatch, AllToAll) and m.dispatch.buffer_factor > 0]
    if not exchanges:
        return None
    counts = torch.tensor([sum(x.rows_routed for x in exchanges), sum(x.rows_dropped for x in exchanges)],
                          dtype=torch.float64, device=device)
    for x in exchanges:
        x.rows_routed = x.rows_dropped = 0
    dist.all_reduce(counts)
    routed, dropped = counts.tolist()
    return dropped / routed if routed else None


def parallelize(model, ep_mesh):
    """Route every MoE block's rows through an all-to-all over ep (model.MoE's declared seam), its
    buffers sized by the block's ep_buffer_factor; simplefsdp.data_parallel then places the expert
    weights over `ep_mesh`."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.route_through(AllToAll(ep_mesh, module.args.ep_buffer_factor))
    return model
