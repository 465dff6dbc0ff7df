# flux/task.py + flux/latents.py through the shared trainer. Oracles: the eager single process (graph
# mode, --scan, compile + Pallas, XLA:CPU, HSDP on 4 processes), the straight run (resume), the
# rectified-flow MSE written in the test, flux_hf.load and diffusers' stored outputs (--init-from)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import math
import os
import re

import pytest
import torch

from tests import launch
from tests.common import _main, assert_close, _near, _records, largest_gap, losses, ran_on, torchrun, with_gradient_rounding
from tests.check_flux import FLUX_FIXTURES, _flux_expected
from tests.check_graph import _gathers


def _flux_weights(run_dir, task=None, scan=False):
    """The final weights; a --scan run's (L, ...) stacks unstacked into the plain model's names."""
    from run import checkpoint
    from run import resume
    from flux import model as flux
    from flux import task as flux_task
    import layer_scan
    model = task.family.build(task.args) if task else flux_task.ConditionedFlux(flux.FLAVORS["flux_debug"])
    if scan:
        layer_scan.stack_layers(model, model.flux.pack_for_scan(flux_task.PROMPT_TOKENS))
    path, _ = resume.find_resumable(os.path.join(run_dir, "checkpoints"))
    state, plain = checkpoint.load(path, {"model": model.state_dict()})["model"], {}
    for name, w in state.items():
        stack = re.fullmatch(r"(flux\.(?:double|single)_blocks)\.block__(.+)", name)
        plain.update({f"{stack[1]}.{i}.{stack[2].replace('__', '.')}": w[i] for i in range(len(w))} if stack else {name: w})
    return plain


