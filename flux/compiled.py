"""flux/compiled.py: FLUX's training step for `--dry-run --compile`, and its pure-JAX twin.

    .venv/bin/python train.py --task flux --flavor flux_dev --set in_channels=4 --set out_channels=4 \
        --set depth=2 --set depth_single_blocks=4 --image-size 128 --batch-size 8 \
        --dry-run --compile --chip tpu_v5p --mesh ici=4 --against-jax

TorchTitan's FLUX headline is "99% of JAX MaxDiffusion". On a chip that is a measured step; here the
TPU compiler can price both programs for the same pod: our step (tpu_pod/step_compile.py: ConditionedFlux's
forward, the flow-matching loss, backward, clipping, AdamW, captured as one graph and run by torchax)
and flux/jax_step.py's (the same step written in jax.numpy, one jit), on the same compile-only
devices, with the same shardings (each parameter and AdamW moment split by
step_compile.param_sharding, the batch by rows over dcn x ici), the same attention (softmax(q k^T) v
in XLA: our SDPA's math form, its written-out form) and fp32 throughout (--dtype fp32; jax_step has
no bf16 path). The pure-JAX step trains the digits' class prompts, so the twin needs 4-channel
tokens (--set in_channels=4 --set out_channels=4); the transformer, where the time goes, is the
flavor's. What is compared is the compiler's cost model, not a chip's time.
"""
import dataclasses

import torch

from flux import model as flux
from tpu_pod import step_compile
from flux import jax_step


def program(model, loss, args, S, T, batch_size, kernels, saved_bytes, twin=False):
    """The step_compile.Program: `model` (flux/task.py's ConditionedFlux on meta, its attention the
    reference, or splash with --kernels pallas), `loss` (the flow-matching loss), the batch (x0, eps,
    t, conditioning) as the trainer feeds it, fp32 latents of S tokens. The digits' 4-channel tokens take a class (its learned
    prompt); VAE latents take T text tokens and the pooled vector. `twin`: with the pure-JAX step to
    compile beside it."""
    classes = args.in_channels == 4
    if twin and not classes:
        raise ValueError("--against-jax: the pure-JAX step trains the digits' class prompts; compile 4-channel tokens "
                         "(--set in_channels=4 --set out_channels=4)")
    f32, B = torch.float32, batch_size
    cond = [((B,), torch.long)] if classes else [((B, T, args.context_in_dim), f32), ((B, args.vec_in_dim), f32)]
    latent = ((B, S, args.in_channels), f32)
    splash = flux.attention_flops_per_sample(args, S + T) * B if kernels == "pallas" else 0.0  # (unseen by the cost model)
    return step_compile.Program(model, loss, (latent, latent, ((B,), f32), *cond), saved_bytes, splash,
                                twin=jax_twin(model, args, S, B) if twin else None,
                                stacks=lambda m: m.flux.pack_for_scan(T))  # (--scan: both block stacks)


def jax_twin(model, args, S, B):
    """mesh, clip -> (flux/jax_step.py's train step, its abstract inputs on `mesh`, donated arguments):
    params named as `model`'s state (jax_step's contract), sharded as step_compile shards ours; AdamW's
    moments alike; the batch (x0, eps, t, class) split by rows."""
    def build(mesh, clip):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec
        struct = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
        params = {n: struct(p.shape, jnp.float32, step_compile.param_sharding(mesh, p.shape))
                  for n, p in model.named_parameters()}
        rows, whole = NamedSharding(mesh, PartitionSpec(("dcn", "ici"))), NamedSharding(mesh, PartitionSpec())
        latent = struct((B, S, args.in_channels), jnp.float32, rows)
        batch = (latent, latent, struct((B,), jnp.float32, rows), struct((B,), jnp.int32, rows))
        scalar = struct((), jnp.float32, whole)
        step = jax_step.make_train_step(dataclasses.asdict(args), *step_compile.ADAMW_DEFAULTS, clip)
        return step, (params, {"m": params, "v": params}, batch, scalar, scalar), (0, 1)
    return build
