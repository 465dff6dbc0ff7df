"""flux/sample.py: rectified flow for FLUX.1: the training target and the sampler.

Training (torchtitan's flux `preprocess_inputs`, the rectified-flow / flow-matching formulation of
Liu et al. and Lipman et al.): a straight line from data to noise,
    x_t = (1 - t) x0 + t eps,    t in [0, 1], eps ~ N(0, I)
whose velocity dx_t/dt = eps - x0 is what the model learns to predict (MSE). t is drawn uniformly,
or logit-normal (SD3's choice: sigmoid of a Gaussian, more weight on the middle of the path).

Sampling (BFL's `flux/src/flux/sampling.py`): start at pure noise (t = 1) and integrate the
predicted velocity back to t = 0 with Euler steps on a *time-shifted* schedule: t' = e^mu / (e^mu +
(1/t - 1)), with mu growing linearly with the image's token count (0.5 at 256 tokens, 1.15 at 4096),
so larger images spend more of their steps at high noise. Classifier-free guidance mixes the
conditional and unconditional velocities, u + s (c - u) (s = 1: the conditional model alone);
flux-dev instead takes its distilled guidance scale as a model input (`guidance`).

Grids: `sample_grid` samples a row per class (or prompt) of a run's model, judged on the digits by an
independent classifier (digits.py); `python -m flux.sample RUN_DIR --guidance 1,2,4` does it for a
digits run's newest checkpoint, loaded by its own family (checkpoint.load_run).
"""
import math
import os

import torch
import torch.nn.functional as F

from flux import digits
from flux.model import KIND, image_ids, patchify, text_ids, unpatchify


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


def schedule(steps, image_tokens, base_shift=0.5, max_shift=1.15, shift=True):
    """steps + 1 times from 1 to 0; shifted towards 1 by mu = a line through (256, base), (4096, max)."""
    ts = [1 - i / steps for i in range(steps + 1)]
    if not shift:
        return ts
    mu = base_shift + (max_shift - base_shift) * (image_tokens - 256) / (4096 - 256)
    return [time_shift(mu, t) for t in ts]


def euler(velocity, x_BxSxC, times, cfg_scale=1.0):
    """Integrate dx/dt = v from times[0] to times[-1]. `velocity(x, t_B, cond)` is the model with
    (cond=True) or without (cond=False) the prompt; s != 1 mixes them: u + s (c - u)."""
    x = x_BxSxC
    B = x.shape[0]
    for t_cur, t_next in zip(times[:-1], times[1:]):
        t_B = torch.full((B,), t_cur, dtype=x.dtype, device=x.device)
        v = velocity(x, t_B, True)
        if cfg_scale != 1.0:
            u = velocity(x, t_B, False)
            v = u + cfg_scale * (v - u)
        x = x + (t_next - t_cur) * v
    return x


@torch.no_grad()
def sample(model, txt_BxTxE, y_BxV, shape_CxHxW, steps=20, seed=0, cfg_scale=1.0, uncond=None, guidance=None,
           shift=True):
    """Images (B, C, H, W) for B prompts (text embeddings + pooled vectors), from seeded noise.
    `uncond` = (txt_1xTxE, y_1xV), the empty prompt, needed when cfg_scale != 1; `guidance` is
    flux-dev's distilled scale (a model with guidance_embed only)."""
    C, H, W = shape_CxHxW
    B, dev = txt_BxTxE.shape[0], txt_BxTxE.device
    if cfg_scale != 1.0 and uncond is None:
        raise ValueError("classifier-free guidance (cfg_scale != 1) needs an unconditional prompt")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise = patchify(torch.randn(B, C, H, W, generator=gen)).to(dev)
    img_ids, txt_ids = image_ids(B, H, W, device=dev), text_ids(B, txt_BxTxE.shape[1], device=dev)
    g_B = None if guidance is None else torch.full((B,), float(guidance), device=dev)

    def velocity(x, t_B, cond):
        txt, y = (txt_BxTxE, y_BxV) if cond else (uncond[0].expand(B, -1, -1), uncond[1].expand(B, -1))
        return model(x, img_ids, txt, txt_ids, t_B, y, g_B)

    x = euler(velocity, noise, schedule(steps, noise.shape[1], shift=shift), cfg_scale)
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
def sample_grid(model, src, seed, path=None, per_class=10, steps=20, guidance=GUIDANCE, judge=True):
    """(images (rows * per_class, C, H, W), the judge's accuracy on them, or None); a PNG grid (a row per
    class / prompt). Classifier-free guidance where the source has an empty prompt."""
    device = next(model.parameters()).device
    cond, classes = grid_prompts(src)
    cond = tuple(c.to(device).repeat_interleave(per_class, dim=0) for c in cond)
    txt, y = model.encode(*cond)
    uncond = model.encode(*(e.to(device) for e in src.empty)) if src.empty is not None else None
    images = sample(
        model.flux, txt, y, (model.flux.args.in_channels // 4, *src.hw), steps=steps, seed=seed,
        cfg_scale=guidance if uncond is not None else 1.0, uncond=uncond,
        guidance=model.guidance if model.flux.args.guidance_embed else None).cpu()
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
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None):
    """python -m flux.sample RUN_DIR [--per-class N] [--guidance 1,2,4]: sample a FLUX run's newest
    checkpoint, a grid per guidance scale (RUN_DIR/samples_g<scale>.png) and the judge's accuracy."""
    import argparse
    import sys
    import checkpoint
    p = argparse.ArgumentParser(description=main.__doc__.split(":")[0])
    p.add_argument("run_dir")
    p.add_argument("--per-class", type=int, default=10)
    p.add_argument("--guidance", default=str(GUIDANCE), help="comma list of guidance scales")
    p.add_argument("--seed", type=int, default=0)
    cfg = p.parse_args(argv)
    try:
        scales = [float(g) for g in cfg.guidance.split(",")]
        if cfg.per_class < 1 or not all(0 < g < float("inf") for g in scales):
            raise ValueError(f"--per-class must be >= 1 and --guidance positive numbers, got {cfg.per_class}, {cfg.guidance}")
        path, meta = checkpoint.run_checkpoint(cfg.run_dir)
        if meta.get("task") != "flux":
            raise ValueError(f"{path} is not a FLUX run (task {meta.get('task')!r})")
        if meta["train"].get("data"):
            raise ValueError(f"{path} trained on a latent file: its prompts are the file's (the run's grids "
                             f"are written at each evaluation); this CLI samples digits runs")
        model, _ = checkpoint.load_run(path, kind=KIND)  # (the run's own family builds it: flux/task.py)
    except (ValueError, TypeError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    for g in scales:
        out = os.path.join(cfg.run_dir, f"samples_g{g:g}.png")
        images, accuracy = sample_grid(model, digits.DigitsSource(cfg.seed), cfg.seed, out, per_class=cfg.per_class,
                                       guidance=g)
        print(f"guidance {g:g}: {100 * accuracy:.1f}% of {len(images)} samples labelled as their prompt's class; {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
