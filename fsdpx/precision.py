"""Mixed precision: the FSDP2 dtype policy, fp16 loss scaling, gradient overflow checks.

The scalers follow DeepSpeed (``deepspeed/runtime/fp16/loss_scaler.py``), so a DeepSpeed
fp16 run and an fsdpx run with the same ``fp16`` config skip the same steps. They hold only
Python state; the tensor work is in the free functions, usable without the engine.

Example::

    scaler = build_loss_scaler(cfg)
    scale = scaler.scale  # read before update(), which may change it
    (loss * scale).backward()
    if not scaler.update(grads_have_overflow(model.parameters())):
        unscale_grads_(model.parameters(), 1.0 / scale)
        optimizer.step()
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdpx.config import Config, LossScaleConfig, PrecisionConfig
from fsdpx.dtensor import to_local

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

StateValue = int | float | bool


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config dtype name ("fp32", "bf16" or "fp16")."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype name {name!r}; expected one of {', '.join(map(repr, _DTYPES))}"
        ) from None


def mp_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """The FSDP2 policy: gathered parameters and forward inputs in ``param_dtype``,
    gradient reduction in ``reduce_dtype``; all-fp32 gives the no-cast default policy.
    The parallelize recipe (fsdpx/parallelize.py) builds it once for every part it shards.

    Example::

        fully_shard(block, mp_policy=mp_policy(PrecisionConfig("bf16", "fp32")))
    """
    if precision.param_dtype == "fp32" and precision.reduce_dtype == "fp32":
        return MixedPrecisionPolicy()
    # reduce_dtype is always explicit: None would make FSDP reduce in param_dtype, which
    # silently drops the fp32 reduction asked for by ("bf16", "fp32").
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(precision.param_dtype),
        reduce_dtype=torch_dtype(precision.reduce_dtype),
        cast_forward_inputs=True,
    )


# --- loss scalers ---------------------------------------------------------------------


class LossScaler(ABC):
    """Multiply the loss by ``scale``; report each step's overflow to ``update``.

    The state dict holds the attributes named in ``_STATE``, as plain numbers (msgpack).
    """

    dynamic: bool = False
    checks_overflow: bool = True
    """Whether steps are checked for inf/nan gradients (and skipped on overflow). True for
    every fp16 scaler, whatever its scale: a static scale of 1 still skips, as in DeepSpeed."""
    _STATE: tuple[str, ...] = ()

    @property
    @abstractmethod
    def scale(self) -> float: ...

    @abstractmethod
    def update(self, overflow: bool) -> bool:
        """Advance one optimizer step; returns True if that step must be skipped."""

    def state_dict(self) -> dict[str, StateValue]:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, d: dict[str, StateValue]) -> None:
        if set(d) != set(self._STATE):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expected keys {sorted(self._STATE)}; "
                f"got {sorted(d)}. The checkpoint was saved with another fp16 loss-scale "
                "setting (precision.param_dtype, fp16.static_scale); resume with the same one."
            )
        for k in self._STATE:
            # Keep each attribute's type: msgpack may hand back 65536 for 65536.0.
            setattr(self, k, type(getattr(self, k))(d[k]))


class NoLossScaler(LossScaler):
    """Scale 1 that never skips a step: fp32 and bf16 have fp32's exponent range."""

    checks_overflow = False

    @property
    def scale(self) -> float:
        return 1.0

    def update(self, overflow: bool) -> bool:
        return False


class StaticLossScaler(LossScaler):
    """A fixed scale. Like DeepSpeed, an overflowing step is still skipped."""

    _STATE = ("cur_scale",)

    def __init__(self, scale: float) -> None:
        assert scale > 0, f"{scale=}"
        self.cur_scale = float(scale)

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> bool:
        return overflow


class DynamicLossScaler(LossScaler):
    """DeepSpeed's ``DynamicLossScaler.update_scale``, rule for rule.

    An overflow skips the step and halves the scale (not below ``min_scale``) once the
    hysteresis budget is spent, else spends one unit of it; it also restarts the window.
    After ``window`` clean steps the scale doubles and the budget refills (with
    ``consecutive_hysteresis`` every clean step refills it). Unlike DeepSpeed, an overflow
    at ``min_scale`` does not raise: the config has no ``raise_error_at_min_scale``.
    """

    dynamic = True
    _STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.scale_factor = 2.0
        self.cur_scale = float(2**cfg.initial_scale_power)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = cfg.hysteresis

    @property
    def scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> bool:
        cfg = self.cfg
        if overflow:
            if cfg.hysteresis == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, cfg.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if cfg.consecutive_hysteresis:
                self.cur_hysteresis = cfg.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % cfg.window == 0:
                if not cfg.consecutive_hysteresis:
                    self.cur_hysteresis = cfg.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return overflow


def build_loss_scaler(cfg: Config) -> LossScaler:
    """The scaler for a config: none unless parameters compute in fp16, then static when
    ``fp16.static_scale > 0``, else dynamic."""
    if cfg.precision.param_dtype != "fp16":
        return NoLossScaler()
    if cfg.fp16.static_scale > 0:
        return StaticLossScaler(cfg.fp16.static_scale)
    return DynamicLossScaler(cfg.fp16)


# --- gradient passes ------------------------------------------------------------------


def _local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        grads.append(to_local(g))
    return grads


def _flag_device(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.device:
    # Prefer an accelerator: a CPU flag copied there needs no sync, while a non-blocking
    # copy the other way could be read before it lands. A rank with no tensors must still
    # join the all_reduce, on a device its backend accepts.
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    if not tensors and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def autocast_context(mode: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The engine's forward context for `precision.autocast`: torch.autocast(bfloat16) on
    the device's type for "bf16", nothing for "none"."""
    if mode == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def grads_have_overflow(
    params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> bool:
    """Whether any gradient holds inf or nan on any rank of ``group``.

    Args:
        params: parameters whose ``.grad`` (tensor, DTensor or None) is checked. Every rank
            of ``group`` must call this, even one without gradients.
        group: the group to agree over (None: the default group); unused when
            torch.distributed is not initialised.

    Returns:
        The same answer on every rank, after one device-to-host sync.

    Example::

        if grads_have_overflow(model.parameters()): ...
    """
    params = list(params)
    grads = _local_grads(params)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not grads and not distributed:
        return False
    locals_ = [to_local(p) for p in params]
    device = _flag_device(grads + locals_, group)
    flag = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        # isfinite rather than a sum: a large finite fp32 gradient can overflow a sum.
        # Stacking per-tensor flags keeps everything on device until the one .item().
        bad = [(~torch.isfinite(g)).any().to(device, non_blocking=True) for g in grads]
        flag = torch.stack(bad).any().to(torch.float32)
    if distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def unscale_grads_(params: Iterable[torch.Tensor], inv_scale: float) -> None:
    """Multiply every gradient (its local shard for a DTensor) by ``inv_scale`` in place.

    Example::

        unscale_grads_(model.parameters(), 1.0 / loss_scale)
    """
    if inv_scale == 1.0:
        return  # the fp32/bf16 path: skip a kernel launch per gradient.
    # _foreach_mul_ needs one device and dtype per call; sparse grads take the plain path.
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in _local_grads(params):
        if g.is_sparse:
            g.mul_(inv_scale)
        else:
            buckets.setdefault((g.device, g.dtype), []).append(g)
    for grads in buckets.values():
        torch._foreach_mul_(grads, inv_scale)
