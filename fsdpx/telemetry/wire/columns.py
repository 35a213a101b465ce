"""Columnar records in `batch` frames (protocol 1.1, monitor/PROTOCOL.md "Columnar
batches"); stdlib + msgpack only, used by the relay (to write them) and the monitor (to
read them).

[Note: columnar batches]
At 4,096 ranks a monitor receives ~20,000 records a second, each a msgpack map of ~45
keys: decoding those maps and walking them for the protocol's value checks cost the
monitor ~7 us per record, a third of its CPU, although it keeps only the newest record of
each rank and reads a few fields of the others. A batch whose records all have the same
keys is sent instead as `record_columns`: the field names once and one array per field
(msgpack arrays of scalars decode in C, and the validation walk then checks a whole
column per C-level set operation). The monitor ingests the columns directly
(monitor/model.py `add_columns`) and rebuilds a dict only for each rank's newest record.

Records with differing key sets stay rows (`records`): filling the gaps with nils could
make a batch much larger than the frames its records came in (the budget of
fsdpx/telemetry/wire/coalesce.py [Note: relay coalescing]), and all records of one fsdpx
version have the same keys, so in practice whole batches are columnar. With equal keys
and at least two records a column layout is never larger than the maps (per field: the
key once and one array header, against the key once per record; one map header instead
of one per record), so the frame budget holds; a lone record stays a map (its column
layout would add an array header per field).

Opt-in (the monitor's hello `columns: true` together with `batch_s`), so a monitor that
does not ask, and the replay log, are unchanged; a relay that predates 1.1 ignores the
hello field and sends row batches, which a 1.1 monitor reads as before.

Example::

    columns = to_columns(records)            # relay: None when keys differ
    block = RecordColumns.read(columns)      # monitor: None when malformed
    assert block is not None and block.row(0) == records[0]
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any


def to_columns(records: list[Any]) -> dict[str, list[Any]] | None:
    """`records` (maps, as a relay accepted them) as {field: values in record order}, or
    None when they do not all have the same keys, or there are fewer than two (one record
    as columns would be larger than as a map: an array header per field)."""
    if len(records) < 2 or type(records[0]) is not dict or not records[0]:
        return None
    first = records[0].keys()
    if not all(type(r) is dict and r.keys() == first for r in records):
        return None
    fields = list(first)
    if len(fields) == 1:
        return {fields[0]: [r[fields[0]] for r in records]}
    # itemgetter and zip run in C: one tuple per record, then transposed.
    rows = map(itemgetter(*fields), records)
    return {
        name: list(values) for name, values in zip(fields, zip(*rows, strict=True), strict=True)
    }


@dataclass(frozen=True)
class RecordColumns:
    """A `record_columns` block as the monitor reads it: `n` records, one list per field."""

    fields: tuple[str, ...]
    columns: tuple[list[Any], ...]
    n: int

    @classmethod
    def read(cls, value: Any) -> RecordColumns | None:
        """The block of a `batch` frame's `record_columns`, or None when it is not a map of
        equally long lists (the monitor counts that as one bad record and goes on)."""
        if type(value) is not dict or not value:
            return None
        columns = tuple(value.values())
        if not all(type(c) is list for c in columns):
            return None
        n = len(columns[0])
        if any(len(c) != n for c in columns):
            return None
        return cls(tuple(value), columns, n)

    def get(self, name: str) -> list[Any] | None:
        """One field's values (None when no record has the field: read as all nil)."""
        try:
            return self.columns[self.fields.index(name)]
        except ValueError:
            return None

    def row(self, i: int) -> dict[str, Any]:
        """Record `i` as the map it was."""
        return dict(zip(self.fields, [c[i] for c in self.columns], strict=True))

    def rows(self) -> list[dict[str, Any]]:
        """Every record as a map, in order."""
        return [
            dict(zip(self.fields, values, strict=True))
            for values in zip(*self.columns, strict=True)
        ]

    def take(self, indexes: list[int]) -> RecordColumns:
        """The block of the records at `indexes` (in that order)."""
        return RecordColumns(
            self.fields, tuple([c[i] for i in indexes] for c in self.columns), len(indexes)
        )
