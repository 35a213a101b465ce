"""Checkpoints on each node's own storage (`checkpoint.node_local`, DeepSpeed's
`checkpoint.use_node_local_storage`).

[Note: node-local checkpoints] The checkpoint root is the same path on every rank but a
different file system per node (a local NVMe disk), so no rank sees every file.

Who writes what where. Every rank writes its rank files into `<root>/<tag>.tmp-<nonce>/`
on its own node (the nonce is rank 0's, broadcast as in [Note: atomic commit]), and
writes *everything it holds*: replicated pieces, plain tensors and empty shards too
(collect_pieces' every_held), so each node's files hold every rectangle its ranks need to
load in place (replicas and buffers cost their size once per rank holding them).
Which ranks share a node is found from the storage itself, not from host names or the
launcher: once every rank has written and voted, each lists the rank files in its temp
directory, and those lists must split the ranks into disjoint groups (a rank seeing a
rank that does not see the same set is an error naming both). Each group's lowest rank
is its node's leader.

Commit, atomic per node and checked across nodes:
1. Vote (as in [Note: atomic commit]); a failure anywhere removes every temp directory.
2. Rank 0's training state goes to every leader, and each leader writes the same
   MANIFEST (every rank's files, and `state.node_local`: this save's nonce and which
   ranks were on which node, with the host) into its temp directory; then a second vote,
   so a MANIFEST that fails to write on one node (disk full) commits nothing anywhere.
3. Each leader renames its temp directory into place, replaces its node's `latest`,
   and cleans up and applies keep_last on its node; a third vote says which nodes
   committed. A node can still die between its neighbours' renames and its own: then
   the nodes disagree, and that is what loading checks for. Every node's directory is
   always its old or its new state (the ordinary rename commit), and a load first
   compares, across ranks, which save each found (a fingerprint of the rank files'
   random file ids, which every node's copy of one MANIFEST lists): a mix of saves is
   refused on every rank, before any state is touched, naming each node's tag. (A
   shared, ordinary checkpoint passes the same check, so node_local loads it too.)

Loading in place: each rank resolves `latest` (or the tag) on its own node, opens the
directory with only its node's files (CheckpointReader present_only), and reads its
rectangles from them: at the world size and layout that saved it they are all there; a
rectangle in another node's files is an error naming the nodes that hold it.

Gathered: the rank files of every node's `<tag>` directory copied into one directory
(with one node's MANIFEST: they are byte-identical) are an ordinary checkpoint that
loads at any world size and that `fsdpx-ckpt` verifies and consolidates; a directory
missing a node's files is refused naming that node (checkpoint_tools/format/parts.py).
With a shared directory, node_local finds one group and behaves like a shared save.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import torch.distributed as dist

from checkpoint_tools.format import CheckpointError, CheckpointReader, write_manifest
from checkpoint_tools.format.root import write_latest
from fsdpx.checkpoint import commit, shared_dir
from fsdpx.checkpoint.state import merge_optimizer_meta
from fsdpx.checkpoint.vote_errors import error_report, rebuild_error

if TYPE_CHECKING:
    from fsdpx.checkpoint.saving import SaveOptions, _Plan

_RANK_INDEX = re.compile(r"rank-(\d{5,})\.index")


def _seen(temp: Path) -> list[int]:
    """The ranks whose index file is in `temp` (this node's, once every rank voted)."""
    try:
        names = [p.name for p in temp.iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _RANK_INDEX.fullmatch(n)))


def nodes_from(seen: list[list[int]], hosts: list[str]) -> list[dict[str, Any]]:
    """The nodes (groups of ranks sharing storage) from what each rank saw.

    Raises:
        CheckpointError: the lists do not split the ranks into disjoint groups.
    """
    for r, mine in enumerate(seen):
        odd = [o for o in mine if seen[o] != mine] if r in mine else [r]
        if odd:
            o = odd[0]
            raise CheckpointError(
                f"with checkpoint.node_local the ranks sharing a node's storage must all see "
                f"the same rank files, but rank {r} (on {hosts[r]}) sees the files of ranks "
                f"{mine} and rank {o} (on {hosts[o]}) sees {seen[o]}; nothing was committed. "
                "A network file system that shows other clients' new files late can do "
                "this: use storage local to each node, or a shared directory without "
                "node_local"
            )
    groups = sorted({tuple(s) for s in seen})
    return [{"ranks": list(g), "host": hosts[g[0]]} for g in groups]


