"""Config sections for the data-parallel core: the device mesh, ZeRO (and its offload),
precision and the fp16 loss scaler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fsdpx.config_sections.checks import DType, check


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the device-mesh axes; their product must equal the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP / MiCS: shard inside a group, replicate across groups)."""
    dp_shard: int = -1
    """Data-parallel shard group size; -1 infers it from the world size and the other axes."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    sp: int = 1
    """Sequence (context) parallel degree: each rank of an sp group holds seq/sp tokens of
    the same samples (context_parallel.mode picks Ulysses or ring). FSDP shards over
    dp_shard x sp; the batch rule uses dp = dp_replicate x dp_shard."""
    ep: int = 1
    """Expert-parallel degree (DeepSpeed's ep_size): carved out of dp_shard, which it must
    divide; it does not change the data-parallel degree (fsdpx/moe/parallel.py)."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "sp", "ep"):
            v = getattr(self, name)
            check(v >= 1, f"mesh.{name}", v, "an integer >= 1")
        check(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "mesh.dp_shard",
            self.dp_shard,
            "an integer >= 1, or -1 to infer it from the world size",
        )


@dataclass(frozen=True)
class OffloadConfig:
    """Where a ZeRO state lives between steps (DeepSpeed's offload_optimizer/offload_param)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    """none: on the training device; cpu: host memory; nvme: files under nvme_path."""
    nvme_path: str | None = None
    """Directory for device "nvme" (a fast local disk); required with it."""
    pin_memory: bool | None = None
    """Pin host buffers; None: pin exactly when an accelerator exists (pinning without one
    fails in torch)."""
    buffer_mb: int = 256
    """nvme only: host memory for the streaming buffers; the bound the swapper keeps to."""

    def __post_init__(self) -> None:
        check(self.buffer_mb >= 1, "offload.buffer_mb", self.buffer_mb, "an integer >= 1 (MiB)")
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError(
                "offload device 'nvme' needs 'nvme_path': the directory on a fast local disk "
                "where the offloaded state is kept"
            )


@dataclass(frozen=True)
class ZeroConfig:
    """ZeRO stage and sharding layout (see DESIGN.md section 3 for the FSDP2 mapping)."""

    stage: Literal[0, 1, 2, 3] = 3
    """0: DDP; 1: optimizer state sharded; 2: + gradients sharded; 3: + parameters sharded."""
    hpz_partition_size: int = 1
    """ZeRO++ hpZ: after forward, keep parameters gathered within groups of this many ranks
    (secondary partition) instead of resharding fully. 1 disables it. Stage 3 only."""
    quantized_weights: bool = False
    """ZeRO++ qwZ: FSDP's parameter all-gathers carry blockwise-quantized shards (one fp32
    scale per block), dequantized on arrival into the compute dtype. The fp32 master shard is
    never quantized (fsdpx/comm/fsdp_slot.py). DeepSpeed: zero_quantized_weights."""
    quantized_weights_dtype: Literal["int8", "fp8"] = "int8"
    """qwZ wire format: int8 (scale = absmax / 127) or fp8 e4m3 (scale = absmax / 448)."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ: FSDP's gradient reduce-scatter becomes a quantized all-to-all with fp32
    accumulation of the dequantized pieces. DeepSpeed: zero_quantized_gradients."""
    quantized_gradients_bits: Literal[8, 4] = 8
    """qgZ wire format: 8 (int8) or 4 (int4, two values per byte; block size must be even)."""
    quantized_gradients_hierarchical: bool = False
    """qgZ as ZeRO++'s two-level scheme: a quantized all-to-all within each node, dequantize
    and sum, re-quantize, an all-to-all across nodes, dequantize and sum (the cross-node
    links carry 1 / ranks-per-node of the one-level scheme's cross-node bytes). False: one
    all-to-all over the whole shard group (fsdpx/comm/qgz_hier.py)."""
    quantized_gradients_node_size: int = 0
    """Ranks per node for the hierarchical qgZ: node k holds the consecutive global ranks
    k * node_size ... (k + 1) * node_size - 1, as torchrun numbers them. 0: the launcher's
    LOCAL_WORLD_SIZE (torchrun sets it)."""
    quantization_block_size: int = 256
    """Elements per fp32 scale for qwZ and qgZ (wire bytes per element: 1 + 4 / block_size
    for int8, 0.5 + 4 / block_size for int4)."""
    block_classes: tuple[str, ...] = ()
    """Class names of the blocks to shard one by one. Empty: every nn.ModuleList /
    nn.Sequential whose children all share one class is taken as the block list."""
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    """ZeRO-Offload / ZeRO-Infinity: fp32 master params and optimizer state off the device."""
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    """Parameter offload: sharded parameters live in host memory between uses."""

    def __post_init__(self) -> None:
        check(
            self.hpz_partition_size >= 1,
            "zero.hpz_partition_size",
            self.hpz_partition_size,
            "an integer >= 1",
        )
        if self.hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(
                f"config key 'zero.hpz_partition_size' ({self.hpz_partition_size}) needs "
                f"zero.stage 3; got stage {self.stage}. Set stage 3 or drop hpz_partition_size."
            )
        check(
            isinstance(self.quantization_block_size, int) and self.quantization_block_size >= 1,
            "zero.quantization_block_size",
            self.quantization_block_size,
            "an integer >= 1",
        )
        if self.quantized_weights and self.stage != 3:
            raise ValueError(
                f"config key 'zero.quantized_weights' (qwZ) needs zero.stage 3 (parameters are "
                f"all-gathered only at stage 3); got stage {self.stage}. Set stage 3 or drop "
                "quantized_weights."
            )
        if self.quantized_gradients and self.stage == 0:
            raise ValueError(
                "config key 'zero.quantized_gradients' (qgZ) needs zero.stage 1, 2 or 3 (it "
                "replaces the gradient reduce-scatter; stage 0 all-reduces); got stage 0"
            )
        check(
            isinstance(self.quantized_gradients_node_size, int)
            and self.quantized_gradients_node_size >= 0,
            "zero.quantized_gradients_node_size",
            self.quantized_gradients_node_size,
            "an integer >= 0 (0: LOCAL_WORLD_SIZE from the launcher)",
        )
        if self.quantized_gradients_hierarchical and not self.quantized_gradients:
            raise ValueError(
                "config key 'zero.quantized_gradients_hierarchical' needs "
                "zero.quantized_gradients = true (it is how qgZ reduces); got "
                "quantized_gradients false. Turn qgZ on or drop the hierarchical key."
            )
        if self.quantized_gradients_node_size and not self.quantized_gradients_hierarchical:
            raise ValueError(
                f"config key 'zero.quantized_gradients_node_size' "
                f"({self.quantized_gradients_node_size}) is read only by the hierarchical "
                "qgZ; set zero.quantized_gradients_hierarchical = true or drop it"
            )
        if (
            self.quantized_gradients
            and self.quantized_gradients_bits == 4
            and self.quantization_block_size % 2
        ):
            raise ValueError(
                f"config key 'zero.quantization_block_size' ({self.quantization_block_size}) "
                "must be even with zero.quantized_gradients_bits 4: two int4 values share a "
                "byte and a block may not split one. Use an even block size (e.g. 256)."
            )


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: parameters are kept in fp32 and cast for compute and reduction."""

    param_dtype: DType = "fp32"
    """Dtype of the gathered parameters used in forward/backward."""
    reduce_dtype: DType = "fp32"
    """Dtype gradients are reduced in."""
    autocast: Literal["none", "bf16"] = "none"
    """bf16: the engine runs forward (engine(...), train_batch, eval_batch) under
    torch.autocast(bfloat16), which casts per op (matmuls and convolutions in bf16, reductions
    and losses in fp32) instead of casting the parameters (DeepSpeed's ``torch_autocast``).
    Needs param_dtype fp32 and no pipeline parallelism; backward follows autocast's casts."""
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    """bf16: the sharded parameters themselves (the masters the optimizer updates), their
    gradients and the optimizer's moments are bf16, with no fp32 copy (DeepSpeed's
    ``bf16_master_weights_and_grads`` with ``bf16_optimizer_states``): half the parameter,
    gradient and optimizer memory, at bf16 update precision. Needs param_dtype bf16, ZeRO
    stage 1-3 (as DeepSpeed), no offload, and optimizer type adamw/adam (with bias correction)
    or sgd."""


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling, DeepSpeed semantics. Used only when param_dtype is fp16."""

    static_scale: float = 0.0
    """A fixed loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    window: int = 1000
    """Double the scale after this many consecutive steps without overflow."""
    hysteresis: int = 2
    """Overflows tolerated (skipping the step each time) before the scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every clean step, not only on scale-up."""
    min_scale: float = 1.0
    """The scale never drops below this."""

    def __post_init__(self) -> None:
        check(self.static_scale >= 0, "fp16.static_scale", self.static_scale, ">= 0")
        check(self.window >= 1, "fp16.window", self.window, "an integer >= 1")
        check(self.hysteresis >= 1, "fp16.hysteresis", self.hysteresis, "an integer >= 1")
        check(self.min_scale > 0, "fp16.min_scale", self.min_scale, "> 0")
        check(
            0 <= self.initial_scale_power <= 64,
            "fp16.initial_scale_power",
            self.initial_scale_power,
            "an integer in [0, 64]",
        )
