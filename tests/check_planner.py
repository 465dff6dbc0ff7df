# planner/: the cross-validated calibration, remat policies that are never silent, one memory model
# (the dry run's is stepmodel's) with the host memory, layouts of exactly the chips asked.
# Oracles: hand computations, the published figures in calibration.json, the fit itself re-run.
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json
import math

import pytest

from model import FLAVORS

from tests.check_dryrun import _toy_chip, _toy_shape


def test_planner_calibrate_fit_leave_one_out_and_held_out_bands(capsys, tmp_path):
    """The calibration table reads calibration.json as written (published step from the figure the
    source gives, by hand here). Held-out runs never enter the fit (the fit with or without them, or
    with their published figures tripled, is chips.FITTED; a held-out run made a fit run moves it).
    Fit, leave-one-out and held-out rows are each within +-25% or name why not: the rows outside are
    exactly the ones docs/planning.md explains (a constant resting on one run; TorchTitan's assumed
    configurations). Every published layout is predicted to fit. `python -m planner.dryrun --calibrate` prints
    the three tables, one row a run in each."""
    from planner import calibrate
    from planner import chips
    from model import flops_per_token
    runs = calibrate.load()
    rows = calibrate.table(runs)
    bad = tmp_path / "bad.json"                 # a field the planner does not read is refused, not dropped
    bad.write_text(json.dumps({"runs": [dict(runs[0], sparse_matmul=False)]}))
    with pytest.raises(ValueError, match="does not model sparse_matmul"):
        calibrate.load(str(bad))
    assert [r["id"] for r in rows] == [r["id"] for r in runs] and len(runs) >= 17
    assert {r["role"] for r in runs} == {"fit", "held_out"}
    by_id = {r["id"]: r for r in rows}
    assert math.isclose(by_id["tpu_recipes_llama3.1_8b_v6e_256"]["published_s"], 1024 * 8192 / (7207.336 * 256))
    assert math.isclose(by_id["maxdiffusion_flux_dev_v5p_8"]["published_s"], 1.31)
    qwen = flops_per_token(FLAVORS["qwen3_8b"], 4096) * 4096 * 256 / (0.515 * 256 * 459e12)
    assert math.isclose(by_id["torchtitan_qwen3_8b"]["published_s"], qwen)
    fit_runs = [r for r in runs if r["role"] == "fit"]
    held = [r for r in runs if r["role"] == "held_out"]
    fitted = calibrate.fit(runs)
    assert fitted == chips.FITTED == calibrate.fit(fit_runs)
    tripled = [dict(r, published={"step_s": 3 * by_id[r["id"]]["published_s"]}) for r in held]
    assert calibrate.fit(fit_runs + tripled) == fitted
    assert calibrate.fit(runs[:0] + fit_runs + [dict(held[0], role="fit")]) != fitted   # (the check can fail)
    loo = calibrate.leave_one_out(runs)
    assert [r["id"] for r in loo] == [r["id"] for r in fit_runs]
    outside = {}
    for name, group in (("fit", [r for r in rows if r["role"] == "fit"]), ("loo", loo), ("held", [r for r in rows if r["role"] == "held_out"])):
        for r in group:
            assert r["fits"], r
            if not 0.75 <= r["ratio"] <= 1.25:
                assert r["note"], r
                outside.setdefault(name, set()).add(r["id"])
    assert outside == {"loo": {"maxtext_mixtral_8x7b_v5p_128"}, "held": {"torchtitan_qwen3_8b", "torchtitan_qwen3_235b_a22b"}}
    # a constant resting on one run says so, in the fit table and in leave-one-out (where it is the default)
    assert "rests on this run alone" in by_id["maxtext_mixtral_8x7b_v5p_128"]["note"]
    assert "the default" in next(r for r in loo if r["id"] == "maxtext_mixtral_8x7b_v5p_128")["note"]
    assert calibrate.main([]) == 0         # (a refit differing from chips.FITTED is printed beside it)
    out = capsys.readouterr().out
    assert "chips.FITTED has" not in out and all(f"  {chip}: matmul_efficiency" in out for chip in chips.FITTED)
    for header in ("fit:", "leave-one-out:", "held out:"):
        assert any(line.startswith(header) for line in out.splitlines()), header
    lines = out.splitlines()
    assert all(sum(line.startswith(run["id"] + " ") for line in lines) == (2 if run["role"] == "fit" else 1) for run in runs)


