"""flux_task.py: FLUX.1 diffusion training as a Task: rectified flow on real images, the class as the prompt.

    python train.py --task flux --flavor flux_debug --steps 800 --batch-size 64 --lr 1e-3 --warmup 50

The shared trainer (train.py) runs it unchanged: the same loop, AdamW, checkpoints, graph mode. What
is FLUX's own, after torchtitan's `models/flux` (its train.py / validate.py):
  - the model: flux.Flux behind a prompt encoder. The frozen T5 / CLIP encoders cannot be downloaded
    here, so a learned token sequence and pooled vector per class stand in for them (`ClassPrompt`;
    one extra row is the empty prompt, for classifier-free guidance);
  - the data: scikit-learn's 1797 handwritten 8x8 digits (digits.py), packed 2x2 as FLUX packs its
    latents: 16 tokens of 4 channels. Global batch i is a pure function of (seed, i): the images, the
    prompts dropped to empty (probability 0.1), the times t and the noise eps all come from one
    generator seeded with (seed, i), so resume and N ranks see what one process would;
  - the loss: x_t = (1 - t) x0 + t eps, target v = eps - x0, MSE (flux_sample.py); validation MSE
    at the fixed times (i + 0.5) / 8 on held-out digits, comparable across runs;
  - the preview: --sample-images samples per class (10) (Euler on FLUX's shifted schedule, guidance scale
    `GUIDANCE`), a PNG grid (a row per class) and the share an independent classifier (an SVC on the
    real digits, digits.py) labels as the prompt's class.

The dry run (`--dry-run [--plan --chips N]`, dryrun.py) plans the published flavors at full scale
through `plan_workload`: FLUX itself on cached VAE latents and T5 / CLIP outputs (the frozen encoders
run ahead of training, as the MLPerf reference caches them), an --image-size image, e.g.

    python train.py --task flux --flavor flux_dev --dry-run --image-size 1024 --batch-size 4 --mesh ici=4

1024 x 1024 pixels -> a 128 x 128 x 16 latent (the VAE downsamples 8x) -> packed 2x2: 4096 tokens of
64 channels, beside 512 T5 tokens; FLOPs from flux.flops_per_sample (torchtitan's formula).
"""
import dataclasses
import os

import torch
import torch.nn as nn

import digits
import flux
import flux_sample
from cli import ConfigError
from model import with_overrides
from task import Task

N_CLASSES, PROMPT_TOKENS = 10, 4
DROP_PROMPT = 0.1     # classifier-free guidance: train the empty prompt on this share of samples
GUIDANCE = 2.0        # the preview's guidance scale u + s (c - u)
SIDE = 8              # digits are 8 x 8, one channel
VAE_CHANNELS, VAE_DOWN = 16, 8  # FLUX's autoencoder: 16 latent channels at 1/8 of the image's side
T5_TOKENS = 512       # the published flavors' prompt length (flux-dev's T5 max_sequence_length)
PUBLISHED_SIZE = 1024  # FLUX.1's native resolution: the published flavors' default --image-size


def latent_geometry(args, image_size):
    """(latent side, text tokens) for an image_size-pixel square image and this flavor: tokens of 2 x 2
    x 16 channels read FLUX's VAE latents (side / 8) beside T5's tokens; tokens of 2 x 2 x 1 read the
    digits' pixels beside the learned prompt. ValueError (one line) for a size that does not pack."""
    if args.in_channels == 4 * VAE_CHANNELS:
        down, text = VAE_DOWN, T5_TOKENS
    elif args.in_channels == 4:
        down, text = 1, PROMPT_TOKENS
    else:
        raise ValueError(f"in_channels {args.in_channels}: FLUX tokens pack 2 x 2 patches of {VAE_CHANNELS} VAE "
                         f"channels ({4 * VAE_CHANNELS}) or, for the digits, of one pixel channel (4)")
    if image_size <= 0 or image_size % (2 * down):
        raise ValueError(f"--image-size {image_size} is not a positive multiple of {2 * down} (the latent is "
                         f"1/{down} of the side, packed in 2 x 2 patches)")
    return image_size // down, text


