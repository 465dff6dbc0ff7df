"""tpu_pod/step_compile.py: our training step compiled for a TPU pod by the real TPU compiler, on a CPU machine.

    python train.py --dry-run --compile --flavor llama3_debug --mesh ici=4 --chip tpu_v5p
    python train.py --dry-run --compile --flavor llama3_8b --set n_layers=2 --mesh ici=4 --batch-size 8 --seq-len 2048
    python train.py --dry-run --compile --scan --flavor qwen3_8b --mesh ici=256 --batch-size 256 --seq-len 4096
    python train.py --dry-run --compile --kernels pallas --chip tpu_v5p --mesh ici=4 --flavor llama3_debug \
        --set n_layers=1 --set max_seq_len=8192 --batch-size 256 --seq-len 8192

The question it answers is MaxText's train_compile.py's: will this run compile and fit on that pod?
The program is the one graph mode runs, not a rewrite of it: graph_trainer.build_step_fn (forward, the
workload's loss, backward, global-norm clipping, optim.adamw) captured by make_fx into one aten graph
on fake tensors (nothing allocated: Qwen3-8B's fp32 weights alone are 32 GB), after the graph passes
the flags ask for (--remat: graph_passes.remat). torchax then runs that graph's aten ops on JAX
tracers, so `jax.jit` lowers the whole step to one StableHLO program (why torchax rather than
torch_xla's HLO: docs/planning.md), every parameter and AdamW moment sharded by the layout's
partition spec (spmd.partition_spec: the GSPMD layout train.py gives XLA; param_sharding) and
donated (updated in place, as torch_xla aliases them). XLA:TPU compiles it for the named topology
through JAX's compile-only devices (tpu_pod/target.py): the compiler's verdict, its per-device HBM
(arguments, temporaries, outputs; the fit judged on its peak, or with host buffers on the HBM
its buffer assignment reserves: tpu_target.Compiled.hbm_bytes), its
cost model's FLOPs and `optimal_seconds` (Ironwood: a chip's, its two TensorCores being two
devices: tpu_target.per_chip). That time is the compiler's estimate, not a measurement: no chip
ran anything, and the cost model prices a bf16 matmul at 22.8 TFLOP/s a device on v5p and v6e
alike (Ironwood: 996, 86% of its peak), so the report also reads it in units of that rate
(tpu_target.cost_model_rate). Under --scan the blocks (Program.stacks) are
layer_scan's ops, whose JAX form is a lax.scan; the cost model counts a While body once, so the
step is compiled again at 2 layers an iteration and every layer counted from the difference
(every_layer_counted). --scan --offload sends each layer's input to host memory as the scan makes
it (MaxText's `decoder_layer_input: offload`).

What differs from a run on the chip, and why:
  - attention and loss are the reference implementations unless --kernels pallas: SDPA's math form
    (the S x S scores, causal by mask, chosen before autograd so that its backward is plain aten ops
    as well) and the whole logits, which the cost model prices in full, both lowered in JAX's forms
    (compile_graph.JAX_FORMS). With --kernels pallas they are our Mosaic kernels, each under
    shard_map (tpu_pod/sharded_kernels.py: the partitioner cannot split a custom call), which the cost model
    cannot see: FLOPs and step then leave their share out (kernel_flops).
    An MoE's experts are always the grouped-matmul kernel (the reference reads group sizes on the
    host), its tokens routed one group a device (lm_program).
  - the `_foreach_*` ops of clipping and AdamW (no torchax lowering) are unfolded into the same
    arithmetic tensor by tensor; token ids are int32 (JAX without x64); a tensor with no dimension
    divisible by ici is replicated (JAX shards evenly; GSPMD would pad).
  - tp is Megatron's split of the weights handed to GSPMD (tensor_parallel.split_dims), the batch
    whole over tp; cp is spmd.py's head-tail split of each sequence over cp. Each is kept to that
    split by a constraint on the token rows (compile_graph.rows_over_batch); neither with --scan nor
    --kernels pallas (the kernels' shard_map is over the data-parallel devices). ep is the trainer's
    padded all-to-all as two JAX ops (tpu_pod/expert_exchange.py). docs/planning.md has each, measured.
  - --grad-accum is graph mode's unrolled loop, each microbatch after the first tied to the previous
    one's gradients (compile_graph.GradsLikeParams.after_microbatch: XLA ran every forward first).
  - the arguments' bytes include the TPU's tile padding (a shard's last two dims rounded up to the
    (8, 128) tile), which no planner counts.
"""
import contextlib
import dataclasses
import math
import time

