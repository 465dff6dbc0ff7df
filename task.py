"""task.py: the two interfaces a kind of training plugs into the shared trainer, and their registry.

The trainer (train.py) owns what every workload shares: the loop, AdamW, the schedule, clipping,
checkpoints, the run directory, the watchdog, logging, MFU and the parallel layout (parallel.py).
What differs comes in two composed objects, after torchtitan's TrainSpec (a model family's own
model, parallelize function and loss beside the shared trainer):

  ModelFamily: the model, what the layout and the planner need of it (no data, no loss)
    args                        the model's config (a dataclass: flavor, --set, --init-from's config)
    build(args)                 the model (the trainer builds it on the meta device, stacks / shards it,
                                then fills each process's shards: materialize.py)
    initializer(model)          init(name, shape, generator) -> the initial values of one parameter of the
                                model as built, from its own (seed, name) stream (None: the trainer
                                builds the model whole on the device, seeded, and shards it after)
    init_buffers(model)         what is not a parameter (rope frequencies), after allocation
    load_pretrained(model)      --init-from's weights; after sharding each rank copies its own block
                                (parallel.local_block); with --scan before stacking (stacking renames)
    blocks(model)               the repeated modules: FSDP2's units, --mode compile's units, the bucket
                                pass's buckets (default: the whole model as one)
    scan_stacks(model)          (owner, attribute) of each ModuleList --scan stacks (none: refused)
    param_count(args), label(), record(args), from_record(meta) (a run's family: how generate, export,
    --init-from RUN and the samplers load a run, checkpoint.load_run), dynamic_shapes_reason(args),
    activation_bytes(args, local_batch, seq_len, free_bytes), plan(args, cfg) (dryrun.Workload)
    model_parallel              the layout dims beyond data parallel it can be split over ("tp", "ep")
    layout_args(args, tp, ep)   the config a layout splitting it over tp / ep ranks builds (ValueError: why not)
    parallelize(model, tp_mesh, ep_mesh, sequence)  its whole model parallelization in one function
                                (torchtitan's parallelize_llama): tensor parallel, expert routing, its
                                sequences split (context parallel), in that order; the layout then
                                shards it data-parallel. Returns the modules whose weights are experts
                                split over ep_mesh (with --scan: a stack's block's, naming its stacked
                                weights). The only place a layout changes a model
    kind                        what its models are, in words (a run of another kind is refused by name)
    resume_settings             config fields no weight depends on (ep's buffer factor): a checkpoint
                                records them as training settings, which a resume may change (run/resume.py)

  Workload: the data, the loss and what a run of it does besides the loop
    name, default_flavor        registered in WORKLOADS below; `Flags`: a dataclass of its own flags
                                (run/cli.py shows them as the workload's group; another's are refused);
    family_class                its ModelFamily's class (for checks before it is built)
    resume_policy               what a resume may change, the one form: each meta() key -> True (with
                                --allow-change KEY), why not (a clause), or f(saved, now) -> None or why;
                                a key it does not name cannot change (run/resume.py reads it)
    check_flags(cfg)            its own validation (classmethod; ConfigError: one line, exit 2)
    splits_sequences            True if its loss is a mean over the batch's tokens, as many per rank when
                                a sequence is split over cp ranks (so cp ranks' mean is the whole's)
    global_rows(cfg)            (rows of one global batch, as its flags name them): what must split evenly
                                over the data-parallel ranks (classmethod; run/cli.py checks it before a rank starts)
    loss_reduction(cfg)         how its loss over a batch splits into microbatches (--grad-accum, step.py):
                                "mean" (a mean over rows of equal counts), "sum" (divided by a whole-batch
                                count carried in the batch), or None: it refuses --grad-accum (classmethod)
    family                      its ModelFamily, whole when the workload is (GRPO and SFT use the LM
                                family; none inherits another workload)
    setup_data(rank, size), batch(step) (a pure function of (seed, step): resume and N ranks see what
    one process would), val_batches, loss(model, batch) -> (reported, differentiated), units_per_step
    and unit (what the log counts a step in), flops_per_step(args), meta() (what a resume must match), notes
    preview(model, log, out_dir, step, final)   something to look at (one device only)
    attach(model, parallel), step_metrics(), evaluate(model, step, log), evaluates, plotted, close()
                                for a workload with state beside the model (GRPO's rollout engine)
    halt(record)                end the run after an evaluation (sft's --halt-at-accuracy)
    eos_id                      the token that ends a sample (GRPO's and SFT's completions: a newline),
                                or None; the run records it, and sampling it stops there (tokenizer.for_run)

These are all the members the trainer uses (tests/check_seams.py holds it to that).

A new workload is one file (a Workload subclass and, if the model is new, a ModelFamily) and one line
in WORKLOADS. This file imports nothing of ours: the registry names classes by "module:Class" and
imports the one a run asks for; a run imports no other workload (tests/check_seams.py runs one to see).
"""
import dataclasses
import importlib

import torch

WORKLOADS = {  # --task NAME -> "module:Class"
    "lm": "workloads.lm:Pretraining",
    "flux": "flux.task:FluxDigits",
    "sft": "rl.sft_task:SFTArithmetic",
    "grpo": "rl.grpo_task:GRPOArithmetic",
    "dpo": "rl.dpo_task:DPOPreferences",
}


def workload_class(name):
    """The Workload class registered as `name` (imported on first use)."""
    module, _, cls = WORKLOADS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