def velocity(model, x_BxSxC, t_B, txt_BxTxE, y_BxV, side):
    """flux.Flux on packed tokens of a side x side latent: position ids built here; flux-dev's
    distilled guidance input fixed at 1."""
    B, dev = x_BxSxC.shape[0], x_BxSxC.device
    guidance_B = torch.ones(B, device=dev) if model.args.guidance_embed else None
    return model(x_BxSxC, flux.image_ids(B, side, side, device=dev), txt_BxTxE,
                 flux.text_ids(B, txt_BxTxE.shape[1], device=dev), t_B, y_BxV, guidance_B)


def flow_matching_loss(model, batch):
    """(x0, eps, t, *conditioning): rectified flow's MSE, as (loss to report, loss to differentiate)."""
    x0, eps, t, *cond = batch
    x_t, _ = flux_sample.flow_pair(x0, eps, t)
    mse = flux_sample.flow_loss(model(x_t, t, *cond), x0, eps)
    return mse, mse


class ClassPrompt(nn.Module):
    """Per class (and one empty prompt, row N_CLASSES): T learned text tokens and a pooled vector."""

    def __init__(self, args):
        super().__init__()
        self.tokens_CxTxE = nn.Parameter(0.02 * torch.randn(N_CLASSES + 1, PROMPT_TOKENS, args.context_in_dim))
        self.pooled_CxV = nn.Parameter(0.02 * torch.randn(N_CLASSES + 1, args.vec_in_dim))

    def forward(self, class_B):
        return self.tokens_CxTxE[class_B], self.pooled_CxV[class_B]


class FluxOnDigits(nn.Module):
    """(x_t packed (B, 16, 4), t (B,), class (B,)) -> predicted velocity (B, 16, 4)."""

    def __init__(self, args):
        super().__init__()
        self.prompt, self.flux = ClassPrompt(args), flux.Flux(args)

    def forward(self, x_BxSxC, t_B, class_B):
        return velocity(self.flux, x_BxSxC, t_B, *self.prompt(class_B), SIDE)


class FluxOnLatents(nn.Module):
    """(x_t packed (B, S, C), t (B,), T5 tokens (B, T, E), pooled CLIP (B, V)) -> velocity (B, S, C):
    FLUX as it trains at scale, on cached encoder outputs (what the dry run traces)."""

    def __init__(self, args, side, attention=flux.sdpa):
        super().__init__()
        self.flux, self.side = flux.Flux(args, attention), side

    def forward(self, x_BxSxC, t_B, txt_BxTxE, y_BxV):
        return velocity(self.flux, x_BxSxC, t_B, txt_BxTxE, y_BxV, self.side)