import numpy as np
import torch

from step import Microbatches
from tpu_pod import compile_graph
import graph_passes
import graph_trainer
import layer_scan
import optim
import spmd
import context_parallel
from tpu_pod import expert_exchange
import tensor_parallel
from model import Transformer, next_token_loss
from tpu_pod import sharded_kernels
from tpu_pod import target as tpu_target

GiB = 2**30
AUTOCAST = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # --dtype bf16's: bf16 matmuls
ADAMW_DEFAULTS = optim.AdamW.__init__.__defaults__  # (betas, eps, weight_decay): the trainer's optimizer's


@dataclasses.dataclass
class Program:
    """What a workload hands the compile (dryrun.Workload.program): the model on the meta device, its
    loss(model, batch) -> (reported, differentiated), the global batch's (shape, torch dtype) each, and
    the planner's saved-activation bytes a sample of this same program (remat -> bytes), and the
    FLOPs of the step inside Mosaic kernels (kernel_flops), which the compiler's cost model cannot see."""
    model: object
    loss: object
    batch: tuple
    saved_bytes: object = None
    kernel_flops: float = 0.0
    expert_parallel: object = None  # ep -> names of the parameters split over ep, the model's MoE blocks now
    #                                 routed through expert_exchange.Exchange(ep, the args' ep_buffer_factor)
    #                                 (None: no experts)
    twin: object = None  # (mesh, clip) -> (jax fn, its abstract inputs, donated argnums): the same step written
    #                      in JAX, compiled beside ours (FLUX's flux/jax_step.py: flux/compiled.py)
    stacks: object = None  # model -> [(owner, attribute)] of its block stacks for --scan (the family's
    #                        ModelFamily.scan_stacks); None: a decoder's `layers`
    tp_split: dict = None  # {parameter name: its dim over tp} (tensor_parallel.split_dims); None: no tp plan
    loss_reduction: str = None  # how --grad-accum's microbatches combine ("mean" / "sum": step.py); None: refused
    split_sequence: object = None  # cp -> None: the model computes on its sequences split cp ways in head-tail
    #                                order (the model's split_sequence seam, as spmd.py's cp); None: no cp


def lm_program(args, batch_size, seq_len, saved_bytes, shards=1):
    """The language model's step for --compile: the model on meta, next-token loss, (B, S) ids twice;
    `saved_bytes(remat)`: the planner's activations a sample, traced for the same implementations.
    An MoE's experts are the grouped-matmul kernel (the one grouped matmul of static shapes: the
    reference reads group sizes on the host), its tokens routed in `shards` groups, one a
    data-parallel device (model.MoE's moe_groups; sharded_kernels.by_routing_group)."""
    if args.n_experts:
        args = dataclasses.replace(args, moe_impl="gmm", moe_groups=shards)
    with torch.device("meta"):
        model = Transformer(args)
    ids = ((batch_size, seq_len), torch.long)
    return Program(model, next_token_loss, (ids, ids), saved_bytes, kernel_flops(args, batch_size * seq_len, seq_len),
                   tp_split=None if args.n_experts else tensor_parallel.split_dims(model),
                   loss_reduction="mean", split_sequence=lambda cp: model.split_sequence(context_parallel.HeadTailOrder(cp)),
                   expert_parallel=(lambda ep: expert_exchange.route(model, ep, args.ep_buffer_factor)) if args.n_experts else None)



