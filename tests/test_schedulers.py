"""fsdpx.schedulers against closed forms of DeepSpeed's lr formulas.

The references below are written from DeepSpeed's documented formulas in DeepSpeed's
own terms: ``i`` = last_batch_iteration, -1 at construction and +1 per step(). They
deliberately use DeepSpeed's float arithmetic (``1/log(W) * log(i+1)``, the OneCycle
``x = 1 + b/total - cycle`` form) rather than the module's, so they check it
independently. After n step() calls the scheduler must show ``ref(n - 1)``.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from typing import Literal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.config import SchedulerConfig
from fsdpx.schedulers import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

LR = 0.1
WarmupType = Literal["log", "linear"]
STEPS = 30


def _opt(lr: float = LR, groups: int = 1) -> torch.optim.Optimizer:
    params = [
        {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (g + 1)} for g in range(groups)
    ]
    return torch.optim.SGD(params, lr=lr)


def _run(sched: torch.optim.lr_scheduler.LRScheduler, steps: int = STEPS) -> list[float]:
    """lr at construction, then after each of `steps` optimizer+scheduler steps."""
    opt = sched.optimizer
    seen = [float(sched.get_last_lr()[0])]
    for _ in range(steps):
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
        seen.append(float(sched.get_last_lr()[0]))
    return seen


def _expect(ref: Callable[[int], float], steps: int = STEPS) -> list[float]:
    return [ref(n - 1) for n in range(steps + 1)]


def _close(got: list[float], want: list[float]) -> None:
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


# --- references -------------------------------------------------------------------------


def ref_warmup(
    i: int, *, lo: float, hi: float, w: int, kind: str, total: int | None = None
) -> float:
    """WarmupLR (total None) / WarmupDecayLR."""
    if i < 0:
        return lo
    w = max(2, w)
    if i < w:
        gamma = (1.0 / math.log(w)) * math.log(i + 1) if kind == "log" else i / w
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, float(total - i) / float(max(1.0, total - w)))
    return lo + (hi - lo) * gamma


def ref_cosine(
    i: int, *, base: float, w: int, total: int, kind: str, min_ratio: float, cos_min: float
) -> float:
    if i < 0:
        return 0.0
    w = max(2, w)
    if i < w:
        r = (1.0 / math.log(w)) * math.log(i + 1) if kind == "log" else i / w
        return base * (min_ratio + r * (1.0 - min_ratio))
    progress = min(1.0, (i - w + 1) / max(1, total - w))
    r = (1 + math.cos(math.pi * progress)) / 2
    return base * max(0.0, cos_min + (1.0 - cos_min) * r)


def ref_one_cycle(
    i: int,
    *,
    lo: float,
    hi: float,
    first: int,
    second: int,
    stairs1: int = 0,
    stairs2: int = 0,
    rate: float = 0.0,
    decay: int = 0,
) -> float:
    total = float(first + second)
    if i < total:
        b = i + 1
        cycle = math.floor(1 + b / total)
        x = 1.0 + b / total - cycle
        ratio = first / total
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        if stairs1 > 0 or stairs2 > 0:
            # The half (and its stair count) is chosen by integer position here; DeepSpeed
            # chooses the count by `x <= ratio`, which only differs at a float-rounded peak.
            ci = b % total
            if ci <= first:
                pos, n = ci * stairs1 / first, stairs1
            else:
                pos, n = (total - ci) * stairs2 / second, stairs2
            if n > 0:
                scale = math.floor(pos) / n
        return lo + (hi - lo) * scale
    if decay == 0 or rate == 0:
        return lo
    return lo / (1 + rate * ((i - total + 1) / decay))


# --- sequences --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("w", [1, 7, 10, 40])
def test_warmup_lr_sequence(kind: WarmupType, w: int) -> None:
    cfg = SchedulerConfig(
        type="WarmupLR", warmup_min_lr=0.01, warmup_max_lr=0.5, warmup_num_steps=w, warmup_type=kind
    )
    got = _run(WarmupLR(_opt(), cfg))
    _close(got, _expect(lambda i: ref_warmup(i, lo=0.01, hi=0.5, w=w, kind=kind)))


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("w", "total"), [(5, 20), (10, 11), (1, 25), (3, 60)])
def test_warmup_decay_lr_sequence(kind: WarmupType, w: int, total: int) -> None:
    cfg = SchedulerConfig(
        type="WarmupDecayLR",
        warmup_min_lr=0.0,
        warmup_max_lr=0.2,
        warmup_num_steps=w,
        warmup_type=kind,
        total_num_steps=total,
    )
    got = _run(WarmupDecayLR(_opt(), cfg))
    _close(got, _expect(lambda i: ref_warmup(i, lo=0.0, hi=0.2, w=w, kind=kind, total=total)))


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("w", "total"), [(5, 20), (10, 10), (1, 25), (4, 60)])
def test_warmup_cosine_lr_sequence(kind: WarmupType, w: int, total: int) -> None:
    cfg = SchedulerConfig(
        type="WarmupCosineLR",
        warmup_num_steps=w,
        warmup_type=kind,
        total_num_steps=total,
        warmup_min_ratio=0.1,
        cos_min_ratio=0.05,
    )
    got = _run(WarmupCosineLR(_opt(), cfg))
    _close(
        got,
        _expect(
            lambda i: ref_cosine(
                i, base=LR, w=w, total=total, kind=kind, min_ratio=0.1, cos_min=0.05
            )
        ),
    )


@pytest.mark.parametrize(
    ("first", "second", "s1", "s2", "rate", "decay"),
    [
        (5, None, 0, None, 0.0, 0),
        (4, 6, 0, None, 0.5, 3),
        (3, 7, 0, None, 0.0, 2),  # decay_lr_rate 0: no decay
        (8, 8, 4, None, 1.0, 1),
        (9, 6, 3, 2, 0.1, 0),  # decay_step_size 0: no decay
    ],
)
def test_one_cycle_sequence(
    first: int, second: int | None, s1: int, s2: int | None, rate: float, decay: int
) -> None:
    cfg = SchedulerConfig(
        type="OneCycle",
        cycle_min_lr=0.01,
        cycle_max_lr=0.3,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_first_stair_count=s1,
        cycle_second_stair_count=s2,
        decay_lr_rate=rate,
        decay_step_size=decay,
    )
    sec = first if second is None else second
    st2 = s1 if s2 is None else s2
    got = _run(OneCycle(_opt(), cfg))
    _close(
        got,
        _expect(
            lambda i: ref_one_cycle(
                i,
                lo=0.01,
                hi=0.3,
                first=first,
                second=sec,
                stairs1=s1,
                stairs2=st2,
                rate=rate,
                decay=decay,
            )
        ),
    )


@settings(max_examples=60, deadline=None)
@given(
    first=st.integers(1, 12),
    second=st.integers(1, 12),
    s1=st.integers(0, 5),
    s2=st.integers(0, 5),
    rate=st.sampled_from([0.0, 0.3]),
    decay=st.integers(0, 4),
)
def test_one_cycle_matches_reference_property(
    first: int, second: int, s1: int, s2: int, rate: float, decay: int
) -> None:
    cfg = SchedulerConfig(
        type="OneCycle",
        cycle_min_lr=1e-3,
        cycle_max_lr=1e-2,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_first_stair_count=s1,
        cycle_second_stair_count=s2,
        decay_lr_rate=rate,
        decay_step_size=decay,
    )
    got = _run(OneCycle(_opt(), cfg), steps=first + second + 5)
    want = _expect(
        lambda i: ref_one_cycle(
            i,
            lo=1e-3,
            hi=1e-2,
            first=first,
            second=second,
            stairs1=s1,
            stairs2=s2,
            rate=rate,
            decay=decay,
        ),
        steps=first + second + 5,
    )
    _close(got, want)


# --- hand-computed points ---------------------------------------------------------------


def test_linear_warmup_hand_points() -> None:
    cfg = SchedulerConfig(
        type="WarmupLR",
        warmup_min_lr=0.0,
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="linear",
    )
    lrs = _run(WarmupLR(_opt(), cfg), steps=15)
    assert lrs[0] == 0.0 and lrs[1] == 0.0  # construction, then i=0
    assert lrs[6] == pytest.approx(0.05)  # i=5: midpoint of 10 warmup steps
    assert lrs[11] == pytest.approx(0.1) and lrs[15] == pytest.approx(0.1)


def test_log_warmup_reaches_peak_at_last_warmup_step() -> None:
    cfg = SchedulerConfig(
        type="WarmupLR",
        warmup_min_lr=0.0,
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="log",
    )
    lrs = _run(WarmupLR(_opt(), cfg), steps=12)
    assert lrs[1] == 0.0  # log(1) = 0
    assert lrs[10] == pytest.approx(0.1)  # i=9: log(10)/log(10)
    assert lrs[5] == pytest.approx(0.1 * math.log(5) / math.log(10))


def test_warmup_decay_hand_points() -> None:
    cfg = SchedulerConfig(
        type="WarmupDecayLR",
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="linear",
        total_num_steps=20,
    )
    lrs = _run(WarmupDecayLR(_opt(), cfg), steps=25)
    assert lrs[11] == pytest.approx(0.1)  # i=10: decay starts at the peak
    assert lrs[16] == pytest.approx(0.05)  # i=15: (20-15)/(20-10)
    assert lrs[21] == 0.0 and lrs[25] == 0.0  # i=20 reaches the floor and stays


def test_cosine_hand_points() -> None:
    cfg = SchedulerConfig(
        type="WarmupCosineLR",
        warmup_num_steps=5,
        warmup_type="linear",
        total_num_steps=19,
        warmup_min_ratio=0.2,
        cos_min_ratio=0.01,
    )
    lrs = _run(WarmupCosineLR(_opt(), cfg), steps=25)
    assert lrs[0] == 0.0  # DeepSpeed's pre-start value, not warmup_min_ratio * lr
    assert lrs[1] == pytest.approx(0.2 * LR)
    assert lrs[3] == pytest.approx(LR * (0.2 + 0.8 * 2 / 5))
    assert lrs[12] == pytest.approx(LR * (0.01 + 0.99 * 0.5))  # i=11: progress 7/14
    assert lrs[19] == pytest.approx(0.01 * LR)  # total_num_steps steps: cos_min_ratio * lr
    assert all(v == pytest.approx(0.01 * LR) for v in lrs[19:])


def test_one_cycle_hand_points() -> None:
    cfg = SchedulerConfig(
        type="OneCycle",
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_lr_rate=0.5,
        decay_step_size=2,
    )
    lrs = _run(OneCycle(_opt(), cfg), steps=14)
    assert lrs[0] == 0.01  # starts at cycle_min_lr
    assert lrs[2] == pytest.approx(0.01 + 0.09 * 0.5)
    assert lrs[4] == pytest.approx(0.1)  # peak after first_step_size steps
    assert lrs[7] == pytest.approx(0.055)  # halfway down: 3 of 6
    assert lrs[10] == pytest.approx(0.01)  # cycle over
    assert lrs[11] == pytest.approx(0.01 / (1 + 0.5 * 0.5))  # 1 decay step of 2
    assert lrs[14] == pytest.approx(0.01 / (1 + 0.5 * 2.0))


def test_one_cycle_stairs_hand_points() -> None:
    cfg = SchedulerConfig(
        type="OneCycle",
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_first_stair_count=2,
    )
    lrs = _run(OneCycle(_opt(), cfg), steps=8)
    assert lrs == pytest.approx([0.0, 0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])


# --- defaults, resume, factory ----------------------------------------------------------


def test_max_lr_none_uses_each_groups_initial_lr() -> None:
    cfg = SchedulerConfig(type="WarmupLR", warmup_num_steps=4, warmup_type="linear")
    assert cfg.warmup_max_lr is None
    opt = _opt(lr=0.3, groups=2)  # group lrs 0.3 and 0.6
    sched = WarmupLR(opt, cfg)
    _run(sched, steps=6)
    assert sched.get_last_lr() == pytest.approx([0.3, 0.6])

    oc = SchedulerConfig(type="OneCycle", cycle_first_step_size=2)
    assert oc.cycle_max_lr is None
    sched2 = OneCycle(_opt(lr=0.4), oc)
    assert _run(sched2, steps=2)[2] == pytest.approx(0.4)


@pytest.mark.parametrize(
    "cfg",
    [
        SchedulerConfig(type="WarmupLR", warmup_min_lr=0.01, warmup_num_steps=8),
        SchedulerConfig(
            type="WarmupDecayLR", warmup_num_steps=5, total_num_steps=20, warmup_type="linear"
        ),
        SchedulerConfig(type="WarmupCosineLR", warmup_num_steps=5, total_num_steps=20),
        SchedulerConfig(
            type="OneCycle",
            cycle_min_lr=0.001,
            cycle_first_step_size=4,
            cycle_second_step_size=5,
            decay_lr_rate=0.2,
            decay_step_size=2,
        ),
    ],
    ids=lambda c: c.type,
)
def test_state_dict_round_trip_resumes_sequence(cfg: SchedulerConfig) -> None:
    full = _run(build_scheduler(_opt(), cfg), steps=STEPS)  # type: ignore[arg-type]

    opt = _opt()
    sched = build_scheduler(opt, cfg)
    assert sched is not None
    _run(sched, steps=11)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # state must be plain data

    opt2 = _opt(lr=123.0)  # wrong lr on purpose: the restored initial_lr must win
    sched2 = build_scheduler(opt2, cfg)
    assert sched2 is not None
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert sched2.get_last_lr()[0] == full[11]
    _close(_run(sched2, steps=STEPS - 11)[1:], full[12:])

    # Constructor resume, DeepSpeed's last_batch_iteration=k: continues the same way.
    opt3 = _opt(lr=123.0)
    opt3.load_state_dict(saved["opt"])
    cls = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}
    sched3 = cls[cfg.type](opt3, cfg, last_epoch=10)
    assert sched3.last_epoch == 11
    _close(_run(sched3, steps=STEPS - 11), full[11:])


def test_build_scheduler_types() -> None:
    assert build_scheduler(_opt(), SchedulerConfig()) is None
    assert build_scheduler(_opt(), SchedulerConfig(type="none")) is None
    for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle):
        total = 2000 if cls in (WarmupDecayLR, WarmupCosineLR) else None
        cfg = SchedulerConfig(type=cls.__name__, total_num_steps=total)  # type: ignore[arg-type]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only the keys a schedule reads: no warning
            sched = build_scheduler(_opt(), cfg)
        assert type(sched) is cls
        assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)


def test_unused_key_warns_and_names_it() -> None:
    # SchedulerConfig rejects keys its own type does not read (tests/test_config.py); a
    # class built from a config of another type still warns about the keys it ignores.
    cfg = SchedulerConfig(type="WarmupDecayLR", total_num_steps=2000, warmup_max_lr=0.5)
    with pytest.warns(
        UserWarning,
        match=r"scheduler\.warmup_max_lr set but not used by the "
        r"WarmupCosineLR",
    ):
        WarmupCosineLR(_opt(), cfg)


def test_missing_total_num_steps_is_an_error() -> None:
    cfg = SchedulerConfig(type="WarmupLR")  # total_num_steps only validated for its types
    with pytest.raises(
        ValueError, match="'scheduler.total_num_steps' is required for WarmupDecayLR"
    ):
        WarmupDecayLR(_opt(), cfg)
    with pytest.raises(ValueError, match="required for WarmupCosineLR"):
        WarmupCosineLR(_opt(), cfg)


def test_tensor_lr_is_supported() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.2), foreach=False)
    cfg = SchedulerConfig(type="WarmupLR", warmup_num_steps=4, warmup_type="linear")
    sched = WarmupLR(opt, cfg)
    for _ in range(3):
        p.grad = torch.ones(2)
        opt.step()
        sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.2 * 2 / 4)
