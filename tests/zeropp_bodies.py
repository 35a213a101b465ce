"""Rank bodies of the ZeRO++ tests (tests/test_zeropp.py); importable by spawned ranks."""

from __future__ import annotations

from typing import Any

from fsdpx.comm import comm_log
from tests.parity import fsdpx_run


def train_cases(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case trained through tests/parity.fsdpx_run: (losses, full params, bytes per
    kind sent by this rank over the run)."""
    out = {}
    for name, cfg in cases.items():
        before = comm_log().totals()
        losses, params = fsdpx_run(cfg)
        after = comm_log().totals()
        out[name] = (losses, params, {k: after[k] - before[k] for k in after})
    return out


def collectives(rank: int, world: int) -> dict[str, Any]:
    """The slot's collectives called directly: exactly representable inputs (bitwise
    checks in the test) and random ones (error-bound checks in the test)."""
    import torch
    import torch.distributed as dist

    from fsdpx.comm.fsdp_slot import QuantizedAllGather, QuantizedReduceScatter

    group = dist.group.WORLD
    assert group is not None
    g = torch.Generator().manual_seed(100 + rank)
    out: dict[str, Any] = {}

    # qwZ, exact case: blocks of 4 whose values are k * 2**-7 with one +-127 * 2**-7 each,
    # so scale = 2**-7 exactly and every q * scale is x.
    n, b = 4 * 6, 4
    k = torch.randint(-127, 128, (n,), generator=g).float()
    k[::b] = 127.0 * torch.sign(torch.randn(n // b, generator=g))
    x = k * 2.0**-7
    # fp8: blocks [448, -1, 0.5, 3] * 2**-5 have scale 2**-5 and e4m3-exact quotients.
    x_fp8 = torch.tensor([448.0, -1.0, 0.5, 3.0]).repeat(n // 4) * 2.0 ** -(5 + rank)
    for fmt, xx in (("int8", x), ("fp8", x_fp8)):
        ag = QuantizedAllGather(fmt, b)  # type: ignore[arg-type]
        got = torch.empty(world * n)
        ag(got, xx, group)
        plain = torch.empty(world * n)
        dist.all_gather_single(plain, xx)
        out[f"ag_{fmt}"] = (got, plain, ag.payload(xx))

    # qgZ, exact case: the same construction per rank piece; sums of two such values are
    # exact in fp32.
    m = 8
    k = torch.randint(-127, 128, (world * m,), generator=g).float()
    k[::b] = 127.0
    x = k * 2.0 ** -(7 + rank)
    for op in ("sum", "avg"):
        rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
        got = torch.empty(m)
        QuantizedReduceScatter(8, b)(got, x, group, rop)
        plain = torch.empty(m)
        dist.reduce_scatter_single(plain, x.clone(), op=dist.ReduceOp.SUM)
        out[f"rs_exact_{op}"] = (got, plain / world if op == "avg" else plain)

    # qgZ, random inputs over several magnitudes: the test checks the stated bound.
    m, b = 300, 64  # a partial last block in each piece
    x = torch.randn(world * m, generator=g) * torch.exp2(
        torch.randint(-6, 6, (world * m,), generator=g).float()
    )
    for bits in (8, 4):
        got = torch.empty(m)
        QuantizedReduceScatter(bits, b)(got, x, group, dist.ReduceOp.SUM)  # type: ignore[arg-type]
        out[f"rs_random_{bits}"] = got
    out["rs_random_input"] = x
    return out


def _exact_init(model: Any, seed: int) -> None:
    """Every weight +-127 * 2**e: with block size 1 each value is its own block, its scale
    2**e is exact and q = +-127, so the quantized gather returns it bit for bit."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            e = torch.randint(-14, -7, p.shape, generator=g).float()
            sign = torch.where(torch.rand(p.shape, generator=g) < 0.5, -1.0, 1.0)
            p.copy_(sign * 127.0 * torch.exp2(e))


def first_step_grads(rank: int, world: int, zero: dict[str, Any]) -> dict[str, Any]:
    """Loss and full gradients of one micro-step from the exactly representable weights."""
    import fsdpx
    from tests.parity import global_batches, make_model, shard_batch

    model = make_model()
    _exact_init(model, seed=3)
    cfg = fsdpx.Config.from_dict({"zero": zero, "precision": {"param_dtype": "bf16"}})
    engine = fsdpx.shard(model, cfg)
    x, y = global_batches(1, 1)[0][0]
    loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
    engine.backward(loss)
    grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}  # type: ignore[union-attr]
    return {"loss": loss.detach(), "grads": grads}


