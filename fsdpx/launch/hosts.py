"""Which hosts and slots a launch uses: DeepSpeed's hostfile and its resource filters.

A hostfile has one ``HOST slots=N`` line per machine (``#`` comments, blank lines allowed),
exactly DeepSpeed's format. ``--include`` / ``--exclude`` take DeepSpeed's syntax,
``host1:0,1@host2`` (slots 0 and 1 of host1, all of host2); ``--num_nodes`` keeps the first
N hosts and ``--num_gpus`` the first N slots of each, and neither combines with
include/exclude (as in DeepSpeed). Hosts keep the hostfile's order: the first is node 0,
and the master address defaults to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fsdpx.errors import LaunchError

__all__ = ["Host", "LaunchError", "parse_hostfile", "read_hostfile", "select_hosts"]

_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)\s*$")


@dataclass(frozen=True)
class Host:
    """One machine of the job and the slots (device indices, or CPU rank slots) it runs."""

    name: str
    slots: tuple[int, ...]


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` in file order from a DeepSpeed hostfile's text.

    Example:
        >>> parse_hostfile("worker-1 slots=4\\nworker-2 slots=4  # spare\\n")
        {'worker-1': 4, 'worker-2': 4}
    """
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise LaunchError(
                f"{source}, line {number}: expected 'HOST slots=N', found {raw.strip()!r}"
            )
        host, slots = match["host"], int(match["slots"])
        if host in hosts:
            raise LaunchError(f"{source}, line {number}: host {host!r} is listed twice")
        if slots < 1:
            raise LaunchError(f"{source}, line {number}: {host} has slots={slots}; need >= 1")
        hosts[host] = slots
    if not hosts:
        raise LaunchError(f"{source} lists no hosts (expected lines like 'worker-1 slots=8')")
    return hosts


def read_hostfile(path: str | Path) -> dict[str, int]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise LaunchError(
            f"cannot read the hostfile {str(path)!r}: {e.strerror}; pass --hostfile PATH "
            "(lines 'HOST slots=N'), or leave it out to run on this machine only"
        ) from None
    return parse_hostfile(text, str(path))


def parse_filter(spec: str, resources: dict[str, int], flag: str) -> dict[str, set[int] | None]:
    """``host1:0,1@host2`` -> ``{"host1": {0, 1}, "host2": None}`` (None: every slot)."""
    chosen: dict[str, set[int] | None] = {}
    for part in spec.split("@"):
        host, _, slot_text = part.partition(":")
        if not host:
            raise LaunchError(f"{flag} {spec!r}: empty host name (syntax: host1:0,1@host2)")
        if host not in resources:
            raise LaunchError(
                f"{flag} {spec!r}: host {host!r} is not in the hostfile "
                f"(hosts: {', '.join(resources)})"
            )
        if not slot_text:
            chosen[host] = None
            continue
        slots: set[int] = set()
        for item in slot_text.split(","):
            if not item.isdigit():
                raise LaunchError(f"{flag} {spec!r}: slot {item!r} of {host} is not a number")
            slot = int(item)
            if slot >= resources[host]:
                raise LaunchError(
                    f"{flag} {spec!r}: {host} has slots 0-{resources[host] - 1}, not {slot}"
                )
            slots.add(slot)
        if host in chosen and chosen[host] is None:
            continue  # named before without slots: all of it
        chosen[host] = (chosen.get(host) or set()) | slots
    return chosen


def select_hosts(
    resources: dict[str, int],
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: int = -1,
    num_gpus: int = -1,
) -> list[Host]:
    """The hosts and slots to run on, in hostfile order (DeepSpeed's rules)."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together; give one of them")
    if (include or exclude) and (num_nodes >= 0 or num_gpus >= 0):
        raise LaunchError(
            "--num_nodes / --num_gpus cannot be combined with --include / --exclude "
            "(as in DeepSpeed): name the hosts and slots in --include instead"
        )
    hosts = {name: set(range(n)) for name, n in resources.items()}
    if include:
        chosen = parse_filter(include, resources, "--include")
        hosts = {
            name: set(range(resources[name])) if slots is None else slots
            for name, slots in ((n, chosen[n]) for n in resources if n in chosen)
        }
    elif exclude:
        for name, slots in parse_filter(exclude, resources, "--exclude").items():
            hosts[name] = set() if slots is None else hosts[name] - slots
        hosts = {name: slots for name, slots in hosts.items() if slots}
    if num_nodes >= 0:
        if num_nodes == 0 or num_nodes > len(hosts):
            raise LaunchError(
                f"--num_nodes {num_nodes}: the hostfile has {len(hosts)} host(s); "
                f"give 1-{len(hosts)}"
            )
        hosts = dict(list(hosts.items())[:num_nodes])
    if num_gpus >= 0:
        short = [name for name, slots in hosts.items() if len(slots) < num_gpus]
        if num_gpus == 0 or short:
            raise LaunchError(
                f"--num_gpus {num_gpus}: "
                + (f"host(s) {', '.join(short)} have fewer slots" if short else "must be >= 1")
            )
        hosts = {name: set(sorted(slots)[:num_gpus]) for name, slots in hosts.items()}
    if not hosts:
        raise LaunchError("the --include/--exclude filters leave no host to run on")
    return [Host(name, tuple(sorted(slots))) for name, slots in hosts.items()]
