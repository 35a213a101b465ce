"""`fsdpx launch` (issue 23): hostfile and filters, the commands per launcher (pinned
dry-run output), and real launches of two simulated nodes on this machine — through a fake
`ssh` / `srun` on PATH that records its arguments and runs the command locally, and the
local launcher — checked against the single-process reference."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdpx.launch.cli import parse, plan_from_args
from fsdpx.launch.commands import build_commands, dry_run_text
from fsdpx.launch.hosts import Host, LaunchError, parse_hostfile, select_hosts
from tests.parity import LR, reference_run

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "launch_script.py"
HOSTS = {"worker-1": 4, "worker-2": 4, "worker-3": 2}


# --- hostfile and filters ----------------------------------------------------------------


def test_hostfile_lines_comments_and_errors() -> None:
    text = "# cluster\nworker-1 slots=4\n\nworker-2 slots=2   # small one\n"
    assert parse_hostfile(text) == {"worker-1": 4, "worker-2": 2}
    with pytest.raises(LaunchError, match=r"hostfile, line 2: expected 'HOST slots=N', found"):
        parse_hostfile("worker-1 slots=4\nworker-2 gpus=4\n")
    with pytest.raises(LaunchError, match="line 2: host 'worker-1' is listed twice"):
        parse_hostfile("worker-1 slots=4\nworker-1 slots=2\n")
    with pytest.raises(LaunchError, match="worker-1 has slots=0; need >= 1"):
        parse_hostfile("worker-1 slots=0\n")
    with pytest.raises(LaunchError, match="lists no hosts"):
        parse_hostfile("# nothing\n")


def test_include_exclude_in_deepspeed_syntax() -> None:
    got = select_hosts(HOSTS, include="worker-2:0,2@worker-1")
    assert got == [Host("worker-1", (0, 1, 2, 3)), Host("worker-2", (0, 2))]  # file order
    got = select_hosts(HOSTS, exclude="worker-1:0@worker-3")
    assert got == [Host("worker-1", (1, 2, 3)), Host("worker-2", (0, 1, 2, 3))]
    assert select_hosts(HOSTS, num_nodes=2, num_gpus=2) == [
        Host("worker-1", (0, 1)),
        Host("worker-2", (0, 1)),
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include": "worker-9"}, "host 'worker-9' is not in the hostfile"),
        ({"include": "worker-3:2"}, "worker-3 has slots 0-1, not 2"),
        ({"include": "worker-1:x"}, "slot 'x' of worker-1 is not a number"),
        ({"include": "worker-1", "exclude": "worker-2"}, "cannot be used together"),
        ({"include": "worker-1", "num_gpus": 1}, "cannot be combined with --include"),
        ({"num_nodes": 4}, "the hostfile has 3 host"),
        ({"num_gpus": 3}, "host(s) worker-3 have fewer slots"),
        ({"exclude": "worker-1@worker-2@worker-3"}, "leave no host to run on"),
    ],
)
def test_filter_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        select_hosts(HOSTS, **kwargs)


def test_unsupported_launchers_and_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="--launcher openmpi is not supported.*use --launcher"):
        plan_from_args(parse(["--hostfile", str(tmp_path / "h"), "--launcher", "openmpi", "t"]))
    with pytest.raises(LaunchError, match=r"cannot read the hostfile .*/nope'"):
        plan_from_args(parse(["--hostfile", str(tmp_path / "nope"), "t.py"]))
    hostfile = tmp_path / "h"
    hostfile.write_text("a slots=2\nb slots=1\n")
    args = parse(["--hostfile", str(hostfile), "--launcher", "slurm", "t.py"])
    with pytest.raises(LaunchError, match="every host must use the same slots; found a: 0,1, b: 0"):
        build_commands(plan_from_args(args))


# --- dry run, pinned ---------------------------------------------------------------------


def _plan_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A known environment: nothing forwarded but what the test sets, a fixed run id."""
    for key in list(os.environ):
        if key.startswith(("MLFLOW", "NCCL", "PYTHON", "MV2", "UCX", "GLOO", "TORCH", "FSDPX")):
            monkeypatch.delenv(key)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FSDPX_RUN_ID", "job7")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.chdir(tmp_path)


