"""tpu_kernels.py: our Pallas kernels, forward + backward, compiled for a TPU by the real compiler on
this CPU machine (tpu_target.py), beside the XLA reference of the same computation.

Each case is a kernel at a production shape and the plain-JAX computation it replaces: attention
that materializes S x S scores, a cross-entropy over the full (rows, vocab) logits,
jax.lax.ragged_dot for the grouped matmul. Both are compiled, as the gradient of a scalar (forward
and backward), for one device of the chip; the compiler's verdict and HBM temporaries are printed
side by side. What a compile verifies: the kernels lower, Mosaic accepts them, their blocks fit the
chip's VMEM and the program its HBM. Not verified: numerics (the suite's interpret-mode tests do that
on CPU) or speed on a chip (the cost model does not see inside a Mosaic kernel).

    .venv/bin/python tpu_kernels.py sweep [--chip tpu_v5p] [--kernel splash] [--quick]
    .venv/bin/python tpu_kernels.py one splash tpu_v5p    # one case, a JSON line (the suite's test)
The sweep runs each chip in its environment (tpu_v7: .venv-tpu, tpu_target.py says why).
"""
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

import tpu_target

BF16, I32 = jnp.bfloat16, jnp.int32
spec = jax.ShapeDtypeStruct


def _grad_of_sum(f, n_diff):
    """jax.grad of sum(f(...)) in f's first n_diff arguments: forward and backward, as a step does."""
    def step(*args):
        loss = lambda *d: f(*d, *args[n_diff:]).astype(jnp.float32).sum()
        return jax.value_and_grad(loss, argnums=tuple(range(n_diff)))(*args[:n_diff])
    return step


def _attention_reference(q, k, v, seg, window, causal):
    """softmax(q k^T / sqrt(D) + mask) v, the S x S scores materialized (GQA by repeating k / v)."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, 1), jnp.repeat(v, group, 1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    pos = jnp.arange(q.shape[2])
    keep = seg[:, None, :, None] == seg[:, None, None, :]
    if causal:
        keep &= pos[None, None, :, None] >= pos[None, None, None, :]
    if window:
        keep &= pos[None, None, :, None] - pos[None, None, None, :] < window
    p = jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v)


def splash_case(chip, B=1, H=32, Hkv=8, S=8192, D=128, window=0, segments=0, causal=1):
    import kernels_pallas
    import kernels_splash
    block = kernels_pallas.TPU_BLOCKS[chip]["splash"]
    args = (spec((B, H, S, D), BF16), spec((B, Hkv, S, D), BF16), spec((B, Hkv, S, D), BF16), spec((B, S), I32))
    ours = lambda q, k, v, s: kernels_splash.splash_jax.jax_fn(q, k, v, s, window=window, block=block,
                                                               segments=segments, causal=causal)
    ref = lambda q, k, v, s: _attention_reference(q, k, v, s, window, causal)
    return _grad_of_sum(ours, 3), _grad_of_sum(ref, 3), args, 3  # Mosaic kernels: fwd, dq, dkv


def ce_case(chip, N=8192, D=4096, V=128256):
    import kernels_pallas
    bn, bv = kernels_pallas.ce_blocks(chip, D, V)
    args = (spec((N, D), BF16), spec((V, D), BF16), spec((N,), I32))
    ours = lambda h, w, t: kernels_pallas.fused_ce_jax.jax_fn(h, w, t, ignore_index=-100, block_n=bn, block_v=bv)

    def ref(h, w, t):
        logits = jnp.einsum("nd,vd->nv", h, w, preferred_element_type=jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), t[:, None], 1).mean()
    return _grad_of_sum(ours, 2), _grad_of_sum(ref, 2), args, 3  # fwd, dh, dw


def gmm_case(chip, M=8192, G=8, K=4096, N=14336):
    """Uneven groups with an empty one: the group sizes are data (a ShapeDtypeStruct), so the
    compiled program serves every split of M; the kernel's grid has room for the worst."""
    import kernels_gmm
    import kernels_pallas
    tm, tk, tn = kernels_pallas.TPU_BLOCKS[chip]["gmm"]
    args = (spec((M, K), BF16), spec((G, K, N), BF16), spec((G,), I32))
    ours = lambda x, w, gs: kernels_gmm.gmm_jax.jax_fn(x, w, gs, block_m=tm, block_k=tk, block_n=tn)
    ref = lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)
    return _grad_of_sum(ours, 2), _grad_of_sum(ref, 2), args, 3  # gmm, gmm (dx, w read transposed), tgmm