def gathered_weight_errors(rank: int, world: int, zero: dict[str, Any]) -> list[float]:
    """Train 5 steps with qwZ; in each forward, compare every gathered (unsharded)
    parameter of each FSDP module with the fp32 master it came from. Returns, per module
    and step, max |w_hat - w| / bound, bound = A / 254 + 2**-22 * A with A the largest
    |master| in the module (a block's absmax is at most A: the documented int8 bound)."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import fsdpx
    from tests.parity import STEPS, global_batches, make_model, shard_batch

    cfg = fsdpx.Config.from_dict({"zero": zero, "optimizer": {"lr": 1e-2}})
    engine = fsdpx.shard(make_model(), cfg)
    masters: dict[int, torch.Tensor] = {}
    ratios: list[float] = []

    def check(module: torch.nn.Module, args: Any) -> None:
        params = [(n, p) for n, p in module.named_parameters() if not isinstance(p, DTensor)]
        if not params:
            return
        amax = max(float(masters[key(module, n)].abs().max()) for n, _ in params)
        bound = amax / 254 + 2.0**-22 * amax
        err = max(float((p - masters[key(module, n)]).abs().max()) for n, p in params)
        ratios.append(err / bound)

    names = {id(m): name for name, m in engine.module.named_modules()}

    def key(module: torch.nn.Module, n: str) -> int:
        return hash((names[id(module)], n))

    fsdp_modules = [m for m in engine.module.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.register_forward_pre_hook(check)  # after FSDP's own: parameters are gathered
    for micro in global_batches(STEPS, 1):
        x, y = micro[0]
        for m in fsdp_modules:
            for n, p in m.named_parameters():
                masters[key(m, n)] = p.full_tensor().detach()  # type: ignore[attr-defined]
        loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
        engine.backward(loss)
        engine.step()
    return ratios


def training(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The training-level checks of one spawn: first-step exactness, gathered-weight
    errors, and the parity/bytes cases (with the per-call records of each case)."""
    out: dict[str, Any] = {
        "exact_plain": first_step_grads(rank, world, {}),
        "exact_qwz": first_step_grads(
            rank, world, {"quantized_weights": True, "quantization_block_size": 1}
        ),
        "weight_errors": gathered_weight_errors(rank, world, {"quantized_weights": True}),
    }
    for name, cfg in cases.items():
        mark = comm_log().mark()
        losses, params = fsdpx_run(cfg)
        calls = [(r.kind, r.bytes_sent) for r in comm_log().since(mark)]
        out[name] = (losses, params, calls)
    return out


def hpz_payloads(rank: int, world: int, block_size: int) -> dict[str, Any]:
    """One qwZ training step under hpZ (secondary groups of 2): every tensor handed to
    torch.distributed.all_gather_single, with what the slot was asked to gather."""
    import torch
    import torch.distributed as dist

    from fsdpx.comm import fsdp_slot

    wire: list[tuple[torch.dtype, int, int]] = []
    asked: list[tuple[torch.Tensor, Any]] = []
    real_ag, real_call = dist.all_gather_single, fsdp_slot.QuantizedAllGather.__call__

    def spy_ag(output: torch.Tensor, input: torch.Tensor, group: Any = None, **kw: Any) -> Any:
        wire.append((input.dtype, input.numel(), dist.get_world_size(group)))
        return real_ag(output, input, group=group, **kw)

    def spy_call(self: Any, **kw: Any) -> Any:
        inp = kw["input_tensor"]
        asked.append((inp.detach().clone(), self.payload(inp)))
        return real_call(self, **kw)

    dist.all_gather_single = spy_ag  # type: ignore[assignment]
    fsdp_slot.QuantizedAllGather.__call__ = spy_call  # type: ignore[method-assign,assignment]
    try:
        _hpz_step(rank, world, block_size)
    finally:  # the same spawn goes on with other runs (four_ranks)
        dist.all_gather_single = real_ag  # type: ignore[assignment]
        fsdp_slot.QuantizedAllGather.__call__ = real_call  # type: ignore[method-assign]
    return {"wire": wire, "asked": asked}


