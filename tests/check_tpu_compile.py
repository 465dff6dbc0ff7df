# python -m tpu_pod.target + tpu_pod/kernels.py: our Pallas kernels compiled for a TPU. Oracle: the TPU compiler
# itself (XLA:TPU and Mosaic, in libtpu, on compile-only devices: no chip), which refuses a block
# layout Mosaic cannot lower, a kernel whose blocks overflow VMEM, temporaries that overflow HBM.
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import os

import pytest

from tests import launch

MiB = 2**20


def _compiled(kernel, chip, shape):
    """`python -m tpu_pod.kernels one KERNEL CHIP SHAPE` in a fresh process (libtpu loads into it, never
    into the suite's): its JSON row. A missing compile environment fails here, in one line."""
    rc, out, err = launch.python(["-m", "tpu_pod.kernels", "one", kernel, chip, *(f"{k}={v}" for k, v in shape.items())],
                                 timeout=600)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 0, (lines or ["(no stderr)"])[-1]
    row = json.loads(out.strip().splitlines()[-1])
    ours = row["ours"]
    assert "error" not in ours, f"the TPU compiler refused our {kernel} at {row['statics']}: {ours.get('error')}"
    assert ours["fits"], ours["message"]
    # forward + both backward kernels went through Mosaic (interpret mode would leave none)
    assert ours["mosaic_calls"] == row["expected_mosaic_calls"], ours["mosaic_calls"]
    return row


@pytest.mark.parametrize("kernel, chip, shape, temp_below", [
    # splash, B 1, 32 query / 8 kv heads, S 8192, D 128, causal: XLA's attention keeps 32 heads of
    # fp32 S x S scores (8 GiB); ours per-row vectors and the forward's output (measured 256 MiB):
    # bound 1/16 of the scores
    ("splash", "tpu_v5p", {}, 32 * 8192 * 8192 * 4 // 16),
    # fused CE, 8192 rows, hidden 4096, Llama 3's vocab 128256 (Llama 3 8B): the fp32 logits are
    # 3.9 GiB; ours none of that size (measured 4 MiB; 2 GiB when the vocabulary was padded to whole
    # tiles: a copy of w and of its gradient): bound 64 MiB. Without the chip's VMEM limit on this
    # path the dW kernel overflows v5p's default scoped VMEM
    ("ce", "tpu_v5p", {}, 64 * MiB),
    # the same at Qwen3-14B's width 5120 and vocabulary 151936 on v6e (measured: no temporaries)
    ("ce", "tpu_v6e", dict(D=5120, V=151936), 64 * MiB),
    # gmm, Mixtral's experts: 8192 rows x 4096 by 8 x 4096 x 14336, group sizes data (any split:
    # uneven, empty): bound the bf16 weights' size (measured 224 MiB: the row tiles' padding, dx).
    # With K and N whole (interpret mode's tiles) one expert's weight is a 112 MiB block: VMEM refuses it
    ("gmm", "tpu_v5p", {}, 8 * 4096 * 14336 * 2),
    # Qwen3-235B-A22B's 128 experts of 4096 x 1536 on v6e (measured 48 MiB)
    ("gmm", "tpu_v6e", dict(M=16384, G=128, K=4096, N=1536), 128 * 4096 * 1536 * 2),
])
def test_a_training_step_on_a_chip_runs_kernels_that_compile(kernel, chip, shape, temp_below):
    """Each kernel's forward + backward at a production shape, compiled as a training step on that
    chip calls it: its PyTorch entry point's own tiles there (the model's tables call it), the chip
    found as a process on it finds it (jax's device_kind, here the compile-only device's), the VMEM
    limit set through that path alone. Mosaic lowers all three kernels, their blocks fit VMEM (the
    compiler's check), and the HBM temporaries are a fraction of what the XLA computation it replaces
    materializes."""
    import kernels_pallas
    row = _compiled(kernel, chip, shape)
    assert kernels_pallas.chip_of(row["device_kind"]) == chip, row["device_kind"]
    ours = row["ours"]
    assert ours["temp_bytes"] < temp_below, (ours["temp_bytes"] / MiB, temp_below / MiB)


# A scanned FSDP step of plain JAX ops, 64 layers of (4096, 4096) weights sharded over v5p:2x2x1's 4
# devices, each layer's input kept for the backward: as jax.checkpoint's input (argument "inputs"), or
# named and saved in HBM ("keep") or offloaded to host memory ("offload") by a checkpoint policy, as
# MaxText's decoder_layer_input; printed: one JSON row a token count. Compiled at --compile-effort -1
# (0.6 s a compile, 5 s at XLA's default): what these tests read is how the compiler accounts for
# the schedule it made (its peak, its host buffers), which holds at either effort; the token counts
# at the edge of HBM are -1's schedule's (at 0 the edge is 16384 tokens further on)
_SCANNED_STEP = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tpu_pod import target as tpu_target
mesh = Mesh(np.array(tpu_target.devices("tpu_v5p", "v5p:2x2x1")), ("x",))
names = jax.checkpoint_policies
policy = {"keep": names.save_only_these_names("x"), "offload": names.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=["x"], offload_src="device", offload_dst="pinned_host")}
def loss(w_LxDxD, x_TxD):
    def layer(h, w):
        w = jax.lax.with_sharding_constraint(w.astype(jnp.bfloat16), NamedSharding(mesh, P()))  # (gathered)
        if sys.argv[1] == "inputs":
            return jax.checkpoint(lambda h, w: h + jnp.tanh(h @ w) @ w.T)(h, w), None
        named = lambda h, w: (lambda h: h + jnp.tanh(h @ w) @ w.T)(checkpoint_name(h, "x"))
        return jax.checkpoint(named, policy=policy[sys.argv[1]])(h, w), None
    return (jax.lax.scan(layer, x_TxD, w_LxDxD)[0].astype(jnp.float32) ** 2).mean()
