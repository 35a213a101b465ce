"""Which node a rank runs on, as its telemetry records carry it (`node`).

[Note: node identity] A node is identified by the launcher's / torchrun's node rank, not
the hostname (DESIGN.md, Round 2 clarification 15): two agents on one host (tests, or
`fsdpx launch --launcher local` with host aliases) are two nodes, and a host renamed
between jobs is the same node. `fsdpx launch` exports `FSDPX_NODE` (the node's index in
the host list); plain torchrun exports `GROUP_RANK` (the agent's node rank). Anything
else (a single process, another launcher) has no node: the field is nil.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger("fsdpx.telemetry")

NODE_ENV_VARS: tuple[str, ...] = ("FSDPX_NODE", "GROUP_RANK")
"""Where the node rank is read from, first match wins."""


def node_from_env(env: Mapping[str, str]) -> int | None:
    """The rank's node: `FSDPX_NODE`, else torchrun's `GROUP_RANK`, else None.

    A variable that is set but not a non-negative integer is logged (naming it and its
    value) and skipped: telemetry never stops a run, and the next source, or nil, is a
    truthful "unknown" rather than a guessed node.

    Example::

        assert node_from_env({"GROUP_RANK": "1"}) == 1
        assert node_from_env({}) is None
    """
    for name in NODE_ENV_VARS:
        value = env.get(name)
        if value is None or value == "":
            continue
        if value.strip().isdigit():
            return int(value)
        log.warning(
            "telemetry: %s=%r is not a node rank (expected an integer >= 0); "
            "records will not name this node from it",
            name,
            value,
        )
    return None
