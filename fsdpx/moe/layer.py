"""`fsdpx.moe.MoE`: DeepSpeed's MoE layer (constructor and return value), plus a dropless
top-k path, on stacked experts with optional expert parallelism.

    moe = MoE(hidden_size=512, expert=mlp, num_experts=8, ep_size=2, k=2)
    out, l_aux, exp_counts = moe(hidden_states)           # as deepspeed.moe.layer.MoE
    loss = task_loss + aux_coef * l_aux

The module tree keeps DeepSpeed's names where they exist (`deepspeed_moe.gate.wg`,
`deepspeed_moe.experts`, `mlp` and `coefficient` for use_residual). Experts are stacked
(fsdpx/moe/experts.py, [Note: stacked experts]), so their parameters are
`deepspeed_moe.experts.expert.<template name>` of shape [num_experts, ...], where DeepSpeed
has one module per local expert: DeepSpeed *checkpoints* do not load as they are.

`ep_size` is checked, not acted on, here: expert parallelism is switched on by
`fsdpx.shard` when mesh.ep > 1 (fsdpx/moe/parallel.py), and `ep_size` must equal mesh.ep
(DESIGN.md, clarification 15). Before that the layer computes every expert locally, so the
same module is its own single-process reference.

fsdpx extensions, keyword-only (DeepSpeed has none of them): `capacity_factor=None` is the
dropless top-k router (any k; `score_func` softmax or sigmoid, `normalize_weights`,
`z_loss_coef`), `shared_expert` (a module every token also goes through, its output
added: DeepSeek / Qwen-MoE shared experts), `grouped` (the expert compute,
[Note: grouped expert compute]) and `reinit_experts`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from fsdpx.moe.dispatch import moe_dispatch
from fsdpx.moe.experts import Experts, Grouped
from fsdpx.moe.router import (
    NoisyGatePolicy,
    Routing,
    ScoreFunc,
    capacity_gating,
    topk_routing,
)
from fsdpx.telemetry.moe_load import moe_load

_NOISY = (None, "None", "Jitter", "RSample")


class TopKGate(nn.Module):
    """The router: a bias-free fp32 linear layer `wg` and the gate rule (DeepSpeed's name)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        k: int,
        capacity_factor: float | None,
        eval_capacity_factor: float | None,
        min_capacity: int,
        noisy_gate_policy: NoisyGatePolicy,
        drop_tokens: bool,
        use_rts: bool,
        top2_2nd_expert_sampling: bool,
        score_func: ScoreFunc,
        normalize_weights: bool,
        z_loss_coef: float,
    ) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.score_func = score_func
        self.normalize_weights = normalize_weights
        self.z_loss_coef = z_loss_coef

    def forward(self, x: Tensor, used_token: Tensor | None = None) -> Routing:
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            # DeepSpeed's multiplicative jitter: x * U(1 - 1e-2, 1 + 1e-2).
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if factor is None:
            return topk_routing(
                logits,
                k=self.k,
                score_func=self.score_func,
                normalize_weights=self.normalize_weights,
                z_loss_coef=self.z_loss_coef,
                used_token=used_token,
            )
        return capacity_gating(
            logits,
            k=self.k,
            capacity_factor=factor,
            min_capacity=self.min_capacity,
            drop_tokens=self.drop_tokens,
            use_rts=self.use_rts,
            noisy_gate_policy=self.noisy_gate_policy,
            top2_2nd_expert_sampling=self.top2_2nd_expert_sampling,
            used_token=used_token,
            training=self.training,
        )


class MOELayer(nn.Module):
    """Gate + experts + dispatch (DeepSpeed's name); keeps `l_aux` and `exp_counts`."""

    def __init__(self, gate: TopKGate, experts: Experts, num_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.num_experts = num_experts
        self.ep_group: dist.ProcessGroup | None = None
        """Set by fsdpx.moe.parallel when mesh.ep > 1; None: every expert is local."""
        self.l_aux: Tensor = torch.zeros(())
        self.exp_counts: Tensor = torch.zeros(num_experts, dtype=torch.long)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> Tensor:
        d = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, d)
        routing = self.gate(x, used_token)
        self.l_aux = routing.l_aux
        self.exp_counts = routing.exp_counts
        gate = self.gate
        factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        if factor is not None and gate.drop_tokens:
            # Capacity gates: chosen before dropping minus kept (their nonzero() has
            # synchronised already); telemetry's moe_dropped.
            dropped = int(routing.exp_counts.sum()) - routing.token.numel()
            moe_load().add_dropped(dropped)
        out = moe_dispatch(
            x,
            routing.token,
            routing.expert,
            routing.weight,
            num_experts=self.num_experts,
            experts=self.experts,
            ep_group=self.ep_group,
        )
        return out.reshape(hidden_states.shape)


