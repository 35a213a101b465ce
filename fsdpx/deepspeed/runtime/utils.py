"""`deepspeed.runtime.utils`: `set_random_seed`."""

import random as _random

import numpy as _np
import torch as _torch


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (DeepSpeed's helper; it seeds the
    same three)."""
    _random.seed(seed)
    _np.random.seed(seed % (2**32))  # numpy takes 32-bit seeds
    _torch.manual_seed(seed % (2**63))


__all__ = ["set_random_seed"]
