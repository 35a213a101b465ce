"""`deepspeed.runtime.dataloader`."""

from fsdpx.deepspeed._data import RepeatingLoader

__all__ = ["RepeatingLoader"]