def test_dry_run_commands_for_ssh_and_slurm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _plan_env(monkeypatch, tmp_path)
    (tmp_path / "hostfile").write_text("worker-1 slots=2\nworker-2 slots=2\n")
    (tmp_path / ".deepspeed_env").write_text("# DeepSpeed's env file\nHF_HOME=/data/hf\n")
    py, cwd = sys.executable, str(tmp_path)
    torchrun = (
        f"exec {py} -m torch.distributed.run --nnodes=2 --nproc-per-node=2 "
        "--rdzv-backend=c10d --rdzv-endpoint=worker-1:29600 --rdzv-id=job7 train.py --deepspeed "
        "ds.json"
    )
    common = ["--hostfile", "hostfile", "--master_port", "29600", "--dry-run"]
    ssh = dry_run_text(
        build_commands(plan_from_args(parse([*common, "train.py", "--deepspeed", "ds.json"])))
    )
    exports = (
        "export FSDPX_RUN_ID=job7; export NCCL_SOCKET_IFNAME=eth0; export HF_HOME=/data/hf; "
        f"export PYTHONPATH={cwd}"
    )
    assert ssh == (
        "# node 0 (worker-1)\n"
        f"ssh -o BatchMode=yes worker-1 'cd {cwd}; {exports}; export FSDPX_NODE=0; "
        f"export FSDPX_NODE_HOST=worker-1; export FSDPX_RDZV_ENDPOINT=worker-1:29600; "
        f"{torchrun}'\n"
        "# node 1 (worker-2)\n"
        f"ssh -o BatchMode=yes worker-2 'cd {cwd}; {exports}; export FSDPX_NODE=1; "
        f"export FSDPX_NODE_HOST=worker-2; export FSDPX_RDZV_ENDPOINT=worker-1:29600; "
        f"{torchrun}'\n"
    )
    slurm_args = [*common, "--launcher", "slurm", "--launcher_args=--partition=gpu"]
    slurm = dry_run_text(
        build_commands(plan_from_args(parse([*slurm_args, "train.py", "--deepspeed", "ds.json"])))
    )
    assert slurm == (
        "# node 0 (worker-1,worker-2)\n"
        "srun --nodes=2 --ntasks-per-node=1 --nodelist=worker-1,worker-2 --kill-on-bad-exit=1 "
        f"--partition=gpu bash -c 'cd {cwd}; {exports}; "
        "export FSDPX_RDZV_ENDPOINT=worker-1:29600; export FSDPX_NODE=$SLURM_NODEID "
        f"FSDPX_NODE_HOST=$SLURMD_NODENAME; {torchrun}'\n"
    )
    # No hostfile (none given, no /job/hostfile): this machine, its agent started directly
    # with the exports in its environment.
    local = dry_run_text(build_commands(plan_from_args(parse(["--num_gpus", "2", "train.py"]))))
    assert local == (
        "# node 0 (localhost)\n"
        f"FSDPX_RUN_ID=job7 NCCL_SOCKET_IFNAME=eth0 HF_HOME=/data/hf PYTHONPATH={cwd} "
        "FSDPX_NODE=0 FSDPX_NODE_HOST=localhost FSDPX_RDZV_ENDPOINT=localhost:29500 "
        f"{py} -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d "
        "--rdzv-endpoint=localhost:29500 --rdzv-id=job7 train.py\n"
    )


# --- real launches: two simulated nodes on this machine ----------------------------------

FAKE_SSH = """#!/bin/bash
# Records its arguments, then runs the remote command (the last argument) here.
printf '%s\\n' "$*" >> "{log}"
exec bash -c "${{@: -1}}"
"""

