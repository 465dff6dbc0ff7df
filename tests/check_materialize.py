# materialize.py (build on meta, fill by shard) and spmd_checkpoint.py (SPMD checkpoints shard by shard).
# Oracles: one process's initial weights (bit for bit), the whole model's bytes, DCP's own metadata,
# the uninterrupted run.
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import os

import pytest
import torch

from tests import launch
from tests.common import DIST_TINY, _records, losses, run_train

MIB = 2**20
BASELINE = 48 * MIB  # what a build holds besides weights: the mesh, the meta model, allocator slack (measured ~10 MiB)
# A model of 27M parameters (108 MB in fp32): 4 ranks each hold a quarter of it.
BIG = ["--set", "dim=512", "--set", "n_layers=8", "--set", "ffn_dim=1536", "--set", "n_heads=8", "--set", "n_kv_heads=4",
       "--set", "head_dim=64"]
MOE = ["--flavor", "qwen3_moe_debug", "--set", "moe_ffn_dim=32"]
LAYOUTS = [  # (flags, mesh, dp impl): every torchrun layout, both families, --scan stacks
    ([], "ici=4", "simple"), ([], "dcn=2,ici=2", "simple"), ([], "ici=4", "fsdp2"), (["--set", "ffn_dim=128"], "ici=2,tp=2", "simple"),
    (MOE, "ici=4,ep=2", "simple"), (["--scan"], "ici=4", "simple"), (["--scan"], "dcn=2,ici=2", "fsdp2"),
    (["--task", "flux"], "ici=4", "simple"), (["--task", "flux"], "dcn=2,ici=2", "fsdp2")]
FLUX = ["--batch-size", "8", "--sample-images", "0", "--no-plot"]


def _common(corpus, extra):
    model = FLUX if "flux" in extra else [*DIST_TINY, "--data", corpus]
    return [*model, "--steps", "1", "--eval-batches", "0", *extra]


