"""expert_parallel.py: the experts of each MoE layer spread over `ep` ranks, tokens sent to them
(GShard, Lepikhin et al., arXiv 2006.16668; torchtitan's expert parallel; MaxText's ragged
all-to-all).

    --mesh ici=2,ep=2         # 2 ranks: each holds E/2 experts and its own batch rows
    --mesh dcn=2,ici=2,ep=2   # 4 ranks: ep groups {0,1}, {2,3}; each expert FSDP-sharded over 2

As in torchtitan, ep adds no ranks: it borrows data-parallel ones. Every rank routes its own tokens;
the rows for expert e go to the rank that owns e, run through the local experts' grouped matmul,
and come back to be combined with the router weights:

    rows sorted by expert (M, D) --all-to-all--> rows for my experts --gmm--> --all-to-all--> (M, D)

1. exchange counts: an all-to-all of group_sizes (E,) viewed (ep, E/ep) tells each rank how many
   rows every peer sends it, per local expert;
2. the rows travel: eagerly with variable splits (the counts, read on the host); when traced
   (graph mode, XLA) shapes must be static, so each destination gets a buffer of the worst case
   (all M rows), padded with zero rows, and nothing can be dropped (the step compiled for a TPU
   can bound the buffers, dropping the overflow: ModelArgs.ep_buffer_factor, expert_exchange.py;
   this trainer refuses it);
3. arrivals are ordered by source rank, then expert: a stable sort by local expert makes them
   expert-major for the grouped matmul (padding rows last, in the last expert's group, where zero
   rows add nothing to its gradient), and the inverse permutation undoes it;
4. the all-to-all back is the transpose of the first (autograd runs it in reverse for the backward).

The experts' gradient on their owner sums the ep ranks' losses; the data-parallel mean counts each
rank once, so it is scaled by 1/ep (simplefsdp.py places expert weights as Shard(expert) over ep
and FSDP-shards them over the remaining data-parallel ranks).
"""
import torch
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


class AllToAll:
    """An MoE dispatch (model.MoE.route_through) that sends rows to the ranks owning their experts;
    the module's `experts` then holds (and runs) only this rank's E/ep experts."""

    def __init__(self, ep_mesh):
        self.mesh, self.group, self.ep = ep_mesh, ep_mesh.get_group("ep"), ep_mesh.size(1)

    def __call__(self, experts, x_MxD, group_sizes_E):
        ep, E = self.ep, group_sizes_E.shape[0]
        to_peer_RxL = group_sizes_E.view(ep, E // ep)                       # rows I send, per peer expert
        from_peer_RxL = funcol.all_to_all_single(to_peer_RxL.reshape(-1), None, None, self.group).view(ep, E // ep)
        if detect_fake_mode(x_MxD) is None:
            return self._ragged(experts, x_MxD, to_peer_RxL, from_peer_RxL)
        return self._padded(experts, x_MxD, to_peer_RxL, from_peer_RxL)

    @staticmethod
    def _local(experts, x_NxD, expert_N, sizes_L):
        """Rows (any order) of local experts expert_N through them; same order out."""
        order = torch.argsort(expert_N, stable=True)
        y = experts(x_NxD[order], sizes_L)
        return torch.empty_like(y).index_copy(0, order, y)  # (the inverse permutation)

    def _ragged(self, experts, x_MxD, to_peer_RxL, from_peer_RxL):
        send, recv = to_peer_RxL.sum(1).tolist(), from_peer_RxL.sum(1).tolist()  # (host sync: eager)
        x_NxD = funcol.all_to_all_single_autograd(x_MxD, recv, send, self.group)
        L = from_peer_RxL.shape[1]
        expert_N = torch.arange(L, device=x_MxD.device).repeat(self.ep).repeat_interleave(from_peer_RxL.reshape(-1))
        y_NxD = self._local(experts, x_NxD, expert_N, from_peer_RxL.sum(0))
        return funcol.all_to_all_single_autograd(y_NxD, send, recv, self.group)

    def _padded(self, experts, x_MxD, to_peer_RxL, from_peer_RxL):
        M, (ep, L) = x_MxD.shape[0], to_peer_RxL.shape
        # my sorted row m goes to peer r = its expert // L, slot m - (rows before r's first)
        send_R = to_peer_RxL.sum(1)
        first_R = torch.cumsum(send_R, 0) - send_R
        peer_M = torch.repeat_interleave(torch.arange(ep, device=x_MxD.device), send_R, output_size=M)
        slot_M = peer_M * M + torch.arange(M, device=x_MxD.device) - first_R[peer_M]
        buf = x_MxD.new_zeros(ep * M, x_MxD.shape[1]).index_copy(0, slot_M, x_MxD)
        x_NxD = funcol.all_to_all_single_autograd(buf, None, None, self.group)  # (ep * M, D), equal splits
        # arrival from peer r, slot j: valid if j < its count; its local expert from the counts
        j_RxM = torch.arange(M, device=x_MxD.device).expand(ep, M)
        ends_RxL = torch.cumsum(from_peer_RxL, 1)
        expert_RxM = torch.searchsorted(ends_RxL, j_RxM, right=True)  # L for padding (j >= count)
        expert_N = expert_RxM.clamp(max=L - 1).reshape(-1)  # padding joins the last expert's group
        sizes_L = from_peer_RxL.sum(0)
        sizes_L = torch.cat([sizes_L[:-1], sizes_L[-1:] + (ep * M - from_peer_RxL.sum())])
        y_NxD = self._local(experts, x_NxD, expert_N, sizes_L)
        y = funcol.all_to_all_single_autograd(y_NxD, None, None, self.group)
        return y[slot_M]


def parallelize(model, ep_mesh):
    """Route every MoE block's rows through an all-to-all over ep (model.MoE's declared seam);
    simplefsdp.data_parallel then places the expert weights over `ep_mesh`."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.route_through(AllToAll(ep_mesh))
    return model