def _broadcast_bytes(payload: bytes, group: dist.ProcessGroup | None) -> bytes:
    """Rank 0's bytes on every rank (a real broadcast: the training state can be MBs)."""
    rank, size = commit.world(group)
    if size == 1:
        return payload
    src = dist.get_global_rank(group, 0) if group is not None else 0
    n = torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    buf = torch.zeros(int(n), dtype=torch.uint8)
    if rank == 0 and payload:
        buf[:] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes()


def _state_for_manifest(
    plan: _Plan, nonce: str, nodes: list[dict[str, Any]], reports: list[dict[str, Any]], group: Any
) -> dict[str, Any]:
    """The MANIFEST's state, the same on every leader: rank 0's, sent to all."""
    raw = _broadcast_bytes(msgpack.packb(plan.state, use_bin_type=True), group)
    state = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    state["rng"] = [rep["rng"] for rep in reports]
    if plan.partial:
        state["optimizer"] = merge_optimizer_meta([rep["optim"] for rep in reports])
    state["node_local"] = {"save": nonce, "nodes": nodes}
    return state


def _outcome(what: BaseException | None) -> str | None:
    return None if what is None else f"{type(what).__name__}: {what}"


def write_and_commit(
    plan: _Plan | BaseException,
    options: SaveOptions,
    group: dist.ProcessGroup | None,
    on_commit: Callable[[Path, int], None] | None,
    write_rank_file: Callable[[_Plan, Path, int, SaveOptions], dict[str, Any]],
    housekeeping: Callable[[Path, str, SaveOptions], None],
) -> Path:
    """The node-local save (see the Note); every rank calls it, with its plan or the
    error that kept it from making one."""
    rank, size = commit.world(group)
    error: BaseException | None = plan if isinstance(plan, BaseException) else None
    nonce = commit.broadcast_obj(commit.new_nonce() if rank == 0 else None, group)
    info = None
    temp = final = None
    if not isinstance(plan, BaseException):
        temp, final = commit.temp_dir(plan.root, plan.tag, nonce), plan.root / plan.tag
        try:
            info = write_rank_file(plan, temp, rank, options)
        except Exception as exc:
            error = exc
    vote = {
        "ok": error is None,
        "error": _outcome(error),
        "host": shared_dir.where(),
        "info": info,
        "rng": plan.rng if not isinstance(plan, BaseException) else {},
        "optim": plan.state["optimizer"]
        if not isinstance(plan, BaseException) and plan.partial
        else None,
    }
    reports = commit.all_gather_obj(vote, group)
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if not rep["ok"]]

    def give_up(message: str) -> CheckpointError:
        if temp is not None:  # every rank: a node's ranks share its temp directory
            shutil.rmtree(temp, ignore_errors=True)
        return CheckpointError(f"{message}; nothing was committed and 'latest' is unchanged")

    if failed:
        if error is not None:
            if temp is not None:
                shutil.rmtree(temp, ignore_errors=True)
            raise error
        r, what = failed[0]
        raise give_up(
            f"rank {r} (on {reports[r]['host']}) failed to save its part of the node-local "
            f"checkpoint ({what}); the traceback is in rank {r}'s output"
        )
    assert not isinstance(plan, BaseException) and temp is not None and final is not None
    seen = commit.all_gather_obj(_seen(temp), group)
    try:
        nodes = nodes_from(seen, [rep["host"] for rep in reports])
    except CheckpointError as exc:
        shutil.rmtree(temp, ignore_errors=True)
        raise exc from None
    leader = any(node["ranks"][0] == rank for node in nodes)
    state = _state_for_manifest(plan, nonce, nodes, reports, group)
    prepared: BaseException | None = None
    if leader:
        try:
            files = [rep["info"] for rep in reports]
            write_manifest(temp, world_size=size, rank_files=files, state=state)
        except Exception as exc:
            prepared = exc
    votes = commit.all_gather_obj(_outcome(prepared), group)
    bad = [(r, v) for r, v in enumerate(votes) if v is not None]
    if bad:
        r, what = bad[0]
        raise give_up(
            f"node leader rank {r} (on {reports[r]['host']}) could not write the MANIFEST of "
            f"{str(final)!r} ({what})"
        )
    committed: BaseException | None = None
    if leader:
        try:
            commit.commit_dir(temp, final)
            if options.save_latest:
                write_latest(plan.root, plan.tag)
        except Exception as exc:
            committed = exc
            shutil.rmtree(temp, ignore_errors=True)
        else:
            housekeeping(plan.root, plan.tag, options)
    outcomes = commit.all_gather_obj(_outcome(committed), group)
    lost = [(r, v) for r, v in enumerate(outcomes) if v is not None]
    if lost:
        done = [n["host"] for n in nodes if outcomes[n["ranks"][0]] is None]
        r, what = lost[0]
        raise CheckpointError(
            f"node leader rank {r} (on {reports[r]['host']}) failed to commit {str(final)!r} "
            f"({what}) while the nodes on {', '.join(done) or 'no host'} committed it: the "
            "nodes now hold different checkpoints under this tag and 'latest', and a "
            "node-local load refuses the mix; save again, or load a tag every node holds"
        )
    if on_commit is not None and rank == 0:
        on_commit(
            final, sum(rep["info"]["data_size"] + rep["info"]["index_size"] for rep in reports)
        )
    return final


