"""Meta-device construction (DeepSpeed's zero.Init, the FSDP2 way): a model built under
torch.device("meta") is sharded first, then each rank allocates and initialises only its
shards. Multi-rank bodies live in tests/meta_bodies.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig
from fsdpx.materialize import materialize_
from tests.dist import run_ranks
from tests.meta_bodies import (
    ODD,
    SEED,
    TINY,
    Mixed,
    NoReset,
    Thin,
    WithBuffer,
    gpt_init,
    init_sweep,
    meta_gpt,
    rss_body,
)

NO_RESET_MSG = (
    r"NoReset was built on the meta device but has no reset_parameters\(\); pass init_fn= "
    r"to fsdpx.shard \(e.g. fsdpx.per_param_init\(...\)\) to initialise it"
)
UNWRITTEN_MSG = r"left tensors of the meta-built {cls} unwritten: {names}\. A tensor built on"

# --- multi-rank: per_param_init equals a normal build; the default path -----------------

PER_PARAM_CASES = {
    2: {
        "stage0": {"zero": {"stage": 0}},
        "stage1": {"zero": {"stage": 1}},
        "stage2": {"zero": {"stage": 2}},
        "stage3": {"zero": {"stage": 3}},
        "stage3_checkpointed": {
            "zero": {"stage": 3},
            "activation_checkpointing": {"mode": "full"},
        },
    },
    4: {
        "stage1": {"zero": {"stage": 1}},
        "stage3": {"zero": {"stage": 3}},
        "stage3_hsdp2x2": {"zero": {"stage": 3}, "mesh": {"dp_replicate": 2, "dp_shard": 2}},
        "stage3_hpz2": {"zero": {"stage": 3, "hpz_partition_size": 2}},
    },
}
DEFAULT_CASES = {
    2: {"stage3": {"zero": {"stage": 3}}, "stage0": {"zero": {"stage": 0}}},
    4: {
        "stage3": {"zero": {"stage": 3}},
        "stage0": {"zero": {"stage": 0}},
        "stage3_hsdp2x2": {"zero": {"stage": 3}, "mesh": {"dp_replicate": 2, "dp_shard": 2}},
    },
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def sweep(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, run_ranks(init_sweep, world, (PER_PARAM_CASES[world], DEFAULT_CASES[world]))


def test_per_param_init_on_meta_equals_normal_build(sweep: tuple[int, list[Any]]) -> None:
    world, results = sweep
    torch.manual_seed(999)  # the normal build's own init is overwritten: must not matter
    reference = GPT(ODD)
    fsdpx.per_param_init(gpt_init, seed=SEED)(reference)
    expected = dict(reference.named_parameters())
    for rank, result in enumerate(results):
        for case, params in result["full"].items():
            assert params.keys() == expected.keys()
            for name, value in params.items():
                torch.testing.assert_close(
                    value,
                    expected[name].detach(),
                    rtol=0,
                    atol=0,
                    msg=lambda m, r=rank, c=case, n=name: f"rank {r} {c} {n}: {m}",
                )


def test_default_init_seeds_per_shard_and_replicas_agree(sweep: tuple[int, list[Any]]) -> None:
    """[Note: init on shards]: on CPU distinct shards must not repeat each other's values,
    and ranks holding the same shard (ZeRO-0, HSDP replicas) must hold identical values."""
    world, results = sweep
    for case in DEFAULT_CASES[world]:
        per_rank = [r["default"][case] for r in results]
        for name, std in per_rank[0]["stds"].items():
            # GPT-2 init: std 0.02, or 0.02 / sqrt(2 * n_layer) on the residual projections.
            assert 0.005 < std < 0.03, f"{case} {name}: std {std} is not GPT-2's init"
        for a in range(world):
            for b in range(a + 1, world):
                same_shard = per_rank[a]["shard_index"] == per_rank[b]["shard_index"]
                for name, local in per_rank[a]["local"].items():
                    other = per_rank[b]["local"][name]
                    random_init = name.endswith("weight") and local.ndim == 2
                    if same_shard:
                        assert torch.equal(local, other), f"{case} {name}: replicas {a},{b} differ"
                    elif random_init and local.shape == other.shape:
                        assert not torch.equal(local, other), (
                            f"{case} {name}: ranks {a} and {b} hold copies of one shard"
                        )
    if world == 4:  # the cases cover all three layouts
        indices = {c: [r["default"][c]["shard_index"] for r in results] for c in DEFAULT_CASES[4]}
        assert indices["stage0"] == [[0]] * 4
        assert indices["stage3"] == [[0], [1], [2], [3]]
        assert indices["stage3_hsdp2x2"] == [[0], [1], [0], [1]]


def test_default_init_trains(sweep: tuple[int, list[Any]]) -> None:
    _, results = sweep
    losses = results[0]["default"]["stage3"]["losses"]
    assert all(r["default"]["stage3"]["losses"] == losses for r in results)
    assert abs(losses[0] - math.log(TINY.vocab_size)) < 0.3, losses  # a sane init
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_meta_errors_and_buffers_across_ranks(sweep: tuple[int, list[Any]]) -> None:
    """Pinned messages; buffers made in __init__ on meta; an unwritten parameter whose
    shard is empty on ranks >= 1 still fails on every rank (they agree via a collective)."""
    _, results = sweep
    freqs = WithBuffer.frequencies().tolist()
    for rank, out in enumerate(r["errors"] for r in results):
        assert _matches(NO_RESET_MSG, out["no_reset"]), out["no_reset"]
        for case, cls in (
            ("buffer_not_reset", "WithBuffer"),
            ("per_param_no_buffers", "WithBuffer"),
        ):
            pattern = UNWRITTEN_MSG.format(cls=cls, names="inv_freq")
            assert _matches(pattern, out[case]), (rank, case, out[case])
        assert out["buffer_reset"] == freqs
        assert out["buffer_on_cpu"] == freqs
        assert out["per_param_buffers"] == freqs
        assert out["param_on_cpu"] == list(range(8))
        assert isinstance(out["empty_shard_unwritten"], str)
    assert _matches(
        UNWRITTEN_MSG.format(cls="Thin", names="row"), results[0]["errors"]["empty_shard_unwritten"]
    )
    for r in results[1:]:
        assert "in shards held by other ranks" in r["errors"]["empty_shard_unwritten"]


def _matches(pattern: str, text: object) -> bool:
    import re

    return isinstance(text, str) and re.search(pattern, text) is not None


# --- memory: each rank allocates about its shard, not the model ------------------------

RSS_DEFAULT = GPTConfig(vocab_size=256, block_size=32, n_layer=12, n_head=8, n_embd=512)
RSS_LARGE = GPTConfig(vocab_size=256, block_size=32, n_layer=12, n_head=16, n_embd=1024)


def _check_rss(config: GPTConfig) -> None:
    world = 4
    # Spawned, not forked from tests/dist.py's preloaded server: a forked rank starts with
    # the server's VmHWM (its import peak), and rss_body's bound reads VmHWM.
    results = run_ranks(rss_body, world, (config,), fresh_interpreter=True)
    mib = 2**20
    for rank, r in enumerate(results):
        # The memory budget of one rank: its shard and half as much again.
        budget = 1.5 * r["shard_bytes"]
        print(
            f"rank {rank}: model {r['full_bytes'] / mib:.0f} MiB, shard "
            f"{r['shard_bytes'] / mib:.0f} MiB, budget {budget / mib:.0f} MiB, baseline RSS "
            f"{r['baseline_rss'] / mib:.0f} MiB; peak increase: construction "
            f"{r['build_peak_increase'] / mib:.0f} MiB ({r['build_s']:.1f} s), training "
            f"{r['train_peak_increase'] / mib:.0f} MiB ({r['train_s']:.1f} s); losses {r['losses']}"
        )
        assert r["shard_bytes"] <= r["full_bytes"] / world * 1.01
        assert r["full_bytes"] > 2.5 * budget
        assert r["build_peak_increase"] < budget, r
        assert r["finite"]
        assert abs(r["losses"][0] - r["expected_first_loss"]) < 0.3, r["losses"]
        assert r["losses"][1] < r["losses"][0], r["losses"]


def test_meta_build_rss_stays_near_shard() -> None:
    """~145 MiB fp32 model over 4 ranks (ZeRO-3)."""
    _check_rss(RSS_DEFAULT)


@pytest.mark.slow
def test_meta_build_rss_stays_near_shard_large() -> None:
    """~580 MiB fp32 model over 4 ranks (ZeRO-3); about 70 s on 2 cores."""
    _check_rss(RSS_LARGE)


# --- one process, no process group -------------------------------------------------------


def test_materialize_without_sharding_equals_normal_build_and_keeps_rng() -> None:
    torch.manual_seed(3)
    expected = GPT(TINY)
    model = meta_gpt(TINY)
    torch.manual_seed(42)
    state = torch.get_rng_state()
    materialize_(model, torch.device("cpu"), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, p), q in zip(model.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_materialize_without_reset_parameters_raises() -> None:
    with torch.device("meta"):
        model = NoReset()
    with pytest.raises(ValueError, match=NO_RESET_MSG):
        materialize_(model, torch.device("cpu"), seed=0)


def test_materialize_checks_buffers_and_parameters() -> None:
    with torch.device("meta"):
        model = WithBuffer(reset_buffers=False)
    with pytest.raises(ValueError, match=UNWRITTEN_MSG.format(cls="WithBuffer", names="inv_freq")):
        materialize_(model, torch.device("cpu"), seed=0)

    with torch.device("meta"):
        model = Thin()
    with pytest.raises(ValueError, match=UNWRITTEN_MSG.format(cls="Thin", names="row")):
        materialize_(model, torch.device("cpu"), seed=0)

    with torch.device("meta"):
        mixed = Mixed()  # `scale` is made on the CPU: kept, not re-initialised
    materialize_(mixed, torch.device("cpu"), seed=0)
    assert mixed.scale.tolist() == list(range(8))

    class Counters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))
            self.register_buffer("mask", torch.ones(2, dtype=torch.bool))

        def reset_parameters(self) -> None:
            self.fc.reset_parameters()

    with torch.device("meta"):
        model = Counters()
    with pytest.raises(ValueError, match=UNWRITTEN_MSG.format(cls="Counters", names="steps")):
        materialize_(model, torch.device("cpu"), seed=0)
    # bool has no sentinel: zero-filled, not checked (documented in [Note: meta buffers]).
    assert model.mask.tolist() == [False, False]


def test_per_param_init_unwritten_parameter_raises() -> None:
    def skips_bias(name: str, t: torch.Tensor, g: torch.Generator) -> None:
        if not name.endswith("bias"):
            t.normal_(generator=g)

    model = meta_gpt(ODD)
    unwritten = UNWRITTEN_MSG.format(cls="GPT", names=r"blocks\.0\.ln_1\.bias, .* and 9 more")
    with pytest.raises(ValueError, match="^init_fn " + unwritten):
        materialize_(model, torch.device("cpu"), seed=0, init_fn=fsdpx.per_param_init(skips_bias))


def test_per_param_init_depends_only_on_seed_and_unwrapped_name() -> None:
    def values(seed: int, wrap: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed + 100)  # the model's own RNG use must not matter
        inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
        model: nn.Module = inner
        if wrap:
            model = nn.Module()
            model._checkpoint_wrapped_module = inner
        fsdpx.per_param_init(gpt_init, seed=seed)(model)
        return {n: p.detach().clone() for n, p in inner.named_parameters()}

    a, b, c = values(0, wrap=False), values(0, wrap=True), values(1, wrap=False)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["0.weight"], c["0.weight"])
    assert not torch.equal(a["0.weight"], a["1.weight"])  # same shape, distinct names
