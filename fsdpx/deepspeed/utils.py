"""`deepspeed.utils`: the helpers DeepSpeed scripts import from it."""

from fsdpx.deepspeed._data import RepeatingLoader

__all__ = ["RepeatingLoader"]
