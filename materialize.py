"""materialize.py: build a model on the meta device, parallelize it there, then fill each process's
own shards, one parameter at a time.

A trainer that builds the whole model in every process before sharding it needs the whole model's
fp32 weights in host memory per process: 280 GB for Llama 3 70B, which no TPU host has. TorchTitan's
route (torchtitan/train.py: `with torch.device("meta")`, parallelize, `model.to_empty(device=...)`,
`model.init_weights()`) is the anchor; ours differs in one point, so that every layout starts from
exactly the weights one process starts from, bit for bit:

    seed fill   parameter `name`'s values are a pure function of (seed, name): a CPU generator seeded
                from a hash of both draws the whole parameter (`param_generator`), the layout's `fill`
                keeps this process's block of it (`parallel.Parallel.fill`: a DTensor's local shard, an
                XLA tensor's partition spec) and the whole tensor is dropped before the next one. Peak
                host memory: this process's shards + the largest single parameter.
    --init-from the family's `load_pretrained` reads each rank's block from the files (interop/hf.py, flux/hf.py)
    resume      the checkpoint fills the shards (DCP: each rank reads its own)

The values do not depend on how parameters are laid out, so a `--scan` stack (L, ...) is filled from
its layers' names as the unstacked model names them (`seed_names`), and a model built on a real device
(`init_module`, what model.Transformer / flux's models call in their constructors) gets the same
values as the trainer's seed fill: the seed is then torch.initial_seed(), what `torch.manual_seed` set.
The rule for each parameter (normal, Xavier, ones, zeros) is the model's own (`ModelFamily.initializer`).
"""
import hashlib

import torch

import device as dev
import layer_scan
from errors import ConfigError


def param_generator(seed, name):
    """A CPU generator whose stream is a pure function of (seed, parameter name)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@torch.no_grad()
def init_module(module, init, seed=None):
    """Fill a module built on a real device by `init(name, shape, generator) -> fp32 CPU tensor`, each
    parameter from its own (seed, name) stream; seed None: torch.initial_seed()."""
    seed = torch.initial_seed() if seed is None else seed
    for name, p in module.named_parameters():
        p.copy_(init(name, tuple(p.shape), param_generator(seed, name)))
    return module


def built_names(model):
    """{id(parameter): name} of a freshly built model: the names the seed fill draws by, taken before
    --scan stacks (layer_scan.stack_layers records each stacked weight's layer names from it)."""
    return {id(p): n for n, p in model.named_parameters()}


def seed_names(model, built):
    """{name in `model`: its name in the built model (a plain parameter), or a list of one per layer (a
    stacked (L, ...) one)}. Call before parallelize (which replaces the parameter objects)."""
    out = {}
    for prefix, module in model.named_modules():
        stacked = isinstance(module, layer_scan.StackedLayers)  # (its `origins`: layer i's built names)
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            out[full] = list(module.origins[name]) if stacked else built[id(p)]
    return out


@torch.no_grad()
def fill_from_seed(model, names, init, fill, seed):
    """Every parameter of the parallelized, allocated `model` from its (seed, name) streams: the whole
    parameter drawn on the host (stacked layer by layer), `fill(param, whole)` keeps this process's block."""
    for name, p in model.named_parameters():
        source = names[name]
        if isinstance(source, list):  # a --scan stack: layer i from layer i's own stream
            whole = torch.empty(tuple(p.shape))
            for i, n in enumerate(source):
                whole[i] = init(n, tuple(p.shape[1:]), param_generator(seed, n))
        else:
            whole = init(source, tuple(p.shape), param_generator(seed, source))
        fill(p, whole.to(p.dtype))
        del whole


def units(model, family, scan):
    """The model's repeated units as a layout and the step see them: under --scan the stacks
    (layer_scan.StackedLayers, each one scan over its blocks), else the family's blocks."""
    if scan:
        return [m for m in model.modules() if isinstance(m, layer_scan.StackedLayers)]
    return family.blocks(model)


def build(family, args, parallel, *, seed, scan, init_from, resuming, traced):
    """`family`'s model of `args` built on the meta device, maybe stacked (--scan), parallelized by
    `parallel`, and only then filled, each process its own shards: from the seed, then the family's
    load_pretrained reads --init-from over it. `resuming` leaves the shards allocated, unfilled: the
    checkpoint fills them (train.Trainer.restore). A family without an
    `initializer`, and --scan with --init-from (stacking renames the weights: they are loaded first),
    build it whole, seeded, as before. `traced`: graph mode (ahead-of-time tracing, as --scan)."""
    dynamic = family.dynamic_shapes_reason(args)
    if dynamic and (traced or scan):
        raise ConfigError(f"{'--scan' if scan else 'graph mode'} traces ahead of time; {dynamic}")
    dev.seed_all(seed)
    with torch.device("meta"):
        model = family.build(args)
    init = family.initializer(model) if family.initializer else None
    whole = init is None or bool(scan and not resuming and init_from)
    if whole:  # on the host, initialized by its constructor (seeded above: the same values)
        model = family.build(args)
    built = built_names(model)
    stacks = family.scan_stacks(model) if scan else []
    if scan and not stacks:
        raise ConfigError(f"--scan stacks a model's identical blocks; the {family.label()} model has none")
    if scan:
        if not resuming and whole:  # (stacking renames the weights: load them first)
            family.load_pretrained(model)
        model = layer_scan.stack_layers(model, stacks, built)
    names = seed_names(model, built)
    model = parallel.parallelize(model, units(model, family, scan), family)
    if not whole:
        family.init_buffers(model)
        if not resuming:
            fill_from_seed(model, names, init, parallel.fill, seed)
    if not resuming and not scan:  # under a mesh each rank reads only its own pieces
        family.load_pretrained(model)
    if not resuming:
        parallel.place_state({"params": list(model.parameters())})
    return model


def largest_whole(family, args, scan, init_from):
    """Elements of the largest whole tensor a process holds while it fills its shards: one parameter (a
    --scan stack's (L, ...) one under --scan), or the whole model where the trainer builds it whole (a
    family without an initializer; --scan with --init-from). Counted on the meta device."""
    with torch.device("meta"):
        model = family.build(args)
    if not family.initializer or (scan and init_from):
        return sum(p.numel() for p in model.parameters())
    sizes = [p.numel() for p in model.parameters()]
    for owner, attr in (family.scan_stacks(model) if scan else []):
        blocks = list(getattr(owner, attr))
        sizes += [len(blocks) * p.numel() for p in blocks[0].parameters()]
    return max(sizes, default=0)
