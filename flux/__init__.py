"""flux/: FLUX.1 rectified-flow training as a workload of the shared trainer (`--task flux`).

Read in this order (each file imports only those above it, and the core at the repository root):

    model.py     FLUX.1's transformer (Black Forest Labs' layout): double-stream blocks (joint attention
                 over image and text), single-stream blocks, adaLN-Zero modulation, 3-axis RoPE; 2x2
                 latent packing; flux_dev / flux_schnell (11.9B) and flux_debug; torchtitan's FLOP formula
    sample.py    the rectified flow (x_t = (1 - t) x0 + t eps, target eps - x0), timestep samplers, seeded
                 Euler sampling with classifier-free guidance; text to image through a FLUX directory's parts
    interop/hf.py        diffusers FluxTransformer2DModel directories in and out
    latents.py   the data FLUX trains on at scale: VAE latents + T5 / CLIP outputs cached in a file
    pipeline.py  FLUX's frozen parts from a diffusers FLUX directory (VAE, CLIP, T5): encode, decode
    prepare.py   captioned images -> that latent file (`python -m flux.prepare`), batched, resumable
    digits.py    real images without a download: scikit-learn's 8x8 digits, and an SVC judge
    tiny.py      a tiny FLUX pipeline built offline (random weights): the tests' and the demo's directory
    jax_step.py  the same training step in pure JAX: the oracle its test holds model.py to, and the
                 competitor bench.py races (TorchTitan's "99% of MaxDiffusion")
    compiled.py  the training step for `--dry-run --compile`, and its pure-JAX twin (jax_step.py) compiled
                 beside it for the same pod: the TPU compiler's estimate of "99% of MaxDiffusion"
    shape.py     the model's shape as the planner reads it (planner/ imports no workload: a family hands it over)
    task.py      FluxFamily (the model behind its conditioning) and FluxDigits (the workload: batches,
                 the flow-matching loss, a sample grid per evaluation, the dry run's plan)

    python train.py --task flux --steps 800 --batch-size 64 --lr 1e-3 --warmup 50 --out-dir runs/flux
    python -m flux.sample runs/flux --guidance 1,2,4     # sample a digits run, judged by the SVC
    python -m flux.prepare IMAGES_DIR FLUX_DIR cache.safetensors             # images + captions -> latents
    python train.py --task flux --data cache.safetensors --init-from FLUX_DIR/transformer
    python -m flux.sample RUN_DIR --flux FLUX_DIR --data cache.safetensors   # decoded through FLUX's VAE
"""
