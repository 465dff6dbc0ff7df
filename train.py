"""train.py: the one trainer, for every workload (task.py: a Workload and its ModelFamily, found in
task.WORKLOADS by --task) on every parallel layout (parallel.py, chosen by parallel.layout_kind).

    python train.py                                  # llama3_debug on the Python stdlib, eager, CPU
    python train.py --device xla                     # the same through torch_xla (XLA:CPU here)
    python train.py --task flux --mesh ici=2 ...     # under torchrun: any workload on any layout

`--mode` is the optimization ladder: eager (plain loop) -> compile (each block torch.compile'd) ->
graph (the whole step, optimizer included, as one traced graph: graph_trainer.py). A failure ends in
one line and the exit code of its kind (run/process.py; the table: errors.py); the last good checkpoint always stays.
"""
import contextlib
import math
import os
import sys
import time

import torch

import device as dev
import fsdp_passes
import graph_trainer
import materialize
import mesh
import optim
import spmd
from errors import EXIT_NONFINITE, ConfigError
from parallel import Parallel, layout_kind
from planner import dryrun
from run import checkpoint, process, profiling, resume, rundir
from run.cli import parse_config
from step import Microbatches, train_step
from task import workload_class


def make_workload(cfg):
    """The workload --task names (task.WORKLOADS), built for `cfg`."""
    return workload_class(cfg.task)(cfg)


def model_args(cfg):
    """The model config the workload builds for `cfg` (before any layout's rewrite)."""
    return make_workload(cfg).args


def choose_parallel(cfg):
    """The layout parallel.layout_kind decides for the command line: XLA SPMD (one process drives every
    XLA device), a torchrun mesh, or one device."""
    kind = layout_kind(cfg.mesh, cfg.device)
    if kind == "spmd":
        return spmd.XlaSpmd(cfg.mesh)
    if kind == "torchrun":
        return mesh.TorchrunMesh.from_cli(cfg.mesh, cfg.device, cfg.dp_impl,
                                          torch.bfloat16 if cfg.dtype == "bf16" else None)
    return Parallel(dev.pick_device(cfg.device))


