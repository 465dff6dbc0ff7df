"""rl/grpo_task.py: GRPO post-training as a workload of the shared trainer: the policy learns from its
own samples, scored by a program (a verifiable reward), drawn by a separate rollout engine.

    python train.py --task sft --out-dir runs/sft ...                      # warm start: rl/sft_task.py
    python train.py --task grpo --init-from runs/sft --steps 100 ...       # then GRPO on its policy

The trainer (train.py) runs it like any Workload (task.py): the loop, AdamW, clipping, checkpoints, graph mode and
the SimpleFSDP mesh are its. What is GRPO's own, after torchtitan's experiments/rl and TRL's
GRPOTrainer (the pieces: rl/grpo.py the algorithm, rl/rollout.py the engine, rl/weight_sync.py the pipe;
or rl/vllm_engine.py, --engine vllm, for both):

  - a rollout batch r feeds optimizer steps r U + 1 .. r U + U (U = --updates-per-batch). At its
    first step the live policy's weights go to the engine process as policy version r U (the number
    of optimizer steps in them: every trainer rank gathers its shards in the same order, global rank 0
    broadcasts to the engine), and the engine samples G completions of each of the P prompts of
    rollout batch r, seeded by (seed, r), with their sampling logprobs;
  - rank 0 scores them (rl/arithmetic.py) and computes the advantages per group (grpo.group_advantages);
    each rank receives only its own P G / N rows (completions and mask, logprobs and advantages: two
    scatters through parallel.Parallel) and the batch's token count and mean reward. The DAPO
    normalizer is the global token count over N, so the ranks' averaged gradients are one process's
    on the whole batch;
  - the loss is grpo.policy_loss on the policy's logprobs of the completions (graph mode traces it
    whole); --kl-beta > 0 adds k3 KL to a frozen copy of the warm start, scored on each rank's rows;
  - the batch is a pure function of (seed, step) and the weights at the batch's first step, so a
    checkpoint on a rollout-batch boundary (GRPOArithmetic.check_flags, called by run/cli.py's checks,
    refuses any other) resumes bit for bit;
  - evaluations: greedy accuracy on the task's 500 held-out prompts, sampled by the engine from the
    policy at that step; a few completions in the log at the first and last evaluation. The warm
    start (--init-from) is a train.py run directory (checkpoint.load_run) or a HF directory.
    (ArithmeticPolicy, GRPOArithmetic's base, holds what the supervised warm start shares with it: the
    policy, the engine and this evaluation.)
"""
import dataclasses
import math
import os

import torch

from run import checkpoint
from run import resume
from run.flags import flag
from errors import ConfigError
from workloads.lm import LanguageModelFamily
from model import flops_per_token
from parallel import local_block, local_tensor
from rl import arithmetic, grpo, rollout, vllm_engine, weight_sync
from task import Workload

SHOWN = 4  # completions printed at the first and the last evaluation


def warm_checkpoint(cfg):
    """(checkpoint, its meta) of the --init-from run to start from: its newest verified checkpoint, or, on a
    resume, the one this run started from (its meta.json records the path and a checksum of that
    checkpoint's meta.json, which holds every file's sha256), even if the warm-start run has gained newer
    checkpoints since: the KL reference must stay the policy the run started from. Gone or changed: one line."""
    recorded = _recorded_warm_start(cfg)
    given = os.path.abspath(cfg.init_from)
    if recorded is None or given not in (recorded[0], os.path.dirname(os.path.dirname(recorded[0]))):
        return checkpoint.run_checkpoint(cfg.init_from)  # (another warm start: the resume check names it)
    path, digest = recorded
    meta_json = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_json) or checkpoint.sha256_of(meta_json) != digest or checkpoint.verify(path):
        raise ConfigError(f"--init-from {cfg.init_from}: this run started from {path}, which is "
                          f"{'changed or broken' if os.path.isdir(path) else 'gone'} (it no longer matches the "
                          f"checksum recorded at the start); the run cannot resume against another warm start")
    return path, checkpoint.read_meta(path)


def _recorded_warm_start(cfg):
    """(path, sha256) of the warm-start checkpoint recorded by the checkpoint this run resumes from, or None."""
    if not (cfg.resume or cfg.resume_from) or not cfg.out_dir:
        return None
    try:  # (the trainer's own choice, resume.resume_path; it refuses a broken or absent one itself)
        path, _ = resume.resume_path(os.path.join(cfg.out_dir, "checkpoints"), cfg.resume, cfg.resume_from)
        record = checkpoint.read_meta(path)["train"]["init_from"] if path else None
    except (checkpoint.CheckpointError, KeyError, TypeError):
        return None
    if not isinstance(record, str) or " sha256:" not in record:
        return None
    return tuple(record.rsplit(" sha256:", 1))


