"""Generate tests/data/moe/deepspeed_moe.safetensors from deepspeed.moe.layer.MoE itself.

Run in an environment with DeepSpeed (never in fsdpx's tests):

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/moe/make_deepspeed_moe.py

The cases are the deterministic ones (no random token selection, no second-expert
sampling, no noise): top-1 without dropping, top-2 with a capacity that drops tokens, each
in train mode. (Top-1 with dropping and use_rts=False is left out: which tokens DeepSpeed
keeps then depends on torch.topk's order among equal values; see [Note: which tokens
survive] in fsdpx/moe/router.py.) For each case the file holds the gate weight, the expert weights (experts
given different values), the input, DeepSpeed's output, l_aux, exp_counts and the input
gradient of sum(output * probe).
"""

import os

import deepspeed
import torch
from deepspeed.moe.layer import MoE
from safetensors.torch import save_file

HIDDEN, FFN, EXPERTS, TOKENS = 8, 16, 4, 24


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed("gloo")
    out: dict[str, torch.Tensor] = {}
    cases = {
        "top1": dict(k=1, capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_rts=False),
        "top2_drop": dict(
            k=2, capacity_factor=0.5, min_capacity=1, drop_tokens=True, use_rts=False
        ),
    }
    for name, kw in cases.items():
        torch.manual_seed(0)
        expert = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)
        )
        moe = MoE(
            HIDDEN, expert, num_experts=EXPERTS, ep_size=1, top2_2nd_expert_sampling=False, **kw
        )
        moe.set_deepspeed_parallelism()
        for ex in moe.deepspeed_moe.experts.deepspeed_experts:
            for p in ex.parameters():
                with torch.no_grad():
                    p.copy_(torch.randn_like(p) * 0.3)
        moe.train()
        x = torch.randn(2, TOKENS // 2, HIDDEN, requires_grad=True)
        probe = torch.randn(2, TOKENS // 2, HIDDEN)
        y, l_aux, counts = moe(x)
        (y * probe).sum().backward()
        out[f"{name}.gate"] = moe.deepspeed_moe.gate.wg.weight.detach().clone()
        for pname in ["0.weight", "0.bias", "2.weight", "2.bias"]:
            out[f"{name}.experts.{pname}"] = torch.stack(
                [
                    ex.get_parameter(pname).detach()
                    for ex in moe.deepspeed_moe.experts.deepspeed_experts
                ]
            ).contiguous()
        out[f"{name}.x"] = x.detach().clone()
        out[f"{name}.probe"] = probe
        out[f"{name}.y"] = y.detach().clone()
        out[f"{name}.l_aux"] = l_aux.detach().reshape(1).clone()
        out[f"{name}.exp_counts"] = counts.detach().clone()
        out[f"{name}.x_grad"] = x.grad.detach().clone()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_moe.safetensors")
    save_file(out, path)
    print("wrote", path, sorted(out))


if __name__ == "__main__":
    main()
