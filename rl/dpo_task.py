"""rl/dpo_task.py: DPO as a workload of the shared trainer (`train.py --task dpo`): the policy learns from
preference pairs against a frozen copy of its start (rl/dpo.py: the losses).

    python train.py --task sft --reward-task safety --max-new-tokens 6 ... --out-dir runs/helpful
    python train.py --task dpo --init-from runs/helpful --beta 0.1 ... --out-dir runs/dpo
    python train.py --task dpo --init-from runs/helpful --pairs pairs.jsonl ...      # your own pairs

The pairs come from a JSONL file in TRL's format, one {"prompt", "chosen", "rejected"} object a line
(the strings are the policy's bytes: our policies are byte-level), or, without --pairs, from the
reward task's own pairs (rl/safety.py: the refusal over compliance for a harmful request, the answer
over a refusal for the rest). A step takes --batch-size pairs, a pure function of (seed, step); each
data-parallel rank its slice. Each pair is two rows, prompt + completion, right-padded to one width
(the file's longest pair, or the task's): a pair longer than the model's max_seq_len is refused, never
truncated (a cut completion would be a different preference).

The reference is the policy's start (--init-from, or the seeded initial weights): a frozen copy on the
host of every rank (the model's weights in host memory), which scores each batch's pairs without
gradients as the batch is made. The step is then the policy's forward and backward on both
completions, concatenated into one forward as TRL does; every layout, --grad-accum and graph mode run
it as any loss (it divides by the whole batch's pair and chosen-token counts, carried in the batch:
"sum"). --sft-weight adds the chosen completions' NLL (TRL's "sft" loss beside the pair loss). A resume rebuilds the same reference (the warm start is
recorded with its checksum: rl/grpo_task.warm_checkpoint).

Each evaluation adds, besides the reward task's scores of greedy completions (rl/safety.py: refusal
rate, benign accuracy, look-alike over-refusal), TRL's reward statistics on held-out pairs: the chosen
and rejected implicit rewards, their margin and the fraction the chosen one wins.
"""
import dataclasses
import json

import torch

from errors import ConfigError
from model import flops_per_token
from rl import dpo
from rl.grpo_task import ArithmeticPolicy, PolicyFlags
from run.flags import flag

EVAL_PAIRS = 96  # held-out pairs the reward statistics are measured on (fewer: what splits over the ranks)


def read_pairs(path):
    """[(prompt, chosen, rejected) as byte lists] from a JSONL file; ConfigError (one line, naming the
    line) for a line that is not an object of three non-empty strings, or whose chosen is its rejected."""
    pairs = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--pairs {path}: cannot read it ({e})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--pairs {path} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: not an object with prompt, chosen and rejected")
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(key), str):
                raise ConfigError(f"{where}: no {key!r} string (TRL's preference format: prompt, chosen, rejected)")
        if not row["chosen"] or not row["rejected"]:
            raise ConfigError(f"{where}: an empty {'chosen' if not row['chosen'] else 'rejected'} completion")
        if row["chosen"] == row["rejected"]:
            raise ConfigError(f"{where}: chosen equals rejected (the pair prefers nothing)")
        pairs.append(tuple(list(row[k].encode()) for k in ("prompt", "chosen", "rejected")))
    if not pairs:
        raise ConfigError(f"--pairs {path}: no pairs in it")
    return pairs