class PolicyFamily(LanguageModelFamily):
    """The LM family, also startable from a train.py run (--init-from RUN_DIR: its newest checkpoint,
    the warm start) besides a flavor or a Hugging Face directory."""

    def __init__(self, cfg):
        self.warm = None  # a train.py run's policy (full weights, CPU) to start from
        # meta.json's record of the warm start: a HF directory's path, or the run checkpoint's path and checksum
        self.warm_record = os.path.abspath(cfg.init_from) if cfg.init_from else None
        if cfg.init_from and not os.path.isfile(os.path.join(cfg.init_from, "config.json")):
            if cfg.set:
                raise ConfigError("--set changes the model; the warm-start run at --init-from fixes it")
            path, _ = warm_checkpoint(cfg)
            self.warm, _ = checkpoint.load_run(path, kind=self.kind)
            self.warm_record = f"{os.path.abspath(path)} sha256:{checkpoint.sha256_of(os.path.join(path, 'meta.json'))}"
            super().__init__(cfg, args=self.warm.args)
        else:
            super().__init__(cfg)  # --flavor / --set, or a HF directory

    def label(self):
        return f"run:{os.path.abspath(self.cfg.init_from)}" if self.warm is not None else super().label()

    @torch.no_grad()
    def load_pretrained(self, model):
        """The warm start's weights into the (maybe sharded) policy: each rank copies its own block."""
        if self.warm is None:
            return super().load_pretrained(model)
        full = dict(self.warm.named_parameters())
        for name, p in model.named_parameters():
            local_tensor(p).copy_(local_block(full[name], p))

    def activation_bytes(self, args, local_batch, seq_len, free_bytes):
        return 0  # (a few short rows: the LM family's estimate is for --seq-len windows)


@dataclasses.dataclass
class PolicyFlags:
    """What the warm start (sft) and GRPO share: the verifiable task and the engine."""
    reward_task: str = flag("arith", "the verifiable task that draws prompts and scores completions")
    format_credit: float = flag(0.0, "reward of a well-formed wrong answer (the exact answer scores 1)")
    max_new_tokens: int = flag(4, "tokens sampled per completion")
    engine: str = flag("ours", "the rollout engine: ours (rl/rollout.py, the teaching engine) or vllm (rl/vllm_engine.py, "
                       "in the vLLM environment)", choices=["ours", "vllm"])
    vllm_python: str = flag("", "--engine vllm: the vLLM environment's python (default: $MINITITAN_VLLM_PYTHON, or "
                            ".venv-tpu/bin/python beside train.py)")
    engine_dtype: str = flag("fp32", "the rollout engine's weights", choices=["fp32", "bf16"])
    engine_timeout: float = flag(120.0, "seconds without a reply before the engine counts as stalled (exit 4); it "
                                 "also bounds the engine's start (vLLM's takes ~40 s on 2 cores) and every message "
                                 "to and from it, a weight push's included")
    halt_at_accuracy: float = flag(0.0, "stop at the first evaluation after step 0 whose held-out accuracy is >= "
                                   "this, saving that checkpoint (the newest: what --init-from RUN takes); 0: off")


