"""Building the optimizer named in the config."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fsdpx.config import OptimizerConfig


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """The optimizer `cfg.type` over `params`, with torch's fastest implementation for the
    parameters' device (fused on CUDA, foreach on CPU where fused is not available).

    Example::

        opt = build_optimizer(model.parameters(), OptimizerConfig(type="adamw", lr=3e-4))
    """
    params = list(params)
    if cfg.type == "adamw":
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.type == "adam":
        return torch.optim.Adam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
        )
    if cfg.type == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    raise AssertionError(f"unhandled optimizer type {cfg.type!r}")  # config validated it
