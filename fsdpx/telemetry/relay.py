"""`python -m fsdpx.telemetry.relay`: the per-node relay's command line, kept at this name.

The relay itself is `fsdpx.telemetry.wire.relay` (see [Note: the wire package is
torch-free] in fsdpx/telemetry/wire/__init__.py); this module only runs its `main`, and
importing it runs nothing.
"""

from __future__ import annotations

if __name__ == "__main__":
    from fsdpx.telemetry.wire.relay import main

    raise SystemExit(main())
