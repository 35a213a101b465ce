"""fsdpx.moe: mixture-of-experts layers and expert parallelism.

layer.py     MoE (DeepSpeed's constructor / return value), MOELayer, TopKGate
router.py    DeepSpeed's top-1 / top-2 capacity gates and the dropless top-k router
experts.py   stacked experts and their grouped compute
auto_grouped.py  what grouped="auto" runs on each device (fused or torch._grouped_mm)
dispatch.py  sorting tokens by expert; all_to_all dispatch under expert parallelism
parallel.py  expert parallelism on mesh.ep, expert FSDP over the expert-data-parallel ranks
hf_experts.py  automatic EP for transformers' fused experts
plan.py      moe.plan: stacked experts and fsdpx's dispatch for MoE blocks it does not recognise
"""

from fsdpx.moe.experts import Experts
from fsdpx.moe.layer import MoE, MOELayer, TopKGate
from fsdpx.moe.router import Routing

__all__ = ["Experts", "MOELayer", "MoE", "Routing", "TopKGate"]
