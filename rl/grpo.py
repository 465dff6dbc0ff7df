"""rl/grpo.py: Group Relative Policy Optimization, the algorithm: group advantages and the clipped loss.

GRPO (DeepSeekMath, arXiv 2402.03300) is PPO without a value model. Each prompt is sampled G times;
a completion's advantage is its reward relative to its own group,

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-6)        (std: unbiased, as verl and TRL)
    A_i =  r_i - mean(r_group)                                  (Dr. GRPO, arXiv 2503.20783: no std)

and every token of completion i carries A_i. The per-token objective is PPO's clipped surrogate

    rho_t = exp(logp_policy_t - logp_engine_t)
    l_t   = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)  [+ beta * k3_t]
    k3_t  = exp(logp_ref_t - logp_policy_t) - (logp_ref_t - logp_policy_t) - 1   (Schulman's k3)

where, as in torchtitan's experiments/rl, the ratio is taken against the logprobs the inference
engine returned with the samples (no extra "old policy" forward), so it also absorbs any
train/inference numerical mismatch. eps_high > eps_low is DAPO's clip-higher (arXiv 2503.14476).
How l_t becomes one number is the aggregation (TRL's loss_type):

    grpo    : mean over each sequence's tokens, then mean over sequences (short answers weigh more)
    dapo    : sum over all tokens / number of tokens in the GLOBAL batch (every token weighs the same)
    dr_grpo : sum over all tokens / a constant (default: sequences x max completion length)

Under data parallelism the trainer passes the global token count (dapo) or the global constant
(dr_grpo) so that ranks' gradients add up to the one-process gradient.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AGGREGATIONS = ("grpo", "dapo", "dr_grpo")


@dataclass(frozen=True)
class GRPOConfig:
    group_size: int = 8         # G: samples per prompt
    eps_low: float = 0.2        # clip(rho, 1 - eps_low, 1 + eps_high)
    eps_high: float = 0.2
    aggregation: str = "dapo"   # torchtitan's GRPO: the DAPO loss with equal clip bounds
    std_norm: bool = True       # False: Dr. GRPO advantages (mean baseline only)
    beta: float = 0.0           # k3 KL to a frozen reference (0: none, no reference forward)
    temperature: float = 1.0    # the sampling temperature: logprobs are of softmax(logits / T)

    def check(self):
        """ValueError (one line) for a setting the algorithm cannot run with."""
        if self.group_size < 2:
            raise ValueError(f"group size G must be >= 2 (a group of one has no baseline), got {self.group_size}")
        # (written so that NaN fails them: NaN <= 0 is False; run/cli.py refuses NaN flags before this)
        if not (0 < self.eps_low < math.inf and 0 < self.eps_high < math.inf):
            raise ValueError(f"clip bounds must be > 0 and finite, got eps_low={self.eps_low} eps_high={self.eps_high}")
        if self.eps_low >= 1:
            raise ValueError(f"eps_low must be < 1 (the ratio's lower bound 1 - eps_low > 0), got {self.eps_low}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown loss aggregation {self.aggregation!r}; known: {', '.join(AGGREGATIONS)}")
        if not (0 <= self.beta < math.inf):
            raise ValueError(f"KL coefficient beta must be finite and >= 0, got {self.beta}")
        if not (0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        return self


def group_advantages(rewards_N, group_size, std_norm=True, eps=1e-6):
    """Advantages (N,) for rewards (N,) laid out group after group (N = prompts x G)."""
    if rewards_N.numel() % group_size:
        raise ValueError(f"{rewards_N.numel()} rewards do not split into groups of {group_size}")
    r_PxG = rewards_N.float().reshape(-1, group_size)
    adv_PxG = r_PxG - r_PxG.mean(dim=1, keepdim=True)
    if std_norm:
        adv_PxG = adv_PxG / (r_PxG.std(dim=1, keepdim=True) + eps)
    return adv_PxG.reshape(-1)


def completion_logprobs(model, tokens_BxT, prompt_len, temperature=1.0):
    """log p(token_t | tokens_<t) under softmax(logits / T) for the completion tokens t >= prompt_len:
    (B, T - prompt_len). Temperature 0 (greedy sampling) scores the plain logits."""
    logits_BxCxV = model(tokens_BxT)[:, prompt_len - 1:-1].float()
    if temperature > 0:
        logits_BxCxV = logits_BxCxV / temperature
    logp_BxCxV = F.log_softmax(logits_BxCxV, dim=-1)
    return logp_BxCxV.gather(-1, tokens_BxT[:, prompt_len:, None]).squeeze(-1)


def policy_loss(logp_BxC, logp_engine_BxC, adv_B, mask_BxC, cfg, logp_ref_BxC=None, n_tokens=None, norm=None,
                with_stats=True):
    """The GRPO loss (a scalar to minimize) and statistics ({} when with_stats is False: reading them
    to Python would cut a traced graph, as graph mode traces this loss).

    logp_BxC: the policy's logprobs of the sampled tokens (with grad); logp_engine_BxC: the engine's
    (sampling) logprobs of the same tokens; adv_B: one advantage per sequence; mask_BxC: 1 for the
    completion's tokens (through its end-of-sequence token), 0 after. n_tokens (dapo) and norm
    (dr_grpo) override the local normalizers with global ones under data parallelism."""
    mask = mask_BxC.to(logp_BxC.dtype)
    rho = torch.exp(logp_BxC - logp_engine_BxC.detach())
    adv = adv_B.detach()[:, None].to(logp_BxC.dtype)
    unclipped, clipped = rho * adv, rho.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if cfg.beta > 0:
        if logp_ref_BxC is None:
            raise ValueError("beta > 0 needs the reference model's logprobs")
        d = logp_ref_BxC.detach() - logp_BxC
        kl = torch.exp(d) - d - 1
        per_token = per_token + cfg.beta * kl
    if cfg.aggregation == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif cfg.aggregation == "dapo":
        loss = (per_token * mask).sum() / (mask.sum().clamp(min=1) if n_tokens is None else n_tokens)
    elif cfg.aggregation == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.numel() if norm is None else norm)
    else:
        raise ValueError(f"unknown loss aggregation {cfg.aggregation!r}")
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        is_clipped = clipped < unclipped  # min() took the clipped term: this token's gradient is 0
        stats = {"ratio_mean": float((rho * mask).sum() / n),
                 "clip_frac": float((is_clipped.to(mask.dtype) * mask).sum() / n)}
        if kl is not None:
            stats["kl"] = float((kl * mask).sum() / n)
    return loss, stats

