# flux/prepare.py, flux/pipeline.py, the decode / prompt paths of flux/sample.py and `python -m flux.hf
# export`, on a tiny FLUX pipeline built offline (flux/tiny.py). Oracle: diffusers' FluxPipeline loaded
# from the same directory (its encode_prompt, its VAE with its image processor, its text-to-image call),
# and a prepare run that was never stopped (resume)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import contextlib
import glob
import json
import os
import resource
import shutil

import numpy as np
import pytest
import torch

from tests.common import _main

CAPTIONS = ["digit 0", "a seven", "zero one", "two", "cat", "dog 9", "xyz", "big 8", "q", "r 2", "ok 5", "no 4"]


def _images(folder, n=len(CAPTIONS), size=(32, 48), seed=0):
    """n random RGB PNGs (H x W = size) with distinct captions and labels, in ImageFolder's layout."""
    from PIL import Image
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(os.path.join(folder, f"{i:02d}.png"))
            f.write(json.dumps({"file_name": f"{i:02d}.png", "text": CAPTIONS[i], "label": i % 10}) + "\n")
    return str(folder)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory):
    """The tiny pipeline (built once a session), 12 captioned 32 x 48 images, and their latent file
    written by one uninterrupted prepare: {"dir", "images", "file"}."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # (nothing may be downloaded: every part is on disk)
    from flux import prepare, tiny
    root = tmp_path_factory.mktemp("tiny_flux")
    d = tiny.build(str(root / "pipe"))
    images = _images(root / "images")
    file = str(root / "cache.safetensors")
    prepare.prepare(images, d, file, batch_size=5, max_sequence_length=tiny.T5_TOKENS, progress=False)
    return {"dir": d, "images": images, "file": file}


def _pipe(path):
    from diffusers import FluxPipeline
    return FluxPipeline.from_pretrained(path, local_files_only=True)


def test_flux_prepare_rows_equal_fluxpipeline_encodings_and_a_stopped_run_resumes(tiny_flux, tmp_path, monkeypatch, capsys):
    """Every row of prepare's file is one image: its latents equal FluxPipeline's VAE on diffusers' own
    preprocessing ((mode - shift) * scale; to 1e-5: batches of 5 against one of 12, latents ~N(0, 1)),
    its txt / pooled equal FluxPipeline.encode_prompt of its caption (to 1e-6), its label its own; empty_txt / empty_pooled encode_prompt(""). A run stopped in its second
    batch keeps the first (and no file), the rerun encodes only the rest and writes the file the
    uninterrupted run wrote, bit for bit, then removes its partial batches; partial batches of other
    inputs are dropped, not mixed in."""
    from PIL import Image
    from safetensors.torch import load_file, save_file
    from flux import prepare, tiny
    pipe = _pipe(tiny_flux["dir"])
    got = load_file(tiny_flux["file"])
    assert got["latents"].shape == (12, 16, 4, 6) and got["txt"].shape == (12, tiny.T5_TOKENS, 32)
    with torch.no_grad():
        pixels = pipe.image_processor.preprocess([Image.open(os.path.join(tiny_flux["images"], f"{i:02d}.png"))
                                                  for i in range(12)])
        c = pipe.vae.config
        want_lat = (pipe.vae.encode(pixels).latent_dist.mode() - c.shift_factor) * c.scaling_factor
        want_txt, want_pooled, _ = pipe.encode_prompt(CAPTIONS + [""], prompt_2=None, max_sequence_length=tiny.T5_TOKENS)
    rows = [[r for r in range(12) if torch.allclose(got["latents"][r], want_lat[i], rtol=0, atol=1e-5)] for i in range(12)]
    assert sorted(sum(rows, [])) == list(range(12)) and all(len(r) == 1 for r in rows), rows  # a permutation
    assert [r[0] for r in rows] != list(range(12))  # (shuffled: latents.py holds out the last tenth)
    for i, (r,) in enumerate(rows):
        torch.testing.assert_close(got["txt"][r], want_txt[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(got["pooled"][r], want_pooled[i], rtol=0, atol=1e-6)
        assert got["labels"][r] == i % 10
    torch.testing.assert_close(got["empty_txt"], want_txt[12], rtol=0, atol=1e-6)
    torch.testing.assert_close(got["empty_pooled"], want_pooled[12], rtol=0, atol=1e-6)
    assert want_txt[:12].std() > 0.1 and (want_txt[0] - want_txt[1]).abs().max() > 0.1  # (prompts differ)

    out = str(tmp_path / "resumed.safetensors")
    real, calls = prepare.encode_batch, []

    def stop_in_second(parts, rows, size):
        calls.append(len(rows))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(parts, rows, size)
    monkeypatch.setattr(prepare, "encode_batch", stop_in_second)
    args = [tiny_flux["images"], tiny_flux["dir"], out, "--batch-size", "5", "--max-sequence-length", str(tiny.T5_TOKENS)]
    assert prepare.main(args) == 130  # (Ctrl-C: one line, the finished batch kept)
    assert not os.path.exists(out) and sorted(os.listdir(out + ".partial")) == ["batch_000000.safetensors"]
    calls.clear()
    monkeypatch.setattr(prepare, "encode_batch", lambda parts, rows, size: calls.append(len(rows)) or real(parts, rows, size))
    assert prepare.main(args) == 0
    assert calls == [5, 2] and not os.path.exists(out + ".partial")  # batches 1 and 2 only: 5 + 5 + 2 rows
    again = load_file(out)
    assert again.keys() == got.keys() and all(torch.equal(again[k], got[k]) for k in got)
    assert prepare.main(args) == 2  # the file exists: not overwritten
    stale = str(tmp_path / "stale.safetensors")  # batches of other inputs are never mixed in: started over
    os.makedirs(stale + ".partial")
    with open(os.path.join(stale + ".partial", "inputs.json"), "w") as f:
        json.dump({"fingerprint": "another folder's"}, f)
    save_file({"latents": torch.zeros(5, 16, 4, 6), "txt": torch.zeros(5, 12, 32), "pooled": torch.zeros(5, 24)},
              os.path.join(stale + ".partial", "batch_000000.safetensors"))
    assert prepare.main([*args[:2], stale, *args[3:]]) == 0 and "encoded again" in capsys.readouterr().err
    again = load_file(stale)
    assert all(torch.equal(again[k], got[k]) for k in got)


def _prepare_args(images, tiny_dir, out):
    from flux import tiny
    return [images, tiny_dir, out, "--batch-size", "5", "--max-sequence-length", str(tiny.T5_TOKENS)]


def test_flux_prepare_resumed_after_an_image_changed_re_encodes_its_batch(tiny_flux, tmp_path, monkeypatch, capsys):
    """A prepare stopped in its third batch, then an image of its first replaced (same name, other
    pixels): the rerun encodes the first batch again (one note line says so) and the third, keeps the
    second, and writes what a fresh run over the changed folder writes, bit for bit: never the old
    image's latents. A copy of the folder elsewhere is other inputs too (the fingerprint holds its path)."""
    from PIL import Image
    from safetensors.torch import load_file
    from flux import prepare, tiny
    images, out = str(tmp_path / "images"), str(tmp_path / "resumed.safetensors")
    shutil.copytree(tiny_flux["images"], images)
    real, calls, stop = prepare.encode_batch, [], [3]

    def record(parts, rows, *size):  # (*size: the old two-argument encode_batch too, to see this test fail there)
        calls.append([os.path.basename(p) for p, _, _ in rows])
        if len(calls) in stop:
            raise KeyboardInterrupt
        return real(parts, rows, *size)
    monkeypatch.setattr(prepare, "encode_batch", record)
    assert prepare.main(_prepare_args(images, tiny_flux["dir"], out)) == 130
    first = calls[:]
    changed = os.path.join(images, first[0][0])  # an image of the finished first batch
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(changed)
    calls.clear(), stop.clear(), capsys.readouterr()
    assert prepare.main(_prepare_args(images, tiny_flux["dir"], out)) == 0
    err = capsys.readouterr().err
    assert calls == [first[0], first[2]], calls  # the changed batch and the one never finished
    assert err.count("note:") == 1 and "1 batch(es) not encoded from these inputs" in err, err
    fresh = str(tmp_path / "fresh.safetensors")
    prepare.prepare(images, tiny_flux["dir"], fresh, batch_size=5, max_sequence_length=tiny.T5_TOKENS, progress=False)
    got, want, old = load_file(out), load_file(fresh), load_file(tiny_flux["file"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), \
        {k: (got[k] - want[k]).abs().max().item() for k in want if got[k].shape == want[k].shape}
    assert not torch.equal(want["latents"], old["latents"])  # (the replaced image's latents are new)
    rows = prepare.read_captions(images)
    copy = shutil.copytree(images, tmp_path / "copy")
    assert prepare.batch_fingerprints([rows], images, tiny_flux["dir"], 12) != \
        prepare.batch_fingerprints([prepare.read_captions(str(copy))], str(copy), tiny_flux["dir"], 12)


def _said(stderr):
    """stderr's lines without tqdm's progress bar (its updates and the line it ends)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("encoding:")]


@contextlib.contextmanager
def _file_size_limit(nbytes):
    """A full disk, as `ulimit -f`: a write past nbytes fails with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_flux_prepare_write_failures_are_one_line_exit_5_and_leave_nothing_half_written(tiny_flux, tmp_path, capsys):
    """A folder that cannot be written (its parent is a file), and a full disk (a file-size limit: the
    batch files and the file are safetensors' writes, which fail as its own SafetensorError) at the first
    batch and at the file itself: one `error:` line naming the file, exit 5, no temporary file and no empty
    OUT.partial/ left. Failed at the file, the finished batches stay: the same command then writes the
    uninterrupted run's file."""
    from safetensors.torch import load_file
    from flux import prepare
    (tmp_path / "a_file").write_text("")
    blocked = str(tmp_path / "a_file" / "x.safetensors")
    out = str(tmp_path / "out.safetensors")
    for target, limit, names in ((blocked, None, blocked + ".partial"), (out, 4096, "batch_000000.safetensors"),
                                 (out, 24 << 10, out)):  # (a batch file is ~16 KB, the file ~40 KB)
        with _file_size_limit(limit) if limit else contextlib.nullcontext():
            rc = prepare.main(_prepare_args(tiny_flux["images"], tiny_flux["dir"], target))
        err = _said(capsys.readouterr().err)
        assert rc == 5 and len(err) == 1 and err[0].startswith("error: a write failed:") and names in err[0], (rc, err)
        assert not os.path.exists(target) and not glob.glob(glob.escape(target) + ".*tmp")
    assert sorted(os.listdir(out + ".partial")) == [f"batch_00000{b}.safetensors" for b in range(3)]
    assert "the finished batches stay" in err[0]
    assert prepare.main(_prepare_args(tiny_flux["images"], tiny_flux["dir"], out)) == 0
    got, want = load_file(out), load_file(tiny_flux["file"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_flux_prepare_error_after_the_encoders_load_is_its_only_line(tiny_flux, tmp_path):
    """`python -m flux.prepare` on an image whose header reads and whose pixels do not (half a PNG): the
    error comes once diffusers' VAE and the encoders have loaded, and it is the only line on stderr
    besides the progress bar (no "Flax classes are deprecated" from diffusers' import)."""
    from flux import tiny
    from tests import launch
    images = _images(tmp_path / "images", n=4, size=(32, 32))
    with open(os.path.join(images, "02.png"), "rb") as f:
        head = f.read()
    with open(os.path.join(images, "02.png"), "wb") as f:
        f.write(head[:len(head) // 2])
    rc, _, err = launch.python(["-m", "flux.prepare", images, tiny_flux["dir"], str(tmp_path / "o.safetensors"),
                                "--max-sequence-length", str(tiny.T5_TOKENS)], env={"PJRT_DEVICE": "CPU"})
    lines = _said(err)
    assert rc == 2 and len(lines) == 1 and "02.png: not a readable image" in lines[0], err


def test_flux_images_load_upright_as_diffusers_load_image(tmp_path):
    """An image with an EXIF orientation (6: turned 90 degrees) loads as diffusers' load_image + its
    VaeImageProcessor read it (exif_transpose applied), and prepare's size check sees it upright."""
    from PIL import Image
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.utils import load_image
    from flux import pipeline, prepare
    path = str(tmp_path / "turned.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(path, exif=exif)
    want = VaeImageProcessor().preprocess(load_image(path))[0]
    got = pipeline.load_image(path)
    assert got.shape == want.shape == (3, 48, 32), (got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert prepare.check_images([(path, "x", None)], 16) == (48, 32)


def _refusal_cases(tmp_path, tiny_dir):
    """name -> (images folder, FLUX dir, what the one line says): each a copy of a good folder with one flaw."""
    cases = {}
    for name in ("unreadable", "size", "uncaptioned", "no_text", "mixed_sizes", "not_flux", "other_pipeline"):
        cases[name] = [_images(tmp_path / name, n=4, size=(32, 32)), tiny_dir]
    with open(os.path.join(cases["unreadable"][0], "01.png"), "w") as f:
        f.write("not a png")
    cases["unreadable"].append("01.png: not a readable image")
    shutil.rmtree(cases["size"][0])
    cases["size"] = [_images(tmp_path / "size", n=4, size=(32, 40)), tiny_dir, "40x32 pixels; FLUX needs sides that are multiples of 16"]
    shutil.copy(os.path.join(cases["uncaptioned"][0], "00.png"), os.path.join(cases["uncaptioned"][0], "extra.png"))
    cases["uncaptioned"].append("extra.png: no caption in metadata.jsonl")
    with open(os.path.join(cases["no_text"][0], "metadata.jsonl"), "a") as f:
        f.write(json.dumps({"file_name": "00.png", "text": " "}) + "\n")
    cases["no_text"].append("00.png has no caption")
    _images(tmp_path / "other", n=1, size=(48, 48))
    shutil.copy(tmp_path / "other" / "00.png", os.path.join(cases["mixed_sizes"][0], "02.png"))
    cases["mixed_sizes"].append("48x48 pixels, the others are 32x32")
    cases["not_flux"][1] = str(tmp_path / "other")
    cases["not_flux"].append("not a diffusers FLUX directory (no readable model_index.json")
    other = tmp_path / "sd"
    shutil.copytree(tiny_dir, other)
    (other / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    cases["other_pipeline"][1] = str(other)
    cases["other_pipeline"].append("model_index.json names 'StableDiffusionPipeline', not FluxPipeline")
    for name, entry, says in (("name_not_a_string", {"file_name": 5, "text": "x"}, "file_name 5 is not a file name"),
                              ("text_not_a_string", {"file_name": "00.png", "text": 3}, 'has no caption (a non-empty "text", got 3)'),
                              ("label_not_a_class", {"file_name": "00.png", "text": "x", "label": True}, "label true is not a class"),
                              ("listed_twice", {"file_name": "00.png", "text": "again"}, "00.png is listed twice")):
        cases[name] = [_images(tmp_path / name, n=2, size=(32, 32)), tiny_dir, says]
        with open(os.path.join(cases[name][0], "metadata.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")
    return cases


def test_flux_prepare_refuses_bad_input_in_one_line_exit_2_nothing_written(tiny_flux, tmp_path, capsys):
    """An unreadable image, a side that is not a multiple of 16, sizes that differ, an image without a
    caption or with an empty one, a metadata field of another type (a number as file_name or text, a
    bool as label), an image listed twice, a directory that is not FLUX's (no model_index.json, another
    pipeline's): one `error:` line naming the cause, exit 2, no file and no partial batches."""
    from flux import prepare
    for name, (images, flux_dir, says) in _refusal_cases(tmp_path, tiny_flux["dir"]).items():
        out = str(tmp_path / f"{name}.safetensors")
        assert prepare.main([images, flux_dir, out]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and says in err and len(err.splitlines()) == 1, (name, err)
        assert not os.path.exists(out) and not os.path.exists(out + ".partial"), name


# scheduler_config.json overrides: FLUX.1-dev's (the tiny pipeline's own), FLUX.1-schnell's, a static shift
SCHEDULERS = {"dev": {}, "schnell": {"use_dynamic_shifting": False, "shift": 1.0},
              "static_3": {"use_dynamic_shifting": False, "shift": 3.0}}


def _pipeline_copy(tiny_dir, to, scheduler="dev", without=()):
    """A copy of the tiny pipeline (but the parts `without`) whose scheduler config has SCHEDULERS[scheduler]."""
    shutil.copytree(tiny_dir, to, ignore=lambda at, names: list(without) if at == tiny_dir else [])
    config = os.path.join(to, "scheduler", "scheduler_config.json")
    with open(config) as f:
        cfg = {**json.load(f), **SCHEDULERS[scheduler]}
    with open(config, "w") as f:
        json.dump(cfg, f)
    return str(to)


@pytest.mark.parametrize("cfg_scale,scheduler", [(1.0, "dev"), (2.0, "dev"), (0.5, "schnell"), (1.0, "static_3")])
def test_flux_sampler_and_vae_decode_equal_fluxpipeline_images(tiny_flux, cfg_scale, scheduler, tmp_path, capsys):
    """flux.Flux loaded from the directory's transformer/, our Euler sampler on the scheduler config's
    time shift (FLUX.1-dev's dynamic one; FLUX.1-schnell's static shift 1, none; a static shift 3), then the
    VAE decode, give FluxPipeline's images for the same prompts, seed, steps, distilled guidance 3.5 (and
    true classifier-free guidance 2 against the empty prompt; a scale 0.5 is none, as FluxPipeline applies
    it above 1 only) to 1e-4, on a non-square 32 x 48 image; the times are diffusers' scheduler's sigmas
    (to 1e-6: float32); `python -m flux.sample --flux DIR --prompt ...`'s PNG is the image too (to 1/255),
    with its defaults for the guidance (1: off) and the distilled guidance (3.5) where they are these; its
    --out into a folder that cannot be written is one line, exit 5."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from flux import hf as flux_hf, pipeline, sample as flux_sample, tiny
    d = _pipeline_copy(tiny_flux["dir"], tmp_path / "pipe", scheduler) if scheduler != "dev" else tiny_flux["dir"]
    pipe = _pipe(d)
    prompts = ["digit 3", "a seven"]
    extra = dict(true_cfg_scale=cfg_scale, negative_prompt=[""] * 2) if cfg_scale != 1 else {}
    with torch.no_grad():
        want = pipe(prompts, height=32, width=48, num_inference_steps=3, guidance_scale=3.5, output_type="pt",
                    generator=torch.Generator().manual_seed(5), max_sequence_length=tiny.T5_TOKENS, **extra).images
    parts = pipeline.FluxParts(d, tiny.T5_TOKENS)
    theirs, c = FlowMatchEulerDiscreteScheduler.from_pretrained(d, subfolder="scheduler"), pipe.scheduler.config
    for steps, tokens in ((3, 6), (10, 4096)):  # (FluxPipeline's sigmas and mu, as its __call__ makes them)
        theirs.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=calculate_shift(
            tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift))
        assert flux_sample.schedule(steps, tokens, **parts.schedule) == pytest.approx(theirs.sigmas.tolist(), abs=1e-6)
    got = flux_sample.text_to_image(flux_hf.load(os.path.join(d, "transformer")), parts, prompts, (32, 48), steps=3,
                                    seed=5, cfg_scale=cfg_scale, guidance=3.5)
    assert got.shape == want.shape == (2, 3, 32, 48) and want.std() > 0.05
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    off = flux_sample.text_to_image(flux_hf.load(os.path.join(d, "transformer")), parts, prompts, (32, 48), steps=3,
                                    seed=5, cfg_scale=cfg_scale, guidance=1.0)
    assert (off - want).abs().max() > 1e-3  # (the comparison sees the distilled guidance)
    from PIL import Image
    # the CLI, without a run: the directory's own transformer samples
    png = os.path.join(str(tmp_path), "prompts.png")
    scale = ["--guidance", f"{cfg_scale:g}"] if cfg_scale != 1 else []  # (1: the default)
    assert flux_sample.main(["--flux", d, "--prompt", prompts[0], "--prompt", prompts[1], "--size", "32x48", "--steps", "3",
                             "--seed", "5", *scale, "--per-class", "1", "--max-sequence-length", str(tiny.T5_TOKENS),
                             "--out", png]) == 0
    grid = torch.from_numpy(np.array(Image.open(png))).permute(2, 0, 1).int()  # a row per prompt: one above the other
    assert (grid - (torch.cat(list(want), dim=1) * 255).round().int()).abs().max() <= 1
    if scheduler == "schnell":  # --out where no file can be written (its folder is a file): one line, exit 5
        (tmp_path / "a_file").write_text("")
        blocked = str(tmp_path / "a_file" / "p.png")
        capsys.readouterr()  # (FluxPipeline's progress bars)
        assert flux_sample.main(["--flux", d, "--prompt", "x", "--size", "32x32", "--steps", "1", "--per-class", "1",
                                 "--max-sequence-length", str(tiny.T5_TOKENS), "--out", blocked]) == 5
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: a write failed:") and blocked in err[0], err


def test_flux_latent_run_decodes_exports_back_and_fluxpipeline_loads_it(tiny_flux, tmp_path, capsys):
    """Trained 2 steps on prepare's file from the directory's transformer (--init-from, distilled guidance
    3.5), the run: `flux.sample RUN --flux DIR --data FILE` writes decoded_g2.png, the grid of the file's
    held-out prompts sampled with the run's own distilled guidance (the default) on DIR's scheduler (here
    a static shift 3, not FLUX.1-dev's default) and decoded through the VAE: FluxPipeline's images for
    those prompt embeddings, true CFG 2 against the file's empty prompt, with the exported transformer,
    to 1/255. Into a full disk (a file-size limit) it is one line naming the PNG, exit 5, nothing left;
    another file of the same shapes is refused in one line; `flux.hf export` writes its transformer into
    a copy of the pipeline, which FluxPipeline loads: its weights are the run's (renamed, unfused), and
    its image for a prompt equals our sampler with the run's model to 1e-4."""
    from PIL import Image
    from safetensors.torch import load_file, save_file
    from run import checkpoint
    from flux import hf as flux_hf, latents, pipeline, sample as flux_sample, tiny
    d, file, run = tiny_flux["dir"], tiny_flux["file"], str(tmp_path / "run")
    assert _main(["--task", "flux", "--data", file, "--init-from", os.path.join(d, "transformer"), "--distilled-guidance",
                  "3.5", "--steps", "2", "--batch-size", "4", "--lr", "1e-2", "--eval-batches", "1", "--sample-images", "0",
                  "--out-dir", run]) == 0
    model, _ = checkpoint.load_run(run)
    assert not torch.equal(model.flux.img_in.weight, flux_hf.load(os.path.join(d, "transformer")).img_in.weight)
    back = _pipeline_copy(d, tmp_path / "pipe_trained", "static_3", without=["transformer"])
    from flux.hf import main as hf_main
    assert hf_main(["export", run, os.path.join(back, "transformer")]) == 0
    pipe = _pipe(back)
    theirs = pipe.transformer.state_dict()
    ours = flux_hf.diffusers_state_dict(model.flux)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)

    decode = [run, "--flux", back, "--data", file, "--per-class", "2", "--steps", "2", "--guidance", "2"]
    capsys.readouterr()
    with _file_size_limit(2048):
        assert flux_sample.main(decode) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: a write failed:") and "decoded_g2.png" in err[0], err
    assert not [f for f in os.listdir(run) if f.startswith("decoded")]
    assert flux_sample.main(decode) == 0
    src = latents.LatentFile(file, model.flux.args)
    (txt, pooled), _ = flux_sample.grid_prompts(src)  # (the file's held-out rows, a row per class)
    txt, pooled = txt.repeat_interleave(2, dim=0), pooled.repeat_interleave(2, dim=0)
    n = len(txt)
    with torch.no_grad():
        want = pipe(prompt_embeds=txt, pooled_prompt_embeds=pooled, negative_prompt_embeds=src.empty[0].expand(n, -1, -1),
                    negative_pooled_prompt_embeds=src.empty[1].expand(n, -1), true_cfg_scale=2.0, height=32, width=48,
                    num_inference_steps=2, guidance_scale=3.5, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images
    want = (want * 255).round().int()
    png = torch.from_numpy(np.array(Image.open(os.path.join(run, "decoded_g2.png")))).permute(2, 0, 1).int()
    assert n in (2, 4) and png.shape == (3, n // 2 * 32, 2 * 48)  # (a row per class among the 2 held-out rows)
    for i in range(n):
        r, c = divmod(i, 2)
        off = (png[:, 32 * r:32 * (r + 1), 48 * c:48 * (c + 1)] - want[i]).abs().max().item()
        assert off <= 1, (i, off)
    other = load_file(file)
    other["latents"] = other["latents"] + 1
    save_file(other, str(tmp_path / "other.safetensors"))
    capsys.readouterr()
    assert flux_sample.main([run, "--flux", d, "--data", str(tmp_path / "other.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "is not the file" in err and len(err.splitlines()) == 1, err

    with torch.no_grad():
        want = pipe(["digit 3"], height=32, width=32, num_inference_steps=2, guidance_scale=3.5, output_type="pt",
                    generator=torch.Generator().manual_seed(1), max_sequence_length=tiny.T5_TOKENS).images
    got = flux_sample.text_to_image(model.flux, pipeline.FluxParts(back, tiny.T5_TOKENS), ["digit 3"], (32, 32), steps=2,
                                    seed=1, guidance=3.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
