"""jax_op.py: a JAX function becomes a PyTorch operator (after TorchTPU's torch.tpu.pallas.jax_op).

    @jax_op("splash")
    def splash(q, k, v, segment_ids, *, window, block): ...      # JAX code, e.g. a pallas_call

registers `minititan::splash` with torch.library.custom_op. The contract is TorchTPU's (torch_tpu
0.2.0, `_internal/pallas/pallas.py`), read off the function's signature: the op schema's tensors are
the positional parameters, its static arguments (compile-time constants: a new value is a new
compilation) the keyword-only ones. TorchTPU reads the same split from annotations (`jax.Array` ->
Tensor, int/float/bool/str -> static) and requires them; ours are unannotated JAX code, so the `*`
marks the split, and statics are ints. Then:
  - fake/meta: shapes come from jax.eval_shape (TorchTPU: from the jax.export'ed program's output
    avals), so make_fx and torch.compile see ONE opaque node;
  - autograd: the backward is a second op, `minititan::splash_vjp`, computed by jax.vjp (a kernel
    with a jax.custom_vjp brings its own Pallas backward kernels). The forward is re-run inside the
    vjp op: a rematerialization traded for a stateless bridge. TorchTPU's jax_op registers no
    backward: its splash_sdpa pairs two ops in a torch.autograd.Function and saves (out, lse);
  - implementation, by the inputs' device:
      CPU tensors -> zero-copy DLPack into JAX CPU arrays, the jitted function, DLPack back;
      XLA tensors -> torch_xla's call_jax: the JAX program is embedded in the same XLA graph as the
                     rest of the step (one compiled program, kernel included);
      TorchTPU    -> the same function registered once through torch.tpu.pallas.jax_op, with our
                     reading of its signature written as annotations (`native_tpu_op`): TorchTPU
                     exports it for TPU and runs the Mosaic kernel itself (checked on CPU by
                     test_torch_tpu.py; never run on a TPU).
Integer tensors are handed to JAX as int32 (JAX runs without x64), and only floating inputs get
gradients. Every op has one tensor output.
"""
import functools
import inspect
import re

import jax
import torch

import device as dev

_LIB = "minititan"


def _to_jax(t):
    if not t.dtype.is_floating_point and t.dtype != torch.int32:
        t = t.to(torch.int32)
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def _to_torch(a):
    return torch.from_dlpack(a)


def _schema_types(tensor_names, static, n_out):
    args = ", ".join([f"Tensor {n}" for n in tensor_names] + [f"int {s}" for s in static])
    return f"({args}) -> " + ("Tensor" if n_out == 1 else "Tensor[]")


@functools.lru_cache(maxsize=None)
def _closure(fn, statics):
    """One Python function per (kernel, static config): call_jax caches compilations by its id."""
    kw = dict(statics)

    def call(*arrays):
        return fn(*arrays, **kw)

    return call


def _run(fn, tensors, statics, many=False):
    """Evaluate JAX `fn` on torch tensors (all on one device), returning torch tensor(s) (a list
    where `many`)."""
    device = tensors[0].device
    if dev.is_xla(device):
        import torch_xla.core.xla_builder as xb
        ints = [t.to(torch.int32) if not t.dtype.is_floating_point else t for t in tensors]
        return xb.call_jax(_closure(fn, statics), tuple(ints),
                           override_hash=hash((fn.__module__, fn.__qualname__, statics)))
    if dev.is_tpu(device):  # (not XLA, handled above) TorchTPU: its bridge compiles through Mosaic directly.
        op = native_tpu_op(fn, len(tensors), tuple(k for k, _ in statics), many)
        return op(*tensors, **dict(statics))
    if device.type != "cpu":
        host = _run(fn, [t.cpu() for t in tensors], statics, many)
        return [h.to(device) for h in host] if isinstance(host, (list, tuple)) else host.to(device)
    out = _jit(fn, statics)(*map(_to_jax, tensors))
    return [_to_torch(o) for o in out] if isinstance(out, (list, tuple)) else _to_torch(out)


@functools.lru_cache(maxsize=None)
def native_tpu_op(fn, n_tensors, static, many):
    """`fn` as TorchTPU's own op, registered once: torch.tpu.pallas.jax_op(name, fn) requires a
    namespaced name and a fully annotated signature, and infers the schema and the static arguments
    (here the keyword-only ints) from it. Its fake implementation runs jax.export for TPU, which
    needs no chip; running it does."""
    from torch.tpu.pallas import jax_op as tpu_jax_op  # torch_tpu only (requirements-tpu.txt)

    def kernel(*arrays, **statics):
        return fn(*arrays, **statics)

    P = inspect.Parameter
    kernel.__signature__ = inspect.Signature(
        [P(f"x{i}", P.POSITIONAL_OR_KEYWORD, annotation=jax.Array) for i in range(n_tensors)]
        + [P(k, P.KEYWORD_ONLY, annotation=int) for k in static],
        return_annotation=list[jax.Array] if many else jax.Array)
    kernel.__name__ = re.sub(r"\W+", "_", fn.__qualname__).strip("_")
    return tpu_jax_op(f"{_LIB}_tpu::{kernel.__name__}", kernel)