class Trainer:
    """What every workload shares: model building through the layout, AdamW, schedule, clipping,
    checkpoints, the run directory, watchdog, logging, MFU. `run()` is the loop."""

    def __init__(self, cfg, parallel=None, task=None):
        self.cfg, self.parallel = cfg, parallel or choose_parallel(cfg)
        self.device = self.parallel.device
        dp = self.parallel.dp_size  # (--batch-size divides over it: run/cli.py's checks)
        self.out_dir = cfg.out_dir or os.path.join("runs", f"{cfg.flavor}-{time.strftime('%Y%m%d-%H%M%S')}")
        rundir.check_writable(self.out_dir, ("checkpoints",) + (("profile",) if cfg.profile else ()))
        self.task = task or make_workload(cfg)
        self.family = self.task.family
        self.microbatches = Microbatches(cfg.grad_accum, self.task.loss_reduction(cfg) or "mean")
        self.model_args = self.parallel.model_args(self.task.args, self.family)
        self.check_memory()  # (before the data is prepared: a batch too large is refused at once)
        self.task.setup_data(self.parallel.dp_rank, dp)
        self.notes = list(self.task.notes)
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        self.meta = resume.run_record(cfg, self.task, self.model_args, self.parallel.mesh_spec)
        self.resume_from, note = resume.choose(self.ckpt_dir, cfg, self.meta, type(self.task))
        self.notes += [f"note: {note}"] if note else []
        dev.reset_peak_memory("cpu")  # the build's host peak, measured (README: what a rank holds at start)
        rss_before = dev.host_peak_rss_bytes()
        self.model = self.build_model()
        self.build_host_bytes = dev.host_peak_rss_bytes() - rss_before
        self.params = list(self.model.parameters())
        self.param_names = [n for n, _ in self.model.named_parameters()]
        # The optimizer works on local shards (plain tensors sharing the parameters' storage).
        self.opt = optim.AdamW(self.parallel.local(self.params), self.param_names, weight_decay=cfg.weight_decay)
        self.parallel.place_state(self.opt.state)
        self.step = 0
        if self.resume_from:
            self.restore(self.resume_from)
        self.task.attach(self.model, self.parallel)
        self.evaluates = bool(self.task.val_batches) or self.task.evaluates
        self.flops_per_step = self.task.flops_per_step(self.model_args)
        self.peak, self.peak_label = dev.peak_flops(self.device)
        dev.sync(self.device)  # XLA: parameters and AdamW state become device data before step 1, so
        self.step_fn = self.make_step_fn()  # step 1 builds the same program as every later step

    def check_memory(self):
        """What a process holds at start must fit: its shards of the weights, gradients and AdamW state
        (16 bytes a parameter, split the layout's `param_split` ways), plus, while they are filled, one
        whole parameter on the host (materialize.py; the whole model where it is built whole), plus the
        activations of one microbatch (--grad-accum: and the gradients' running sum, 4 bytes a parameter).
        Refused before anything is allocated or written (the dry run at full scale)."""
        cfg, family = self.cfg, self.family
        local_batch = cfg.batch_size // self.parallel.dp_size // cfg.grad_accum
        weights = 16 * family.param_count(self.model_args) / self.parallel.param_split
        weights += 4 * (cfg.grad_accum > 1) * family.param_count(self.model_args) / self.parallel.grad_sum_split
        weights += 4 * materialize.largest_whole(family, self.model_args, cfg.scan, cfg.init_from)
        acts = family.activation_bytes(self.model_args, local_batch, cfg.seq_len, dev.free_memory_bytes(self.device))
        acts /= self.parallel.seq_split  # (context parallel: a rank's tokens, its (S / cp) x S scores)
        dev.check_fits(weights + acts, self.device, "the model's shards of weights, gradients and AdamW state (16 "
                       f"bytes a parameter), the largest whole tensor it is filled from and the activations of "
                       f"{local_batch} sequences" + (f" (one microbatch of {cfg.grad_accum})" if cfg.grad_accum > 1 else ""))

    def build_model(self):
        """Built on the meta device, parallelized, then filled shard by shard (materialize.build): from
        the seed or --init-from; a resume's checkpoint fills it later (restore)."""
        cfg = self.cfg
        return materialize.build(self.family, self.model_args, self.parallel, seed=cfg.seed, scan=cfg.scan,
                                 init_from=cfg.init_from, resuming=bool(self.resume_from), traced=cfg.mode == "graph")

    # ---------------------------------------------------------------------------------------------
    def autocast(self):
        if self.cfg.dtype == "bf16":
            return torch.autocast(dev.autocast_type(self.device), dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def make_step_fn(self):
        cfg = self.cfg
        if cfg.mode == "graph":
            return graph_trainer.GraphStep(self.model, self.task.loss, self.opt, self.device, clip=cfg.clip,
                                           autocast=self.autocast, parallel=self.parallel, backend=cfg.backend,
                                           remat=cfg.remat, offload=cfg.offload, split=cfg.split,
                                           fsdp_passes=fsdp_passes.chosen(cfg.fsdp_passes, self.parallel.graph_passes),
                                           blocks=() if cfg.scan else self.family.blocks(self.model),
                                           microbatches=self.microbatches)
        if cfg.mode == "compile":
            for block in self.family.blocks(self.model):
                block.compile(backend=dev.compile_backend(self.device))
        return self.eager_step

    def eager_step(self, *batch_and_lr):
        """The step, as step.py writes it: forward, loss, backward, clipping, AdamW."""
        *batch, lr = batch_and_lr
        return train_step(self.model, self.task.loss, batch, lr, self.opt, self.parallel, self.params,
                               self.microbatches, self.cfg.clip, self.autocast)

    @torch.no_grad()
    def evaluate(self):
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.task.val_batches):
            self.watchdog.beat(f"evaluation batch {i + 1} at step {self.step}")
            with self.autocast():
                reported, _ = self.task.loss(self.model, self.parallel.place_batch(batch))
            total = total + reported.float()
        total = self.parallel.mean_over_dp(total)
        dev.sync(self.device)
        return total.item() / len(self.task.val_batches)

    # ---------------------------------------------------------------------------------------------
    def state(self):
        def named(tensors):  # optimizer shards as DTensors like their parameters, so DCP shards them
            return dict(zip(self.param_names, self.parallel.like(tensors, self.params)))
        # (keep_vars: the parameters themselves; an XLA tensor's detached copy has lost its partition spec)
        return {"model": self.model.state_dict(keep_vars=True),
                "optim": {"exp_avg": named(self.opt.state["exp_avg"]),
                          "exp_avg_sq": named(self.opt.state["exp_avg_sq"])},
                "step": torch.tensor(self.step), "rng": torch.get_rng_state()}

    def save(self):
        checkpoint.save(self.ckpt_dir, self.step, self.state(), self.meta, self.parallel.checkpoint_shards())

    def restore(self, path):
        """The resume checkpoint fills the model and AdamW state in place, each process its own shards
        (DCP; XLA SPMD through its planners), whatever layout wrote it (resume.check_compatible)."""
        state = checkpoint.load_into(path, self.state(), self.parallel.checkpoint_shards())
        self.step = int(state["step"])
        self.opt.step_count = self.step
        torch.set_rng_state(state["rng"])

    # ---------------------------------------------------------------------------------------------
    def log(self, record, line, to_stderr=False):
        if not self.parallel.writes_files:
            return
        print(line, file=sys.stderr if to_stderr else sys.stdout, flush=True)
        self.run_dir.append_metrics(record)

    def stop_nonfinite(self, what, value):
        self.log({"event": "nonfinite", "step": self.step, what: value},
                 f"error: {what.replace('_', ' ')} is {value} at step {self.step}; stopping before it is "
                 f"saved (last good checkpoint kept)", to_stderr=True)
        return EXIT_NONFINITE

    def run(self):
        self.run_dir = rundir.RunDir(self.out_dir, self.parallel.global_rank, self.cfg.tensorboard).open()
        self.watchdog = rundir.Watchdog(self.cfg.watchdog, self.parallel.global_rank,
                                        peers=self.parallel.n_devices > 1 and self.parallel.mesh_spec is not None)
        self.profiler = profiling.Profiler(profiling.parse_steps(self.cfg.profile, self.cfg.steps) if self.cfg.profile
                                           else (), self.out_dir, self.parallel.global_rank, self.device,
                                           prints=self.parallel.writes_files)
        self.notes += self.profiler.skipped_notes(self.step)  # (steps a resume starts past: said, not dropped)
        try:
            rc = self.loop()
            self.profiler.close()  # (the traced steps' breakdown, printed at the end of the run)
            return rc
        finally:
            self.profiler.abandon()  # (a failed or stopped run: no profiler left running at teardown)
            self.task.close()
            self.watchdog.stop()
            self.run_dir.close()

    def loop(self):
        """Start, then per step: train, log, evaluate, save, halt."""
        cfg = self.cfg
        self.start()
        if self.step == 0 and self.evaluates:
            self.evaluate_and_log()
        self.clock = (time.perf_counter(), self.step, time.perf_counter(), self.step)
        while self.step < cfg.steps:
            self.step += 1
            with self.profiler.step(self.step):  # (--profile: traced, or nothing)
                loss, gnorm = self.train_step()
            for what, value in (("loss", loss), ("grad_norm", gnorm)):
                if not math.isfinite(value):  # the update was applied: these weights must not be saved
                    return self.stop_nonfinite(what, value)
            last = self.step in (cfg.steps, cfg.halt_at)
            if self.step % cfg.log_interval == 0 or last:
                self.log_step(loss, gnorm)
            halt = None  # the workload's own end (e.g. --halt-at-accuracy): a message, after an evaluation
            if self.evaluates and (cfg.eval_interval and self.step % cfg.eval_interval == 0 or self.step == cfg.steps):
                val = self.evaluate_and_log()
                if not math.isfinite(val):
                    return self.stop_nonfinite("val_loss", val)
                halt = self.task.halt(self.last_eval)
            if (cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0) or last or halt:
                self.watchdog.beat(f"checkpoint at step {self.step}")
                self.save()
            if halt:
                record, line = halt
                self.log({"event": "halted", "step": self.step, **record},
                         f"step {self.step:5d} | {line}: halted, checkpoint step_{self.step:06d} saved (the newest)")
                return 0
            if self.step == cfg.halt_at:
                return 0
        if self.parallel.mesh_spec is None and self.parallel.writes_files:  # (sharded weights: no preview)
            self.task.preview(self.model, self.log, self.out_dir, step=self.step, final=True)
        return 0

    def start(self):
        """Set aside what the resumed checkpoint supersedes (--resume-from; --resume auto past a broken
        one), print the notes, log the start line."""
        cfg, p = self.cfg, self.parallel
        if self.resume_from and p.writes_files:
            resume.set_aside_newer(self.ckpt_dir, self.step)
        for note in self.notes if p.writes_files else ():
            print(note, file=sys.stderr, flush=True)
        n_params = sum(t.numel() for t in self.model.parameters())
        self.log({"event": "start", "params": n_params, "device": str(self.device), "resumed_at": self.step,
                  "devices": p.n_devices, "hosts": p.hosts, "param_bytes_local": p.local_bytes(self.params),
                  "build_host_bytes": self.build_host_bytes,
                  "optim_bytes_local": p.local_bytes(self.opt.state["exp_avg"] + self.opt.state["exp_avg_sq"])},
                 f"{self.meta['flavor']}: {n_params / 1e6:.2f}M params on {self.device}, mode {cfg.mode}, "
                 f"{self.task.units_per_step} {self.task.unit}/step, start at step {self.step}, out {self.out_dir}")
        dev.reset_peak_memory(self.device)  # the log's memory is the training's, not model building's

    def train_step(self):
        """One optimizer step on global batch `self.step`: (loss, pre-clip gradient norm) as floats."""
        cfg = self.cfg
        self.watchdog.beat(f"step {self.step}")
        batch = self.parallel.place_batch(self.task.batch(self.step))
        lr = optim.lr_at(self.step, cfg.lr, cfg.warmup, cfg.steps)
        reported, norm = self.step_fn(*batch, dev.scalar(lr, self.device))
        dev.sync(self.device)
        loss, gnorm = reported.item(), norm.item()  # (both computed already: no new device program)
        first = self.clock[3]
        if self.step == first + 2:  # from the second step on, memory is the steady state's (capture,
            dev.reset_peak_memory(self.device)  # compilation and first allocations are one-offs)
        if self.step == first + 1 and cfg.mode == "graph":
            rep = self.step_fn.report
            self.log({"event": "graph", **rep}, f"graph: {rep['nodes']} nodes, collectives {rep['collectives']}, "
                     f"saved activations {rep['saved_bytes'] / 2**20:.1f} MiB (captured "
                     f"{rep['saved_bytes_captured'] / 2**20:.1f} MiB), offloaded {rep['offloaded_bytes'] / 2**20:.1f} MiB")
        self.lr = lr
        return loss, gnorm

    def log_step(self, loss, gnorm):
        t_last, step_last, t_start, first = self.clock
        now, p, unit = time.perf_counter(), self.parallel, self.task.unit
        per_s = (self.step - step_last) * self.task.units_per_step / (now - t_last)
        flops = (self.step - step_last) * self.flops_per_step / (now - t_last)  # all devices; MFU is per device:
        eta = (self.cfg.steps - self.step) * (now - t_start) / (self.step - first)
        mem = dev.memory_stats(self.device)
        mfu, self.peak = dev.utilization(flops / p.n_devices, self.peak, self.peak_label)
        rec = {"step": self.step, "loss": loss, "grad_norm": gnorm, "lr": self.lr, f"{unit}_per_s": per_s,
               "tflops": flops / 1e12, **({"mfu": mfu} if mfu is not None else {}), "peak_label": self.peak_label,
               "peak_flops": self.peak, "devices": p.n_devices, "mem_bytes": mem["peak_bytes"], "mem_kind": mem["kind"]}
        if unit == "tok":
            rec["tokens_per_s"] = rec.pop("tok_per_s")
        extra = self.task.step_metrics()
        rec.update(extra)
        self.log(rec, f"step {self.step:5d} | loss {loss:.4f} | gnorm {gnorm:.3f} | lr {self.lr:.2e}"
                 f" | {f'{per_s / 1e3:.1f}k' if per_s >= 1e3 else f'{per_s:.1f}'} {unit}/s | {flops / 1e12:.3f} TFLOP/s | "
                 + (f"MFU {100 * mfu:.1f}% of {self.peak_label}" if mfu is not None else f"MFU n/a (above {self.peak_label})")
                 + f" | mem {mem['peak_bytes'] / 2**30:.2f} GiB ({mem['kind']})"
                 f" | eta {eta:.0f}s" + "".join(f" | {k} {v:.4g}" for k, v in extra.items()))
        self.clock = (time.perf_counter(), self.step, t_start, first)

    def evaluate_and_log(self):
        """The validation loss (if the task has validation batches) and the task's own evaluation
        numbers in one record; NaN-free unless the validation loss is not finite."""
        val = self.evaluate() if self.task.val_batches else None
        extra = self.task.evaluate(self.model, self.step, self.log)
        rec = {"step": self.step, **({"val_loss": val} if val is not None else {}), **extra}
        self.last_eval = rec
        parts = ([] if val is None else [f"val loss {val:.4f}"]) + [f"{k.replace('_', ' ')} {v:.4f}" for k, v in extra.items()]
        self.log(rec, f"step {self.step:5d} | " + " | ".join(parts))
        if self.parallel.writes_files:
            if not self.cfg.no_plot:
                self.run_dir.plot(self.task.plotted)
            if self.parallel.mesh_spec is None:  # (sharded weights: not drawn)
                self.task.preview(self.model, self.log, self.out_dir, step=self.step, final=False)
        return 0.0 if val is None else val


# ------------------------------------------------------------------------------------------------
def main(argv=None):
    """A run from its command line: exit code 0, or one line and the code of its kind (run/process.py)."""
    return process.run(_run, argv)


def _run(argv, at):
    cfg = parse_config(argv)
    if cfg.dry_run:
        at.dry_run = True
        workload = make_workload(cfg)
        try:
            plan = workload.family.plan(workload.args, cfg)
            return dryrun.main(plan, cfg)
        except ValueError as e:  # a mesh, batch or chip the plan cannot use
            raise ConfigError(str(e)) from None
    at.parallel = choose_parallel(cfg)
    at.trainer = Trainer(cfg, at.parallel)
    rc = at.trainer.run()
    at.parallel.close()  # only on the happy path: after a peer failure it could wait on the dead
    return rc


if __name__ == "__main__":
    process.main(_run)
