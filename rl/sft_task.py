"""rl/sft_task.py: supervised fine-tuning on a verifiable task's solved problems, the loss on the answer only:
GRPO's warm start (`train.py --task sft`, then `train.py --task grpo --init-from` its run).

    python train.py --task sft --set dim=64 ... --steps 1250 --lr 3e-3 --out-dir runs/sft
    python train.py --task grpo --init-from runs/sft --steps 100 --lr 1e-4 ... --out-dir runs/grpo

GRPO learns nothing from a group whose G samples all score the same, so it starts from a policy that
is already partly right (DeepSeekMath, arXiv 2402.03300, starts from an SFT model; TRL's SFTTrainer's
`completion_only_loss` is the same mask). Each row is one problem, `ab+cd=` then `ef\\n`, padded with
newlines to the longest answer; the next-byte cross-entropy counts only the answer's bytes (the
newline that ends it included). The prompt digits are uniform random: predicting them is 0.94 nats a
byte of irreducible loss that the lm task on the same text spends most of its gradient on.

The batch is a pure function of (seed, step) (arithmetic.solved: the problems GRPO's prompts(step)
draws), each rank its slice. The loss is a sum over this rank's answer bytes divided by the global
batch's answer-byte count over N, so N ranks' averaged gradients are one process's on the whole batch
(answers are 3 or 4 bytes: per-rank means would weight them unequally). The policy, the engine that
evaluates it (greedy accuracy on the 500 held-out prompts) and the warm start are rl/grpo_task.py's.
"""
import torch
import torch.nn.functional as F

from errors import ConfigError
from model import flops_per_token
from rl import arithmetic
from rl.grpo_task import ArithmeticPolicy

IGNORE = -100  # F.cross_entropy's ignore_index: positions that are not an answer byte


class SFTArithmetic(ArithmeticPolicy):
    """Batches of solved problems; the loss is the cross-entropy of the answer bytes."""
    name, plotted = "sft", ("held_out_accuracy",)
    resume_policy = {"init_from": True, "reward_task": True}  # (what meta() records: ArithmeticPolicy.meta)
    # the loss divides by the whole batch's answer-byte count (a 0-d entry): microbatch losses add up (step.py)
    loss_reduction = classmethod(lambda cls, cfg: "sum")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.width = self.prompt_len + self.reward_task.max_answer_bytes  # a whole row: prompt + longest answer
        if self.width > self.args.max_seq_len:
            raise ConfigError(f"a solved problem ({self.width} bytes) exceeds the model's max_seq_len {self.args.max_seq_len}")

    def batch(self, step):
        """(inputs (B/N, W-1), targets (B/N, W-1), global answer bytes / N) of global batch `step`."""
        B, W = self.cfg.batch_size, self.width
        rows_BxW = torch.full((B, W), arithmetic.EOS, dtype=torch.long)  # padding
        targets_BxW = torch.full((B, W), IGNORE, dtype=torch.long)
        for i, (prompt, answer) in enumerate(self.reward_task.solved(step, B)):
            end = len(prompt) + len(answer)
            rows_BxW[i, :end] = torch.tensor(prompt + answer)
            targets_BxW[i, len(prompt):end] = torch.tensor(answer)  # target at t is the byte at t: shifted below
        n_tokens = (targets_BxW != IGNORE).sum().float() / self.dp_size
        mine = slice(self.dp_rank * B // self.dp_size, (self.dp_rank + 1) * B // self.dp_size)
        return rows_BxW[mine, :-1], targets_BxW[mine, 1:], n_tokens

    def loss(self, model, batch):
        inputs_BxS, targets_BxS, n_tokens = batch
        logits_BxSxV = model(inputs_BxS)
        ce = F.cross_entropy(logits_BxSxV.flatten(0, 1).float(), targets_BxS.flatten(), ignore_index=IGNORE,
                             reduction="sum") / n_tokens
        return ce, ce

    @property
    def units_per_step(self):
        return self.cfg.batch_size

    def flops_per_step(self, args):
        return flops_per_token(args, self.width - 1) * self.cfg.batch_size * (self.width - 1)

