# flux/prepare.py, flux/pipeline.py, the decode / prompt paths of flux/sample.py and `python -m flux.hf
# export`, on a tiny FLUX pipeline built offline (flux/tiny.py). Oracle: diffusers' FluxPipeline loaded
# from the same directory (its encode_prompt, its VAE with its image processor, its text-to-image call),
# and a prepare run that was never stopped (resume)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import os
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

    def stop_in_second(parts, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(parts, rows)
    monkeypatch.setattr(prepare, "encode_batch", stop_in_second)
    args = [tiny_flux["images"], tiny_flux["dir"], out, "--batch-size", "5", "--max-sequence-length", str(tiny.T5_TOKENS)]
    assert prepare.main(args) == 130  # (Ctrl-C: one line, the finished batch kept)
    assert not os.path.exists(out) and sorted(os.listdir(out + ".partial")) == ["batch_000000.safetensors", "inputs.json"]
    calls.clear()
    monkeypatch.setattr(prepare, "encode_batch", lambda parts, rows: calls.append(len(rows)) or real(parts, rows))
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
    assert prepare.main([*args[:2], stale, *args[3:]]) == 0 and "starting over" in capsys.readouterr().err
    again = load_file(stale)
    assert all(torch.equal(again[k], got[k]) for k in got)


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
    return cases


def test_flux_prepare_refuses_bad_input_in_one_line_exit_2_nothing_written(tiny_flux, tmp_path, capsys):
    """An unreadable image, a side that is not a multiple of 16, sizes that differ, an image without a
    caption or with an empty one, a directory that is not FLUX's (no model_index.json, another
    pipeline's): one `error:` line naming the cause, exit 2, no file and no partial batches."""
    from flux import prepare
    for name, (images, flux_dir, says) in _refusal_cases(tmp_path, tiny_flux["dir"]).items():
        out = str(tmp_path / f"{name}.safetensors")
        assert prepare.main([images, flux_dir, out]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and says in err and len(err.splitlines()) == 1, (name, err)
        assert not os.path.exists(out) and not os.path.exists(out + ".partial"), name


@pytest.mark.parametrize("cfg_scale", [1.0, 2.0])
def test_flux_sampler_and_vae_decode_equal_fluxpipeline_images(tiny_flux, cfg_scale, tmp_path):
    """flux.Flux loaded from the directory's transformer/, our Euler sampler on the scheduler config's
    time shift, then the VAE decode, give FluxPipeline's images for the same prompts, seed, steps,
    distilled guidance 3.5 (and true classifier-free guidance 2 against the empty prompt) to 1e-4, on a
    non-square 32 x 48 image; so does `python -m flux.sample --flux DIR --prompt ...`'s PNG (to 1/255)."""
    from flux import hf as flux_hf, pipeline, sample as flux_sample, tiny
    pipe, d = _pipe(tiny_flux["dir"]), tiny_flux["dir"]
    prompts = ["digit 3", "a seven"]
    extra = dict(true_cfg_scale=cfg_scale, negative_prompt=[""] * 2) if cfg_scale != 1 else {}
    with torch.no_grad():
        want = pipe(prompts, height=32, width=48, num_inference_steps=3, guidance_scale=3.5, output_type="pt",
                    generator=torch.Generator().manual_seed(5), max_sequence_length=tiny.T5_TOKENS, **extra).images
    parts = pipeline.FluxParts(d, tiny.T5_TOKENS)
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
    assert flux_sample.main(["--flux", d, "--prompt", prompts[0], "--prompt", prompts[1], "--size", "32x48", "--steps", "3",
                             "--seed", "5", "--guidance", f"{cfg_scale:g}", "--distilled-guidance", "3.5", "--per-class", "1",
                             "--max-sequence-length", str(tiny.T5_TOKENS), "--out", png]) == 0
    grid = torch.from_numpy(np.array(Image.open(png))).permute(2, 0, 1).int()  # a row per prompt: one above the other
    assert (grid - (torch.cat(list(want), dim=1) * 255).round().int()).abs().max() <= 1


def test_flux_latent_run_decodes_exports_back_and_fluxpipeline_loads_it(tiny_flux, tmp_path, capsys):
    """Trained 2 steps on prepare's file from the directory's transformer (--init-from), the run:
    `flux.sample RUN --flux DIR --data FILE` writes decoded_g2.png, the grid of the file's held-out
    prompts sampled and decoded through the VAE (checked against sample_grid + FluxParts.decode here);
    another file of the same shapes is refused in one line; `flux.hf export` writes its transformer into
    a copy of the pipeline, which FluxPipeline loads: its weights are the run's (renamed, unfused), and
    its image for a prompt equals our sampler with the run's model to 1e-4."""
    from PIL import Image
    from safetensors.torch import load_file, save_file
    import checkpoint
    from flux import hf as flux_hf, latents, pipeline, sample as flux_sample, tiny
    d, file, run = tiny_flux["dir"], tiny_flux["file"], str(tmp_path / "run")
    assert _main(["--task", "flux", "--data", file, "--init-from", os.path.join(d, "transformer"), "--distilled-guidance",
                  "3.5", "--steps", "2", "--batch-size", "4", "--lr", "1e-2", "--eval-batches", "1", "--sample-images", "0",
                  "--out-dir", run]) == 0
    model, _ = checkpoint.load_run(run)
    assert not torch.equal(model.flux.img_in.weight, flux_hf.load(os.path.join(d, "transformer")).img_in.weight)
    assert flux_sample.main([run, "--flux", d, "--data", file, "--per-class", "2", "--steps", "2", "--guidance", "2",
                             "--distilled-guidance", "3.5"]) == 0
    parts = pipeline.FluxParts(d, tiny.T5_TOKENS)
    model.guidance = 3.5
    lat, _ = flux_sample.sample_grid(model, latents.LatentFile(file, model.flux.args), 0, per_class=2, steps=2, judge=False)
    want = (parts.decode(lat) * 255).round().to(torch.uint8)  # rows: the held-out prompts, 2 samples each
    png = torch.from_numpy(np.array(Image.open(os.path.join(run, "decoded_g2.png")))).permute(2, 0, 1)
    n = len(lat)  # (a row per class among the 2 held-out rows: 1 or 2 rows)
    assert n in (2, 4) and lat.shape[1:] == (16, 4, 6) and png.shape == (3, n // 2 * 32, 2 * 48)
    for i in range(n):
        r, c = divmod(i, 2)
        assert (png[:, 32 * r:32 * (r + 1), 48 * c:48 * (c + 1)].int() - want[i].int()).abs().max() <= 1, i
    other = load_file(file)
    other["latents"] = other["latents"] + 1
    save_file(other, str(tmp_path / "other.safetensors"))
    capsys.readouterr()
    assert flux_sample.main([run, "--flux", d, "--data", str(tmp_path / "other.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "is not the file" in err and len(err.splitlines()) == 1, err

    back = tmp_path / "pipe_trained"
    shutil.copytree(d, back, ignore=lambda at, names: ["transformer"] if at == d else [])
    from flux.hf import main as hf_main
    assert hf_main(["export", run, str(back / "transformer")]) == 0
    pipe = _pipe(str(back))
    theirs = pipe.transformer.state_dict()
    ours = flux_hf.diffusers_state_dict(model.flux)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    with torch.no_grad():
        want = pipe(["digit 3"], height=32, width=32, num_inference_steps=2, guidance_scale=3.5, output_type="pt",
                    generator=torch.Generator().manual_seed(1), max_sequence_length=tiny.T5_TOKENS).images
    got = flux_sample.text_to_image(model.flux, parts, ["digit 3"], (32, 32), steps=2, seed=1, guidance=3.5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
