"""flux/task.py: FLUX.1 diffusion training as a workload (FluxFamily + FluxDigits): rectified flow on real images or on cached latents.

    python train.py --task flux --flavor flux_debug --steps 800 --batch-size 64 --lr 1e-3 --warmup 50
    python train.py --task flux --data cache.safetensors --init-from FLUX_DIR   # latents + embeddings; fine-tune

The shared trainer (train.py) runs it unchanged: the same loop, AdamW, checkpoints, graph mode. What
is FLUX's own, after torchtitan's `models/flux` (its train.py / validate.py):
  - the model: flux.Flux behind its conditioning (`ConditionedFlux`). On the digits the frozen T5 /
    CLIP encoders (which cannot be downloaded here) are stood in for by a learned token sequence and
    pooled vector per class (`ClassPrompt`; one extra row is the empty prompt, for classifier-free
    guidance); a latent file brings the encoders' outputs themselves. `--init-from` a diffusers
    directory fills the transformer (flux/hf.py) to fine-tune it;
  - the data, one of two sources with the same fields (`train` / `held` rows, `cond_keys`, `empty`):
    scikit-learn's 1797 handwritten 8x8 digits (flux/digits.py), or `--data FILE.safetensors`: VAE
    latents + T5 / CLIP outputs computed ahead (flux/latents.py: its schema, its held-out tenth).
    Either is packed 2x2 as FLUX packs its latents. Global batch i is a pure function of (seed, i):
    the rows, the prompts dropped to empty (--prompt-dropout: 0.1 on the digits, 0 on a latent file), the
    times t and the noise eps all come from one generator seeded with (seed, i), so resume and N
    ranks see what one process would;
  - the loss: x_t = (1 - t) x0 + t eps, target v = eps - x0, MSE (flux/sample.py); validation MSE
    at the fixed times (i + 0.5) / 8 on held-out rows (unconditional where there is an empty prompt),
    comparable across runs;
  - pictures: at each evaluation a quick grid (a row per class / prompt, 8 Euler steps) named by the
    step (samples_step_000200.png); at the end --sample-images per class (20 steps, guidance scale
    `GUIDANCE`) into samples.png, and, for the digits, the share an independent classifier (an SVC
    on the real digits, flux/digits.py) labels as the prompt's class. A latent file's grid here shows the
    latents' first channel; `python -m flux.sample RUN --flux FLUX_DIR --data FILE` decodes them through
    the directory's VAE (flux/pipeline.py).

The dry run (`--dry-run [--plan --chips N]`, planner/dryrun.py) plans the published flavors at full scale
through `plan_workload`: FLUX itself on cached VAE latents and T5 / CLIP outputs (the frozen encoders
run ahead of training, as the MLPerf reference caches them), an --image-size image, e.g.

    python train.py --task flux --flavor flux_dev --dry-run --image-size 1024 --batch-size 4 --mesh ici=4

1024 x 1024 pixels -> a 128 x 128 x 16 latent (the VAE downsamples 8x) -> packed 2x2: 4096 tokens of
64 channels, beside 512 T5 tokens; FLOPs from flux.flops_per_sample (torchtitan's formula).
"""
import dataclasses
import math
import os
from typing import Optional

import torch
import torch.nn as nn

from flux.digits import N_CLASSES, SIDE, DigitsSource
from flux import model as flux
from flux import latents as flux_latents
from flux import sample as flux_sample
from flux.sample import GUIDANCE, sample_grid
import materialize
from run.checkpoint import CheckpointError
from run.flags import flag, with_overrides
from errors import ConfigError
from parallel import local_block, local_tensor
from task import ModelFamily, Workload
from flux import hf as flux_hf
from planner import dryrun
from planner import activations
from flux.shape import flux_shape

PROMPT_TOKENS = 4
DROP_PROMPT = 0.1     # the digits' classifier-free guidance: train the empty prompt on this share of samples
EVAL_GRID = (4, 8)    # at each evaluation: up to this many samples per row, Euler steps (cheap)
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
        self.tokens_CxTxE = nn.Parameter(torch.empty(N_CLASSES + 1, PROMPT_TOKENS, args.context_in_dim))
        self.pooled_CxV = nn.Parameter(torch.empty(N_CLASSES + 1, args.vec_in_dim))  # (N(0, 0.02): flux.initializer)

    def forward(self, class_B):
        return self.tokens_CxTxE[class_B], self.pooled_CxV[class_B]


