# layer_scan.py. Oracles: the unrolled loop (gradients), one process (under a mesh), HLO size
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json

import pytest
import torch

from model import FLAVORS, Transformer

from tests import launch
from tests.common import (DIST_TINY, TINY, _near, adam_spread, _ranks_equal_one_process, _train_losses, _trainer,
                          shared_run, start_record, torchrun)


@pytest.mark.parametrize("flavor", [pytest.param("llama3_debug", marks=pytest.mark.fast), "qwen3_debug", "qwen3_moe_debug"])
def test_layer_scan_equals_the_unrolled_loop(flavor):
    import copy
    import layer_scan
    torch.manual_seed(0)
    unrolled = Transformer(dataclasses.replace(FLAVORS[flavor], moe_impl="gmm" if "moe" in flavor else "reference"))
    scanned = layer_scan.stack_layers(copy.deepcopy(unrolled))
    x, y = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
    ce, aux = unrolled(x, y)
    ce_s, aux_s = scanned(x, y)
    assert ce.item() == ce_s.item() and aux.item() == pytest.approx(aux_s.item(), rel=1e-6)
    ce, ce_s = ce + aux, ce_s + aux_s
    grads = dict(zip([n for n, _ in unrolled.named_parameters()], torch.autograd.grad(ce, list(unrolled.parameters()))))
    for name, g in zip([n for n, _ in scanned.named_parameters()], torch.autograd.grad(ce_s, list(scanned.parameters()))):
        if name.startswith("layers."):
            leaf = name[len("layers."):].replace("__", ".")
            want = torch.stack([grads[f"layers.{i}.{leaf}"] for i in range(len(unrolled.layers))])
        else:
            want = grads[name]
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


def child_xla_scan_gradients():
    """(child process) Scan gradients on XLA vs the unrolled model on CPU; HLO size and While loops."""
    import copy
    import torch_xla
    import layer_scan
    xla = torch_xla.device()
    out = {}
    for flavor, layers in (("llama3_debug", 2), ("llama3_debug", 5), ("qwen3_moe_debug", 2)):
        torch.manual_seed(0)
        unrolled = Transformer(dataclasses.replace(FLAVORS[flavor], n_layers=layers,
                                                   moe_impl="gmm" if "moe" in flavor else "reference"))
        scanned = layer_scan.stack_layers(copy.deepcopy(unrolled)).to(xla)
        x, y = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
        want = torch.autograd.grad(sum(unrolled(x, y)), list(unrolled.parameters()))
        got = torch.autograd.grad(sum(scanned(x.to(xla), y.to(xla))), list(scanned.parameters()))
        hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(got))
        torch_xla.sync()  # one program for all gradients (reading them one by one would compile one each)
        by_name = dict(zip([n for n, _ in unrolled.named_parameters()], want))
        errs = []  # per gradient (a max() over them would skip a NaN)
        for name, g in zip([n for n, _ in scanned.named_parameters()], got):
            leaf = name[len("layers."):].replace("__", ".")
            w = (torch.stack([by_name[f"layers.{i}.{leaf}"] for i in range(layers)]) if name.startswith("layers.")
                 else by_name[name])
            errs.append((g.cpu() - w).abs().max().item())
        out[f"{flavor}/{layers}"] = {"errs": errs, "hlo_lines": len(hlo.splitlines()), "whiles": hlo.count(" while(")}
    print(json.dumps(out))


def test_layer_scan_on_xla_is_one_while_loop_with_the_unrolled_gradients():
    """On XLA the scan op lowers to XLA While loops (forward and backward): the program is the same
    size at 2 and 5 layers, and the gradients equal the unrolled model's on CPU (MoE: Pallas gmm
    inside the loop body, through call_jax)."""
    rc, out, err = launch.python(["test_all.py", "child_xla_scan_gradients"], env={"PJRT_DEVICE": "CPU"})
    assert rc == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    for r in res.values():
        assert r["errs"] and all(e < 1e-6 for e in r["errs"]) and r["whiles"] >= 2, res
    assert res["llama3_debug/2"]["hlo_lines"] == res["llama3_debug/5"]["hlo_lines"], res


