"""flux/sample.py: rectified flow for FLUX.1: the training target and the sampler.

Training (torchtitan's flux `preprocess_inputs`, the rectified-flow / flow-matching formulation of
Liu et al. and Lipman et al.): a straight line from data to noise,
    x_t = (1 - t) x0 + t eps,    t in [0, 1], eps ~ N(0, I)
whose velocity dx_t/dt = eps - x0 is what the model learns to predict (MSE). t is drawn uniformly,
or logit-normal (SD3's choice: sigmoid of a Gaussian, more weight on the middle of the path).

Sampling (BFL's `flux/src/flux/sampling.py`): start at pure noise (t = 1) and integrate the
predicted velocity back to t = 0 with Euler steps on a *time-shifted* schedule: t' = e^mu / (e^mu +
(1/t - 1)), with mu growing linearly with the image's token count (0.5 at 256 tokens, 1.15 at 4096),
so larger images spend more of their steps at high noise (a diffusers scheduler with a static `shift` s
instead: e^mu = s; FLUX.1-schnell's s = 1, no shift). Classifier-free guidance mixes the conditional and
unconditional velocities, u + s (c - u), for s > 1 only, as FluxPipeline's `true_cfg_scale` (s <= 1: the
conditional model alone); flux-dev instead takes its distilled guidance scale as a model input (`guidance`).

Grids: `sample_grid` samples a row per class (or prompt) of a run's model, judged on the digits by an
independent classifier (digits.py); `python -m flux.sample RUN_DIR --guidance 1,2,4` does it for a
digits run's newest checkpoint, loaded by its own family (checkpoint.load_run). Through a diffusers FLUX
directory's parts (flux/pipeline.py): `text_to_image` is FluxPipeline's call on our transformer and
sampler, and `--flux DIR` decodes a latent run's grid through its VAE or samples `--prompt`s.
"""
import math
import os

import torch
import torch.nn.functional as F

from flux import digits, pipeline
from flux import hf as flux_hf
from flux import latents as latent_files
from flux.model import KIND, image_ids, patchify, text_ids, unpatchify
from flux.pipeline import written
from flux.pipeline import FluxDirError
from run import checkpoint
from errors import BadInput, WriteFailed, describe_write_failure, error_line


# ------------------------------------------------------------------------------------------------
# Training target

def flow_pair(x0, eps, t_B):
    """The noised input x_t and the velocity target eps - x0 for per-sample times t_B."""
    t = t_B.reshape(-1, *[1] * (x0.dim() - 1)).to(x0.dtype)
    return (1 - t) * x0 + t * eps, eps - x0


def flow_loss(v_pred, x0, eps):
    """Mean squared error of the predicted velocity (float32 reduction under bf16)."""
    return F.mse_loss(v_pred.float(), (eps - x0).float())


def sample_timesteps(n, generator=None, kind="uniform", mean=0.0, std=1.0, device=None):
    """n training times in (0, 1): `uniform`, or `logit_normal` (sigmoid of N(mean, std^2))."""
    if kind == "uniform":
        return torch.rand(n, generator=generator, device=device)
    if kind == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=device))
    raise ValueError(f"timestep sampling {kind!r} is not one of uniform, logit_normal")


def validation_timesteps(n=8):
    """Fixed times (i + 0.5) / n (torchtitan's validate.py), so validation MSE compares across runs."""
    return [(i + 0.5) / n for i in range(n)]


# ------------------------------------------------------------------------------------------------
# Sampling

def time_shift(mu, t):
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1)) if 0 < t < 1 else t


def schedule(steps, image_tokens, base_shift=0.5, max_shift=1.15, shift=True, base_image_seq_len=256,
             max_image_seq_len=4096, static_shift=None):
    """steps + 1 times from 1 to 0; shifted towards 1 by mu = a line through (256, base), (4096, max), or
    by a `static_shift` s whatever the size: mu = ln s, i.e. t -> s t / (1 + (s - 1) t), diffusers'
    use_dynamic_shifting=False (the lengths and shifts are a diffusers scheduler config's: flux/pipeline.py
    reads them)."""
    ts = [1 - i / steps for i in range(steps + 1)]
    if not shift:
        return ts
    if static_shift is not None:
        mu = math.log(static_shift)
    else:
        mu = base_shift + (max_shift - base_shift) * (image_tokens - base_image_seq_len) / (max_image_seq_len - base_image_seq_len)
    return [time_shift(mu, t) for t in ts]