class ConditionedFlux(nn.Module):
    """(x_t packed (B, S, C), t (B,), *conditioning) -> predicted velocity (B, S, C). The conditioning
    is a class (B,) through the learned ClassPrompt (`classes`), or the text tokens (B, T, E) and
    pooled vectors (B, V) as given. A model with a guidance embedding gets `guidance` (flux-dev's
    distilled scale) for every sample."""

    def __init__(self, args, hw=(SIDE, SIDE), classes=True, guidance=1.0):
        super().__init__()
        self.prompt = ClassPrompt(args) if classes else None
        self.flux, self.hw, self.guidance = flux.Flux(args), tuple(hw), guidance
        if not self.flux.img_in.weight.is_meta:  # (the trainer builds on meta and fills: materialize.py)
            materialize.init_module(self, flux.initializer(self))

    def encode(self, *cond):
        return self.prompt(*cond) if self.prompt is not None else cond

    def forward(self, x_BxSxC, t_B, *cond):
        txt_BxTxE, y_BxV = self.encode(*cond)
        B, dev = x_BxSxC.shape[0], x_BxSxC.device
        guidance_B = torch.full((B,), self.guidance, device=dev) if self.flux.args.guidance_embed else None
        return self.flux(x_BxSxC, flux.image_ids(B, *self.hw, device=dev), txt_BxTxE,
                         flux.text_ids(B, txt_BxTxE.shape[1], device=dev), t_B, y_BxV, guidance_B)


