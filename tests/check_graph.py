# graph_trainer.py. Oracles: the eager loop, one process (under HSDP), torch_xla's compile counter
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json
import os

import pytest
import torch

import optim
from model import ModelArgs, Transformer

from tests import launch
from tests.common import (DIST_TINY, TINY, _near, background, _ops_of_one_more_step, _records, _train_losses,
                          _trainer, shared_run, torchrun)


@pytest.mark.parametrize("extra", [[], ["--flavor", "qwen3_moe_debug", "--kernels", "pallas", "--set", "moe_ffn_dim=32"]])
def test_graph_mode_is_one_graph_and_equals_eager(corpus, tmp_path, extra):
    eager = _trainer(corpus, tmp_path, *extra)
    graph = _trainer(corpus, tmp_path, "--mode", "graph", *extra)
    want, got = _train_losses(eager), _train_losses(graph)
    _near(want, got, atol=1e-5)
    for p, q in zip(eager.params, graph.params):  # (MoE through Pallas gmm: 1.9e-5 on one weight of 4096 with
        torch.testing.assert_close(p, q, rtol=1e-4, atol=5e-5 if extra else 1e-5)  # the seed fill's init)
    import graph_trainer
    ops = graph_trainer.op_counts(graph.step_fn.gm)
    # forward (embedding, matmuls), backward (embedding_dense_backward), optimizer (sqrt of AdamW's
    # second moment, foreach lerp), all in ONE GraphModule:
    assert ops.get("aten.embedding.default") == 1 and ops.get("aten.embedding_dense_backward.default") == 1
    assert any("lerp" in k for k in ops) and any("sqrt" in k for k in ops)
    assert sum(v for k, v in ops.items() if k in ("aten.mm.default", "aten.bmm.default")) >= 3 * 4 * 2


def test_compile_mode_matches_eager_over_20_steps(corpus, tmp_path):
    want = _train_losses(_trainer(corpus, tmp_path))
    compiled = _trainer(corpus, tmp_path, "--mode", "compile")
    got = _train_losses(compiled)
    _near(want, got, atol=1e-5)
    ran = _ops_of_one_more_step(compiled)  # dynamo's frames ran, and inductor's compiled code in them
    assert any(n.startswith("Torch-Compiled Region") for n in ran) and any("CompiledFxGraph" in n for n in ran), sorted(ran)


def test_graph_mode_inductor_backend_matches_eager(corpus, tmp_path):
    want = _train_losses(_trainer(corpus, tmp_path), steps=6)
    inductor = _trainer(corpus, tmp_path, "--mode", "graph", "--backend", "inductor")
    got = _train_losses(inductor, steps=6)
    _near(want, got, atol=1e-4)
    ran = _ops_of_one_more_step(inductor)  # inductor's compiled step ran, not the FX interpreter
    assert any("CompiledFxGraph" in n for n in ran), sorted(ran)