class FluxDigits(Task):
    unit = "img"

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.flavor not in flux.FLAVORS:
            raise ConfigError(f"unknown FLUX flavor {cfg.flavor!r}; choose one of {', '.join(flux.FLAVORS)}")
        try:
            self.args = with_overrides(flux.FLAVORS[cfg.flavor], cfg.set)
            flux.check_args(self.args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.init_from or cfg.tokenizer or cfg.kernels != "reference":
            raise ConfigError("--task flux trains from scratch on the digits with the reference kernels "
                              "(--init-from / --tokenizer / --kernels pallas are not built for it)")
        published = self.args.in_channels == 4 * VAE_CHANNELS
        self.image_size = cfg.image_size or (PUBLISHED_SIZE if published else SIDE)
        if cfg.dry_run:  # planned at full scale on cached latents (plan_workload): no digits involved
            if self.args.out_channels != self.args.in_channels:
                raise ConfigError(f"--flavor {cfg.flavor}: the velocity has the latent's channels; the model takes "
                                  f"{self.args.in_channels} in and gives {self.args.out_channels} out")
            try:
                self.latent_side, self.text_tokens = latent_geometry(self.args, self.image_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            return
        if self.args.in_channels != 4 or self.args.out_channels != 4:
            raise ConfigError(f"--flavor {cfg.flavor}: the digits are 1 channel packed 2x2 (4 channels a token), "
                              f"the model takes {self.args.in_channels} in and {self.args.out_channels} out"
                              f"{' (the published flavors: --dry-run)' if published else ''}")
        if self.image_size != SIDE:
            raise ConfigError(f"--image-size {self.image_size}: the digits are {SIDE} x {SIDE} (other sizes: --dry-run)")

    def setup_data(self, dp_rank, dp_size):
        self.images, self.labels = digits.load("train", self.cfg.seed)
        self.rank, self.size = dp_rank, dp_size
        held, _ = digits.load("held_out", self.cfg.seed)
        gen = torch.Generator().manual_seed(self.cfg.seed + 1_000_003)
        x0 = flux.patchify(held[: min(len(held), self.cfg.batch_size)])
        eps = torch.randn(x0.shape, generator=gen)
        rows = self._mine(len(x0))
        cls = torch.full((len(x0),), N_CLASSES)  # unconditional: the validation measures the flow itself
        self.val_batches = [(x0[rows], eps[rows], torch.full((len(x0),), t)[rows], cls[rows])
                            for t in flux_sample.validation_timesteps(8)][: max(self.cfg.eval_batches, 0)]

    def _mine(self, n):
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def build_model(self, args):
        return FluxOnDigits(args)

    def batch(self, step):
        """This rank's rows of global batch `step`: (x0 (B, 16, 4), eps, t (B,), class (B,))."""
        B = self.cfg.batch_size
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        pick = torch.randint(0, len(self.images), (B,), generator=gen)
        x0, cls = flux.patchify(self.images[pick]), self.labels[pick].clone()
        cls[torch.rand(B, generator=gen) < DROP_PROMPT] = N_CLASSES
        t = flux_sample.sample_timesteps(B, gen, "logit_normal")
        eps = torch.randn(x0.shape, generator=gen)
        rows = self._mine(B)
        return x0[rows], eps[rows], t[rows], cls[rows]

    loss = staticmethod(flow_matching_loss)  # batch: (x0, eps, t, class)

    @property
    def units_per_step(self):
        return self.cfg.batch_size

    def flops_per_step(self, args):
        return flux.flops_per_sample(args, (SIDE // 2) ** 2, PROMPT_TOKENS) * self.cfg.batch_size

    def param_count(self, args):
        return flux.param_count(args) + (N_CLASSES + 1) * (PROMPT_TOKENS * args.context_in_dim + args.vec_in_dim)

    def blocks(self, model):
        return [*model.flux.double_blocks, *model.flux.single_blocks]

    def label(self):
        return self.cfg.flavor

    def plan_workload(self, args):
        """The dry run's FLUX (dryrun.Workload): FluxOnLatents at --image-size, one sample traced on
        meta at one double and one single block, then one more of each, extrapolated to the depths.
        All of it is data parallel (no tp / ep); FSDP gathers one block at a time, the double one
        the larger."""
        import dryrun
        side, T = self.latent_side, self.text_tokens
        S = (side // 2) ** 2

        def saved_at(depths, remat):
            with torch.device("meta"):
                model = FluxOnLatents(dataclasses.replace(args, **depths), side, flux.flash_sdpa)  # (TPU: splash)
                bf16 = dict(dtype=torch.bfloat16)
                x0, eps = torch.empty(1, S, args.in_channels, **bf16), torch.empty(1, S, args.in_channels, **bf16)
                batch = (x0, eps, torch.empty(1), torch.empty(1, T, args.context_in_dim, **bf16),
                         torch.empty(1, args.vec_in_dim, **bf16))
            return dryrun.step_saved_bytes(model, flow_matching_loss, batch, remat)

        with torch.device("meta"):
            one_of_each = flux.Flux(dataclasses.replace(args, depth=1, depth_single_blocks=1))
        largest = max(sum(p.numel() for p in blocks[0].parameters())
                      for blocks in (one_of_each.double_blocks, one_of_each.single_blocks))
        no_tp = lambda dims: (None if dims["tp"] == dims["ep"] == 1 else f"--task flux runs data parallel "
                              f"only (dcn / ici): tp={dims['tp']}, ep={dims['ep']} refused")
        depths = {"depth": args.depth, "depth_single_blocks": args.depth_single_blocks}
        return dryrun.Workload(
            self.cfg.flavor, {"tp": 0, "experts": 0, "rest": flux.param_count(args)},
            {"tp": 0, "experts": 0, "rest": largest}, flux.flops_per_sample(args, S, T), S + T,
            lambda remat: dryrun.extrapolate(lambda d: saved_at(d, remat), depths), no_tp,
            dim=args.hidden_size, n_layers=args.depth + args.depth_single_blocks)

    def preview(self, model, log, out_dir):
        if not self.cfg.sample_images:
            return
        images, accuracy = sample_grid(model, self.cfg.seed, os.path.join(out_dir, "samples.png"),
                                       per_class=self.cfg.sample_images)
        log({"event": "samples", "accuracy": accuracy, "guidance": GUIDANCE},
            f"samples: {os.path.join(out_dir, 'samples.png')}; an SVC on the real digits labels {100 * accuracy:.1f}% "
            f"of {len(images)} samples as their prompt's class (guidance {GUIDANCE})")


@torch.no_grad()
def sample_grid(model, seed, path=None, per_class=10, steps=20, guidance=GUIDANCE):
    """(images (10 * per_class, 1, 8, 8), the judge's accuracy on them); a PNG grid (row per class)."""
    device = next(model.parameters()).device
    cls = torch.arange(N_CLASSES, device=device).repeat_interleave(per_class)
    empty = torch.full((1,), N_CLASSES, device=device)
    txt, y = model.prompt(cls)
    images = flux_sample.sample(
        model.flux, txt, y, (1, SIDE, SIDE), steps=steps, seed=seed, cfg_scale=guidance, uncond=model.prompt(empty),
        guidance=1.0 if model.flux.args.guidance_embed else None).cpu()
    judge, _ = digits.classifier(seed)
    accuracy = (digits.classify(judge, images) == cls.cpu()).float().mean().item()
    if path:
        save_grid(images, per_class, path)
    return images, accuracy


def save_grid(images_Nx1xHxW, per_row, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = images_Nx1xHxW.shape[0] // per_row
    grid = images_Nx1xHxW[:, 0].clamp(-1, 1).reshape(rows, per_row, SIDE, SIDE).permute(0, 2, 1, 3)
    fig = plt.figure(figsize=(per_row * 0.5, rows * 0.5))
    plt.imshow(grid.reshape(rows * SIDE, per_row * SIDE).numpy(), cmap="gray_r", vmin=-1, vmax=1)
    plt.axis("off")
    tmp = path + ".tmp"
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None):
    """python flux_task.py RUN_DIR [--per-class N] [--guidance 1,2,4]: sample a FLUX run's newest
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
        model = FluxOnDigits(flux.FluxArgs(**{k: tuple(v) if isinstance(v, list) else v
                                              for k, v in meta["model_args"].items()}))
        model.load_state_dict(checkpoint.load(path, {"model": model.state_dict()})["model"])
    except (ValueError, TypeError, OSError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    for g in scales:
        out = os.path.join(cfg.run_dir, f"samples_g{g:g}.png")
        images, accuracy = sample_grid(model, cfg.seed, out, per_class=cfg.per_class, guidance=g)
        print(f"guidance {g:g}: {100 * accuracy:.1f}% of {len(images)} samples labelled as their prompt's class; {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
