"""context_parallel.py: a sequence split over `cp` processes (context parallelism), and the masks a
process needs to attend from its part of a sequence.

    torchrun --nproc-per-node 4 train.py --mesh ici=2,cp=2 --seq-len 4096   # each rank: 1/2 of every sequence

Each of the C ranks of a cp group holds 1/C of every sequence of its rows; the MLPs, norms and the loss
run on those tokens alone, so a rank's activations are ~1/C of a whole sequence's. Attention needs
every earlier key, so before each layer's attention the group all-gathers the keys and values
(torchprime's and MaxText's all-gather variant; backward: the reduce-scatter of their gradients) and a
rank's queries attend over the whole sequence under a mask built from global positions.

Load balancing (torchtitan's head-tail split): with causal attention the last tokens see the most
keys, so contiguous chunks would leave rank C-1 with most of the work. The sequence is cut into 2C
chunks and rank r holds chunks r and 2C-1-r: every rank holds one early and one late chunk, and the
same number of (query, key) pairs under the causal mask.

What stays right per chunk: RoPE takes the tokens' global positions (the view's `positions`),
the causal, sliding-window and packed-document masks compare global positions and document ids
(document ids need the whole sequence's separators: the tokens are all-gathered once per forward, an
int per token). The gathered keys stay in the gather's order (rank by rank): attention does not care
in which order keys arrive, only which it may see, and the mask is built for that order. Under the
splash kernel (--kernels pallas) a rank builds no mask: the keys go back to sequence order and the
kernel runs once per chunk at the chunk's query offset (ChunkedKernelView).

Parameters: the cp ranks are data-parallel ranks for the weights (they read the same rows but hold
different tokens): FSDP shards over dp x cp and averages their gradients, as torchtitan's
`dp_shard_cp` does. Each rank's loss is the mean over its tokens, all ranks hold as many, so the mean
of the ranks' losses is the whole batch's and the averaged gradient is one process's.

The model meets this through one seam (model.Transformer.split_sequence): every forward asks its
`sequence` for a view (this process's positions, and each layer's attention over the keys it may
see); WholeSequence, the default, is one process with every position. A KV cache is the same seam
(generate.py).
"""
import warnings

import torch
import torch.distributed._functional_collectives as funcol

# all_gather_tensor_autograd's own backward (the reduce-scatter) carries the keys' gradients; the
# wait_tensor after the gather has no autograd kernel and passes them through, which PyTorch warns
# about once a rank. cp's losses, gradient norms and weights equal one process's
# (tests/check_context_parallel.py), so the warning says nothing about these runs.
warnings.filterwarnings("ignore", message="wait_tensor: an autograd kernel was not registered")


def position_mask(q_pos_S, k_pos_T, window=None, q_seg_BxS=None, k_seg_BxT=None):
    """Boolean (S, T) or (B, S, T) mask, True = may attend, from the queries' and keys' global
    positions (in any order): causal, a sliding window (a query sees itself and the window-1 keys
    before it), packed documents (same segment id)."""
    q, k = q_pos_S[:, None], k_pos_T[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    if q_seg_BxS is not None:
        mask = mask & (q_seg_BxS[:, :, None] == k_seg_BxT[:, None, :])
    return mask


def document_ids(tokens_BxS, doc_sep):
    """Packed documents' segment ids: the number of `doc_sep` tokens before each position (a separator
    belongs to the document it ends), as torchtitan's block-causal mask counts its EOS tokens."""
    ends = (tokens_BxS == doc_sep).to(torch.int32)
    return ends.cumsum(1) - ends


def masked_attention(q_BxHxSxD, k_BxKxTxD, v_BxKxTxD, mask_SxT):
    """Attention under an explicit mask (boolean, or additive 0 / -inf), the S x T scores materialized:
    GQA by repeating the kv heads."""
    groups = q_BxHxSxD.shape[1] // k_BxKxTxD.shape[1]
    k = k_BxKxTxD.repeat_interleave(groups, dim=1)
    v = v_BxKxTxD.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q_BxHxSxD, k, v, attn_mask=mask_SxT)