def test_layer_scan_keeps_the_step_graph_constant_in_depth(corpus, tmp_path):
    sizes = {}
    for layers in (2, 8):
        for scan in (False, True):
            tr = _trainer(corpus, tmp_path, "--mode", "graph", "--set", f"n_layers={layers}", *(["--scan"] if scan else []))
            _train_losses(tr, steps=1)
            sizes[layers, scan] = len(tr.step_fn.gm.graph.nodes)
    # The optimizer's per-parameter ops grow with the parameter count; with scan there is one
    # parameter per block weight name whatever the depth, so the whole graph stays the same size.
    assert sizes[2, True] == sizes[8, True]
    assert sizes[8, False] > 3 * sizes[2, True]
    want = _train_losses(_trainer(corpus, tmp_path), steps=5)
    got = _train_losses(_trainer(corpus, tmp_path, "--mode", "graph", "--scan"), steps=5)
    moe = ["--flavor", "qwen3_moe_debug", "--kernels", "pallas", "--set", "moe_ffn_dim=32"]
    want += _train_losses(_trainer(corpus, tmp_path, *moe), steps=3)
    got += _train_losses(_trainer(corpus, tmp_path, "--mode", "graph", "--scan", *moe), steps=3)
    # Gradients agree to 1e-6 (above); the global norm sums stacked tensors in another order, so
    # the clip coefficient differs in the last bits and losses drift by ~2e-5 over 5 steps.
    _near(want, got, atol=1e-4)


# qwen3_moe_debug's MoE with the grouped-matmul kernel (a scanned MoE needs static shapes), its
# load-balancing loss off (per rank under ep: not one process's)
SCAN_MOE = [*TINY, "--flavor", "qwen3_moe_debug", "--kernels", "pallas", "--set", "moe_ffn_dim=32", "--set", "aux_loss_coef=0"]


@pytest.mark.parametrize("impl,mode,mesh,model", [("simple", "graph", "ici=2", DIST_TINY),
                                                  ("simple", "eager", "dcn=2,ici=2", DIST_TINY),
                                                  ("fsdp2", "eager", "ici=2", DIST_TINY),
                                                  ("simple", "graph", "dcn=2,ici=2,ep=2", SCAN_MOE)])
def test_layer_scan_under_a_mesh_matches_single_process(impl, mode, mesh, model, corpus, tmp_path, tmp_path_factory):
    """SimpleFSDP: stacked (L, ...) weights sharded after the layer axis, one layer gathered per
    iteration inside the scan op, gradients reduce-scattered per layer (HSDP: and averaged over dcn).
    FSDP2: the stack is one unit. Under ep the stack's one block routes every layer's rows through
    the all-to-all, each rank holding and gathering only its experts of each layer (L, E/ep, ...).
    (The oracle is one process with --scan: scan vs unrolled is tested above, and its grad norm sums
    in another order, ~2e-5 over 6 steps.)"""
    common = [*model, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "0", "--scan"]
    single, multi = shared_run(common, tmp_path_factory), str(tmp_path / "multi")
    nproc = 4 if mesh.startswith("dcn") else 2
    rc, out, err = torchrun(nproc, [*common, "--out-dir", multi, "--mesh", mesh, "--dp-impl", impl, "--mode", mode])
    assert rc == 0, err[-3000:]
    # (under ep the experts' gradients sum the ranks' rows in another order: the weights within how far one
    # process's own move under rounding-size gradient errors, adam_spread, as for the unstacked ep runs)
    p_single = _ranks_equal_one_process(single, multi, 6, common, keys=("grad_norm",),
                                        weights_atol=adam_spread(common, tmp_path_factory) if "ep" in mesh else 1e-5)
    assert any(p.dim() == 3 for p in p_single.values())  # (stacked)
    if "ep" in mesh:  # a rank holds 1/(ep x efsdp) = 1/4 of each layer's experts, 1/ici = 1/2 of the rest
        want = sum(p.numel() * 4 / (4 if "_Ex" in name else 2) for name, p in p_single.items())
        assert start_record(multi)["param_bytes_local"] == want, (start_record(multi)["param_bytes_local"], want)