def child_xla_graph_steps(*argv):
    """(child process) 8 steps (or --steps, if fewer) of train.py's step function on XLA, any task's
    batches; losses and compile counts."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import device
    import train
    cfg = train.parse_config(argv)
    tr = train.Trainer(cfg)
    out, compiles, recorded = [], [], []
    for i in range(1, min(cfg.steps, 8) + 1):
        batch = [t.to(tr.device) for t in tr.task.batch(i)]
        graphs = met.metric_data("TensorsGraphSize")[0] or 0
        ce, _ = tr.step_fn(*batch, device.scalar(optim.lr_at(i, cfg.lr, cfg.warmup, 8), tr.device))
        torch_xla.sync()
        out.append(ce.item())
        compiles.append(met.metric_data("CompileTime")[0])
        sizes = met.metric_data("TensorsGraphSize")[2]  # (the IR nodes of each graph torch_xla recorded)
        recorded.append(int(sum(v for _, v in sizes[len(sizes) - (met.metric_data("TensorsGraphSize")[0] - graphs):])))
    print(json.dumps({"losses": out, "compiles": compiles, "recorded": recorded}))


@pytest.mark.parametrize("mode,scan,backend", [("graph", False, "xla"), ("graph", True, "xla"), ("graph", False, "openxla")])
def test_xla_compiles_one_program_per_step_shape(mode, scan, backend, corpus, tmp_path):
    """XLA graph mode compiles its step once, equal to eager CPU. --backend xla records the step's
    whole graph as lazy tensors every step (~2500 IR nodes unrolled, ~500 with --scan); --backend openxla (torch_xla's dynamo
    bridge) only at step 1, then runs the cached program: each later step records a handful of nodes
    (measured: 6), which is what bench.py --flux's "call" column times."""
    # (Not asserted for --mode eager: there, on a loaded machine, a step now and then compiles a new
    # program (6 of 12 runs with two at once); see README, Known limits.)
    args = [*TINY, "--data", corpus, "--ckpt-interval", "0", "--eval-batches", "0", "--out-dir", str(tmp_path / "x"),
            *(["--scan"] if scan else [])]
    child = launch.Child(["test_all.py", "child_xla_graph_steps", *args, "--mode", mode, "--device", "xla",
                          "--backend", backend], env={"PJRT_DEVICE": "CPU"})
    want = _train_losses(_trainer(corpus, tmp_path), steps=8)  # (the oracle, while the child runs)
    rc, out, err = child.result()
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    # Step 1 compiles the step program (after one small program that materializes the initial
    # state); no step compiles again, also not step 2, whose bias correction (1 - 0.9 = 0.1) equals
    # the weight decay: per-step scalars enter as inputs that torch_xla does not merge by value.
    # (openxla: one more, the few-node graph each step still records)
    assert res["compiles"][0] == res["compiles"][-1] == (3 if backend == "openxla" else 2), res["compiles"]
    _near(want, res["losses"], atol=1e-4)
    later = res["recorded"][1:]
    assert (max(later) <= 16) if backend == "openxla" else (min(later) >= 100), res["recorded"]


# ------------------------------------------------------------------------------------------------
# graph_passes.py. Oracles: the untransformed graph (bit for bit), the graph's structure

@pytest.mark.parametrize("flags", [["--remat"], ["--offload"], ["--split", "3"], ["--remat", "--offload", "--split", "2"]])
def test_graph_passes_keep_losses_and_do_their_job(flags, corpus, tmp_path):
    import graph_passes
    plain = _trainer(corpus, tmp_path, "--mode", "graph")
    passed = _trainer(corpus, tmp_path, "--mode", "graph", *flags)
    assert _train_losses(plain, steps=5) == _train_losses(passed, steps=5)  # bit for bit
    before, after = plain.step_fn.report, passed.step_fn.report
    assert before["saved_bytes"] == before["saved_bytes_captured"] > 0
    n_off, n_back = graph_passes.transfer_counts(passed.step_fn.gm)
    if "--remat" in flags:
        assert after["saved_bytes"] * 2 <= before["saved_bytes"]
    if "--offload" in flags:  # the graph holds the transfers; what stays on device shrinks
        assert n_off == n_back > 0 and after["offloaded_bytes"] > 0
        # Structure: an offloaded value's only post-forward reader is its reload, which the backward
        # reads instead (on TPU the offloaded copy lives in host memory: compute must never read it).
        gm = passed.step_fn.gm
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        end = graph_passes.forward_end_index(gm)
        for off in (n for n in gm.graph.nodes if n.target == torch.ops.minititan.offload.default):
            src = off.args[0]
            assert order[src] < order[off] < end and all(order[u] < end for u in src.users), src
            assert off.users and all(u.target == torch.ops.minititan.reload.default and order[u] > end for u in off.users)
        assert after["saved_bytes"] < (before["saved_bytes"] if "--remat" not in flags else after["saved_bytes_captured"])
    else:
        assert n_off == n_back == 0
    if "--split" in flags:
        assert len(passed.step_fn.compiled.stages) == int(flags[flags.index("--split") + 1])


