"""The mesh side of `fsdpx.hf.Trainer`: which ranks see which samples, and how evaluation
gathers them, when the mesh has more ranks than data-parallel ones.

[Note: Trainer data over dp] The stock Trainer (through accelerate) gives every rank its
own slice of each batch. Under tensor parallelism (`mesh.tp`) the tp ranks of a group
compute on the same samples, and under sequence parallelism (`mesh.sp`) the sp ranks of a
group on shards of the same sequences (DESIGN.md clarification 1: `ParallelDims.dp` drives the
samplers), so this mixin:

- prepares every data loader over the data-parallel ranks only: accelerate's
  `prepare_data_loader` with `num_processes = dp` and `process_index = dp rank` (the rank
  with the sp and tp coordinates dropped, fsdpx's world-mesh order pp, dp_replicate,
  dp_shard, sp, tp);
- reports the global batch as micro x accumulation x world / (tp x sp) (the Trainer's own
  formula would count the sp ranks as data-parallel);
- reports `get_tp_size() = mesh.tp`, which the Trainer already uses for the global batch
  (`micro x accumulation x world / tp`), its token count (the world's sum divided by tp:
  each tp group counted once) and its loss scale (`world / tp` = dp, undone by the
  gradient average over dp); the sp side of the count and scale is in
  fsdpx/hf/trainer_sequence.py ([Note: Trainer under sp]);
- gathers evaluation outputs over the data-parallel ranks only: the world's gather,
  keeping the part of each group's first rank (every rank of a tp x sp group holds the
  same samples; sp ranks gathered their sequences first), then accelerate's truncation of the padded last batch;
- refuses `include_num_input_tokens_seen`, which the Trainer sums over the world and would
  count every sample tp x sp times.

Expert parallelism needs nothing here: ep ranks are data-parallel ranks (they see their
own samples). Pipeline parallelism is refused where the config is checked
(fsdpx/hf/trainer.py).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply

from fsdpx.parallel_dims import ParallelDims

__all__ = ["MeshMixin", "dp_rank"]


def dp_rank(dims: ParallelDims, rank: int) -> int:
    """The data-parallel rank of world rank `rank`: its coordinate on (dp_replicate x
    dp_shard) in the world mesh (pp, dp_replicate, dp_shard, sp, tp), outermost first."""
    return (rank // (dims.sp * dims.tp)) % dims.dp


class MeshMixin:
    """transformers.Trainer's data split and evaluation gather, over the dp ranks."""

    # Set by transformers.Trainer and fsdpx.hf.Trainer.
    args: Any
    accelerator: Any
    gather_function: Any
    _train_batch_size: int
    _fsdpx_dims: ParallelDims | None

    def get_tp_size(self) -> int:
        dims = getattr(self, "_fsdpx_dims", None)
        return 1 if dims is None else dims.tp

    def get_total_train_batch_size(self, args: Any) -> int:
        # The sp ranks of a group share samples, as tp ranks do ([Note: Trainer data over dp]).
        dims = getattr(self, "_fsdpx_dims", None)
        sharing = 1 if dims is None else dims.tp * dims.sp
        return (
            self._train_batch_size * args.gradient_accumulation_steps * (args.world_size // sharing)
        )

    def _install_mesh(self, dims: ParallelDims) -> None:
        """Route the accelerator's data loader preparation and evaluation gather through
        the dp ranks when some ranks share samples ([Note: Trainer data over dp])."""
        self._fsdpx_dims = dims
        if dims.dp == dims.world_size:
            return
        if self.args.include_num_input_tokens_seen not in ("no", False):
            raise ValueError(
                f"include_num_input_tokens_seen={self.args.include_num_input_tokens_seen!r} "
                f"with mesh.tp={dims.tp}, mesh.sp={dims.sp}: the Trainer sums the tokens over "
                f"every rank, and the {dims.tp * dims.sp} ranks of a tensor- x sequence-parallel "
                "group see the same tokens, so the count would be tp x sp times too high; drop "
                "include_num_input_tokens_seen"
            )
        self.accelerator.prepare_data_loader = self._prepare_data_loader_dp
        self.accelerator.gather_for_metrics = self._gather_for_metrics_dp
        # The Trainer bound its gather_function in __init__ and rebinds it to
        # accelerator.gather_for_metrics after each evaluation loop.
        self.gather_function = self._gather_for_metrics_dp

    def _prepare_data_loader_dp(
        self,
        data_loader: torch.utils.data.DataLoader,  # type: ignore[type-arg]
        device_placement: bool | None = None,
        slice_fn_for_dispatch: Any = None,
    ) -> Any:
        """accelerate's `Accelerator.prepare_data_loader`, split over the dp ranks."""
        acc, dims = self.accelerator, self._fsdpx_dims
        assert dims is not None
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in acc._dataloaders:
                acc._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = acc.device_placement
        if acc.dispatch_batches:
            raise ValueError(
                "accelerator_config.dispatch_batches=True: rank 0 would slice each batch over "
                f"every rank, but the {dims.tp * dims.sp} ranks of a tensor- x sequence-parallel "
                "group need the same "
                "samples; leave dispatch_batches off"
            )
        prepared = prepare_data_loader(
            data_loader,
            acc.device,
            num_processes=dims.dp,
            process_index=dp_rank(dims, acc.process_index),
            split_batches=acc.split_batches,
            put_on_device=device_placement,
            rng_types=acc.rng_types.copy(),
            dispatch_batches=False,
            even_batches=acc.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        acc._dataloaders.append(prepared)
        return prepared

    def _gather_for_metrics_dp(self, data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's `gather_for_metrics` over the dp ranks: the world's gather (equal
        batches on every rank: the loaders are prepared with even_batches), keeping each
        tp group's first rank's part, then the padded last batch truncated."""
        acc, dims = self.accelerator, self._fsdpx_dims
        assert dims is not None
        if use_gather_object:
            raise ValueError(
                "eval_use_gather_object=True with tensor or sequence parallelism: objects cannot be "
                "gathered over the data-parallel ranks only; leave eval_use_gather_object off"
            )
        world, group = dims.world_size, dims.sp * dims.tp
        first_of_group = [r for r in range(world) if r % group == 0]

        def keep(t: torch.Tensor) -> torch.Tensor:
            per_rank = t.reshape(world, -1, *t.shape[1:])
            return per_rank[first_of_group].flatten(0, 1)

        gathered = recursively_apply(keep, acc.gather(data))
        state = acc.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return recursively_apply(lambda t: t[: state.remainder], gathered)
        return gathered
