"""fsdp_passes.py: the compiler half of SimpleFSDP (Zhang et al., arXiv 2411.00284; torchtitan's
SimpleFSDP with its graph passes): passes on the whole-step graph, where each of SimpleFSDP's
all-gathers and reduce-scatters is a node (simplefsdp.py makes them plain DTensor ops).

  reshard   reshard after forward: a gathered weight is not kept from its forward use to its
            backward use; the backward gathers it again right before (FSDP's memory: the full
            weights of one block at a time, not of the whole model). This is
            graph_passes.recompute_in_backward with the all-gather chains as what to recompute.
  bucket    one all-gather per transformer block (and one for the embedding, one for the final
            norm + output head) on a flat buffer, split back into the parameters; the same for
            the backward's reduce-scatters (with gradient accumulation, first a parameter's reduce-scatters
            of every microbatch become one of their sum: `reduce_once`). The merging is torch's own (torch/_inductor/fx_passes/
            bucketing.py, in our pinned torch 2.9); choosing the buckets, by block, is ours, and so
            is the merge of HSDP's gradient all-reduces over dcn (torch has none for all-reduce).
  prefetch  each all-gather is issued one bucket early, before the wait of the previous one: the
            next block's weights travel while this block computes (functional collectives are
            asynchronous until their wait_tensor; gloo runs them on its own threads). Every rank
            runs the same graph, so every rank issues the collectives in the same new order.

All keep the numerics exactly: the same values are gathered and reduced. A --scan stack's
collectives are not graph nodes: they run per layer inside the scan op (simplefsdp.LayerGather).
"""
import operator

import torch

import graph_passes

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
PASSES = ("reshard", "bucket", "prefetch")


def chosen(spec, default=PASSES):
    """--fsdp-passes: 'auto' (`default`: the layout's choice, all of them under a SimpleFSDP mesh),
    'none', or a comma list."""
    if spec == "auto":
        return tuple(default)
    names = () if spec == "none" else tuple(spec.split(","))
    if set(names) - set(PASSES):
        raise ValueError(f"--fsdp-passes {spec!r}: unknown {sorted(set(names) - set(PASSES))}; choose from "
                         f"{', '.join(PASSES)}, none, auto")
    return names


def _is(node, op):
    return node.op == "call_function" and node.target == op.default


def gather_chains(gm):
    """Forward nodes that are an all-gather or only reshape / cast / wait on one: the full weights."""
    end = graph_passes.forward_end_index(gm)
    chain = set()
    for i, node in enumerate(gm.graph.nodes):
        if i >= end or node.op != "call_function":
            continue
        if _is(node, c10d.all_gather_into_tensor):
            chain.add(node)
        elif (node.target not in graph_passes._MATMULS and node.target not in graph_passes._ATTENTION
              and graph_passes._namespace(node) != "minititan" and node.all_input_nodes
              and any(n in chain for n in node.all_input_nodes)
              and all(n in chain or n.op == "placeholder" for n in node.all_input_nodes)):
            chain.add(node)
    return chain


def reshard_after_forward(gm, also=None):
    """Gathered weights are re-gathered in the backward instead of saved (`also`: another
    recompute policy applied in the same sweep, e.g. remat's)."""
    chain = gather_chains(gm)
    return graph_passes.recompute_in_backward(gm, lambda n: n in chain or (also is not None and also(n)))


# ------------------------------------------------------------------------------------------------
# bucketing

def param_buckets(named_parameters, blocks):
    """The bucket of each parameter, in order: the block (of the Task's `blocks`, the model's
    repeated modules: a transformer's layers, FLUX's double and single blocks) holding it, else the
    embedding or the head."""
    owner = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
    return [f"block {owner[id(p)]}" if id(p) in owner else "embedding" if "embed" in name else "head"
            for name, p in named_parameters]


def _param_index(gm):
    """placeholder node -> index of the parameter it is (the step's first flat inputs are params)."""
    return {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}


def _source_param(node, index, n_params):
    """The parameter an all-gather gathers (through casts of its shard), or None."""
    while node.op != "placeholder":
        if len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    i = index.get(node)
    return i if i is not None and i < n_params else None


def _grad_param(wait, n_params):
    """The parameter whose gradient a reduce-scatter's wait carries: its position in the list of
    gradients that the first foreach op (the gradient norm) takes, after single-input steps."""
    node = wait
    for _ in range(8):
        for user in node.users:
            if user.op == "call_function" and "_foreach" in str(user.target):
                grads = user.args[0]
                return grads.index(node) if node in grads and len(grads) == n_params else None
        if len(node.users) != 1:
            return None
        node = next(iter(node.users))
    return None


def _buckets(nodes_and_params, bucket_of):
    """Group collectives by the block of their parameter, keeping graph order within each side (and
    by process group and dtype: an expert-parallel block's expert weights gather over another group)."""
    groups = {}
    for node, i in nodes_and_params:
        if i is not None:
            how = tuple(a for a in node.args[1:] if isinstance(a, (str, int)))
            dtype = node.meta["val"].dtype if "val" in node.meta else None
            groups.setdefault((bucket_of[i], how, dtype), []).append(node)
    return [g for g in groups.values() if len(g) > 1]