class ArithmeticPolicy(Workload):
    """What GRPO and its supervised warm start (rl/sft_task.py) share: a byte-level language model as the
    policy (PolicyFamily), the verifiable task, the rollout engine fed with the live weights, and greedy
    accuracy on the held-out prompts."""
    unit, evaluates, default_flavor = "seq", True, "llama3_debug"
    Flags, family_class = PolicyFlags, PolicyFamily
    sequence_from = "a problem's prompt and answer bytes (--max-new-tokens: the answer's)"
    eos_id = arithmetic.EOS  # (an answer ends with a newline: generate.py --run stops after it)
    # resume_policy (task.Workload): the warm start, and each of its own flags a checkpoint records (meta())

    @classmethod
    def check_flags(cls, cfg):
        try:
            longest = arithmetic.get_task(cfg.reward_task, format_credit=cfg.format_credit).max_answer_bytes
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.max_new_tokens < longest:
            raise ConfigError(f"--max-new-tokens {cfg.max_new_tokens} cannot write the {cfg.reward_task} task's "
                              f"longest answer ({longest} bytes with its newline)")
        if not (cfg.engine_timeout > 0 and math.isfinite(cfg.engine_timeout)):
            raise ConfigError(f"--engine-timeout must be a positive number of seconds, got {cfg.engine_timeout}")
        if cfg.scan or cfg.dry_run:
            raise ConfigError(f"--task {cfg.task} trains a byte-level policy unstacked: --scan and --dry-run are "
                              f"not built for it")
        if not (0 <= cfg.halt_at_accuracy <= 1):
            raise ConfigError(f"--halt-at-accuracy {cfg.halt_at_accuracy}: a held-out accuracy in (0, 1], or 0: off")
        if cfg.engine == "vllm":
            vllm_engine.vllm_python(cfg.vllm_python or None)
        elif cfg.vllm_python:
            raise ConfigError("--vllm-python is for --engine vllm")

    def halt(self, record):
        """--halt-at-accuracy: the warm start ends at its first evaluation (after step 0) that reaches it."""
        accuracy, goal = record.get("held_out_accuracy"), self.cfg.halt_at_accuracy
        if goal and record["step"] > 0 and accuracy is not None and accuracy >= goal:
            return ({"accuracy": accuracy, "halt_at_accuracy": goal},  # (not a second held_out_accuracy point)
                    f"held-out accuracy {accuracy:.4f} >= --halt-at-accuracy {goal:g}")
        return None

    def __init__(self, cfg):
        super().__init__(cfg)
        self.notes = []
        try:
            self.reward_task = arithmetic.get_task(cfg.reward_task, cfg.seed, cfg.format_credit)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.family = PolicyFamily(cfg)
        self.warm, self.warm_record = self.family.warm, self.family.warm_record
        self.prompt_len = len(self.reward_task.prompts(0, 1)[0])
        if self.prompt_len + cfg.max_new_tokens > self.args.max_seq_len:
            raise ConfigError(f"prompt ({self.prompt_len}) + --max-new-tokens ({cfg.max_new_tokens}) exceeds the "
                              f"model's max_seq_len {self.args.max_seq_len}")
        if self.args.vocab_size < 256:
            raise ConfigError(f"the policy's vocab_size {self.args.vocab_size} cannot write the task's bytes")
        if cfg.engine == "vllm":
            vllm_engine.check_model(self.args)
        self.model = self.engine = self.sender = self.synced = self.ref = None
        self.stats = {}

    def setup_data(self, dp_rank, dp_size):
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def attach(self, model, parallel):
        self.model, self.parallel = model, parallel
        self.talks_to_engine = parallel.global_rank == 0  # (rank 0 alone holds the engine)

    # ---------------------------------------------------------------------------------------------
    def _sync(self, version):
        """The live policy to the engine as `version` (skipped if it holds that version already). A
        collective on the trainer's mesh: every rank gathers the full weights, in the same order."""
        if self.synced == version:
            return
        named = list(self.model.named_parameters())
        if self.talks_to_engine:
            if self.engine is None:
                self.engine = self._start_engine()
            stats = self.engine.sync(named, version)
        else:
            self.sender = self.sender or weight_sync.Sender(None, named)
            stats = self.sender.send(named, version)
        self.synced = version
        self.stats.update(sync_mib=stats["bytes"] / 2**20, sync_s=stats["seconds"])

    def _start_engine(self):
        """The engine process --engine names; both take the same calls (sync, generate, close)."""
        dtype = torch.bfloat16 if self.cfg.engine_dtype == "bf16" else torch.float32
        if self.cfg.engine == "vllm":
            return vllm_engine.VLLMEngineProcess(self.args, dtype=dtype, timeout_s=self.cfg.engine_timeout,
                                                 python=self.cfg.vllm_python or None)
        return rollout.EngineProcess(self.args, dtype=dtype, timeout_s=self.cfg.engine_timeout)

    def _generate(self, prompts, group_size, temperature, seed):
        """Rank 0 asks the engine: (completions, engine logprobs, mask, reward) (B, ...) there; None on the
        other ranks (what they need of it reaches them through the Parallel)."""
        if not self.talks_to_engine:
            return None
        B, C = len(prompts) * group_size, self.cfg.max_new_tokens
        ro = self.engine.generate(prompts, group_size, C, temperature=temperature, seed=seed,
                                  eos_id=arithmetic.EOS, batch_size=B)
        if ro.version != self.synced:  # the ratio would compare the wrong policies
            raise rollout.EngineError(f"rollout carries policy version {ro.version}, expected {self.synced}")
        rewards = [self.reward_task.reward(p, c) for p, c in zip(ro.prompts_BxP.tolist(), ro.completions_BxC.tolist())]
        self.stats["rollout_s"] = ro.seconds
        return ro.completions_BxC.long(), ro.logprobs_BxC.float(), ro.mask_BxC.bool(), torch.tensor(rewards)

    def evaluate(self, model, step, log):
        """The task's scores (reward_task.score: the held-out accuracy, and the safety task's refusal
        rates) of greedy completions of its test set, sampled by the engine from the policy at `step`."""
        self._sync(step)
        test, names = self.reward_task.test_set(), self.reward_task.score_names
        scores_K = torch.zeros(len(names))
        drawn = self._generate(test, 1, 0.0, 0)
        if drawn is not None:
            comp_BxC = drawn[0]
            scores = self.reward_task.score(test, comp_BxC.tolist())
            scores_K[:] = torch.tensor([scores[k] for k in names])
            if step in (0, self.cfg.steps):
                shown = [bytes(p).decode().lstrip() + repr(bytes(c).split(b"\n")[0].decode("utf-8", "replace"))
                         for p, c in zip(test[:SHOWN], comp_BxC[:SHOWN].tolist())]
                log({"event": "completions", "step": step, "text": shown},
                    f"held-out completions at step {step}: " + "  ".join(shown))
        scores_K = self.parallel.broadcast_from_first(scores_K)  # (every rank halts alike)
        return dict(zip(names, scores_K.tolist()))

    def _reference(self):
        """The frozen warm start (or the seeded initial weights) on the host: the KL's (GRPO) or DPO's reference."""
        if self.ref is None:
            with torch.random.fork_rng():
                torch.manual_seed(self.cfg.seed)  # (as the trainer seeds before building the policy)
                self.ref = self.family.build(self.args)
            self.family.load_pretrained(self.ref)  # (the warm start, a HF directory, or nothing)
            self.ref.eval()
        return self.ref

    def meta(self):
        """The flags its resume_policy names, under the workload's name, and the warm start."""
        return {self.name: {k: getattr(self.cfg, k) for k in self.resume_policy if k != "init_from"},
                "init_from": self.warm_record}

    def close(self):
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def preview(self, model, log, out_dir, step, final):
        """(The last evaluation has shown completions already.)"""


