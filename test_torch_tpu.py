"""test_torch_tpu.py: our TorchTPU branch against the real torch_tpu 0.2.0, on a machine without TPU.

Runs in the TorchTPU environment (requirements-tpu.txt: torch 2.13, torch_tpu, libtpu, jax 0.10), not
in the main one (torch 2.9 + torch_xla), so it is its own file:

    .venv-tpu/bin/python -m pytest -q test_torch_tpu.py

What a CPU machine can check, and does: `import torch_tpu` succeeds and reports no device, so
`--device tpu` fails in one line naming what is missing and `--device auto` takes the CPU; every
torch_tpu name device.py and jax_op.py call exists with the signature they call it with; and one of
our Pallas kernels registered through torch_tpu's own `torch.tpu.pallas.jax_op` gets its schema,
its fake (shapes from jax.export for TPU: no chip needed) and, through torch_tpu's JAX-array interop
branch (it runs the jitted kernel on the tensors' JAX arrays, here on JAX's CPU backend), values
equal to a plain PyTorch loop. What needs a chip (torch_tpu's kernel launch, Mosaic) is not run.
"""
import inspect
import os
import subprocess
import sys

# JAX's own TPU probe (libtpu is installed here) waits on cloud metadata that this machine does not
# have; the checks below need JAX's CPU backend only. torch_tpu's PCI scan is unaffected.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import device as dev  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------
# device.py: is there a TPU, and what does --device say where there is none

def test_torch_tpu_imports_and_reports_no_device_so_auto_is_cpu_and_tpu_is_refused(monkeypatch):
    # `import torch` already imported torch_tpu: it is a device-backend entry point that torch autoloads
    assert "torch_tpu" in sys.modules
    from torch_tpu._internal.utils import hardware
    # oracle: torch_tpu's own PCI scan for Google TPUs (what its loader uses to register "tpu")
    assert hardware.get_tpu_device_count() == 0
    assert not torch.accelerator.is_available()
    native, why = dev.torchtpu_status()
    assert not native and "torch_tpu 0.2.0 is installed but found no TPU chip" in why
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert dev.pick_device("auto") == torch.device("cpu")
    with pytest.raises(dev.DeviceUnavailable, match=r"torch_tpu 0\.2\.0 is installed but found no TPU "
                                                     r"chip.*PJRT_DEVICE is not TPU"):
        dev.pick_device("tpu")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # the torch_xla route: not installed in this env
    with pytest.raises(dev.DeviceUnavailable, match="PJRT_DEVICE=TPU needs torch_xla"):
        dev.pick_device("tpu")


def _train_device_tpu(tmp_path, hide_torch_tpu):
    """train.py --device tpu in a real process; `hide_torch_tpu` makes `import torch_tpu` fail as
    where it is not installed (the main environment)."""
    out = tmp_path / ("hidden" if hide_torch_tpu else "installed")
    argv = ["train.py", "--device", "tpu", "--steps", "1", "--out-dir", str(out)]
    code = ("import runpy, sys; sys.argv = %r; %s runpy.run_path('train.py', run_name='__main__')"
            % (argv, "sys.modules['torch_tpu'] = None;" if hide_torch_tpu else ""))
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    if hide_torch_tpu:  # torch itself imports torch_tpu at `import torch` (a device-backend entry point)
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                       text=True, timeout=300)
    return r, out


@pytest.mark.parametrize("hide_torch_tpu, missing", [
    (False, "torch_tpu 0.2.0 is installed but found no TPU chip (torch.accelerator reports no accelerator)"),
    (True, "torch_tpu is not installed"),
])
def test_device_tpu_without_a_tpu_is_one_error_line_exit_2(hide_torch_tpu, missing, tmp_path):
    r, out = _train_device_tpu(tmp_path, hide_torch_tpu)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(errors) == 1 and missing in errors[0] and "PJRT_DEVICE is not TPU" in errors[0], errors
    assert "Traceback" not in r.stderr and not out.exists()


# ------------------------------------------------------------------------------------------------
# every torch_tpu name our code calls, with the signature we call it with

def test_the_torch_tpu_names_we_call_exist_with_our_signatures():
    import torch_tpu  # noqa: F401
    import torch_tpu._loader as loader
    from torch_tpu._internal.utils import hardware
    # device.py: availability, sync, memory (torch.accelerator, which TorchTPU backs)
    for name in ("is_available", "current_accelerator", "synchronize", "max_memory_allocated",
                 "reset_peak_memory_stats"):
        inspect.signature(getattr(torch.accelerator, name)).bind()  # we call each with no argument
    inspect.signature(torch.tpu.get_device_name).bind()
    # every chip name torch_tpu reports (its PCI table) has a published peak in device.py
    for chip in hardware._PCI_DEVICE_ID_TO_NAME.values():
        assert dev._lookup_published_peak(chip.lower())[0] is not None, chip
    # compile backend: "tpu" is registered with dynamo at import; torch_tpu refuses inductor on TPU
    assert dev.compile_backend("tpu") == "tpu" and "tpu" in torch._dynamo.list_backends(exclude_tags=())
    # process-group backend: registered as "tpu" when the loader finds chips (read from its source)
    assert dev.dist_backend("tpu") == "tpu"
    init_src = " ".join(inspect.getsource(loader._init_device_impl).split())
    assert '"tpu", tpu_distributed.create_process_group' in init_src
    # jax_op.py: torch.tpu.pallas.jax_op(name, fn) with both positional
    params = list(inspect.signature(torch.tpu.pallas.jax_op).parameters.values())
    assert [(p.name, p.kind) for p in params[:2]] == [("name", inspect.Parameter.POSITIONAL_ONLY),
                                                      ("fn", inspect.Parameter.POSITIONAL_ONLY)]
    # README's table names these: eager modes, the mesh helper, the optimizer and ops
    assert {m.name for m in torch.tpu.EagerMode} >= {"DEFER_AND_FUSE", "DEFER_NEVER",
                                                     "DEFER_NEVER_AND_LAUNCH_BLOCKING"}
    inspect.signature(torch.tpu.set_eager_mode).bind(torch.tpu.EagerMode.DEFER_NEVER)
    inspect.signature(torch.tpu.distributed.topology_aware_mesh).bind((2, 4), dcn_mesh_shape=(2, 1))
    for name in ("splash_sdpa", "ragged_dot", "ragged_all_to_all", "all_gather_dim", "reduce_scatter_dim"):
        assert callable(getattr(torch.tpu.ops, name)), name
    assert {"AdamW", "SingleTraceTrainer"} <= set(dir(torch.tpu.optimizers))


