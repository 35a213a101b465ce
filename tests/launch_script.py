"""The training script tests/test_launch.py starts with `fsdpx launch` (under torchrun).

    python launch_script.py MODE OUT_DIR

MODE ``train``: ZeRO-3 training of the parity GPT (tests/parity.py); every rank writes
``rank<R>.json`` with its node as the launcher named it, torchrun's node rank and the
losses; rank 0 also writes the final parameters' sums. ``fail``: the rank on launcher
node 1 raises after the first barrier. ``hang``: the node-1 rank writes its torchrun
agent's pid to ``agent1.pid``, then every rank waits in a barrier that never completes.
``die``: the rank on launcher node 1 kills itself with SIGKILL after the first barrier;
node 0's rank waits in a barrier that never completes.
``hold``: as ``hang``, but every rank waits for a ``release`` file no test writes.
``relays``: telemetry on, each node's rank running its node's relay on a loopback port of
its own; once `fsdpx.shard` has published the relays, rank 0 writes the rendezvous
endpoint to ``published``, and every rank waits for the test (the monitor) to write
``monitor_done``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    node = os.environ["FSDPX_NODE"]
    info = {
        "node": node,
        "host": os.environ["FSDPX_NODE_HOST"],
        "group_rank": os.environ["GROUP_RANK"],
        "rank": os.environ["RANK"],
    }
    if mode == "train":
        from tests.parity import LR, fsdpx_run

        losses, params = fsdpx_run({"zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": LR}})
        info["losses"] = losses
        if dist.get_rank() == 0:
            info["param_sums"] = {n: float(p.double().sum()) for n, p in params.items()}
    elif mode == "relays":
        _relays(out)
    else:
        dist.init_process_group("gloo")
        dist.barrier()
        if node == "1":
            (out / "node1_rank").write_text(info["rank"])
            if mode == "fail":
                raise ValueError(f"bad batch on node {node}")
            if mode == "die":  # killed outright: no exception, no word from the rank
                import signal

                os.kill(os.getpid(), signal.SIGKILL)
            tmp = out / "agent1.pid.tmp"
            tmp.write_text(str(os.getppid()))
            tmp.rename(out / "agent1.pid")  # whole, once it exists
        if mode in ("hang", "die"):
            dist.barrier()  # node 1's agent or rank is killed first: this never completes
        if mode == "hold":  # until the test stops the job (bounded: a failed test ends)
            import time

            (out / f"pid{info['rank']}").write_text(str(os.getpid()))

            deadline = time.monotonic() + 300
            while not (out / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    (out / f"rank{info['rank']}.json").write_text(json.dumps(info))
    print(f"rank {info['rank']} done", flush=True)


def _relays(out: Path) -> None:
    import time

    import fsdpx

    telemetry = {"enabled": True, "relay": "127.0.0.1:0", "poll_interval_s": 0.05}
    cfg = fsdpx.Config.from_dict({"telemetry": {**telemetry, "measure_flops": False}})
    engine = fsdpx.shard(torch.nn.Linear(4, 1), cfg)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    if dist.get_rank() == 0:
        tmp = out / "published.tmp"
        tmp.write_text(os.environ["FSDPX_RDZV_ENDPOINT"])
        tmp.rename(out / "published")
    deadline = time.monotonic() + 300  # only ends a test that has already failed
    while not (out / "monitor_done").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.telemetry is not None
    engine.telemetry.close()


if __name__ == "__main__":
    main()
