"""Config sections for the model-parallel axes: activation checkpointing, tensor
parallel, context (sequence) parallel, mixture-of-experts and the pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdpx.config_sections.checks import check, check_unused


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
        check_unused(self, "activation_checkpointing", "mode", reads)
        check(
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
            check(
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
        check(
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
            check(
                bool(getattr(self, name)),
                f"moe.plan.*.{name}",
                getattr(self, name),
                "the name of a submodule of the matched block (required)",
            )
        check(self.top_k >= 1, "moe.plan.*.top_k", self.top_k, "an integer >= 1")


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
        check(
            self.stages_per_rank >= 1,
            "pipeline.stages_per_rank",
            self.stages_per_rank,
            "an integer >= 1",
        )
        for name in ("first_stage_layers", "last_stage_layers"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"pipeline.{name}", v, "an integer >= 1, or null")
            if v is not None and self.split_points:
                raise ValueError(
                    f"config key 'pipeline.{name}' ({v}) applies to the even split only, but "
                    f"pipeline.split_points {list(self.split_points)} is set; drop one of them"
                )
