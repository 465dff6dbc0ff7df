# step.py: the step and its gradient accumulation. Oracles: plain autograd on the whole batch (gradients before any
# update), the unaccumulated trainer on the same global batch (losses, pre-clip norms, weights after AdamW)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import math
import re
import os

import pytest
import torch

import step as step_lib
from model import Transformer, next_token_loss

from tests import launch
from tests.common import DIST_TINY, LOSS_RTOL, TINY, _main, _near, _ranks_equal_one_process, _train_losses, _trainer, shared_run, tiny_args


def _flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


def _grad_gap(want, got):
    """max |got - want| over every gradient entry, and the largest entry (the scale the gap is read on)."""
    want, got = _flat(want), _flat(got)
    return (got - want).abs().max().item(), want.abs().max().item()


def test_microbatch_gradients_sum_to_the_whole_batch_gradient_mean_and_sum_reductions():
    """Before any update: the gradients accumulated over 4 microbatches equal plain autograd on the whole
    batch. "mean" (the LM's cross-entropy, every position a target); "sum" (a masked loss divided by the
    whole batch's target count, the 0-d entry, where the microbatches hold 1 to 31 targets each: a mean of
    microbatch means would be wrong by far more than the tolerance, checked below)."""
    torch.manual_seed(0)
    model = Transformer(tiny_args(vocab_size=256, max_seq_len=32))
    params = list(model.parameters())
    x, y = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))

    def grads_of(loss, last=True):
        return torch.autograd.grad(loss, params)
    layout = _Autograd(grads_of)
    want = grads_of(next_token_loss(model, (x, y))[1])
    reported, got = step_lib.loss_and_grads(next_token_loss, model, (x, y), step_lib.Microbatches(4, "mean"), layout,
                                            params, _no_autocast)
    gap, scale = _grad_gap(want, got)
    assert gap <= 1e-6 * scale, (gap, scale)
    torch.testing.assert_close(reported, next_token_loss(model, (x, y))[0], rtol=1e-6, atol=0)

    masked = y.clone()
    masked[:2, 1:] = -100  # rows 0, 1 keep 1 target each, rows 2, 3 keep 8, the rest all 16
    masked[2:4, :8] = -100
    count = (masked != -100).sum().float()

    def masked_loss(m, batch):
        inputs, targets, n = batch
        ce = torch.nn.functional.cross_entropy(m(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100,
                                               reduction="sum") / n
        return ce, ce
    want = grads_of(masked_loss(model, (x, masked, count))[1])
    _, got = step_lib.loss_and_grads(masked_loss, model, (x, masked, count), step_lib.Microbatches(4, "sum"), layout,
                                     params, _no_autocast)
    gap, scale = _grad_gap(want, got)
    assert gap <= 1e-6 * scale, (gap, scale)
    micro_means = [grads_of(masked_loss(model, (mx, my, (my != -100).sum()))[1])  # each its own count
                   for (mx, my, _), _ in step_lib.Microbatches(4, "sum").split((x, masked, count))]
    wrong = [sum(g) / 4 for g in zip(*micro_means)]  # what a mean of microbatch means would step on
    assert _grad_gap(want, wrong)[0] > 100 * gap + 1e-3 * scale


class _Autograd:
    """The layout hooks step_lib.loss_and_grads calls (parallel.Parallel's), as plain autograd: the oracle's."""

    def __init__(self, grads_of):
        self.grads_of = grads_of

    def grads(self, loss, params, last=True):
        return self.grads_of(loss, last)

    @staticmethod
    def after_microbatch(grads_sum, micro):
        return micro


def _no_autocast():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("mode", ["eager", "graph", "compile"])
def test_a_step_of_4_microbatches_equals_one_step_on_the_whole_batch(corpus, tmp_path, mode):
    """The trainer with --grad-accum 4 in each mode against the eager trainer without accumulation on the
    same global batch of 8 rows, 4 steps: the losses, the pre-clip gradient norms (a wrong scale, e.g. a
    sum where a mean belongs, hides behind clipping and Adam in the losses) and the weights after AdamW.
    Graph mode: the loop unrolled in the one traced step (4 embedding backwards in it, one a microbatch);
    compile mode: the compiled blocks called on each microbatch."""
    whole = _trainer(corpus, tmp_path / "whole", "--batch-size", "8")
    micro = _trainer(corpus, tmp_path / "micro", "--batch-size", "8", "--mode", mode, "--grad-accum", "4")
    norms_whole, norms_micro = [], []
    want, got = _train_losses(whole, 4, norms_whole), _train_losses(micro, 4, norms_micro)
    _near(want, got, atol=0, rtol=LOSS_RTOL)
    _near(norms_whole, norms_micro, atol=0, rtol=1e-5)
    for p, q in zip(whole.params, micro.params):  # (1.2e-6 measured: Adam divides a rounding-sized gradient
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)  # gap by sqrt(v); the layouts' oracle's 1e-5)
    if mode == "graph":
        import graph_trainer
        assert graph_trainer.op_counts(micro.step_fn.gm).get("aten.embedding_dense_backward.default") == 4


