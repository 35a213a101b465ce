"""FSDP2's per-module all-gather / reduce-scatter slot, owned by fsdpx (DESIGN, Round 2
clarification 4): counted plain collectives, and ZeRO++'s quantized ones (qwZ, qgZ).

[Note: which FSDP2 extension point] torch 2.13 offers two: the tensor-subclass hooks
(`fsdp_pre_all_gather` / `fsdp_post_all_gather`, torchao's float8 route) and the module's
comm slot (`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`). fsdpx uses
the slot: it sees the one flat buffer FSDP already built for the whole module (so one
collective per module, blocks spanning parameter boundaries), it needs no parameter
subclass (which would have to survive TP's DTensors, checkpoint loading and the optimizer),
and it is the same slot for weights and gradients, so counting, qwZ and qgZ live in one
place. The fp32 master shard is never touched: the slot receives FSDP's all-gather input,
the shard already cast to the compute dtype, and quantizes only that copy. Under hpZ the
backward re-gather over the secondary group goes through the same slot (quantized on the
wire; the secondary copy FSDP keeps is the dequantized compute-dtype one: clarification 12).

Wire formats (``n`` = this rank's all-gather input numel, ``m`` = the reduce-scatter
output numel, ``b`` = block size, ``W`` = group size):

* qwZ all-gather: one ``all_gather_single`` of a uint8 payload per rank,
  ``[q: n bytes | scales: 4 * ceil(n / b) bytes]`` (q int8 or fp8 e4m3 bit patterns);
  every rank, its own piece included, dequantizes all ``W`` pieces, so all ranks compute
  with the same weights. Bytes sent: ``(W - 1) * (n + 4 * ceil(n / b))``.
* qgZ reduce-scatter: each of the ``W`` pieces of the input is quantized on its own and
  sent by one ``all_to_all_single`` of ``W`` payloads ``[q | scales]`` (int8: ``m`` bytes;
  int4: ``ceil(m / 2)``); the receiver sums the ``W`` pieces it got, dequantized, into a
  float32 buffer in rank order (the fused ``dequantize_accumulate_int8`` / ``_int4``
  kernels), then divides by ``W`` for AVG. Bytes sent:
  ``(W - 1) * (qbytes(m) + 4 * ceil(m / b))``. Or ZeRO++'s two-level scheme
  (``zero.quantized_gradients_hierarchical``: fsdpx/comm/qgz_hier.py, its formats, bytes
  and bound). Under HSDP FSDP's cross-replica all-reduce of the reduced shard is not in
  the slot (fsdpx counts and times it from the slot's edges: fsdpx/comm/fsdp_all_reduce.py)
  and stays in the reduce dtype (a documented decision).

Error bounds (``qmax`` = 127 for int8, 7 for int4; ``A_r`` = the absmax of the block of
rank ``r``'s piece that holds element ``j``; from the per-block bound in
``fsdpx/ops/quant.py`` plus float32 accumulation of ``W`` terms, ``(W - 1) * 2**-24`` of
their magnitude sum)::

    qwZ, each gathered element:  |w_hat - w| <= A / (2 * qmax) + 2**-22 * A   (int8; fp8:
                                 the fp8 bound of fsdpx/ops/quant.py), then the compute
                                 dtype's own rounding
    qgZ, SUM:  |g_hat_j - sum_r g_rj| <= (1 / (2 * qmax) + 2**-22 + W * 2**-24) * sum_r A_r
    qgZ, AVG:  the SUM bound / W, plus 2**-24 * |g_hat_j| for the division

[Note: no error feedback in qgZ] The residual of each quantization is not carried to the
next step (ZeRO++ has none either), at either level of the two-level scheme. The per-step
error is bounded as above and round-to-nearest keeps it from drifting one way; the
convergence runs of `benchmarks/zeropp.py` (several seeds: README "Measured") find the
quantized runs' final validation loss on either side of unquantized ZeRO-3's, by seed. Error feedback would cost one fp32
buffer the size of the unsharded gradient per module, which is what ZeRO-3 avoids keeping.

[Note: timing FSDP's waits] `comm_wait_s` is exposed communication: time the training
thread was blocked waiting for a collective (monitor/PROTOCOL.md "Phase times"). FSDP's
plain collectives go through `CountedAllGather` / `CountedReduceScatter`, which time it
where it happens. On a CPU device (gloo) a synchronous call (FSDP's default: all-gathers
and reduce-scatters are issued with `async_op=False`) returns only when the collective is
done, so its wall time is the wait; an asynchronous one (`unshard(async_op=True)`) comes
back as a `_TimedWork`, whose `wait()` (called by FSDP before it uses the output) is the
wait. The quantized slots are not timed as a whole: their one blocking collective
(`counted.all_gather_single` / `all_to_all_single`) is timed by the comm layer already,
and the quantize / dequantize around it is compute, not waiting; timing the slot call too
would count the collective twice. On CUDA the collectives run on FSDP's own comm streams and
the host never blocks in them: the exposed part is the time the compute stream stalls on
FSDP's events, which these slots do not see; fsdpx/comm/fsdp_events.py times it with CUDA
event pairs at FSDP's wait points ([Note: CUDA waits]). FSDP's HSDP / replicate all-reduce
is outside the slot: fsdpx/comm/fsdp_all_reduce.py counts it and times its wait on CPU
([Note: timing FSDP's all-reduce]).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from fsdpx.comm import counted, fsdp_all_reduce, fsdp_events, qgz_hier
from fsdpx.comm.fsdp_all_reduce import AllReduceTimer
from fsdpx.ops.quant import (
    dequantize_accumulate_int8,
    dequantize_fp8,
    dequantize_int8,
    quantize_fp8,
    quantize_int8,
)
from fsdpx.ops.quant_int4 import dequantize_accumulate_int4, packed_int4_bytes, quantize_int4
from fsdpx.telemetry.phases import COMM_WAIT, phase_clock

WeightFormat = Literal["int8", "fp8"]
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CLOCK = phase_clock()
W = TypeVar("W", bound="dist.Work | None")


class _TimedWork(dist.Work):
    """An asynchronous FSDP collective's work whose `wait()` counts as comm wait
    ([Note: timing FSDP's waits]); FSDP checks `isinstance(work, dist.Work)` and calls
    `wait()` once before it reads the output."""

    def __init__(self, inner: dist.Work) -> None:
        super().__init__()
        self.inner = inner

    def wait(self, timeout: timedelta | None = None) -> bool:
        started = time.perf_counter()
        try:
            return self.inner.wait() if timeout is None else self.inner.wait(timeout)
        finally:
            _CLOCK.add(COMM_WAIT, time.perf_counter() - started)

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def is_success(self) -> bool:
        return self.inner.is_success()

    def exception(self) -> BaseException | None:
        return self.inner.exception()

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        return self.inner.get_future()


def _timed(tensor: Tensor, call: Callable[[], W]) -> W | _TimedWork:
    """Run an FSDP collective, its host wait counted as comm wait on a CPU device
    ([Note: timing FSDP's waits]): the call itself when synchronous, the work's wait()
    when it returns one."""
    if not _CLOCK.enabled or tensor.device.type != "cpu":
        return call()
    started = time.perf_counter()
    work = call()
    if isinstance(work, dist.Work):
        return _TimedWork(work)  # issued only: the wait comes when FSDP waits
    _CLOCK.add(COMM_WAIT, time.perf_counter() - started)
    return work


def _n_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


class CountedAllGather(DefaultAllGather):
    """FSDP's default all-gather, counted as ``all_gather_single``. A subclass of the default
    so that FSDP's own allocation options (symmetric memory, ...) still accept it."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        w = group.size()
        counted.comm_log().add(
            "all_gather_single", (w - 1) * input_tensor.numel() * input_tensor.element_size(), w
        )
        work = _timed(
            input_tensor,
            lambda: super(CountedAllGather, self).__call__(
                output_tensor, input_tensor, group, async_op
            ),
        )
        counted.comm_log().done()  # issued (FSDP waits on it later): see counted's docstring
        return work


class _MarksAllReduce:
    """A reduce-scatter slot that, under HSDP, marks where FSDP's all-reduce begins
    (fsdpx/comm/fsdp_all_reduce.py, [Note: timing FSDP's all-reduce]): when FSDP allocates
    the output and again when the reduce-scatter is issued."""

    timer: AllReduceTimer | None = None

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        out: Tensor = super().allocate(size, dtype=dtype, device=device)  # type: ignore[misc]
        self._mark_all_reduce()
        return out

    def _mark_all_reduce(self) -> None:
        if self.timer is not None:
            self.timer.mark()


class CountedReduceScatter(_MarksAllReduce, DefaultReduceScatter):
    """FSDP's default reduce-scatter, counted as ``reduce_scatter``; under HSDP it marks
    where FSDP's all-reduce begins (fsdpx/comm/fsdp_all_reduce.py)."""

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work:
        w = group.size()
        nbytes = input_tensor.numel() * input_tensor.element_size()
        counted.comm_log().add("reduce_scatter", (w - 1) * nbytes // w, w)
        work = _timed(
            input_tensor,
            lambda: super(CountedReduceScatter, self).__call__(
                output_tensor, input_tensor, group, op, async_op
            ),
        )
        counted.comm_log().done()
        self._mark_all_reduce()
        return work


def _scales_of(payload_tail: Tensor) -> Tensor:
    """The fp32 scales at the end of a payload row. Copied: a row's scales start at any
    byte offset and a float32 view needs a multiple of 4 (they are 4 / block_size of it)."""
    return payload_tail.clone().view(torch.float32)


class _Alloc:
    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _check_float(t: Tensor, what: str) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"ZeRO++ {what} quantizes float32/bfloat16/float16 FSDP buffers, got {t.dtype} "
            "(parameters with their own all-gather hooks, e.g. float8 training, cannot be "
            "quantized again); turn zero.quantized_weights / quantized_gradients off for them"
        )


@dataclass
class QuantizedAllGather(_Alloc, AllGather):
    """qwZ: FSDP's all-gather with a blockwise int8 / fp8 payload (module docstring)."""

    fmt: WeightFormat
    block_size: int

    def payload(self, input_tensor: Tensor) -> Tensor:
        """This rank's wire payload: uint8 ``[q | scales]`` (what the test inspects)."""
        quant = quantize_int8 if self.fmt == "int8" else quantize_fp8
        q, scales = quant(input_tensor.reshape(-1), block_size=self.block_size)
        return torch.cat([q.view(torch.uint8), scales.view(torch.uint8)])

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        _check_float(input_tensor, "qwZ")
        w, n = group.size(), input_tensor.numel()
        send = self.payload(input_tensor)
        recv = send.new_empty((w, send.numel()))
        counted.all_gather_single(recv.view(-1), send, group=group)
        q_dtype = torch.int8 if self.fmt == "int8" else torch.float8_e4m3fn
        dequant = dequantize_int8 if self.fmt == "int8" else dequantize_fp8
        out = output_tensor.view(w, n)
        for r in range(w):
            q = recv[r, :n].view(q_dtype)
            scales = _scales_of(recv[r, n:])
            out[r].copy_(dequant(q, scales, block_size=self.block_size, dtype=out.dtype))
        # Synchronous: FSDP accepts a None work and then has nothing to wait on.
        return None


def _as_sum_or_avg(op: dist.ReduceOp | dist.ReduceOp.RedOpType) -> bool:
    """True for AVG, False for SUM; anything else is refused."""
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ValueError(
        f"qgZ reduces with SUM or AVG, got {op!r} (a gradient divide factor other than the "
        "group size); remove set_gradient_divide_factor or turn zero.quantized_gradients off"
    )


@dataclass
class QuantizedReduceScatter(_MarksAllReduce, _Alloc, ReduceScatter):
    """qgZ: FSDP's reduce-scatter as a quantized all-to-all with fp32 accumulation."""

    bits: Literal[8, 4]
    block_size: int
    node_size: int = 0
    """> 0: ZeRO++'s two-level scheme with this many ranks per node (fsdpx/comm/qgz_hier.py)."""
    timer: AllReduceTimer | None = None
    """Under HSDP: marks where FSDP's all-reduce begins (fsdpx/comm/fsdp_all_reduce.py)."""

    def qbytes(self, m: int) -> int:
        return m if self.bits == 8 else packed_int4_bytes(m)

    def payloads(self, input_tensor: Tensor, w: int) -> Tensor:
        """The ``(W, P)`` uint8 payloads this rank sends, row ``r`` to rank ``r``."""
        pieces = input_tensor.reshape(w, -1)
        rows = []
        for piece in pieces:
            if self.bits == 8:
                q, scales = quantize_int8(piece, block_size=self.block_size)
                q = q.view(torch.uint8)
            else:
                q, scales = quantize_int4(piece, block_size=self.block_size)
            rows.append(torch.cat([q, scales.view(torch.uint8)]))
        return torch.stack(rows)

    def accumulate_row(self, acc: Tensor, row: Tensor) -> None:
        """Add one received ``[q | scales]`` payload row, dequantized, to the float32 ``acc``
        (``m`` contiguous values): the fused native kernel, same bits as ``acc += dequantize``."""
        qb = self.qbytes(acc.numel())
        scales = _scales_of(row[qb:])
        if self.bits == 8:
            q = row[:qb].view(torch.int8)
            dequantize_accumulate_int8(acc, q, scales, block_size=self.block_size)
        else:
            dequantize_accumulate_int4(acc, row[:qb], scales, block_size=self.block_size)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> None:
        _check_float(input_tensor, "qgZ")
        avg = _as_sum_or_avg(op)
        if self.node_size:
            qgz_hier.reduce_two_level(self, output_tensor, input_tensor, group, avg)
        else:
            w, m = group.size(), output_tensor.numel()
            send = self.payloads(input_tensor, w)
            recv = torch.empty_like(send)
            counted.all_to_all_single(recv.view(-1), send.view(-1), group=group)
            acc = torch.zeros(m, dtype=torch.float32, device=output_tensor.device)
            for r in range(w):  # sum in rank order
                self.accumulate_row(acc, recv[r])
            if avg:
                acc /= w
            output_tensor.copy_(acc)
        self._mark_all_reduce()


def install(
    module: FSDPModule,
    *,
    quantized_weights: bool,
    weights_dtype: WeightFormat,
    quantized_gradients: bool,
    gradient_bits: Literal[8, 4],
    block_size: int,
    node_size: int = 0,
) -> None:
    """Put fsdpx's collectives into `module`'s FSDP slot: counted plain ones, or qwZ / qgZ
    (`node_size` > 0: qgZ's two-level scheme with that many ranks per node)."""
    ag: AllGather = (
        QuantizedAllGather(weights_dtype, block_size) if quantized_weights else CountedAllGather()
    )
    rs: ReduceScatter = (
        QuantizedReduceScatter(gradient_bits, block_size, node_size)
        if quantized_gradients
        else CountedReduceScatter()
    )
    module.set_custom_all_gather(ag)
    module.set_custom_reduce_scatter(rs)
    # HSDP / replicate: FSDP's own all-reduce, counted and timed ([Note: timing FSDP's
    # all-reduce] in fsdpx/comm/fsdp_all_reduce.py).
    timer = fsdp_all_reduce.attach(module)
    if timer is not None:
        assert isinstance(rs, CountedReduceScatter | QuantizedReduceScatter)
        rs.timer = timer
    if not quantized_weights and not quantized_gradients:
        # CUDA: the compute stream's stalls on FSDP's collectives, as CUDA event pairs
        # ([Note: CUDA waits] in fsdpx/comm/fsdp_events.py; nothing without CUDA).
        fsdp_events.attach(module)