def test_planner_remat_policies_are_never_silent_and_state_dtypes_are_fields():
    """A custom policy naming a tensor the model does not have is refused in one line listing the names
    it has; MaxText's names (fused q/k/v, mlpwi, mlpwo, the MoE second names) all resolve; FLUX takes a
    policy for its double blocks and another for its single blocks (MaxDiffusion's FLUX_OPTIMIZED, by
    hand from flux_dev's widths); AdamW's first-moment dtype and vocabulary tiling change the memory
    by the bytes they should."""
    from planner import stepmodel
    from planner.shapes import POLICIES, lm_shape, policy_split
    from planner.calibrate import family_shape
    shape = lm_shape(FLAVORS["llama3_8b"], 8192)
    with pytest.raises(ValueError) as e:
        policy_split(shape, {"decoder_layer_input": "offload", "mlpwo_out": "offload"})
    msg = str(e.value)
    assert "\n" not in msg and "mlpwo_out" in msg and all(n in msg for n in ("qkv_proj", "mlpwo", "mlpwi_1", "context"))
    with pytest.raises(ValueError, match="remat policy 'nope'"):
        policy_split(shape, "nope")
    names = ["decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "kv_proj", "context",
             "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"]
    for name in names:
        policy_split(shape, {name: "offload"})                  # every MaxText name is modelled
    # qkv_proj is q, k and v together; mlpwo's output is never read by the backward: naming it costs nothing
    assert policy_split(shape, {"qkv_proj": "offload"})[1] == 4096 + 1024 + 1024   # (the layer input stays: device)
    assert policy_split(shape, {"mlpwo": "device"})[:2] == policy_split(shape, "full")[:2]
    moe = lm_shape(FLAVORS["qwen3_235b_a22b"], 4096)
    assert policy_split(moe, {"moe_mlpwi_0": "device"})[0] == policy_split(moe, {"mlpwi_0": "device"})[0]
    for name in POLICIES:
        if name != "flux_optimized":
            policy_split(shape, name)
    with pytest.raises(ValueError, match="by block kind"):
        policy_split(shape, "flux_optimized")                   # an LM has one kind of block
    flux = family_shape("flux", ["--flavor", "flux_dev", "--image-size", "1024"])
    h, Ld, Ls = 3072, 19, 38
    dev, off, _, _, redo = policy_split(flux, "flux_optimized")
    double = h + h + h + 4 * h       # every named tensor but q, k, v: layer input, context, out_proj, mlp_in
    single = h + (3 * h + 4 * h) + h  # layer input, linear1's output (q, k, v, mlp_in), attention output
    assert math.isclose(dev, (double * Ld + single * Ls) / (Ld + Ls)) and off == 0
    assert redo == {"img_qkv": Ld / 57, "txt_qkv": Ld / 57}            # only the double blocks' qkv again
    split = policy_split(flux, {"double": "full", "single": "none"})
    assert split[4]["attention"] == Ld / 57
    with pytest.raises(ValueError, match="has double, single"):
        policy_split(flux, {"double": "full"})
    # AdamW's first moment in bf16 beside fp32 weights: 6 bytes of optimizer state a parameter, not 8
    assert stepmodel.precision("fp32", "bfloat16") == stepmodel.Precision(4, 4, 6)
    assert stepmodel.precision("bf16") == stepmodel.PRECISIONS["bf16"]
    with pytest.raises(ValueError, match="mu_dtype"):
        stepmodel.precision("fp32", "int8")
    chip, toy = _toy_chip(), _toy_shape(vocab=1000)
    lay = stepmodel.Layout(local_batch=1, precision=stepmodel.precision("fp32", "bfloat16"))
    p = stepmodel.predict(toy, lay, chip)
    assert p["memory"]["optimizer state"] == 6 * 1024
    assert p["memory"]["transient peak"] == 2 * 2 * 8 * 1000              # logits + their gradient, bf16
    tiled = stepmodel.predict(toy, dataclasses.replace(lay, vocab_tiles=4), chip)
    assert tiled["memory"]["transient peak"] == max(2 * 2 * 8 * 1000 / 4, 64 * 2 * 8)


