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
        txt_BxTxE, y_BxV = self.prompt(class_B)
        B, dev = x_BxSxC.shape[0], x_BxSxC.device
        guidance_B = torch.ones(B, device=dev) if self.flux.args.guidance_embed else None  # (flux-dev's input)
        return self.flux(x_BxSxC, flux.image_ids(B, SIDE, SIDE, device=dev), txt_BxTxE,
                         flux.text_ids(B, PROMPT_TOKENS, device=dev), t_B, y_BxV, guidance_B)


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
        if self.args.in_channels != 4 or self.args.out_channels != 4:
            raise ConfigError(f"--flavor {cfg.flavor}: the digits are 1 channel packed 2x2 (4 channels a token), "
                              f"the model takes {self.args.in_channels} in and {self.args.out_channels} out")
        if cfg.init_from or cfg.tokenizer:
            raise ConfigError("--task flux trains from scratch on the digits (--init-from / --tokenizer are "
                              "not built for it)")
        if cfg.kernels == "pallas":  # the joint attention as the Pallas splash kernel, every block live
            self.args = dataclasses.replace(self.args, attn_impl="splash")

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

    def loss(self, model, batch):
        x0, eps, t, cls = batch
        x_t, _ = flux_sample.flow_pair(x0, eps, t)
        mse = flux_sample.flow_loss(model(x_t, t, cls), x0, eps)
        return mse, mse

    @property
    def units_per_step(self):
        return self.cfg.batch_size

    def flops_per_step(self, args):
        return flux.flops_per_sample(args, (SIDE // 2) ** 2, PROMPT_TOKENS) * self.cfg.batch_size

    def param_count(self, args):
        return flux.param_count(args) + (N_CLASSES + 1) * (PROMPT_TOKENS * args.context_in_dim + args.vec_in_dim)

    def scan_stacks(self, model):
        return model.flux.pack_for_scan(PROMPT_TOKENS)

    def blocks(self, model):
        return [*model.flux.double_blocks, *model.flux.single_blocks]

    def label(self):
        return self.cfg.flavor

    def model_record(self, args):
        """The attention implementation may change across resumes: not recorded."""
        return {k: v for k, v in dataclasses.asdict(args).items() if k != "attn_impl"}

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