CASES = {"splash": splash_case, "ce": ce_case, "gmm": gmm_case}
# The shapes (sweep): attention for causal / window / packed documents / FLUX's non-causal
# 4096 + 512 tokens, GQA 32/8 and 64/8, head_dim 64 / 128 / 256, S 4096 / 8192 / 32768; the fused
# cross-entropy at Llama 3's / Qwen3's vocab; the experts of Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral.
SWEEP = [
    ("splash", dict(S=4096, H=32, Hkv=8, D=128)),
    ("splash", dict(S=8192, H=32, Hkv=8, D=128)),
    ("splash", dict(S=8192, H=64, Hkv=8, D=128, window=4096)),
    ("splash", dict(S=8192, H=32, Hkv=8, D=64, segments=1)),
    ("splash", dict(S=8192, H=16, Hkv=8, D=256)),
    ("splash", dict(S=4608, H=24, Hkv=24, D=128, causal=0, segments=1)),  # FLUX: 4096 image + 512 text
    ("splash", dict(S=32768, H=32, Hkv=8, D=128)),
    ("ce", dict(N=8192, D=4096, V=128256)),
    ("ce", dict(N=16384, D=4096, V=151936)),
    ("ce", dict(N=8192, D=8192, V=128256)),
    ("gmm", dict(M=16384, G=128, K=2048, N=768)),     # Qwen3-30B-A3B experts
    ("gmm", dict(M=16384, G=128, K=4096, N=1536)),    # Qwen3-235B-A22B experts
    ("gmm", dict(M=8192, G=8, K=4096, N=14336)),      # Mixtral 8x7B experts
]
QUICK = {0, 7, 12}  # one row per kernel


def compile_case(kernel, chip, reference=True, **shape):
    """{kernel, chip, shape, ours: Compiled fields, reference: Compiled fields or its error}."""
    ours_fn, ref_fn, args, n_kernels = CASES[kernel](chip, **shape)
    row = {"kernel": kernel, "chip": chip, "shape": shape, "expected_mosaic_calls": n_kernels}
    try:
        row["ours"] = vars(tpu_target.compile(ours_fn, *args, chip=chip))
    except tpu_target.CompileFailed as e:
        row["ours"] = {"error": str(e)}
    if reference:
        try:
            row["reference"] = vars(tpu_target.compile(ref_fn, *args, chip=chip))
        except tpu_target.CompileFailed as e:
            row["reference"] = {"error": str(e)}
    return row


def _cell(c):
    if "error" in c:
        return "refused: " + c["error"][:80]
    if not c["fits"]:
        used = re.search(r"Used [\d.]+\w? of [\d.]+\w? hbm", c["message"])
        return "does not fit HBM" + (f" ({used.group(0)})" if used else "")
    return f"{c['temp_bytes'] / 2**20:,.0f} MiB ({c['compile_s']:.0f} s)"


def sweep(chips, kernels, quick):
    """One child process a chip, in its environment; rows printed as they come."""
    print("| kernel | chip | shape | ours: Mosaic kernels, HBM temporaries (compile s) | XLA reference: temporaries |")
    print("|---|---|---|---|---|")
    for chip in chips:
        rows = [i for i, (k, _) in enumerate(SWEEP) if k in kernels and (not quick or i in QUICK)]
        proc = subprocess.Popen([tpu_target.python_for(chip), __file__, "rows", chip, *map(str, rows)],
                                stdout=subprocess.PIPE, text=True, cwd=tpu_target.ROOT)
        for line in proc.stdout:
            r = json.loads(line)
            shape = ", ".join(f"{k} {v}" for k, v in r["shape"].items())
            ours = r["ours"]
            calls = "" if "error" in ours else f"{ours['mosaic_calls']} kernels, "
            print(f"| {r['kernel']} | {chip} | {shape} | {calls}{_cell(ours)} | {_cell(r['reference'])} |", flush=True)
        if proc.wait():
            print(f"| (the {chip} child failed: exit {proc.returncode}) |")


def main(argv):
    try:
        if argv[:1] == ["one"]:   # one KERNEL CHIP: the suite's case (no reference), as a JSON line
            print(json.dumps(compile_case(argv[1], argv[2], reference=False)))
        elif argv[:1] == ["rows"]:  # rows CHIP I...: sweep rows, in this environment
            for i in map(int, argv[2:]):
                kernel, shape = SWEEP[i]
                print(json.dumps(compile_case(kernel, argv[1], **shape)), flush=True)
        elif argv[:1] == ["sweep"]:
            opt = lambda flag, default: [argv[argv.index(flag) + 1]] if flag in argv else default
            sweep(opt("--chip", list(tpu_target.KINDS)), opt("--kernel", list(CASES)), "--quick" in argv)
        else:
            print(__doc__.split("\n\n")[-1], file=sys.stderr)
            return 2
    except tpu_target.TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