def _hoist_inputs(gm, bucket):
    """Move what each collective of `bucket` reads (casts and pads of its shard, computed from graph
    inputs only) before the bucket's first collective, where the merged one will stand."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(bucket, key=order.get)
    todo = set()
    for node in bucket:
        stack = list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n.op == "call_function" and order[n] > order[first] and n not in todo:
                todo.add(n)
                stack.extend(n.all_input_nodes)
    for n in sorted(todo, key=order.get):  # topological: inputs move first
        first.prepend(n)


def _after_last(gm, bucket):
    """torch's merge puts the merged reduce-scatter right after the bucket's last one (the last
    gradient is ready only there) and hands its results to every wait's readers: so move what reads
    the earlier waits, in order, to just after the last reduce-scatter."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = max(bucket, key=order.get)
    moving, stack = set(), [u for n in bucket if n is not last for w in n.users for u in w.users]
    while stack:
        n = stack.pop()
        if order[n] < order[last] and n not in moving:
            moving.add(n)
            stack.extend(n.users)
    anchor = last
    for n in sorted(moving, key=order.get):
        anchor.append(n)
        anchor = n


def bucket_by_block(gm, bucket_of):
    """Merge each block's all-gathers (forward, and backward after reshard) and reduce-scatters;
    `bucket_of`: param_buckets(), one name per parameter in the step's order."""
    from torch._inductor.fx_passes.bucketing import merge_all_gather, merge_reduce_scatter
    end = graph_passes.forward_end_index(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    index, P = _param_index(gm), len(bucket_of)
    gathers = [n for n in gm.graph.nodes if _is(n, c10d.all_gather_into_tensor)]
    for side in (lambda n: order[n] < end, lambda n: order[n] > end):  # never merge across the boundary
        buckets = _buckets([(g, _source_param(g, index, P)) for g in gathers if side(g)], bucket_of)
        for bucket in buckets:
            _hoist_inputs(gm, bucket)
        if buckets:
            merge_all_gather(gm, buckets)
    # HSDP: DTensor reduces each full gradient over dcn (all-reduce), then scatters it over ici.
    reduces = [n for n in gm.graph.nodes if _is(n, c10d.all_reduce)]
    for bucket in _buckets([(r, _grad_param(_wait_of(r), P) if _wait_of(r) else None) for r in reduces], bucket_of):
        _merge_all_reduce(gm, bucket)
    reduce_once(gm, P)
    scatters = [n for n in gm.graph.nodes if _is(n, c10d.reduce_scatter_tensor)]
    waits = {s: next((u for u in s.users if _is(u, c10d.wait_tensor)), None) for s in scatters}
    buckets = _buckets([(s, _grad_param(waits[s], P) if waits[s] else None) for s in scatters], bucket_of)
    for bucket in buckets:
        _after_last(gm, bucket)
    if buckets:
        merge_reduce_scatter(gm, buckets)
    _functional_gathers(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def reduce_once(gm, n_params):
    """Gradient accumulation (step.py, the loop unrolled in the step): a parameter's N reduce-scatters,
    one a microbatch, whose results the step sums, become one reduce-scatter of their summed inputs at
    the last one's place (reduce-scatter is linear: the same sum, rounded once more or less). The cost:
    the unsharded gradient sum lives from the first microbatch's backward to the last, a rank holding
    its whole, as FSDP2's set_requires_gradient_sync(False); the earlier results become zeros."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_param = {}
    for s in (n for n in gm.graph.nodes if _is(n, c10d.reduce_scatter_tensor)):
        wait = _wait_of(s)
        i = _grad_param(wait, n_params) if wait is not None else None
        if i is not None:
            by_param.setdefault(i, []).append(s)
    g = gm.graph
    for group in (sorted(s, key=order.get) for s in by_param.values() if len(s) > 1):
        last = group[-1]
        with g.inserting_before(last):
            total = group[0].args[0]
            for s in group[1:]:
                total = g.call_function(aten.add.Tensor, (total, s.args[0]))
                total.meta = dict(s.args[0].meta)
        last.args = (total, *last.args[1:])
        for s in group[:-1]:
            wait, val = _wait_of(s), _wait_of(s).meta["val"]
            with g.inserting_before(s):
                zeros = g.call_function(aten.zeros.default, (list(val.shape),),
                                        {"dtype": val.dtype, "device": val.device})
            zeros.meta = dict(wait.meta)
            wait.replace_all_uses_with(zeros)
            g.erase_node(wait)
            g.erase_node(s)


def _merge_all_reduce(gm, bucket):
    """One all-reduce of the bucket's flattened gradients (same op, same group), split back."""
    if len({(n.args[1], n.args[2]) for n in bucket}) != 1:
        return
    _after_last(gm, bucket)  # readers of the earlier results wait for the merged one
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last, g = max(bucket, key=order.get), gm.graph
    waits, ins = [_wait_of(n) for n in bucket], [n.args[0] for n in bucket]
    shapes = [list(n.meta["val"].shape) for n in bucket]
    with g.inserting_before(last.next):
        flat = g.call_function(aten.cat.default, ([g.call_function(aten.reshape.default, (x, [-1])) for x in ins],))
        done = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (flat, *bucket[0].args[1:])),))
        parts = g.call_function(aten.split_with_sizes.default, (done, [int(torch.Size(s).numel()) for s in shapes]))
        for i, (wait, shape) in enumerate(zip(waits, shapes)):
            piece = g.call_function(aten.view.default, (g.call_function(operator.getitem, (parts, i)), shape))
            piece.meta = dict(wait.meta)  # (later passes read shapes and dtypes from node.meta["val"])
            wait.replace_all_uses_with(piece)
    for wait, node in zip(waits, bucket):
        g.erase_node(wait)
        g.erase_node(node)


