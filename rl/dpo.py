"""rl/dpo.py: Direct Preference Optimization, the algorithm: sequence log-probabilities and the pair losses.

DPO (Rafailov et al., 2023, arXiv 2305.18290) learns from pairs (prompt x, chosen y_w, rejected y_l)
without a reward model or sampling. The policy's implicit reward of a completion is its log-ratio to
a frozen reference (the same start), scaled by beta:

    r(x, y)   = beta * (log pi(y | x) - log pi_ref(y | x))       log pi(y | x): summed over y's tokens
    delta     = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))

and each pair's loss pushes delta up, in one of these forms (TRL's `loss_type`, the names kept):

    sigmoid  -log sigmoid(beta delta)                              DPO (the Bradley-Terry likelihood)
    hinge    max(0, 1 - beta delta)                                SLiC (arXiv 2305.10425)
    ipo      (delta_avg - 1 / (2 beta))^2                          IPO (Azar et al., arXiv 2310.12036):
             delta_avg divides each log-ratio by its completion's token count (TRL's, confirmed with the
             authors), so beta means the same for short and long completions
    robust   (-(1 - e) log sigmoid(beta delta) + e log sigmoid(-beta delta)) / (1 - 2 e)
             rDPO (Chowdhury et al., arXiv 2403.00409): e = --label-smoothing, the fraction of pairs
             believed flipped; the unbiased loss under that noise

The batch loss is the mean over pairs, plus, with sft_weight > 0, that weight times the chosen
completions' negative log-likelihood per token (TRL's `loss_type=[..., "sft"]`, `loss_weights=[1, w]`;
RPO, Pang et al., arXiv 2404.19733). The pair losses only move the chosen side relative to the rejected
one: both can fall, and mass go to neither (likelihood displacement); the SFT term holds the chosen one
up. What TRL logs, we report (at each evaluation, on held-out
pairs): the chosen and rejected rewards, their margin, and how often the chosen one wins.

The reference's log-probabilities have no gradient and depend only on the pair, so the workload
(rl/dpo_task.py) computes them with the batch, as TRL's `precompute_ref_log_probs` does: the step is
the policy's forward and backward on both completions, whatever the layout.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1             # TRL's default
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # robust's e (TRL reads it for robust alone)
    sft_weight: float = 0.0       # the chosen completions' NLL per token, added with this weight

    def check(self):
        """ValueError (one line) for a setting the loss cannot run with."""
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown DPO loss {self.loss_type!r}; known: {', '.join(LOSS_TYPES)}")
        if not (0 < self.beta < math.inf):
            raise ValueError(f"beta must be positive and finite, got {self.beta}")
        if self.label_smoothing and self.loss_type != "robust":
            raise ValueError(f"label smoothing is the robust loss's flipped-pair rate (as in TRL); "
                             f"--dpo-loss {self.loss_type} does not read it")
        if not (0 <= self.sft_weight < math.inf):
            raise ValueError(f"the SFT weight must be finite and >= 0, got {self.sft_weight}")
        if not (0 <= self.label_smoothing < 0.5):
            raise ValueError(f"label smoothing must be in [0, 0.5) (0.5: every pair a coin flip), got {self.label_smoothing}")
        return self


def sequence_logprobs(model, tokens_BxT, mask_BxT):
    """(sum over each row's completion tokens of log p(token_t | tokens_<t), completion token counts):
    (B,), (B,). mask_BxT marks the completion's tokens (1), prompt and padding (0); position 0 is a
    prompt token, which nothing predicts."""
    logits_BxTxV = model(tokens_BxT[:, :-1]).float()
    logp_BxT = torch.log_softmax(logits_BxTxV, -1).gather(-1, tokens_BxT[:, 1:, None]).squeeze(-1)
    mask = mask_BxT[:, 1:].to(logp_BxT.dtype)
    return (logp_BxT * mask).sum(1), mask.sum(1)


def pair_losses(logp_chosen_B, logp_rejected_B, ref_chosen_B, ref_rejected_B, cfg, n_chosen_B=None, n_rejected_B=None):
    """Each pair's loss (B,) under cfg.loss_type; n_*: completion token counts (ipo's averages)."""
    chosen_B = logp_chosen_B - ref_chosen_B.detach()
    rejected_B = logp_rejected_B - ref_rejected_B.detach()
    z_B = cfg.beta * (chosen_B - rejected_B)
    if cfg.loss_type == "sigmoid":
        return -F.logsigmoid(z_B)
    if cfg.loss_type == "hinge":
        return torch.relu(1 - z_B)
    if cfg.loss_type == "ipo":
        delta_avg_B = chosen_B / n_chosen_B.clamp(min=1) - rejected_B / n_rejected_B.clamp(min=1)
        return (delta_avg_B - 1 / (2 * cfg.beta)) ** 2
    e = cfg.label_smoothing  # robust
    return (-(1 - e) * F.logsigmoid(z_B) + e * F.logsigmoid(-z_B)) / (1 - 2 * e)


def batch_loss(logp_chosen_B, logp_rejected_B, ref_chosen_B, ref_rejected_B, n_chosen_B, n_rejected_B, cfg,
               n_pairs=None, n_chosen_tokens=None):
    """The loss to minimize: the pair losses' sum over n_pairs, plus sft_weight x the chosen tokens' NLL
    summed over n_chosen_tokens. The counts default to this batch's (its mean over pairs, TRL's per-token
    mean); a trainer rank passes the global batch's over the ranks, so that ranks and microbatches add up."""
    pairs_B = pair_losses(logp_chosen_B, logp_rejected_B, ref_chosen_B, ref_rejected_B, cfg, n_chosen_B, n_rejected_B)
    loss = pairs_B.sum() / (len(pairs_B) if n_pairs is None else n_pairs)
    if cfg.sft_weight:
        loss = loss - cfg.sft_weight * logp_chosen_B.sum() / (n_chosen_B.sum() if n_chosen_tokens is None else n_chosen_tokens)
    return loss


def implicit_rewards(logp_chosen_B, logp_rejected_B, ref_chosen_B, ref_rejected_B, beta):
    """{chosen, rejected, margin, accuracy}: per-pair tensors (B,) of the implicit rewards (TRL's
    rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies before their mean)."""
    chosen_B = beta * (logp_chosen_B - ref_chosen_B).detach()
    rejected_B = beta * (logp_rejected_B - ref_rejected_B).detach()
    return {"reward_chosen": chosen_B, "reward_rejected": rejected_B, "reward_margin": chosen_B - rejected_B,
            "reward_accuracy": (chosen_B > rejected_B).float()}