FAKE_SRUN = """#!/bin/bash
# Records its arguments, then runs the task (after 'bash -c') once per node of --nodelist,
# with SLURM_NODEID / SLURMD_NODENAME set as srun would.
printf '%s\\n' "$*" >> "{log}"
IFS=, read -ra nodes <<< "$(printf '%s\\n' "$@" | sed -n 's/^--nodelist=//p')"
cmd="${{@: -1}}"
pids=()
for i in "${{!nodes[@]}}"; do
  SLURM_NODEID=$i SLURMD_NODENAME=${{nodes[$i]}} bash -c "$cmd" & pids+=($!)
done
rc=0; for p in "${{pids[@]}}"; do wait $p || rc=$?; done; exit $rc
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("ssh", FAKE_SSH), ("srun", FAKE_SRUN)):
        path = bin_dir / name
        path.write_text(body.format(log=tmp_path / f"{name}.log"))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp_path: Path, launcher: str, slots: int, mode: str, **popen: object):
    """Start `fsdpx launch` on hosts 'localhost' and '127.0.0.1' (two names of this
    machine), `slots` ranks each; returns the Popen and the output directory."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={slots}\n127.0.0.1 slots={slots}\n")
    env = {
        **os.environ,
        "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "fsdpx.cli", "launch", "--hostfile", str(hostfile)]
    argv += ["--launcher", launcher, "--master_port", str(_free_port())]
    argv += [str(SCRIPT), mode, str(out)]
    proc = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )
    return proc, out


def _check_training(out: Path, world: int, ranks_per_node: int) -> None:
    infos = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    per_node: dict[str, list[str]] = {}
    for info in infos:
        per_node.setdefault(info["node"], []).append(info["host"])
    assert per_node == {
        "0": ["localhost"] * ranks_per_node,
        "1": ["127.0.0.1"] * ranks_per_node,
    }, per_node
    cfg = {"zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": LR}}
    ref_losses, ref_params = reference_run(cfg, dp=world)
    for info in infos:
        torch.testing.assert_close(torch.tensor(info["losses"]), torch.tensor(ref_losses))
    sums = infos[0]["param_sums"]
    for name, p in ref_params.items():
        assert sums[name] == pytest.approx(float(p.double().sum()), rel=1e-4, abs=1e-4), name


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's end, waiting for init)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat_line.rpartition(")")[2].split()[0] != "Z"


def _ranks_by_host(out: Path) -> list[tuple[str, str]]:
    infos = [json.loads(p.read_text()) for p in out.glob("rank*.json")]
    return [(info["host"], info["rank"]) for info in infos]


def test_ssh_launch_of_two_nodes_matches_reference(tmp_path: Path) -> None:
    proc, out = _launch(tmp_path, "ssh", 1, "train")
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr + stdout
    _check_training(out, world=2, ranks_per_node=1)
    calls = (tmp_path / "ssh.log").read_text().splitlines()
    assert [c.split()[:2] for c in calls] == [["-o", "BatchMode=yes"]] * 2
    assert sorted(c.split()[2] for c in calls) == ["127.0.0.1", "localhost"]
    # Each agent's output comes back prefixed with its host, as pdsh does.
    lines = stdout.splitlines()
    assert {line for line in lines if line.endswith(" done")} == {
        f"{host}: rank {r} done" for host, r in _ranks_by_host(out)
    }


@pytest.mark.slow
def test_slurm_launch_of_two_nodes_matches_reference(tmp_path: Path) -> None:
    proc, out = _launch(tmp_path, "slurm", 1, "train")
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr + stdout
    _check_training(out, world=2, ranks_per_node=1)
    assert "--nodelist=localhost,127.0.0.1" in (tmp_path / "srun.log").read_text()


@pytest.mark.slow
def test_local_launch_of_two_nodes_with_two_ranks_each_matches_reference(tmp_path: Path) -> None:
    proc, out = _launch(tmp_path, "local", 2, "train")
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr + stdout
    _check_training(out, world=4, ranks_per_node=2)


def test_a_failing_rank_stops_every_node_and_is_named(tmp_path: Path) -> None:
    proc, out = _launch(tmp_path, "local", 1, "fail")
    stdout, stderr = proc.communicate()
    assert proc.returncode == 1, stderr + stdout
    rank = (out / "node1_rank").read_text()
    assert (
        f"fsdpx launch: node 1 (127.0.0.1) ended with exit code 1; rank {rank} failed first"
        in stderr
    ), stderr
    assert "ValueError: bad batch on node 1" in stdout


