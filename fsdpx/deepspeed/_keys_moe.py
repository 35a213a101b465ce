"""Rows of the DeepSpeed key table for mixture of experts: DeepSpeed 0.19.8's `expert_parallel`
block (AutoEP) and `use_data_before_expert_parallelism`.

`expert_parallel.enabled` with `expert_parallel.autoep_size` is mesh.ep (fsdpx.deepspeed._config
maps the pair; fsdpx/moe/parallel.py does the rest). DeepSpeed's AutoEP replaces a Hugging Face
model's MoE blocks with its own router and experts, configured by the keys below; fsdpx keeps
the model's own router and replaces only the expert loop (fsdpx/moe/hf_experts.py), so:

- the keys that *find* modules (presets, patterns, attribute names) are ignored: fsdpx finds
  transformers' fused experts by structure and refuses, at fsdpx.shard, a model it cannot;
- the keys that would change the routing math (top_k, scores, scaling, grouped routing, the
  load-balancing coefficient) are refused when set: the model's config defines them;
- implementation switches (kernels, communication backends) are ignored.

Plain data, as in fsdpx/deepspeed/_keys_more.py (whose Rule it shares).
"""

from __future__ import annotations

from fsdpx.deepspeed._keys_more import Rule

_FIND = (
    "fsdpx finds transformers' fused experts (3-D gate_up_proj / down_proj) by structure "
    "and keeps the model's router; a model it cannot split is an error at fsdpx.shard"
)
_IMPL = "DeepSpeed-internal implementation switch"
_ROUTING = (
    "fsdpx keeps the Hugging Face model's own router, configured by the model's config; "
    "remove the key (or set it in the model config)"
)


def moe_rules() -> dict[str, Rule]:
    """The rows (dotted DeepSpeed key -> Rule)."""
    r: dict[str, Rule] = {
        "expert_parallel": Rule("section", "-> mesh.ep"),
        "expert_parallel.enabled": Rule("mapped", "true: mesh.ep = autoep_size"),
        "expert_parallel.autoep_size": Rule("mapped", "-> mesh.ep (with enabled: true)"),
        "expert_parallel.expert_tensor_parallel_size": Rule(
            "refused",
            "tensor parallelism inside experts is not implemented; experts are split by "
            "mesh.ep only. Remove the key or set it to 1",
            "",
            (1,),
        ),
        "use_data_before_expert_parallelism": Rule(
            "refused",
            "fsdpx carves the expert-parallel ranks out of the data-parallel shard group "
            "(ep innermost); DeepSpeed's other rank order is not implemented. Set it false",
            "",
            (False,),
        ),
    }
    for name in (
        "preset_model",
        "moe_layer_pattern",
        "router_pattern",
        "expert_pattern",
        "expert_w1",
        "expert_w2",
        "expert_w3",
        "num_experts_attr",
        "top_k_attr",
        "has_shared_experts",
        "shared_experts_pattern",
        "shared_experts_gate_pattern",
        "expert_activation",
    ):
        r[f"expert_parallel.{name}"] = Rule("ignored", _FIND, "found by structure")
    for name in (
        "top_k",
        "score_func",
        "score_apply",
        "route_norm",
        "route_scale",
        "routed_scaling_factor",
        "num_expert_groups",
        "num_limited_groups",
        "load_balance_coeff",
    ):
        r[f"expert_parallel.{name}"] = Rule("refused", _ROUTING)
    for name in (
        "async_split_plan",
        "combine_impl",
        "comm_backend",
        "comm_max_tokens_per_rank",
        "comm_num_sm",
        "comm_qp_margin",
        "disable_triton_grouped_mm",
        "gate_up_impl",
        "row_weighting_impl",
        "use_grouped_mm",
        "validate_folding_routing",
    ):
        r[f"expert_parallel.{name}"] = Rule("ignored", _IMPL, "implementation switch")
    return r
