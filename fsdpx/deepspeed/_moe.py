"""mesh.ep for a DeepSpeed script: DeepSpeed takes the expert-parallel size from
`MoE(..., ep_size=N)` itself (its config has no key for it outside AutoEP), fsdpx from
mesh.ep, and the two must agree (DESIGN.md, clarification 15). `initialize` therefore sets
mesh.ep from the model's MoE layers when the config leaves it at 1, and logs it.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from fsdpx.config import Config
from fsdpx.moe.layer import MoE

log = logging.getLogger("fsdpx.deepspeed")


def with_model_ep(model: nn.Module, cfg: Config) -> Config:
    """`cfg` with mesh.ep = the ep_size of the model's fsdpx MoE layers, when the config
    left mesh.ep at 1; `cfg` unchanged otherwise (a conflict is fsdpx.shard's error).

    Raises:
        ValueError: MoE layers built with different ep_size values.
    """
    sizes = sorted({m.ep_size for m in model.modules() if isinstance(m, MoE)})
    if not sizes or sizes == [cfg.mesh.ep]:
        return cfg
    if len(sizes) > 1:
        raise ValueError(
            f"the model's MoE layers were built with different ep_size values {sizes}; "
            "fsdpx runs one expert-parallel size (mesh.ep): build every layer with the same "
            "ep_size"
        )
    if cfg.mesh.ep != 1:
        return cfg  # the config asked for another size: fsdpx.shard names both
    ep = sizes[0]
    log.info("mesh.ep = %d: the model's MoE layers were built with ep_size=%d", ep, ep)
    return cfg.replace(mesh=dataclasses.replace(cfg.mesh, ep=ep))
