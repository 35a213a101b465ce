"""`fsdpx launch`: DeepSpeed's launcher arguments, torchrun underneath.

    fsdpx launch --hostfile hostfile train.py --deepspeed ds_config.json
    fsdpx launch --hostfile hostfile --include "worker-1:0,1@worker-2" --dry-run train.py
    fsdpx launch --num_gpus 4 train.py                      # this machine only

Without a hostfile (none given and DeepSpeed's default ``/job/hostfile`` absent) the job
runs on this machine with ``--num_gpus`` ranks (default: the CUDA devices, else 1).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Sequence

from fsdpx.launch.commands import LaunchPlan, build_commands, dry_run_text, exports_for
from fsdpx.launch.hosts import Host, LaunchError, read_hostfile, select_hosts
from fsdpx.launch.runner import run_agents

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, help="lines 'HOST slots=N'")
    p.add_argument("-i", "--include", default="", help="hosts/slots to use: host1:0,1@host2")
    p.add_argument("-e", "--exclude", default="", help="hosts/slots to leave out, same syntax")
    p.add_argument("--num_nodes", type=int, default=-1, help="the first N hosts")
    p.add_argument(
        "--num_gpus", "--num_accelerators", type=int, default=-1, help="the first N slots"
    )
    p.add_argument("--master_addr", default="", help="rendezvous host (default: first host)")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument(
        "--launcher",
        default="ssh",
        help="ssh (default; DeepSpeed's pdsh runs as ssh), slurm (srun inside an allocation), "
        "or local (every host's agent on this machine: one host, or tests)",
    )
    p.add_argument("--launcher_args", default="", help="extra arguments for ssh / srun")
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--module", action="store_true", help="run USER_SCRIPT as python -m")
    p.add_argument("--no_python", action="store_true", help="USER_SCRIPT is an executable")
    p.add_argument(
        "--no_local_rank",
        action="store_true",
        help="accepted for DeepSpeed scripts; torchrun passes LOCAL_RANK in the environment "
        "only, never as --local_rank",
    )
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the commands")
    p.add_argument("user_script", help="the training script (or module with --module)")
    p.add_argument("user_args", nargs=argparse.REMAINDER)


def plan_from_args(args: argparse.Namespace) -> LaunchPlan:
    launcher = args.launcher.lower()
    if launcher == "pdsh":
        # pdsh is DeepSpeed's default: a parallel ssh. The same thing, said once.
        print("fsdpx launch: --launcher pdsh runs as --launcher ssh", file=sys.stderr)
        launcher = "ssh"
    if launcher in ("openmpi", "mpich", "impi", "mvapich"):
        raise LaunchError(
            f"--launcher {args.launcher} is not supported: fsdpx starts one torchrun agent per "
            "host itself; use --launcher ssh, or slurm inside an allocation"
        )
    hostfile_given = args.hostfile != DEFAULT_HOSTFILE or os.path.exists(DEFAULT_HOSTFILE)
    if hostfile_given:
        hosts = select_hosts(
            read_hostfile(args.hostfile),
            include=args.include,
            exclude=args.exclude,
            num_nodes=args.num_nodes,
            num_gpus=args.num_gpus,
        )
    else:
        if args.include or args.exclude or args.num_nodes > 1:
            raise LaunchError(
                "--include / --exclude / --num_nodes need a hostfile: pass --hostfile PATH "
                f"(no {DEFAULT_HOSTFILE} here)"
            )
        hosts = [Host("localhost", tuple(range(_local_slots(args.num_gpus))))]
        launcher = "local"
    cwd = os.getcwd()
    return LaunchPlan(
        hosts=hosts,
        user_argv=[args.user_script, *args.user_args],
        master_addr=args.master_addr or hosts[0].name,
        master_port=args.master_port,
        run_id=os.environ.get("FSDPX_RUN_ID") or f"fsdpx-{secrets.token_hex(4)}",
        launcher=launcher,
        launcher_args=args.launcher_args.split(),
        module=args.module,
        no_python=args.no_python,
        ssh_port=args.ssh_port,
        exports=exports_for(os.environ, cwd),
        cwd=cwd,
    )


def _local_slots(num_gpus: int) -> int:
    if num_gpus > 0:
        return num_gpus
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def main(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
        commands = build_commands(plan)
    except LaunchError as e:
        print(f"fsdpx launch: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(dry_run_text(commands))
        return 0
    return run_agents(commands)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fsdpx launch", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p.parse_args(argv)