def _hpz_step(rank: int, world: int, block_size: int) -> None:
    import fsdpx
    from tests.parity import global_batches, make_model, shard_batch

    cfg = fsdpx.Config.from_dict(
        {
            "zero": {
                "hpz_partition_size": 2,
                "quantized_weights": True,
                "quantization_block_size": block_size,
            },
            "precision": {"param_dtype": "bf16"},
        }
    )
    engine = fsdpx.shard(make_model(), cfg)
    x, y = global_batches(1, 1)[0][0]
    loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
    engine.backward(loss)
    engine.step()


PP_GAS = 2
PP_BASE: dict[str, Any] = {
    "mesh": {"pp": 2},  # x dp_shard 2 on 4 ranks
    "pipeline": {"schedule": "1F1B"},
}


def pp_qwz(rank: int, world: int) -> dict[str, Any]:
    """qwZ under pipeline parallelism (pp 2 x dp 2, ZeRO-3 over dp in each stage), through
    tests/tp_bodies.fsdpx_run: one step from exactly representable weights (block size 1)
    with and without qwZ, and 3 steps of qwZ from the usual initialisation; with the
    per-call records of each run."""
    from tests import tp_bodies as tb

    def exact_model() -> Any:
        model = tb.make_model()
        _exact_init(model, seed=5)
        return model

    base = tb.base_cfg(PP_GAS, **PP_BASE)
    runs = {
        "plain_exact": (base, 1, exact_model),
        "qwz_exact": (
            {**base, "zero": {"quantized_weights": True, "quantization_block_size": 1}},
            1,
            exact_model,
        ),
        "qwz": ({**base, "zero": {"quantized_weights": True}}, tb.STEPS, tb.make_model),
    }
    out: dict[str, Any] = {}
    for name, (cfg, steps, make) in runs.items():
        mark = comm_log().mark()
        result = tb.fsdpx_run(cfg, steps=steps, make=make)
        result["calls"] = [(r.kind, r.bytes_sent) for r in comm_log().since(mark)]
        out[name] = result
    return out


def four_ranks(rank: int, world: int, block_size: int) -> dict[str, Any]:
    """The 4-rank ZeRO++ checks of the default tier in one spawn: hpZ payloads, qwZ + PP."""
    return {"hpz": hpz_payloads(rank, world, block_size), "pp": pp_qwz(rank, world)}


def hierarchical(rank: int, world: int) -> dict[str, Any]:
    """4 ranks as 2 simulated nodes x 2: the two-level qgZ slot called directly on random
    gradients (its per-call records too), a short training run of it, and the error for
    an HSDP mesh whose shard groups lie inside one node."""
    import torch
    import torch.distributed as dist

    from fsdpx.comm.fsdp_slot import QuantizedReduceScatter

    group = dist.group.WORLD
    assert group is not None
    g = torch.Generator().manual_seed(200 + rank)
    m, b = 300, 64  # a partial last block in each piece
    x = torch.randn(world * m, generator=g) * torch.exp2(
        torch.randint(-6, 6, (world * m,), generator=g).float()
    )
    out: dict[str, Any] = {"input": x}
    for bits in (8, 4):
        for op in ("sum", "avg"):
            rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
            got = torch.empty(m)
            mark = comm_log().mark()
            QuantizedReduceScatter(bits, b, node_size=2)(got, x, group, rop)  # type: ignore[arg-type]
            calls = [(r.kind, r.bytes_sent, r.group_size) for r in comm_log().since(mark)]
            out[f"{bits}_{op}"] = (got, calls)
    zero = {"quantized_gradients": True, "quantized_gradients_hierarchical": True}
    cfg = {
        "optimizer": {"lr": 1e-2},
        "precision": {"param_dtype": "bf16"},
        "zero": {**zero, "quantized_gradients_node_size": 2},
    }
    out["train"] = fsdpx_run(cfg)
    hsdp = {**cfg, "mesh": {"dp_replicate": 2, "dp_shard": 2}}
    try:
        fsdpx_run(hsdp)
        out["hsdp_error"] = None
    except ValueError as e:
        out["hsdp_error"] = str(e)
    return out