@pytest.mark.fast
def test_saved_activation_bytes_equal_what_autograd_keeps_beyond_the_inputs():
    """The graph report's (and the planner's) saved bytes: storage the step keeps from forward to
    backward that its inputs do not already hold. Oracle: autograd's own saved tensors (recorded by
    saved_tensors_hooks), each storage once, minus the inputs' storage. Transposed weights and
    detached copies are views: counting them (as before) doubled this figure."""
    import graph_passes
    import graph_trainer
    torch.manual_seed(0)
    w1, w2, x = torch.randn(256, 64), torch.randn(8, 256), torch.randn(4, 64)
    forward = lambda w1, w2, x: (torch.relu(x @ w1.t()) @ w2.t()).square().sum()

    def step(w1, w2, x):
        with torch.enable_grad():
            w1, w2 = w1.detach().requires_grad_(), w2.detach().requires_grad_()
            return torch.autograd.grad(graph_passes.forward_end(forward(w1, w2, x)), (w1, w2))
    gm = graph_trainer.capture(step, (w1, w2, x))
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    inputs = {t.untyped_storage().data_ptr() for t in (a, b, x)}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(a, b, x)
    assert sum(kept.values()) == 4 * 256 * 4 + 4 * 8 * 4  # relu(x w1^T) and the product squared
    assert graph_passes.saved_bytes(gm) == sum(kept.values())


# ------------------------------------------------------------------------------------------------
# fsdp_passes.py. Oracles: passes off (bit for bit), one process (under HSDP), live bytes on real tensors

def _gathers(side):
    return side.get("all_gather_into_tensor", 0) + side.get("all_gather_into_tensor_out", 0)


def test_graph_mode_with_simplefsdp_hsdp_is_one_graph_with_its_collectives(corpus, tmp_path, tmp_path_factory):
    """HSDP (4 processes) in graph mode, with the SimpleFSDP passes on (the default under a mesh):
    equal to one process; one all-gather per block (+ embedding, + head) in each direction, the
    backward re-gathering what the forward gathered, no gathered weight saved in between."""
    common = [*DIST_TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "0"]
    single, multi = shared_run(common, tmp_path_factory), str(tmp_path / "multi")
    rc, out, err = torchrun(4, [*common, "--out-dir", multi, "--mesh", "dcn=2,ici=2", "--mode", "graph"])
    assert rc == 0, err[-3000:]
    for key in ("loss", "grad_norm"):
        want, got = _records(single, key), _records(multi, key)
        _near(want, got, atol=1e-5)
    graph = next(json.loads(line) for line in open(os.path.join(multi, "metrics.jsonl")) if '"graph"' in line)
    n_params = len(Transformer(dataclasses.replace(ModelArgs(), n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
                                                   ffn_dim=131)).state_dict())
    fwd, bwd = graph["collectives_by_side"]["forward"], graph["collectives_by_side"]["backward"]
    blocks = 2
    assert 1 <= _gathers(fwd) <= blocks + 2 and 1 <= _gathers(bwd) <= blocks + 2, graph["collectives_by_side"]
    assert 1 <= bwd["reduce_scatter_tensor"] <= blocks + 2
    # HSDP's gradient all-reduces over dcn, bucketed by block too (a gradient whose shard is padded
    # goes through a split and stays alone), plus the gradient norm's and the logged loss's
    assert 2 + blocks + 2 <= bwd["all_reduce"] <= n_params // 2, bwd
    assert graph["saved_gathered_bytes"] == 0
    # prefetch: every forward all-gather after the first is issued before the previous one's wait,
    # so before the previous block's first matmul (which reads that wait's result)
    assert graph["prefetched_gathers"] == _gathers(fwd) - 1 >= blocks


