"""Routers: which experts each token goes to, with what weight, and the auxiliary losses.

Two families, one output (`Routing`: the kept (token, expert, weight) assignments):

- DeepSpeed's gates (`capacity_gating`, k = 1 or 2): softmax scores, a per-expert capacity
  ceil(tokens / experts * capacity_factor * k) (at least min_capacity), tokens over capacity
  dropped, the GShard load-balancing loss, DeepSpeed's `exp_counts` (assignments chosen
  per expert before dropping).
- The dropless top-k router (`topk_routing`, any k): softmax or sigmoid scores, top-k,
  optionally renormalised weights, the Switch load-balancing loss and the router z-loss.

[Note: sparse routing] DeepSpeed builds dense [tokens, experts, capacity] combine and
dispatch tensors. Here a gate returns only the kept assignments; the dispatch
(fsdpx/moe/dispatch.py) sorts them by expert, which is the same arithmetic (each kept
token times its gate weight, summed over its experts) at O(tokens * k) memory, and it is
what expert parallelism needs anyway (per-expert token counts for uneven all_to_all
splits).

[Note: which tokens survive] With `use_rts=True` (DeepSpeed's Random Token Selection) the
tokens an expert keeps are the `capacity` with the highest uniform random priority, as in
DeepSpeed. With `use_rts=False`, DeepSpeed's top-1 gate keeps whichever tokens
`torch.topk` returns among equal mask values (an unspecified tie order); fsdpx keeps the
earliest tokens, the rule DeepSpeed's top-2 gate uses for both of its choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

NoisyGatePolicy = Literal["Jitter", "RSample"] | None
ScoreFunc = Literal["softmax", "sigmoid"]


@dataclass
class Routing:
    """The kept assignments of one forward; every tensor is on the input's device."""

    token: Tensor
    """[A] int64: the token of each kept assignment."""
    expert: Tensor
    """[A] int64: its expert."""
    weight: Tensor
    """[A] fp32: the weight its expert's output gets in the token's output."""
    l_aux: Tensor
    """Scalar: load-balancing loss (plus z_loss_coef * z-loss on the dropless path)."""
    exp_counts: Tensor
    """[num_experts] int64: assignments chosen per expert before any dropping."""


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's per-expert capacity: max(ceil(tokens / experts * factor), min_capacity)."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def _gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    u = torch.rand(shape, device=device)
    return -torch.log(-torch.log(u.clamp_min(1e-20)).clamp_min(1e-20))


def _keep_first(mask: Tensor, cap: int, *, offset: Tensor | None = None) -> Tensor:
    """Per expert column, keep the first `cap` ones in token order (after `offset` slots)."""
    locations = torch.cumsum(mask, dim=0) - 1
    if offset is not None:
        locations = locations + offset
    return mask * (locations < cap)


def _keep_random(mask: Tensor, cap: int) -> Tensor:
    """Per expert column, keep the `cap` ones with the highest uniform random priority."""
    priority = mask * torch.rand(mask.shape, device=mask.device)
    k = min(cap, mask.shape[0])
    top = torch.topk(priority, k=k, dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def capacity_gating(
    logits: Tensor,
    *,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool,
    use_rts: bool,
    noisy_gate_policy: NoisyGatePolicy,
    top2_2nd_expert_sampling: bool,
    used_token: Tensor | None,
    training: bool,
) -> Routing:
    """DeepSpeed's top-1 / top-2 gate on fp32 `logits` [tokens, experts]."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choose1 = gates
    if k == 1 and noisy_gate_policy == "RSample" and training:
        choose1 = logits + _gumbel(logits.shape, logits.device)
    idx1 = torch.argmax(choose1, dim=1)
    mask1 = F.one_hot(idx1, num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if k == 1:
        exp_counts = mask1.sum(dim=0)
        if drop_tokens:
            cap = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
            mask1 = _keep_random(mask1, cap) if use_rts and training else _keep_first(mask1, cap)
        kept = mask1.bool().any(dim=1)
        token = torch.nonzero(kept).flatten()
        expert = idx1[token]
        weight = gates[token, expert]
        return Routing(token, expert, weight, l_aux, exp_counts)

    # k == 2 (DeepSpeed's top2gating).
    second = logits
    if top2_2nd_expert_sampling and training:
        second = logits + _gumbel(logits.shape, logits.device)
    idx2 = torch.argmax(second.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(idx2, num_experts)
    if used_token is not None:
        mask2 = mask2 * used_token.reshape(-1, 1).to(mask2.dtype)
    exp_counts = (mask1 + mask2).sum(dim=0)
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        first_total = mask1.sum(dim=0, keepdim=True)
        mask1 = _keep_first(mask1, cap)
        mask2 = _keep_first(mask2, cap, offset=first_total)
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    tok1 = torch.nonzero(mask1.bool().any(dim=1)).flatten()
    tok2 = torch.nonzero(mask2.bool().any(dim=1)).flatten()
    return Routing(
        token=torch.cat([tok1, tok2]),
        expert=torch.cat([idx1[tok1], idx2[tok2]]),
        weight=torch.cat([g1[tok1], g2[tok2]]),
        l_aux=l_aux,
        exp_counts=exp_counts,
    )


def topk_routing(
    logits: Tensor,
    *,
    k: int,
    score_func: ScoreFunc,
    normalize_weights: bool,
    z_loss_coef: float,
    used_token: Tensor | None,
) -> Routing:
    """The dropless top-k router on fp32 `logits` [tokens, experts]; no token is dropped.

    l_aux is the Switch load-balancing loss E * sum_e f_e * P_e (f_e: the fraction of
    assignments that chose expert e, P_e: its mean normalised score; 1.0 when perfectly
    balanced) plus z_loss_coef * mean(logsumexp(logits)^2).
    """
    num_tokens, num_experts = logits.shape
    scores = F.softmax(logits, dim=1) if score_func == "softmax" else torch.sigmoid(logits)
    top_scores, top_idx = torch.topk(scores, k=k, dim=1)
    if normalize_weights:
        top_scores = top_scores / top_scores.sum(dim=1, keepdim=True).clamp_min(1e-20)
    token = torch.arange(num_tokens, device=logits.device).repeat_interleave(k)
    expert = top_idx.reshape(-1)
    weight = top_scores.reshape(-1)
    if used_token is not None:
        keep = used_token.reshape(-1).bool().repeat_interleave(k)
        token, expert, weight = token[keep], expert[keep], weight[keep]
    exp_counts = torch.bincount(expert, minlength=num_experts)
    probs = scores / scores.sum(dim=1, keepdim=True).clamp_min(1e-20)
    fraction = exp_counts.float() / max(int(expert.numel()), 1)
    l_aux = num_experts * torch.sum(fraction * probs.mean(dim=0))
    if z_loss_coef > 0:
        l_aux = l_aux + z_loss_coef * torch.logsumexp(logits, dim=1).square().mean()
    return Routing(token, expert, weight, l_aux, exp_counts)
