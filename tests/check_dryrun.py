# planner/dryrun.py. Oracle: a real run's allocation
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json
import math

import pytest

from model import FLAVORS, flops_per_token

from tests.common import TINY, _main, _trainer
from tests.check_flux import FLUX_DEV_CONFIG


@pytest.mark.fast
def test_dry_run_bytes_equal_a_real_runs_allocation(corpus, tmp_path, capsys):
    import train
    assert train.main(["--dry-run", *TINY]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    real = _trainer(corpus, tmp_path)
    param_bytes = sum(p.numel() * p.element_size() for p in real.params)
    optim_bytes = sum(t.numel() * t.element_size() for k in ("exp_avg", "exp_avg_sq") for t in real.opt.state[k])
    assert report["memory_bytes"]["params (fp32 shard)"] == param_bytes
    assert report["memory_bytes"]["AdamW state (fp32 shard)"] == optim_bytes
    assert report["memory_bytes"]["saved activations (bf16)"] > 0 and report["fits"]


def test_plan_ranks_every_layout_of_the_chips_fast_and_refuses_impossible_ones(capsys):
    """--plan for the largest MoE flavor: under 2 minutes; every row a layout of exactly N chips that
    the model allows (ep divides the experts and the data-parallel ranks, no tp on MoE blocks);
    each under every memory policy; fitting layouts first, each group ordered by step time; the row
    for a layout equals that layout's own dry run; an impossible request is one line, exit 2."""
    import time
    t0 = time.time()
    flags = ["--dry-run", "--flavor", "qwen3_235b_a22b", "--batch-size", "256", "--seq-len", "4096"]
    rc = _main([*flags, "--plan", "--chips", "256"])
    out, err = capsys.readouterr()
    assert rc == 0 and time.time() - t0 < 120, err[-2000:]
    rows = json.loads(out.strip().splitlines()[-1])
    dims = [{k: int(v) for k, v in (p.split("=") for p in r["mesh"].split(","))} for r in rows]
    assert all(d.get("dcn", 1) * d["ici"] * d.get("cp", 1) * d.get("tp", 1) == 256 and d.get("tp", 1) == 1 for d in dims)
    assert all(128 % d.get("ep", 1) == 0 and (d.get("dcn", 1) * d["ici"]) % d.get("ep", 1) == 0 for d in dims)
    policies = {json.dumps(r["remat"]) for r in rows}  # (every layout under each memory policy an LM takes)
    assert any(d.get("ep", 1) > 1 for d in dims) and len({r["mesh"] for r in rows}) * len(policies) == len(rows)
    from planner import dryrun
    assert len(policies) == len(dryrun.plan_policies(dryrun.lm_workload(FLAVORS["qwen3_235b_a22b"], "", 4096))) >= 10
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits)
    for group in (True, False):
        steps = [r["step_s"] for r in rows if r["fits"] == group]
        assert steps == sorted(steps)
    # Every row equals its layout's own dry run (in this process; the activation bytes a sequence,
    # the one traced figure, traced once per remat setting as a single dry run does)
    from planner import dryrun
    from planner import activations
    import mesh as mesh_lib
    import model
    import train
    args = train.model_args(train.parse_config(flags))
    per_sequence = {r: activations.saved_bytes_per_sequence(model.tpu_config(args), 4096, r) for r in (False, True)}
    assert any(r["remat"] for r in rows) and not all(r["remat"] for r in rows)
    for row in (r for r in rows if isinstance(r["remat"], bool)):  # (the two policies traced)
        own = dryrun.dry_run(args, "qwen3_235b_a22b", mesh_lib.mesh_dims(row["mesh"]), 256, 4096, "tpu_v5p",
                             row["remat"], per_sequence[row["remat"]])
        assert {k: own[k] for k in row} == row, (row, {k: own[k] for k in row})
    rc = _main([*flags, "--plan", "--chips", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, err
    for extra, said in ((["--plan", "--chips", "8", "--mesh", "ici=8"], "--plan ranks every layout of --chips; --mesh "
                                                                         "ici=8 is one layout: give one of them"),
                        (["--topology", "v5p:2x2x1"], "--topology v5p:2x2x1 names the chips the compile targets: add "
                                                      "--compile"),
                        (["--compile-effort", "-1"], "--compile-effort -1.0 is the TPU compiler's: add --compile")):
        # (each was ignored: a report of another layout, an estimate no effort changes)
        assert _main([*flags, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: " + said), err


@pytest.mark.parametrize("flavor,mesh", [("llama3_405b", "dcn=2,ici=128"), ("qwen3_235b_a22b", "dcn=2,ici=128")])
def test_dry_run_of_the_largest_flavors_is_fast_and_says_whether_it_fits(flavor, mesh, capsys):
    import time
    t0 = time.time()
    rc = _main(["--dry-run", "--flavor", flavor, "--mesh", mesh, "--batch-size", "256", "--seq-len", "4096", "--remat"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    assert time.time() - t0 < 120
    report = json.loads(out.strip().splitlines()[-1])
    from planner import dryrun
    whole, _ = dryrun.param_groups(FLAVORS[flavor])  # experts over all 256 data-parallel ranks, the rest over ici
    shard = math.ceil(whole["tp"] / 128) + math.ceil(whole["experts"] / 256) + math.ceil(whole["rest"] / 128)
    assert report["memory_bytes"]["params (fp32 shard)"] == 4 * shard
    # The verdict is the published HBM (95 GiB a v5p chip) against the sum of the parts, and the text
    # says the same ("fits" is also a key of the JSON line, so look at the text's total line).
    assert report["total_bytes"] == sum(report["memory_bytes"].values())
    assert report["fits"] == (report["total_bytes"] <= 95 * 2**30), report
    total_line = next(l for l in out.splitlines() if l.strip().startswith("total per device"))
    assert total_line.endswith("GiB HBM: fits") if report["fits"] else "GiB HBM: DOES NOT FIT: short by" in total_line, total_line
    assert report["flops_per_device"] == flops_per_token(FLAVORS[flavor], 4096) * 4096  # 1 sequence/device


def test_flux_dry_run_at_1024_through_the_task_seam_flops_shards_plan_and_a_bad_image_size(capsys):
    """flux_dev at 1024 x 1024 on 8 v5p chips under FSDP (ici=8), planned through ModelFamily.plan (flux.task.plan_workload):
    FLOPs per device are flux/model.py's formula (checked against FlopCounterMode and the published sizes in
    the FLUX section) for 4096 image + 512 text tokens, times the local batch; parameter, gradient and
    AdamW bytes per device are the published 11,901,408,320 parameters x 4 / 4 / 8 bytes over 8 chips;
    the gathered unit is one double block, counted here from the published config. --plan offers
    data-parallel layouts only (dcn x ici = 8, no tp / ep), its row for ici=8 equals the dry run.
    An image size the VAE (8x) and 2 x 2 packing cannot divide is one error line, exit 2."""
    from planner import dryrun
    from flux import model as flux
    import train
    flags = ["--task", "flux", "--flavor", "flux_dev", "--dry-run", "--image-size", "1024", "--batch-size", "16"]
    assert train.main([*flags, "--mesh", "ici=8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    published, chips, local = 11_901_408_320, 8, 2
    mem = report["memory_bytes"]
    assert report["params"] == published and report["local_batch"] == local and report["seq_len"] == 4096 + 512
    assert mem["params (fp32 shard)"] == mem["grads (fp32 shard)"] == 4 * published / chips
    assert mem["AdamW state (fp32 shard)"] == 8 * published / chips
    assert report["flops_per_device"] == flux.flops_per_sample(flux.FLAVORS["flux_dev"], 4096, 512) * local
    hd = FLUX_DEV_CONFIG["attention_head_dim"]
    h = FLUX_DEV_CONFIG["num_attention_heads"] * hd
    lin = lambda i, o: i * o + o
    double = 2 * (lin(h, 6 * h) + lin(h, 3 * h) + 2 * hd + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h))
    assert mem["gathered layer (bf16, x2 prefetch)"] == 2 * 2 * double
    # (flash attention traced: a sample's S x S probabilities, 24 heads x 4608^2 fp32 = 2 GB a block,
    # are not saved; the 57 blocks together keep less than that of 57 blocks)
    assert 0 < mem["saved activations (bf16)"] / local < 57 * 24 * 4608**2 * 4
    task = train.make_workload(train.parse_config([*flags, "--plan", "--chips", "8"]))
    per_sample = mem["saved activations (bf16)"] / local
    workload = dataclasses.replace(task.family.plan(task.args, task.cfg), saved_bytes=lambda remat: per_sample)
    rows = dryrun.plan(workload, 8, 16, "tpu_v5p")
    assert sorted(r["mesh"] for r in rows if not r["remat"]) == ["dcn=2,ici=4", "dcn=4,ici=2", "dcn=8,ici=1", "ici=8"]
    policies = {json.dumps(r["remat"]) for r in rows}  # (each layout under every policy FLUX takes: its own too)
    assert len(rows) == 4 * len(policies) and '"flux_optimized"' in policies and {"true", "false"} <= policies
    assert next(r for r in rows if r["mesh"] == "ici=8" and not r["remat"]) == report
    for size in ("1000", "8"):  # (8: a FLUX VAE latent of 1 x 1 cannot be packed 2 x 2)
        assert train.main([*flags, "--image-size", size]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --image-size {size} is not a positive multiple of 16") and "\n" not in err, err


# ---- The planner's step time and memory (stepmodel.py), each term against a hand computation ----

def _toy_chip(**kw):
    from planner import chips
    base = dict(name="toy", peak_flops=1e12, hbm_bytes=1e12, hbm_bw=1e11, ici_bw=1e10, torus_dims=1, mxu_tile=1,
                host_bytes=1e12, host_bw=1e9, dcn_bw=1e9, ici_latency_s=0.0, dcn_latency_s=0.0, host_overhead_s=0.01)
    return chips.Chip(**{**base, **kw})


def _toy_shape(**kw):
    """One matmul (rows 8, k 16, n 32, 2 layers), causal attention (2 heads x 4 dims over 8 tokens),
    four named activations; every number small enough to compute by hand."""
    from planner import shapes
    base = dict(label="toy", tokens=8, layers=2, params={"tp": 1000, "experts": 0, "rest": 24},
                layer_params={"tp": 500, "experts": 0, "rest": 12},
                matmuls=(shapes.Matmul("mlpwi_0", 8, 16, 32, 2, "tp"),),
                attention=dict(heads=2, head_dim=4, seq=8, causal=True, layers=2),
                acts={"decoder_layer_input": 16, "query_proj": 8, "context": 8, "mlpwi_0": 32},
                recompute_of={"query_proj": [], "context": ["attention"], "mlpwi_0": ["mlpwi_0"]},
                elementwise=100.0, vocab=0, dim=16)
    return shapes.Shape(**{**base, **kw})


def test_planner_matmul_efficiency_and_causal_blocks_by_hand():
    from planner import stepmodel
    from planner.chips import CHIPS
    v6e, v5p = CHIPS["tpu_v6e"], CHIPS["tpu_v5p"]
    assert stepmodel.matmul_efficiency(4096, 1536, v6e, 0.7) == 0.7          # 16 and 6 tiles of 256: no loss
    # k = 200 on 128-wide tiles: padded to 256 (200/256), and shorter than 4 tiles (200/512)
    assert math.isclose(stepmodel.matmul_efficiency(200, 4096, v5p, 0.5), 0.5 * (200 / 256) * (200 / 512))
    assert stepmodel.causal_fraction(8192, 2048) == 5 / 8                    # 4 x 4 blocks: 10 of 16 on/below
    assert stepmodel.causal_fraction(512, 512) == 1.0
    assert stepmodel.ring_steps(256, v6e) == 2 * 15 and stepmodel.ring_steps(1, v6e) == 0  # 16 x 16 torus


@pytest.mark.fast
def test_planner_step_terms_equal_a_hand_computation():
    """FSDP over 4 chips, 2 samples a chip, fp32 master weights, nothing recomputed: every term by hand."""
    from planner import chips
    from planner import stepmodel
    chip, shape = _toy_chip(), _toy_shape()
    lay = stepmodel.Layout(ici=4, local_batch=2, remat="none")
    p = stepmodel.predict(shape, lay, chip, {"matmul_efficiency": 0.5, "moe_efficiency": 0.5})
    c = p["compute"]
    assert math.isclose(c["matmul"], 3 * (2 * 8 * 16 * 32 * 2 * 2) / (1e12 * 0.5 * 1.0))    # k=16, n=32: tile 1
    fwd = 4 * 8**2 * 2 * 4 * 2 * 2 * (5 / 8 if 8 > 512 else 1.0)     # 8 tokens: one 512-block, nothing skipped
    assert math.isclose(c["attention"], 3.5 * fwd / (1e12 * 0.5 * chips.ATTENTION_RELATIVE_EFFICIENCY))
    assert c["recompute"] == 0
    assert math.isclose(c["elementwise"], 100 * 2 * (8 * 2) * 2 * 3 / 1e11)   # elems x layers x tokens x bf16 x 3
    shard = 1000 / 4 + 24 / 4
    assert math.isclose(c["optimizer"], shard * (2 * 4 + 4 + 2 * 8) / 1e11)  # read w g m v, write w m v
    assert math.isclose(c["gathered copies"], 2 * 2 * 2 * (500 + 12) * 2 / 1e11)
    ici = (2 * 2 + 4) * 1024 * 3 / 4 / 1e10                                  # gather x2 (bf16) + reduce-scatter (fp32)
    assert math.isclose(p["comm"]["ici"], ici)
    compute = sum(c.values())
    assert math.isclose(p["exposed_comm_s"], ici - chips.OVERLAP * min(ici, compute))
    assert math.isclose(p["step_s"], 0.01 + compute + p["exposed_comm_s"])
    m = p["memory"]
    assert (m["parameters"], m["gradients"], m["optimizer state"]) == (4 * shard, 4 * shard, 8 * shard)
    assert m["gathered block (bf16, x2)"] == 2 * 2 * 512
    assert m["saved activations"] == (16 + 8 + 8 + 32) * 2 * 16 * 2           # all kept: elems x bf16 x tokens x layers
    assert m["transient peak"] == 64 * 2 * 16
    # a chip of two devices (Ironwood's TensorCores, each running the step on half the chip's tokens):
    # each gathers its own block and loss head, so those double; state and activations a chip do not
    head = _toy_shape(vocab=64, loss_head=64 * 16)
    one, two = (stepmodel.predict(head, lay, _toy_chip(devices=n))["memory"] for n in (1, 2))
    assert two["gathered block (bf16, x2)"] == 2 * one["gathered block (bf16, x2)"] == 2 * 2 * 2 * 512
    # the head's peak (bf16 head + its gradient) is outside the layers, where the block's bytes are free:
    # the transient term is what it needs beyond them
    assert one["transient peak"] == 2 * 2 * 64 * 16 - 2 * 2 * 512 and two["transient peak"] == 2 * one["transient peak"]
    assert all(two[k] == one[k] for k in ("parameters", "gradients", "optimizer state", "saved activations"))
    # bf16 state (MaxText weight_dtype=bfloat16) halves it; DDP replicates it and gathers nothing
    q = stepmodel.predict(shape, dataclasses.replace(lay, precision=stepmodel.PRECISIONS["bf16"], dp_mode="ddp"), chip)
    assert q["memory"]["parameters"] == 2 * 1024 and q["memory"]["optimizer state"] == 4 * 1024
    assert q["memory"]["gathered block (bf16, x2)"] == 0 and q["compute"]["gathered copies"] == 0
    assert math.isclose(q["comm"]["ici"], 2 * 2 * 1024 * 3 / 4 / 1e10)       # all-reduce of bf16 gradients


def test_planner_remat_policies_charge_what_they_free_and_offload_uses_the_host_link():
    from planner import stepmodel
    chip, shape = _toy_chip(), _toy_shape()
    lay = stepmodel.Layout(ici=1, local_batch=1)
    none = stepmodel.predict(shape, lay, chip)
    full = stepmodel.predict(shape, dataclasses.replace(lay, remat="full"), chip)
    eff = 0.69 * 0.6
    # full: only the layer input saved; the matmul and the attention forward again; one more elementwise pass
    assert full["memory"]["saved activations"] == 16 * 2 * 8 * 2
    assert math.isclose(full["compute"]["recompute"], 2 * 8 * 16 * 32 * 2 / (1e12 * 0.69))
    assert math.isclose(full["compute"]["attention"] - none["compute"]["attention"], 4 * 64 * 2 * 4 * 2 / (1e12 * eff))
    assert math.isclose(full["compute"]["elementwise"], none["compute"]["elementwise"] * 4 / 3)
    # MaxText custom: named tensors offloaded, the unnamed recomputed; offload bytes cross the host link twice
    custom = {"decoder_layer_input": "offload", "query_proj": "offload"}
    off = stepmodel.predict(shape, dataclasses.replace(lay, remat=custom), chip)
    assert off["offload_bytes"] == (16 + 8) * 2 * 8 * 2 and off["memory"]["saved activations"] == 0
    assert math.isclose(off["comm"]["offload"], 2 * off["offload_bytes"] / 1e9)
    with pytest.raises(ValueError, match="remat policy"):
        stepmodel.predict(shape, dataclasses.replace(lay, remat="some"), chip)


def test_the_compiler_columns_stand_in_flavors_have_the_published_shapes():
    """planner/compile_column.FLAVOR_OF compiles a published model with no flavor of its own as a
    flavor and --set overrides: those give shapes.PLANNER_MODELS' published config (every shape
    field; the rotary table's values aside), so the compiled program has the run's parameters. The
    MoE runs are compiled, Mixtral 8x22B at its published ep=4 and capacity factor (before, skipped:
    the ep compile took no --scan); the two-slice 405B as published, FSDP over DCN (before, as HSDP);
    a DDP run is skipped, naming it."""
    import dataclasses
    from run.flags import with_overrides
    from model import FLAVORS, param_counts
    from planner import calibrate, compile_column
    from planner.shapes import PLANNER_MODELS
    shape_fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "hd", "ffn_dim", "vocab_size", "n_experts", "top_k",
                    "moe_ffn_dim", "qk_norm", "tie_embeddings")
    for model, (flavor, extra) in compile_column.FLAVOR_OF.items():
        args = with_overrides(FLAVORS[flavor], extra[1::2])
        want = PLANNER_MODELS[model]
        if want.n_experts:  # (an MoE block has no dense MLP: its ffn_dim is never built)
            args, want = dataclasses.replace(args, ffn_dim=0), dataclasses.replace(want, ffn_dim=0)
        assert [getattr(args, f) for f in shape_fields] == [getattr(want, f) for f in shape_fields], model
        assert param_counts(args) == param_counts(want), model
    runs = {r["id"]: r for r in calibrate.load()}
    assert compile_column.skip_reason(runs["maxtext_mixtral_8x7b_v5p_128"]) is None
    assert compile_column.skip_reason(runs["tpu_recipes_mixtral_8x22b_v6e_256"]) is None
    command = compile_column.command(runs["tpu_recipes_mixtral_8x22b_v6e_256"])
    assert command[command.index("--mesh") + 1] == "ici=256,ep=4", command
    assert "ep_buffer_factor=1.25" in command, command  # (its published capacity factor bounds the exchange)
    command = compile_column.command(runs["tpu_recipes_llama3.1_405b_2x_v6e_256"])  # (published as FSDP over DCN:
    assert command[command.index("--mesh") + 1] == "ici=512", command              # one FSDP axis over both slices)
    assert command[command.index("--topology") + 1] == "v6e:16x16", command
    assert "DDP" in compile_column.skip_reason(runs["maxdiffusion_flux_dev_v5p_8"])


def test_planner_lm_shape_counts_the_published_models_matmuls():
    """llama3_8b at 8192: the shape's forward matmul FLOPs are 2 x the non-embedding parameters a token
    (6N's forward third); MaxText's save_dot_except_mlpwi recomputes exactly the two MLP input matmuls
    (and the attention forward: it does not save `context`)."""
    from planner import stepmodel
    from model import FLAVORS, param_counts
    from planner.shapes import lm_shape, policy_split
    a = FLAVORS["llama3_8b"]
    shape = lm_shape(a, 8192)
    total, emb, _ = param_counts(a)
    assert math.isclose(sum(m.flops for m in shape.matmuls), 2 * (total - emb) * 8192, rel_tol=1e-4)  # (norms: not matmuls)
    # MaxText's list (decoders.py): q, k, v, out_proj, mlpwo saved; so the attention output (context)
    # and the MLP's inputs are recomputed (mlpwo's output is never read by the backward: it costs nothing)
    device, offload, remat, names, redo = policy_split(shape, "save_dot_except_mlpwi")
    assert sorted(names) == ["context", "mlp_act", "mlpwi_0", "mlpwi_1", "norms"] and offload == 0
    assert device == 4096 + 4096 + 2 * 1024 + 4096 and redo == {"attention": 1.0, "mlpwi_0": 1.0, "mlpwi_1": 1.0}
    lay = stepmodel.Layout(local_batch=1, remat="save_dot_except_mlpwi")
    chip = _toy_chip(mxu_tile=128)
    p = stepmodel.predict(shape, lay, chip, {"matmul_efficiency": 0.5, "moe_efficiency": 0.5})
    assert math.isclose(p["compute"]["recompute"], 2 * (2 * 8192 * 4096 * 14336 * 32) / (1e12 * 0.5))


def test_planner_ranks_layouts_x_memory_policies_finds_the_published_offload_and_names_the_cheapest_fix(capsys):
    """Qwen3-235B on 256 Ironwood chips at global batch 8192 x 4096 (32 sequences a data-parallel rank),
    with a recorded activation size (no trace): remat off or on fits no layout, and --plan ranks every
    layout under every memory policy planner/shapes.py knows. The published run's layout (FSDP over
    256, the decoder layers' inputs offloaded to host, the rest recomputed) is among those that fit, and
    its row is calibrate's prediction for that run record (one model: step, HBM and host bytes alike).
    Fitting rows rank first, each group by step. At a batch no policy fits (65536), one line says so
    and names the cheapest change that fits."""
    import types
    from planner import dryrun
    from planner import calibrate, chips, report, stepmodel
    w = dryrun.lm_workload(FLAVORS["qwen3_235b_a22b"], "qwen3_235b_a22b", 4096)
    traced = {False: 40 * 2**30, True: 12 * 2**30}                  # bytes a sequence (the order of the trace)
    w = dataclasses.replace(w, saved_bytes=lambda remat: traced[remat])
    published = {"decoder_layer_input": "offload"}
    for remat in (False, True):
        assert not any(r["fits"] for r in dryrun.layouts(w, 256, 8192, "tpu_v7", (remat,), traced))
    rows = dryrun.plan(w, 256, 8192, "tpu_v7", traced)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    for group in (True, False):
        steps = [r["step_s"] for r in rows if r["fits"] == group]
        assert steps == sorted(steps)
    assert {report.remat_label(r["remat"]) for r in rows} >= {"off", "on", "full", "offload:decoder_layer_input"}
    mine = [r for r in rows if r["mesh"] == "ici=256" and r["remat"] == published]
    assert len(mine) == 1 and mine[0]["fits"], mine
    record = {"model": "qwen3_235b_a22b", "chip": "tpu_v7", "dcn": 1, "ici": 256, "global_batch": 8192,
              "seq_len": 4096, "precision": "fp32", "dp_mode": "fsdp", "remat": published, "fused_loss": True}
    want = stepmodel.predict(calibrate.run_shape(record), calibrate.run_layout(record), chips.CHIPS["tpu_v7"])
    assert want["fits"] and math.isclose(mine[0]["step_s"], want["step_s"], rel_tol=1e-9), (mine[0]["step_s"], want["step_s"])
    assert math.isclose(mine[0]["total_bytes"], want["total_bytes"], rel_tol=1e-9)
    assert math.isclose(mine[0]["host_need"], want["host_need"], rel_tol=1e-9)
    cfg = types.SimpleNamespace(chip="tpu_v7", plan=True, chips=256, batch_size=8192, mesh=None, remat=False)
    assert dryrun.main(w, cfg) == 0
    ranked = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ranked[0]["fits"] and {"mesh": "ici=256", "remat": published, "fits": True}.items() <= \
        next(r for r in ranked if r["remat"] == published and r["mesh"] == "ici=256").items()
    cfg.batch_size = 65536
    assert dryrun.main(w, cfg) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("no layout of 256 x tpu_v7 fits at global batch 65536") and "cheapest change that fits:" in lines[0]
    assert json.loads(lines[-1]) == [] and len(lines) == 2


def test_planner_cpu_anchor_arithmetic_on_recorded_measurements():
    """anchor.predict_step on the recorded CPU measurement: its elementwise term is the eager step's
    counted non-matmul bytes over the measured eager bandwidth (forward + backward of the layer's own
    blocks); its matmuls each of the step's matmul shapes (x3: forward, dX, dW) at the rate measured
    at that shape; its attention stepmodel's attention FLOPs (4 S^2 H hd forward, x3.5) at the rate
    measured on the step's own SDPA; no collectives; the host overhead the forward's ops x an op's
    cost through autograd. Without the measured rates it is the old law (the 1024^3 GEMM rate under
    the short-dim law with a 64-wide tile). (The live measurement, python -m planner.anchor, is in
    docs/profiling.md (the CPU anchor): too noisy on a shared machine to assert here.)"""
    from planner import anchor
    from planner import stepmodel
    from planner.chips import measured_chip
    rec = anchor.RECORDED
    assert anchor.DEFAULT_RUN["tokens"] == 128 and anchor.DEFAULT_RUN["batch_size"] == 32
    host = anchor.host_overhead(rec["forward_ops"], rec["autograd_op_s"])
    assert math.isclose(host, 357 * 9.580e-05)
    p = anchor.predict_step(rec["peak_flops"], rec["mem_bw"], anchor.DEFAULT_RUN, rec["eager_bytes"], host,
                            rec["matmul_rates"], rec["attention_rate"])
    assert math.isclose(p["compute"]["elementwise"], rec["eager_bytes"] / rec["mem_bw"])
    # by hand: llama3_debug (dim 192, 6 heads of 32, 2 kv heads, ffn 512, 4 layers, vocab 256), 32 x 128 = 4096 rows
    r = rec["matmul_rates"]
    rows, L = 4096, 4
    layer = 2 * rows * (2 * 192 * 192 / r[(rows, 192, 192)] + 2 * 192 * 64 / r[(rows, 192, 64)]
                        + 2 * 192 * 512 / r[(rows, 192, 512)] + 512 * 192 / r[(rows, 512, 192)])
    mm = 3 * (L * layer + 2 * rows * 192 * 256 / r[(rows, 192, 256)])
    assert math.isclose(p["compute"]["matmul"], mm)
    attention = 3.5 * 4 * 128**2 * 6 * 32 * L * 32 / rec["attention_rate"]
    assert math.isclose(p["compute"]["attention"], attention)
    assert p["exposed_comm_s"] == 0 and p["host_overhead_s"] == host
    assert math.isclose(p["step_s"], host + sum(p["compute"].values()))
    # the old law, without the measured rates: matmuls at the 1024^3 rate under the short-dim law
    from planner.shapes import lm_shape
    shape = lm_shape(FLAVORS["llama3_debug"], 128)
    old = anchor.predict_step(rec["peak_flops"], rec["mem_bw"], anchor.DEFAULT_RUN, rec["eager_bytes"], host)
    chip = measured_chip(rec["peak_flops"], rec["mem_bw"], float("inf"))
    law = lambda d: min(1.0, d / 256)
    mm_law = sum(3 * m.flops * 32 / (rec["peak_flops"] * law(m.k) * law(m.n)) for m in shape.matmuls)
    assert math.isclose(old["compute"]["matmul"], mm_law) and chip.mxu_tile == 64
    assert math.isclose(old["step_s"], host + sum(old["compute"].values()))
    assert isinstance(stepmodel.Layout().act_bytes, int)
    # EagerBytes, by hand: a broadcast multiply of (4, 8) by (8,) fp32 reads 128 + 32 bytes and writes
    # 128; a matmul and a view move nothing it counts; all four run with grad mode on (forward ops)
    import torch
    x, w = torch.ones(4, 8), torch.ones(8)
    counter = anchor.EagerBytes()
    with counter:
        x * w, x @ x.t(), x.view(32)
    assert counter.total == 128 + 32 + 128 and counter.ops == 4   # mul, t, mm, view: each dispatched
    assert counter.forward_ops == 4
    # a backward's ops run with grad mode off: not forward ops (its cost is in the autograd probe's)
    a, g = torch.ones(4, requires_grad=True), torch.ones(4)
    counter = anchor.EagerBytes()
    with counter:
        torch.autograd.backward(a * 2, g)
    assert counter.forward_ops == 1 and counter.ops > 1


def test_planner_workload_without_a_shape_is_its_flops_at_the_matmul_efficiency():
    """A task that hands dryrun no Shape (Workload.shape None) is planned as one matmul a layer
    carrying all its FLOPs: on one chip the step is those FLOPs at the chip's fitted matmul
    efficiency, the optimizer's and the host's terms, nothing else."""
    from planner import chips
    from planner import dryrun
    w = dryrun.Workload("custom", {"tp": 0, "experts": 0, "rest": 10**6}, {"tp": 0, "experts": 0, "rest": 10**5},
                        6e12, 1024, lambda remat: 2**20, lambda dims: None, dim=512, n_layers=10)
    r = dryrun.estimate(w, {"dcn": 1, "ici": 1, "tp": 1, "ep": 1}, 2, "tpu_v5p", False)
    chip, eff = chips.CHIPS["tpu_v5p"], chips.FITTED["tpu_v5p"]["matmul_efficiency"]
    optimizer = 10**6 * 28 / chip.hbm_bw                   # read w g m v, write w m v: fp32
    assert math.isclose(r["step_s"], 2 * 6e12 / (chip.peak_flops * eff) + optimizer + chip.host_overhead_s)
