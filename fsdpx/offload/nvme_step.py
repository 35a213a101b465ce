"""The optimizer step of ZeRO-Infinity's NVMe offload: the fp32 master and Adam states of
this rank's shards live in one swap file (fsdpx/offload/nvme.py) and are streamed through a
few fixed host buffers, chunk by chunk: the store reads chunk i+1 while `adam_step` updates
chunk i and chunk i-1 is written back, so host memory stays at `buffer_mb` whatever the
model size.

[Note: the flat layout] Each region of the file (0 master, 1 exp_avg, 2 exp_avg_sq) is the
concatenation of the parameters' local shards in param-group order (`_Slot.offset`). A chunk
may span several parameters and param groups; it is cut into segments, one per parameter,
and each (param group, step) gets one `adam_step` call over its segments. Elementwise the
update is the one the in-memory optimizer does, so results are bitwise equal.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fsdpx.offload.cpu import wrap_like
from fsdpx.offload.grad_stream import local
from fsdpx.offload.nvme import BufferSet, NvmeStore
from fsdpx.ops import adam_step

if TYPE_CHECKING:
    from fsdpx.offload.cpu import OffloadedAdamW, _Slot

MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


@dataclass(frozen=True)
class _Segment:
    slot: _Slot
    lo: int
    """Start within the parameter's flat local shard."""
    hi: int
    buf: int
    """Start within the chunk's buffers."""


