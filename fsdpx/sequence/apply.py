"""The sequence step of the parallelize recipe (TP -> SP/CP -> EP -> AC -> compile -> FSDP)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpx.config import Config
from fsdpx.parallel_dims import Axis
from fsdpx.sequence.hf_model import is_hf_model
from fsdpx.sequence.ring import RingSDPA
from fsdpx.sequence.tiled import apply_tiled_mlp
from fsdpx.sequence.ulysses import UlyssesSDPA


def apply_sequence_parallel(
    part: nn.Module, blocks: Sequence[nn.Module], *, cfg: Config, mesh: DeviceMesh
) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """Tile the blocks' MLPs (context_parallel.mlp_tile_tokens) and, under mesh.sp > 1,
    route a Hugging Face model's attention through Ulysses or the ring
    (context_parallel.mode), in place.

    Returns:
        For a native model under mesh.sp > 1, what activation checkpointing must enter
        around each recompute (UlyssesSDPA or RingSDPA: the engine enters it for forward;
        see [Note: Ulysses for native models]); else None.
    """
    apply_tiled_mlp(blocks, cfg.context_parallel.mlp_tile_tokens)
    sp = mesh[Axis.SP.value]
    if sp.size() == 1:
        return None
    ring = cfg.context_parallel.mode == "ring"
    if is_hf_model(part):
        from fsdpx.hf.ulysses import patch_hf_attention

        patch_hf_attention(part, sp.get_group(), tp=mesh[Axis.TP.value].size(), ring=ring)
        return None
    return partial(RingSDPA if ring else UlyssesSDPA, sp.get_group())
