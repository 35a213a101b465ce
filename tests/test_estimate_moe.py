"""The estimator's mixture-of-experts terms ([Note: expert terms] in fsdpx/estimate.py, the
dispatch formula in fsdpx/estimate_comm.py): expert state per rank under mesh.ep, the
experts' own FSDP units, and the all-to-all bytes. Measured against real 4-rank runs by
benchmarks/moe.py (README, Measured)."""

from __future__ import annotations

import math

from fsdpx.config import Config
from fsdpx.estimate import estimate_memory, param_shapes
from fsdpx.estimate_comm import comm_volume, dispatch_bytes
from tests import moe_bodies as mb

E = 8  # experts per layer; expert MLP HIDDEN -> 12 -> HIDDEN
EXPERT_NUMEL = 12 * mb.HIDDEN + 12 + mb.HIDDEN * 12 + mb.HIDDEN  # one expert


def _model(ep: int) -> mb.MoEModel:
    return mb.make_model(dict(num_experts=E, ep_size=ep, k=2, capacity_factor=None))


def _cfg(ep: int, stage: int = 3) -> Config:
    return Config.from_dict({"mesh": {"ep": ep}, "zero": {"stage": stage}})


def test_experts_are_marked() -> None:
    shapes = param_shapes(_model(1))
    experts = [s for s in shapes if s.expert]
    assert sum(s.numel for s in experts) == 2 * E * EXPERT_NUMEL  # 2 layers
    assert all(s.shape[0] == E for s in experts)


def test_expert_state_per_rank_under_ep() -> None:
    """4 ranks: ZeRO-3 without EP and ep = 2 (x edp 2) both hold E/4 experts' rows of
    master, gradient and moments; ep = 4 (edp 1) too; ZeRO-1 without EP also shards them
    (the master is the shard), so what EP changes is what is gathered."""
    base = estimate_memory(_model(1), _cfg(1), 4)
    for ep in (2, 4):
        est = estimate_memory(_model(ep), _cfg(ep), 4)
        assert est.ep == ep
        assert est.expert_params == base.expert_params == 2 * (E // 4) * EXPERT_NUMEL * 4
        assert est.params == base.params
    # Stage 3 gathers the root plus two blocks; a block's experts are E / ep of them.
    non_expert_block = sum(s.numel for s in param_shapes(_model(1)) if s.unit == 0 and not s.expert)
    root = sum(s.numel for s in param_shapes(_model(1)) if s.unit == -1)
    for ep in (1, 2, 4):
        est = estimate_memory(_model(ep), _cfg(ep), 4)
        assert est.gathered_params == 4 * (root + 2 * (non_expert_block + E // ep * EXPERT_NUMEL))
    # Stage 0 (EP refused there): experts replicated, ep not applied.
    assert estimate_memory(_model(2), _cfg(2, stage=0), 4).ep == 1


def test_uneven_expert_split_rounds_up_per_rank() -> None:
    # 8 experts, ep 2, edp 3 (6 ranks): 4 local experts over 3 ranks: rank 0 holds 2.
    est = estimate_memory(_model(2), _cfg(2), 6)
    assert est.expert_params == 2 * math.ceil(4 / 3) * EXPERT_NUMEL * 4


def test_dispatch_and_expert_gather_bytes() -> None:
    tokens = 96
    assert dispatch_bytes(tokens, 16, 2, E, 1, 4) == 0
    assert dispatch_bytes(tokens, 16, 2, E, 4, 4) == 3 * (8 * E + 4 * tokens * 2 * 16 * 4) // 4
    for ep in (1, 2, 4):
        v = comm_volume(_model(ep), _cfg(ep), 4, tokens_per_micro_step=tokens)
        assert v.all_to_all == 2 * dispatch_bytes(tokens, mb.HIDDEN, 2, E, ep, 4)  # 2 layers
    # Expert all-gathers (forward and backward, 2 layers) shrink with ep: over 4 ranks of
    # E / 4 each without EP, over edp = 2 ranks of E / 4 each at ep = 2, none at ep = 4.
    gathers = [comm_volume(_model(ep), _cfg(ep), 4).all_gather for ep in (1, 2, 4)]
    expert_bytes = EXPERT_NUMEL * 4 * (E // 4)  # one rank's share of one layer's experts
    assert gathers[0] - gathers[2] == 2 * 2 * 3 * expert_bytes
    assert gathers[1] - gathers[2] == 2 * 2 * 1 * expert_bytes