@functools.lru_cache(maxsize=None)
def _jit(fn, statics):
    return jax.jit(_closure(fn, statics))


def _jax_dtype_of(t):
    if t.dtype.is_floating_point:
        return {torch.float32: jax.numpy.float32, torch.bfloat16: jax.numpy.bfloat16,
                torch.float16: jax.numpy.float16}[t.dtype]
    return jax.numpy.int32


def _torch_dtype_of(d):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "int32": torch.int32}[str(d)]


@functools.lru_cache(maxsize=None)
def vjp_fn(fn, float_mask):
    """JAX: (*inputs, cotangent) -> grads of the floating inputs, via jax.vjp."""
    def vjp(*args, **statics):
        *inputs, cot = args
        floats = [x for x, f in zip(inputs, float_mask) if f]

        def only_floats(*fl):
            it = iter(fl)
            return fn(*[next(it) if f else x for x, f in zip(inputs, float_mask)], **statics)

        _, pullback = jax.vjp(only_floats, *floats)
        return list(pullback(cot.astype(_result_dtype(only_floats, floats))))
    vjp.__qualname__ = fn.__qualname__ + f"_vjp{float_mask}"
    vjp.__module__ = fn.__module__
    return vjp


def _result_dtype(f, args):
    return jax.eval_shape(f, *args).dtype


KERNELS = {}  # op name ("minititan::splash") -> its registered call: .op, .vjp_op, .jax_fn, .n_tensors,
# .statics (tpu_pod/step_compile.py lowers each as its JAX function when it compiles the step for a TPU)


def jax_op(name, static=None):
    """Decorator: register JAX function `fn(*tensors, *, static_ints)` as torch op `name`
    ("ns::name", or "name" in namespace minititan). Tensors are the positional parameters, statics the
    keyword-only ones; `static`, where given, must name exactly those."""

    def deco(fn):
        sig = inspect.signature(fn).parameters.values()
        params = [p.name for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        statics = tuple(p.name for p in sig if p.kind is p.KEYWORD_ONLY)
        defaults = {p.name: p.default for p in sig if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
        if static is not None and set(static) != set(statics):
            raise TypeError(f"jax_op {name!r}: static={tuple(static)} but the keyword-only "
                            f"parameters (the statics) are {statics}")
        return _register(fn, name if "::" in name else f"{_LIB}::{name}", params, statics, defaults)
    return deco


def _register(fn, qualified, params, static, defaults):
    """The forward op, its fake, and the vjp op wired as its backward."""
    fwd = torch.library.custom_op(qualified, mutates_args=(),
                                  schema=_schema_types(params, static, 1))(
        lambda *args: _run(fn, list(args[:len(params)]), tuple(zip(static, args[len(params):]))))

    @fwd.register_fake
    def _(*args):
        tensors, statics = args[:len(params)], dict(zip(static, args[len(params):]))
        specs = [jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype_of(t)) for t in tensors]
        out = jax.eval_shape(functools.partial(fn, **statics), *specs)
        return tensors[0].new_empty(out.shape, dtype=_torch_dtype_of(out.dtype))

    bwd = torch.library.custom_op(f"{qualified}_vjp", mutates_args=(),
                                  schema=_schema_types(params + ["cotangent"], static, 2))(
        lambda *args: _run(vjp_fn(fn, tuple(t.dtype.is_floating_point for t in args[:len(params)])),
                           list(args[:len(params) + 1]),
                           tuple(zip(static, args[len(params) + 1:])), many=True))

    @bwd.register_fake
    def _(*args):
        return [t.new_empty(t.shape) for t in args[:len(params)] if t.dtype.is_floating_point]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:len(params)])
        ctx.statics = inputs[len(params):]

    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        grads = iter(bwd(*tensors, grad.contiguous(), *ctx.statics))
        return tuple([next(grads) if t.dtype.is_floating_point else None for t in tensors]
                     + [None] * len(ctx.statics))

    fwd.register_autograd(backward, setup_context=setup_context)

    def call(*tensors, **statics):  # (a static left out takes the function's default)
        return fwd(*tensors, *[int(statics[s] if s in statics else defaults[s]) for s in static])
    call.op, call.vjp_op, call.jax_fn, call.n_tensors, call.statics = fwd, bwd, fn, len(params), static
    KERNELS[qualified] = call
    return call
