"""grpo_demo.py: GRPO end to end on the arithmetic task, small enough for 2 CPU cores, outside train.py.

    python grpo_demo.py --warm-until 0.5 --steps 50       # warm start to 50% held-out, then 50 GRPO steps

1. Warm start: next-byte training on solved problems (`12+34=46\\n...`, arithmetic.py) until the policy is
   partly right: GRPO learns nothing from a group whose G samples all score the same.
2. GRPO: each step the engine process (rollout.py; its own policy copy, synced by weight_sync.py)
   samples G completions of P prompts; arithmetic.py scores them; grpo.py turns the rewards into group
   advantages and the clipped loss; `--updates` AdamW steps (optim.py) per rollout batch; the new
   weights go back to the engine with the step as the policy version.
Prints greedy accuracy on the 500 held-out problems before and after, and a few completions. This is
the workload's skeleton, not the workload: no checkpoints, no mesh, no graph mode (train.py's
Trainer takes those over when GRPO becomes one of its workloads).
"""
import argparse
import sys
import time

import torch

import arithmetic
import grpo
import optim
import rollout
from model import ModelArgs, Transformer

DEMO_MODEL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=16)
PROMPT_LEN = 6  # `ab+cd=`


def accuracy(model, task, show=0):
    """Greedy exact-answer rate on the held-out problems (the engine's decoder, in this process)."""
    test = task.test_set()
    ro = rollout.Engine(model).generate(test, 1, task.max_answer_bytes, temperature=0.0, eos_id=arithmetic.EOS,
                                        batch_size=len(test))
    model.train()
    rewards = [task.reward(p, c) for p, c in zip(test, ro.completions_BxC.tolist())]
    for p, c in list(zip(test, ro.completions_BxC.tolist()))[:show]:
        answer = bytes(c).split(bytes([arithmetic.EOS]))[0].decode("utf-8", "replace")
        print(f"  {bytes(p).decode()}{answer!r}")
    return sum(r == 1.0 for r in rewards) / len(rewards)


def adamw_step(model, state, step, lr, weight_decay):
    """optim.adamw on the model's parameters, written back in place (the sender packs them again)."""
    names, params = zip(*model.named_parameters())
    grads = [p.grad for p in params]
    new, state = optim.adamw(list(params), grads, state, step, lr, weight_decay=weight_decay,
                             mask=optim.decay_mask(names, params))
    with torch.no_grad():
        for p, n in zip(params, new):
            p.copy_(n)
            p.grad = None
    return state


def warm_start(model, task, max_steps, lr, seed, until, batch=64):
    """Supervised steps on solved problems, one problem a row, the loss on the answer bytes only (the
    prompt digits are random: nothing to learn there), until held-out accuracy reaches `until`."""
    state, acc = optim.init_state(list(model.parameters())), 0.0
    for step in range(1, max_steps + 1):
        lines = task.train_text(batch, seed * 1_000_003 + step).split(b"\n")[:-1]  # `12+34=46`, `56+78=134`
        width = PROMPT_LEN + task.max_answer_bytes
        rows = torch.tensor([list(x + b"\n" * (width - len(x))) for x in lines])
        targets = rows[:, 1:].clone()
        targets[:, :PROMPT_LEN - 1] = -100  # ignore_index: no loss on predicting the prompt
        for i, x in enumerate(lines):
            targets[i, len(x):] = -100  # nor after the answer's newline (padding)
        loss, _ = model(rows[:, :-1], targets)
        loss.backward()
        state = adamw_step(model, state, step, lr, 0.0)
        if step % 50 == 0:
            acc = accuracy(model, task)
            print(f"warm start {step}: loss {loss.item():.3f} held-out accuracy {acc:.3f}", flush=True)
            if acc >= until:
                break
    return acc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warm-steps", type=int, default=3000, help="at most this many supervised steps")
    p.add_argument("--warm-until", type=float, default=0.5, help="stop the warm start at this held-out accuracy")
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prompts", type=int, default=32, help="prompts per GRPO step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout batch")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--aggregation", default="dapo")
    p.add_argument("--task", default="arith")
    p.add_argument("--engine-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before the engine counts as stalled")
    cfg = p.parse_args(argv)
    try:
        algo = grpo.GRPOConfig(group_size=cfg.group_size, eps_low=cfg.clip, eps_high=cfg.clip,
                               aggregation=cfg.aggregation).check()
        task = arithmetic.get_task(cfg.task, cfg.seed)
        if min(cfg.steps, cfg.prompts, cfg.updates, cfg.eval_interval) < 1 or cfg.warm_steps < 0 or cfg.lr <= 0:
            raise ValueError("need --steps, --prompts, --updates, --eval-interval >= 1, --warm-steps >= 0, --lr > 0")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(cfg.seed)
    model = Transformer(DEMO_MODEL)
    t0 = time.perf_counter()
    warm_start(model, task, cfg.warm_steps, cfg.warm_lr, cfg.seed, cfg.warm_until)
    acc0 = accuracy(model, task, show=4)
    print(f"after warm start ({time.perf_counter() - t0:.0f} s): held-out greedy accuracy {acc0:.3f}", flush=True)
    dtype = torch.bfloat16 if cfg.engine_dtype == "bf16" else torch.float32
    engine = None
    try:
        engine = rollout.EngineProcess(DEMO_MODEL, dtype=dtype, timeout_s=cfg.timeout)
        state, t1, n_opt = optim.init_state(list(model.parameters())), time.perf_counter(), 0
        for step in range(cfg.steps):
            sync = engine.sync(model.named_parameters(), version=step)
            prompts = task.prompts(step, cfg.prompts)
            ro = engine.generate(prompts, algo.group_size, task.max_answer_bytes, temperature=algo.temperature,
                                 seed=cfg.seed * 1_000_003 + step, eos_id=arithmetic.EOS)
            if ro.version != step:  # the ratio would compare the wrong policies
                raise rollout.EngineError(f"rollout carries policy version {ro.version}, expected {step}")
            rewards = torch.tensor([task.reward(pr, c) for pr, c in
                                    zip(ro.prompts_BxP.tolist(), ro.completions_BxC.tolist())])
            adv = grpo.group_advantages(rewards, algo.group_size, algo.std_norm)
            full = torch.cat([ro.prompts_BxP, ro.completions_BxC], 1)
            for _ in range(cfg.updates):
                logp = grpo.completion_logprobs(model, full, PROMPT_LEN, algo.temperature)
                loss, stats = grpo.policy_loss(logp, ro.logprobs_BxC, adv, ro.mask_BxC, algo)
                loss.backward()
                n_opt += 1
                state = adamw_step(model, state, n_opt, cfg.lr, 0.0)
            line = (f"step {step + 1}: reward {rewards.mean():.3f} loss {loss.item():+.4f} ratio {stats['ratio_mean']:.4f} "
                    f"clip {stats['clip_frac']:.3f} rollout {ro.seconds:.2f}s sync {sync['bytes'] / 2**20:.2f} MiB "
                    f"{sync['seconds'] * 1e3:.1f} ms")
            if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps:
                line += f" | held-out accuracy {accuracy(model, task):.3f}"
            print(line, flush=True)
    except rollout.EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    finally:
        if engine is not None:
            engine.close()
    acc1 = accuracy(model, task, show=4)
    print(f"held-out greedy accuracy {acc0:.3f} -> {acc1:.3f} after {cfg.steps} GRPO steps "
          f"({time.perf_counter() - t1:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
