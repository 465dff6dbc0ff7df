"""tpu_pod/kernels.py: our Pallas kernels, forward + backward, compiled for a TPU by the real compiler on
this CPU machine (tpu_pod/target.py), beside the XLA reference of the same computation.

Each case is a kernel at a production shape and the plain-JAX computation it replaces: attention
that materializes S x S scores, a cross-entropy over the full (rows, vocab) logits,
jax.lax.ragged_dot for the grouped matmul. Both are compiled, as the gradient of a scalar (forward
and backward), for one device of the chip; the compiler's verdict and HBM temporaries are printed
side by side. What a compile verifies: the kernels lower, Mosaic accepts them, their blocks fit the
chip's VMEM and the program its HBM. Not verified: numerics (the suite's interpret-mode tests do that
on CPU) or speed on a chip (the cost model does not see inside a Mosaic kernel).

    .venv/bin/python -m tpu_pod.kernels sweep [--chip tpu_v5p] [--kernel splash] [--quick]
    .venv/bin/python -m tpu_pod.kernels one ce tpu_v6e D=5120   # one case, a JSON line (the suite's test)
The sweep runs each chip in its environment (tpu_v7: .venv-tpu, python -m tpu_pod.target says why).
"""
import inspect
import json
import re
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import torch

import kernels_gmm
import kernels_pallas
import kernels_splash
from tpu_pod import target as tpu_target

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


def splash_case(statics, B=1, H=32, Hkv=8, S=8192, D=128, window=0, segments=0, causal=1):
    args = (spec((B, H, S, D), BF16), spec((B, Hkv, S, D), BF16), spec((B, Hkv, S, D), BF16), spec((B, S), I32))
    ours = lambda q, k, v, s: kernels_splash.splash_jax.jax_fn(q, k, v, s, **statics)
    ref = lambda q, k, v, s: _attention_reference(q, k, v, s, window, causal)
    return _grad_of_sum(ours, 3), _grad_of_sum(ref, 3), args, 3  # Mosaic kernels: fwd, dq, dkv


def ce_case(statics, N=8192, D=4096, V=128256):
    args = (spec((N, D), BF16), spec((V, D), BF16), spec((N,), I32))
    ours = lambda h, w, t: kernels_pallas.fused_ce_jax.jax_fn(h, w, t, **statics)

    def ref(h, w, t):
        logits = jnp.einsum("nd,vd->nv", h, w, preferred_element_type=jnp.float32)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), t[:, None], 1).mean()
    return _grad_of_sum(ours, 2), _grad_of_sum(ref, 2), args, 3  # fwd, dh, dw


def gmm_case(statics, M=8192, G=8, K=4096, N=14336):
    """Uneven groups with an empty one: the group sizes are data (a ShapeDtypeStruct), so the
    compiled program serves every split of M; the kernel's grid has room for the worst."""
    args = (spec((M, K), BF16), spec((G, K, N), BF16), spec((G,), I32))
    ours = lambda x, w, gs: kernels_gmm.gmm_jax.jax_fn(x, w, gs, **statics)
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


def _entry_call(kernel, shape):
    """Each kernel's PyTorch entry point (what the model's tables call) on meta tensors of the case's
    shape, its op replaced by a recorder: the static arguments (the tiles) it passes its op."""
    meta = lambda *size, dtype=torch.bfloat16: torch.empty(size, dtype=dtype, device="meta")
    g = {name: p.default for name, p in inspect.signature(CASES[kernel]).parameters.items() if name != "statics"}
    g.update(shape)
    module, op, call = {
        "splash": (kernels_splash, "splash_jax", lambda: kernels_splash.splash_attention(
            meta(g["B"], g["H"], g["S"], g["D"]), meta(g["B"], g["Hkv"], g["S"], g["D"]),
            meta(g["B"], g["Hkv"], g["S"], g["D"]), g["window"] or None,
            meta(g["B"], g["S"], dtype=torch.int32) if g["segments"] else None, causal=bool(g["causal"]))),
        "ce": (kernels_pallas, "fused_ce_jax", lambda: kernels_pallas.fused_linear_cross_entropy(
            meta(g["N"], g["D"]), meta(g["V"], g["D"]), meta(g["N"], dtype=torch.int32))),
        "gmm": (kernels_gmm, "gmm_jax", lambda: kernels_gmm.gmm(
            meta(g["M"], g["K"]), meta(g["G"], g["K"], g["N"]), meta(g["G"], dtype=torch.int32))),
    }[kernel]
    with mock.patch.object(module, op, lambda *args, **statics: statics):
        return call()


def training_statics(kernel, chip, **shape):
    """The tiles a training step running on `chip` passes the kernel (its entry point's own choice)."""
    with mock.patch.object(kernels_pallas, "running_chip", lambda: chip):
        return _entry_call(kernel, shape)


def compile_case(kernel, chip, reference=True, **shape):
    """{kernel, chip, shape, statics, ours: Compiled fields, reference: Compiled fields or its error}.
    Ours as a training step on `chip` runs it: this process taken for one on that chip (the chip
    found as kernels_pallas.running_chip finds it), the kernel's tiles those its PyTorch entry point
    passes there (training_statics), the kernels lowered through that path alone (the harness names
    no chip: lower_kernels=False). The reference: plain JAX, as XLA compiles it."""
    statics = training_statics(kernel, chip, **shape)
    ours_fn, ref_fn, args, n_kernels = CASES[kernel](statics, **shape)
    row = {"kernel": kernel, "chip": chip, "shape": shape, "expected_mosaic_calls": n_kernels, "statics": statics}
    try:
        with mock.patch.object(kernels_pallas, "running_chip", lambda: chip):
            row["ours"] = vars(tpu_target.compile(ours_fn, *args, chip=chip, lower_kernels=False))
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
        proc = subprocess.Popen([tpu_target.python_for(chip), "-m", "tpu_pod.kernels", "rows", chip, *map(str, rows)],
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
        if argv[:1] == ["one"]:   # one KERNEL CHIP [NAME=INT ...]: the suite's case (no reference), a JSON line
            shape = {k: int(v) for k, v in (a.split("=") for a in argv[3:])}
            row = compile_case(argv[1], argv[2], reference=False, **shape)
            row["device_kind"] = tpu_target.devices(argv[2])[0].device_kind  # (what a chip of it reports)
            print(json.dumps(row))
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