class CausalView:
    """Whole causal sequences: positions 0..S-1, and each layer the model's own attention (None: the
    attention implementation its config names)."""

    def __init__(self, positions):
        self.positions = positions

    @staticmethod
    def layer(i):
        return None


class SequenceView:
    """How one process's tokens see a sequence in one forward, the model's one seam for it (a KV cache
    is another, generate.py): `positions` (S,), their places in the whole sequence (RoPE's); `layer(i)`,
    layer i's attention, attend(q, k, v) -> out: over the keys `gather` brings from the other
    processes (None: this process has them all; `key_positions` (T,) are where those keys sit), under
    the mask of which each query may see."""

    def __init__(self, positions, key_positions, window=None, q_seg=None, k_seg=None, gather=None):
        self.positions, self.gather = positions, gather
        mask = position_mask(positions, key_positions, window, q_seg, k_seg)
        self.mask = mask[:, None] if mask.dim() == 3 else mask  # (broadcast over heads)
        self.additive = {}

    def layer(self, i):
        return self.attend

    def attend(self, q_BxHxSxD, k_BxKxSxD, v_BxKxSxD):
        """The mask as 0 / -inf in the keys' dtype, made once for all the layers (SDPA turns a boolean
        mask into that per call, and saves each copy for backward)."""
        dtype = k_BxKxSxD.dtype
        if dtype not in self.additive:
            self.additive[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill(
                ~self.mask, float("-inf"))
        if self.gather is not None:
            k_BxKxSxD, v_BxKxSxD = self.gather(k_BxKxSxD), self.gather(v_BxKxSxD)
        return masked_attention(q_BxHxSxD, k_BxKxSxD, v_BxKxSxD, self.additive[dtype])


class WholeSequence:
    """The default sequence: this process holds every position of its rows."""

    @staticmethod
    def view(tokens_BxS, args):
        """Plain causal attention (the attention implementation's own path), or the window / packed
        documents as a mask over the whole sequence (the reference attention)."""
        pos = torch.arange(tokens_BxS.shape[1], device=tokens_BxS.device)
        if args.sliding_window is None and args.doc_sep is None:
            return CausalView(pos)
        seg = None if args.doc_sep is None else document_ids(tokens_BxS, args.doc_sep)
        return SequenceView(pos, pos, args.sliding_window, seg, seg)


def head_tail_positions(seq_len, size, rank, device=None):
    """The global positions rank `rank` of `size` holds: chunks rank and 2*size-1-rank of 2*size."""
    n = seq_len // (2 * size)
    head, tail = rank * n, (2 * size - 1 - rank) * n
    return torch.cat([torch.arange(head, head + n, device=device), torch.arange(tail, tail + n, device=device)])


class ContextParallel:
    """A sequence split over the `size` ranks of process group `group` (this process: `rank` in it)."""

    def __init__(self, size, rank, group):
        self.size, self.rank, self.group = size, rank, group

    def split(self, x_BxS):
        """This rank's head and tail chunks of whole sequences (inputs, targets: shifted before the split)."""
        return x_BxS[:, head_tail_positions(x_BxS.shape[1], self.size, self.rank, x_BxS.device)]

    def gather(self, x, dim):
        """Every rank's x, concatenated along `dim` in rank order (backward: the reduce-scatter)."""
        return funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=dim, group=self.group)

    def view(self, tokens_BxS, args):
        """The SequenceView of this rank's tokens (B, S/C): its global positions; the keys of the whole
        sequence, gathered in rank order, and the mask of which each query may see. Under the splash
        kernel (attn_impl "splash"): a ChunkedKernelView, which builds no mask."""
        seq_len, device = tokens_BxS.shape[1] * self.size, tokens_BxS.device
        pos = head_tail_positions(seq_len, self.size, self.rank, device)
        key_pos = torch.cat([head_tail_positions(seq_len, self.size, r, device) for r in range(self.size)])
        ids = None
        if args.doc_sep is not None:  # document ids count the separators of the whole sequence before a token
            gathered = funcol.all_gather_tensor(tokens_BxS, gather_dim=1, group=self.group)
            whole = torch.empty_like(gathered).index_copy_(1, key_pos, gathered)  # (back in sequence order)
            ids = document_ids(whole, args.doc_sep)
        if args.attn_impl == "splash":
            return ChunkedKernelView(self, pos, key_pos, args.sliding_window, ids)
        q_seg, k_seg = (None, None) if ids is None else (ids[:, pos], ids[:, key_pos])
        return SequenceView(pos, key_pos, args.sliding_window, q_seg, k_seg, gather=lambda x: self.gather(x, 2))