def test_flux_trains_through_the_shared_trainer_on_every_layout_alike(tmp_path, monkeypatch):
    """FLUX as a workload (flux/task.py) on the one trainer: graph mode (one traced step with AdamW),
    SimpleFSDP on 2 processes (graph mode, its passes on) and HSDP on 4 (dcn=2 x ici=2, eager) equal the
    eager single process on the same global batches: losses, pre-clip gradient norms, validation MSE at
    the fixed times, final weights. (Graph mode on 2 ranks, not 4: each rank traces the step, 20 s on 4
    ranks of 2 cores; HSDP's graph is the LM's test_graph_mode_with_simplefsdp_hsdp_is_one_graph_...)
    So does --scan (each block stack one scan over stacked weights; the weights compared unstacked).
    The SimpleFSDP passes bucket by FLUX's blocks (the Task's `blocks`): one all-gather per double /
    single block (+ one for the rest) each way, each issued before the previous one's wait.
    So do XLA SPMD (graph mode on 2 XLA:CPU devices) and one XLA device (eager), each a child process,
    to 1e-4 (XLA's kernels). So
    does --mode compile with --kernels pallas (one run: inductor-compiled blocks around the non-causal
    splash kernel; losses and norms to 1e-4). A halted run resumed equals the uninterrupted one bit for bit; the end writes a
    sample grid."""
    common = ["--task", "flux", "--steps", "4", "--batch-size", "8", "--log-interval", "1", "--eval-batches", "2",
              "--eval-interval", "2", "--ckpt-interval", "0", "--sample-images", "0", "--no-plot"]
    runs = {name: str(tmp_path / name) for name in ("eager", "graph", "simple", "fsdp", "part", "compiled", "xla", "spmd",
                                                    "scan")}
    # XLA SPMD in its own process, started first (it runs while this one trains): graph mode on 2 XLA:CPU
    # devices, GSPMD partitioning the traced step (the layout takes FLUX's blocks from the workload)
    spmd = launch.Child(["train.py", *common, "--mode", "graph", "--device", "xla", "--mesh", "ici=2", "--out-dir",
                         runs["spmd"]], env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"})
    xla = launch.Child(["train.py", *common, "--device", "xla", "--out-dir", runs["xla"]], env={"PJRT_DEVICE": "CPU"})
    assert _main([*common, "--out-dir", runs["eager"], "--sample-images", "2"]) == 0
    import kernels_splash  # the table names "kernels_splash:splash_full_attention": count that it is what runs
    splash_calls, splash = [], kernels_splash.splash_full_attention
    monkeypatch.setattr(kernels_splash, "splash_full_attention", lambda *a: splash_calls.append(1) or splash(*a))
    assert _main([*common, "--mode", "compile", "--kernels", "pallas", "--eval-batches", "0",
                  "--out-dir", runs["compiled"]]) == 0
    assert splash_calls
    for key in ("loss", "grad_norm"):
        _near(_records(runs["eager"], key), _records(runs["compiled"], key), atol=1e-4)
    assert _main([*common, "--mode", "graph", "--out-dir", runs["graph"]]) == 0
    assert _main([*common, "--scan", "--out-dir", runs["scan"]]) == 0
    rc, _, err = torchrun(4, [*common, "--mesh", "dcn=2,ici=2", "--out-dir", runs["fsdp"]])  # HSDP, eager
    assert rc == 0, err[-3000:]
    rc, _, err = torchrun(2, [*common, "--mode", "graph", "--mesh", "ici=2", "--out-dir", runs["simple"]])  # SimpleFSDP
    assert rc == 0, err[-3000:]
    assert _main([*common, "--halt-at", "2", "--out-dir", runs["part"]]) == 0
    assert _main([*common, "--resume", "--out-dir", runs["part"]]) == 0
    oracle = runs["eager"]
    for child in (spmd, xla):
        rc, _, err = child.result(timeout=600)
        assert rc == 0, err[-3000:]
    where = {"graph": ("cpu", 1), "simple": ("cpu", 2), "fsdp": ("cpu", 4), "scan": ("cpu", 1), "spmd": ("xla:0", 2),
             "xla": ("xla:0", 1)}
    for name in ("graph", "simple", "fsdp", "scan", "spmd", "xla"):
        assert ran_on(runs[name]) == where[name], name
        on_xla = name in ("spmd", "xla")
        tol = dict(rtol=1e-4, atol=1e-4) if on_xla else dict(rtol=1e-5, atol=1e-6)  # (XLA's own kernels)
        for key in ("loss", "grad_norm", "val_loss"):
            mine, ref = _records(runs[name], key), _records(oracle, key)
            assert mine.keys() == ref.keys() and len(ref) >= 3, (name, key)
            torch.testing.assert_close(torch.tensor([mine[k] for k in sorted(mine)]),
                                       torch.tensor([ref[k] for k in sorted(ref)]), **tol)
        mine = _flux_weights(runs[name], scan=name == "scan")
        assert mine.keys() == _flux_weights(oracle).keys(), name
        for k, w in _flux_weights(oracle).items():
            assert_close(mine[k], w, k, rtol=1e-4 if on_xla else 1e-5, atol=1e-5)
    graph = next(json.loads(line) for line in open(os.path.join(runs["simple"], "metrics.jsonl")) if '"graph"' in line)
    fwd, bwd, blocks = graph["collectives_by_side"]["forward"], graph["collectives_by_side"]["backward"], 2 + 2
    assert _gathers(fwd) == _gathers(bwd) == bwd["reduce_scatter_tensor"] == blocks + 1, graph["collectives_by_side"]
    assert graph["prefetched_gathers"] == blocks and graph["saved_gathered_bytes"] == 0
    assert losses(runs["part"]) == losses(oracle)
    assert all(torch.equal(a, b) for a, b in zip(_flux_weights(runs["part"]).values(), _flux_weights(oracle).values()))
    with open(os.path.join(oracle, "metrics.jsonl")) as f:
        judged = [json.loads(line) for line in f if '"samples"' in line]
    assert os.path.getsize(os.path.join(oracle, "samples.png")) > 0 and 0 <= judged[0]["accuracy"] <= 1
    assert all(os.path.getsize(os.path.join(oracle, f"samples_step_00000{i}.png")) > 0 for i in (0, 2, 4))  # per evaluation
    from flux import sample as flux_sample  # the sampling CLI on the run: a grid per scale; a run of another task refused in one line
    assert flux_sample.main([oracle, "--per-class", "1", "--guidance", "1,3"]) == 0
    assert all(os.path.getsize(os.path.join(oracle, f"samples_g{g}.png")) > 0 for g in (1, 3))
    assert flux_sample.main([oracle, "--guidance", "nan"]) == 2


def _latent_file(path, n=20, chw=(1, 4, 4), te=(3, 32), v=32, seed=0, **replace):
    """A small precomputed-latents file (flux/latents.py's schema) of random tensors; `replace` swaps or
    adds tensors (None drops one)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    t = {"latents": torch.randn(n, *chw, generator=g), "txt": torch.randn(n, *te, generator=g),
         "pooled": torch.randn(n, v, generator=g), "labels": torch.arange(n) % 3,
         "empty_txt": torch.randn(*te, generator=g), "empty_pooled": torch.randn(v, generator=g)}
    t.update(replace)
    save_file({k: v.contiguous() for k, v in t.items() if v is not None}, str(path))
    return str(path)


def _pack_by_loop(lat_NxCxHxW):
    """FLUX's 2x2 packing written out: token r * W/2 + c holds channels (ch, i, j) of patch (r, c)."""
    N, C, H, W = lat_NxCxHxW.shape
    out = torch.empty(N, (H // 2) * (W // 2), 4 * C)
    for r in range(H // 2):
        for c in range(W // 2):
            for ch in range(C):
                for i in range(2):
                    for j in range(2):
                        out[:, r * (W // 2) + c, ch * 4 + i * 2 + j] = lat_NxCxHxW[:, ch, 2 * r + i, 2 * c + j]
    return out


def test_flux_latent_file_batches_are_its_rows_loss_is_the_flow_mse_and_a_run_trains_with_grids(tmp_path):
    """--data FILE.safetensors (cached latents + T5 / CLIP outputs): a batch's rows are the file's training
    rows (packed as the loop above packs them) with their own embeddings, or the empty prompt's where
    --prompt-dropout asks (by default none, as diffusers' training scripts); the
    task's loss equals the rectified-flow MSE computed here from those tensors; validation holds out the
    last tenth, unconditional; a 2-step run trains and draws a grid per evaluation, named by step."""
    from run import cli
    from flux import task as flux_task
    path = _latent_file(tmp_path / "cache.safetensors")
    from safetensors.torch import load_file
    f = load_file(path)
    cfg = cli.parse_config(["--task", "flux", "--data", path, "--batch-size", "16", "--eval-batches", "2"])
    task = flux_task.FluxDigits(cfg)
    task.setup_data(0, 1)
    packed = _pack_by_loop(f["latents"])
    x0, eps, t, txt, y = task.batch(3)
    dropped = 0
    for b in range(16):  # each batch row is one of the 18 training rows (the last 2 of 20 are held out)
        row = [n for n in range(18) if torch.equal(packed[n], x0[b])]
        assert len(row) == 1, b
        own = torch.equal(txt[b], f["txt"][row[0]]) and torch.equal(y[b], f["pooled"][row[0]])
        empty = torch.equal(txt[b], f["empty_txt"]) and torch.equal(y[b], f["empty_pooled"])
        assert own or empty, b
        dropped += empty
    assert dropped == 0 and 0 < t.min() and t.max() < 1  # (no prompt dropout unless asked: diffusers' scripts' default)
    asked = flux_task.FluxDigits(cli.parse_config(["--task", "flux", "--data", path, "--batch-size", "16",
                                                   "--prompt-dropout", "0.5"]))
    asked.setup_data(0, 1)
    _, _, _, txt_asked, y_asked = asked.batch(3)
    gone = [torch.equal(txt_asked[b], f["empty_txt"]) and torch.equal(y_asked[b], f["empty_pooled"]) for b in range(16)]
    kept = [torch.equal(txt_asked[b], txt[b]) and torch.equal(y_asked[b], y[b]) for b in range(16)]
    assert 0 < sum(gone) < 16 and all(g or k for g, k in zip(gone, kept)), gone  # (the same rows, some dropped)
    torch.manual_seed(0)
    model = task.family.build(task.args)
    with torch.no_grad():  # (random weights everywhere: the zero-initialised last layer would predict 0 for any x_t)
        for p in model.parameters():
            p.normal_(0, 0.2)
    with torch.no_grad():  # the flow written out: x_t = (1 - t) x0 + t eps, target eps - x0, mean of squares
        tt = t[:, None, None]
        want = ((model(((1 - tt) * x0 + tt * eps), t, txt, y) - (eps - x0)) ** 2).mean()
        got, _ = task.loss(model, (x0, eps, t, txt, y))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    vx0, _, vt, vtxt, vy = task.val_batches[1]
    assert torch.equal(vx0, packed[18:]) and (vt == 0.1875).all()
    assert torch.equal(vtxt, f["empty_txt"].expand(2, -1, -1)) and torch.equal(vy, f["empty_pooled"].expand(2, -1))
    out = str(tmp_path / "run")
    assert _main(["--task", "flux", "--data", path, "--steps", "2", "--batch-size", "8", "--eval-interval", "2",
                  "--eval-batches", "1", "--log-interval", "1", "--sample-images", "1", "--out-dir", out]) == 0
    assert len(losses(out)) == 2 and all(math.isfinite(v) for v in losses(out).values())
    assert sorted(p for p in os.listdir(out) if p.startswith("samples")) == [
        "samples.png", "samples_step_000000.png", "samples_step_000002.png"]
    trained = _flux_weights(out, task)
    torch.manual_seed(0)
    init = task.family.build(task.args).state_dict()
    assert trained.keys() == init.keys() and not torch.equal(trained["flux.img_in.weight"], init["flux.img_in.weight"])
    from flux import sample as flux_sample
    assert flux_sample.main([out]) == 2  # the sampling CLI is for digits runs: refused in one line


def test_flux_init_from_a_diffusers_directory_fills_the_transformer(tmp_path):
    """--init-from (fine-tuning) on a latent file: the trainer's transformer holds the fixture's weights
    bit for bit, and its output with --distilled-guidance 3.5, through the task's own conditioning
    (image ids from the file's 8x6 latents), equals diffusers' stored output for that sample. Under
    SimpleFSDP on 2 processes (each rank loads its own shard) the first step's loss, gradient norm
    and validation MSE equal the one-process run's."""
    from flux import hf as flux_hf
    import train
    fixture = os.path.join(FLUX_FIXTURES, "guidance")
    want = _flux_expected("guidance")
    path = _latent_file(tmp_path / "cache.safetensors", n=20, chw=(2, 8, 6), te=(5, 24), v=12)
    common = ["--task", "flux", "--data", path, "--init-from", fixture, "--distilled-guidance", "3.5", "--steps", "1",
              "--batch-size", "4", "--eval-batches", "1", "--sample-images", "0", "--ckpt-interval", "0",
              "--prompt-dropout", "0.1"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    trainer = train.Trainer(train.parse_config([*common, "--out-dir", one]))
    ref = flux_hf.load(fixture)
    mine = dict(trainer.model.flux.named_parameters())
    assert mine.keys() == dict(ref.named_parameters()).keys()
    assert all(torch.equal(mine[n], p) for n, p in ref.named_parameters())
    with torch.no_grad():
        got = trainer.model(want["hidden_states"][:1], want["timestep"][:1], want["encoder_hidden_states"][:1],
                            want["pooled_projections"][:1])
    assert want["guidance"][0] == 3.5
    torch.testing.assert_close(got, want["sample"][:1], rtol=1e-4, atol=1e-4 * want["sample"].abs().max().item())
    assert trainer.meta["flavor"] == f"hf:{os.path.abspath(fixture)}" and not os.path.exists(one)
    assert trainer.run() == 0
    # FSDP2 (torch's fully_shard, one unit per FLUX block the workload names) on 2 ranks, each loading its
    # own block of the diffusers weights: the same losses, norms and final weights as one process
    rc, _, err = torchrun(2, [*common, "--mesh", "ici=2", "--dp-impl", "fsdp2", "--out-dir", two])
    assert rc == 0, err[-3000:]
    for key in ("loss", "grad_norm", "val_loss"):
        mine, ref = _records(two, key), _records(one, key)
        assert mine.keys() == ref.keys() and len(ref) >= 1, key
        torch.testing.assert_close(torch.tensor(list(mine.values())), torch.tensor(list(ref.values())), rtol=1e-5, atol=0)
    # The weights after Adam's step: within how far one process's own move when its gradients carry
    # rounding-size errors (adam_spread's measure, on this run): Adam's g / (sqrt(v) + eps) turns a
    # near-zero gradient's last bits into up to lr x (its error) / eps (measured 1.5e-6 against a fixed
    # 1e-6 + 1e-5 |w| before, at 0.92 of it on this CPU)
    moved = str(tmp_path / "moved")
    assert with_gradient_rounding(lambda: train.Trainer(train.parse_config([*common, "--out-dir", moved])).run()) == 0
    spread = largest_gap(_flux_weights(moved, trainer.task), _flux_weights(one, trainer.task))
    print(f"adam spread {spread:.3g}")
    for k, w in _flux_weights(one, trainer.task).items():
        assert_close(_flux_weights(two, trainer.task)[k], w, k, rtol=0, atol=spread)


def _flux_bad_inputs(tmp_path):
    """(argv, message) per bad input of the flux task; the files they name are written here."""
    import shutil
    lat = lambda name, **kw: _latent_file(tmp_path / f"{name}.safetensors", **kw)
    patch2 = tmp_path / "patch2"
    shutil.copytree(os.path.join(FLUX_FIXTURES, "guidance"), patch2)
    c = json.loads((patch2 / "config.json").read_text())
    (patch2 / "config.json").write_text(json.dumps({**c, "patch_size": 2}))
    return {
        "image_shape": (["--data", lat("shape", chw=(2, 4, 4))], "latents has shape (20, 2, 4, 4)"),
        "odd_side": (["--data", lat("odd", chw=(1, 5, 4))], "H, W even"),
        "label_range": (["--data", lat("label", labels=torch.tensor([0] * 19 + [12]))], "labels must be classes 0..9 (a grid row each), got 12"),
        "txt_width": (["--data", lat("width", te=(3, 16))], "txt has shape (20, 3, 16)"),
        "no_txt": (["--data", lat("notxt", txt=None)], "no tensor 'txt'"),
        "nan": (["--data", lat("nan", pooled=torch.full((20, 32), float("nan")))], "finite"),
        "guidance": (["--distilled-guidance", "3.5"], "has no guidance embedding"),
        "diffusers_config": (["--init-from", str(patch2)], "patch_size=2 is not implemented"),
        "out_channels": (["--init-from", os.path.join(FLUX_FIXTURES, "plain"), "--data", lat("plain", chw=(2, 4, 4),
                          te=(3, 24), v=12)], "predicts 4 channels a token from 8"),
        "missing_file": (["--data", str(tmp_path / "nowhere.safetensors")], "no such file"),
        "not_safetensors": (["--data", str(patch2 / "config.json")], "not a readable safetensors file"),
    }


@pytest.mark.parametrize("case", ["image_shape", "odd_side", "label_range", "txt_width", "no_txt", "nan", "guidance",
                                  "diffusers_config", "out_channels", "missing_file", "not_safetensors"])
def test_flux_bad_input_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    args, message = _flux_bad_inputs(tmp_path)[case]
    out_dir = str(tmp_path / "run")
    rc = _main(["--task", "flux", "--steps", "1", "--batch-size", "4", "--sample-images", "0", "--out-dir", out_dir, *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out_dir)


def test_flux_init_from_nan_weights_stops_before_training_naming_them(tmp_path, capsys):
    """--init-from a diffusers directory holding a NaN: one line naming the tensor, exit 2, before a step
    is trained or anything is written (it used to log val loss nan at step 0, train a step, then exit 3)."""
    from flux import model as flux
    from flux import hf as flux_hf
    from safetensors.torch import load_file, save_file
    d = str(tmp_path / "nan_dir")
    flux_hf.save(flux.Flux(flux.FLAVORS["flux_debug"]), d)
    weights = load_file(os.path.join(d, flux_hf.WEIGHTS))
    key = "transformer_blocks.1.ff.net.2.weight"
    weights[key][0, 0] = float("nan")
    save_file(weights, os.path.join(d, flux_hf.WEIGHTS))
    out = str(tmp_path / "run")
    rc = _main(["--task", "flux", "--init-from", d, "--steps", "2", "--batch-size", "4", "--eval-batches", "1",
                "--sample-images", "0", "--out-dir", out])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and key in err and "non-finite" in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out)


def test_flux_resume_refuses_another_latent_file_of_the_same_shapes_or_a_dropped_data_in_one_line(tmp_path, capsys):
    """A latent-file run records its data's content hash (not only the shapes): resumed on another file of
    the same shapes it is refused naming `data` (--allow-change data continues, deliberately); resumed
    without --data (the digits: another conditioning, other weights) it is refused naming `data`, and
    --allow-change data is neither offered nor taken (it used to end in DCP's missing-key traceback).
    The checkpoints stay as they were."""
    from tests.common import _files
    a = _latent_file(tmp_path / "a.safetensors", seed=0)
    b = _latent_file(tmp_path / "b.safetensors", seed=1)
    out = str(tmp_path / "run")
    common = ["--task", "flux", "--steps", "4", "--batch-size", "4", "--eval-batches", "1", "--eval-interval", "0",
              "--sample-images", "0", "--ckpt-interval", "2", "--log-interval", "1", "--out-dir", out]
    assert _main([*common, "--data", a, "--halt-at", "2"]) == 0
    capsys.readouterr()
    before = _files(out)
    for extra, needles in ((["--data", b], ["data: saved '", "pass --allow-change data"]),
                           ([], ["data: saved '", "now None", "cannot change on a resume"]),
                           (["--allow-change", "data"], ["data: saved '", "now None", "cannot change on a resume"])):
        assert _main([*common, "--resume", *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and len(err.splitlines()) == 1 and all(n in err for n in needles), (extra, err)
        assert "--allow-change" not in err or extra == ["--data", b], err
        assert _files(out) == before
    assert _main([*common, "--resume", "--data", b, "--allow-change", "data"]) == 0
    assert sorted(losses(out)) == [1, 2, 3, 4]


def test_flux_latents_beyond_float32_are_refused_before_anything_is_written(tmp_path, capsys):
    """float64 latents holding 1e300 are finite until the float32 cast makes them inf: refused in one
    line, exit 2, nothing written (not exit 3 "loss is nan at step 1" after loss.png and metrics.jsonl)."""
    from flux import latents as flux_latents
    from flux import model as flux
    big = _latent_file(tmp_path / "big.safetensors", latents=torch.full((20, 1, 4, 4), 1e300, dtype=torch.float64))
    with pytest.raises(flux_latents.DataError, match="latents must hold finite floating-point values"):
        flux_latents.LatentFile(big, flux.FLAVORS["flux_debug"])
    out = str(tmp_path / "run")
    assert _main(["--task", "flux", "--data", big, "--steps", "2", "--batch-size", "4", "--sample-images", "0",
                  "--out-dir", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --data") and "latents must hold finite" in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out)


def test_flux_sampling_cli_samples_a_scan_run_and_a_dcp_failure_is_one_line(tmp_path, capsys):
    """`python -m flux.sample RUN_DIR` on a run trained with --scan (its blocks saved stacked) builds the
    model stacked as the run did and samples it (it used to end in DCP's CheckpointException
    traceback), unstacked into the plain blocks; its images equal the stacked model's. DCP's
    exception is a BaseException: checkpoint.load turns it into one CheckpointError line."""
    from run import checkpoint
    from flux import model as flux
    from flux import sample as flux_sample
    from flux import task as flux_task
    import layer_scan
    run = str(tmp_path / "scan")
    assert _main(["--task", "flux", "--steps", "2", "--batch-size", "8", "--eval-batches", "0",  # (no evaluation:
                  "--sample-images", "0", "--log-interval", "1", "--scan", "--out-dir", run]) == 0  # an eager scan is slow)
    assert flux_sample.main([run, "--per-class", "1", "--guidance", "2"]) == 0
    assert os.path.getsize(os.path.join(run, "samples_g2.png")) > 0
    # the oracle: the model stacked as the run built it, holding the checkpoint as DCP loads it, sampled
    # as it is (slowly: 2 Euler steps)
    stacked = flux_task.ConditionedFlux(flux.FLAVORS["flux_debug"])
    layer_scan.stack_layers(stacked, stacked.flux.pack_for_scan(flux_task.PROMPT_TOKENS))
    path, _ = checkpoint.run_checkpoint(run)
    stacked.load_state_dict(checkpoint.load(path, {"model": stacked.state_dict()})["model"])
    loaded, _ = checkpoint.load_run(run)  # (through FLUX's family: task.WORKLOADS -> FluxFamily.from_record)
    assert not any("block__" in n for n, _ in loaded.named_parameters())  # (unstacked: fast to sample)
    images = [flux_sample.sample_grid(m, flux_sample.digits.DigitsSource(0), 0, per_class=1, steps=2, judge=False)[0]
              for m in (stacked, loaded)]
    assert images[0].abs().max() > 0.1
    torch.testing.assert_close(images[1], images[0], rtol=0, atol=1e-5)
    path, _ = checkpoint.run_checkpoint(run)
    with pytest.raises(checkpoint.CheckpointError, match="could not be loaded") as e:
        checkpoint.load(path, {"model": {"flux.no_such_weight": torch.zeros(1)}})
    assert "\n" not in str(e.value)


def test_the_sampling_cli_refuses_what_it_would_ignore_in_one_line(tmp_path, capsys):
    """python -m flux.sample RUN_DIR writes a run's grids into RUN_DIR: --out and --size (--prompt's grid)
    were ignored without a word; a --guidance that is no number said only Python's "could not convert
    string to float". Each is one line naming the flag, exit 2, before the run is read, nothing written."""
    from flux import sample as flux_sample
    run = tmp_path / "run"
    run.mkdir()
    for argv, said in ((["--out", str(tmp_path / "g.png")], "--out: --prompt's grid; a run's own grids are written "
                                                            "into RUN_DIR"),
                       (["--size", "16x16"], "--size: --prompt's grid"),
                       (["--guidance", "1,x"], "--guidance '1,x': a comma list of numbers")):
        assert flux_sample.main([str(run), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: " + said), err
    assert os.listdir(tmp_path) == ["run"] and not os.listdir(run)


def test_a_flux_run_given_as_a_language_model_is_named_a_flux_run(tmp_path, capsys):
    """generate.py --run, python -m interop.hf export and --task grpo --init-from on a FLUX run: one line saying it is a
    FLUX run, not a language model (not "model_args ... unknown to this version"), exit 2, nothing
    written. The run: a checkpoint directory whose meta.json is a flux_debug run's (no weight files:
    it is refused before any is read)."""
    import dataclasses
    from flux import model as flux
    import generate
    from interop import hf
    step = tmp_path / "flux_run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    args = {k: v for k, v in dataclasses.asdict(flux.FLAVORS["flux_debug"]).items() if k != "attn_impl"}
    (step / "meta.json").write_text(json.dumps({"flavor": "flux_debug", "task": "flux", "model_args": args,
                                                "mesh": None, "train": {"data": None}, "step": 2, "files": {}}))
    run, out = str(tmp_path / "flux_run"), str(tmp_path / "out")
    for call in (lambda: generate.main(["--run", run, "a", "--device", "cpu"]),
                 lambda: hf.main(["export", run, out]),
                 lambda: _main(["--task", "grpo", "--init-from", run, "--steps", "2", "--out-dir", out])):
        assert call() == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and "is a flux run (--task flux: a FLUX diffusion model), not a language model" in err, err
        assert len(err.splitlines()) == 1 and not os.path.exists(out), err