def euler(velocity, x_BxSxC, times, cfg_scale=1.0):
    """Integrate dx/dt = v from times[0] to times[-1]. `velocity(x, t_B, cond)` is the model with
    (cond=True) or without (cond=False) the prompt; s > 1 mixes them: u + s (c - u) (FluxPipeline's
    `do_true_cfg = true_cfg_scale > 1`)."""
    x = x_BxSxC
    B = x.shape[0]
    for t_cur, t_next in zip(times[:-1], times[1:]):
        t_B = torch.full((B,), t_cur, dtype=x.dtype, device=x.device)
        v = velocity(x, t_B, True)
        if cfg_scale > 1:
            u = velocity(x, t_B, False)
            v = u + cfg_scale * (v - u)
        x = x + (t_next - t_cur) * v
    return x


@torch.no_grad()
def sample(model, txt_BxTxE, y_BxV, shape_CxHxW, steps=20, seed=0, cfg_scale=1.0, uncond=None, guidance=None,
           shift=True, schedule_kw=None):
    """Images (B, C, H, W) for B prompts (text embeddings + pooled vectors), from seeded noise.
    `uncond` = (txt_1xTxE, y_1xV), the empty prompt, needed when cfg_scale > 1; `guidance` is
    flux-dev's distilled scale (a model with guidance_embed only); `schedule_kw` schedule()'s shifts."""
    C, H, W = shape_CxHxW
    B, dev = txt_BxTxE.shape[0], txt_BxTxE.device
    if cfg_scale > 1 and uncond is None:
        raise ValueError("classifier-free guidance (cfg_scale > 1) needs an unconditional prompt")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = patchify(torch.randn(B, C, H, W, generator=gen)).to(dev)
    img_ids, txt_ids = image_ids(B, H, W, device=dev), text_ids(B, txt_BxTxE.shape[1], device=dev)
    g_B = None if guidance is None else torch.full((B,), float(guidance), device=dev)

    def velocity(x, t_B, cond):
        txt, y = (txt_BxTxE, y_BxV) if cond else (uncond[0].expand(B, -1, -1), uncond[1].expand(B, -1))
        return model(x, img_ids, txt, txt_ids, t_B, y, g_B)

    x = euler(velocity, noise, schedule(steps, noise.shape[1], shift=shift, **(schedule_kw or {})), cfg_scale)
    return unpatchify(x, H, W)


GUIDANCE = 2.0  # the grids' classifier-free guidance scale u + s (c - u)


def grid_prompts(src):
    """The grid's rows: one per class present among the held-out rows (its first sample's prompt), or,
    without labels, the first held-out samples' prompts. -> (conditioning tuple (R, ...), classes or None)"""
    held = src.held
    if "labels" in held:
        classes = [c for c in range(digits.N_CLASSES) if (held["labels"] == c).any()]
        first = torch.tensor([int((held["labels"] == c).nonzero()[0]) for c in classes])
        return tuple(held[k][first] for k in src.cond_keys), held["labels"][first]
    n = min(len(held["latents"]), digits.N_CLASSES)
    return tuple(held[k][:n] for k in src.cond_keys), None