@dataclasses.dataclass
class GRPOFlags(PolicyFlags):
    group_size: int = flag(8, "G, completions sampled per prompt (>= 2)")
    prompts_per_step: int = flag(32, "prompts per rollout batch (G x this rows; divisible over ranks)")
    updates_per_batch: int = flag(1, "optimizer steps on each rollout batch (--steps, --ckpt-interval, --halt-at "
                                  "must be multiples)")
    clip_eps: float = flag(0.2, "the ratio's clip range, clip(rho, 1 - eps, 1 + eps)")
    aggregation: str = flag("dapo", "loss aggregation, grpo | dapo | dr_grpo")
    kl_beta: float = flag(0.0, "k3 KL coefficient to the frozen warm-start policy (0: none)")
    temperature: float = flag(1.0, "sampling temperature")


class GRPOArithmetic(ArithmeticPolicy):
    """The policy learns from its own samples: batches are rollouts, the loss is the clipped surrogate."""
    name, Flags, plotted = "grpo", GRPOFlags, ("reward", "held_out_accuracy")
    resume_policy = {**dict.fromkeys(("init_from", "reward_task", "format_credit", "group_size", "prompts_per_step"), True),
                     "updates_per_batch": "a checkpoint falls on a rollout-batch boundary of the run's "
                                          "--updates-per-batch (another one would split a rollout batch)",
                     **dict.fromkeys(("clip_eps", "aggregation", "kl_beta", "max_new_tokens", "temperature", "engine",
                                      "engine_dtype"), True)}

    @staticmethod
    def algorithm(cfg):
        """grpo.GRPOConfig from the flags, checked (ConfigError: one line)."""
        try:
            return grpo.GRPOConfig(group_size=cfg.group_size, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps,
                                   aggregation=cfg.aggregation, beta=cfg.kl_beta, temperature=cfg.temperature).check()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def check_flags(cls, cfg):
        """The algorithm's flags, and checkpoints on rollout-batch boundaries (a resume then starts a
        fresh batch: no rollout needs replaying)."""
        super().check_flags(cfg)
        cls.algorithm(cfg)
        for name in ("prompts_per_step", "updates_per_batch"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
        u = cfg.updates_per_batch
        for name in ("steps", "ckpt_interval", "halt_at"):
            if getattr(cfg, name) % u:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(cfg, name)} is not a multiple of "
                                  f"--updates-per-batch {u} (checkpoints fall on rollout-batch boundaries)")

    @classmethod
    def loss_reduction(cls, cfg):
        """The policy update's (step.py): DAPO divides by the batch's completion-token count, which the batch
        carries (microbatch losses add up); grpo's mean of per-sequence means and Dr. GRPO's fixed count per
        row average over microbatches of equal rows. The rollout is drawn for the whole batch first."""
        return "sum" if cfg.aggregation == "dapo" else "mean"

    @classmethod
    def global_rows(cls, cfg):
        rows = cfg.prompts_per_step * cfg.group_size
        return rows, f"--prompts-per-step x --group-size = {rows} rows"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo = self.algorithm(cfg)
        self.rows, _ = self.global_rows(cfg)  # rows of one rollout batch
        self.current = None

    def _rollout(self, r):
        """Rollout batch r: sampled by the policy after r U optimizer steps; this rank's rows."""
        cfg, G = self.cfg, self.algo.group_size
        self._sync(r * cfg.updates_per_batch)
        prompts = self.reward_task.prompts(r, cfg.prompts_per_step)
        N, C = self.dp_size, cfg.max_new_tokens
        ints_Nx_bxW, floats_Nx_bxW, totals_2 = None, None, torch.zeros(2)  # b = B / N rows of this rank
        drawn = self._generate(prompts, G, self.algo.temperature, cfg.seed * 1_000_003 + r)
        if drawn is not None:  # rank 0: the advantages need every group's rewards; each rank gets its rows
            comp_BxC, logp_BxC, mask_BxC, reward_B = drawn
            adv_B = grpo.group_advantages(reward_B, G, self.algo.std_norm)
            ints_Nx_bxW = torch.cat([comp_BxC, mask_BxC.long()], 1).chunk(N)
            floats_Nx_bxW = torch.cat([logp_BxC, adv_B[:, None]], 1).chunk(N)
            totals_2 = torch.stack([mask_BxC.sum().float(), reward_B.mean()])
        ints_bxW = self.parallel.scatter_from_first(ints_Nx_bxW, torch.zeros(self.rows // N, 2 * C, dtype=torch.long))
        floats_bxW = self.parallel.scatter_from_first(floats_Nx_bxW, torch.zeros(self.rows // N, C + 1))
        n_mask, reward = self.parallel.broadcast_from_first(totals_2).tolist()
        mine = slice(self.dp_rank * self.rows // N, (self.dp_rank + 1) * self.rows // N)
        tokens_bxT = torch.cat([torch.tensor(prompts).repeat_interleave(G, 0)[mine], ints_bxW[:, :C]], 1)
        n_tokens = torch.tensor(n_mask) / N  # dapo: the global count, per rank's share
        batch = (tokens_bxT, ints_bxW[:, C:].bool(), floats_bxW[:, :C], floats_bxW[:, C], n_tokens)
        if self.algo.beta > 0:
            with torch.no_grad():
                batch += (grpo.completion_logprobs(self._reference(), tokens_bxT, self.prompt_len,
                                                   self.algo.temperature),)
        self.current = (r, batch)
        self.stats.update(reward=reward, policy_version=self.synced)

    def batch(self, step):
        """(tokens (B/N, T), mask (B/N, C), engine logprobs (B/N, C), advantages (B/N,), token normalizer
        [, reference logprobs]) of rollout batch (step - 1) // U."""
        r = (step - 1) // self.cfg.updates_per_batch
        if self.current is None or self.current[0] != r:
            self._rollout(r)
        return self.current[1]

    def loss(self, model, batch):
        tokens_BxT, mask_BxC, logp_engine_BxC, adv_B, n_tokens, *ref = batch
        logp_BxC = grpo.completion_logprobs(model, tokens_BxT, tokens_BxT.shape[1] - mask_BxC.shape[1],
                                            self.algo.temperature)
        loss, _ = grpo.policy_loss(logp_BxC, logp_engine_BxC, adv_B, mask_BxC, self.algo,
                                   logp_ref_BxC=ref[0] if ref else None, n_tokens=n_tokens, with_stats=False)
        return loss, loss

    def step_metrics(self):
        return dict(self.stats)

    # ---------------------------------------------------------------------------------------------
    @property
    def units_per_step(self):
        return self.rows

    def flops_per_step(self, args):
        T = self.prompt_len + self.cfg.max_new_tokens
        return flops_per_token(args, T) * self.rows * T