class ChunkedKernelView(SequenceView):
    """A cp rank's attention through the splash kernel (kernels_splash.splash_chunk_attention): the
    gathered keys and values put back in sequence order, then one kernel call per chunk of this rank's
    queries (head, tail), each over the keys from position 0 to the chunk's end at its own query offset,
    with the chunk's and the keys' document ids; the two outputs concatenated (each call sees every key
    its queries may see: no log-sum-exp merge). No (S/C) x S mask is built; each rank visits 2C + 1
    chunks' worth of key blocks."""

    def __init__(self, cp, positions, key_positions, window, ids):  # (no mask: SequenceView's is not built)
        self.cp, self.positions, self.window, self.ids = cp, positions, window, ids  # (positions: RoPE's)
        self.order = torch.argsort(key_positions)  # gathered (rank order) -> sequence order

    def attend(self, q_BxHxSxD, k_BxKxSxD, v_BxKxSxD):
        from kernels_splash import splash_chunk_attention
        keys, values = (self.cp.gather(t, 2)[:, :, self.order] for t in (k_BxKxSxD, v_BxKxSxD))
        n, size, rank = q_BxHxSxD.shape[2] // 2, self.cp.size, self.cp.rank
        out = []
        for chunk, start in ((0, rank * n), (1, (2 * size - 1 - rank) * n)):  # (head_tail_positions' chunks)
            end = start + n
            seg = (None, None) if self.ids is None else (self.ids[:, start:end], self.ids[:, :end])
            out.append(splash_chunk_attention(q_BxHxSxD[:, :, chunk * n:(chunk + 1) * n], keys[:, :, :end],
                                              values[:, :, :end], start, self.window, *seg))
        return torch.cat(out, dim=2)


class HeadTailOrder:
    """XLA SPMD (spmd.py): one process holds whole sequences, each put in head-tail order (rank 0's
    two chunks, then rank 1's, ...), its sequence dim partitioned over `cp`: each device's contiguous
    block is its head and tail chunk. The model computes on the reordered sequence with these global
    positions; GSPMD gathers the keys and values the attention needs (no collective written here)."""

    def __init__(self, size):
        self.size = size

    def order(self, seq_len, device=None):
        return torch.cat([head_tail_positions(seq_len, self.size, r, device) for r in range(self.size)])

    def split(self, x_BxS):
        """Whole sequences in head-tail order (inputs and targets alike: the loss's mean is unchanged)."""
        return x_BxS[:, self.order(x_BxS.shape[1], x_BxS.device)]

    def view(self, tokens_BxS, args):
        pos = self.order(tokens_BxS.shape[1], tokens_BxS.device)
        seg = None
        if args.doc_sep is not None:  # (document ids count separators in sequence order)
            whole = torch.empty_like(tokens_BxS).index_copy_(1, pos, tokens_BxS)
            seg = document_ids(whole, args.doc_sep)[:, pos]
        return SequenceView(pos, pos, args.sliding_window, seg, seg)
