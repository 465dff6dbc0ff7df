"""flux/latents.py: the data real FLUX training at scale reads: VAE latents and text-encoder outputs
computed once, ahead of training, and stored in a file (MLPerf Training's Flux.1 reference, built on
torchtitan's flux, caches the autoencoder's latents and the T5 / CLIP outputs the same way, so the
step runs the transformer alone). `python -m flux.prepare` writes it from captioned images (flux/prepare.py).

    python train.py --task flux --data cache.safetensors [--init-from FLUX_DIR]

The file (safetensors; one row per training sample):
    latents       float (N, C, H, W)   the autoencoder's latents (FLUX.1: C = 16, H = W = side / 8); packed
                                       2x2 into tokens of 4C channels, so 4C = the model's in_channels
                                       and H, W are even
    txt           float (N, T, E)      the T5 token embeddings; E = the model's context_in_dim
    pooled        float (N, V)         the pooled CLIP vector; V = the model's vec_in_dim
  optional:
    labels        int   (N,)           each sample's class, 0..9: the evaluation grid's rows (one per class,
                                       prompted by the first held-out sample of that class)
    empty_txt     float (T, E)         the encoders' outputs for the empty prompt; with them, a share of the
    empty_pooled  float (V,)           prompts can be dropped for classifier-free guidance (--prompt-dropout;
                                       then the grid is guided) and validation is unconditional (the flow itself)
Split: the last tenth of the rows (at least one) is held out for validation, the rest is trained on
(write the file shuffled). Anything else is refused in one line (DataError, exit 2): a missing or
unreadable file, a missing or unknown tensor, a shape the model cannot take, a label out of range,
values that are not finite.
"""
import hashlib
import math
import os

import torch

from data import DataError

N_CLASSES = 10
HELD_OUT = 0.1
REQUIRED = ("latents", "txt", "pooled")
OPTIONAL = ("labels", "empty_txt", "empty_pooled")


class LatentFile:
    """The checked tensors of one file, split: `train` / `held` are dicts of row-aligned tensors
    (latents, txt, pooled[, labels]); `cond_keys` name the model's conditioning among them; `empty`
    is the empty prompt's (txt_1xTxE, pooled_1xV), or None."""
    cond_keys = ("txt", "pooled")

    def __init__(self, path, args):
        self.path = path
        t = _read(path)
        self._check(t, args)
        n_held = max(1, math.ceil(HELD_OUT * len(t["latents"])))
        rows = {k: t[k] for k in ("latents", "txt", "pooled", "labels") if k in t}
        self.train = {k: v[:-n_held] for k, v in rows.items()}
        self.held = {k: v[-n_held:] for k, v in rows.items()}
        self.empty = (t["empty_txt"][None], t["empty_pooled"][None]) if "empty_txt" in t else None
        self.hw = tuple(t["latents"].shape[2:])
        # What a resume must read again: the tensors' contents (a content hash, as the LM's corpus), not
        # only their shapes (another file of the same shapes would be trained on without a word).
        h = hashlib.blake2b(digest_size=8)
        for k, v in sorted(t.items()):
            h.update(f"{k} {tuple(v.shape)} {v.dtype};".encode())
            h.update(v.contiguous().numpy().tobytes())
        self.fingerprint = f"{h.hexdigest()} ({', '.join(f'{k} {tuple(v.shape)}' for k, v in sorted(t.items()))})"

    def _fail(self, message):
        raise DataError(f"--data {self.path}: {message}")

    def _check(self, t, a):
        missing = [k for k in REQUIRED if k not in t]
        unknown = sorted(set(t) - set(REQUIRED) - set(OPTIONAL))
        if missing or unknown:
            self._fail(f"{'no tensor ' + repr(missing[0]) if missing else 'unknown tensor ' + repr(unknown[0])} "
                       f"(the file holds latents, txt, pooled; optionally labels, empty_txt, empty_pooled)")
        x, txt, raw = t["latents"], t["txt"], dict(t)
        if x.dim() != 4 or 4 * x.shape[1] != a.in_channels or x.shape[2] % 2 or x.shape[3] % 2 or min(x.shape[2:]) < 2:
            self._fail(f"latents has shape {tuple(x.shape)}; the model takes (N, C, H, W) with 4 C = its in_channels "
                       f"{a.in_channels} (2x2 packing) and H, W even")
        n = len(x)
        if n < 2:
            self._fail(f"{n} sample(s): at least 2 are needed (one to train on, one held out)")
        for name, want in (("txt", (n, txt.shape[1] if txt.dim() == 3 else -1, a.context_in_dim)),
                           ("pooled", (n, a.vec_in_dim))):
            if tuple(t[name].shape) != want or (name == "txt" and want[1] < 1):
                self._fail(f"{name} has shape {tuple(t[name].shape)}, the model and {n} latents need "
                           f"{'(%d, T, %d)' % (n, a.context_in_dim) if name == 'txt' else want}")
        if "labels" in t:
            lab = t["labels"]
            integer = lab.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
            if not integer or tuple(lab.shape) != (n,):
                self._fail(f"labels must be integers of shape ({n},), got {lab.dtype} {tuple(lab.shape)}")
            if len(lab) and (lab.min() < 0 or lab.max() >= N_CLASSES):
                self._fail(f"labels must be classes 0..{N_CLASSES - 1} (a grid row each), got "
                           f"{int(lab.min() if lab.min() < 0 else lab.max())}")
        if ("empty_txt" in t) != ("empty_pooled" in t):
            self._fail("empty_txt and empty_pooled come together (the empty prompt's two encoder outputs)")
        if "empty_txt" in t and (tuple(t["empty_txt"].shape) != tuple(txt.shape[1:])
                                 or tuple(t["empty_pooled"].shape) != (a.vec_in_dim,)):
            self._fail(f"empty_txt / empty_pooled have shapes {tuple(t['empty_txt'].shape)} / "
                       f"{tuple(t['empty_pooled'].shape)}, want {tuple(txt.shape[1:])} / ({a.vec_in_dim},)")
        for k, v in t.items():
            if k != "labels" and not v.dtype.is_floating_point:
                self._fail(f"{k} must hold finite floating-point values ({v.dtype})")
        for k in t:  # float32 from here on (bf16 / fp16 caches are common)
            t[k] = t[k].long() if k == "labels" else t[k].float()
        for k, v in t.items():  # after the cast: a float64 1e300 is finite, its float32 is inf
            if k != "labels" and not torch.isfinite(v).all():
                self._fail(f"{k} must hold finite floating-point values (non-finite{' in float32' if torch.isfinite(raw[k]).all() else ''})")


def _read(path):
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise DataError(f"--data {path}: no such file (a .safetensors file of latents and text embeddings)")
    try:
        return dict(load_file(path))
    except Exception as e:  # truncated, not safetensors, unreadable
        raise DataError(f"--data {path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None
