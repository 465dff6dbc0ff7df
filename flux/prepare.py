"""flux/prepare.py: captioned images -> the latent file FLUX trains on (flux/latents.py's schema), through a
diffusers FLUX directory's own VAE and text encoders (flux/pipeline.py). The preprocessing torchtitan's
flux recipe and MLPerf's Flux.1 reference run ahead of training, so that a step runs the transformer alone.

    python -m flux.prepare IMAGES_DIR FLUX_DIR cache.safetensors [--batch-size 8] [--max-sequence-length 512]
    python train.py --task flux --data cache.safetensors --init-from FLUX_DIR/transformer

IMAGES_DIR holds the images and a `metadata.jsonl` (Hugging Face's ImageFolder layout): one JSON object a
line, {"file_name": "0001.png", "text": "a caption"}, optionally "label" (a class 0..9: the training
grids' rows). Every image gets a caption; all share one size, its sides multiples of 16 (the VAE's 8x,
then FLUX's 2x2 packing). Rows are written in a seeded shuffled order (latents.py holds out the last
tenth), with the empty prompt's encodings (`empty_txt`, `empty_pooled`: classifier-free guidance).

Batched, with a progress bar; resumable: each finished batch is kept in OUT.partial/ (with the inputs'
fingerprint), so a stopped run continues where it stopped; the file itself is written once, atomically
(a temporary file, then rename), and OUT.partial/ removed. Bad input gets one `error:` line and exit 2,
before any encoding where it can be seen from the files' headers: an unreadable image, a size that does
not divide by 16 (or differs from the others'), a missing caption, a directory that is not FLUX's.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

import torch

from errors import BadInput
from flux import pipeline

META = "metadata.jsonl"
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class PrepareError(BadInput):
    """Input prepare cannot encode: one line, exit 2."""


def read_captions(folder):
    """[(image path, caption, label or None)] from folder/metadata.jsonl, sorted by file name; every image
    file of the folder captioned, every entry a file that opens with sides that are multiples of 16."""
    meta = os.path.join(folder, META)
    if not os.path.isfile(meta):
        raise PrepareError(f"{folder}: no {META} (one line per image: {{\"file_name\": ..., \"text\": ...}})")
    entries = {}
    with open(meta) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                name = e["file_name"]
            except (ValueError, KeyError, TypeError):
                raise PrepareError(f"{meta}:{n}: not a JSON object with a file_name") from None
            text, label = e.get("text"), e.get("label")
            if not isinstance(text, str) or not text.strip():
                raise PrepareError(f"{meta}:{n}: {name} has no caption (a non-empty \"text\")")
            if label is not None and not (isinstance(label, int) and 0 <= label <= 9):
                raise PrepareError(f"{meta}:{n}: label {label!r} is not a class 0..9")
            entries[name] = (os.path.join(folder, name), text, label)
    uncaptioned = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_EXTS) and n not in entries)
    if uncaptioned:
        raise PrepareError(f"{os.path.join(folder, uncaptioned[0])}: no caption in {META}")
    if not entries:
        raise PrepareError(f"{meta}: no images listed")
    if len({e[2] is None for e in entries.values()}) > 1:
        raise PrepareError(f"{meta}: some entries have a label and some not (all or none)")
    return [entries[k] for k in sorted(entries)]


def check_images(rows, multiple):
    """(H, W) shared by all images, read from their headers; one line for the first that fails."""
    from PIL import Image
    size = None
    for path, _, _ in rows:
        try:
            with Image.open(path) as im:
                w, h = im.size
        except Exception as e:  # missing, not an image, truncated header
            raise PrepareError(f"{path}: not a readable image ({type(e).__name__})") from None
        if h % multiple or w % multiple:
            raise PrepareError(f"{path}: {w}x{h} pixels; FLUX needs sides that are multiples of {multiple} "
                               f"(the VAE's {multiple // 2}x, then 2x2 packing)")
        if size and size != (h, w):
            raise PrepareError(f"{path}: {w}x{h} pixels, the others are {size[1]}x{size[0]} (one size a file)")
        size = (h, w)
    return size


def encode_batch(parts, rows):
    images = []
    for path, _, _ in rows:
        try:
            images.append(pipeline.load_image(path))
        except Exception as e:  # a header that opened, data that does not decode
            raise PrepareError(f"{path}: not a readable image ({type(e).__name__}: {str(e)[:80]})") from None
    txt, pooled = parts.prompts([text for _, text, _ in rows])
    return {"latents": parts.encode(torch.stack(images)).float().cpu().contiguous(),
            "txt": txt.float().cpu().contiguous(), "pooled": pooled.float().cpu().contiguous()}


def prepare(folder, flux_dir, out, batch_size=8, max_sequence_length=512, seed=0, progress=True):
    """Write `out`; returns the number of rows. Resumes from out + '.partial/' if it holds these inputs."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm
    if os.path.exists(out):
        raise PrepareError(f"{out}: exists (not overwritten)")
    if batch_size < 1 or max_sequence_length < 1:
        raise PrepareError(f"--batch-size and --max-sequence-length must be >= 1")
    pipeline.check_dir(flux_dir, pipeline.PARTS[:-1])
    rows = read_captions(folder)
    g = torch.Generator().manual_seed(seed)
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    check_images(rows, 2 * pipeline.vae_down(flux_dir))  # (before the encoders load: T5-XXL is 9 GB)
    parts = pipeline.FluxParts(flux_dir, max_sequence_length)
    fingerprint = hashlib.sha256(json.dumps([[os.path.basename(p), t, lab] for p, t, lab in rows] + [
        os.path.abspath(flux_dir), max_sequence_length, batch_size]).encode()).hexdigest()
    partial = out + ".partial"
    manifest = os.path.join(partial, "inputs.json")
    if os.path.isdir(partial):
        try:
            with open(manifest) as f:
                same = json.load(f)["fingerprint"] == fingerprint
        except (OSError, ValueError, KeyError):
            same = False
        if not same:
            sys.stderr.write(f"note: {partial} holds another run's batches: starting over\n")
            shutil.rmtree(partial)
    os.makedirs(partial, exist_ok=True)
    with open(manifest + ".tmp", "w") as f:
        json.dump({"fingerprint": fingerprint}, f)
    os.replace(manifest + ".tmp", manifest)
    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    name = lambda b: os.path.join(partial, f"batch_{b:06d}.safetensors")
    done = [b for b in range(len(batches)) if os.path.exists(name(b))]
    with tqdm(total=len(rows), initial=sum(len(batches[b]) for b in done), unit="img", disable=not progress,
              desc="encoding") as bar:
        for b, batch in enumerate(batches):
            if b in done:
                continue
            save_file(encode_batch(parts, batch), name(b) + ".tmp")
            os.replace(name(b) + ".tmp", name(b))  # (a batch file is whole or absent)
            bar.update(len(batch))
    pieces = [load_file(name(b)) for b in range(len(batches))]
    t = {k: torch.cat([p[k] for p in pieces]) for k in ("latents", "txt", "pooled")}
    empty_txt, empty_pooled = parts.prompts([""])
    t["empty_txt"], t["empty_pooled"] = empty_txt[0].float().cpu(), empty_pooled[0].float().cpu()
    if rows[0][2] is not None:
        t["labels"] = torch.tensor([lab for _, _, lab in rows], dtype=torch.int64)
    save_file({k: v.contiguous() for k, v in t.items()}, out + ".tmp", metadata={"flux_dir": os.path.abspath(flux_dir)})
    os.replace(out + ".tmp", out)
    shutil.rmtree(partial)
    return len(rows)


def main(argv=None):
    """python -m flux.prepare IMAGES_DIR FLUX_DIR OUT.safetensors: captioned images -> a FLUX latent file."""
    p = argparse.ArgumentParser(description=main.__doc__.split(":", 1)[1].strip())
    p.add_argument("images", help=f"a folder of images and their {META}")
    p.add_argument("flux_dir", help="a diffusers FLUX directory (vae/, text_encoder/, tokenizer/, text_encoder_2/, ...)")
    p.add_argument("out", help="the .safetensors file to write (train.py --task flux --data OUT)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-sequence-length", type=int, default=512, help="T5 tokens (FLUX.1-dev 512, schnell 256)")
    p.add_argument("--seed", type=int, default=0, help="the rows' shuffled order")
    cfg = p.parse_args(argv)
    try:
        n = prepare(cfg.images, cfg.flux_dir, cfg.out, cfg.batch_size, cfg.max_sequence_length, cfg.seed)
    except BadInput as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted: the finished batches stay in {cfg.out}.partial/; the same command resumes\n")
        return 130
    print(f"{n} images -> {cfg.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