def _functional_gathers(gm):
    """torch's merge writes into a fresh buffer (all_gather_into_tensor_out, an aliasing op that
    torch.compile's functionalization refuses): use the functional all-gather, same values."""
    for node in list(gm.graph.nodes):
        if _is(node, c10d.all_gather_into_tensor_out):
            buffer = node.kwargs["out"]
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(c10d.all_gather_into_tensor.default, node.args)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            if not buffer.users:
                gm.graph.erase_node(buffer)


def _is_wait(node):  # (torch's merge emits the legacy c10d_functional namespace's wait)
    return _is(node, c10d.wait_tensor) or _is(node, torch.ops.c10d_functional.wait_tensor)


def _wait_of(node):
    return next((u for u in node.users if _is_wait(u)), None)


def _writers_through_views(node, order, lo, hi):
    """In-place ops placed in (lo, hi) that write into `node` or a view of it (split, getitem, ...)."""
    found, stack, seen = [], list(node.users), set()
    while stack:
        u = stack.pop()
        if u in seen or not (lo < order[u] < hi):
            continue
        seen.add(u)
        if getattr(getattr(u.target, "_schema", None), "is_mutable", False):
            found.append(u)
        elif u.op == "call_function":
            stack.extend(u.users)
    return found


def prefetch(gm):
    """Move every all-gather (with the casts and concatenation that feed it, which read only graph
    inputs) to just before the previous all-gather's wait, in the forward and in the backward."""
    end = graph_passes.forward_end_index(gm)
    for backward in (False, True):
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        gathers = [n for n in gm.graph.nodes if _is(n, c10d.all_gather_into_tensor) and (order[n] > end) == backward]
        for prev, nxt in zip(gathers, gathers[1:]):
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            anchor = _wait_of(prev)
            if anchor is None or order[nxt] < order[anchor]:
                continue
            feed, stack = {nxt}, list(nxt.all_input_nodes)
            while stack:  # what nxt needs that comes after the anchor: must be computed from inputs only
                n = stack.pop()
                if n.op == "call_function" and order[anchor] < order[n] < order[nxt] and n not in feed:
                    feed.add(n)
                    stack.extend(n.all_input_nodes)
                    # torch's merge fills the flat buffer in place (_foreach_copy_ into views of
                    # it): a writer is a dependency no edge shows, so it moves too, with its inputs
                    stack.extend(_writers_through_views(n, order, order[anchor], order[nxt]))
            if any(graph_passes._namespace(n) in ("_c10d_functional", "c10d_functional") and n is not nxt for n in feed):
                continue  # (it would depend on another collective: leave it where it is)
            if any(anchor in n.all_input_nodes for n in feed):
                continue  # (an activation's gather under tensor parallelism: it needs this very wait)
            for n in sorted(feed, key=order.get):
                anchor.prepend(n)
    gm.graph.lint()
    gm.recompile()
    return gm


def prefetched(gm):
    """How many forward all-gathers are issued before the previous one's wait (the overlap prefetch
    makes: block k+1's weights in flight while block k computes)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    end = graph_passes.forward_end_index(gm)
    gathers = [n for n in gm.graph.nodes if _is(n, c10d.all_gather_into_tensor) and order[n] < end]
    return sum(1 for prev, nxt in zip(gathers, gathers[1:]) if _wait_of(prev) and order[nxt] < order[_wait_of(prev)])


def reduce_scatter_bytes(gm):
    """Bytes the step's reduce-scatters take in (a rank's unsharded gradients, each reduced once)."""
    return sum(graph_passes.tensor_bytes(n.args[0]) for n in gm.graph.nodes if _is(n, c10d.reduce_scatter_tensor))


def collective_counts(gm):
    """{'forward': {kind: n}, 'backward': {kind: n}} of the collectives, split at the marker."""
    end = graph_passes.forward_end_index(gm)
    out = {"forward": {}, "backward": {}}
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "call_function" and graph_passes._namespace(node) == "_c10d_functional":
            side = out["forward" if i < end else "backward"]
            kind = node.target.__name__.split(".")[0]
            side[kind] = side.get(kind, 0) + 1
    return out
