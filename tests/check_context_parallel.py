# context_parallel.py (+ model.py's sequence seam, mesh.py's cp dim). Oracles: one process on the same
# global batch (losses, pre-clip gradient norms, validation, final weights), the attention formula
# written out query by query (window, documents), each document run alone (packed documents), the
# head-tail chunks counted out.
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import math

import pytest
import torch

import context_parallel as cp_lib
from model import Attention, Transformer

from tests.common import DIST_TINY, _main, assert_close, _ranks_equal_one_process, background, ran_on, shared_run, tiny_args

PACKED_WINDOW = ["--set", "doc_sep=10", "--set", "sliding_window=8"]  # (10: '\n', every line a document)


def test_head_tail_chunks_cover_the_sequence_once_and_balance_causal_work():
    """Rank r holds chunks r and 2C-1-r of 2C: together the ranks hold every position once, and each
    rank's queries see as many keys under the causal mask (contiguous chunks would give rank C-1 ~2C-1
    times rank 0's work)."""
    for size, seq in ((2, 32), (4, 32), (4, 64)):
        held = [cp_lib.head_tail_positions(seq, size, r) for r in range(size)]
        assert sorted(torch.cat(held).tolist()) == list(range(seq))
        work = {int((p + 1).sum()) for p in held}  # (query at position p sees p + 1 keys)
        assert len(work) == 1, (size, seq, work)
        n = seq // (2 * size)
        assert held[0][:n].tolist() == list(range(n)) and held[0][n:].tolist() == list(range(seq - n, seq))


def _attention_by_hand(q, k, v, window, seg):
    """Softmax attention one query at a time over the keys it may see (causal, window, its document)."""
    B, H, S, D = q.shape
    k, v = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
    out = torch.zeros_like(q)
    for b in range(B):
        for i in range(S):
            keys = [j for j in range(i + 1) if (window is None or i - j < window) and (seg is None or seg[b, j] == seg[b, i])]
            scores_HxN = (k[b, :, keys] @ q[b, :, i, :, None]).squeeze(-1) / math.sqrt(D)
            out[b, :, i] = (torch.softmax(scores_HxN, -1)[:, None] @ v[b, :, keys]).squeeze(1)
    return out