def kernel_flops(args, tokens, seq_len):
    """The step's FLOPs inside the Pallas kernels (tpu_pod/sharded_kernels.py), as model.flops_per_token counts
    them: splash attention's scores and values, 12 L H Dh S a token (forward and backward, the full
    S x S), the fused loss's projection, 6 V D a token, and the grouped matmul's experts, 6 L k 3 D F
    a token (k of them, three matrices each)."""
    attention = 12 * args.n_layers * args.n_heads * args.hd * seq_len if args.attn_impl == "splash" else 0
    loss = 6 * args.vocab_size * args.dim if args.loss_impl == "fused" else 0
    experts = 6 * args.n_layers * args.top_k * 3 * args.dim * args.moe_ffn_dim if args.n_experts and args.moe_impl == "gmm" else 0
    return tokens * (attention + loss + experts)


def capture(program, remat, clip, dtype="fp32", microbatches=1):
    """The step graph, as graph mode traces it, and its example inputs (fake CPU tensors: autocast
    applies to them, nothing is allocated). `dtype` is --dtype as the FSDP mesh runs it: fp32
    throughout, or bf16: the fp32 master weights cast to bf16 for the forward (FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16), SimpleFSDP's gather dtype) under bf16 autocast, so the
    activations and the residual stream are bf16, as MaxText's `dtype: bfloat16` keeps them.
    `microbatches` (--grad-accum): the step as graph mode unrolls it, each microbatch's forward and
    backward in turn, one gradient sum, one update (graph_trainer.build_step_fn)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = program.model
    names = [n for n, _ in model.named_parameters()]
    metas = list(model.parameters())
    with FakeTensorMode():
        params = [torch.empty(p.shape) for p in metas]
        example = (params, [torch.empty(b.shape, dtype=b.dtype) for b in model.buffers()],
                   [torch.empty_like(p) for p in params], [torch.empty_like(p) for p in params],
                   torch.empty(()), torch.empty(()), *[torch.empty(s, dtype=d) for s, d in program.batch])
    autocast = AUTOCAST if dtype == "bf16" else contextlib.nullcontext
    step_fn = graph_trainer.build_step_fn(model, names, program.loss, clip, *ADAMW_DEFAULTS,
                                          optim.decay_mask(names, metas), autocast, compile_graph.GradsLikeParams(None),
                                          microbatches=Microbatches(microbatches, program.loss_reduction)
                                          if microbatches > 1 else None,  # (one pass: any workload's loss)
                                          param_dtype=torch.bfloat16 if dtype == "bf16" else None)
    with sdpa_kernel(SDPBackend.MATH):
        gm = graph_trainer.capture(step_fn, example)
        with autocast():  # --scan: each stack's block forward traced as its vjp was (the scan's JAX form)
            for node in gm.graph.nodes:  # (at the dtypes the step reached it with)
                if node.target == torch.ops.minititan.scan_layers.default:
                    h, cos, sin, stacked, block = torch.fx.node.map_arg(node.args, lambda a: a.meta["val"])
                    layer_scan.trace_block_forward(block, h, cos, sin, stacked)
    if remat:
        gm = compile_graph.behind_barrier(graph_passes.remat(gm))
    return compile_graph.for_torchax(gm, example), example


def layout_mesh(dims, devices):
    """The (dcn, ici) mesh of the compile-only devices; (dcn, ici, tp) with tp > 1, (dcn, ici, cp) with
    cp > 1, that axis innermost: a tp (cp) group is neighbouring devices, as a slice's fastest links
    join them. ep borrows ici's devices: (dcn, ici / ep, ep), an ep group neighbours (mesh.py's)."""
    from jax.sharding import Mesh
    inner = [(axis, dims[axis]) for axis in ("tp", "cp", "ep") if dims.get(axis, 1) > 1]
    ici = dims["ici"] // dims.get("ep", 1)
    names, sizes = ("dcn", "ici", *(a for a, _ in inner)), (dims["dcn"], ici, *(n for _, n in inner))
    return Mesh(np.array(devices).reshape(sizes), names)


def param_sharding(mesh, shape, stack=False, tp_dim=None, expert=False):
    """A parameter's (and its AdamW moments') sharding: spmd.partition_spec's dim over ici (`stack`: a
    --scan stack keeps its layer axis whole); `tp_dim` (tensor_parallel.split_dims) also over tp, tp
    the major part where both split one dim (tp's block of the weight, itself split over ici: FSDP2's
    (Shard(0), Shard(0)) over (dp, tp)); replicated where a dim does not divide. Under ep an `expert`
    weight (E, ...) is split over ep on its experts and over the mesh's ici (the rest of the
    data-parallel devices) on another dim, as simplefsdp.py places it (a stack's (L, E, ...) on its
    experts, the layer axis whole); the others over ici x ep."""
    from jax.sharding import NamedSharding, PartitionSpec
    sizes = dict(mesh.shape)
    ici, tp, cp, ep = sizes["ici"], sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("ep", 1)
    local = [n // tp if d == tp_dim else n for d, n in enumerate(shape)]  # (the shape a tp rank holds)
    if expert and ep > 1:  # ((L, E, ...) in a --scan stack: the layer axis whole, the experts over ep)
        lead = [None, "ep"] if stack else ["ep"]
        spec = [*lead, *spmd.partition_spec(tuple(local[len(lead):]), ici)]
    elif ep > 1:
        spec = list(spmd.partition_spec(tuple(local), ici, stack, ep, inner="ep"))
    else:
        spec = list(spmd.partition_spec(tuple(local), ici, stack, cp))  # (cp: FSDP over ici x cp, XLA SPMD's)
    if tp_dim is not None and tp > 1:
        spec[tp_dim] = ("tp", "ici") if spec[tp_dim] else "tp"
    ways = lambda s: math.prod(mesh.shape[a] for a in ((s,) if isinstance(s, str) else s))
    even = all(n % ways(s) == 0 for n, s in zip(shape, spec) if s)
    return NamedSharding(mesh, PartitionSpec(*spec) if even else PartitionSpec())


def abstract_inputs(example, dims, devices, stacked, tp_dims=None, experts=None):
    """ShapeDtypeStructs of the step's inputs on a (dcn, ici[, tp | cp | ep]) mesh of the compile-only devices,
    with the layout's shardings (`stacked`: a flag a parameter, a --scan stack's keeps its layer axis
    whole; `tp_dims`: a parameter's dim over tp, or None); and the outputs' (new weights and moments
    like the old, scalars whole). The batch is split over dcn x ici, whole over tp; under cp each
    sequence over cp (its tokens in head-tail order, as spmd.py places them: data, not the graph);
    under ep over dcn x ici x ep. `experts`: a flag a parameter, split over ep (param_sharding)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = layout_mesh(dims, devices)
    whole = NamedSharding(mesh, PartitionSpec())
    tp_dims, experts = tp_dims or [None] * len(stacked), experts or [False] * len(stacked)
    param = lambda t, stack, tp_dim, expert: param_sharding(mesh, t.shape, stack, tp_dim, expert)

    def struct(t, sharding):
        dtype = {torch.int64: np.int32}.get(t.dtype, torch.empty((), dtype=t.dtype).numpy().dtype) \
            if t.dtype != torch.bfloat16 else jax.numpy.bfloat16
        return jax.ShapeDtypeStruct(tuple(t.shape), dtype, sharding=sharding)
    params, buffers, exp_avg, exp_avg_sq, step, lr, *batch = example
    shardings = [param(*each) for each in zip(params, stacked, tp_dims, experts)]
    states = [[struct(t, s) for t, s in zip(ts, shardings)] for ts in (params, exp_avg, exp_avg_sq)]
    data = ("dcn", "ici", "ep") if "ep" in mesh.shape else ("dcn", "ici")  # (ep borrows data-parallel devices)
    over_dp = NamedSharding(mesh, PartitionSpec(data, *(("cp",) if "cp" in mesh.shape else ())))
    inputs = (states[0], [struct(b, whole) for b in buffers], states[1], states[2], struct(step, whole),
              struct(lr, whole), *[struct(t, over_dp if t.dim() else whole) for t in batch])
    return inputs, (shardings, list(shardings), list(shardings), whole, whole)


