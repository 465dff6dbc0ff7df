"""train.py: one CLI that trains Llama 3 / Qwen 3 / Qwen 3-MoE flavors on byte-level text.

    python train.py                                  # llama3_debug on the Python stdlib, eager, CPU
    python train.py --device xla                     # the same through torch_xla (XLA:CPU here)
    python train.py --flavor qwen3_moe_debug --kernels pallas

`--mode` is the optimization ladder: eager (plain loop) -> compile (each block torch.compile'd) ->
graph (the whole step, optimizer included, as one traced graph: graph_trainer.py). Every bad input
ends in one `error: ...` line and exit code 2; a NaN/Inf loss, gradient norm or validation loss stops
the run with exit code 3 before anything non-finite is saved; a stalled peer ends it with exit code 4
(rundir.Watchdog); a failed write (disk full) with exit code 5. The last good checkpoint always stays.
"""
import contextlib
import dataclasses
import math
import os
import sys
import time

import torch

import checkpoint
import data
import device as dev
import fsdp_passes
import graph_trainer
import hf
import mesh
import optim
import rundir
from model import Transformer, dynamic_shapes_reason, flops_per_token, param_counts

from cli import (EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_PEER_FAILED, EXIT_WRITE_FAILED, RESUME_CHECKED,  # noqa: F401
                 ConfigError, build_parser, error_line, model_args_from, validate)


