"""The sequence-parallel side of `fsdpx.hf.Trainer` (`mesh.sp > 1`, Ulysses or ring): each
step's batch split by sequence, and the loss the Trainer logs and differentiates kept the
mean over the global token count.

[Note: Trainer under sp] The data loaders give the sp ranks of a group the same whole
sequences (fsdpx/hf/trainer_mesh.py, [Note: Trainer data over dp]), and the model's
attention is already routed through Ulysses or ring attention by `fsdpx.shard`
(fsdpx/hf/ulysses.py, fsdpx/hf/ring.py). What is left is where the Trainer meets the model:

- `compute_loss` splits the batch with the engine's sequence plan (`shard_sequence`:
  labels shifted once on the whole sequence, [Note: pre-shifted labels] in
  fsdpx/sequence/batch.py; global `position_ids`; the ring's load-balanced chunks under
  context_parallel.mode "ring"; a length sp does not divide padded with
  -100 labels, or refused with context_parallel.pad false), then runs the stock
  `compute_loss` on this rank's shard.
- The token count. The Trainer counts the valid targets of the whole sequences before the
  split (`num_items_in_batch`: summed over every rank with average_tokens_across_devices,
  divided by `get_tp_size()`), so every sp rank counted its group's sequences: the count
  is sp times the global one. `compute_loss` divides it by sp, exactly what transformers
  does with its own `get_sp_size()` (which fsdpx does not report: the Trainer reads it as
  DeepSpeed's data-loader adapter that multiplies the loader's length by sp). Each rank's
  loss is then its share (its tokens' summed cross-entropy / the global count), times the
  Trainer's loss scale world / tp = dp x sp. Over the world the logged mean is the sum of
  the shares, the global mean. Without average_tokens_across_devices the count is this dp
  rank's, and the same division makes each rank sp x its share of its dp rank's mean:
  again the usual mean over the world. When the Trainer counts nothing (no labels counted),
  the whole sequences' count of this rank stands in, divided alike.
- The gradient. FSDP averages over dp x sp, and the loss already carries the factor dp x
  sp that turns that average into the sum of the shares, so the engine's own sp factor
  ([Note: sp gradient scale] in fsdpx/sequence/plan.py, for losses that are plain shares)
  is undone in the Trainer's backward (fsdpx/hf/trainer.py).
- Evaluation (`prediction_step`): the loss of a batch is each rank's scaled share, so it is
  averaged over the sp group (the stock value: dp x the dp rank's summed loss / the count),
  and logits (any sequence-shaped output) are gathered over the sp group back into whole
  sequences in order (the ring's load-balanced chunks put back), padding dropped, before
  the Trainer gathers them over the dp ranks.

What the split cannot honour is refused when the Trainer is built: a `compute_loss_func`
or label smoothing (they take whole, unshifted labels), and a model whose forward takes no
`num_items_in_batch` (its loss would be each shard's own mean).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from torch import nn

from fsdpx.parallel_dims import ParallelDims
from fsdpx.sequence.batch import unshard_sequence
from fsdpx.sequence.plan import SequencePlan

__all__ = ["SequenceMixin"]


class SequenceMixin:
    """transformers.Trainer's loss and evaluation steps on sequence shards."""

    # Set by transformers.Trainer and fsdpx.hf.Trainer.
    args: Any
    engine: Any
    compute_loss_func: Any
    model_accepts_loss_kwargs: bool
    label_names: list[str]

    def _check_sequence(self, dims: ParallelDims) -> None:
        """Refuse what sequence shards cannot honour ([Note: Trainer under sp])."""
        if dims.sp == 1:
            return
        if self.compute_loss_func is not None:
            raise ValueError(
                f"compute_loss_func with mesh.sp={dims.sp}: the function would get this "
                "rank's sequence shard of pre-shifted labels, not the whole labels it is "
                "written for; drop compute_loss_func (the model's own loss is used, "
                "normalised over the global token count)"
            )
        if self.args.label_smoothing_factor != 0:
            raise ValueError(
                f"label_smoothing_factor={self.args.label_smoothing_factor} with mesh.sp="
                f"{dims.sp}: the Trainer's label smoother shifts whole labels itself, and each "
                "sp rank holds a shard of labels already shifted; set label_smoothing_factor "
                "to 0"
            )
        if not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"mesh.sp={dims.sp} needs a model whose forward takes num_items_in_batch (a "
                "**kwargs loss, as transformers' causal LMs have): each rank's loss must be "
                "its share of the global mean, not the mean over its own shard"
            )

    def _sequence_plan(self) -> SequencePlan | None:
        return None if self.engine is None else self.engine.sequence

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        plan = self._sequence_plan()
        parent: Any = super()
        if plan is None:
            return parent.compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        shard = plan.shard(inputs)
        whole_count = shard.pop("num_items_in_batch", None)
        count: torch.Tensor | float | None = None
        if num_items_in_batch is not None:
            # The Trainer counted whole sequences on every sp rank: sp x the global count.
            count = num_items_in_batch / plan.size
        elif whole_count is not None:
            # No Trainer count: this rank's whole sequences' count, divided alike, goes to
            # the model directly (the Trainer then treats the loss as a plain mean).
            shard["num_items_in_batch"] = whole_count / plan.size
        return parent.compute_loss(
            model, shard, return_outputs=return_outputs, num_items_in_batch=count
        )

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        plan = self._sequence_plan()
        parent: Any = super()
        if plan is None:
            return parent.prediction_step(model, inputs, prediction_loss_only, ignore_keys)  # type: ignore[no-any-return]
        seq = self._sequence_length(inputs)
        labelled = len(self.label_names) > 0 and all(
            inputs.get(k) is not None for k in self.label_names
        )
        if not labelled:
            # The stock step calls the model itself on such a batch (no compute_loss).
            inputs = plan.shard(inputs)
        loss, logits, labels = parent.prediction_step(
            model, inputs, prediction_loss_only, ignore_keys
        )
        if loss is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=plan.group)
            loss = loss / plan.size
        if logits is not None:
            logits = _whole_sequences(logits, plan, seq)
        return loss, logits, labels

    @staticmethod
    def _sequence_length(inputs: dict[str, Any]) -> int:
        key = "input_ids" if "input_ids" in inputs else "inputs_embeds"
        if key not in inputs:
            raise ValueError(
                "fsdpx.hf.Trainer with mesh.sp > 1 needs 'input_ids' or 'inputs_embeds' in "
                f"each batch to split by sequence; got keys {sorted(inputs)}"
            )
        return int(inputs[key].shape[1])


def _whole_sequences(outputs: Any, plan: SequencePlan, seq: int) -> Any:
    """Each sequence-shaped tensor of `outputs` gathered over the sp group along dim 1, in
    sequence order, without the padding shard_sequence added."""
    return recursively_apply(
        lambda t: unshard_sequence(
            t, seq=seq, size=plan.size, group=plan.group, balanced=plan.ring
        ),
        outputs,
    )
