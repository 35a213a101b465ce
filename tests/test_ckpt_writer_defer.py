"""RankWriter(defer=True) ([Note: deferred pieces]): encoding overlaps across pieces, the
bytes are the ones the plain writer writes, `written` runs once a piece is in the file,
and an encoding error surfaces and aborts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from checkpoint_tools.format import CheckpointReader, RankWriter, write_manifest
from checkpoint_tools.format.kernels import NumpyKernels

FILE_ID = b"d" * 16


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/a": torch.randn(50, 20, generator=g),  # 1000 floats: one 4000-byte chunk
        "model/b": torch.randn(3000, generator=g),  # three chunks
        "model/empty": torch.zeros(0),
        "model/c": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "optim/a/exp_avg": torch.rand(50, 20, generator=g),
        "model/d": torch.randn(999, generator=g),
    }


def _write(d: Path, defer: bool, calls: list[tuple[str, int]] | None = None) -> RankWriter:
    w = RankWriter(d, 0, chunk_bytes=4000, threads=2, file_id=FILE_ID, defer=defer)
    for name, t in _tensors().items():

        def written(name: str = name) -> None:
            if calls is not None:
                calls.append((name, w._pos))

        w.add(name, t, global_shape=t.shape, offsets=(0,) * t.dim(), written=written)
        if not defer and calls is not None:
            assert calls[-1][0] == name  # the plain writer: before add returns
    return w


def test_deferred_pieces_write_the_same_bytes_and_call_back_once_written(tmp_path: Path) -> None:
    plain = _write(tmp_path / "plain", defer=False)
    write_manifest(tmp_path / "plain", world_size=1, rank_files=[plain.close()], state={})
    calls: list[tuple[str, int]] = []
    w = _write(tmp_path / "defer", defer=True, calls=calls)
    # Nothing waits for a chunk until the in-flight window (2 x threads) is full.
    assert len(calls) < len(_tensors())
    pieces: list[dict[str, Any]] = list(w._pieces)
    write_manifest(tmp_path / "defer", world_size=1, rank_files=[w.close()], state={})
    assert (tmp_path / "plain" / "rank-00000.data").read_bytes() == (
        tmp_path / "defer" / "rank-00000.data"
    ).read_bytes()
    assert (tmp_path / "plain" / "rank-00000.index").read_bytes() == (
        tmp_path / "defer" / "rank-00000.index"
    ).read_bytes()
    assert sorted(n for n, _ in calls) == sorted(_tensors())  # each exactly once
    ends = {p["name"]: max((c[0] + c[1] for c in p["chunks"]), default=0) for p in pieces}
    for name, pos in calls:
        assert pos >= ends[name], name  # its last chunk was in the file when it was called
    with CheckpointReader(tmp_path / "defer") as r:
        for name, t in _tensors().items():
            assert torch.equal(r.read(name), t), name


class _FailingKernels(NumpyKernels):
    """Fails the third chunk's shuffle (on an encode thread)."""

    def __init__(self) -> None:
        self.calls = 0

    def shuffle_crc(self, src: Any, size: int, dst: np.ndarray, want: Any) -> list[int]:
        self.calls += 1
        if self.calls == 3:
            raise OSError("injected encode failure")
        return super().shuffle_crc(src, size, dst, want)


def test_an_encoding_error_of_a_deferred_piece_surfaces_and_aborts(tmp_path: Path) -> None:
    w = RankWriter(tmp_path, 0, chunk_bytes=4000, threads=1, defer=True, kernels=_FailingKernels())
    t = torch.randn(1000)
    with pytest.raises(OSError, match="injected encode failure"):
        for i in range(6):
            w.add(f"model/t{i}", t, global_shape=t.shape, offsets=(0,))
        w.close()
    with pytest.raises(ValueError, match="closed or aborted"):
        w.add("model/late", t, global_shape=t.shape, offsets=(0,))