@pytest.mark.slow
def test_killing_one_nodes_agent_stops_the_other(tmp_path: Path) -> None:
    proc, out = _launch(tmp_path, "local", 1, "hang")
    pid_file = out / "agent1.pid"
    while not pid_file.exists():  # a state: node 1's rank is up and waiting
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 128 + signal.SIGKILL, stderr + stdout
    assert "fsdpx launch: node 1 (127.0.0.1) ended with signal SIGKILL" in stderr, stderr


@pytest.mark.slow
def test_a_rank_killed_outright_stops_every_node_and_is_named(tmp_path: Path) -> None:
    """SIGKILL leaves the rank no chance to say anything: torchrun's summary on its node
    still names it, and node 0 (its rank waiting in a barrier) ends too, with node 1
    named as the job's failure."""
    proc, out = _launch(tmp_path, "local", 1, "die")
    stdout, stderr = proc.communicate()
    assert proc.returncode == 1, stderr + stdout
    rank = (out / "node1_rank").read_text()
    assert (
        f"fsdpx launch: node 1 (127.0.0.1) ended with exit code 1; rank {rank} failed first"
        in stderr
    ), stderr
    assert "Signal 9 (SIGKILL)" in stdout + stderr
    assert not list(out.glob("rank*.json"))  # node 0's rank was stopped, never finished


@pytest.mark.slow
def test_sigterm_to_the_launcher_reaches_every_node(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to `fsdpx launch` goes to every agent and so their ranks
    (each waiting for a file no one writes): the job ends, naming the node whose agent
    ended first, with no agent or rank left running."""
    proc, out = _launch(tmp_path, "local", 1, "hold")
    pid_file = out / "agent1.pid"
    # A state: both ranks are up and holding.
    while not (pid_file.exists() and (out / "pid0").exists() and (out / "pid1").exists()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    ranks = [int((out / f"pid{r}").read_text()) for r in (0, 1)]
    agent1 = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate()
    assert proc.returncode != 0, stderr + stdout
    assert re.search(
        r"fsdpx launch: node [01] \((localhost|127\.0\.0\.1)\) ended with .*; stopped the "
        "other nodes",
        stderr,
    ), stderr
    with pytest.raises(ProcessLookupError):  # reaped by the launcher, not left running
        os.kill(agent1, 0)
    # Each agent stops and waits for its ranks before it exits.
    assert not [pid for pid in ranks if _running(pid)]
    # The ranks (their files appear only once released) never finished.
    assert not list(out.glob("rank*.json"))


@pytest.mark.slow
def test_launched_ranks_publish_their_relays_in_the_rendezvous_store(tmp_path: Path) -> None:
    """Relay discovery through a real launch: the two agents' c10d rendezvous store (at
    --master_addr:--master_port, FSDPX_RDZV_ENDPOINT) holds both nodes' relays, and a
    monitor reading it reaches each node's rank ([Note: relay discovery]). Default-tier
    twin: tests/test_telemetry_discovery.py (the store hosted by the test)."""
    from fsdpx.telemetry.wire.transport import connect
    from monitor.discover import relays_from_store

    proc, out = _launch(tmp_path, "local", 1, "relays")
    try:
        while not (out / "published").exists():  # a state: rank 0 has published
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        endpoint = (out / "published").read_text()
        entries = relays_from_store(endpoint, timeout_s=60.0)
        assert [(e.node, e.host) for e in entries] == [(0, "localhost"), (1, "127.0.0.1")]
        assert sorted(r for e in entries for r in e.ranks) == [0, 1]
        for entry in entries:
            conn = connect(entry.address, role="monitor", secret=None, timeout_s=60.0)
            seen: dict[int, object] = {}
            while entry.ranks[0] not in seen:  # the node's rank, through its relay
                for message in conn.receive(timeout_s=1.0):
                    for rec in message.get("records") or []:
                        seen[rec["rank"]] = rec.get("node")
                assert proc.poll() is None, proc.communicate()
            conn.close()
            assert seen == {entry.ranks[0]: entry.node}
    finally:
        (out / "monitor_done").write_text("")
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr + stdout
