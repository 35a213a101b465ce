"""The data loader DeepSpeed builds from `training_data`, and its `RepeatingLoader`.

DeepSpeed's `deepspeed_io` gives each data-parallel rank a `DistributedSampler` share of
the dataset (shuffled for training, in order for evaluation) in micro-batches of
`train_micro_batch_size_per_gpu`, dropping the last partial batch only when the config's
`dataloader_drop_last` says so. Ranks that hold the same data-parallel coordinate (tensor
and pipeline peers) read the same samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"


def build_loader(
    dataset: Any,
    *,
    batch_size: int,
    dp_rank: int,
    dp_size: int,
    route: str = ROUTE_TRAIN,
    pin_memory: bool = True,
    data_sampler: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int | None = None,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """A DataLoader over this data-parallel rank's share of `dataset`, as DeepSpeed's
    `deepspeed_io` builds it.

    Raises:
        ValueError: `dataset` is not a torch Dataset, or `route` is not train/eval/predict.
    """
    if not isinstance(dataset, Dataset | IterableDataset):
        raise ValueError(
            f"training data must be a torch.utils.data.Dataset; got {type(dataset).__name__}"
        )
    if route not in (ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT):
        raise ValueError(f"route must be 'train', 'eval' or 'predict'; got {route!r}")
    if data_sampler is None and not isinstance(dataset, IterableDataset):
        data_sampler = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=route == ROUTE_TRAIN
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=data_sampler,
        collate_fn=collate_fn,
        # Pinned host memory only helps (and only works) with an accelerator.
        pin_memory=pin_memory and torch.cuda.is_available(),
        num_workers=num_workers or 0,
        drop_last=drop_last,
    )


class RepeatingLoader:
    """Wraps an iterable (a DataLoader) and restarts it when exhausted, for scripts that
    call `next()` forever (DeepSpeed's `deepspeed.utils.RepeatingLoader`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            # As DeepSpeed's: no set_epoch, so a DistributedSampler repeats its order.
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
