"""Config sections for what a run writes out: checkpoints and live telemetry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdpx.config_sections.checks import check


@dataclass(frozen=True)
class CheckpointConfig:
    """How engine.save_checkpoint writes (format: checkpoint_tools/FORMAT.md)."""

    compression: Literal["zstd", "none"] = "zstd"
    """Frames are byte-shuffled and zstd-compressed, or stored as they are."""
    zstd_level: int = 1
    """zstd level; higher levels cost much more time for little size on weights. At 1 the
    byte planes use a small zstd match table ([Note: plane compressor] in
    checkpoint_tools/format/codec.py)."""
    async_save: bool = False
    """Snapshot to host memory and write from a background thread; training continues.
    (With NVMe optimizer offload the save is synchronous: see fsdpx/checkpoint/saving.py.)"""
    keep_last: int = 0
    """Keep this many newest checkpoints (never deleting the one `latest` names); 0: all."""
    threads: int = 0
    """Threads per rank that shuffle, compress and checksum while saving, and read, check
    and decode while loading, in parallel with the file I/O (the files are byte-identical
    for any count); 0: min(4, CPU count)."""
    node_local: bool = False
    """Checkpoint directories on each node's own storage (DeepSpeed's
    checkpoint.use_node_local_storage): every rank writes its files on its node, each
    node commits the same MANIFEST, and a load reads each node's part in place; copy
    every node's directory into one to load it elsewhere ([Note: node-local checkpoints]
    in fsdpx/checkpoint/node_local.py). False: the directory must be shared by every rank."""

    def __post_init__(self) -> None:
        check(1 <= self.zstd_level <= 22, "checkpoint.zstd_level", self.zstd_level, "in [1, 22]")
        check(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "an integer >= 0")
        check(self.threads >= 0, "checkpoint.threads", self.threads, "an integer >= 0 (0: auto)")


@dataclass(frozen=True)
class TelemetryConfig:
    """Live per-rank telemetry for the monitor (monitor/PROTOCOL.md, fsdpx/telemetry)."""

    enabled: bool = False
    """Publish a record per optimizer step and events (start, checkpoint, overflow,
    exception, exit) from every rank to the node's relay."""
    relay: str | None = None
    """Relay address: a Unix socket path, or host:port (loopback TCP); None: this user's
    per-node default socket ($XDG_RUNTIME_DIR/fsdpx/telemetry.sock or
    /tmp/fsdpx-<uid>/telemetry.sock)."""
    start_relay: bool = True
    """Local rank 0 starts a relay thread in its process when nothing answers at `relay`
    (it stops with the job); False: only an external `python -m fsdpx.telemetry.relay`."""
    log_path: str | None = None
    """The replay log (zstd, append-only) of the relay started by local rank 0; None: no
    log. An external relay writes the log given by its --log instead."""
    queue_size: int = 4096
    """Records (and events) kept while the relay is slow or absent; the oldest are
    dropped and counted in each record's `dropped`."""
    tokens_per_step: int | None = None
    """Tokens per optimizer step on this rank, for tokens/s; None: not shown."""
    measure_flops: bool = True
    """Count model FLOPs and collective bytes of the first training step (for TFLOP/s,
    MFU and comm_bytes); the first step runs slower while counting."""
    poll_interval_s: float = 0.5
    """How often the sender thread wakes up to send what is queued."""
    send_timeout_s: float = 1.0
    """Socket timeout for connecting and for sending one batch; a batch not sent in
    time is dropped (counted) and the connection retried with backoff."""
    secret_env: str = "FSDPX_TELEMETRY_SECRET"
    """Environment variable holding the shared secret (HMAC) for relays that require
    one; the secret itself is never part of a config file."""
    run_id: str | None = None
    """This launch's run id, carried by every record and event (the monitor's run
    selector, `fsdpx-monitor export --run`). None: global rank 0 makes one (UTC start
    time + random bits) and shares it with every rank. A value you set must differ per
    launch (e.g. your scheduler's job id and restart count): two launches with one id
    are shown as one run. See fsdpx/telemetry/wire/runs.py [Note: run identity]."""
    job: str | None = None
    """The job's name, the same for every launch of it (a resume into the same log is a
    later run of the same job). None: torchrun's rendezvous id (TORCHELASTIC_RUN_ID)
    when it has one (`--rdzv-id`; with --standalone a fresh one per torchrun command,
    shared by its elastic restarts), else no name."""
    total_steps: int | None = None
    """Optimizer steps the run will take, sent in the start event so the monitor can show
    an ETA; None: scheduler.total_num_steps when the schedule has one."""
    publish_relays: bool = True
    """Global rank 0 writes every node's relay address into the rendezvous store
    (`FSDPX_RDZV_ENDPOINT`, set by `fsdpx launch`, else MASTER_ADDR:MASTER_PORT) at
    start-up, for `fsdpx-monitor --rendezvous HOST:PORT` ([Note: relay discovery] in
    fsdpx/telemetry/wire/discovery.py)."""
    discovery_file: str | None = None
    """A file global rank 0 writes the same relay list to (JSON), for
    `fsdpx-monitor --discovery FILE`; on a file system the monitor's machine sees. None:
    no file."""

    def __post_init__(self) -> None:
        check(self.queue_size >= 1, "telemetry.queue_size", self.queue_size, "an integer >= 1")
        check(
            self.total_steps is None or self.total_steps >= 1,
            "telemetry.total_steps",
            self.total_steps,
            "an integer >= 1, or null",
        )
        for key in ("poll_interval_s", "send_timeout_s"):
            value = getattr(self, key)
            check(value > 0, f"telemetry.{key}", value, "a number of seconds > 0")
        check(
            self.tokens_per_step is None or self.tokens_per_step >= 1,
            "telemetry.tokens_per_step",
            self.tokens_per_step,
            "None or an integer >= 1",
        )
