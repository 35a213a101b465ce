"""Writing the imported checkpoint: `<out>/<tag>` committed atomically, then `<out>/latest`.

The importer writes one group of RankWriters per DeepSpeed rank file it reads (streaming:
only that file is open); each group has `slots` writers because a rank's run of a
parameter becomes up to that many rectangles and a name appears at most once per rank
file ([Note: flat ranges as pieces]). The output's "world size" is therefore a count of
files, unrelated to the world size that later loads it (loading reshards).
"""

from __future__ import annotations

import functools
import secrets
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from checkpoint_tools.deepspeed.rectangles import flat_rectangles
from checkpoint_tools.format import RankWriter, write_manifest
from checkpoint_tools.format.errors import DeepSpeedImportError
from checkpoint_tools.format.root import check_tag, fsync_dir, write_latest


class Sink:
    """The output checkpoint being written; `commit` makes it visible."""

    def __init__(
        self,
        root: Path,
        tag: str,
        slots: int,
        compression: Literal["zstd", "none"] = "zstd",
        threads: int = 1,
    ) -> None:
        check_tag(tag)
        if (root / tag).exists():
            raise DeepSpeedImportError(
                f"the output checkpoint {tag!r} already exists; choose another OUT_DIR or "
                "remove it",
                path=root / tag,
            )
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.tag, self.slots = root, tag, slots
        self.compression, self.threads = compression, threads
        self.temp = root / f"{tag}.tmp-{secrets.token_hex(6)}"
        self.infos: list[dict[str, Any]] = []
        self._group: list[RankWriter] = []
        self.bytes = 0

    def open_group(self) -> None:
        """Start the next group of `slots` rank files (one per DeepSpeed rank file)."""
        self.close_group()
        base = len(self.infos)
        # defer: encoding a run overlaps writing the previous ones ([Note: deferred
        # pieces]); the importer's sources are read-only mappings that stay alive.
        self._group = [
            RankWriter(
                self.temp, base + j, compression=self.compression, threads=self.threads, defer=True
            )
            for j in range(self.slots)
        ]

    def close_group(self) -> None:
        for w in self._group:
            self.infos.append(w.close())
        self._group = []

    def put(self, name: str, t: torch.Tensor) -> None:
        """A whole tensor (slot 0 of the open group)."""
        self._group[0].add(name, t, global_shape=t.shape, offsets=(0,) * t.dim())
        self.bytes += t.numel() * t.element_size()

    def put_run(
        self,
        name: str,
        run: torch.Tensor,
        start: int,
        shape: Sequence[int],
        written: Callable[[int, int], None] | None = None,
    ) -> None:
        """Flat elements `[start, start + len(run))` of tensor `name` of `shape`, as
        rectangles written from views of `run` (no copy). The writers defer: `run` must
        stay unchanged until `written(a, b)` has run for each of its ranges `[a, b)` (one
        per rectangle, in run elements), i.e. until that range is in its file."""
        pos = 0
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * int(shape[d + 1])
        for j, (offs, rshape) in enumerate(flat_rectangles(start, start + run.numel(), shape)):
            first = sum(o * s for o, s in zip(offs, stride, strict=True)) - start
            n = 1
            for s in rshape:
                n *= s
            assert first == pos, (name, first, pos)
            done = None if written is None else functools.partial(written, pos, pos + n)
            self._group[j].add(
                name,
                run[pos : pos + n].view(rshape),
                global_shape=shape,
                offsets=offs,
                written=done,
            )
            pos += n
        self.bytes += run.numel() * run.element_size()

    def commit(self, state: dict[str, Any]) -> Path:
        self.close_group()
        write_manifest(self.temp, world_size=len(self.infos), rank_files=self.infos, state=state)
        final = self.root / self.tag
        self.temp.rename(final)
        fsync_dir(self.root)
        write_latest(self.root, self.tag)
        return final

    def abort(self) -> None:
        for w in self._group:
            w.abort()
        self._group = []
        shutil.rmtree(self.temp, ignore_errors=True)