def pack(pairs, width, pad):
    """(chosen tokens (B, width), chosen mask, rejected tokens, rejected mask) of `pairs`, each row its
    prompt then its completion, right-padded with `pad`: a mask marks the completion's tokens."""
    out = []
    for side in (1, 2):
        tokens_BxW = torch.full((len(pairs), width), pad, dtype=torch.long)
        mask_BxW = torch.zeros(len(pairs), width, dtype=torch.bool)
        for i, pair in enumerate(pairs):
            prompt, completion = pair[0], pair[side]
            tokens_BxW[i, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            mask_BxW[i, len(prompt):len(prompt) + len(completion)] = True
        out += [tokens_BxW, mask_BxW]
    return tuple(out)


@dataclasses.dataclass
class DPOFlags(PolicyFlags):
    reward_task: str = flag("safety", "the task whose pairs (without --pairs) and test set (the evaluation) are used")
    max_new_tokens: int = flag(8, "tokens sampled per completion (the evaluation's)")
    pairs: str = flag("", "a JSONL file of {prompt, chosen, rejected} (TRL's format); default: the reward task's own")
    beta: float = flag(0.1, "DPO's beta: the implicit reward's scale (ipo: its regularization 1 / (2 beta))")
    dpo_loss: str = flag("sigmoid", "the pair loss (rl/dpo.py)", choices=list(dpo.LOSS_TYPES))
    label_smoothing: float = flag(0.0, "robust: the fraction of pairs believed flipped, in [0, 0.5)")
    sft_weight: float = flag(0.0, "adds this weight x the chosen completions' NLL per token (TRL's loss_type "
                             "[..., 'sft']; 0: none)")


class DPOPreferences(ArithmeticPolicy):
    """Preference pairs against a frozen reference; the loss is rl/dpo.py's."""
    name, Flags, unit = "dpo", DPOFlags, "pairs"
    plotted = ("held_out_accuracy", "reward_accuracy")
    resume_policy = {**dict.fromkeys(("init_from", "reward_task", "pairs"), True),
                     **dict.fromkeys(("beta", "dpo_loss", "label_smoothing", "sft_weight", "max_new_tokens", "engine",
                                      "engine_dtype"), True)}
    # the loss divides by the whole batch's pair and chosen-token counts (0-d entries): microbatches add up
    loss_reduction = classmethod(lambda cls, cfg: "sum")

    @staticmethod
    def algorithm(cfg):
        try:
            return dpo.DPOConfig(beta=cfg.beta, loss_type=cfg.dpo_loss, label_smoothing=cfg.label_smoothing,
                                 sft_weight=cfg.sft_weight).check()
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def check_flags(cls, cfg):
        super().check_flags(cfg)
        cls.algorithm(cfg)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.algo = self.algorithm(cfg)
        self.file_pairs = read_pairs(cfg.pairs) if cfg.pairs else None
        if self.file_pairs is None:
            self.width = self.prompt_len + self.reward_task.max_answer_bytes
            held_out = self.reward_task.test_pairs()
        else:
            self.width = max(len(p) + max(len(c), len(r)) for p, c, r in self.file_pairs)
            held_out = self.file_pairs  # (a file holds no held-out pairs: its own, first ones)
        if self.width > self.args.max_seq_len:
            raise ConfigError(f"a pair of {self.width} tokens (prompt + its longer completion) exceeds the model's "
                              f"max_seq_len {self.args.max_seq_len}; pairs are not truncated (a cut completion "
                              f"is another preference): shorten them or use a model with a longer max_seq_len")
        self.held_out = held_out[:EVAL_PAIRS]

    def setup_data(self, dp_rank, dp_size):
        super().setup_data(dp_rank, dp_size)
        n = len(self.held_out) - len(self.held_out) % dp_size
        self.eval_batch = self._rows(self.held_out[:n]) if n else None

    # -- batches ----------------------------------------------------------------------------------
    def _pairs(self, step, n):
        if self.file_pairs is None:
            return self.reward_task.pairs(step, n)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        return [self.file_pairs[i] for i in torch.randint(len(self.file_pairs), (n,), generator=g).tolist()]

    def _rows(self, pairs):
        """This rank's slice of `pairs`, packed, with the reference's sequence logprobs of both sides,
        and the whole batch's pair and chosen-token counts over N (dpo.batch_loss's normalizers)."""
        N = self.dp_size
        rows = pack(pairs[self.dp_rank * len(pairs) // N:(self.dp_rank + 1) * len(pairs) // N], self.width, self.eos_id)
        counts = (torch.tensor(len(pairs) / N), torch.tensor(sum(len(p[1]) for p in pairs) / N))
        with torch.no_grad():
            ref = self._reference()
            return rows + (dpo.sequence_logprobs(ref, *rows[:2])[0], dpo.sequence_logprobs(ref, *rows[2:])[0]) + counts

    def batch(self, step):
        return self._rows(self._pairs(step, self.cfg.batch_size))

    def _logprobs(self, model, batch):
        """The policy's (chosen, rejected) sequence logprobs and token counts: one forward of both."""
        chosen_bxW, chosen_mask, rejected_bxW, rejected_mask, *_ = batch
        logp_2b, n_2b = dpo.sequence_logprobs(model, torch.cat([chosen_bxW, rejected_bxW]),
                                              torch.cat([chosen_mask, rejected_mask]))
        return logp_2b.chunk(2) + n_2b.chunk(2)

    def loss(self, model, batch):
        logp_chosen, logp_rejected, n_chosen, n_rejected = self._logprobs(model, batch)
        loss = dpo.batch_loss(logp_chosen, logp_rejected, *batch[4:6], n_chosen, n_rejected, self.algo, *batch[6:])
        return loss, loss

    def evaluate(self, model, step, log):
        """The reward task's scores, and the implicit rewards' statistics on the held-out pairs (each
        rank its slice, averaged: equal slices)."""
        scores = super().evaluate(model, step, log)
        if self.eval_batch is None:
            return scores
        batch = self.parallel.place_batch(self.eval_batch)
        with torch.no_grad():
            logp_chosen, logp_rejected, _, _ = self._logprobs(model, batch)
            stats = dpo.implicit_rewards(logp_chosen, logp_rejected, batch[4], batch[5], self.algo.beta)
            means = self.parallel.mean_over_dp(torch.stack([v.mean() for v in stats.values()]))
        return {**scores, **dict(zip(stats, means.tolist()))}

    # -------------------------------------------------------------------------------------------
    @property
    def units_per_step(self):
        return self.cfg.batch_size

    def flops_per_step(self, args):
        """The policy's forward and backward on both completions (6N a token) and the reference's
        forward on them (2N: a third more)."""
        T = self.width - 1
        return flops_per_token(args, T) * 2 * self.cfg.batch_size * T * 4 / 3