def test_layer_scan_under_simplefsdp_holds_one_gathered_layer_not_the_stack(corpus, tmp_path):
    """Measured, per rank (VmHWM over a forward, and over forward + backward, minus the resident bytes
    before), on a parameter-heavy stack: 8 layers of DIM x 4 DIM, 16 DIM^2 parameters a layer (fp32 gathered,
    the norms aside). FSDP2, which gathers the stack as one unit, shows that the measurement sees a stack."""
    dim = 768
    heavy = ["--scan", "--set", "n_layers=8", "--set", f"dim={dim}", "--set", "n_heads=8", "--set", "n_kv_heads=8",
             "--set", f"ffn_dim={4 * dim}", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "0", "--steps", "2",
             "--data", corpus, "--mesh", "ici=2"]
    transient = {}
    for impl in ("simple", "fsdp2"):
        rc, out, err = launch.ranks(2, ["test_all.py", "child_step_transient_bytes", *heavy, "--dp-impl", impl,
                                        "--out-dir", str(tmp_path / impl)])
        assert rc == 0, err[-3000:]
        transient[impl] = json.loads(out.strip().splitlines()[-1])
    layer = 4 * 16 * dim * dim  # (q, k, v, o: 4 DIM^2; gate, up, down: 12 DIM^2)
    stack = 8 * layer
    print(f"\nper layer {layer / 1e6:.1f} MB; transient bytes in layers: "
          f"{ {k: {w: round(b / layer, 2) for w, b in v.items()} for k, v in transient.items()} }")
    assert transient["fsdp2"]["forward"] > stack and transient["fsdp2"]["transient"] > stack, transient
    # forward: by simplefsdp.LayerGather's order at most 2.5 layers are alive (the layer in use, the next
    # one's all-gather in flight: its flat input, half a layer on 2 ranks, and its output; while that
    # output is unpacked, the copies out of it replace the used layer). Measured 2.7 and 3.0 layers in
    # runs on two machines (at DIM 768 and 1024: gloo's and the allocator's own buffers on top). Bound
    # 3.5: the stack is 8, and a second layer prefetched would add 1.5
    assert transient["simple"]["forward"] < 3.5 * layer, (transient["simple"]["forward"] / layer, transient)
    # forward + backward: also one layer's full gradients and the flat buckets of two reduce-scatters
    # in flight (this one's and the one overlapping the next layer's vjp): 5.5 layers by that count,
    # measured 5.1 and, in one suite run, 6.01 (gloo's and the allocator's buffers, as in the forward's
    # 0.2-0.5 above its count). Bound 7: one layer under the stack, which FSDP2's gathering exceeds
    assert transient["simple"]["transient"] < 7 * layer < stack, (transient["simple"]["transient"] / layer, transient)


def child_step_transient_bytes(*argv):
    """(child process, torchrun) Rank 0's peak resident bytes during a forward + backward above what it
    held before, less the gradient shards it returns (the optimizer's own copies are not the point)."""
    import ctypes
    import gc
    import device as dev
    import train
    # A fixed mmap threshold (glibc's M_MMAP_THRESHOLD, -3): every tensor over 64 KiB is its own mapping,
    # returned on free, so RSS follows live bytes; glibc's adaptive threshold otherwise keeps freed 16 MB
    # weights in its heap, and the figure depended on the allocation history: 266 vs 442 MB in two runs.
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 65536) == 1
    cfg = train.parse_config(argv)
    tr = train.Trainer(cfg)
    for step in (1, 2):  # the first warms up (traces the block's vjp, fills the allocator's caches)
        x, y = tr.task.batch(step)
        gc.collect()
        dev.reset_peak_memory("cpu")
        before = _rss_bytes()
        ce, aux = tr.model(x, y)
        forward = dev.host_peak_rss_bytes() - before
        grads = tr.parallel.grads(ce + aux, tr.params)
        transient = dev.host_peak_rss_bytes() - before - sum(g.numel() * g.element_size() for g in grads)
        del ce, aux, grads
    if tr.parallel.writes_files:
        print(json.dumps({"transient": transient, "forward": forward}))


def _rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