@torch.no_grad()
def sample_grid(model, src, seed, path=None, per_class=10, steps=20, guidance=GUIDANCE, judge=True, schedule_kw=None):
    """(images (rows * per_class, C, H, W), the judge's accuracy on them, or None); a PNG grid (a row per
    class / prompt). Classifier-free guidance where the source has an empty prompt; `schedule_kw` the
    time shift (a FLUX directory's scheduler: flux/pipeline.py), FLUX.1-dev's by default."""
    device = next(model.parameters()).device
    cond, classes = grid_prompts(src)
    cond = tuple(c.to(device).repeat_interleave(per_class, dim=0) for c in cond)
    txt, y = model.encode(*cond)
    uncond = model.encode(*(e.to(device) for e in src.empty)) if src.empty is not None else None
    images = sample(
        model.flux, txt, y, (model.flux.args.in_channels // 4, *src.hw), steps=steps, seed=seed,
        cfg_scale=guidance if uncond is not None else 1.0, uncond=uncond,
        guidance=model.guidance if model.flux.args.guidance_embed else None, schedule_kw=schedule_kw).cpu()
    accuracy = None
    if judge and classes is not None:
        clf, _ = digits.classifier(seed)
        accuracy = (digits.classify(clf, images) == classes.repeat_interleave(per_class)).float().mean().item()
    if path:
        save_grid(images, per_class, path)
    return images, accuracy


def save_grid(images_Nx1xHxW, per_row, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    N, _, H, W = images_Nx1xHxW.shape
    rows = N // per_row
    grid = images_Nx1xHxW[:, 0].clamp(-1, 1).reshape(rows, per_row, H, W).permute(0, 2, 1, 3)  # channel 0
    fig = plt.figure(figsize=(per_row * 0.5, rows * 0.5))
    plt.imshow(grid.reshape(rows * H, per_row * W).numpy(), cmap="gray_r", vmin=-1, vmax=1)
    plt.axis("off")
    try:
        with written(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def text_to_image(flux_model, parts, prompts, size_HxW, steps=20, seed=0, cfg_scale=1.0, guidance=3.5):
    """FluxPipeline's text-to-image with our sampler and transformer (flux.Flux), through `parts`
    (flux/pipeline.py's FluxParts: the directory's encoders and VAE): prompts ->
    pixels in [0, 1], (B, 3, H, W). The noise is FluxPipeline's (one CPU generator seeded `seed`, (B, 16,
    H / 8, W / 8)); cfg_scale > 1 is true classifier-free guidance against the empty prompt (its
    `true_cfg_scale` with negative_prompt ""); `guidance` flux-dev's distilled scale (its `guidance_scale`)."""
    H, W = size_HxW
    if H <= 0 or W <= 0 or H % (2 * parts.down) or W % (2 * parts.down):
        raise FluxDirError(f"image size {H}x{W}: FLUX needs positive sides that are multiples of {2 * parts.down}")
    a, dims = flux_model.args, (parts.t5.config.d_model, parts.clip.config.hidden_size)
    if dims != (a.context_in_dim, a.vec_in_dim):
        raise FluxDirError(f"the encoders give T5 width {dims[0]} and CLIP width {dims[1]}; the transformer reads "
                           f"{a.context_in_dim} and {a.vec_in_dim} (another FLUX directory's model?)")
    txt, pooled = parts.prompts(prompts)
    uncond = parts.prompts([""]) if cfg_scale > 1 else None
    latents = sample(flux_model, txt, pooled, (parts.channels, H // parts.down, W // parts.down), steps=steps,
                     seed=seed, cfg_scale=cfg_scale, uncond=uncond,
                     guidance=guidance if flux_model.args.guidance_embed else None, schedule_kw=parts.schedule)
    return parts.decode(latents)


def main(argv=None):
    """python -m flux.sample [RUN_DIR] [--flux FLUX_DIR [--data FILE | --prompt TEXT ...]]: sample a FLUX run's
    newest checkpoint, a grid per guidance scale. A digits run: RUN_DIR/samples_g<scale>.png, judged. A run
    trained on a latent file: its held-out prompts (--data, the file it trained on) decoded through
    FLUX_DIR's VAE into RUN_DIR/decoded_g<scale>.png. --prompt: text through FLUX_DIR's encoders, sampled
    by the run (or without RUN_DIR by FLUX_DIR's own transformer), decoded into --out."""
    import argparse
    import sys
    p = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    p.add_argument("run_dir", nargs="?")
    p.add_argument("--per-class", type=int, default=10, help="images per class / prompt")
    p.add_argument("--guidance", default="1", help="comma list of true classifier-free guidance scales s, "
                   "u + s (c - u), applied for s > 1 only (default 1: off, FluxPipeline's true_cfg_scale=1, one "
                   f"forward a step; the training grids of a digits run use {GUIDANCE:g})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flux", help="a diffusers FLUX directory: its VAE decodes, its encoders read --prompt")
    p.add_argument("--data", help="the latent file a latent run trained on (its prompts; checked by content)")
    p.add_argument("--prompt", action="append", help="a text prompt (repeatable; needs --flux)")
    p.add_argument("--size", default="", help="HxW pixels for --prompt (default: the --data file's, else 1024x1024)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--distilled-guidance", type=float, default=None,
                   help="flux-dev's guidance input (default: the run's own --distilled-guidance, as it trained; "
                        "FluxPipeline's 3.5 for FLUX_DIR's transformer)")
    p.add_argument("--max-sequence-length", type=int, default=512, help="T5 tokens for --prompt without --data")
    p.add_argument("--out", default=None, help="--prompt's grid (default: RUN_DIR/prompts_g<scale>.png, or ./)")
    cfg = p.parse_args(argv)
    try:
        try:
            scales = [float(g) for g in cfg.guidance.split(",")]
        except ValueError:
            raise ValueError(f"--guidance {cfg.guidance!r}: a comma list of numbers (e.g. 1,2,4)") from None
        given = [f for f, v in (("--out", cfg.out), ("--size", cfg.size)) if v]
        if given and not cfg.prompt:  # (a run's grids go into RUN_DIR: they were ignored)
            raise ValueError(f"{' and '.join(given)}: --prompt's grid; a run's own grids are written into RUN_DIR "
                             f"(samples_g<scale>.png, decoded_g<scale>.png)")
        if cfg.per_class < 1 or cfg.steps < 1 or not all(0 < g < float("inf") for g in scales):
            raise ValueError(f"--per-class and --steps must be >= 1 and --guidance positive numbers, got "
                             f"{cfg.per_class}, {cfg.steps}, {cfg.guidance}")
        if (cfg.prompt or cfg.data) and not cfg.flux:
            raise ValueError("--prompt and --data decode through a FLUX directory's VAE: give --flux FLUX_DIR")
        model = meta = src = parts = flux_model = size = None
        if cfg.run_dir:
            path, meta = checkpoint.run_checkpoint(cfg.run_dir)
            if meta.get("task") != "flux":
                raise ValueError(f"{path} is not a FLUX run (task {meta.get('task')!r})")
            latent_run = bool(meta["train"].get("data"))
            if latent_run and not (cfg.flux and (cfg.data or cfg.prompt)):
                raise ValueError(f"{path} trained on a latent file: decode its samples with --flux FLUX_DIR and "
                                 f"--data FILE (the file it trained on) or --prompt TEXT")
            if not latent_run and cfg.flux:
                raise ValueError(f"{path} is a digits run (pixels, no latents): it samples without --flux")
            model, _ = checkpoint.load_run(path, kind=KIND)  # (the run's own family builds it: flux/task.py)
        elif not cfg.prompt:
            raise ValueError("give a RUN_DIR, or --flux FLUX_DIR with --prompt (its own transformer samples)")
        if cfg.flux:
            flux_model = model.flux if model is not None else _directory_transformer(cfg.flux)
            if cfg.data:
                src = latent_files.LatentFile(cfg.data, flux_model.args)
                if meta is not None and src.fingerprint != meta["train"]["data"]:
                    raise ValueError(f"--data {cfg.data} is not the file {cfg.run_dir} trained on (its contents differ)")
            parts = pipeline.FluxParts(cfg.flux, src.train["txt"].shape[1] if src else cfg.max_sequence_length)
            size = tuple(int(v) for v in cfg.size.lower().split("x")) if cfg.size else \
                tuple(parts.down * v for v in src.hw) if src else (1024, 1024)
            if len(size) != 2:
                raise ValueError(f"--size {cfg.size!r} is not HxW")
    except (ValueError, TypeError, OSError) as e:  # (BadInput too: a directory that is not FLUX's)
        sys.stderr.write(f"error: {e}\n")
        return 2
    guidance = cfg.distilled_guidance if cfg.distilled_guidance is not None else (3.5 if model is None else model.guidance)
    if model is not None:
        model.guidance = guidance
    try:
        return _sample_each(cfg, scales, model, flux_model, src, parts, size, guidance)
    except BadInput as e:
        error_line(str(e))
        return 2
    except WriteFailed as e:  # (a read-only run directory, a full disk: nothing half-written is left)
        error_line(f"a write failed: {describe_write_failure(e)}")
        return e.exit_code


def _sample_each(cfg, scales, model, flux_model, src, parts, size, guidance):
    """main's grids, one per true-CFG scale."""
    for g in scales:
        if cfg.prompt:
            images = text_to_image(flux_model, parts, [t for t in cfg.prompt for _ in range(cfg.per_class)],
                                   size, cfg.steps, cfg.seed, g, guidance)
            out = cfg.out or os.path.join(cfg.run_dir or ".", f"prompts_g{g:g}.png")
            print(f"guidance {g:g}: {len(images)} images of {len(cfg.prompt)} prompt(s); "
                  f"{pipeline.save_rgb_grid(images, cfg.per_class, out if len(scales) == 1 else f'{out[:-4]}_g{g:g}.png')}")
        elif parts is not None:
            latent, _ = sample_grid(model, src, cfg.seed, per_class=cfg.per_class, steps=cfg.steps, guidance=g, judge=False,
                                    schedule_kw=parts.schedule)
            out = pipeline.save_rgb_grid(parts.decode(latent), cfg.per_class, os.path.join(cfg.run_dir, f"decoded_g{g:g}.png"))
            classes, judged = grid_prompts(src)[1], ""
            if classes is not None:  # a labelled file: an SVC on its real latents judges the sampled ones
                clf, real = digits.latent_classifier(src)
                hit = (torch.from_numpy(clf.predict(latent.flatten(1).numpy())) == classes.repeat_interleave(cfg.per_class))
                judged = (f" an SVC on the file's latents labels {100 * hit.float().mean():.1f}% as their prompt's class "
                          f"({100 * real:.1f}% of its held-out real latents);")
            print(f"guidance {g:g}: {len(latent)} samples of the file's held-out prompts, decoded;{judged} {out}")
        else:
            out = os.path.join(cfg.run_dir, f"samples_g{g:g}.png")
            images, accuracy = sample_grid(model, digits.DigitsSource(cfg.seed), cfg.seed, out, per_class=cfg.per_class,
                                           guidance=g)
            print(f"guidance {g:g}: {100 * accuracy:.1f}% of {len(images)} samples labelled as their prompt's class; {out}")
    return 0


def _directory_transformer(flux_dir):
    pipeline.check_dir(flux_dir)
    return flux_hf.load(os.path.join(flux_dir, "transformer"))


if __name__ == "__main__":
    raise SystemExit(main())
