"""layer_scan.py: the repeated blocks as ONE scan over stacked layer weights.

A 126-layer model traced layer by layer gives a graph (and a compiled program) 126 times the size of
one layer, and compile time grows with it. JAX's answer is lax.scan over weights stacked on a leading
layer axis; torch_xla's is torch_xla.experimental.scan_layers. Ours, for the traced step graph:

  stack_layers(model)      replaces model.layers by a StackedLayers holding, for every block
                           parameter name, one (L, ...) parameter; the model's run_layers() calls it.
  minititan::scan_layers   one custom op: forward loops over the layers, keeping each layer's input
                           (the scan carry, (L, B, S, D)) for the backward;
  ..._scan_layers_bwd      the backward op: walks the layers in reverse, recomputing each block
                           under torch.func.vjp from its saved input (per-layer remat, like JAX's
                           scan + checkpoint) and stacking the weight gradients.

Under make_fx each is one node, so the step graph has the same size at 2 or 200 layers. (torch's
own torch._higher_order_ops.scan gave wrong gradients in torch 2.9 in our measurement, hence this.)
Limit: on XLA the op's Python loop is traced lazily and unrolls into the HLO; there
torch_xla.experimental.scan_layers would keep the program small (not wired in here).
"""
import copy

import torch
import torch.nn as nn

_BLOCKS = {}  # id -> (template block module, parameter names): custom ops take no modules


def _block_call(block_id, params, h, cos, sin):
    block, names = _BLOCKS[block_id]
    h, aux = torch.func.functional_call(block, dict(zip(names, params)), (h, cos, sin))
    return h, aux.float()


@torch.library.custom_op("minititan::scan_layers", mutates_args=())
def scan_layers(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stacked: list[torch.Tensor],
                block_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    carries, aux = [], h.new_zeros((), dtype=torch.float32)
    for i in range(stacked[0].shape[0]):
        carries.append(h)
        h, layer_aux = _block_call(block_id, [w[i] for w in stacked], h, cos, sin)
        aux = aux + layer_aux
    return h.clone(), aux, torch.stack(carries)


@scan_layers.register_fake
def _(h, cos, sin, stacked, block_id):
    return torch.empty_like(h), h.new_empty((), dtype=torch.float32), h.new_empty((stacked[0].shape[0], *h.shape))


@torch.library.custom_op("minititan::scan_layers_bwd", mutates_args=())
def scan_layers_bwd(carries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stacked: list[torch.Tensor],
                    grad_h: torch.Tensor, grad_aux: torch.Tensor, block_id: int) -> list[torch.Tensor]:
    grads = [torch.zeros_like(w) for w in stacked]
    for i in reversed(range(stacked[0].shape[0])):
        # Recompute layer i from its saved input and pull the cotangents back through it. torch.func,
        # because plain autograd is switched off (at the dispatcher) inside a custom op's kernel.
        _, pullback = torch.func.vjp(lambda h, *p: _block_call(block_id, list(p), h, cos, sin),
                                     carries[i], *[w[i] for w in stacked])
        grad_h, *grad_params = pullback((grad_h, grad_aux))
        for g, gp in zip(grads, grad_params):
            g[i] = gp
    return [grad_h, *grads]


@scan_layers_bwd.register_fake
def _(carries, cos, sin, stacked, grad_h, grad_aux, block_id):
    return [torch.empty_like(grad_h), *[torch.empty_like(w) for w in stacked]]


def _setup(ctx, inputs, output):
    h, cos, sin, stacked, block_id = inputs
    ctx.save_for_backward(output[2], cos, sin, *stacked)
    ctx.block_id = block_id


def _backward(ctx, grad_h, grad_aux, _grad_carries):
    carries, cos, sin, *stacked = ctx.saved_tensors
    grad_aux = grad_aux if grad_aux is not None else carries.new_zeros((), dtype=torch.float32)
    grad_h = grad_h if grad_h is not None else torch.zeros_like(carries[0])
    grad_in, *grad_stacked = scan_layers_bwd(carries, cos, sin, stacked, grad_h, grad_aux, ctx.block_id)
    return grad_in, None, None, grad_stacked, None


scan_layers.register_autograd(_backward, setup_context=_setup)


class StackedLayers(nn.Module):
    """All blocks' weights as (L, ...) parameters named like one block's, dots as '__'."""

    def __init__(self, layers):
        super().__init__()
        template = copy.deepcopy(layers[0]).to("meta")  # shapes and code only; weights come stacked
        self.names = [n for n, _ in layers[0].named_parameters()]
        for name in self.names:
            stacked = torch.stack([dict(layer.named_parameters())[name].detach() for layer in layers])
            self.register_parameter(name.replace(".", "__"), nn.Parameter(stacked))
        self.block_id = len(_BLOCKS)
        _BLOCKS[self.block_id] = (template, self.names)
        self.n_layers = len(layers)

    def run(self, h, cos, sin):
        stacked = [getattr(self, n.replace(".", "__")) for n in self.names]
        out, aux, _ = scan_layers(h, cos, sin, stacked, self.block_id)
        return out, aux

    def __len__(self):
        return self.n_layers


def stack_layers(model):
    """Swap model.layers (a ModuleList of identical blocks) for one StackedLayers, in place."""
    model.layers = StackedLayers(list(model.layers))
    return model
