"""flux/pipeline.py: FLUX's frozen parts around the transformer, from a diffusers FLUX directory (the
layout of black-forest-labs/FLUX.1-dev): what turns captioned pictures into the latent file the
transformer trains on (flux/latents.py), and sampled latents back into pictures.

    parts = FluxParts("FLUX.1-dev", max_sequence_length=512)
    txt_BxTxE, pooled_BxV = parts.prompts(["a photo of a cat", ""])     # T5 tokens, CLIP's pooled vector
    latents_BxCxhxw = parts.encode(images_Bx3xHxW)                      # pixels in [-1, 1] -> VAE latents
    images = parts.decode(latents_BxCxhxw)                              # -> pixels in [0, 1]

The encoders are not what this project teaches: they are diffusers' AutoencoderKL and transformers'
CLIPTextModel / T5EncoderModel, used as diffusers' FluxPipeline uses them (`encode_prompt`: CLIP padded
to its tokenizer's length, pooled; T5 padded to max_sequence_length, its last hidden state; the
latents `(z - shift_factor) * scaling_factor`, z the VAE posterior's mean; decoding the inverse, then
`(x / 2 + 0.5).clamp(0, 1)` as its image processor does; images read as diffusers' `load_image` reads
them, EXIF orientation applied). The scheduler's config gives the sampler's time shift (flux/sample.py's
`schedule`): FLUX.1-dev's dynamic one, or a static `shift` (FLUX.1-schnell's 1.0: none). A directory that
is not FLUX's (no model_index.json of a FluxPipeline, a part missing) is refused in one line
(FluxDirError, exit 2); nothing is downloaded. Files are written atomically (`written`): a failed write
(read-only folder, full disk) leaves nothing behind and is one WriteFailed naming the file (exit 5).
"""
import contextlib
import json
import logging
import os
import re

import numpy as np
import torch

import atomic
from errors import BadInput, WriteFailed

PARTS = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler", "transformer")
SHIFT_KEYS = ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")


class FluxDirError(BadInput):
    """Not a diffusers FLUX directory we can use: one line, exit 2."""


def check_dir(path, parts=PARTS):
    """Refuse (one line) a path that is not a diffusers FluxPipeline directory holding `parts`."""
    index = os.path.join(path, "model_index.json")
    try:
        with open(index) as f:
            cls = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError) as e:
        raise FluxDirError(f"{path}: not a diffusers FLUX directory (no readable model_index.json: "
                           f"{type(e).__name__})") from None
    if cls != "FluxPipeline":
        raise FluxDirError(f"{path}: model_index.json names {cls!r}, not FluxPipeline")
    missing = [p for p in parts if not os.path.isdir(os.path.join(path, p))]
    if missing:
        raise FluxDirError(f"{path}: a FLUX directory has {', '.join(parts)}; {missing[0]}/ is missing")
    return path


# FlowMatchEulerDiscreteScheduler options that change its sigmas in ways flux/sample.py does not implement
UNIMPLEMENTED_SCHEDULER = ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                           "invert_sigmas", "stochastic_sampling")