def child_build_memory_and_layouts(corpus, out):
    """(each of 4 ranks) the host peak of building BIG on SimpleFSDP ici=4 against its shards, one whole
    parameter and what building the whole model holds; then every layout's initial weights, gathered,
    against one process's (rank 0 compares, bit for bit)."""
    import torch.distributed as dist
    import device as dev
    import train
    from parallel import Parallel
    cfg = train.parse_config([*_common(corpus, BIG), "--mesh", "ici=4", "--out-dir", os.path.join(out, "big")])
    tr = train.Trainer(cfg)
    rank = dist.get_rank()
    report = {"build": tr.build_host_bytes, "shards": tr.parallel.local_bytes(tr.params),
              "largest": 4 * max(p.numel() for p in tr.params), "whole": 4 * sum(p.numel() for p in tr.params)}
    del tr
    dev.reset_peak_memory("cpu")
    before = dev.host_peak_rss_bytes()
    whole = train.make_workload(cfg).family.build(train.model_args(cfg))  # what the trainer built before
    report["whole_build"] = dev.host_peak_rss_bytes() - before
    del whole
    report["equal"] = []
    for extra, mesh, impl in LAYOUTS:
        flags = _common(corpus, extra)
        tr = train.Trainer(train.parse_config([*flags, "--mesh", mesh, "--dp-impl", impl,
                                               "--out-dir", os.path.join(out, f"{mesh}-{impl}")]))
        full = {n: p.full_tensor() for n, p in zip(tr.param_names, tr.params)}
        if rank == 0:
            one = train.Trainer(train.parse_config([*flags, "--out-dir", os.path.join(out, "one")]), Parallel(torch.device("cpu")))
            want = dict(zip(one.param_names, one.params))
            report["equal"].append([" ".join([*extra, mesh, impl]), sorted(full) == sorted(want) and
                                    all(torch.equal(full[n], want[n].detach()) for n in want)])
    if rank == 0:
        print(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def test_build_on_meta_holds_its_shards_and_every_layout_starts_from_one_process_weights(corpus, tmp_path):
    """Built on the meta device and filled by shard: a rank's host peak while building a 108 MB model
    split 4 ways is its quarter + one whole parameter + a fixed baseline (building the whole model, as
    the trainer did, holds all of it); every torchrun layout (SimpleFSDP, HSDP, FSDP2, TP, EP, --scan
    stacks; the LM and FLUX families) starts from exactly one process's initial weights."""
    rc, out, err = launch.ranks(4, ["test_all.py", "child_build_memory_and_layouts", corpus, str(tmp_path)], timeout=600)
    assert rc == 0, err[-3000:]
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["whole"] >= 4 * rep["shards"] - 4 * MIB, rep  # (an uneven split: a row more here and there)
    assert rep["build"] <= rep["shards"] + rep["largest"] + BASELINE, rep
    # the oracle of what it saves: the whole build's RSS growth (allocator reuse of the first trainer's
    # freed pages makes it read below the whole model's bytes: measured 0.85x)
    assert rep["whole_build"] >= rep["whole"] * 0.7 and rep["build"] < rep["whole"] / 2, rep
    assert [ok for _, ok in rep["equal"]] == [True] * len(LAYOUTS), rep["equal"]
    print(f"build peak {rep['build'] / MIB:.1f} MiB per rank (shards {rep['shards'] / MIB:.1f} MiB, largest parameter "
          f"{rep['largest'] / MIB:.1f} MiB); building the whole model: {rep['whole_build'] / MIB:.1f} MiB")


SPMD_ENV = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
# 12.8M parameters: a 154 MB state (weights, two moments), its largest tensor 1.5 MB
CKPT_MODEL = ["--set", "dim=384", "--set", "n_layers=8", "--set", "ffn_dim=1024", "--set", "n_heads=6", "--set", "n_kv_heads=2",
              "--set", "head_dim=64"]


def child_spmd_checkpoint_memory(corpus, out):
    """(child) an XLA SPMD trainer (dcn=2,ici=2) of CKPT_MODEL: the host peak of one save and one restore,
    above the RSS before each, against the state's bytes, its largest tensor and the design before
    (`whole`: the weights alone copied to the host, what a whole-tensor save did for the whole state).
    On XLA:CPU the devices' buffers are host memory: with glibc's default (a dynamic mmap threshold) the
    buffers a restore replaced stayed in the heap (+208 MB, measured); a fixed threshold returns them
    (mallopt M_MMAP_THRESHOLD, here as the child is a fork: MALLOC_MMAP_THRESHOLD_ is read at exec).
    On a TPU they are HBM, not the host's."""
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # (M_MMAP_THRESHOLD)
    import device as dev
    import train
    cfg = train.parse_config([*_common(corpus, CKPT_MODEL), "--device", "xla", "--mesh", "dcn=2,ici=2", "--out-dir", out])
    tr = train.Trainer(cfg)
    dev.sync(tr.device)
    report = {"state": 3 * 4 * sum(p.numel() for p in tr.params), "largest": 4 * max(p.numel() for p in tr.params)}
    for what, call in (("save", tr.save), ("restore", lambda: tr.restore(os.path.join(out, "checkpoints", "step_000000"))),
                       ("whole", lambda: [p.cpu() for p in tr.params])):
        dev.reset_peak_memory("cpu")
        before = dev.host_peak_rss_bytes()
        call()
        dev.sync(tr.device)
        report[what] = dev.host_peak_rss_bytes() - before
    print(json.dumps(report))


def _chunks_cover_once(path):
    """{tensor: number of chunks} of a DCP checkpoint, asserting its chunks tile every tensor exactly
    once (no overlap, nothing missing): the files hold each shard once."""
    import itertools
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    counts = {}
    for fqn, md in FileSystemReader(path).read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        boxes = [[(o, o + n) for o, n in zip(c.offsets, c.sizes)] for c in md.chunks]
        volume = lambda box: int(torch.tensor([b - a for a, b in box], dtype=torch.int64).prod()) if box else 1
        assert sum(volume(b) for b in boxes) == md.size.numel(), fqn
        for a, b in itertools.combinations(boxes, 2):
            assert any(x1 <= y0 or y1 <= x0 for (x0, x1), (y0, y1) in zip(a, b)), (fqn, a, b)
        counts[fqn] = len(boxes)
    return counts


def test_spmd_checkpoint_is_written_shard_by_shard_and_resumes_on_any_layout(corpus, tmp_path):
    """XLA SPMD on dcn=2,ici=2: the checkpoint's chunks are the distinct device shards, each once (the
    dcn replicas not twice); the checkpoint resumes on one process and on a torchrun mesh
    (--allow-change mesh, DCP resharding) equal to the uninterrupted SPMD run. (The host peak of a save
    and a restore, child_spmd_checkpoint_memory, on a 154 MB state: each adds under an eighth of the
    state, where copying the weights alone to the host adds their 51 MB.)"""
    import shutil
    from tests.common import torchrun
    common = [*DIST_TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "0", "--eval-batches", "1",
              "--sample-tokens", "0"]
    spmd = [*common, "--device", "xla", "--mesh", "dcn=2,ici=2"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    full_run = launch.Child(["train.py", *spmd, "--out-dir", full], env=SPMD_ENV)
    memory = launch.Child(["test_all.py", "child_spmd_checkpoint_memory", corpus, str(tmp_path / "memory")], env=SPMD_ENV)
    rc, _, err = run_train([*spmd, "--out-dir", part, "--halt-at", "3"], env=SPMD_ENV, timeout=600)
    assert rc == 0, err[-3000:]
    ckpt = os.path.join(part, "checkpoints", "step_000003")
    counts = _chunks_cover_once(ckpt)
    sharded = [n for n in counts if n.startswith(("model.", "optim."))]
    assert len(os.listdir(ckpt)) == sum(counts.values()) + 2  # (a file per shard, the step, the rng; .metadata, meta.json)
    assert sharded and all(counts[n] == 2 for n in sharded), counts  # ici=2 shards; the 2 dcn replicas once
    assert full_run.result(timeout=600)[0] == 0
    want = losses(full)
    for name, launcher in (("one", lambda a: run_train(a)), ("mesh", lambda a: torchrun(2, [*a, "--mesh", "ici=2"]))):
        os.makedirs(os.path.join(tmp_path, name, "checkpoints"))
        shutil.copytree(ckpt, os.path.join(tmp_path, name, "checkpoints", "step_000003"))
        rc, _, err = launcher([*common, "--out-dir", str(tmp_path / name), "--resume", "--allow-change", "mesh"])
        assert rc == 0, err[-3000:]
        got = losses(str(tmp_path / name))
        assert sorted(got) == [4, 5, 6] and all(abs(got[k] - want[k]) <= 1e-4 for k in got), (name, got, want)
        assert _records(str(tmp_path / name), "val_loss")[6] == pytest.approx(_records(full, "val_loss")[6], abs=1e-4)
    rc, out, err = memory.result(timeout=600)
    assert rc == 0, err[-3000:]
    mem = json.loads(out.strip().splitlines()[-1])
    print(f"\nSPMD checkpoint of a {mem['state'] / 1e6:.0f} MB state (largest tensor {mem['largest'] / 1e6:.2f} MB): host "
          f"peak +{mem['save'] / 1e6:.1f} MB to save, +{mem['restore'] / 1e6:.1f} MB to restore; the weights copied whole "
          f"+{mem['whole'] / 1e6:.0f} MB")
    assert mem["whole"] >= mem["state"] / 3 * 0.9  # (the measure sees a whole-tensor copy)
    assert mem["save"] < mem["state"] / 8 and mem["restore"] < mem["state"] / 8, mem


@pytest.mark.fast
def test_the_seed_fill_equals_each_family_built_whole_on_the_host(corpus, tmp_path):
    """Every family is filled by shard (each has an `initializer`: FLUX had none, and was built whole in
    every process), and the trainer's fill on meta equals the model its family builds whole on the host
    after torch.manual_seed(seed) (its constructor's init_module), bit for bit: dense LM, MoE, FLUX, and
    FLUX under --scan (each stacked weight against its layers)."""
    import layer_scan
    import train
    from parallel import Parallel
    for extra in ([], MOE, ["--task", "flux"], ["--task", "flux", "--scan"]):
        cfg = train.parse_config([*_common(corpus, extra), "--seed", "7", "--out-dir", str(tmp_path / "_".join(extra))])
        tr = train.Trainer(cfg, Parallel(torch.device("cpu")))
        assert tr.family.initializer is not None, extra
        torch.manual_seed(7)
        whole = dict(tr.family.build(tr.model_args).named_parameters())
        compared = 0
        for prefix, module in tr.model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if isinstance(module, layer_scan.StackedLayers):  # (L, ...): layer i is the plain model's block i
                    want = torch.stack([whole[o] for o in module.origins[name]])
                else:
                    want = whole[f"{prefix}.{name}" if prefix else name]
                assert torch.equal(p.detach(), want.detach()), (extra, prefix, name)
                compared += want.numel()
        assert compared == sum(p.numel() for p in whole.values()), extra


def _init_rule(family, name, shape, n_layers):
    """The documented init rule of parameter `name`, restated here (not read from the code under test):
    ("ones" | "zeros" | ("normal", std) | ("uniform", bound)). Language models (model.init_value, GPT-2
    style): norms 1, N(0, 0.02), the residual output projections N(0, 0.02 / sqrt(2 L)). FLUX
    (flux.model.initializer, torchtitan's): modulation and final layer 0, biases 0, RMSNorm scales 1,
    the blocks' linears Xavier-uniform, the rest N(0, 0.02)."""
    if family == "lm":
        if len(shape) == 1:
            return "ones"
        residual = name.endswith(("o_proj.weight", "down_proj.weight", "w_down_ExFxD"))
        return ("normal", 0.02 / (2 * n_layers) ** 0.5 if residual else 0.02)
    if any(part in name for part in ("_mod.", "modulation.", "final_layer.")) or name.endswith(".bias"):
        return "zeros"
    if name.endswith(".scale"):
        return "ones"
    if ("double_blocks." in name or "single_blocks." in name) and len(shape) == 2:
        return ("uniform", (6.0 / (shape[0] + shape[1])) ** 0.5)
    return ("normal", 0.02)


def _five_sigma_std_error(kind, n):
    """5 standard errors of a sample std's ratio to the true one over n draws: sqrt(Var(x^2)) / (2 E x^2)
    / sqrt(n), which is sqrt(2) / 2 for a normal and sqrt(0.8) / 2 for a uniform (E x^4 = a^4 / 5)."""
    return 5 * (2 if kind == "normal" else 0.8) ** 0.5 / 2 / n ** 0.5


def test_the_seed_fill_draws_each_parameter_by_its_rule_and_independently(corpus, tmp_path):
    """An oracle that shares nothing with materialize.param_generator: each parameter of the trainer's
    seed fill (dense LM, MoE, FLUX) against its init rule (exact ones and zeros; a random one's mean and
    std within 5 standard errors, a uniform's bound), and every two distinct random parameters of one
    shape uncorrelated (|r| < 5 / sqrt(n)), as another seed's draw of the same parameter is: a fill
    drawing each parameter from the seed alone gives all layers' weights of one shape the same values."""
    import train
    from parallel import Parallel

    def filled(extra, seed):
        cfg = train.parse_config([*_common(corpus, extra), "--seed", str(seed), "--out-dir", str(tmp_path / f"{seed}")])
        tr = train.Trainer(cfg, Parallel(torch.device("cpu")))
        return {n: p.detach().double() for n, p in tr.model.named_parameters()}, tr.model_args

    def correlation(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return float((a @ b) / (a.norm() * b.norm()))
    for extra in ([], MOE, ["--task", "flux"]):
        params, args = filled(extra, 7)
        family = "flux" if "--task" in extra else "lm"
        drawn = {}
        for name, p in params.items():
            rule, n = _init_rule(family, name, tuple(p.shape), getattr(args, "n_layers", 0)), p.numel()
            if rule in ("ones", "zeros"):
                assert torch.equal(p, torch.ones_like(p) if rule == "ones" else torch.zeros_like(p)), (name, rule)
                continue
            kind, scale = rule
            std = scale if kind == "normal" else scale / 3 ** 0.5
            assert abs(float(p.mean())) < 5 * std / n ** 0.5, (name, rule, float(p.mean()))
            assert abs(float(p.std()) / std - 1) < _five_sigma_std_error(kind, n), (name, rule, float(p.std()))
            assert kind == "normal" or float(p.abs().max()) <= scale, (name, rule, float(p.abs().max()))
            drawn.setdefault((tuple(p.shape), rule), []).append(name)
        pairs = [(a, b) for names in drawn.values() for i, a in enumerate(names) for b in names[i + 1:]]
        assert len(pairs) >= 10, (extra, drawn)  # (layers of one shape: what a fill ignoring the name makes equal)
        for a, b in pairs:
            r = correlation(params[a], params[b])
            assert abs(r) < 5 / params[a].numel() ** 0.5, (extra, a, b, r)
        if not extra:  # another seed draws every parameter anew
            other, _ = filled(extra, 8)
            for name in (n for names in drawn.values() for n in names):
                r = correlation(params[name], other[name])
                assert abs(r) < 5 / params[name].numel() ** 0.5, (name, r)
