"""Tensor naming convention (FORMAT.md §5): `model/<fqn>`, `optim/<fqn>/<state key>` and
`rank/<r>/optim/<key>` (one rank's own optimizer state).

`<fqn>` is the parameter's fully qualified name in the *unwrapped* module (the key of
`model.state_dict()` without FSDP/compile/checkpoint wrapper prefixes), so a consolidated
file loads into the plain model with `load_state_dict(strict=True)`.
"""

from __future__ import annotations

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
RANK_PREFIX = "rank/"


def model_name(fqn: str) -> str:
    """`model/<fqn>`, e.g. model_name("layers.0.w") == "model/layers.0.w"."""
    return MODEL_PREFIX + fqn


def optim_name(fqn: str, key: str) -> str:
    """`optim/<fqn>/<key>`, e.g. optim_name("layers.0.w", "exp_avg") ==
    "optim/layers.0.w/exp_avg". `key` must not contain '/'."""
    if "/" in key:
        raise ValueError(f"optimizer state key must not contain '/'; got {key!r}")
    return f"{OPTIM_PREFIX}{fqn}/{key}"


def split_optim_name(name: str) -> tuple[str, str]:
    """Inverse of optim_name: "optim/layers.0.w/exp_avg" -> ("layers.0.w", "exp_avg")."""
    if not name.startswith(OPTIM_PREFIX) or "/" not in name[len(OPTIM_PREFIX) :]:
        raise ValueError(f"expected 'optim/<fqn>/<key>'; got {name!r}")
    fqn, key = name[len(OPTIM_PREFIX) :].rsplit("/", 1)
    return fqn, key


def rank_optim_prefix(rank: int) -> str:
    """`rank/<rank>/optim/`: the names of state only rank `rank` holds (1-bit error
    feedback), e.g. rank_optim_prefix(1) + "0/worker_error"."""
    return f"{RANK_PREFIX}{rank}/{OPTIM_PREFIX}"
