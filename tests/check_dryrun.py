# dryrun.py. Oracle: a real run's allocation
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import json
import math

import pytest

from model import FLAVORS, flops_per_token

from tests.common import TINY, _trainer, run_train
from tests.check_flux import FLUX_DEV_CONFIG


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


def test_plan_ranks_every_layout_of_the_chips_fast_and_refuses_impossible_ones():
    """--plan for the largest MoE flavor: under 2 minutes; every row a layout of exactly N chips that
    the model allows (ep divides the experts and the data-parallel ranks, no tp on MoE blocks);
    fitting layouts first, each group ordered by step time; the row for a layout equals that
    layout's own dry run; an impossible request is one line, exit 2."""
    import time
    t0 = time.time()
    flags = ["--dry-run", "--flavor", "qwen3_235b_a22b", "--batch-size", "256", "--seq-len", "4096"]
    rc, out, err = run_train([*flags, "--plan", "--chips", "256"], timeout=120)
    assert rc == 0 and time.time() - t0 < 120, err[-2000:]
    rows = json.loads(out.strip().splitlines()[-1])
    dims = [{k: int(v) for k, v in (p.split("=") for p in r["mesh"].split(","))} for r in rows]
    assert all(d.get("dcn", 1) * d["ici"] * d.get("tp", 1) == 256 and d.get("tp", 1) == 1 for d in dims)
    assert all(128 % d.get("ep", 1) == 0 and (d.get("dcn", 1) * d["ici"]) % d.get("ep", 1) == 0 for d in dims)
    assert any(d.get("ep", 1) > 1 for d in dims) and len({r["mesh"] for r in rows}) == len(rows) // 2
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits)
    for group in (True, False):
        steps = [r["step_s"] for r in rows if r["fits"] == group]
        assert steps == sorted(steps)
    # Every row equals its layout's own dry run (in this process; the activation bytes a sequence,
    # the one traced figure, traced once per remat setting as a single dry run does)
    import dryrun
    import mesh as mesh_lib
    import model
    import train
    args = train.model_args(train.parse_config(flags))
    per_sequence = {r: dryrun.saved_bytes_per_sequence(model.tpu_config(args), 4096, r) for r in (False, True)}
    assert any(r["remat"] for r in rows) and not all(r["remat"] for r in rows)
    for row in rows:
        own = dryrun.dry_run(args, "qwen3_235b_a22b", mesh_lib.mesh_dims(row["mesh"]), 256, 4096, "tpu_v5p",
                             row["remat"], per_sequence[row["remat"]])
        assert {k: own[k] for k in row} == row, (row, {k: own[k] for k in row})
    rc, out, err = run_train([*flags, "--plan", "--chips", "3"], timeout=120)
    assert rc == 2 and err.strip().startswith("error:") and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flavor,mesh", [("llama3_405b", "dcn=2,ici=128"), ("qwen3_235b_a22b", "dcn=2,ici=128")])
def test_dry_run_of_the_largest_flavors_is_fast_and_says_whether_it_fits(flavor, mesh):
    import time
    t0 = time.time()
    rc, out, err = run_train(["--dry-run", "--flavor", flavor, "--mesh", mesh, "--batch-size", "256",
                              "--seq-len", "4096", "--remat"], timeout=120)
    assert rc == 0, err[-2000:]
    assert time.time() - t0 < 120
    report = json.loads(out.strip().splitlines()[-1])
    import dryrun
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
    FLOPs per device are flux.py's formula (checked against FlopCounterMode and the published sizes in
    the FLUX section) for 4096 image + 512 text tokens, times the local batch; parameter, gradient and
    AdamW bytes per device are the published 11,901,408,320 parameters x 4 / 4 / 8 bytes over 8 chips;
    the gathered unit is one double block, counted here from the published config. --plan offers
    data-parallel layouts only (dcn x ici = 8, no tp / ep), its row for ici=8 equals the dry run.
    An image size the VAE (8x) and 2 x 2 packing cannot divide is one error line, exit 2."""
    import dryrun
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
    assert len(rows) == 8 and next(r for r in rows if r["mesh"] == "ici=8" and not r["remat"]) == report
    for size in ("1000", "8"):  # (8: a FLUX VAE latent of 1 x 1 cannot be packed 2 x 2)
        assert train.main([*flags, "--image-size", size]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --image-size {size} is not a positive multiple of 16") and "\n" not in err, err