def schedule_kwargs(path):
    """flux/sample.py's schedule() arguments from the scheduler's config, as diffusers'
    FlowMatchEulerDiscreteScheduler reads it: FLUX.1-dev's dynamic exponential shift (its four constants),
    or, with use_dynamic_shifting false, the static `shift` s: t -> s t / (1 + (s - 1) t) (its default 1.0:
    none, FLUX.1-schnell's, as BFL's schnell sampler). Anything else is refused in one line."""
    file = os.path.join(path, "scheduler", "scheduler_config.json")
    try:
        with open(file) as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise FluxDirError(f"{file}: missing or unreadable ({type(e).__name__}: {e})") from None
    if cfg.get("_class_name", "FlowMatchEulerDiscreteScheduler") != "FlowMatchEulerDiscreteScheduler":
        raise FluxDirError(f"{file}: {cfg['_class_name']!r} is not FlowMatchEulerDiscreteScheduler (FLUX's)")
    used = [k for k in UNIMPLEMENTED_SCHEDULER if cfg.get(k)]
    if used or cfg.get("time_shift_type", "exponential") != "exponential":
        raise FluxDirError(f"{file}: {used[0] if used else 'time_shift_type ' + repr(cfg['time_shift_type'])} is not "
                           f"implemented (FLUX's exponential time shift, dynamic or static, only)")
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
    if not cfg.get("use_dynamic_shifting", False):
        shift = cfg.get("shift", 1.0)
        if not (number(shift) and shift > 0):
            raise FluxDirError(f"{file}: shift {shift!r} is not a positive number")
        return dict(static_shift=float(shift))
    defaults = dict(base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    kw = {k: cfg.get(k, v) if cfg.get(k) is not None else v for k, v in defaults.items()}
    bad = [k for k, v in kw.items() if not number(v)]
    if bad or kw["base_image_seq_len"] == kw["max_image_seq_len"]:
        raise FluxDirError(f"{file}: {bad[0] + ' ' + repr(kw[bad[0]]) if bad else 'base_image_seq_len = max_image_seq_len'}"
                           f" (the dynamic shift's line needs two distinct lengths and finite numbers)")
    return kw


def vae_down(path):
    """The VAE's downsampling factor, from its config (2 ** (blocks - 1): FLUX's is 8)."""
    try:
        with open(os.path.join(path, "vae", "config.json")) as f:
            return 2 ** (len(json.load(f)["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FluxDirError(f"{path}/vae: no readable config.json with block_out_channels ({type(e).__name__})") from None


def load_image(path):
    """An image file as float32 (3, H, W) in [-1, 1], turned upright by its EXIF orientation as diffusers'
    `load_image` does (PIL.ImageOps.exif_transpose), then diffusers' VaeImageProcessor: x / 255 * 2 - 1."""
    from PIL import Image, ImageOps
    with Image.open(path) as im:
        a = np.asarray(ImageOps.exif_transpose(im).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(a).permute(2, 0, 1) * 2 - 1


def upright_size(im):
    """(W, H) of an open PIL image once its EXIF orientation is applied (orientations 5..8 turn it), read
    from the header (a PNG's EXIF chunk after its pixels is not: encode_batch then refuses the turned image)."""
    w, h = im.size
    turned = (im.format != "PNG" or "exif" in im.info) and im.getexif().get(0x0112) in (5, 6, 7, 8)
    return (h, w) if turned else (w, h)


class _NoFlaxDeprecation(logging.Filter):
    """diffusers logs "Flax classes are deprecated" while it defines its Flax classes, i.e. on importing
    AutoencoderKL, before any verbosity setting can apply: it would precede our one line."""

    def filter(self, record):
        return not record.getMessage().startswith("Flax classes are deprecated")


def _quiet_diffusers():
    import diffusers  # (the top-level import is lazy: it defines no model class, logs nothing)
    for handler in logging.getLogger("diffusers").handlers:
        if not any(isinstance(f, _NoFlaxDeprecation) for f in handler.filters):
            handler.addFilter(_NoFlaxDeprecation())
    return diffusers


class FluxParts:
    """The VAE and the two text encoders of a diffusers FLUX directory, frozen, float32 (or `dtype`)."""

    def __init__(self, path, max_sequence_length=512, device="cpu", dtype=torch.float32):
        check_dir(path, PARTS[:-1])
        self.schedule = schedule_kwargs(path)  # (refused before the encoders load)
        diffusers = _quiet_diffusers()
        import transformers
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast
        for lib in (diffusers, transformers):  # (their per-load progress bars and notes would bury our one line)
            lib.utils.logging.disable_progress_bar()
            lib.utils.logging.set_verbosity_error()
        kw = dict(local_files_only=True)
        try:
            self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype, **kw).to(device).eval()
            self.clip = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", torch_dtype=dtype, **kw).to(device).eval()
            self.t5 = T5EncoderModel.from_pretrained(path, subfolder="text_encoder_2", torch_dtype=dtype, **kw).to(device).eval()
            self.tok = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
            self.tok2 = T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_2", **kw)
        except (OSError, ValueError, KeyError) as e:
            raise FluxDirError(f"{path}: its encoders do not load ({str(e).splitlines()[0][:160]})") from None
        c = self.vae.config
        self.scale, self.shift = c.scaling_factor, c.shift_factor or 0.0
        self.down = vae_down(path)  # 8 for FLUX's VAE
        self.channels, self.max_len, self.device = c.latent_channels, max_sequence_length, device

    @torch.no_grad()
    def prompts(self, texts):
        """(T5 token embeddings (B, max_len, E), CLIP's pooled vectors (B, V)) of B prompts."""
        ids = self.tok(list(texts), padding="max_length", max_length=self.tok.model_max_length, truncation=True,
                       return_tensors="pt").input_ids
        pooled = self.clip(ids.to(self.device), output_hidden_states=False).pooler_output
        ids2 = self.tok2(list(texts), padding="max_length", max_length=self.max_len, truncation=True,
                         return_tensors="pt").input_ids
        return self.t5(ids2.to(self.device), output_hidden_states=False)[0], pooled

    @torch.no_grad()
    def encode(self, images_Bx3xHxW):
        """Pixels in [-1, 1] -> the latents the transformer trains on, (B, 16, H / 8, W / 8)."""
        z = self.vae.encode(images_Bx3xHxW.to(self.device, self.vae.dtype)).latent_dist.mode()
        return (z - self.shift) * self.scale

    @torch.no_grad()
    def decode(self, latents_BxCxhxw):
        """The inverse: latents -> pixels in [0, 1], (B, 3, 8h, 8w)."""
        x = self.vae.decode(latents_BxCxhxw.to(self.device, self.vae.dtype) / self.scale + self.shift).sample
        return (x / 2 + 0.5).clamp(0, 1)


def save_rgb_grid(images_Nx3xHxW, per_row, path):
    """A PNG grid of images in [0, 1], `per_row` a row, written atomically."""
    from PIL import Image
    N, C, H, W = images_Nx3xHxW.shape
    rows = -(-N // per_row)
    grid = torch.ones(rows * per_row, C, H, W)
    grid[:N] = images_Nx3xHxW.float().cpu()
    grid = grid.reshape(rows, per_row, C, H, W).permute(0, 3, 1, 4, 2).reshape(rows * H, per_row * W, C)
    with written(path) as tmp:
        Image.fromarray((grid * 255).round().clamp(0, 255).to(torch.uint8).numpy()).save(tmp, format="PNG")
    return path


def write_failed(e, path):
    """WriteFailed naming `path` for a failed write: an OSError, or safetensors' SafetensorError (its Rust
    writer's io::Error in words: 'Error while serializing: I/O error: File too large (os error 27)')."""
    why = getattr(e, "strerror", None) or re.sub(r"^.*I/O error: ", "", str(e).splitlines()[0])[:160]
    return WriteFailed(f"{why}: {path}")


@contextlib.contextmanager
def written(path):
    """`with written(path) as tmp:` atomic.written, its failed write (OSError, SafetensorError) one
    WriteFailed naming `path`."""
    from safetensors import SafetensorError
    try:
        with atomic.written(path) as tmp:
            yield tmp
    except (OSError, SafetensorError) as e:
        if isinstance(e, WriteFailed):
            raise
        raise write_failed(e, path) from None
