"""fsdpx: DeepSpeed's feature set on PyTorch's own FSDP2, DTensor and pipelining.

Example::

    import fsdpx
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 2}})
    engine = fsdpx.shard(model, cfg)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
"""

from fsdpx.clip import clip_grad_norm_, total_grad_norm
from fsdpx.config import Config
from fsdpx.distributed import DistInfo, init_distributed
from fsdpx.engine import Engine, StepResult
from fsdpx.errors import FsdpxError, RankFailureError
from fsdpx.materialize import per_param_init
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.shard import shard

__all__ = [
    "Axis",
    "Config",
    "DistInfo",
    "Engine",
    "FsdpxError",
    "ParallelDims",
    "RankFailureError",
    "StepResult",
    "clip_grad_norm_",
    "init_distributed",
    "per_param_init",
    "shard",
    "total_grad_norm",
]
__version__ = "0.1.0"