@pytest.mark.parametrize("argv, message", [
    (["--grad-accum", "0"], "--grad-accum must be positive, got 0"),
    (["--grad-accum", "3"], "--grad-accum 3: --batch-size 4 over 1 data-parallel rank(s) do not split into 3 equal"),
    # (--chips: the layout is picked later, so no rank count is named)
    (["--grad-accum", "3", "--dry-run", "--plan", "--chips", "4"],
     "--grad-accum 3: --batch-size 4 (on any layout) do not split into 3 equal"),
])
def test_a_bad_grad_accum_is_one_line_exit_2(argv, message, capsys):
    assert _main([*TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


# ------------------------------------------------------------------------------------------------
# Layouts. Oracle: one process on the same global batch without accumulation (check_parallel.py's)

@pytest.mark.parametrize("impl,mode", [("simple", "graph"), ("fsdp2", "eager")])
def test_grad_accum_on_two_ranks_equals_one_process(impl, mode, corpus, tmp_path_factory):
    """2 ranks x 2 microbatches of 1 row against one process on the 4 rows at once (the data-parallel
    test's run): losses, pre-clip norms, validation, final weights. SimpleFSDP in graph mode (its passes on:
    the unrolled step's collectives), FSDP2 in eager mode (its hooks reduce-scatter every backward)."""
    from tests.check_parallel import _dp_args
    common = _dp_args("llama3_debug", corpus)
    single = shared_run(common, tmp_path_factory)
    multi = shared_run([*common, "--mesh", "ici=2", "--dp-impl", impl, "--mode", mode, "--grad-accum", "2"],
                       tmp_path_factory, 2)
    _ranks_equal_one_process(single, multi, 10, common)
    if mode == "graph":  # the reduce-scatter once a step (fsdp_passes.reduce_once): a rank's gradient
        graph = next(r for r in map(json.loads, open(os.path.join(multi, "metrics.jsonl"))) if r.get("event") == "graph")
        params = next(r for r in map(json.loads, open(os.path.join(multi, "metrics.jsonl"))) if r.get("event") == "start")
        gradient = 4 * params["params"]  # (fp32; a few rows of padding where a dim does not split evenly)
        assert gradient <= graph["reduce_scatter_bytes"] < 1.05 * gradient, (graph, gradient)  # (not 2x: once, summed)


def child_fsdp2_collectives_a_step(*argv):
    """(torchrun) FSDP2 trainers of `argv` without and with --grad-accum 4, one after the other on the
    same ranks, each 3 steps from the same seed weights: the gradient-reducing collectives FSDP2 issues
    in step 2 (calls and bytes of torch.distributed's reduce_scatter_tensor and all_reduce, counted at
    the call: FSDP2 calls them by name; the trainer's own reductions are functional collectives), the
    pre-clip gradients of step 1 (this rank's shards, as the step hands them to clipping), the losses,
    gradient norms and final weight shards. Rank 0 prints the largest gaps over the ranks."""
    from unittest import mock
    import torch.distributed as dist
    import optim as o
    import train
    counted = {"reduce_scatter_tensor": [0, 0], "all_reduce": [0, 0]}  # [calls, bytes]
    counting = [False]

    def counter(name, real):
        def call(*args, **kwargs):
            if counting[0]:
                t = kwargs["input"] if name == "reduce_scatter_tensor" else (args[0] if args else kwargs["tensor"])
                counted[name][0] += 1
                counted[name][1] += t.numel() * t.element_size()
            return real(*args, **kwargs)
        return call
    runs, clip = {}, o.clip_by_global_norm
    for n in (1, 4):
        tr = train.Trainer(train.parse_config([*argv, "--grad-accum", str(n), "--out-dir", f"{argv[-1]}.{n}"]))
        seen = []

        def clipped(grads, *a, **kw):
            seen.append([g.detach().clone() for g in grads])
            return clip(grads, *a, **kw)
        losses, norms, calls = [], [], {}
        for step in (1, 2, 3):
            counted.update({k: [0, 0] for k in counted})
            counting[0] = step == 2
            with mock.patch.object(dist, "reduce_scatter_tensor", counter("reduce_scatter_tensor", dist.reduce_scatter_tensor)), \
                    mock.patch.object(dist, "all_reduce", counter("all_reduce", dist.all_reduce)), \
                    mock.patch.object(o, "clip_by_global_norm", clipped):
                batch = tr.parallel.place_batch(tr.task.batch(step))
                loss, norm = tr.step_fn(*batch, torch.tensor(o.lr_at(step, tr.cfg.lr, tr.cfg.warmup, tr.cfg.steps)))
            losses.append(loss.item())
            norms.append(norm.item())
            calls = calls or ({k: list(v) for k, v in counted.items()} if step == 2 else {})
        runs[n] = {"calls": calls, "grads": seen[0], "losses": losses, "norms": norms,
                   "weights": [p.detach().clone() for p in tr.parallel.local(tr.params)]}
        del tr
    gap = lambda key: max(float((a - b).abs().max()) for a, b in zip(runs[1][key], runs[4][key]))
    scale = max(float(g.abs().max()) for g in runs[1]["grads"])
    mine = torch.tensor([gap("grads"), scale, gap("weights")], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(json.dumps({"calls": {n: runs[n]["calls"] for n in runs}, "losses": {n: runs[n]["losses"] for n in runs},
                          "norms": {n: runs[n]["norms"] for n in runs}, "grad_gap": mine[0].item(),
                          "grad_scale": mine[1].item(), "weight_gap": mine[2].item()}))


@pytest.mark.parametrize("nproc,mesh", [(2, "ici=2"), (4, "dcn=2,ici=2")])
def test_fsdp2_reduces_gradients_once_a_step_under_accumulation(nproc, mesh, corpus, tmp_path):
    """FSDP2 with --grad-accum 4 issues the gradient collectives of one step without accumulation: as
    many reduce-scatters of as many bytes (each FSDP unit's once, not once a microbatch: 4x before),
    and under HSDP as many dcn all-reduces; and the step is still the unaccumulated one on the same
    batch: the pre-clip gradient shards before any update (to 1e-6 of the largest entry: sums in
    another order), the losses, norms and weights after 3 AdamW steps (the accumulation tests' bounds)."""
    args = [*DIST_TINY, "--data", corpus, "--batch-size", "16", "--steps", "3", "--eval-batches", "0",
            "--ckpt-interval", "0", "--mesh", mesh, "--dp-impl", "fsdp2", "--out-dir", str(tmp_path / "r")]
    rc, out, err = launch.ranks(nproc, ["test_all.py", "child_fsdp2_collectives_a_step", *args])
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    one, four = res["calls"]["1"], res["calls"]["4"]
    print(f"\n{mesh}: gradient collectives a step (calls, bytes) without accumulation {one}, in 4 microbatches {four}")
    assert one["reduce_scatter_tensor"][0] > 0 and four == one, (one, four)
    assert (one["all_reduce"][0] > 0) == mesh.startswith("dcn"), one
    assert res["grad_gap"] <= 1e-6 * res["grad_scale"], res
    _near(res["losses"]["1"], res["losses"]["4"], atol=0, rtol=LOSS_RTOL)
    _near(res["norms"]["1"], res["norms"]["4"], atol=0, rtol=1e-5)
    assert res["weight_gap"] <= 1e-5, res


def test_grad_accum_under_xla_spmd_equals_one_cpu_process(corpus, tmp_path):
    """XLA SPMD on 4 virtual devices, graph mode, 8 rows as 2 microbatches (each device holds 1 row of
    each: step_lib.Microbatches' strided split): losses, norms and weights against one eager CPU process on
    the 8 rows at once; one step program, compiled once."""
    from tests.check_parallel import SPMD_ENV
    args = [*TINY, "--data", corpus, "--steps", "3", "--ckpt-interval", "0", "--eval-batches", "0", "--batch-size", "8"]
    child = launch.Child(["test_all.py", "child_spmd_steps", *args, "--out-dir", str(tmp_path / "x"), "--device", "xla",
                          "--mesh", "ici=4", "--mode", "graph", "--grad-accum", "2"], env=SPMD_ENV)
    oracle, norms = _trainer(corpus, tmp_path, "--batch-size", "8"), []
    want = _train_losses(oracle, steps=3, norms=norms)
    rc, out, err = child.result()
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    _near(want, res["losses"], atol=1e-4)  # (XLA:CPU's sums in another order: check_parallel's bounds)
    _near(norms, res["norms"], atol=0, rtol=1e-4)
    got = torch.load(tmp_path / "x" / "params.pt")
    for name, p in zip(oracle.param_names, oracle.params):
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert res["compiles"][1] == res["compiles"][-1], res["compiles"]


# ------------------------------------------------------------------------------------------------
# Memory: one microbatch's activations, measured, and what the trainer's check and the planner count

def child_step_peak_memory(variants, *argv):
    """(child process, one or under torchrun) For each variant (a JSON list of argument lists added to
    `argv`), the peak resident memory of a training step of the Trainer they build, above what the
    process held before the step (the second step: the first one's one-off allocations aside), the
    largest over the ranks; and check_memory's activation estimate for it (a rank's microbatch).
    glibc's malloc maps every allocation of 64 KiB or more by itself (mallopt M_MMAP_THRESHOLD: no
    dynamic threshold), so a freed tensor leaves the process and the peak is what was alive at once,
    not what the heap kept. Prints one JSON list, a record a variant (rank 0)."""
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    import gc
    import optim as o
    import train
    from tests.common import peak_extra_rss
    out = []
    for i, extra in enumerate(json.loads(variants)):
        cfg = train.parse_config([*argv, *extra, "--out-dir", f"{argv[argv.index('--out-dir') + 1]}.{i}"])
        tr = train.Trainer(cfg)
        steps = [(tr.parallel.place_batch(tr.task.batch(k)), torch.tensor(o.lr_at(k, cfg.lr, cfg.warmup, cfg.steps)))
                 for k in (1, 2)]
        tr.step_fn(*steps[0][0], steps[0][1])  # (first-step allocations)
        gc.collect()
        _, peak = peak_extra_rss([os.getpid()], lambda: tr.step_fn(*steps[1][0], steps[1][1]))
        peak = torch.tensor([peak[os.getpid()]], dtype=torch.float64)
        if tr.parallel.mesh_spec is not None:
            import torch.distributed as dist
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows = cfg.batch_size // tr.parallel.dp_size // cfg.grad_accum
        out.append({"peak": peak.item(), "estimate": tr.family.activation_bytes(tr.model_args, rows, cfg.seq_len, None)
                    / tr.parallel.seq_split})
        del tr, steps
        gc.collect()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out))


def step_peaks(nproc, variants, argv):
    """child_step_peak_memory's records, in one process (nproc 1) or on `nproc` torchrun ranks."""
    child = ["test_all.py", "child_step_peak_memory", json.dumps(variants), *argv]
    rc, out, err = launch.python(child, timeout=300) if nproc == 1 else launch.ranks(nproc, child, timeout=300)
    assert rc == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_step_holds_one_microbatchs_activations_measured_and_as_the_trainer_counts_them(corpus):
    """Peak memory of an eager step whose activations dominate: 4 microbatches hold ~1/4 of the whole
    batch's (measured 12.8 vs 51.1 MiB: ratio 0.25); the trainer's check_memory estimate (an upper bound)
    covers the step it admits at 1/4 of the batch, so a batch refused whole is admitted in microbatches."""
    argv = [*TINY, "--data", corpus, "--batch-size", "32", "--seq-len", "128", "--eval-batches", "0", "--ckpt-interval",
            "0", "--out-dir", os.path.join(os.path.dirname(corpus), "peak")]
    res = dict(zip((1, 4), step_peaks(1, [["--grad-accum", "1"], ["--grad-accum", "4"]], argv)))
    whole, micro = res[1]["peak"], res[4]["peak"]
    assert whole > 30 * 2**20 and micro < 0.4 * whole, res  # (the gradients and AdamW's temporaries: ~2 MiB)
    for n in (1, 4):
        assert res[n]["peak"] <= res[n]["estimate"], res
    assert res[4]["estimate"] * 4 == res[1]["estimate"]


def test_four_ranks_train_8x_the_batch_that_fits_under_a_memory_limit_and_equal_one_process(corpus, tmp_path_factory):
    """On 4 SimpleFSDP ranks, under any memory limit from the larger of the first two peaks below to
    the third: a step of B rows a rank fits, the global batch 8x as large (8B rows a rank) trains in 8
    microbatches, and a step of 2B rows does not fit (so B is the largest power of two that fits
    whole). The accumulated run equals one process on that global batch (losses, pre-clip norms,
    validation, weights). Measured: a rank's step peak above its RSS before the step
    (child_step_peak_memory: 6.5 MiB for B = 4 rows of 128, 7.0 MiB for 8B in 8, 13.0 MiB for 2B)."""
    B = 4
    common = [*DIST_TINY, "--data", corpus, "--seq-len", "128", "--set", "max_seq_len=128", "--steps", "3",
              "--eval-batches", "1", "--ckpt-interval", "0", "--sample-tokens", "0"]
    out = str(tmp_path_factory.mktemp("peaks") / "r")
    fits, accumulated, twice = step_peaks(4, [["--batch-size", str(4 * B)], ["--batch-size", str(32 * B), "--grad-accum", "8"],
                                              ["--batch-size", str(8 * B)]], [*common, "--mesh", "ici=4", "--out-dir", out])
    limit = max(fits["peak"], accumulated["peak"])
    print(f"\na rank's step peak: {B} rows {fits['peak'] / 2**20:.1f} MiB, {8 * B} rows in 8 microbatches "
          f"{accumulated['peak'] / 2**20:.1f} MiB, {2 * B} rows {twice['peak'] / 2**20:.1f} MiB")
    assert twice["peak"] > 1.2 * limit, (fits, accumulated, twice)  # (a margin: the peaks are whole pages)
    args = [*common, "--batch-size", str(32 * B)]
    single = shared_run(args, tmp_path_factory)
    multi = shared_run([*args, "--mesh", "ici=4", "--grad-accum", "8"], tmp_path_factory, 4)
    _ranks_equal_one_process(single, multi, 3, args)


def test_check_memory_and_the_planner_count_one_microbatch(corpus, tmp_path, capsys):
    """A batch whose activations cannot fit is refused whole (check_memory, before anything is written)
    and admitted as 1000 microbatches; the planner charges one microbatch's activations, a second
    gradient buffer and FSDP's gathers and reduce-scatters once a microbatch (its hand-checked terms at
    microbatches=1, tests/check_dryrun.py), and --plan offers --grad-accum as the cheapest change for
    Qwen3-235B at 65536 x 4096 on 256 Ironwood chips (8x the published run's batch, which fits under a
    memory policy; this one fits under none): 4 microbatches with the layers' inputs offloaded, the
    published policy."""
    import dataclasses
    import types
    from planner import dryrun
    import train
    from model import FLAVORS
    from planner import stepmodel
    from tests.check_dryrun import _toy_chip, _toy_shape
    argv = [*TINY, "--data", corpus, "--batch-size", "100000", "--out-dir", str(tmp_path / "r")]
    assert _main(argv) == 2 and "and the activations of 100000 sequences need" in capsys.readouterr().err
    tr = train.Trainer(train.parse_config([*argv, "--grad-accum", "1000"]))  # (admitted: built, not run)
    assert tr.microbatches.count == 1000
    chip, shape = _toy_chip(), _toy_shape()
    one = stepmodel.predict(shape, stepmodel.Layout(ici=4, local_batch=2), chip)
    two = stepmodel.predict(shape, stepmodel.Layout(ici=4, local_batch=4, microbatches=2), chip)
    for term in ("saved activations", "transient peak", "parameters", "gradients", "optimizer state"):
        assert two["memory"][term] == one["memory"][term], term  # 4 samples in 2 microbatches hold what 2 do
    assert two["memory"]["gradient accumulator"] == one["memory"]["gradients"] and one["memory"]["gradient accumulator"] == 0
    four = stepmodel.predict(shape, stepmodel.Layout(ici=4, local_batch=4), chip)
    assert math.isclose(two["comm"]["ici"], 2 * four["comm"]["ici"]) and two["compute"]["matmul"] == four["compute"]["matmul"]
    w = dryrun.lm_workload(FLAVORS["qwen3_235b_a22b"], "qwen3_235b_a22b", 4096)
    traced = {False: 137 * 2**30, True: 56 * 2**30}  # bytes a sequence (the trace's at 4096 tokens, rounded down)
    w = dataclasses.replace(w, saved_bytes=lambda remat: traced[remat])
    cfg = types.SimpleNamespace(chip="tpu_v7", plan=True, chips=256, batch_size=65536, mesh=None, remat=False)
    assert dryrun.main(w, cfg) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert "cheapest change that fits: --grad-accum 4 -> ici=256, remat offload:decoder_layer_input" in line, line
    # (what is short is the host memory, not HBM: a layout fits the 192 GiB, its process needs more than the host has)
    assert re.search(r"the smallest in HBM \(\d+\.\d of 192 GiB a chip\) needs \d+ GB of host memory a chip, over "
                     r"its 240 GB", line), line
    cfg.grad_accum = 4
    assert dryrun.main(w, cfg) == 0
    out = capsys.readouterr().out
    assert "in 4 microbatches" in out.splitlines()[0] and json.loads(out.splitlines()[-1])[0]["fits"]


# ------------------------------------------------------------------------------------------------
# Workloads: each loss splits as its workload declares (Workload.loss_reduction); one that does not
# declare refuses the flag; a resume with another accumulation is checked like the batch settings

POLICY = [x for kv in ("dim=32", "n_layers=2", "n_heads=4", "n_kv_heads=2", "ffn_dim=64", "max_seq_len=16")
          for x in ("--set", kv)]


def _grpo_batch(workload, rows=8, seed=0):
    """A rollout batch as GRPOArithmetic.batch gives it (tokens, mask, engine logprobs, advantages, the
    global completion-token count) with completions of 1 to 4 tokens: the rows' counts differ."""
    g = torch.Generator().manual_seed(seed)
    C, P = workload.cfg.max_new_tokens, workload.prompt_len
    lengths = torch.tensor([1, 4, 2, 4, 1, 3, 4, 2])[:rows]
    mask = torch.arange(C)[None, :] < lengths[:, None]
    return (torch.randint(0, 256, (rows, P + C), generator=g), mask, -torch.rand(rows, C, generator=g) * 3,
            torch.randn(rows, generator=g), mask.sum().float())


@pytest.mark.parametrize("argv", [["--task", "sft", *POLICY, "--batch-size", "8"],
                                  ["--task", "grpo", *POLICY, "--prompts-per-step", "4", "--group-size", "2"],
                                  ["--task", "grpo", *POLICY, "--prompts-per-step", "4", "--group-size", "2",
                                   "--aggregation", "grpo"],
                                  ["--task", "flux", "--batch-size", "4"]],
                         ids=["sft", "grpo-dapo", "grpo-grpo", "flux"])
def test_each_workloads_loss_splits_into_microbatches_as_it_declares(argv):
    """SFT (the answer bytes over the batch's count: "sum"), GRPO's policy update (DAPO: "sum" over the
    batch's completion tokens; grpo's per-sequence means: "mean"), FLUX (the flow-matching MSE: "mean"):
    the gradients of 2 microbatches, accumulated as the workload declares, equal plain autograd on the
    whole batch (its real batch(1); GRPO's a rollout batch of completions of 1-4 tokens)."""
    import train
    cfg = train.parse_config([*argv, "--grad-accum", "2"])
    workload = train.make_workload(cfg)
    if cfg.task == "grpo":
        batch = _grpo_batch(workload)
    else:
        workload.setup_data(0, 1)
        batch = workload.batch(1)
    torch.manual_seed(0)
    model = workload.family.build(workload.args)
    if cfg.task != "flux":
        model.init_buffers()
    params = list(model.parameters())

    def grads_of(loss, last=True):
        return torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    want = grads_of(workload.loss(model, batch)[1])
    _, got = step_lib.loss_and_grads(workload.loss, model, batch, step_lib.Microbatches(2, type(workload).loss_reduction(cfg)),
                                     _Autograd(grads_of), params, _no_autocast)
    gap, scale = _grad_gap(want, got)
    assert scale > 0 and gap <= 1e-6 * scale, (gap, scale)


def test_a_workload_that_does_not_declare_its_loss_reduction_refuses_the_flag(monkeypatch, capsys):
    """check_seams' LinearRegression declares no loss_reduction: --grad-accum 2 is refused in one line
    (exit 2); --grad-accum 1 is its ordinary run."""
    import task as task_lib
    monkeypatch.setitem(task_lib.WORKLOADS, "linreg", "tests.check_seams:LinearRegression")
    from run import cli
    assert cli.parse_config(["--task", "linreg", "--batch-size", "8", "--grad-accum", "1"]).grad_accum == 1
    assert _main(["--task", "linreg", "--batch-size", "8", "--grad-accum", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--grad-accum 2: the linreg workload does not declare how its loss splits" in err, err


def test_a_resume_with_another_accumulation_needs_allow_change_and_then_continues(corpus, tmp_path, capsys):
    """meta.json records grad_accum with the batch settings (resume.RESUME_CHECKED): a resume with another
    value is refused in one line naming --allow-change grad_accum (the update is the same math, but its
    rounding is not: a resume stays bit for bit unless asked otherwise); with it the run continues and
    matches the uninterrupted run to the accumulation's rounding."""
    common = [*TINY, "--data", corpus, "--batch-size", "8", "--steps", "2", "--eval-batches", "0", "--ckpt-interval", "1",
              "--sample-tokens", "0"]
    straight, part = str(tmp_path / "straight"), str(tmp_path / "part")
    assert _main([*common, "--out-dir", straight]) == 0
    assert _main([*common, "--out-dir", part, "--grad-accum", "2", "--halt-at", "1"]) == 0
    capsys.readouterr()
    assert _main([*common, "--out-dir", part, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "grad_accum: saved 2, now 1" in err and "--allow-change grad_accum" in err, err
    assert _main([*common, "--out-dir", part, "--resume", "--allow-change", "grad_accum"]) == 0
    from tests.common import losses
    _near(losses(straight), losses(part), atol=1e-5)