def step(w, x):
    value, grad = jax.value_and_grad(loss)(w, x)
    return value, w - 0.1 * grad
for tokens in map(int, sys.argv[2:]):
    c = tpu_target.compile(step, jax.ShapeDtypeStruct((64, 4096, 4096), jnp.float32, sharding=NamedSharding(mesh, P(None, "x"))),
                           jax.ShapeDtypeStruct((tokens, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))),
                           chip="tpu_v5p", donate_argnums=(0,), effort=-1)
    print(json.dumps({"tokens": tokens, "fits": c.fits, "message": c.message, "hbm": c.hbm_bytes, "summed": c.summed_bytes,
                      "peak": c.peak_bytes, "host": c.host_bytes}))
"""


def _scanned_steps(layer_input, *tokens):
    """_SCANNED_STEP's rows, each layer's input kept as `layer_input` says, at each token count."""
    rc, out, err = launch.python(["-c", _SCANNED_STEP, layer_input, *map(str, tokens)], timeout=600)
    assert rc == 0, (err.strip().splitlines() or ["(no stderr)"])[-1]
    return [json.loads(ln) for ln in out.strip().splitlines()[-len(tokens):]]


def test_a_fit_is_judged_on_the_compilers_peak_not_on_memory_analysis_sizes_added_up():
    """memory_analysis's sizes added up (arguments + temporaries + outputs) over-count a scanned step:
    at 671744 and 688128 tokens they exceed v5p's HBM, yet libtpu compiles both; 16384 tokens more and
    it runs out of HBM, its "Used" the peak's line through the first two (measured within 0.01 GiB),
    not the sums' (measured 5.1 GiB over; at XLA's default effort, 16384 tokens on: 0.01 and 3.3).
    So Compiled.hbm_bytes is the peak (peak_memory_in_bytes; with no host buffers, which it counts
    too), and step_compile judges a fit on it. (Mixtral 8x7B on v5p-128: the sum 120.9 GiB, the peak
    83.0, a program libtpu compiles: docs/planning.md.)"""
    import re
    first, second, third = _scanned_steps("inputs", 671744, 688128, 704512)
    used, capacity = map(float, re.search(r"Used ([\d.]+)G of ([\d.]+)G hbm", third["message"]).groups())
    GiB = 2**30
    assert first["fits"] and second["fits"] and not third["fits"], third["message"]
    assert first["summed"] > capacity * GiB and second["summed"] > capacity * GiB, (first, second, capacity)
    assert second["hbm"] <= capacity * GiB < used * GiB, (second["hbm"] / GiB, capacity, used)
    line = lambda key: (2 * second[key] - first[key]) / GiB  # (the third token count is as far on)
    print(f"the compiler's Used {used} GiB; the peak's line {line('hbm'):.3f}, the sums' {line('summed'):.3f}")
    assert abs(line("hbm") - used) <= 0.05 and line("summed") - used > 1.0, (line("hbm"), line("summed"), used)


def test_with_host_buffers_the_hbm_figure_is_what_the_buffer_assignment_reserves_in_hbm():
    """A program with host buffers (each layer's input offloaded, as --scan --offload does): its peak
    (memory_analysis's peak_memory_in_bytes) counts host buffers, so Compiled.hbm_bytes is the HBM its
    buffer assignment reserves (tpu_target._hbm_allocated, read from XLA's dump). Oracle: the same
    step with the inputs kept in HBM, a program with no host buffers, whose peak is HBM's alone (the
    test above): it holds what the offloaded step holds in HBM plus the inputs it moved to host, within
    0.01 GiB (measured 0.0001; 0.0003 at XLA's default effort). Before, the figure was memory_analysis's
    sizes added up: 2.56 GiB over (1.56 at the default effort)."""
    tokens = 262144
    offloaded, kept = _scanned_steps("offload", tokens)[0], _scanned_steps("keep", tokens)[0]
    GiB, inputs = 2**30, 64 * tokens // 4 * 4096 * 2  # (64 layers' bf16 inputs of a device's rows)
    assert offloaded["host"] == inputs and kept["host"] == 0, (offloaded["host"], kept["host"])
    assert offloaded["peak"] >= inputs, offloaded["peak"] / GiB  # (its peak counts the host buffers)
    moved = (offloaded["hbm"] + inputs - kept["hbm"]) / GiB
    print(f"HBM offloaded {offloaded['hbm'] / GiB:.4f} + inputs {inputs / GiB:.1f} against kept {kept['hbm'] / GiB:.4f} GiB: "
          f"{moved:+.4f}; the sizes added up {(offloaded['summed'] + inputs - kept['hbm']) / GiB:+.4f}")
    assert abs(moved) <= 0.01, moved


def test_the_ironwood_links_follow_a_rebuilt_tpu_environment(tmp_path, monkeypatch):
    """tpu_target.step_jax_path: .jax-tpu7x links to .venv-tpu's jax, jaxlib, libtpu and ml_dtypes with
    their versioned metadata. After .venv-tpu is rebuilt with another libtpu pin, a link to the old
    libtpu's dist-info leads nowhere: the folder is made again, its links to what is there now, and
    what they led to is untouched. Oracle: the links read back (os.readlink). Before, the first
    folder was kept whatever .venv-tpu became (the old version's metadata named, the new one's not)."""
    from tpu_pod import target as tpu_target
    packages = tmp_path / ".venv-tpu" / "lib" / "python3.11" / "site-packages"
    for name in ("jax", "jaxlib", "libtpu", "ml_dtypes", "jax-0.10.2.dist-info", "libtpu-0.0.52.dist-info"):
        (packages / name).mkdir(parents=True)
    monkeypatch.setattr(tpu_target, "ROOT", str(tmp_path))
    where = tpu_target.step_jax_path("tpu_v7")
    assert sorted(os.listdir(where)) == ["jax", "jax-0.10.2.dist-info", "jaxlib", "libtpu", "libtpu-0.0.52.dist-info",
                                         "ml_dtypes"]
    (packages / "libtpu-0.0.52.dist-info").rename(packages / "libtpu-0.0.51.dist-info")  # (the rebuild's pin)
    assert tpu_target.step_jax_path("tpu_v7") == where
    assert sorted(os.listdir(where)) == ["jax", "jax-0.10.2.dist-info", "jaxlib", "libtpu", "libtpu-0.0.51.dist-info",
                                         "ml_dtypes"]
    assert all(os.readlink(os.path.join(where, n)) == str(packages / n) for n in os.listdir(where))
    assert all((packages / n).is_dir() for n in os.listdir(where))  # (the environment's own folders kept)


def test_a_compile_environment_that_is_not_there_is_named(monkeypatch):
    """MINITITAN_LIBTPU naming no libtpu is said as that (not as an environment never built); a
    compile with neither --mesh nor --chips names the smallest slice and the flag to give."""
    from tpu_pod import target as tpu_target
    rc, out, err = launch.python(["train.py", "--dry-run", "--compile", "--flavor", "llama3_debug"], timeout=300)
    assert rc == 2 and err.strip().splitlines() == [
        "error: the smallest tpu_v5p slice (v5p:2x2x1) has 4 chips; the mesh lays out 1: give --mesh ici=4 or --chips 4"], err
    monkeypatch.setenv("MINITITAN_LIBTPU", "/nonexistent")
    with pytest.raises(tpu_target.TargetError, match="MINITITAN_LIBTPU=/nonexistent names no libtpu"):
        tpu_target.libtpu_path()


_LONG_COMPILE = """
import os, signal, sys, threading, time
import jax, jax.numpy as jnp
from tpu_pod import target
def f(x):
    for i in range(1500):
        x = jnp.sin(x) * (i + 1.0) + jnp.cos(x[::-1])
    return x
lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((64,), jnp.float32))
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.perf_counter()
try:
    (target.interruptible if sys.argv[1] == "worker" else (lambda g: g()))(lambda: lowered.compile())
    print(f"compiled in {time.perf_counter() - start:.2f} s", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.perf_counter() - start:.2f} s", flush=True)
os._exit(0)
"""


def test_ctrl_c_stops_a_compile_at_once_and_a_dry_run_says_it_wrote_nothing(capsys):
    """A compile spends its time inside the compiler's C++, where Python runs no signal handler: Ctrl-C
    during `--dry-run --compile` waited for the compile's end (tens of seconds to minutes). The compile
    runs in a worker thread (tpu_target.interruptible) and the main thread takes SIGINT at once. Oracle:
    the same compile (XLA:CPU, ~7 s here) called directly, which SIGINT 1 s in does not stop before
    its end. And the dry run's line says it wrote nothing (there is no checkpoint to name)."""
    import signal
    from run import process
    env = {"JAX_PLATFORMS": "cpu"}
    _, direct, _ = launch.python(["-c", _LONG_COMPILE, "direct"], env=env, timeout=300)
    _, worker, _ = launch.python(["-c", _LONG_COMPILE, "worker"], env=env, timeout=300)
    waited, stopped = (float(out.split()[-2]) for out in (direct, worker))
    assert direct.startswith("interrupted after") and waited > 2.5, direct  # (the compile itself outlasts 2.5 s)
    assert worker.startswith("interrupted after") and stopped < 2.0, worker

    def dry_run(argv, at):
        at.dry_run = True
        raise KeyboardInterrupt
    assert process.run(dry_run) == 128 + signal.SIGINT
    assert capsys.readouterr().err == "error: interrupted by SIGINT during the dry run (it writes nothing)\n"


def test_the_environment_check_refuses_a_bad_command_line_in_one_line(capsys):
    """`python -m tpu_pod.target CHIP [TOPOLOGY | CHIPS]` (a check of the compile environment: one matmul compiled):
    no chip, another chip's name, or a word past the topology (it was ignored) is the usage line; a
    topology of another chip or no chip count is one `error:` line. Exit 2 each, before any compile."""
    from tpu_pod import target as tpu_target
    usage = "usage: python -m tpu_pod.target {tpu_v5p,tpu_v6e,tpu_v7} [TOPOLOGY | CHIPS]"
    for argv, said in (([], usage), (["tpu_v9"], usage), (["tpu_v5p", "4", "extra"], usage),
                       (["tpu_v5p", "v6e:2x2"], "error: topology 'v6e:2x2' is not a tpu_v5p one (v5p:...)"),
                       (["tpu_v5p", "0"], "error: a tpu_v5p topology has 1-4 chips (one host's) or a power of two, not 0")):
        assert tpu_target.main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines() == [said], argv