class Trainer:
    """Holds model, optimizer state and data; `run()` is the loop. Rank/world come from the mesh
    context: mesh.py under torchrun (SimpleFSDP / FSDP2), spmd.py for one process over all XLA
    devices (rank 0 of 1, reading the global batch); a single process is rank 0 of 1."""

    def __init__(self, cfg, dist_ctx=None):
        validate(cfg)
        self.cfg = cfg
        self.model_args = model_args_from(cfg)
        self.dist = dist_ctx
        self.rank, self.world = (dist_ctx.dp_rank, dist_ctx.dp_size) if dist_ctx else (0, 1)
        self.n_devices = dist_ctx.n_devices if dist_ctx else 1  # (SPMD: one process, many devices)
        if cfg.batch_size % self.world:
            raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by {self.world} data-parallel ranks")
        self.device = dev.pick_device(cfg.device) if dist_ctx is None else dist_ctx.device
        self.out_dir = cfg.out_dir or os.path.join("runs", f"{cfg.flavor}-{time.strftime('%Y%m%d-%H%M%S')}")
        rundir.check_writable(self.out_dir)
        self.notes = []  # one-line remarks printed at start (the user should know, nothing is wrong)
        fingerprint = self.load_data()
        self.ckpt_dir = os.path.join(self.out_dir, "checkpoints")
        self.meta = self.run_meta(fingerprint)
        resume_from, note = checkpoint.choose(self.ckpt_dir, self.cfg.resume, self.cfg.resume_from, self.meta,
                                              set(self.cfg.allow_change.split(",")))
        self.notes += [f"note: {note}"] if note else []
        need = 16 * param_counts(self.model_args)[0] / self.n_devices  # fp32 weights, grads, 2 AdamW moments
        dev.check_fits(need, self.device, "the model's weights, gradients and AdamW state (16 bytes a parameter)")
        self.model = self.build_model(resume_from)
        self.params = [p for p in self.model.parameters()]
        self.param_names = [n for n, _ in self.model.named_parameters()]
        # The optimizer works on local shards (plain tensors sharing the parameters' storage).
        self.opt = optim.AdamW(dist_ctx.local(self.params) if dist_ctx else self.params, self.param_names,
                               weight_decay=cfg.weight_decay)
        if dist_ctx:
            dist_ctx.shard_state(self.opt.state)
        self.step = 0
        self.resume_from = resume_from
        if resume_from:
            self.restore(resume_from)
        self.flops_per_token = flops_per_token(self.model_args, cfg.seq_len)
        self.peak, self.peak_label = dev.peak_flops(self.device)
        dev.sync(self.device)  # XLA: parameters and AdamW state become device data before step 1, so
        self.step_fn = self.make_step_fn()  # step 1 builds the same program as every later step

    def load_data(self):
        """Training batches and this rank's validation batches; returns the corpus fingerprint."""
        cfg = self.cfg
        train, val = data.load_corpus(cfg.data)
        if cfg.tokenizer:  # token ids instead of bytes (tokenized once, cached)
            train, val, vocab = data.tokenize(train, val, cfg.tokenizer)
            if vocab > self.model_args.vocab_size:
                raise ConfigError(f"--tokenizer has {vocab} tokens, the model's vocab_size is {self.model_args.vocab_size}")
        self.batches = data.Batches(train, cfg.batch_size, cfg.seq_len, cfg.seed, self.world)
        self.val = data.eval_batches(val, cfg.batch_size, cfg.seq_len, cfg.seed, cfg.eval_batches, self.rank, self.world)
        if cfg.eval_batches and not self.val:
            self.notes.append(f"note: validation skipped: the validation split has {len(val)} tokens, "
                              f"fewer than --seq-len + 2 = {cfg.seq_len + 2}")
        return data.fingerprint(train, val)

    def run_meta(self, fingerprint):
        """What a checkpoint records of the run, and a resume must match (checkpoint.check_compatible)."""
        cfg = self.cfg
        meta = {"flavor": f"hf:{os.path.abspath(cfg.init_from)}" if cfg.init_from else cfg.flavor,
                "model_args": dataclasses.asdict(self.model_args), "mesh": self.dist.mesh_spec if self.dist else None,
                "train": {**{k: getattr(cfg, k) for k in RESUME_CHECKED}, "data": fingerprint}}
        for key in ("attn_impl", "loss_impl", "moe_impl"):  # implementations may change across resumes
            meta["model_args"].pop(key)
        if cfg.scan:
            meta["layers"] = "stacked"
        meta["tokenizer"] = os.path.abspath(cfg.tokenizer) if cfg.tokenizer else None  # (generate.py reads it)
        return meta

    def build_model(self, resume_from):
        """The model, initialized (seeded, or --init-from), maybe stacked (--scan), placed or sharded."""
        cfg, dist_ctx = self.cfg, self.dist
        dynamic = dynamic_shapes_reason(self.model_args)
        if dynamic and (cfg.mode == "graph" or cfg.scan):
            raise ConfigError(f"{'--scan' if cfg.scan else 'graph mode'} traces ahead of time; {dynamic}")
        dev.seed_all(cfg.seed)
        model = Transformer(self.model_args)
        # --init-from: one process (or --scan, whose stacking renames weights) reads every weight;
        # under a mesh each rank reads only the rows of its shards, after sharding below.
        hf_now = cfg.init_from and not resume_from and (dist_ctx is None or cfg.scan)
        if hf_now:
            hf.load_into(model, cfg.init_from)
        if cfg.scan:
            import layer_scan
            model = layer_scan.stack_layers(model)
        model = dist_ctx.shard(model) if dist_ctx else model.to(self.device)
        if cfg.init_from and not resume_from and not hf_now:
            hf.load_into(model, cfg.init_from)
        return model

    # ---------------------------------------------------------------------------------------------
    def autocast(self):
        if self.cfg.dtype == "bf16":
            return torch.autocast(dev.autocast_type(self.device), dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def make_step_fn(self):
        cfg = self.cfg
        if cfg.mode == "graph":
            return graph_trainer.GraphStep(self.model, self.opt, self.device, clip=cfg.clip, autocast=self.autocast,
                                           dist_ctx=self.dist, backend=cfg.backend, remat=cfg.remat,
                                           offload=cfg.offload, split=cfg.split,
                                           fsdp_passes=fsdp_passes.chosen(cfg.fsdp_passes, self.dist))
        if self.cfg.mode == "compile":
            backend = "openxla" if dev.is_xla(self.device) else "inductor"
            for layer in self.model.layers:
                layer.compile(backend=backend)
        return self.eager_step

    def eager_step(self, inputs, targets, lr):
        with self.autocast():
            ce, aux = self.model(inputs, targets)
        if self.dist:  # gradients arrive as averaged shards; the loss is averaged for logging
            grads = self.dist.grads(ce + aux, self.params)
            reduce_sq, ce = self.dist.sum_over_shards, self.dist.mean_over_dp(ce)
        else:
            grads, reduce_sq = torch.autograd.grad(ce + aux, self.params), None
        ce = ce.detach()
        grads, norm = optim.clip_by_global_norm(grads, self.cfg.clip, reduce_sq)
        step = dev.scalar(self.opt.step_count + 1, self.device) if dev.is_xla(self.device) else None
        self.opt.step(grads, lr, self.dist.local(self.params) if self.dist else None, step)
        return ce, norm

    def place(self, inputs, targets):
        """A batch on the device (SPMD: split over the data-parallel devices)."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        return self.dist.shard_batch(inputs, targets) if self.dist else (inputs, targets)

    @torch.no_grad()
    def evaluate(self):
        if not self.val:
            return float("nan")
        total = torch.zeros((), device=self.device)
        for inputs, targets in self.val:
            with self.autocast():
                ce, _ = self.model(*self.place(inputs, targets))
            total = total + ce.float()
        if self.dist:
            total = self.dist.mean_over_dp(total)
        dev.sync(self.device)
        return total.item() / len(self.val)

    # ---------------------------------------------------------------------------------------------
    def state(self):
        def named(tensors):  # optimizer shards as DTensors like their parameters, so DCP shards them
            return dict(zip(self.param_names, self.dist.like(tensors, self.params) if self.dist else tensors))
        return {"model": self.model.state_dict(),
                "optim": {"exp_avg": named(self.opt.state["exp_avg"]),
                          "exp_avg_sq": named(self.opt.state["exp_avg_sq"])},
                "step": torch.tensor(self.step), "rng": torch.get_rng_state()}

    def save(self):
        checkpoint.save(self.ckpt_dir, self.step, checkpoint.to_cpu(self.state()), self.meta)

    def restore(self, path):
        live = self.state()
        host = checkpoint.load(path, checkpoint.to_cpu(live))
        with torch.no_grad():
            for key, tensor in live["model"].items():
                tensor.copy_(host["model"][key])
            for kind in ("exp_avg", "exp_avg_sq"):
                for name, tensor in live["optim"][kind].items():
                    tensor.copy_(host["optim"][kind][name])
        if self.dist:  # SPMD: a copy from the host leaves a tensor replicated; mark it again
            self.dist.shard_state({"params": self.params, **self.opt.state})
        self.step = int(host["step"])
        self.opt.step_count = self.step
        torch.set_rng_state(host["rng"])

    # ---------------------------------------------------------------------------------------------
    def log(self, record, line, to_stderr=False):
        if self.rank != 0 or (self.dist and self.dist.global_rank != 0):
            return
        print(line, file=sys.stderr if to_stderr else sys.stdout, flush=True)
        self.run_dir.append_metrics(record)

    def stop_nonfinite(self, what, value):
        self.log({"event": "nonfinite", "step": self.step, what: value},
                 f"error: {what.replace('_', ' ')} is {value} at step {self.step}; stopping before it is "
                 f"saved (last good checkpoint kept)", to_stderr=True)
        return EXIT_NONFINITE

    def run(self):
        self.run_dir = rundir.RunDir(self.out_dir, self.dist.global_rank if self.dist else 0, self.cfg.tensorboard).open()
        self.watchdog = rundir.Watchdog(self.cfg.watchdog, self.dist.global_rank if self.dist else 0)
        try:
            return self.loop()
        finally:
            self.watchdog.stop()
            self.run_dir.close()

    def loop(self):
        cfg = self.cfg
        if cfg.resume_from and self.rank == 0:
            checkpoint.set_aside_newer(self.ckpt_dir, self.step)
        for note in self.notes:
            if self.rank == 0:
                print(note, file=sys.stderr, flush=True)
        n_params = sum(p.numel() for p in self.model.parameters())
        per_device = self.dist.local_bytes if self.dist else lambda ts: sum(t.numel() * t.element_size() for t in ts)
        self.log({"event": "start", "params": n_params, "device": str(self.device), "resumed_at": self.step,
                  "devices": self.n_devices, "param_bytes_local": per_device(self.params),
                  "optim_bytes_local": per_device(self.opt.state["exp_avg"] + self.opt.state["exp_avg_sq"])},
                 f"{cfg.flavor}: {n_params / 1e6:.2f}M params on {self.device}, mode {cfg.mode}, "
                 f"{cfg.batch_size}x{cfg.seq_len} tokens/step, start at step {self.step}, out {self.out_dir}")
        if self.step == 0 and self.val:
            self.watchdog.beat("evaluation at step 0")
            val = self.evaluate()
            self.log({"step": 0, "val_loss": val}, f"step     0 | val loss {val:.4f}")
        dev.reset_peak_memory(self.device)  # the log's memory is the training's, not model building's
        t_last, step_last, t_start, start_step = time.perf_counter(), self.step, time.perf_counter(), self.step
        while self.step < cfg.steps:
            self.step += 1
            self.watchdog.beat(f"step {self.step}")
            inputs, targets = self.batches.get(self.step, self.rank)
            lr = optim.lr_at(self.step, cfg.lr, cfg.warmup, cfg.steps)
            ce, norm = self.step_fn(*self.place(inputs, targets), dev.scalar(lr, self.device))
            dev.sync(self.device)
            loss, gnorm = ce.item(), norm.item()  # (both computed already: no new device program)
            if self.step == start_step + 2:  # from step 2 on, memory is the steady state's (capture,
                dev.reset_peak_memory(self.device)  # compilation and first allocations are one-offs)
            if self.step == start_step + 1 and cfg.mode == "graph":
                rep = self.step_fn.report
                self.log({"event": "graph", **rep}, f"graph: {rep['nodes']} nodes, collectives {rep['collectives']}, "
                         f"saved activations {rep['saved_bytes'] / 2**20:.1f} MiB (captured "
                         f"{rep['saved_bytes_captured'] / 2**20:.1f} MiB), offloaded {rep['offloaded_bytes'] / 2**20:.1f} MiB")
            for what, value in (("loss", loss), ("grad_norm", gnorm)):
                if not math.isfinite(value):  # the update was applied: these weights must not be saved
                    return self.stop_nonfinite(what, value)
            last = self.step == cfg.steps or self.step == cfg.halt_at
            if self.step % cfg.log_interval == 0 or last:
                now = time.perf_counter()
                tok_s = (self.step - step_last) * cfg.batch_size * cfg.seq_len / (now - t_last)
                flops = tok_s * self.flops_per_token  # all ranks' FLOP/s; MFU is per device:
                eta = (cfg.steps - self.step) * (now - t_start) / (self.step - start_step)
                mem = dev.memory_stats(self.device)
                rec = {"step": self.step, "loss": loss, "grad_norm": gnorm, "lr": lr,
                       "tokens_per_s": tok_s, "tflops": flops / 1e12, "mfu": flops / (self.peak * self.n_devices),
                       "peak_label": self.peak_label, "peak_flops": self.peak, "devices": self.n_devices, "mem_bytes": mem["peak_bytes"], "mem_kind": mem["kind"]}
                self.log(rec, f"step {self.step:5d} | loss {loss:.4f} | gnorm {rec['grad_norm']:.3f} | lr {lr:.2e}"
                         f" | {tok_s / 1e3:.1f}k tok/s | {flops / 1e12:.3f} TFLOP/s | MFU {100 * rec['mfu']:.1f}%"
                         f" of {self.peak_label} | mem {mem['peak_bytes'] / 2**30:.2f} GiB ({mem['kind']})"
                         f" | eta {eta:.0f}s")
                t_last, step_last = time.perf_counter(), self.step
            if self.val and ((cfg.eval_interval and self.step % cfg.eval_interval == 0) or self.step == cfg.steps):
                self.watchdog.beat(f"evaluation at step {self.step}")
                val = self.evaluate()
                self.log({"step": self.step, "val_loss": val}, f"step {self.step:5d} | val loss {val:.4f}")
                if self.rank == 0 and (not self.dist or self.dist.global_rank == 0):
                    self.run_dir.plot()
                if not math.isfinite(val):
                    return self.stop_nonfinite("val_loss", val)
            if (cfg.ckpt_interval and self.step % cfg.ckpt_interval == 0) or last:
                self.watchdog.beat(f"checkpoint at step {self.step}")
                self.save()
            if self.step == cfg.halt_at:
                break
        if self.step == cfg.steps and cfg.sample_tokens:
            self.sample(cfg.sample_tokens)
        return 0

    def sample(self, n):
        """A few bytes from the trained model (not under a mesh: sharded weights; nor --scan: the
        stacked blocks take no KV cache; nor for a vocabulary that is not bytes)."""
        if self.dist or self.cfg.scan or self.cfg.tokenizer or self.model_args.vocab_size != data.BYTE_VOCAB:
            return
        import generate
        text, count = generate.byte_sample(self.model, n, self.cfg.seed)
        self.log({"event": "sample", "text": text}, f"sample ({count} bytes, temperature 0.8):\n{text}")


def main(argv=None):
    cfg = build_parser().parse_args(argv)
    dist_ctx = None
    try:
        if cfg.dry_run:
            import dryrun
            validate(cfg)
            try:
                return dryrun.main(model_args_from(cfg), cfg)
            except ValueError as e:  # a mesh, batch or chip the plan cannot use
                raise ConfigError(str(e)) from None
        if cfg.mesh and not mesh.launched_by_torchrun() and (cfg.device == "xla" or dev.pjrt_is_tpu()):
            import spmd  # one process drives every XLA device; the compiler partitions the step
            if cfg.kernels == "pallas" or cfg.dp_impl != "simple":
                raise ConfigError("XLA SPMD (--device xla --mesh) runs the reference kernels and its own "
                                  "sharding: drop --kernels pallas / --dp-impl (README, Known limits)")
            dist_ctx = spmd.SpmdContext(cfg.mesh)
        elif cfg.mesh or mesh.launched_by_torchrun():
            dist_ctx = mesh.DistContext.from_cli(cfg.mesh, cfg.device, cfg.dp_impl,
                                                 torch.bfloat16 if cfg.dtype == "bf16" else None)
        rc = Trainer(cfg, dist_ctx).run()
        if dist_ctx is not None:
            dist_ctx.close()  # only on the happy path: after a peer failure it could wait on the dead
        return rc
    except (ConfigError, data.DataError, checkpoint.CheckpointError, dev.DeviceUnavailable,
            graph_trainer.GraphCaptureError, rundir.RunDirError, mesh.MeshError, hf.HFError) as e:
        error_line(e)
        return EXIT_BAD_INPUT
    except OSError as e:  # disk full, file-size limit, read-only disk: the checkpoint on disk is intact
        what = str(e) if isinstance(e, checkpoint.CheckpointWriteError) else f"{e.strerror}: {e.filename}"
        error_line(f"a write failed: {what}")
        return EXIT_WRITE_FAILED
    except (RuntimeError, torch.distributed.DistError) as e:
        if dist_ctx is None or dist_ctx.dp_impl == "spmd":  # (one process: no peer to blame)
            raise
        # A peer died or timed out: say so in one line instead of a wall of gloo traces.
        error_line(f"rank {dist_ctx.global_rank}: a collective failed, a peer process probably died "
                   f"({str(e).splitlines()[0][:200]})")
        return EXIT_PEER_FAILED


if __name__ == "__main__":
    sys.exit(main())