def test_simplefsdp_graph_passes_are_exact_and_free_the_gathered_model(corpus, tmp_path):
    """All passes on vs off, 2 processes: bit-identical losses, gradient norms and validation; off, the
    whole gathered model is saved for the backward (the fx backend frees values after their last
    use); on, none is, and the measured per-rank peak memory of a parameter-heavy model drops."""
    common = [*DIST_TINY, "--data", corpus, "--steps", "5", "--ckpt-interval", "0", "--eval-batches", "1",
              "--mode", "graph", "--mesh", "ici=2"]
    runs = {p: str(tmp_path / p) for p in ("none", "reshard,bucket,prefetch")}
    launched = [background(torchrun, 2, [*common, "--fsdp-passes", passes, "--out-dir", out]) for passes, out in runs.items()]
    for run in launched:
        rc, _, err = run.result()
        assert rc == 0, err[-3000:]
    for key in ("loss", "grad_norm", "val_loss"):
        assert _records(runs["none"], key) == _records(runs["reshard,bucket,prefetch"], key), key
    graph = lambda d: next(json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if '"graph"' in line)
    full_bytes = 4 * sum(p.numel() for p in Transformer(dataclasses.replace(
        ModelArgs(), n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=131)).parameters())
    embedding = 4 * 256 * 64  # (its backward reads only the token ids: not saved)
    assert graph(runs["none"])["saved_gathered_bytes"] >= full_bytes - embedding  # (uneven shards gather padded rows)
    assert graph(runs["reshard,bucket,prefetch"])["saved_gathered_bytes"] == 0
    assert graph(runs["none"])["prefetched_gathers"] == 0
    # Memory, measured on the real tensors of a step (a parameter-heavy model, 4 blocks of 16 DIM^2
    # parameters: at DIM 512 67 MB fp32 gathered, 17 MB a block): the peak of live intermediate bytes
    # over the forward and backward, run node by node, passes off vs on.
    dim = 512
    heavy = ["--set", "n_layers=4", "--set", f"dim={dim}", "--set", "n_heads=8", "--set", "n_kv_heads=8",
             "--set", f"ffn_dim={4 * dim}", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "0", "--steps", "1",
             "--data", corpus, "--mode", "graph", "--mesh", "ici=2", "--out-dir", str(tmp_path / "heavy")]
    rc, out, err = launch.ranks(2, ["test_all.py", "child_fsdp_live_bytes", *heavy])
    assert rc == 0, err[-3000:]
    peak = json.loads(out.strip().splitlines()[-1])
    block = 4 * 16 * dim * dim
    full = 4 * block + 4 * 2 * 256 * dim  # (+ the embedding and the output head)
    print(f"\npeak live bytes, passes off -> on: {peak['none'] / 1e6:.0f} -> {peak['reshard,bucket'] / 1e6:.0f} MB "
          f"(the model {full / 1e6:.0f} MB gathered, a block {block / 1e6:.0f} MB)")
    # measured at DIM 1024 300 -> 144 MB: the rest is one gathered block plus its full gradients before
    # the bucketed reduce-scatter, and the activations
    assert peak["none"] - peak["reshard,bucket"] > 0.6 * (full - block), peak


def child_fsdp_live_bytes(*argv):
    """(child process, torchrun) Peak live intermediate bytes of rank 0's step graph up to the
    optimizer (the first foreach op after the forward/backward marker), passes off and on: one
    trainer each, in one launch (the figure is counted node by node, not read off the process)."""
    import graph_passes
    import train
    peak = {}
    for passes in ("none", "reshard,bucket"):
        tr = train.Trainer(train.parse_config([*argv, "--fsdp-passes", passes]))
        x, y = tr.task.batch(1)
        args = tr.step_fn.args((x, y), torch.tensor(1e-4))
        tr.step_fn(x, y, torch.tensor(1e-4))  # captures and transforms the graph
        gm = tr.step_fn.gm
        end = graph_passes.forward_end_index(gm)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        peak[passes] = graph_passes.peak_live_bytes(gm, args, until=lambda n: order[n] > end and "_foreach" in str(n.target))
        del tr, gm, args
    if int(os.environ["RANK"]) == 0:
        print(json.dumps(peak))