def test_plan_layouts_use_exactly_the_chips_asked_and_the_anchor_takes_help(capsys):
    """--plan --chips 7 (and 12): every ranked layout's dcn x ici x tp is the chips asked (tp=2 on 7
    chips was rounded down to 6 before); `python -m planner.anchor --help` and `python -m planner.dryrun --help`
    print their usage, exit 0 (planner/dryrun.py's was an error), and planner/dryrun.py's unknown flag is one line, exit 2."""
    from planner import dryrun
    w = dryrun.lm_workload(FLAVORS["llama3_8b"], "llama3_8b", 1024)
    w = dataclasses.replace(w, saved_bytes=lambda remat: 2**30)
    for chips in (7, 12):
        rows = dryrun.plan(w, chips, 4 * chips, "tpu_v5p")
        dims = [{k: int(v) for k, v in (p.split("=") for p in r["mesh"].split(","))} for r in rows]
        assert rows and all(d.get("dcn", 1) * d["ici"] * d.get("cp", 1) * d.get("tp", 1) == chips for d in dims), \
            [r["mesh"] for r in rows]
        assert all(r["devices"] == chips for r in rows)
    assert any("tp=2" in r["mesh"] for r in dryrun.plan(w, 12, 48, "tpu_v5p"))
    from planner import anchor
    assert anchor.main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: python -m planner.anchor")
    assert dryrun.cli(["--help"]) == 0 and capsys.readouterr().out.startswith("python -m planner.dryrun --calibrate")
    assert dryrun.cli(["--bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: expected --calibrate") and len(err.splitlines()) == 1, err


def test_dry_run_memory_is_the_step_models_and_marks_a_layout_whose_host_memory_does_not_fit():
    """One memory model: the dry run's memory terms and its verdict are stepmodel.predict's for the
    same layout (on the family's parameter groups, with the trace's activation bytes), and the host
    memory a chip's process needs (its shards at start; then the checkpoint's staging copy, the push
    bucket and the offloaded activations), by hand, against chips.py's sourced host figure: Llama 3 70B
    on 8 Ironwood chips with every named tensor offloaded fits HBM at global batch 8 and 16, and the
    host at 8 only; the report says which memory does not fit."""
    from planner import dryrun
    from planner import chips, report, shapes, stepmodel
    w = dryrun.lm_workload(FLAVORS["llama3_70b"], "llama3_70b", 8192)
    w = dataclasses.replace(w, saved_bytes=lambda remat: 2**30)
    offload = {n: "offload" for n in ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context",
                                      "out_proj", "mlpwi_0", "mlpwi_1")}
    chip = chips.CHIPS["tpu_v7"]
    assert chip.host_bytes == 960e9 / 4 and chip.host_source != "assumed"
    for batch, host_fits in ((8, True), (16, False)):
        r = dryrun.estimate(w, {"dcn": 1, "ici": 8, "tp": 1, "ep": 1}, batch, "tpu_v7", offload)
        shape = dataclasses.replace(w.shape, params=w.whole, layer_params=w.layer)
        lay = stepmodel.Layout(ici=8, local_batch=batch // 8, remat=offload)
        saved = dryrun.saved_per_sample(w, offload, {True: 2**30}) * batch // 8
        p = stepmodel.predict(shape, lay, chip, saved_bytes=saved)
        assert list(r["memory_bytes"].values()) == list(p["memory"].values()) and r["total_bytes"] == p["total_bytes"]
        assert r["step_s"] == p["step_s"] and r["fits"] == p["fits"] == (host_fits and p["total_bytes"] <= chip.hbm_bytes)
        # host, by hand: fp32 weights a shard at start; then weights + AdamW staged, beside the offload
        shard = sum(math.ceil(w.whole[g] / 8) for g in ("tp", "rest"))
        elems = shapes.policy_split(w.shape, offload)[1]
        offloaded = elems * 2 * 8192 * (batch // 8) * 80
        assert r["host_memory_bytes"] == {"shards at start": 4 * shard, "checkpoint staging": 12 * shard,
                                          "push bucket": 0, "offloaded activations": offloaded}
        assert r["host_need"] == max(4 * shard, 12 * shard + offloaded) and (r["host_need"] <= chip.host_bytes) == host_fits
        assert r["total_bytes"] <= chip.hbm_bytes
        text = report.format_report(r)
        host_line = next(l for l in text.splitlines() if "host memory a chip" in l)
        assert host_line.endswith("fits" if host_fits else "DOES NOT FIT") and "tpu7x" in host_line
        assert "GiB HBM: fits" in text
    # a chip whose host memory is not published is marked assumed in the report
    r = dryrun.estimate(w, {"dcn": 1, "ici": 8, "tp": 1, "ep": 1}, 8, "h100", offload)
    assert chips.CHIPS["h100"].host_source == "assumed" and "(ASSUMED)" in report.format_report(r)


def test_planner_models_int8_and_fp8_matmuls_over_fp32_master_weights_and_refuses_the_unknown(tmp_path):
    """A run record's `precision` int8 (MaxText's quantization on v6e) or fp8_full (Ironwood): fp32 master
    weights, gradients and AdamW as without it (memory unchanged), the matmuls at the chip's published
    peak for that precision: v6e's 1836 int8 TOPS against its 918 bf16 TFLOP/s, Ironwood's 4614 fp8
    against 2307 (cloud.google.com/tpu/docs/v6e, /tpu7x), so the matmul seconds halve; attention stays
    bf16. calibrate.load reads such records and evaluates them; a precision it does not know, or one the
    chip publishes no peak for (fp8 on v6e), is one line."""
    from planner import calibrate, chips, stepmodel
    from planner.shapes import lm_shape
    assert stepmodel.precision("fp8_full", "bfloat16") == stepmodel.Precision(4, 4, 6, "fp8")
    assert stepmodel.precision("int8") == stepmodel.Precision(4, 4, 8, "int8")
    shape = lm_shape(FLAVORS["llama3_8b"], 8192)
    for chip, name, published, bf16 in (("tpu_v6e", "int8", 1836e12, 918e12), ("tpu_v7", "fp8_full", 4614e12, 2307e12)):
        lay = stepmodel.Layout(ici=64, local_batch=2, remat="full")
        plain = stepmodel.predict(shape, lay, chips.CHIPS[chip])
        quant = stepmodel.predict(shape, dataclasses.replace(lay, precision=stepmodel.precision(name)), chips.CHIPS[chip])
        for term in ("matmul", "recompute"):
            assert math.isclose(quant["compute"][term], plain["compute"][term] * bf16 / published, rel_tol=1e-12), term
        assert quant["compute"]["attention"] == plain["compute"]["attention"] and quant["memory"] == plain["memory"]
        assert quant["step_s"] < plain["step_s"]
    runs = calibrate.load()
    v7 = next(r for r in runs if r["chip"] == "tpu_v7")
    good = tmp_path / "fp8.json"
    good.write_text(json.dumps({"runs": [dict(v7, id="fp8", precision="fp8_full")]}))
    row = calibrate.evaluate(calibrate.load(str(good))[0])
    assert row["predicted_s"] < calibrate.evaluate(v7)["predicted_s"] and row["fits"]
    for precision, says in (("fp8_full", "tpu_v6e publishes no fp8 matmul peak"), ("fp4", "precision 'fp4': choose one of")):
        bad = tmp_path / f"{precision}.json"
        v6e = next(r for r in runs if r["chip"] == "tpu_v6e")
        bad.write_text(json.dumps({"runs": [dict(v6e, precision=precision)]}))
        with pytest.raises(ValueError, match=says) as e:
            calibrate.load(str(bad))
        assert "\n" not in str(e.value)