class MoE(nn.Module):
    """A mixture-of-experts layer with `deepspeed.moe.layer.MoE`'s constructor.

    Args (DeepSpeed's): hidden_size, expert (the template; each expert starts as a copy),
        num_experts, ep_size (must equal mesh.ep under fsdpx.shard), k, capacity_factor,
        eval_capacity_factor, min_capacity, use_residual, noisy_gate_policy ('Jitter',
        'RSample' or None), drop_tokens, use_rts, use_tutel (False only),
        enable_expert_tensor_parallelism (False only), top2_2nd_expert_sampling.
    Args (fsdpx, keyword-only): see the module docstring.
    Returns (forward): (output, l_aux, exp_counts) as DeepSpeed.
    Raises:
        ValueError: num_experts not divisible by ep_size, k out of range, a capacity that
            drops every token, an unknown noisy_gate_policy / score_func, or a DeepSpeed
            option fsdpx does not implement set to True.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float | None = 1.0,
        eval_capacity_factor: float | None = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: NoisyGatePolicy = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        score_func: ScoreFunc = "softmax",
        normalize_weights: bool = True,
        z_loss_coef: float = 0.0,
        shared_expert: nn.Module | None = None,
        grouped: Grouped = "auto",
        reinit_experts: bool = False,
    ) -> None:
        super().__init__()
        _validate(
            num_experts=num_experts,
            ep_size=ep_size,
            k=k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity,
            drop_tokens=drop_tokens,
            noisy_gate_policy=noisy_gate_policy,
            score_func=score_func,
        )
        for name, value in (
            ("use_tutel", use_tutel),
            ("enable_expert_tensor_parallelism", enable_expert_tensor_parallelism),
        ):
            if value:
                raise ValueError(
                    f"MoE({name}=True) is not implemented in fsdpx; pass {name}=False "
                    "(experts run grouped without Tutel; tensor parallelism applies to the "
                    "non-expert layers)"
                )
        if capacity_factor is None and eval_capacity_factor is not None:
            eval_capacity_factor = None  # the dropless router has no capacity, in eval too
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.k = k
        self.use_residual = use_residual
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            None if noisy_gate_policy == "None" else noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
            score_func,
            normalize_weights,
            z_loss_coef,
        )
        experts = Experts(expert, num_experts, grouped=grouped, reinit=reinit_experts)
        self.deepspeed_moe = MOELayer(gate, experts, num_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self.shared_expert = shared_expert

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        if self.shared_expert is not None:
            output = output + self.shared_expert(hidden_states)
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _validate(
    *,
    num_experts: int,
    ep_size: int,
    k: int,
    capacity_factor: float | None,
    eval_capacity_factor: float | None,
    min_capacity: int,
    drop_tokens: bool,
    noisy_gate_policy: NoisyGatePolicy | str,
    score_func: str,
) -> None:
    """Constructor checks; the same on every rank, so a bad layer fails before any collective."""
    if num_experts < 1 or ep_size < 1:
        raise ValueError(
            f"MoE needs num_experts >= 1 and ep_size >= 1; got {num_experts=}, {ep_size=}"
        )
    if num_experts % ep_size != 0:
        raise ValueError(
            f"MoE num_experts ({num_experts}) is not divisible by ep_size ({ep_size}): each "
            "expert-parallel rank must own the same number of experts; choose an ep_size "
            "that divides num_experts"
        )
    if not 1 <= k <= num_experts:
        raise ValueError(f"MoE k must be in 1..num_experts ({num_experts}); got k={k}")
    if capacity_factor is not None and k > 2:
        raise ValueError(
            f"MoE with a capacity (capacity_factor={capacity_factor}) supports k = 1 or 2 "
            f"(DeepSpeed's gates); got k={k}. Use capacity_factor=None for dropless top-k"
        )
    if noisy_gate_policy not in _NOISY:
        raise ValueError(
            f"MoE noisy_gate_policy must be one of 'Jitter', 'RSample' or None; got "
            f"{noisy_gate_policy!r}"
        )
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"MoE score_func must be 'softmax' or 'sigmoid'; got {score_func!r}")
    for name, factor in (
        ("capacity_factor", capacity_factor),
        ("eval_capacity_factor", eval_capacity_factor),
    ):
        if factor is None or not drop_tokens:
            continue
        if not math.isfinite(factor) or factor < 0:
            raise ValueError(f"MoE {name} must be a finite number >= 0 or None; got {factor}")
        if factor == 0 and min_capacity <= 0:
            raise ValueError(
                f"MoE {name}=0 with min_capacity={min_capacity} gives every expert a "
                "capacity of 0: every token would be dropped. Raise the capacity factor or "
                "min_capacity, or pass drop_tokens=False"
            )