# --- loading ------------------------------------------------------------------------------


def load_vote(path: Path | None, reader: CheckpointReader | None) -> dict[str, Any]:
    """What a rank tells the others before a node-local load reads anything: which save it
    found, as a fingerprint of the rank files' random file ids (the same in every node's
    copy of one MANIFEST, different for any other save)."""
    save = None
    if reader is not None:
        ids = b"".join(rf.file_id for rf in reader.rank_files)
        save = hashlib.sha256(ids).hexdigest()[:12]
    return {"save": save, "tag": None if path is None else path.name, "host": shared_dir.where()}


def disagreement(root: str, reports: list[dict[str, Any]]) -> str | None:
    """The error when the ranks found different saves; None when all found the same."""
    if len({rep["save"] for rep in reports}) == 1:
        return None
    found: dict[tuple[Any, Any], list[int]] = {}
    for r, rep in enumerate(reports):
        found.setdefault((rep["tag"], rep["save"]), []).append(r)
    parts = [
        f"rank(s) {', '.join(map(str, rs))} (on {', '.join(sorted({reports[r]['host'] for r in rs}))}) "
        f"found {tag!r} (save {save})"
        for (tag, save), rs in found.items()
    ]
    return (
        f"a node-local load needs every node's {root!r} to hold the same save, but "
        f"{'; '.join(parts)}: a save was interrupted between the nodes' commits, or the "
        "directories come from different runs. Nothing was loaded; load with tag= naming a "
        "checkpoint every node holds"
    )


def agree_on_save(
    root: str,
    path: Path | None,
    reader: CheckpointReader | None,
    error: Exception | None,
    group: dist.ProcessGroup | None,
) -> None:
    """Node-local loads, before any state is touched: every rank opened its node's
    directory, and all found the same save; else every rank raises the same error."""
    rank, size = commit.world(group)
    vote = load_vote(path, reader)
    vote.update({"ok": True} if error is None else error_report(error, str(error)))
    votes = commit.all_gather_obj(vote, group)
    failed = [(r, v) for r, v in enumerate(votes) if not v["ok"]]
    if not failed:
        clash = disagreement(root, votes)
        if clash is None:
            return
        failed = [(0, error_report(CheckpointError(clash), clash))]
    elif size > 1:
        r, v = failed[0]
        failed = [(r, {**v, "message": f"{v['message']} (rank {r} of {size}, on {v['host']})"})]
    if reader is not None:
        reader.close()
    r, v = failed[0]
    raise rebuild_error(v, r) from error
