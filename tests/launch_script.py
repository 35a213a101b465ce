"""The training script tests/test_launch.py starts with `fsdpx launch` (under torchrun).

    python launch_script.py MODE OUT_DIR

MODE ``train``: ZeRO-3 training of the parity GPT (tests/parity.py); every rank writes
``rank<R>.json`` with its node as the launcher named it, torchrun's node rank and the
losses; rank 0 also writes the final parameters' sums. ``fail``: the rank on launcher
node 1 raises after the first barrier. ``hang``: the node-1 rank writes its torchrun
agent's pid to ``agent1.pid``, then every rank waits in a barrier that never completes.
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
    else:
        dist.init_process_group("gloo")
        dist.barrier()
        if node == "1":
            (out / "node1_rank").write_text(info["rank"])
            if mode == "fail":
                raise ValueError(f"bad batch on node {node}")
            tmp = out / "agent1.pid.tmp"
            tmp.write_text(str(os.getppid()))
            tmp.rename(out / "agent1.pid")  # whole, once it exists
        if mode == "hang":
            dist.barrier()  # the node-1 agent is killed first: this never completes
    (out / f"rank{info['rank']}.json").write_text(json.dumps(info))
    print(f"rank {info['rank']} done", flush=True)


if __name__ == "__main__":
    main()