# ------------------------------------------------------------------------------------------------
# one of our Pallas kernels through torch_tpu's own jax_op

class JaxBacked(torch.Tensor):
    """A CPU tensor that carries a JAX array as `_elem` (and `_env`): the two attributes torch_tpu's
    JaxCallable looks for to run the jitted kernel on JAX arrays (its torchax interop branch)
    instead of launching on a TPU. The torch storage is a placeholder of the right shape."""

    @staticmethod
    def __new__(cls, elem, env=None):
        dtype = {"float32": torch.float32, "int32": torch.int32}[str(elem.dtype)]
        t = torch.Tensor._make_subclass(cls, torch.empty(elem.shape, dtype=dtype))
        t._elem, t._env = elem, env
        return t


def _gmm_loop(x, w, sizes):
    """Oracle: each group's rows times its expert's matrix, written as a loop."""
    rows, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        rows.append(x[start:start + n] @ w[g])
        start += n
    return torch.cat(rows)


def test_our_gmm_kernel_through_torch_tpus_jax_op_schema_fake_and_values():
    import jax_op
    import kernels_gmm as kp  # (the grouped matmul)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 16, generator=gen), torch.randn(3, 16, 8, generator=gen)
    sizes = torch.tensor([12, 0, 28], dtype=torch.int32)
    block_m = 16
    ours = kp.gmm(x, w, sizes, block_m=block_m)
    torch.testing.assert_close(ours, _gmm_loop(x, w, sizes), atol=1e-5, rtol=1e-5)

    fwd = jax_op.native_tpu_op(kp.gmm_jax.jax_fn, 3, ("block_m",), False)
    assert type(fwd).__module__.startswith("torch_tpu.")  # torch_tpu's CustomOpDef, not ours
    assert str(fwd._opoverload._schema) == \
        "minititan_tpu::gmm_jax(Tensor x0, Tensor x1, Tensor x2, *, SymInt block_m) -> Tensor"
    with FakeTensorMode() as mode:  # torch_tpu's fake: jax.export of our kernel for TPU
        fx, fw, fs = (mode.from_tensor(t) for t in (x, w, sizes))
        fake_theirs = fwd(fx, fw, fs, block_m=block_m)
        fake_ours = kp.gmm_jax(fx, fw, fs, block_m=block_m)
    assert fake_theirs.shape == fake_ours.shape == ours.shape and fake_theirs.dtype == ours.dtype

    arrays = [JaxBacked(jax.numpy.asarray(t.numpy())) for t in (x, w, sizes)]
    theirs = fwd(*arrays, block_m=block_m)
    torch.testing.assert_close(torch.from_numpy(np.array(theirs._elem)), _gmm_loop(x, w, sizes),
                               atol=1e-5, rtol=1e-5)

    # the backward op (many outputs: Tensor[]) through the same door, against torch autograd
    bwd = jax_op.native_tpu_op(jax_op.vjp_fn(kp.gmm_jax.jax_fn, (True, True, False)), 4, ("block_m",), True)
    assert str(bwd._opoverload._schema).endswith("*, SymInt block_m) -> Tensor[]")
    dy = torch.randn(40, 8, generator=gen)
    dx, dw = bwd(*arrays, JaxBacked(jax.numpy.asarray(dy.numpy())), block_m=block_m)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    _gmm_loop(xr, wr, sizes).backward(dy)
    torch.testing.assert_close(torch.from_numpy(np.array(dx._elem)), xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.from_numpy(np.array(dw._elem)), wr.grad, atol=1e-4, rtol=1e-4)


def test_our_jax_op_splits_tensors_and_statics_as_torch_tpus_does():
    import jax_op

    def axpy(x, y, *, alpha):  # ours: unannotated JAX code, keyword-only = static
        return alpha * x + y

    def axpy_annotated(x: jax.Array, y: jax.Array, *, alpha: int) -> jax.Array:  # TorchTPU's form
        return alpha * x + y

    ours = jax_op.jax_op("minititan_test::axpy")(axpy)
    theirs = torch.tpu.pallas.jax_op("minititan_test_tt::axpy", axpy_annotated)
    kinds = lambda schema: {a.name: str(a.type) == "Tensor" for a in schema.arguments}  # noqa: E731
    assert kinds(ours.op._opoverload._schema) == kinds(theirs._opoverload._schema) == \
        {"x": True, "y": True, "alpha": False}
    x, y = torch.arange(4.0), torch.ones(4)
    torch.testing.assert_close(ours(x, y, alpha=3), 3 * x + y)
    with pytest.raises(TypeError, match="keyword-only"):
        jax_op.jax_op("minititan_test::axpy2", static=("beta",))(axpy)
