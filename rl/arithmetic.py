"""rl/arithmetic.py: verifiable tasks for RL post-training: prompts, held-out test prompts, and a reward.

GRPO (DeepSeekMath, arXiv 2402.03300) needs no learned reward model when the answer can be checked:
the reward is a program. The built-in task is two-digit addition written in bytes (our debug models
are byte-level, vocab 256): the prompt `ab+cd=`, the answer `ef\n` (the sum, then a newline, which is
the end-of-sequence byte). Nothing is downloaded.

    task = get_task("arith", seed=0)
    task.prompts(step=3, n=32)             # a pure function of (seed, step): resuming replays the stream
    task.solved(step=3, n=32)              # the same problems with their answers (supervised warm start)
    task.test_set()                        # 500 held-out problems, never drawn by prompts()
    task.reward(prompt, completion_bytes)  # 1.0 exact answer; format_credit for a well-formed wrong one

    python -m rl.arithmetic write arith.txt --problems 100000   # the warm start's corpus: solved training
                                                             # problems, one a line (train.py --task lm --data)

All 90 x 90 = 8100 problems are split once by a fixed permutation (not by the run's seed), so every
run holds out the same 500 and the test accuracy of two runs is comparable. The reward compares bytes,
never decodes or `int()`s them, so any junk a policy writes (non-UTF-8, NULs, a thousand digits, no
newline at all) scores 0 instead of raising: the parser is `split at the first newline, compare`.
"""
import argparse
import importlib
import sys

import torch

import atomic

EOS = ord("\n")
DIGITS = frozenset(b"0123456789")
SPLIT_SEED = 20240205  # the held-out split is the task's, not the run's


class Arithmetic:
    """`ab+cd=` -> `ef\\n` for two-digit a and b. Problems are (a, b) pairs; text is bytes."""
    name = "arith"
    low, high = 10, 99
    n_test = 500
    max_answer_bytes = 4  # "198\n": the longest answer with its newline
    score_names = ("held_out_accuracy",)  # what score() returns, in this order

    def __init__(self, seed=0, format_credit=0.0):
        if seed < 0:
            raise ValueError(f"task seed must be >= 0, got {seed}")
        if not 0.0 <= format_credit < 1.0:
            raise ValueError(f"format credit must be in [0, 1), got {format_credit}")
        self.seed, self.format_credit = seed, format_credit
        span = self.high - self.low + 1
        order = torch.randperm(span * span, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
        pairs = [(self.low + i // span, self.low + i % span) for i in order]
        self._test, self._train = pairs[:self.n_test], pairs[self.n_test:]

    @staticmethod
    def prompt_bytes(a, b):
        return list(f"{a}+{b}=".encode())

    @staticmethod
    def answer_bytes(a, b):
        return list(f"{a + b}\n".encode())

    def prompts(self, step, n):
        """n training prompts (byte lists, all the same length) for `step`: a pure function of
        (seed, step), so a resumed run draws exactly the prompts the uninterrupted one would."""
        return [self.prompt_bytes(a, b) for a, b in self._draw(step, n)]

    def solved(self, step, n):
        """The same n training problems as prompts(step, n), each as (prompt bytes, answer bytes)."""
        return [(self.prompt_bytes(a, b), self.answer_bytes(a, b)) for a, b in self._draw(step, n)]

    def pairs(self, step, n):
        """Preference pairs of the same problems (DPO, rl/dpo_task.py): (prompt, the sum, the sum + 1)."""
        return [(self.prompt_bytes(a, b), self.answer_bytes(a, b), list(f"{a + b + 1}\n".encode()))
                for a, b in self._draw(step, n)]

    def test_pairs(self):
        """The held-out problems' pairs, in the test set's order."""
        return [(self.prompt_bytes(a, b), self.answer_bytes(a, b), list(f"{a + b + 1}\n".encode())) for a, b in self._test]

    def _draw(self, step, n):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return [self._train[i] for i in torch.randint(len(self._train), (n,), generator=g).tolist()]

    def test_set(self):
        """The held-out prompts, in a fixed order."""
        return [self.prompt_bytes(a, b) for a, b in self._test]

    def train_text(self, n, seed):
        """n solved training problems as one byte string (`12+34=46\\n...`): supervised warm start."""
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(len(self._train), (n,), generator=g).tolist()
        return b"".join(bytes(self.prompt_bytes(*self._train[i]) + self.answer_bytes(*self._train[i])) for i in idx)

    def score(self, prompts, completions):
        """The evaluation of completions of the test set: {held_out_accuracy: the exact-answer rate}."""
        return {"held_out_accuracy": sum(self.reward(p, c) == 1.0 for p, c in zip(prompts, completions)) / len(prompts)}

    def reward(self, prompt, completion):
        """Score a completion (bytes or a list of byte values, possibly junk, possibly with bytes
        after the newline, which are ignored) of `prompt` (as made by prompt_bytes)."""
        a, b = self._parse_prompt(bytes(prompt))
        text = bytes(completion)
        cut = text.find(EOS)
        if cut < 0:
            return 0.0  # never ended: not an answer (the length cap was hit)
        answer = text[:cut]
        if answer == str(a + b).encode():
            return 1.0
        well_formed = 0 < len(answer) <= self.max_answer_bytes - 1 and all(c in DIGITS for c in answer)
        return self.format_credit if well_formed else 0.0

    @staticmethod
    def _parse_prompt(prompt):
        left, plus, right = prompt.partition(b"+")
        if not (plus and right.endswith(b"=") and left.isdigit() and right[:-1].isdigit()):
            raise ValueError(f"not an arithmetic prompt: {prompt!r}")
        return int(left), int(right[:-1])


TASKS = {"arith": "rl.arithmetic:Arithmetic", "safety": "rl.safety:Safety"}  # --reward-task NAME -> "module:Class"


def get_task(name, seed=0, format_credit=0.0):
    """The task called `name` (its module imported on first use, as task.py's workloads); ValueError
    (one line, naming the known ones) for any other name."""
    if name not in TASKS:
        raise ValueError(f"unknown reward task {name!r}; known: {', '.join(sorted(TASKS))}")
    module, _, cls = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(seed, format_credit)


def main(argv=None):
    """`write FILE`: n solved training problems as text (atomically: atomic.write)."""
    p = argparse.ArgumentParser(description="write a verifiable task's solved training problems as text")
    p.add_argument("command", choices=["write"])
    p.add_argument("path")
    p.add_argument("--task", default="arith")
    p.add_argument("--problems", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.error = lambda message: (print(f"error: {message}", file=sys.stderr), sys.exit(2))
    cfg = p.parse_args(argv)
    try:
        if cfg.problems < 1:
            raise ValueError(f"--problems must be >= 1, got {cfg.problems}")
        text = get_task(cfg.task, cfg.seed).train_text(cfg.problems, cfg.seed)
        atomic.write(cfg.path, text)  # (a failed write leaves no partial file behind)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {cfg.problems} solved {cfg.task} problems ({len(text)} bytes) to {cfg.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