def jax_step(gm, out_shardings, unroll=1, offload=False):
    """The step graph as a JAX function: torchax runs its aten ops on JAX values (tracers, under jit);
    --scan's ops as lax.scan, `unroll` layers a While iteration (layer_scan.register_torchax)."""
    import jax
    import torchax
    compile_graph.register_torchax()
    layer_scan.register_torchax(compile_graph.on_jax, unroll, offload)
    sharded_kernels.register_torchax()
    env = torchax.default_env()
    env.load_ops()

    def step(*inputs):
        with env:
            outputs = gm(*env.j2t_iso(inputs))
        new_params, exp_avg, exp_avg_sq, loss, norm = env.t2j_iso(outputs)
        return jax.lax.with_sharding_constraint((list(new_params), list(exp_avg), list(exp_avg_sq), loss, norm),
                                                out_shardings)
    return step


def compile_step(program, dims, chip, topology=None, remat=False, clip=1.0, dtype="fp32", offload=False, cores=1,
                 microbatches=1, effort=0.0):
    """Compile `program`'s training step for `chip`'s topology (one slice's libtpu name, default the
    mesh's ici x tp x cp chips; dcn > 1: that many slices joined by DCN, HSDP; dcn = 1 with a mesh of
    k times the topology's chips: k slices, FSDP over all of them) on the (dcn, ici, tp | cp) layout `dims`:
    a tpu_target.Compiled, plus the capture seconds.
    `dtype`: capture's; `offload` (--scan): each layer's input in host memory between its
    forward and backward (layer_scan.register_torchax); `cores`: devices a chip (Ironwood's 2);
    `effort`: the compiler's (tpu_target.EFFORTS)."""
    from jax.sharding import NamedSharding, PartitionSpec
    tp, cp, ep = dims.get("tp", 1), dims.get("cp", 1), dims.get("ep", 1)
    if ep > 1 and (program.expert_parallel is None or tp > 1 or cp > 1 or dims["ici"] % ep):
        raise ValueError(f"--compile with ep={ep} routes an MoE's rows within a slice, beside FSDP / HSDP: a model with "
                         f"experts, ep dividing ici ({dims['ici']}), no tp or cp")
    if cp > 1 and (tp > 1 or program.kernel_flops or program.split_sequence is None):
        raise ValueError("--compile with cp compiles a language model's reference attention beside FSDP / HSDP (the "
                         "Pallas kernels run under shard_map over the data-parallel devices): no tp, no --kernels pallas")
    if tp > 1 and program.tp_split is None:
        raise ValueError("--compile with tp: this model has no tensor-parallel plan (tensor_parallel.split_dims)")
    if tp > 1 and program.kernel_flops:
        raise ValueError("--compile with tp compiles the reference attention and loss (the Pallas kernels run under "
                         "shard_map over the data-parallel devices): drop --kernels pallas")
    name = tpu_target.topology_name(chip, topology or dims["ici"] * tp * cp)  # (one slice's; dcn: that many slices)
    slices, chips = dims["dcn"], dims["dcn"] * dims["ici"] * tp * cp
    per_slice = tpu_target.topology_chips(chip, name)
    if slices == 1 and chips > per_slice and chips % per_slice == 0:
        slices = chips // per_slice  # (FSDP over DCN: one ici axis across the slices, MaxText's dcn_fsdp)
    devices = tpu_target.devices(chip, name, slices=slices)
    if len(devices) != chips * cores and chips < per_slice and not topology:
        raise ValueError(f"the smallest {chip} slice ({name}) has {per_slice} chips; the mesh lays out {chips}: "
                         f"give --mesh ici={per_slice} or --chips {per_slice}")
    if len(devices) != chips * cores:
        raise ValueError(f"{slices} x topology {name} has {len(devices) // cores} chips; the mesh has {chips}")
    label = name if slices == 1 else f"{slices} x {name}"
    start = time.perf_counter()
    if cp > 1:
        program.split_sequence(cp)
    if microbatches > 1 and program.loss_reduction is None:
        raise ValueError("--compile --grad-accum: this workload does not say how its microbatches' losses combine")
    experts = program.expert_parallel(ep) if ep > 1 else set()
    gm, example = capture(program, remat, clip, dtype, microbatches)
    in_stack = {id(p) for m in program.model.modules() if isinstance(m, layer_scan.StackedLayers) for p in m.parameters()}
    if tp > 1 and in_stack:  # (split_dims names the blocks' weights as built, not stacked)
        raise ValueError("--compile with tp and --scan is not built (nor is the trainer's)")
    named = list(program.model.named_parameters())
    inputs, out_shardings = abstract_inputs(example, device_dims(dims, cores), devices,
                                            [id(p) in in_stack for p in program.model.parameters()],
                                            [program.tp_split.get(n) for n, _ in named] if tp > 1 else None,
                                            [n in experts for n, _ in named])
    gm = compile_graph.rows_over_batch(gm, math.prod(program.batch[0][0]) // microbatches, {tuple(p.shape) for p in example[0]})
    rows, batched = inputs[-1].sharding, None  # (the batch's: dim 0 over dcn x ici; with tp a row's width is the
    if cp > 1:                                 # partitioner's to split, as the logits are on the head's vocabulary)
        rows = NamedSharding(rows.mesh, PartitionSpec(("dcn", "ici", "cp")))  # (rows: batch-major tokens)
    if tp > 1:
        rows = NamedSharding(rows.mesh, PartitionSpec(("dcn", "ici"), PartitionSpec.UNCONSTRAINED))
        batched = NamedSharding(rows.mesh, PartitionSpec(("dcn", "ici", "tp")))
        gm = compile_graph.batched_matmuls_over_batch(gm)
    compile_graph.use(rows, out_shardings[0], batched)
    sharded_kernels.use(inputs[-1].sharding.mesh)
    capture_s = time.perf_counter() - start

    def compiled(unroll):
        try:
            return dataclasses.replace(tpu_target.compile(jax_step(gm, out_shardings, unroll, offload), *inputs,
                                                          chip=chip, topology=name, donate_argnums=(0, 2, 3),
                                                          effort=effort),
                                       topology=label)
        except tpu_target.CompileFailed as e:
            raise ValueError(f"the TPU compiler refused the step for {label}: {e}") from None
    layers = [m.n_layers for m in program.model.modules() if isinstance(m, layer_scan.StackedLayers)]
    once = compiled(1)
    if not layers or layers[0] < 2 or not once.fits:
        return tpu_target.per_chip(once, cores), capture_s
    if offload or len(set(layers)) > 1:  # (no per-layer count, so no cost figures: libtpu 0.0.24 refuses the
        # offloaded inputs' dynamic slices in a 2-layer While body, "Error encountered while compiling
        # %dynamic-slice-start"; stacks of different depths (FLUX's 19 double, 38 single blocks) add
        # one body each to the second compile, which one difference cannot split)
        why = ("--offload: the second compile, 2 layers a While iteration, is not made (this libtpu refuses the "
               "offloaded inputs' slices in it)" if offload else
               "the block stacks have different depths, which one second compile cannot split")
        return tpu_target.per_chip(_uncounted(once, why), cores), capture_s
    return tpu_target.per_chip(every_layer_counted(once, compiled(2), layers[0]), cores), capture_s


def device_dims(dims, cores):
    """The (dcn, ici) layout in the compiler's devices: a chip of two TensorCores (Ironwood) is two
    devices, so its ici axis is twice the chips (each core a shard, as MaxText lays out tpu7x)."""
    return {**dims, "ici": dims["ici"] * cores}


def compile_twin(program, dims, chip, topology, clip, cores=1, effort=0.0):
    """The program's twin (Program.twin) compiled for the same topology (one slice's name) and (dcn,
    ici) layout."""
    fn, inputs, donated = program.twin(layout_mesh(device_dims(dims, cores), tpu_target.devices(chip, topology, dims["dcn"])), clip)
    try:
        return tpu_target.per_chip(tpu_target.compile(fn, *inputs, chip=chip, topology=topology, donate_argnums=donated,
                                                      effort=effort), cores)
    except tpu_target.CompileFailed as e:
        raise ValueError(f"the TPU compiler refused the JAX twin for {topology}: {e}") from None


def every_layer_counted(once, twice, layers):
    """--scan's cost with every layer counted. XLA's cost model counts a While body once, whatever
    its trip count (measured: llama3_debug's scan step, 2.130e9 FLOPs at 2 layers, 2.134e9 at 4): so
    the step is compiled again with 2 layers a While iteration (JAX puts an odd layer in a loop of
    its own; at 2 layers the scan is unrolled whole: 2 or 3 bodies counted), and each layer's FLOPs,
    bytes and seconds are the difference over the extra bodies (stacks of one depth, as FLUX's debug
    flavor's: a block of each). Memory and the verdict are the rolled
    program's: the one a run compiles."""
    if not twice.fits:  # (2 layers' temporaries out of HBM: no second count, so no cost figures)
        return _uncounted(once, "the second compile, 2 layers a While iteration, ran out of HBM", twice)
    extra = 1 + layers % 2  # bodies counted: 1 at unroll=1; 2 (+1 remainder) at unroll=2
    if not (twice.flops or 0) > (once.flops or 0) or not (twice.optimal_seconds or 0) > (once.optimal_seconds or 0):
        # (the second program counted no more than the first, or the cost model gave no time (across
        # slices; the FLOPs' difference there gave 2.2x flops_per_step): no per-layer figure to take)
        return _uncounted(once, "the second compile counted no more than the first, or gave no time (across "
                                "slices)", twice)
    fix = lambda a, b: a + (layers - 1) * (b - a) / extra if a is not None and b is not None else a
    return dataclasses.replace(once, flops=fix(once.flops, twice.flops), bytes_accessed=fix(once.bytes_accessed, twice.bytes_accessed),
                               optimal_seconds=fix(once.optimal_seconds, twice.optimal_seconds),
                               compile_s=once.compile_s + twice.compile_s)


def _uncounted(once, why, twice=None):
    """The rolled program's figures without FLOPs and seconds (a While body counted once), and why."""
    return dataclasses.replace(once, flops=None, bytes_accessed=None, optimal_seconds=None, uncounted=why,
                               compile_s=once.compile_s + (twice.compile_s if twice else 0.0))


def compare(compiled, planned, flops_per_device, peak, hbm, rate=None, kernel_flops_per_device=0.0):
    """The compiler's figures beside the planner's (dryrun.estimate's report for the same layout);
    `rate`: the cost model's own matmul FLOP/s (tpu_target.cost_model_rate), to read its step against. With Mosaic
    kernels in the program its FLOPs and step are the rest's (kernel_flops_per_device left out of
    flops_per_device on both sides: the cost model does not price a kernel)."""
    flops_per_device = flops_per_device - kernel_flops_per_device
    mem = planned["memory_bytes"]
    state = sum(v for k, v in mem.items() if k.startswith(("params", "AdamW")))
    out = compiled.output_bytes - compiled.alias_bytes
    total = compiled.hbm_bytes  # (the compiler's peak, where it gives one: tpu_target.Compiled says why)
    flops = compiled.flops or 0.0
    seconds = compiled.optimal_seconds or 0.0
    return {"topology": compiled.topology, "compiler_fits": compiled.fits, "message": compiled.message,
            "fits": compiled.fits and total <= hbm, "hbm_bytes": hbm,
            "argument_bytes": compiled.argument_bytes, "temp_bytes": compiled.temp_bytes, "output_bytes": out,
            "summed_bytes": compiled.summed_bytes,
            "total_bytes": total, "planned_state_bytes": state, "planned_temp_bytes": planned["total_bytes"] - state,
            "planned_gathered_bytes": sum(v for k, v in mem.items() if k.startswith("gathered")),
            "planned_total_bytes": planned["total_bytes"], "planned_fits": planned["fits"],
            "flops": flops, "flops_per_step": flops_per_device, "kernel_flops": kernel_flops_per_device,
            "mosaic_calls": compiled.mosaic_calls, "all_to_alls": compiled.all_to_alls,
            "host_bytes": compiled.host_bytes, "planned_host_bytes": planned.get("host_bytes", 0),
            "estimated_step_s": seconds,
            "bytes_accessed": compiled.bytes_accessed or 0.0,
            "estimated_mfu": flops_per_device / (seconds * peak) if seconds else 0.0,
            "cost_model_rate": rate or 0.0, "cost_model_mfu": flops_per_device / (seconds * rate) if seconds and rate else 0.0,
            "rescaled_step_s": seconds * rate / peak if rate else 0.0,
            "planned_step_s": planned["step_s"], "planned_mfu": planned["mfu"], "compile_s": compiled.compile_s,
            "uncounted": compiled.uncounted}


def main(program, planned, cfg, spec):
    """--compile (dryrun.compiled_report): `program` compiled for cfg's chip and topology on the
    planner's layout; the compiler's figures beside `planned` (dryrun.estimate for the same program),
    as compare's dict, which the dry run prints and judges (planner.report.judged)."""
    dims = {"dcn": 1, "tp": 1, "ep": 1, **dict(p.split("=") for p in planned["mesh"].split(","))}
    dims = {k: int(v) for k, v in dims.items()}
    if cfg.scan:  # (the planner's column is then remat "full": dryrun.compiled_report)
        if program.stacks is None and not isinstance(getattr(program.model, "layers", None), torch.nn.ModuleList):
            raise ValueError("--compile --scan stacks a decoder's `layers` or the workload's block stacks; this "
                             "model names neither")
        layer_scan.stack_layers(program.model, program.stacks(program.model) if program.stacks else None)
    cores = spec["devices"]  # (a chip's devices: Ironwood's two TensorCores)
    effort = getattr(cfg, "compile_effort", 0.0)  # (0: XLA's default)
    compiled, _ = compile_step(program, dims, cfg.chip, cfg.topology, planned["remat"] is True, cfg.clip,
                               cfg.dtype, cfg.offload, cores, cfg.grad_accum, effort)
    one_slice = compiled.topology.split(" x ")[-1]
    r = compare(compiled, planned, planned["flops_per_device"], spec["peak"], spec["hbm"],
                tpu_target.cost_model_rate(cfg.chip, one_slice, cores) if compiled.fits else None,
                program.kernel_flops / planned["devices"])
    r["devices_per_chip"], r["compile_effort"] = cores, effort
    if program.twin and compiled.fits:
        twin = compile_twin(program, dims, cfg.chip, one_slice, cfg.clip, cores, effort)
        r.update(twin_fits=twin.fits, twin_total_bytes=twin.hbm_bytes, twin_argument_bytes=twin.argument_bytes,
                 twin_flops=twin.flops or 0.0,
                 twin_step_s=twin.optimal_seconds or 0.0, twin_compile_s=twin.compile_s,
                 twin_speed=(twin.optimal_seconds or 0.0) / compiled.optimal_seconds if compiled.optimal_seconds else 0.0)
    return r