class ModelFamily:
    """A kind of model (see the module docstring); subclasses implement what raises here."""
    model_parallel = ()
    kind = "model"  # what its models are, in words ("a language model"): how a run of it is named
    resume_settings = ()  # config fields that change how a step runs, not its weights: a checkpoint records
    #                       them as training settings, which a resume may change with --allow-change NAME

    def __init__(self, args):
        self.args = args

    def build(self, args):
        raise NotImplementedError

    def load_pretrained(self, model):
        """Nothing to load unless the family was made from pretrained weights."""

    initializer = None  # (a method in a family that can be filled by shard)

    def init_buffers(self, model):
        """Nothing but parameters by default."""

    def layout_args(self, args, tp, ep):
        if tp > 1 or ep > 1:
            raise ValueError(f"{self.kind} splits over the data-parallel dims (dcn / ici) only")
        return args

    def parallelize(self, model, tp_mesh=None, ep_mesh=None, sequence=None):
        """No tensor or expert parallelism (layout_args refuses them) and no split sequences (run/cli.py
        refuses cp) by default: the layout's data parallelism alone."""
        if sequence is not None:
            raise NotImplementedError(f"{self.kind} does not split sequences")
        return []

    def blocks(self, model):
        return [model]

    def scan_stacks(self, model):
        """Called once, on the freshly built model, which it may prepare for layer_scan's contract
        (each block maps (h, cos, sin) -> (h, aux))."""
        return []

    def param_count(self, args):
        """Built on the meta device, where nothing is allocated."""
        with torch.device("meta"):
            return sum(p.numel() for p in self.build(args).parameters())

    def label(self):
        raise NotImplementedError

    def record(self, args):
        """The model config as meta.json records it (a resume must build the same model), less its
        resume_settings (resume.run_record records those beside the training settings)."""
        return {k: v for k, v in dataclasses.asdict(args).items() if k not in self.resume_settings}

    def dynamic_shapes_reason(self, args):
        """Why the step cannot be traced ahead of time (graph mode, --scan), or None."""
        return None

    def activation_bytes(self, args, local_batch, seq_len, free_bytes):
        """Activation memory of one step (refusing a batch that cannot fit before anything is
        allocated); 0 where the family does not estimate it."""
        return 0

    @classmethod
    def from_record(cls, meta, where):
        """The family of a checkpoint's model, from its meta.json (`where`, for messages): what
        checkpoint.load_run builds a run's model with. BadInput where the record describes no model."""
        raise NotImplementedError

    def plan(self, args, cfg):
        """dryrun.Workload for `args` at full scale (--dry-run, --plan)."""
        raise NotImplementedError(f"--dry-run plans language models and FLUX; not {type(self).__name__}")


@dataclasses.dataclass
class NoFlags:
    """A workload without flags of its own."""


class Workload:
    """A kind of training (see the module docstring); subclasses implement what raises here."""
    name = default_flavor = None
    Flags = NoFlags
    splits_sequences = False  # (--mesh cp=C: refused by run/cli.py unless True, saying why not:)
    no_split_reason = "its loss is not a mean over equal token sets"
    sequence_from = None        # what fixes a row's length where --seq-len does not (run/cli.py refuses the flag)
    family_class = ModelFamily  # the kind of model it trains (for checks before it is built)
    resume_policy = {}          # meta() key -> True (--allow-change KEY), why it cannot change, or f(saved, now)
    unit = "samples"            # what units_per_step counts
    notes = ()
    val_batches = ()
    evaluates = False
    plotted = ()
    eos_id = None               # the token that ends a sample: recorded with the run (resume.run_record)

    def __init__(self, cfg):
        self.cfg = cfg
        self.family = None

    @classmethod
    def check_flags(cls, cfg):
        """Validate this workload's flags and their combinations with the shared ones."""

    @classmethod
    def global_rows(cls, cfg):
        """(rows of one global batch, their flags' words): each data-parallel rank takes an equal slice."""
        return cfg.batch_size, f"--batch-size {cfg.batch_size}"

    @classmethod
    def loss_reduction(cls, cfg):
        """"mean", "sum" or None (step.py): undeclared, a workload refuses --grad-accum rather than guess."""
        return None

    @property
    def args(self):
        return self.family.args

    def setup_data(self, dp_rank, dp_size):
        raise NotImplementedError

    def batch(self, step):
        raise NotImplementedError

    def loss(self, model, batch):
        raise NotImplementedError

    @property
    def units_per_step(self):
        """How many `unit`s one optimizer step trains on (the log's throughput)."""
        raise NotImplementedError

    def flops_per_step(self, args):
        raise NotImplementedError

    def meta(self):
        return {}

    def preview(self, model, log, out_dir, step, final):
        """Called by the writing process where the weights are whole (one device): after each
        evaluation (final=False: something quick), and once after the last step (final=True)."""

    def attach(self, model, parallel):
        """The live (possibly sharded) model the trainer updates, and its layout (parallel.Parallel: how
        the workload's own exchanges between processes go), before its first step."""

    def step_metrics(self):
        return {}

    def evaluate(self, model, step, log):
        """{name: number} added to the evaluation record at `step` (called on every rank)."""
        return {}

    def halt(self, record):
        """After an evaluation (its `record`): None to go on, or (what to log, a line) to end the run
        there, that step's checkpoint saved (a warm start that ends by a criterion, not a step)."""
        return None

    def close(self):
        """Release what the workload holds; called once however the run ends."""