def test_a_sequence_view_attends_as_the_formula_under_a_window_and_documents():
    """The mask WholeSequence builds from positions and separators, against the formula written out:
    a query sees itself and the window-1 keys before it, in its own document (a separator ends one)."""
    torch.manual_seed(0)
    tokens = torch.tensor([[1, 2, 0, 3, 4, 5, 6, 0, 7, 8, 9, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]])
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2], [0] + [1] * 11])
    for window, doc_sep in ((4, None), (None, 0), (5, 0)):
        args = tiny_args(sliding_window=window, doc_sep=doc_sep)
        view = cp_lib.WholeSequence.view(tokens, args)
        q, k, v = torch.randn(2, 4, 12, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
        got = view.layer(0)(q, k, v)
        want = _attention_by_hand(q, k, v, window, seg if doc_sep is not None else None)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cp_lib.WholeSequence.view(tokens, tiny_args()).layer(0) is None  # (plain causal: the implementation's path)


def test_a_cp_ranks_splash_kernel_attends_as_the_formula_over_its_chunks(monkeypatch):
    """The splash kernel under cp (--kernels pallas: ContextParallel.view gives a ChunkedKernelView, no
    mask): each rank of cp=2 attends from its head and tail chunks, one kernel call each at its query
    offset, over the keys gathered in rank order; its output equals the whole sequence's attention
    written out query by query at the rank's positions, under a window and packed documents; its
    gradients equal those of the reference path (the mask over the same gathered keys). The gather is
    played by indexing the whole sequence's keys in rank order (one process, no group)."""
    torch.manual_seed(0)
    B, H, Hkv, S, D, C, window = 2, 4, 2, 32, 16, 2, 6
    tokens = torch.randint(1, 6, (B, S))
    tokens[0, [5, 20]] = tokens[1, 11] = 0  # (document ends)
    q, k, v = (torch.randn(B, n, S, D, requires_grad=True) for n in (H, Hkv, Hkv))
    want = _attention_by_hand(q, k, v, window, cp_lib.document_ids(tokens, 0))
    in_rank_order = torch.cat([cp_lib.head_tail_positions(S, C, r) for r in range(C)])
    monkeypatch.setattr(cp_lib.funcol, "all_gather_tensor", lambda t, gather_dim, group: tokens[:, in_rank_order])
    for rank in range(C):
        pos = cp_lib.head_tail_positions(S, C, rank)
        mine = {id(t): t[:, :, pos] for t in (q, k, v)}
        whole = {id(mine[id(t)]): t[:, :, in_rank_order] for t in (k, v)}
        cp = cp_lib.ContextParallel(C, rank, None)
        monkeypatch.setattr(cp, "gather", lambda x, dim: whole[id(x)])
        outs = {}
        for impl in ("splash", "sdpa"):
            view = cp.view(tokens[:, pos], tiny_args(attn_impl=impl, sliding_window=window, doc_sep=0))
            if impl == "splash":
                assert isinstance(view, cp_lib.ChunkedKernelView)
                outs[impl] = view.attend(mine[id(q)], mine[id(k)], mine[id(v)])
            else:
                outs[impl] = view.layer(0)(mine[id(q)], mine[id(k)], mine[id(v)])
        assert_close(outs["splash"], want[:, :, pos].detach(), f"rank {rank} output", atol=2e-6, rtol=0)
        cot = torch.randn_like(outs["sdpa"])
        got = torch.autograd.grad((outs["splash"] * cot).sum(), (q, k, v), retain_graph=True)
        ref = torch.autograd.grad((outs["sdpa"] * cot).sum(), (q, k, v), retain_graph=True)
        for name, a, b in zip("qkv", got, ref):
            assert_close(a, b, f"rank {rank} d{name}", atol=2e-6, rtol=0)


def test_packed_documents_score_as_each_document_run_alone():
    """doc_sep: a packed row's logits over each document equal that document run alone (RoPE is
    relative, so a document's place in the row changes nothing but float rounding)."""
    torch.manual_seed(0)
    model = Transformer(tiny_args(doc_sep=0))
    row = torch.tensor([[5, 6, 7, 0, 9, 10, 11, 12, 13, 0, 14, 15, 16]])
    packed = model(row)
    for start, stop in ((0, 4), (4, 10), (10, 13)):
        alone = model(row[:, start:stop])
        torch.testing.assert_close(packed[:, start:stop], alone, atol=2e-5, rtol=1e-5)
    plain = Transformer(tiny_args())  # (the old model: attention crosses documents, so the check can fail)
    plain.load_state_dict(model.state_dict())
    assert (plain(row)[:, 4:10] - plain(row[:, 4:10])).abs().max() > 1e-3


CP_RUNS = [(2, "ici=1,cp=2", "simple", ["--mode", "graph"]), (4, "ici=1,cp=4", "simple", PACKED_WINDOW),
           (4, "ici=2,cp=2", "fsdp2", PACKED_WINDOW),
           (2, "ici=1,cp=2", "simple", ["--mode", "graph", "--kernels", "pallas", *PACKED_WINDOW])]


@pytest.mark.parametrize("nproc,mesh,impl,extra", CP_RUNS)
def test_context_parallel_ranks_equal_one_process(nproc, mesh, impl, extra, corpus, tmp_path_factory):
    """cp ranks (each holding 1/cp of every sequence, head and tail chunks), beside SimpleFSDP / FSDP2
    on the same ranks, against one process on the same global batch: losses, pre-clip gradient norms,
    validation and final weights to 1e-5, plain causal (graph mode: the gathers traced into the step
    graph with SimpleFSDP's passes), with packed documents under a sliding window (eager), and so
    through the splash kernel per rank in graph mode (--kernels pallas: ChunkedKernelView)."""
    common = [*DIST_TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "1",
              "--sample-tokens", "0", *extra]
    single = shared_run(common, tmp_path_factory)
    multi = shared_run([*common, "--mesh", mesh, "--dp-impl", impl], tmp_path_factory, nproc)
    assert ran_on(multi) == ("cpu", nproc)
    _ranks_equal_one_process(single, multi, 6, common)


@pytest.mark.parametrize("extra,message", [
    (["--mesh", "ici=1,cp=2", "--seq-len", "30"], "--seq-len 30 must be divisible by 2 x cp = 4"),
    (["--mesh", "ici=1,cp=2,tp=2"], "cp with tp, ep or --scan is not built"),
    (["--mesh", "ici=1,cp=2", "--mode", "compile"], "cp is built for --mode eager and graph"),
    (["--mesh", "ici=2,cp=2", "--task", "sft"], "cp is for --task lm"),
    (["--mesh", "ici=2,cp=2", "--task", "flux"], "attends over text and image tokens jointly"),
    (["--mesh", "ici=1,cp=0"], "with positive integers"),
    (["--set", "sliding_window=0"], "sliding_window must be positive"),
    (["--set", "doc_sep=256"], "doc_sep must be a token id in [0, 256)"),
])
def test_what_context_parallel_does_not_build_is_refused_in_one_line(extra, message, tmp_path, capsys):
    rc = _main([*extra, "--out-dir", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


def test_plan_offers_context_parallel_for_a_long_sequence_with_its_kv_gather_on_ici():
    """--plan: Llama 3 8B, 4 sequences of 65536 tokens on 16 v5p chips: the best layout splits the
    sequences (cp), and its K/V all-gather is priced on ICI as written out here (a layer's K and V of
    the whole sequence, bf16, (cp-1)/cp of it received forward and the gradients' reduce-scatter
    backward; a latency a ring step); its saved activations are 1/cp of a whole sequence's. At 4096
    tokens (64 sequences) the best layout has no cp: there it buys nothing. (Saved bytes a sequence:
    the dry run's traces of this model at the two lengths, recorded: 394.09 / 184 GiB at 65536, remat
    off / on; 24.63 / 11.5 GiB at 4096.)"""
    import dataclasses as dc
    from planner import dryrun
    from model import FLAVORS
    from planner import chips as chips_lib
    from planner import stepmodel
    GiB, args, v5p = 2**30, FLAVORS["llama3_8b"], chips_lib.CHIPS["tpu_v5p"]
    workloads = {}
    for seq, batch, traced, wants_cp in ((65536, 4, {False: 394.09 * GiB, True: 184 * GiB}, True),
                                         (4096, 64, {False: 24.63 * GiB, True: 11.5 * GiB}, False)):
        w = workloads[seq] = dc.replace(dryrun.lm_workload(args, "llama3_8b", seq), saved_bytes=lambda remat, t=traced: t[remat])
        rows = dryrun.plan(w, 16, batch, "tpu_v5p", traced)
        assert rows[0]["fits"] and ("cp=" in rows[0]["mesh"]) == wants_cp, [(r["mesh"], r["fits"], r["step_s"]) for r in rows[:5]]
        assert any("cp=" in r["mesh"] for r in rows)
    w = workloads[65536]
    row = next(r for r in dryrun.plan(w, 16, 4, "tpu_v5p") if r["mesh"] == "ici=4,cp=4" and r["remat"] is True)
    received = args.n_layers * 2 * (2 * 2 * 65536 * args.n_kv_heads * args.hd) * 3 / 4
    assert row["ici_split"]["cp"] == received, row["ici_split"]
    shape = dc.replace(dryrun.shape_of(w), params=dict(w.whole), layer_params=dict(w.layer))
    pred = stepmodel.predict(shape, stepmodel.Layout(ici=4, cp=4, local_batch=1, remat="save_matmul_outputs"), v5p)
    ring = stepmodel.ring_steps(4, v5p)
    assert math.isclose(pred["comm"]["cp"], received / v5p.ici_bw + args.n_layers * 2 * ring * v5p.ici_latency_s)
    assert math.isclose(row["memory_bytes"][dryrun.MEMORY_LABELS["saved activations"]], 184 * GiB / 4)


def saved_activation_bytes(argv):
    """Bytes autograd saves for backward in one training forward of a Trainer built from `argv`
    (this process's rank: its placed batch), each storage counted once, parameters excluded: the
    activations a rank holds at the peak of its step (weights gathered by FSDP are in it too: small here)."""
    import train
    from parallel import local_tensor
    tr = train.Trainer(train.parse_config(argv))
    params = {local_tensor(p).untyped_storage().data_ptr() for p in tr.model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tr.task.loss(tr.model, tr.parallel.place_batch(tr.task.batch(1)))
    return sum(seen.values())


def child_saved_activation_bytes(*argv):
    """(torchrun) Each rank's saved-activation bytes, printed by rank 0 as a JSON list."""
    import json
    import os
    import torch.distributed as dist
    mine = torch.tensor([saved_activation_bytes(list(argv))], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if os.environ["RANK"] == "0":
        print(json.dumps([float(t) for t in every]))


def test_a_cp_rank_saves_a_cp_th_of_one_process_activations(corpus, tmp_path):
    """One sequence of 1024 tokens (packed documents under a window: one process and the ranks both
    attend under a mask): each of 4 cp ranks saves for backward 1/4 of what one process saves, plus
    what is not split: the whole sequence's keys and values each layer gathers (as the reference
    attention repeats them to every head) and the weights SimpleFSDP gathers. Counted tensor by tensor
    through autograd's saved-tensor hooks. (Measured: 15.0 MiB one process, 4.9 MiB a rank.)"""
    import json
    from tests import launch
    L, H, S, hd = 2, 4, 1024, 16
    argv = [*DIST_TINY, "--data", corpus, "--batch-size", "1", "--seq-len", str(S), "--set", f"max_seq_len={S}",
            "--eval-batches", "0", "--steps", "1", "--out-dir", str(tmp_path / "run"), *PACKED_WINDOW]
    whole = saved_activation_bytes(argv)
    rc, out, err = launch.ranks(4, ["test_all.py", "child_saved_activation_bytes", *argv, "--mesh", "ici=1,cp=4"])
    assert rc == 0, err[-3000:]
    ranks = json.loads(out.strip().splitlines()[-1])
    gathered_kv = L * 2 * H * S * hd * 4
    weights = 4 * sum(p.numel() for p in Transformer(tiny_args(ffn_dim=131)).parameters())
    print(f"\nsaved activations: one process {whole / 2**20:.2f} MiB, cp=4 ranks {[round(r / 2**20, 2) for r in ranks]} MiB "
          f"(1/4: {whole / 4 / 2**20:.2f}; not split: K/V {gathered_kv / 2**20:.2f}, weights {weights / 2**20:.2f})")
    assert all(whole / 4 <= r <= whole / 4 + gathered_kv + weights for r in ranks), (whole, ranks)


def test_four_cp_ranks_train_4x_the_sequence_one_process_holds_under_a_memory_limit(corpus, tmp_path_factory):
    """Under any memory limit from the larger of the first two peaks below to the third: one process
    trains sequences of S tokens, 4 cp ranks train sequences of 4S, and one process cannot train 2S
    (so S is the largest power of two it holds). The cp run equals one process on the same batch of 4S
    (losses, pre-clip norms, validation, weights). Measured: a step's peak above the RSS before it, a
    cp rank's the largest of the 4 (child_step_peak_memory: 24.7 MiB one process at S = 256 tokens x 8
    rows, 32.9 MiB a cp rank at 4S, which holds S tokens a row and the whole sequence's keys and values
    a layer; 51.5 MiB one process at 2S). Plain causal attention: one process builds no mask, a cp rank
    an S x 4S one."""
    from tests.check_accum import step_peaks
    S = 256
    common = [*DIST_TINY, "--data", corpus, "--batch-size", "8", "--steps", "3", "--eval-batches", "1",
              "--ckpt-interval", "0", "--sample-tokens", "0"]
    length = lambda s: ["--seq-len", str(s), "--set", f"max_seq_len={s}"]
    out = str(tmp_path_factory.mktemp("peaks") / "r")
    ranks = background(step_peaks, 4, [length(4 * S)], [*common, "--mesh", "ici=1,cp=4", "--out-dir", out + "cp"])
    fits, twice = step_peaks(1, [length(S), length(2 * S)], [*common, "--out-dir", out])
    (split,) = ranks.result()
    limit = max(fits["peak"], split["peak"])
    print(f"\nstep peak: one process {S} tokens {fits['peak'] / 2**20:.1f} MiB, {2 * S} tokens {twice['peak'] / 2**20:.1f} "
          f"MiB; a cp=4 rank {4 * S} tokens {split['peak'] / 2**20:.1f} MiB")
    assert twice["peak"] > 1.2 * limit, (fits, split, twice)  # (a margin: the peaks are whole pages)
    args = [*common, *length(4 * S)]
    single = shared_run(args, tmp_path_factory)
    multi = shared_run([*args, "--mesh", "ici=1,cp=4"], tmp_path_factory, 4)
    assert ran_on(multi) == ("cpu", 4)
    _ranks_equal_one_process(single, multi, 3, args)


def test_spmd_cp_splits_the_sequence_dim_and_equals_one_cpu_process(corpus, tmp_path):
    """XLA SPMD on 4 XLA:CPU devices, --mesh ici=2,cp=2, packed documents under a window: the batch's
    sequence dim carries a partition spec over cp (each device a (2, 16) block of the (4, 32) batch, in
    head-tail order), GSPMD gathers what attention needs; losses, gradient norms and final weights
    equal one CPU process's (XLA:CPU sums in another order: the SPMD tests' 1e-4)."""
    import json
    from tests import launch
    from tests.common import TINY, _near, _train_losses, _trainer
    args = [*TINY, "--data", corpus, "--steps", "4", "--ckpt-interval", "0", "--eval-batches", "0", *PACKED_WINDOW]
    child = launch.Child(["test_all.py", "child_spmd_steps", *args, "--out-dir", str(tmp_path / "x"), "--device", "xla",
                          "--mesh", "ici=2,cp=2"], env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"})
    oracle, norms = _trainer(corpus, tmp_path, *PACKED_WINDOW), []
    want = _train_losses(oracle, steps=4, norms=norms)
    rc, out, err = child.result()
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["batch_shards"] == [[2, 16]] * 4, res["batch_shards"]
    _near(want, res["losses"], atol=1e-4)
    _near(norms, res["norms"], atol=0, rtol=1e-4)
    got = torch.load(tmp_path / "x" / "params.pt")
    for name, p in zip(oracle.param_names, oracle.params):
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
