"""deepspeed.moe.layer: `MoE` with DeepSpeed's constructor and return value.

It is fsdpx.moe.MoE itself (fsdpx/moe/layer.py): `from deepspeed.moe.layer import MoE`
becomes `from fsdpx.deepspeed.moe.layer import MoE`. Its `ep_size` must equal the
config's mesh.ep (DeepSpeed config translation maps nothing onto it: DeepSpeed takes
ep_size from the constructor only).
"""

from fsdpx.moe.layer import MoE

__all__ = ["MoE"]
