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

Batched, with a progress bar; resumable: each finished batch is kept in OUT.partial/ with its inputs'
fingerprint (the images folder, each image file's bytes hashed, its caption and label, the FLUX directory,
the sequence length), so a stopped run continues where it stopped and re-encodes any batch whose inputs
changed since (an image replaced, another folder); the file itself is written once, atomically (a
temporary file, then rename), and OUT.partial/ removed. Bad input gets one `error:` line and exit 2,
before any encoding where it can be seen from the files' headers: an unreadable image, a size that does
not divide by 16 (or differs from the others'), a missing caption, a metadata field of the wrong type, a
directory that is not FLUX's. A failed write (a read-only folder, a full disk) is one line naming the
file, exit 5: no temporary file is left, and the finished batches stay for the same command to resume.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

import torch

import atomic
from errors import BadInput, WriteFailed, describe_write_failure, error_line
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
            if not isinstance(name, str) or not name.strip():
                raise PrepareError(f"{meta}:{n}: file_name {json.dumps(name)} is not a file name (a string)")
            text, label = e.get("text"), e.get("label")
            if not isinstance(text, str) or not text.strip():
                raise PrepareError(f"{meta}:{n}: {name} has no caption (a non-empty \"text\", got {json.dumps(text)})")
            if label is not None and not (type(label) is int and 0 <= label <= 9):  # (JSON true is no class)
                raise PrepareError(f"{meta}:{n}: label {json.dumps(label)} is not a class 0..9")
            if name in entries:
                raise PrepareError(f"{meta}:{n}: {name} is listed twice")
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
    """(H, W) shared by all images, read from their headers (upright: EXIF orientation applied, as
    load_image reads them); one line for the first that fails."""
    from PIL import Image
    size = None
    for path, _, _ in rows:
        try:
            with Image.open(path) as im:
                w, h = pipeline.upright_size(im)
        except Exception as e:  # missing, not an image, truncated header
            raise PrepareError(f"{path}: not a readable image ({type(e).__name__})") from None
        if h % multiple or w % multiple:
            raise PrepareError(f"{path}: {w}x{h} pixels; FLUX needs sides that are multiples of {multiple} "
                               f"(the VAE's {multiple // 2}x, then 2x2 packing)")
        if size and size != (h, w):
            raise PrepareError(f"{path}: {w}x{h} pixels, the others are {size[1]}x{size[0]} (one size a file)")
        size = (h, w)
    return size


def encode_batch(parts, rows, size):
    images = []
    for path, _, _ in rows:
        try:
            images.append(pipeline.load_image(path))
        except Exception as e:  # a header that opened, data that does not decode
            raise PrepareError(f"{path}: not a readable image ({type(e).__name__}: {str(e)[:80]})") from None
        if tuple(images[-1].shape[1:]) != size:  # (a PNG's EXIF orientation, read with its pixels, turned it)
            h, w = images[-1].shape[1:]
            raise PrepareError(f"{path}: {w}x{h} pixels upright (EXIF orientation), the others are {size[1]}x{size[0]}")
    txt, pooled = parts.prompts([text for _, text, _ in rows])
    return {"latents": parts.encode(torch.stack(images)).float().cpu().contiguous(),
            "txt": txt.float().cpu().contiguous(), "pooled": pooled.float().cpu().contiguous()}


def batch_fingerprints(batches, folder, flux_dir, max_sequence_length):
    """One hash per batch of everything its encodings depend on: which images (by path and bytes), their
    captions and labels, in order, and the encoders (the directory, the T5 length)."""
    settings = [os.path.abspath(folder), os.path.abspath(flux_dir), max_sequence_length]
    return [hashlib.sha256(json.dumps([settings, [[os.path.relpath(p, folder), atomic.sha256_of(p), t, lab]
                                                  for p, t, lab in batch]]).encode()).hexdigest() for batch in batches]


def _encoded_from(path, fingerprint):
    """True if the batch file `path` exists and was encoded from these inputs (its metadata says so)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, "pt") as f:
            return (f.metadata() or {}).get("inputs") == fingerprint
    except (OSError, SafetensorError):
        return False


def prepare(folder, flux_dir, out, batch_size=8, max_sequence_length=512, seed=0, progress=True):
    """Write `out`; returns the number of rows. Resumes from out + '.partial/': the batches there that were
    encoded from these very inputs are kept, any other is encoded again."""
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
    size = check_images(rows, 2 * pipeline.vae_down(flux_dir))  # (before the encoders load: T5-XXL is 9 GB)
    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    fingerprints = batch_fingerprints(batches, folder, flux_dir, max_sequence_length)
    partial = out + ".partial"
    name = lambda b: os.path.join(partial, f"batch_{b:06d}.safetensors")
    done = [b for b in range(len(batches)) if _encoded_from(name(b), fingerprints[b])]
    kept = {os.path.basename(name(b)) for b in done}
    stale = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors") and f not in kept) \
        if os.path.isdir(partial) else []
    if stale:
        sys.stderr.write(f"note: {partial}: {len(stale)} batch(es) not encoded from these inputs (e.g. {stale[0]}: "
                         f"an image, a caption or a setting changed): encoded again\n")
    try:  # (before the encoders load: a read-only folder is found at once)
        os.makedirs(partial, exist_ok=True)
    except OSError as e:
        raise pipeline.write_failed(e, partial) from None
    parts = pipeline.FluxParts(flux_dir, max_sequence_length)
    with tqdm(total=len(rows), initial=sum(len(batches[b]) for b in done), unit="img", disable=not progress,
              desc="encoding") as bar:
        for b, batch in enumerate(batches):
            if b in done:
                continue
            tensors = encode_batch(parts, batch, size)
            with pipeline.written(name(b)) as tmp:  # (a batch file is whole or absent)
                save_file(tensors, tmp, metadata={"inputs": fingerprints[b]})
            bar.update(len(batch))
    pieces = [load_file(name(b)) for b in range(len(batches))]
    t = {k: torch.cat([p[k] for p in pieces]) for k in ("latents", "txt", "pooled")}
    empty_txt, empty_pooled = parts.prompts([""])
    t["empty_txt"], t["empty_pooled"] = empty_txt[0].float().cpu(), empty_pooled[0].float().cpu()
    if rows[0][2] is not None:
        t["labels"] = torch.tensor([lab for _, _, lab in rows], dtype=torch.int64)
    with pipeline.written(out) as tmp:
        save_file({k: v.contiguous() for k, v in t.items()}, tmp, metadata={"flux_dir": os.path.abspath(flux_dir)})
    shutil.rmtree(partial)
    return len(rows)


def _drop_if_empty(partial):
    """Remove OUT.partial/ if it holds no finished batch; False if it still exists."""
    try:
        os.rmdir(partial)
    except FileNotFoundError:
        pass
    except OSError:  # (not empty)
        return False
    return True


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
        _drop_if_empty(cfg.out + ".partial")
        error_line(str(e))
        return 2
    except WriteFailed as e:
        kept = not _drop_if_empty(cfg.out + ".partial")
        error_line(f"a write failed: {describe_write_failure(e)}"
                   f"{f' (the finished batches stay in {cfg.out}.partial/: the same command resumes)' if kept else ''}")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"interrupted: the finished batches stay in {cfg.out}.partial/; the same command resumes\n")
        return 130
    print(f"{n} images -> {cfg.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
