"""The commands a launch runs: one torchrun agent per host, started over ssh, by one `srun`,
or as local processes.

[Note: torchrun is the engine] fsdpx does not spawn ranks itself. Each host gets one
``python -m torch.distributed.run`` agent with c10d rendezvous at ``MASTER_ADDR:MASTER_PORT``
(the first host unless ``--master_addr`` says otherwise): torchrun starts the host's ranks,
assigns global ranks, restarts nothing (no ``--max-restarts``) and reports a failed rank
in its exit summary. The launcher only starts the agents, prefixes their output with the
host, forwards signals and stops every agent when one fails. With c10d, torchrun assigns
node ranks in the order agents join; each agent also gets ``FSDPX_NODE`` (its index in the
host list) and ``FSDPX_NODE_HOST`` so that errors and telemetry can name the node as the
launcher knows it, and ``FSDPX_RDZV_ENDPOINT`` (the rendezvous endpoint, where rank 0
publishes the relays' addresses for `fsdpx-monitor --rendezvous`).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fsdpx.launch.hosts import Host, LaunchError

# Variables forwarded to remote hosts (DeepSpeed forwards the first five prefixes).
EXPORT_PREFIXES = ("MLFLOW", "NCCL", "PYTHON", "MV2", "UCX", "GLOO", "TORCH", "FSDPX", "OMP_")
ENV_FILE_DEFAULT = ".deepspeed_env"


@dataclass(frozen=True)
class LaunchPlan:
    hosts: list[Host]
    user_argv: list[str]
    master_addr: str
    master_port: int
    run_id: str
    launcher: str = "local"
    launcher_args: list[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    ssh_port: int | None = None
    exports: dict[str, str] = field(default_factory=dict)
    cwd: str = field(default_factory=os.getcwd)


@dataclass(frozen=True)
class AgentCommand:
    """One process the launcher starts: a host's agent (or, for slurm, every host's)."""

    host: str
    node: int
    argv: list[str]
    env: dict[str, str]


def read_env_files(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of DeepSpeed's environment file (``$DS_ENV_FILE``, default
    ``.deepspeed_env``) in the home directory, then the working directory (later wins)."""
    name = environ.get("DS_ENV_FILE", ENV_FILE_DEFAULT)
    found: dict[str, str] = {}
    for folder in (Path.home(), Path(cwd)):
        path = folder / name
        if not path.is_file():
            continue
        for number, raw in enumerate(path.read_text().splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise LaunchError(f"{path}, line {number}: expected KEY=VALUE, found {raw!r}")
            found[key.strip()] = value.strip()
    return found


def exports_for(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """What remote agents get: the forwarded prefixes, the env files, and PYTHONPATH with
    the working directory first (as DeepSpeed does, so the script's imports resolve)."""
    out = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    out.update(read_env_files(environ, cwd))
    out["PYTHONPATH"] = ":".join(p for p in (cwd, out.get("PYTHONPATH", "")) if p)
    return out


def torchrun_argv(plan: LaunchPlan, host: Host) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(plan.hosts)}",
        f"--nproc-per-node={len(host.slots)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={plan.master_addr}:{plan.master_port}",
        f"--rdzv-id={plan.run_id}",
    ]
    if plan.module:
        argv.append("--module")
    if plan.no_python:
        argv.append("--no-python")
    return argv + plan.user_argv


def _node_env(plan: LaunchPlan, host: Host, node: int) -> dict[str, str]:
    env = {"FSDPX_NODE": str(node), "FSDPX_NODE_HOST": host.name}
    # Where rank 0 publishes every node's relay address ([Note: relay discovery]).
    env["FSDPX_RDZV_ENDPOINT"] = f"{plan.master_addr}:{plan.master_port}"
    if any(len(h.slots) != max(h.slots) + 1 for h in plan.hosts):
        # A subset of a host's slots: its devices, as DeepSpeed's launcher sets them.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host.slots))
    return env


def _exports_text(env: Mapping[str, str]) -> str:
    return "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def build_commands(plan: LaunchPlan) -> list[AgentCommand]:
    """The processes to start for `plan`, in node order."""
    if plan.launcher == "local":
        return [
            AgentCommand(
                h.name,
                i,
                torchrun_argv(plan, h),
                {**plan.exports, **_node_env(plan, h, i)},
            )
            for i, h in enumerate(plan.hosts)
        ]
    if plan.launcher == "ssh":
        out = []
        for i, h in enumerate(plan.hosts):
            remote = (
                f"cd {shlex.quote(plan.cwd)}; "
                f"{_exports_text({**plan.exports, **_node_env(plan, h, i)})}; "
                f"exec {shlex.join(torchrun_argv(plan, h))}"
            )
            port = ["-p", str(plan.ssh_port)] if plan.ssh_port is not None else []
            argv = ["ssh", "-o", "BatchMode=yes", *port, *plan.launcher_args, h.name, remote]
            out.append(AgentCommand(h.name, i, argv, {}))
        return out
    if plan.launcher == "slurm":
        return [_slurm_command(plan)]
    raise LaunchError(f"unknown launcher {plan.launcher!r}; use ssh, slurm or local")


def _slurm_command(plan: LaunchPlan) -> AgentCommand:
    """One `srun` with a task per node: the same torchrun command on every node, so every
    host must run the same slots; the node index comes from SLURM_NODEID."""
    first = plan.hosts[0]
    if any(h.slots != first.slots for h in plan.hosts):
        raise LaunchError(
            "--launcher slurm runs the same command on every node, so every host must use "
            "the same slots; found "
            + ", ".join(f"{h.name}: {','.join(map(str, h.slots))}" for h in plan.hosts)
            + " (use --num_gpus, or --launcher ssh for uneven hosts)"
        )
    env = {**plan.exports, **_node_env(plan, first, 0)}
    env.pop("FSDPX_NODE")
    env.pop("FSDPX_NODE_HOST")
    inner = (
        f"cd {shlex.quote(plan.cwd)}; {_exports_text(env)}; "
        "export FSDPX_NODE=$SLURM_NODEID FSDPX_NODE_HOST=$SLURMD_NODENAME; "
        f"exec {shlex.join(torchrun_argv(plan, first))}"
    )
    argv = [
        "srun",
        f"--nodes={len(plan.hosts)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(h.name for h in plan.hosts)}",
        "--kill-on-bad-exit=1",
        *plan.launcher_args,
        "bash",
        "-c",
        inner,
    ]
    return AgentCommand(",".join(h.name for h in plan.hosts), 0, argv, {})


def dry_run_text(commands: list[AgentCommand]) -> str:
    """What ``--dry-run`` prints: one line per started process, ready to paste."""
    lines = []
    for c in commands:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in c.env.items())
        lines.append(f"# node {c.node} ({c.host})\n{prefix}{shlex.join(c.argv)}")
    return "\n".join(lines) + "\n"
