"""jax_op.py: a JAX function becomes a PyTorch operator (after TorchTPU's torch.tpu.pallas.jax_op).

    @jax_op("splash", static=("window", "block"))
    def splash(q, k, v, segment_ids, *, window, block): ...      # JAX code, e.g. a pallas_call

registers `minititan::splash` with torch.library.custom_op, so that:
  - fake/meta: shapes come from jax.eval_shape, so make_fx and torch.compile see ONE opaque node;
  - autograd: the backward is a second op, `minititan::splash_vjp`, computed by jax.vjp (a kernel
    with a jax.custom_vjp brings its own Pallas backward kernels). The forward is re-run inside the
    vjp op: a rematerialization traded for a stateless bridge;
  - implementation, by the inputs' device:
      CPU tensors -> zero-copy DLPack into JAX CPU arrays, the jitted function, DLPack back;
      XLA tensors -> torch_xla's call_jax: the JAX program is embedded in the same XLA graph as the
                     rest of the step (one compiled program, kernel included);
      TorchTPU    -> torch.tpu.pallas.jax_op does this natively (not available here; not run).
Integer tensors are handed to JAX as int32 (JAX runs without x64), and only floating inputs get
gradients. Every op has one tensor output.
"""
import functools

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


def _run(fn, tensors, statics):
    """Evaluate JAX `fn` on torch tensors (all on one device), returning torch tensor(s)."""
    device = tensors[0].device
    if dev.is_xla(device):
        import torch_xla.core.xla_builder as xb
        ints = [t.to(torch.int32) if not t.dtype.is_floating_point else t for t in tensors]
        return xb.call_jax(_closure(fn, statics), tuple(ints),
                           override_hash=hash((fn.__module__, fn.__qualname__, statics)))
    if dev.is_tpu(device):  # (not XLA, handled above) TorchTPU: its bridge compiles through Mosaic directly.
        from torch.tpu.pallas import jax_op as native  # noqa: not installable beside torch 2.9
        return native(_closure(fn, statics))(*tensors)
    if device.type != "cpu":
        host = _run(fn, [t.cpu() for t in tensors], statics)
        return [h.to(device) for h in host] if isinstance(host, (list, tuple)) else host.to(device)
    out = _jit(fn, statics)(*map(_to_jax, tensors))
    return [_to_torch(o) for o in out] if isinstance(out, (list, tuple)) else _to_torch(out)


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
def _vjp_fn(fn, float_mask):
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


def jax_op(name, static=()):
    """Decorator: register JAX function `fn(*tensors, **static_ints)` as torch op minititan::name."""
    static = tuple(static)

    def deco(fn):
        import inspect
        params = [p for p in inspect.signature(fn).parameters if p not in static]
        fwd = torch.library.custom_op(f"{_LIB}::{name}", mutates_args=(),
                                      schema=_schema_types(params, static, 1))(
            lambda *args: _run(fn, list(args[:len(params)]), tuple(zip(static, args[len(params):]))))

        @fwd.register_fake
        def _(*args):
            tensors, statics = args[:len(params)], dict(zip(static, args[len(params):]))
            specs = [jax.ShapeDtypeStruct(tuple(t.shape), _jax_dtype_of(t)) for t in tensors]
            out = jax.eval_shape(functools.partial(fn, **statics), *specs)
            return tensors[0].new_empty(out.shape, dtype=_torch_dtype_of(out.dtype))

        bwd = torch.library.custom_op(f"{_LIB}::{name}_vjp", mutates_args=(),
                                      schema=_schema_types(params + ["cotangent"], static, 2))(
            lambda *args: _run(_vjp_fn(fn, tuple(t.dtype.is_floating_point for t in args[:len(params)])),
                               list(args[:len(params) + 1]),
                               tuple(zip(static, args[len(params) + 1:]))))

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

        def call(*tensors, **statics):
            return fwd(*tensors, *[int(statics[s]) for s in static])
        call.op, call.jax_fn = fwd, fn
        return call
    return deco