class FluxFamily(ModelFamily):
    """flux.Flux behind its conditioning (ConditionedFlux): from a flavor or a diffusers directory's
    config, --set applied; the data source fixes the image grid `hw`, whether prompts are learned
    `classes`, and the text tokens (given when the family is made, whole: FluxDigits loads its source first)."""
    kind = flux.KIND

    def __init__(self, cfg, args=None, hw=(SIDE, SIDE), classes=True, guidance=1.0, text_tokens=PROMPT_TOKENS):
        self.cfg = cfg  # (None for a family made from a checkpoint's record)
        super().__init__(args if args is not None else self.args_from_cli(cfg))
        self.hw, self.classes, self.guidance, self.text_tokens = tuple(hw), classes, guidance, text_tokens

    @staticmethod
    def args_from_cli(cfg):
        """FluxArgs from --flavor or --init-from's config, --set applied, checked (ConfigError: one line)."""
        try:
            if cfg.init_from:
                args = flux_hf.read_args(cfg.init_from)
            elif cfg.flavor not in flux.FLAVORS:
                raise ConfigError(f"unknown FLUX flavor {cfg.flavor!r}; choose one of {', '.join(flux.FLAVORS)}")
            else:
                args = flux.FLAVORS[cfg.flavor]
            args = with_overrides(args, cfg.set)
            flux.check_args(args)
        except ValueError as e:  # (flux_hf.FluxHFError too: a config flux/model.py does not implement)
            raise ConfigError(str(e)) from None
        if args.out_channels != args.in_channels:
            raise ConfigError(f"the model predicts {args.out_channels} channels a token from {args.in_channels}: "
                              f"a velocity has its input's channels")
        if cfg.kernels == "pallas":  # the joint attention as the Pallas splash kernel, every block live
            args = dataclasses.replace(args, attn_impl="splash")
        return args

    @classmethod
    def from_record(cls, meta, where):
        """A FLUX run's model: the recorded FluxArgs; learned class prompts unless it trained on a file; the
        distilled guidance it trained with (what sampling it gives by default)."""
        saved = meta.get("model_args")
        known = {f.name for f in dataclasses.fields(flux.FluxArgs)}
        if not isinstance(saved, dict) or set(saved) - known:
            raise CheckpointError(f"{where}: model_args {sorted(set(saved or {}) - known) or '(none)'} describe no "
                              f"FLUX model of this version")
        try:
            args = flux.FluxArgs(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
            flux.check_args(args)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: model_args describe no FLUX model ({str(e).splitlines()[0]})") from None
        g = meta["train"].get("distilled_guidance")
        if g is not None and not (isinstance(g, (int, float)) and not isinstance(g, bool) and math.isfinite(g)):
            raise CheckpointError(f"{where}: distilled_guidance {g!r} is not a number")
        return cls(None, args, classes=not meta["train"].get("data"), guidance=1.0 if g is None else float(g))

    def build(self, args):
        return ConditionedFlux(args, self.hw, classes=self.classes, guidance=self.guidance)

    def initializer(self, model):
        return flux.initializer(model)  # (the rule ConditionedFlux's constructor fills a real-device model by)

    def param_count(self, args):
        prompt = (N_CLASSES + 1) * (PROMPT_TOKENS * args.context_in_dim + args.vec_in_dim)
        return flux.param_count(args) + (prompt if self.classes else 0)

    def scan_stacks(self, model):
        return model.flux.pack_for_scan(self.text_tokens)

    def blocks(self, model):
        return [*model.flux.double_blocks, *model.flux.single_blocks]

    def label(self):
        return f"hf:{os.path.abspath(self.cfg.init_from)}" if self.cfg.init_from else self.cfg.flavor

    def record(self, args):
        """The attention implementation may change across resumes: not recorded."""
        return {k: v for k, v in dataclasses.asdict(args).items() if k != "attn_impl"}

    @torch.no_grad()
    def load_pretrained(self, model):
        """--init-from: the diffusers transformer's weights into model.flux (each rank its own block of a
        sharded parameter); the prompt stand-in, if any, keeps its fresh init."""
        if not self.cfg.init_from:
            return
        try:
            state = flux_hf.read_state(self.cfg.init_from, self.args)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for name, p in model.flux.named_parameters():
            local_tensor(p).copy_(local_block(state[name], p))

    def plan(self, args, cfg):
        return plan_workload(args, cfg)


@dataclasses.dataclass
class FluxFlags:
    data: Optional[str] = flag(None, "flux: a .safetensors file of latents + text embeddings (flux/latents.py; "
                               "default: the digits)")
    image_size: int = flag(0, "flux: image side in pixels (0: the data's, 8 for the digits; 1024 for the "
                           "published flavors' --dry-run)")
    sample_images: int = flag(10, "flux: at the end, sample this many images per class into samples.png, judged "
                              "by a classifier; at each evaluation a quick grid samples_step_N.png (0: off)")
    distilled_guidance: Optional[float] = flag(None, "flux: the guidance value given to a model with a guidance "
                                               "embedding (flux-dev's distilled scale; default 1)")
    against_jax: bool = flag(False, "flux, with --dry-run --compile: also compile the pure-JAX step (flux/jax_step.py) "
                             "for the same topology and layout, and print the ratio of the estimated steps")
    prompt_dropout: Optional[float] = flag(None, f"flux: the share of samples trained on the empty prompt (CFG's "
                                           f"unconditional model; default 0 on a --data file, as diffusers' scripts' "
                                           f"--proportion_empty_prompts; {DROP_PROMPT} on the digits: grids at CFG {GUIDANCE:g})")


class FluxDigits(Workload):
    """Rectified flow on the digits (or a latent file): the batches, the flow-matching loss, the grids."""
    name, default_flavor, Flags, unit = "flux", "flux_debug", FluxFlags, "img"
    family_class = FluxFamily
    no_split_reason = "its transformer attends over text and image tokens jointly, and splitting them is not built"
    sequence_from = "its image's latent tokens (--image-size)"
    loss_reduction = classmethod(lambda cls, cfg: "mean")  # (the MSE over rows of one latent size: step.py)
    resume_policy = {"data": lambda saved, now: None if (saved is None) == (now is None) else (  # (None: the digits)
        "the data source (the digits or a --data latent file) fixes the model's conditioning weights: resume "
        "with the run's --data"),  # another latent file may replace one (--allow-change data); digits <-> a file may not
        "distilled_guidance": lambda saved, now: None, "prompt_dropout": lambda saved, now: None}  # (--allow-change)

    @classmethod
    def check_flags(cls, cfg):
        for name in ("image_size", "sample_images"):
            if getattr(cfg, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
        g = cfg.distilled_guidance
        if g is not None and not (g >= 0 and math.isfinite(g)):
            raise ConfigError(f"--distilled-guidance {g}: a finite value >= 0")
        p = cfg.prompt_dropout
        if p is not None and not 0 <= p <= 1:
            raise ConfigError(f"--prompt-dropout {p}: a share in [0, 1]")

    def __init__(self, cfg):
        super().__init__(cfg)
        a = FluxFamily.args_from_cli(cfg)
        published = a.in_channels == 4 * VAE_CHANNELS
        self.image_size = cfg.image_size or (PUBLISHED_SIZE if published else SIDE)
        self.guidance = 1.0 if cfg.distilled_guidance is None else cfg.distilled_guidance
        if cfg.against_jax and not (cfg.dry_run and cfg.compile):
            raise ConfigError("--against-jax compiles the pure-JAX step beside ours: add --dry-run --compile")
        if cfg.dry_run:  # planned at full scale on cached latents (plan_workload): no data involved
            try:
                latent_geometry(a, self.image_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self.family = FluxFamily(cfg, a)
            return
        if not cfg.data and a.in_channels != 4:
            raise ConfigError(f"the digits are 1 channel packed 2x2 (4 channels a token), the model takes "
                              f"{a.in_channels}: train it on a latent file (--data FILE.safetensors)"
                              f"{' (the published flavors: --dry-run)' if published else ''}")
        if cfg.image_size and (cfg.data or cfg.image_size != SIDE):
            raise ConfigError(f"--image-size {cfg.image_size}: training takes its data's size (the digits are "
                              f"{SIDE} x {SIDE}, a latent file has its own); other sizes: --dry-run")
        if cfg.distilled_guidance is not None and not a.guidance_embed:
            raise ConfigError(f"--distilled-guidance {cfg.distilled_guidance}: this model has no guidance "
                              f"embedding (flux-dev's; guidance_embed=False)")
        # the data source, then the family it fixes (the image grid, learned class prompts or given text)
        self.src = flux_latents.LatentFile(cfg.data, a) if cfg.data else DigitsSource(cfg.seed)
        self.drop_prompt = cfg.prompt_dropout if cfg.prompt_dropout is not None else (0.0 if cfg.data else DROP_PROMPT)
        if self.drop_prompt and self.src.empty is None:
            raise ConfigError(f"--prompt-dropout {self.drop_prompt}: {cfg.data} has no empty prompt (empty_txt, "
                              f"empty_pooled: flux.prepare writes them)")
        self.grid_guidance = GUIDANCE if self.drop_prompt else 1.0  # (CFG only where the empty prompt trained)
        self.family = FluxFamily(cfg, a, self.src.hw, self.src.cond_keys == ("labels",), self.guidance,
                                 self._text_tokens())

    def setup_data(self, dp_rank, dp_size):
        cfg = self.cfg
        self.rank, self.size = dp_rank, dp_size
        held, n = self.src.held, min(len(self.src.held["latents"]), cfg.batch_size) // dp_size * dp_size
        if cfg.eval_batches and not n:  # (a small file's held-out tenth: fewer rows than ranks)
            self.notes = [f"note: validation skipped: {len(held['latents'])} held-out row(s) for {dp_size} ranks"]
        gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
        x0 = flux.patchify(held["latents"][:n])
        eps = torch.randn(x0.shape, generator=gen)
        # unconditional where there is an empty prompt: the validation measures the flow itself
        cond = self._cond(held, slice(0, n)) if self.src.empty is None else \
            tuple(e.expand(n, *e.shape[1:]).contiguous() for e in self.src.empty)
        rows = self._mine(n)
        self.val_batches = [(x0[rows], eps[rows], torch.full((n,), t)[rows], *(c[rows] for c in cond))
                            for t in flux_sample.validation_timesteps(8)][: cfg.eval_batches if n else 0]

    def _cond(self, part, idx):
        return tuple(part[k][idx] for k in self.src.cond_keys)

    def _mine(self, n):
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def batch(self, step):
        """This rank's rows of global batch `step`: (x0 (B, S, C), eps, t (B,), *conditioning)."""
        B, src = self.cfg.batch_size, self.src
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        pick = torch.randint(0, len(src.train["latents"]), (B,), generator=gen)
        x0, cond = flux.patchify(src.train["latents"][pick]), self._cond(src.train, pick)
        drop = torch.rand(B, generator=gen) < self.drop_prompt  # (drawn even at 0: the stream stays the same)
        for c, e in zip(cond, src.empty or ()):  # (indexing copied the rows: writing is safe)
            c[drop] = e
        t = flux_sample.sample_timesteps(B, gen, "logit_normal")
        eps = torch.randn(x0.shape, generator=gen)
        rows = self._mine(B)
        return x0[rows], eps[rows], t[rows], *(c[rows] for c in cond)

    loss = staticmethod(flow_matching_loss)  # batch: (x0, eps, t, *conditioning)

    @property
    def units_per_step(self):
        return self.cfg.batch_size

    def flops_per_step(self, args):
        H, W = self.src.hw
        return flux.flops_per_sample(args, (H // 2) * (W // 2), self._text_tokens()) * self.cfg.batch_size

    def _text_tokens(self):
        return self.src.train["txt"].shape[1] if "txt" in self.src.train else PROMPT_TOKENS

    def meta(self):
        """The data's content hash, None for the digits: always recorded, so that a resume that drops
        --data (or adds it) is seen to change it (resume.check_compatible compares this run's keys);
        the distilled guidance and prompt dropout it trains with (flux.sample's defaults for the run)."""
        return {"data": self.src.fingerprint, "distilled_guidance": self.guidance, "prompt_dropout": self.drop_prompt}

    def preview(self, model, log, out_dir, step, final):
        """A quick grid at each evaluation, named by the step (not judged); at the end the full grid,
        judged."""
        if not self.cfg.sample_images:
            return
        if final:
            return self.final_grid(model, log, out_dir)
        path = os.path.join(out_dir, f"samples_step_{step:06d}.png")
        sample_grid(model, self.src, self.cfg.seed, path, min(self.cfg.sample_images, EVAL_GRID[0]),
                    steps=EVAL_GRID[1], guidance=self.grid_guidance, judge=False)
        log({"event": "grid", "step": step, "path": path}, f"step {step:5d} | grid {path}")

    def final_grid(self, model, log, out_dir):
        path = os.path.join(out_dir, "samples.png")
        images, accuracy = sample_grid(model, self.src, self.cfg.seed, path, per_class=self.cfg.sample_images,
                                       guidance=self.grid_guidance, judge=isinstance(self.src, DigitsSource))
        judged = "" if accuracy is None else (f"; an SVC on the real digits labels {100 * accuracy:.1f}% of "
                                              f"{len(images)} samples as their prompt's class")
        log({"event": "samples", "accuracy": accuracy, "guidance": self.grid_guidance},
            f"samples: {path}{judged} (guidance {self.grid_guidance})")


def plan_workload(args, cfg):
    """The dry run's FLUX (dryrun.Workload): ConditionedFlux on cached latents at --image-size, one sample traced on
    meta at one double and one single block, then one more of each, extrapolated to the depths.
    All of it is data parallel (no tp / ep); FSDP gathers one block at a time, the double one
    the larger."""
    from flux import compiled as flux_compiled
    side, T = latent_geometry(args, cfg.image_size or (PUBLISHED_SIZE if args.in_channels == 4 * VAE_CHANNELS else SIDE))
    S = (side // 2) ** 2

    def saved_at(depths, remat):
        with torch.device("meta"):
            model = ConditionedFlux(dataclasses.replace(args, attn_impl="flash", **depths), (side, side),
                                    classes=False)  # (flash: never S x S, as splash on a TPU)
            bf16 = dict(dtype=torch.bfloat16)
            x0, eps = torch.empty(1, S, args.in_channels, **bf16), torch.empty(1, S, args.in_channels, **bf16)
            batch = (x0, eps, torch.empty(1), torch.empty(1, T, args.context_in_dim, **bf16),
                     torch.empty(1, args.vec_in_dim, **bf16))
        return activations.step_saved_bytes(model, flow_matching_loss, batch, remat)

    with torch.device("meta"):
        one_of_each = flux.Flux(dataclasses.replace(args, depth=1, depth_single_blocks=1))
    largest = max(sum(p.numel() for p in blocks[0].parameters())
                  for blocks in (one_of_each.double_blocks, one_of_each.single_blocks))
    no_tp = lambda dims: (None if dims["tp"] == dims["ep"] == 1 else f"--task flux runs data parallel "
                          f"only (dcn / ici): tp={dims['tp']}, ep={dims['ep']} refused")
    depths = {"depth": args.depth, "depth_single_blocks": args.depth_single_blocks}
    saved = lambda remat: activations.extrapolate(lambda d: saved_at(d, remat), depths)

    def program(batch_size, kernels, shards):  # (--compile: flux/compiled.py; no routing: shards unused)
        with torch.device("meta"):
            attention = "splash" if kernels == "pallas" else "sdpa"
            model = ConditionedFlux(dataclasses.replace(args, attn_impl=attention), (side, side),
                                    classes=args.in_channels == 4)
        return flux_compiled.program(model, flow_matching_loss, args, S, T, batch_size, kernels, saved,
                                     twin=getattr(cfg, "against_jax", False))
    return dryrun.Workload(
        cfg.flavor, {"tp": 0, "experts": 0, "rest": flux.param_count(args)},
        {"tp": 0, "experts": 0, "rest": largest}, flux.flops_per_sample(args, S, T), S + T,
        saved, no_tp, dim=args.hidden_size, n_layers=args.depth + args.depth_single_blocks,
        shape=flux_shape(args, S, T, cfg.flavor),
        program=program)