class NvmeState:
    """The NVMe side of OffloadedAdamW (see the module docstring).

    Args:
        opt: the optimizer (slots, param groups, state, copy stream).
        masters: id(param) -> fp32 local shard to start the master from.
        copy_dtype: 16-bit dtype of the device parameters, or None (fp32 on device).
        rank: names the swap file.
    """

    def __init__(
        self,
        opt: OffloadedAdamW,
        masters: dict[int, torch.Tensor],
        copy_dtype: torch.dtype | None,
        rank: int,
    ) -> None:
        cfg = opt.offload
        assert cfg.nvme_path is not None  # OffloadConfig checks it
        self._opt = opt
        self._slots = opt.slots()
        self._starts = [s.offset for s in self._slots]
        grad_dtypes = {local(s.param).dtype for s in self._slots}
        grad_dtype = grad_dtypes.pop() if len(grad_dtypes) == 1 else torch.float32
        extra = {"grad": grad_dtype}
        if copy_dtype is not None:
            extra["copy"] = copy_dtype
        self.store = NvmeStore(
            cfg.nvme_path,
            rank=rank,
            numel=max(opt.total_numel, 1),
            regions=3,
            buffer_bytes=cfg.buffer_mb << 20,
            extra_dtypes=extra,
            pin_memory=opt.pin_memory,
        )
        self.host_bytes = self.store.host_bytes
        self._copy = copy_dtype is not None
        self._on_accel = opt.copy_stream is not None
        self._init_file(masters)

    # --- layout -------------------------------------------------------------------------

    def _segments(self, chunk: int, n: int) -> list[_Segment]:
        start = chunk * self.store.chunk_numel
        end = start + n
        out = []
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while i < len(self._slots) and self._slots[i].offset < end:
            s = self._slots[i]
            lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
            if lo < hi:
                out.append(_Segment(s, lo - s.offset, hi - s.offset, lo - start))
            i += 1
        return out

    def _chunks(self) -> range:
        return range(self.store.num_chunks)

    # --- passes over the file -----------------------------------------------------------

    def _init_file(self, masters: dict[int, torch.Tensor]) -> None:
        """Masters from the parameters, zero moments."""

        def update(chunk: int, n: int, bufs: BufferSet) -> None:
            for r in (MASTER, EXP_AVG, EXP_AVG_SQ):
                bufs.regions[r][:n].zero_()
            for seg in self._segments(chunk, n):
                src = masters[id(seg.slot.param)].reshape(-1)[seg.lo : seg.hi]
                bufs.regions[MASTER][seg.buf : seg.buf + seg.hi - seg.lo].copy_(src)

        self.store.stream(self._chunks(), update, read=False)
        for s in self._slots:
            self._opt.state[s.param] = {"step": torch.zeros((), dtype=torch.float32)}

    @torch.no_grad()
    def step(self, inv_grad_scale: float) -> None:
        opt = self._opt
        for s in self._slots:
            if "exp_avg" in opt.state.get(s.param, {}):
                # Only the swap file holds the moments; tensors put into `state` from
                # outside (optimizer.load_state_dict) would be silently ignored.
                raise RuntimeError(
                    "OffloadedAdamW with NVMe offload keeps exp_avg/exp_avg_sq in its swap "
                    "file, but `state` holds such tensors (from optimizer.load_state_dict?); "
                    "load optimizer state with engine.load_checkpoint instead"
                )
        step_of = {id(s.param): step for step, slots in opt._steps().items() for s in slots}
        if not step_of:
            return
        opt.wait_copies_done()  # the copy buffers of the previous step are free
        opt.begin_copies()

        def update(chunk: int, n: int, bufs: BufferSet) -> Callable[[], None] | None:
            segs = [g for g in self._segments(chunk, n) if id(g.slot.param) in step_of]
            if not segs:
                return None
            grad_buf = bufs.extra["grad"]
            for g in segs:
                grad = local(g.slot.param.grad)  # type: ignore[arg-type]
                grad_buf[g.buf : g.buf + g.hi - g.lo].copy_(grad.reshape(-1)[g.lo : g.hi])
            calls: dict[tuple[int, int], list[_Segment]] = {}
            for g in segs:
                calls.setdefault((g.slot.group, step_of[id(g.slot.param)]), []).append(g)
            for (gi, step), group_segs in calls.items():
                self._adam(bufs, gi, step, group_segs, inv_grad_scale)
            src = bufs.extra["copy"] if self._copy else bufs.regions[MASTER]
            for g in segs:
                dst = local(g.slot.param).reshape(-1)[g.lo : g.hi]
                opt.copy_to_device(dst, src[g.buf : g.buf + g.hi - g.lo])
            return self._fence()

        self.store.stream(self._chunks(), update)
        opt.finish_copies()

    def _adam(
        self, bufs: BufferSet, gi: int, step: int, segs: list[_Segment], inv_grad_scale: float
    ) -> None:
        group = self._opt.param_groups[gi]
        beta1, beta2 = group["betas"]

        def views(t: torch.Tensor) -> list[torch.Tensor]:
            return [t[g.buf : g.buf + g.hi - g.lo] for g in segs]

        adam_step(
            views(bufs.regions[MASTER]),
            views(bufs.extra["grad"]),
            views(bufs.regions[EXP_AVG]),
            views(bufs.regions[EXP_AVG_SQ]),
            lr=float(group["lr"]),
            step=step,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            bias_correction=group.get("bias_correction", True),
            inv_grad_scale=inv_grad_scale,
            param_copies=views(bufs.extra["copy"]) if self._copy else None,
        )

    def _fence(self) -> Callable[[], None] | None:
        """The buffer set may be refilled once its copies to the device have landed."""
        stream = self._opt.copy_stream
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event.synchronize

    @torch.no_grad()
    def push_masters(self) -> None:
        """Copy every master to its device parameter (after a checkpoint load)."""
        opt = self._opt
        opt.wait_copies_done()
        opt.begin_copies()

        def update(chunk: int, n: int, bufs: BufferSet) -> Callable[[], None] | None:
            for g in self._segments(chunk, n):
                dst = local(g.slot.param).reshape(-1)[g.lo : g.hi]
                opt.copy_to_device(dst, bufs.regions[MASTER][g.buf : g.buf + g.hi - g.lo])
            return self._fence()

        self.store.stream(self._chunks(), update, write=False)
        opt.finish_copies()

    # --- checkpoints --------------------------------------------------------------------

    @contextlib.contextmanager
    def checkpoint_view(self) -> Iterator[dict[int, torch.Tensor]]:
        """Memory-mapped views of the swap file as the optimizer's state and masters (see
        OffloadedAdamW.checkpoint_view); pages are read or written only as the checkpoint
        touches them, so host memory stays bounded."""
        views = [self.store.view(r) for r in (MASTER, EXP_AVG, EXP_AVG_SQ)]
        masters: dict[int, torch.Tensor] = {}
        opt = self._opt
        try:
            for s in self._slots:
                shape = local(s.param).shape

                def part(r: int, s: _Slot = s, shape: torch.Size = shape) -> torch.Tensor:
                    return views[r][s.offset : s.offset + s.numel].view(shape)

                masters[id(s.param)] = wrap_like(s.param, part(MASTER))
                state = opt.state.setdefault(s.param, {})
                if not isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = wrap_like(s.param, part(EXP_AVG))
                state["exp_avg_sq"] = wrap_like(s.param, part(EXP_AVG_SQ))
            yield masters
        finally:
            for s in self._slots:
                state = opt.state.get(s.param)
                if not state or "exp_avg" not in state:
                    # A checkpoint saved before any step holds no state: start from zero.
                    for r in (EXP_AVG, EXP_AVG_SQ):
                        views[r][s.offset : s.offset + s.numel].zero_()
                    step = state.get("step") if state else None
                    state = {"step": step if isinstance(step, torch.Tensor) else torch.zeros(())}
                else:
                    for r, key in ((EXP_AVG, "exp_avg"), (EXP_AVG_SQ, "exp_avg_sq")):
                        t = local(state.pop(key))
                        mine = views[r][s.offset : s.offset + s.numel]
                        if t.data_ptr() != mine.data_ptr():
                            mine.copy_(t.reshape(-1))  # a loader made its own tensor
                opt.state[s.param] = state
            views.clear()
            masters.clear()
            self.store.flush()

    def close(self) -> None:
        self.store.close()
