"""Training configuration: frozen dataclasses, the only place defaults live.

`Config.from_dict` / `Config.from_file` are strict: an unknown key is an error with a
did-you-mean, a value of the wrong type or outside its allowed set is an error that names
the key, the value and what is allowed. A silently ignored option is a bug, so a key that
the chosen variant does not read, set away from its default, is an error too (variants:
scheduler.type, optimizer.type, activation_checkpointing.mode). All are ValueErrors.

Example::

    cfg = Config.from_dict({"zero": {"stage": 2}, "precision": {"param_dtype": "bf16"}})
    cfg = Config.from_file("train.json")          # JSON or TOML
"""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fsdpx.optimizers import EXCHANGING_OPTIMIZERS, OPTIMIZER_KEYS
from fsdpx.strict_parse import parse_dataclass

DType = Literal["fp32", "bf16", "fp16"]


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config key '{key}' must be {allowed}; got {value!r}")


def _check_unused(obj: Any, section: str, chooser: str, reads: frozenset[str]) -> None:
    """Reject fields that the variant named by `chooser` does not read, when they are set
    away from their defaults: a silently ignored option is a bug. A key written with its
    default value passes, so `from_dict(cfg.to_dict())` always works."""
    choice = getattr(obj, chooser)
    unused = [
        f"'{section}.{f.name}' ({getattr(obj, f.name)!r})"
        for f in dataclasses.fields(obj)
        if f.name != chooser and f.name not in reads and getattr(obj, f.name) != f.default
    ]
    if unused:
        what, it = ("key", "it") if len(unused) == 1 else ("keys", "them")
        read = ", ".join(sorted(reads)) or "no keys"
        raise ValueError(
            f"config {what} {', '.join(unused)} set, but {section}.{chooser} {choice!r} does "
            f"not read {it}; {choice!r} reads: {read}. Remove the {what}, or set "
            f"{section}.{chooser} to one that uses {it}."
        )


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
            _check(v >= 1, f"mesh.{name}", v, "an integer >= 1")
        _check(
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
        _check(self.buffer_mb >= 1, "offload.buffer_mb", self.buffer_mb, "an integer >= 1 (MiB)")
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
        _check(
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
        _check(
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
        _check(self.static_scale >= 0, "fp16.static_scale", self.static_scale, ">= 0")
        _check(self.window >= 1, "fp16.window", self.window, "an integer >= 1")
        _check(self.hysteresis >= 1, "fp16.hysteresis", self.hysteresis, "an integer >= 1")
        _check(self.min_scale > 0, "fp16.min_scale", self.min_scale, "> 0")
        _check(
            0 <= self.initial_scale_power <= 64,
            "fp16.initial_scale_power",
            self.initial_scale_power,
            "an integer in [0, 64]",
        )


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer built when `fsdpx.shard` is called with optimizer=None."""

    type: Literal["adamw", "adam", "sgd", "onebit_adam", "lamb", "zero_one_adam", "onebit_lamb"] = (
        "adamw"
    )
    """Which optimizer to build: a row of fsdpx.optimizers.OPTIMIZERS (the keys it reads);
    onebit_adam is fsdpx.onebit_adam.OneBitAdam (1-bit compressed exchange, ZeRO stage 0);
    lamb is fsdpx.lamb.Lamb (DeepSpeed's Lamb: Adam with a per-tensor trust ratio);
    zero_one_adam is fsdpx.zero_one_adam.ZeroOneAdam (0/1 Adam, ZeRO stage 0); onebit_lamb is
    fsdpx.onebit_lamb.OneBitLamb (1-bit Lamb, ZeRO stage 0)."""
    lr: float = 1e-3
    """Learning rate (the peak lr of a schedule whose max lr is left unset)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """adam/adamw only: decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """adam/adamw only: added to the denominator for numerical stability."""
    weight_decay: float = 0.0
    """adamw: decoupled weight decay; adam/sgd: L2 penalty added to the gradient."""
    momentum: float = 0.0
    """sgd only."""
    freeze_step: int = 100000
    """onebit_adam only: full-precision warmup steps before the compressed exchange starts
    (DeepSpeed's default)."""
    bias_correction: bool = True
    """adam/adamw: false drops Adam's bias correction (DeepSpeed's FusedAdam
    ``bias_correction=False``: step size lr, denominator sqrt(v) + eps). torch.optim has no
    such option, so fsdpx.optim.AdamW (the fused adam_step) is built instead. onebit_adam,
    zero_one_adam: false uses m and the frozen v as they are (what DeepSpeed's OnebitAdam and
    ZeroOneAdam did whatever their flag said); onebit_lamb must say false (uncorrected, as
    DeepSpeed's OnebitLamb)."""
    max_coeff: float = 10.0
    """lamb only: upper clamp of the trust ratio ||p|| / ||update|| (DeepSpeed's default)."""
    min_coeff: float = 0.01
    """lamb only: lower clamp of the trust ratio (DeepSpeed's default)."""
    eps_inside_sqrt: bool = False
    """lamb only: add eps under the square root, sqrt(v + eps) (DeepSpeed's eps_inside_sqrt)."""
    var_freeze_step: int = 100000
    """zero_one_adam only: the last step that may update the variance (DeepSpeed's default)."""
    var_update_scaler: int = 16
    """zero_one_adam only: variance steps between doublings of the variance interval."""
    local_step_scaler: int = 32678
    """zero_one_adam only: steps between doublings of the local-step interval (DeepSpeed's
    default)."""
    local_step_clipper: int = 16
    """zero_one_adam only: the largest local-step interval."""
    coeff_beta: float = 0.9
    """onebit_lamb only: averaging factor of the warmup trust ratios."""
    factor_max: float = 4.0
    """onebit_lamb only: upper clamp of the compressed-stage trust-ratio factor."""
    factor_min: float = 0.5
    """onebit_lamb only: lower clamp of that factor."""
    factor_threshold: float = 0.1
    """onebit_lamb only: the most the factor may change from one step to the next (relative)."""

    def __post_init__(self) -> None:
        _check_unused(self, "optimizer", "type", OPTIMIZER_KEYS[self.type])
        _check(self.lr >= 0, "optimizer.lr", self.lr, ">= 0")
        _check(
            all(0 <= b < 1 for b in self.betas),
            "optimizer.betas",
            self.betas,
            "two numbers in [0, 1)",
        )
        _check(self.eps >= 0, "optimizer.eps", self.eps, ">= 0")
        _check(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay, ">= 0")
        _check(self.momentum >= 0, "optimizer.momentum", self.momentum, ">= 0")
        _check(
            0 < self.min_coeff <= self.max_coeff,
            "optimizer.min_coeff/max_coeff",
            (self.min_coeff, self.max_coeff),
            "0 < min_coeff <= max_coeff",
        )


SCHEDULER_KEYS: Mapping[str, frozenset[str]] = types.MappingProxyType(
    {
        "none": frozenset(),
        "WarmupLR": frozenset(
            {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
        ),
        "WarmupDecayLR": frozenset(
            {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}
            | {"total_num_steps"}
        ),
        "WarmupCosineLR": frozenset(
            {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "warmup_type"}
            | {"cos_min_ratio"}
        ),
        "OneCycle": frozenset(
            {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "decay_step_size"}
            | {"cycle_first_step_size", "cycle_second_step_size"}
            | {"cycle_first_stair_count", "cycle_second_stair_count"}
        ),
    }
)
"""The SchedulerConfig fields each scheduler type reads; any other field set away from its
default is an error. fsdpx.schedulers takes its key lists from here."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Learning-rate schedule, DeepSpeed's schedulers with DeepSpeed's parameter names.

    Stepped once per optimizer step. `warmup_max_lr`/`cycle_max_lr` default to optimizer.lr.
    """

    type: Literal["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"] = "none"
    """Which schedule; each reads only the keys listed for it in SCHEDULER_KEYS."""
    warmup_min_lr: float = 0.0
    """WarmupLR / WarmupDecayLR: lr at the start of warmup (and at the end of the decay)."""
    warmup_max_lr: float | None = None
    """WarmupLR / WarmupDecayLR: lr at the end of warmup; None: each group's initial lr."""
    warmup_num_steps: int = 1000
    """Warmup length in optimizer steps; 1 acts as 2, as in DeepSpeed."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup ramp."""
    total_num_steps: int | None = None
    """WarmupDecayLR / WarmupCosineLR: the step at which the decay reaches its end."""
    warmup_min_ratio: float = 0.0
    """WarmupCosineLR: lr at step 0 as a fraction of the optimizer lr."""
    cos_min_ratio: float = 0.0001
    """WarmupCosineLR: lr at total_num_steps as a fraction of the optimizer lr."""
    cycle_min_lr: float = 0.0
    """OneCycle: lr at the start and end of the cycle."""
    cycle_max_lr: float | None = None
    """OneCycle: lr at the peak of the cycle; None: each group's initial lr."""
    decay_lr_rate: float = 0.0
    """OneCycle: after the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)."""
    cycle_first_step_size: int = 2000
    """OneCycle: steps from cycle_min_lr up to the peak."""
    cycle_second_step_size: int | None = None
    """OneCycle: steps from the peak back down; None: cycle_first_step_size."""
    cycle_first_stair_count: int = 0
    """OneCycle: split the rise into this many flat stairs; 0: a straight ramp."""
    cycle_second_stair_count: int | None = None
    """OneCycle: stairs of the fall; None: cycle_first_stair_count."""
    decay_step_size: int = 0
    """OneCycle: steps per decay interval after the cycle; 0: no decay."""

    def __post_init__(self) -> None:
        _check_unused(self, "scheduler", "type", SCHEDULER_KEYS[self.type])
        # Unread keys hold their (valid) defaults by now, so every range check below
        # concerns a key the chosen schedule reads.
        _check(
            self.warmup_num_steps >= 1,
            "scheduler.warmup_num_steps",
            self.warmup_num_steps,
            "an integer >= 1 (1 acts as 2, as in DeepSpeed)",
        )
        if self.type in ("WarmupDecayLR", "WarmupCosineLR"):
            if self.total_num_steps is None:
                raise ValueError(
                    f"config key 'scheduler.total_num_steps' is required for {self.type}; "
                    "set it to the number of optimizer steps of the run"
                )
            _check(
                self.total_num_steps > self.warmup_num_steps - (self.type == "WarmupCosineLR"),
                "scheduler.total_num_steps",
                self.total_num_steps,
                f"greater than scheduler.warmup_num_steps ({self.warmup_num_steps})"
                + (" or equal to it" if self.type == "WarmupCosineLR" else ""),
            )
        for name in ("warmup_min_lr", "warmup_min_ratio", "cos_min_ratio", "cycle_min_lr"):
            v = getattr(self, name)
            _check(v >= 0, f"scheduler.{name}", v, ">= 0")
        for name in ("warmup_max_lr", "cycle_max_lr"):
            v = getattr(self, name)
            _check(
                v is None or v >= 0, f"scheduler.{name}", v, ">= 0, or null for the optimizer lr"
            )
        _check(
            self.cycle_first_step_size >= 1,
            "scheduler.cycle_first_step_size",
            self.cycle_first_step_size,
            "an integer >= 1",
        )
        _check(
            self.cycle_second_step_size is None or self.cycle_second_step_size >= 1,
            "scheduler.cycle_second_step_size",
            self.cycle_second_step_size,
            "an integer >= 1, or null to reuse cycle_first_step_size",
        )
        _check(
            self.cycle_first_stair_count >= 0,
            "scheduler.cycle_first_stair_count",
            self.cycle_first_stair_count,
            "an integer >= 0 (0: no stairs)",
        )
        _check(
            self.cycle_second_stair_count is None or self.cycle_second_stair_count >= 0,
            "scheduler.cycle_second_stair_count",
            self.cycle_second_stair_count,
            "an integer >= 0, or null to reuse cycle_first_stair_count",
        )
        _check(self.decay_lr_rate >= 0, "scheduler.decay_lr_rate", self.decay_lr_rate, ">= 0")
        _check(
            self.decay_step_size >= 0,
            "scheduler.decay_step_size",
            self.decay_step_size,
            "an integer >= 0 (0: no decay)",
        )


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """Activation checkpointing, applied to blocks before sharding."""

    mode: Literal["none", "full", "every_n", "selective"] = "none"
    """full: every block; every_n: every n-th block; selective: every block, but the outputs
    of matmuls are saved and only cheap ops are recomputed."""
    every_n: int = 2
    """With mode every_n: checkpoint blocks 0, n, 2n, ..."""

    def __post_init__(self) -> None:
        reads = frozenset({"every_n"}) if self.mode == "every_n" else frozenset()
        _check_unused(self, "activation_checkpointing", "mode", reads)
        _check(
            self.every_n >= 1, "activation_checkpointing.every_n", self.every_n, "an integer >= 1"
        )


TP_STYLES = ("colwise", "rowwise", "sequence_parallel")
"""Style names a tensor_parallel.plan may use (fsdpx/tp_plans.py maps them to torch styles)."""


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor (and sequence) parallelism over the mesh's tp axis; used when mesh.tp > 1."""

    plan: dict[str, str] | None = None
    """Module-name glob (fnmatch, e.g. "blocks.*.mlp.up_proj") -> style: "colwise",
    "rowwise" or "sequence_parallel". None: the automatic plan, which recognises attention
    q/k/v/o and MLP up/gate/down projections by module name (fsdpx/tp_plans.py)."""
    sequence_parallel: bool = False
    """Shard the activations between blocks (and the norms inside them) along the sequence."""
    loss_parallel: bool = False
    """Keep the logits sharded over the vocabulary and compute the loss in parallel."""

    def __post_init__(self) -> None:
        for pattern, style in (self.plan or {}).items():
            _check(
                style in TP_STYLES,
                f"tensor_parallel.plan[{pattern!r}]",
                style,
                "one of " + ", ".join(repr(s) for s in TP_STYLES),
            )


@dataclass(frozen=True)
class ContextParallelConfig:
    """Long sequences: how mesh.sp splits attention, and tiled MLP / loss
    (fsdpx/sequence/; used for attention when mesh.sp > 1, tiling at any sp)."""

    mode: Literal["ulysses", "ring"] = "ulysses"
    """ulysses: all-to-all around the attention call (heads must divide by sp); ring:
    ring attention, key/value blocks passed around the sp ring on a load-balanced layout
    (no head constraint; no attention mask or dropout; fsdpx/sequence/ring.py)."""
    pad: bool = True
    """Sequences whose length sp does not divide are padded (with a warning) by
    fsdpx.sequence.shard_batch; False makes that an error."""
    mlp_tile_tokens: int = 0
    """Tiled MLP: run each block's `mlp` over tiles of this many tokens, recomputing
    each tile in backward (ALST's TiledMLP); 0: untiled. (The tiled loss is a function,
    fsdpx.sequence.tiled_loss_fn, with its tile size as an argument.)"""

    def __post_init__(self) -> None:
        _check(
            self.mlp_tile_tokens >= 0,
            "context_parallel.mlp_tile_tokens",
            self.mlp_tile_tokens,
            "an integer >= 0 (0: untiled)",
        )


@dataclass(frozen=True)
class MoEPlanEntry:
    """How fsdpx runs one kind of mixture-of-experts block it does not recognise
    (fsdpx/moe/plan.py): names relative to the block the plan's glob matched."""

    router: str = ""
    """The submodule giving router logits [tokens, num_experts] from the tokens (e.g. "gate")."""
    experts: str = ""
    """An nn.ModuleList of num_experts modules of one class, each tokens [n, d] -> [n, d]."""
    shared_experts: str = ""
    """A module every token also goes through, its output added ("": none)."""
    top_k: int = 2
    """Experts per token."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores from the logits (over the experts)."""
    normalize_weights: bool = True
    """Divide each token's top-k scores by their sum."""
    return_router_logits: bool = False
    """The block returns (output, router_logits) instead of the output (Mixtral-style)."""

    def __post_init__(self) -> None:
        for name in ("router", "experts"):
            _check(
                bool(getattr(self, name)),
                f"moe.plan.*.{name}",
                getattr(self, name),
                "the name of a submodule of the matched block (required)",
            )
        _check(self.top_k >= 1, "moe.plan.*.top_k", self.top_k, "an integer >= 1")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts blocks fsdpx does not recognise by itself (fsdpx/moe/plan.py)."""

    plan: dict[str, MoEPlanEntry] | None = None
    """Module-name glob (fnmatch, e.g. "layers.*.moe") -> the block's router, experts and
    shared experts. Each matched block's experts are stacked into one [num_experts, ...]
    tensor per parameter (so they split over mesh.ep; their names become
    `<experts>.expert.<name>`) and the block runs fsdpx's dispatch; at any mesh.ep."""


PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over the mesh's pp axis; used when mesh.pp > 1. Each optimizer
    step runs gradient_accumulation_steps micro-batches through the schedule."""

    schedule: Literal[
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    ] = "1F1B"
    """A torch.distributed.pipelining schedule, by name."""
    split_points: tuple[str, ...] = ()
    """Module names where a new stage begins; empty: split the block list evenly."""
    stages_per_rank: int = 1
    """Stages each pp rank holds (interleaved schedules: >= 2; V schedules: exactly 2)."""
    first_stage_layers: int | None = None
    """Even split only: blocks on the first stage (it also holds the embeddings)."""
    last_stage_layers: int | None = None
    """Even split only: blocks on the last stage (it also holds the head and loss)."""

    def __post_init__(self) -> None:
        _check(
            self.stages_per_rank >= 1,
            "pipeline.stages_per_rank",
            self.stages_per_rank,
            "an integer >= 1",
        )
        for name in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, name)
            _check(v is None or v >= 1, f"pipeline.{name}", v, "an integer >= 1, or null")
            if v is not None and self.split_points:
                raise ValueError(
                    f"config key 'pipeline.{name}' ({v}) applies to the even split only, but "
                    f"pipeline.split_points {list(self.split_points)} is set; drop one of them"
                )


@dataclass(frozen=True)
class CheckpointConfig:
    """How engine.save_checkpoint writes (format: checkpoint_tools/FORMAT.md)."""

    compression: Literal["zstd", "none"] = "zstd"
    """Frames are byte-shuffled and zstd-compressed, or stored as they are."""
    zstd_level: int = 1
    """zstd level; higher levels cost much more time for little size on weights."""
    async_save: bool = False
    """Snapshot to host memory and write from a background thread; training continues.
    (With NVMe optimizer offload the save is synchronous: see fsdpx/checkpoint/saving.py.)"""
    keep_last: int = 0
    """Keep this many newest checkpoints (never deleting the one `latest` names); 0: all."""
    threads: int = 0
    """Threads per rank that shuffle, compress and checksum while saving, and read, check
    and decode while loading, in parallel with the file I/O (the files are byte-identical
    for any count); 0: min(4, CPU count)."""
    node_local: bool = False
    """Checkpoint directories on each node's own storage (DeepSpeed's
    checkpoint.use_node_local_storage): every rank writes its files on its node, each
    node commits the same MANIFEST, and a load reads each node's part in place; copy
    every node's directory into one to load it elsewhere ([Note: node-local checkpoints]
    in fsdpx/checkpoint/node_local.py). False: the directory must be shared by every rank."""

    def __post_init__(self) -> None:
        _check(1 <= self.zstd_level <= 22, "checkpoint.zstd_level", self.zstd_level, "in [1, 22]")
        _check(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last, "an integer >= 0")
        _check(self.threads >= 0, "checkpoint.threads", self.threads, "an integer >= 0 (0: auto)")


@dataclass(frozen=True)
class TelemetryConfig:
    """Live per-rank telemetry for the monitor (monitor/PROTOCOL.md, fsdpx/telemetry)."""

    enabled: bool = False
    """Publish a record per optimizer step and events (start, checkpoint, overflow,
    exception, exit) from every rank to the node's relay."""
    relay: str | None = None
    """Relay address: a Unix socket path, or host:port (loopback TCP); None: this user's
    per-node default socket ($XDG_RUNTIME_DIR/fsdpx/telemetry.sock or
    /tmp/fsdpx-<uid>/telemetry.sock)."""
    start_relay: bool = True
    """Local rank 0 starts a relay thread in its process when nothing answers at `relay`
    (it stops with the job); False: only an external `python -m fsdpx.telemetry.relay`."""
    log_path: str | None = None
    """The replay log (zstd, append-only) of the relay started by local rank 0; None: no
    log. An external relay writes the log given by its --log instead."""
    queue_size: int = 4096
    """Records (and events) kept while the relay is slow or absent; the oldest are
    dropped and counted in each record's `dropped`."""
    tokens_per_step: int | None = None
    """Tokens per optimizer step on this rank, for tokens/s; None: not shown."""
    measure_flops: bool = True
    """Count model FLOPs and collective bytes of the first training step (for TFLOP/s,
    MFU and comm_bytes); the first step runs slower while counting."""
    poll_interval_s: float = 0.5
    """How often the sender thread wakes up to send what is queued."""
    send_timeout_s: float = 1.0
    """Socket timeout for connecting and for sending one batch; a batch not sent in
    time is dropped (counted) and the connection retried with backoff."""
    secret_env: str = "FSDPX_TELEMETRY_SECRET"
    """Environment variable holding the shared secret (HMAC) for relays that require
    one; the secret itself is never part of a config file."""
    run_id: str | None = None
    """This launch's run id, carried by every record and event (the monitor's run
    selector, `fsdpx-monitor export --run`). None: global rank 0 makes one (UTC start
    time + random bits) and shares it with every rank. A value you set must differ per
    launch (e.g. your scheduler's job id and restart count): two launches with one id
    are shown as one run. See fsdpx/telemetry/wire/runs.py [Note: run identity]."""
    job: str | None = None
    """The job's name, the same for every launch of it (a resume into the same log is a
    later run of the same job). None: torchrun's rendezvous id (TORCHELASTIC_RUN_ID)
    when it has one (`--rdzv-id`; with --standalone a fresh one per torchrun command,
    shared by its elastic restarts), else no name."""
    total_steps: int | None = None
    """Optimizer steps the run will take, sent in the start event so the monitor can show
    an ETA; None: scheduler.total_num_steps when the schedule has one."""

    def __post_init__(self) -> None:
        _check(self.queue_size >= 1, "telemetry.queue_size", self.queue_size, "an integer >= 1")
        _check(
            self.total_steps is None or self.total_steps >= 1,
            "telemetry.total_steps",
            self.total_steps,
            "an integer >= 1, or null",
        )
        for key in ("poll_interval_s", "send_timeout_s"):
            value = getattr(self, key)
            _check(value > 0, f"telemetry.{key}", value, "a number of seconds > 0")
        _check(
            self.tokens_per_step is None or self.tokens_per_step >= 1,
            "telemetry.tokens_per_step",
            self.tokens_per_step,
            "None or an integer >= 1",
        )


@dataclass(frozen=True)
class Config:
    """Everything `fsdpx.shard` needs. Build it directly, or with from_dict/from_file."""

    train_micro_batch_size_per_gpu: int = 1
    """Samples per rank per micro-step (informational for the engine; used by the
    DeepSpeed batch-size rule and by examples)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; engine.backward divides the loss by this."""
    gradient_clipping: float = 0.0
    """Clip the global gradient 2-norm to this value; 0 disables clipping."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    fp16: LossScaleConfig = field(default_factory=LossScaleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig
    )
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    seed: int = 0
    """Seeds torch's RNGs on every rank before the model is materialised."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective waiting longer than this fails the job."""
    compile: bool = False
    """torch.compile each block before sharding."""

    def __post_init__(self) -> None:
        _check(
            self.train_micro_batch_size_per_gpu >= 1,
            "train_micro_batch_size_per_gpu",
            self.train_micro_batch_size_per_gpu,
            "an integer >= 1",
        )
        _check(
            self.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            self.gradient_accumulation_steps,
            "an integer >= 1",
        )
        _check(
            self.gradient_clipping >= 0,
            "gradient_clipping",
            self.gradient_clipping,
            ">= 0 (0 disables clipping)",
        )
        _check(self.timeout_s > 0, "timeout_s", self.timeout_s, "> 0 seconds")
        if self.optimizer.type in EXCHANGING_OPTIMIZERS:
            _check_onebit(self)
        if self.precision.master_dtype != "fp32":
            _check_bf16_masters(self)
        if self.precision.autocast != "none":
            for key, value, needed in (
                ("precision.param_dtype", self.precision.param_dtype, "fp32"),
                ("mesh.pp", self.mesh.pp, 1),
            ):
                if value != needed:
                    raise ValueError(
                        f"config key 'precision.autocast' = {self.precision.autocast!r} needs "
                        f"{key} = {needed!r} (autocast casts per op: the parameters stay fp32, "
                        f"and the pipeline schedule runs its stages outside the engine's "
                        f"forward); got {value!r}. Set {key} = {needed!r}, or use "
                        "precision.param_dtype 'bf16' instead of autocast"
                    )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build a Config from plain data, rejecting unknown keys and bad values."""
        return parse_dataclass(cls, data, "")

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Load a JSON (.json) or TOML (.toml) file with the same keys as from_dict.

        Every error about the file's content is a ValueError that starts with the path.
        """
        path = Path(path)
        kind = path.suffix.lower()
        if kind not in (".json", ".toml"):
            raise ValueError(
                f"{path}: config files must end in .json or .toml; got suffix {path.suffix!r}. "
                "Rename the file, or parse it yourself and call Config.from_dict."
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text: {e}") from None
        if kind == ".toml":
            import tomllib

            try:
                data = tomllib.loads(text)
            except (tomllib.TOMLDecodeError, ValueError) as e:
                raise ValueError(f"{path}: not valid TOML: {e}") from None
        else:
            try:
                data = json.loads(text)
            # JSONDecodeError, or a ValueError such as Python's limit on integer digits.
            except ValueError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_deepspeed(
        cls, path_or_dict: str | Path | Mapping[str, Any], *, world_size: int | None = None
    ) -> Config:
        """Translate a DeepSpeed config (file with hjson comments/trailing commas, or dict).

        Args:
            path_or_dict: the ds_config file or its loaded dict.
            world_size: ranks in the job, for the batch-size rule and MiCS; None reads the
                WORLD_SIZE environment variable (torchrun sets it), else 1.
        Returns:
            The Config. Mapped and ignored keys are reported once, in one line on the
            "fsdpx" logger; keys fsdpx cannot honour, unknown keys and an inconsistent
            batch size raise ValueError. `fsdpx config explain FILE` prints the table.

        Example::

            cfg = Config.from_deepspeed("ds_config_zero2.json", world_size=8)
        """
        from fsdpx.deepspeed._config import from_deepspeed

        return from_deepspeed(path_or_dict, world_size=world_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


def _check_bf16_masters(cfg: Config) -> None:
    """precision.master_dtype bf16: what it needs (PrecisionConfig.master_dtype)."""
    o = cfg.optimizer
    found = {
        "precision.param_dtype": (cfg.precision.param_dtype, "bf16", "'bf16'"),
        "zero.stage": (cfg.zero.stage, cfg.zero.stage if cfg.zero.stage else None, "1, 2 or 3"),
        "zero.offload_optimizer.device": (
            cfg.zero.offload_optimizer.device,
            "none",
            "'none' (offload keeps fp32 masters on the host)",
        ),
        "precision.autocast": (cfg.precision.autocast, "none", "'none'"),
        "optimizer.type": (
            o.type,
            o.type if o.type in ("adamw", "adam", "sgd") else None,
            "'adamw', 'adam' or 'sgd' (the others keep fp32 state)",
        ),
        "optimizer.bias_correction": (
            o.bias_correction,
            True,
            "true (the fused Adam without bias correction steps fp32 tensors only)",
        ),
    }
    for key, (value, ok, needed) in found.items():
        if value != ok:
            raise ValueError(
                f"config key 'precision.master_dtype' = 'bf16' (bf16 master weights, gradients "
                f"and optimizer states) needs {key} = {needed}; got {value!r}. Change {key}, "
                "or keep precision.master_dtype 'fp32'"
            )


def _check_onebit(cfg: Config) -> None:
    """1-bit Adam and 0/1 Adam need full replicas (DeepSpeed runs them at ZeRO stage 0
    only)."""
    o = cfg.optimizer
    _check(
        o.freeze_step >= 1,
        "optimizer.freeze_step",
        o.freeze_step,
        "an integer >= 1 (full-precision warmup steps)",
    )
    for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
        _check(getattr(o, name) >= 1, f"optimizer.{name}", getattr(o, name), "an integer >= 1")
    if o.type == "onebit_lamb" and o.bias_correction:
        raise ValueError(
            f"optimizer.type {o.type!r} has no bias correction (DeepSpeed's OnebitLamb never "
            "applied it); set optimizer.bias_correction = false"
        )
    _check(
        0 <= o.coeff_beta < 1 and 0 < o.factor_min <= o.factor_max and o.factor_threshold >= 0,
        "optimizer.coeff_beta/factor_min/factor_max/factor_threshold",
        (o.coeff_beta, o.factor_min, o.factor_max, o.factor_threshold),
        "0 <= coeff_beta < 1, 0 < factor_min <= factor_max, factor_threshold >= 0",
    )
    found = {
        "zero.stage": (cfg.zero.stage, 0),
        "mesh.tp": (cfg.mesh.tp, 1),
        "mesh.pp": (cfg.mesh.pp, 1),
        "zero.offload_optimizer.device": (cfg.zero.offload_optimizer.device, "none"),
    }
    for key, (value, needed) in found.items():
        if value != needed:
            raise ValueError(
                f"optimizer.type {o.type!r} exchanges compressed momentum between full "
                f"replicas (DeepSpeed runs the 1-bit optimizers at ZeRO stage 0 only), so it needs "
                f"{key} = {needed!r}; got {value!r}. Set {key} = {needed!r}, or use "
                "optimizer.type 'adamw'"
            )
