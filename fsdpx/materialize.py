"""Materialising a model built on the meta device after it was sharded (DeepSpeed's
`zero.Init`, the FSDP2 way): each rank allocates only its shards.

Example::

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=48))      # no memory, no init
    engine = fsdpx.shard(model, cfg)            # shard, then allocate + reset_parameters()
    # or, identical full weights for any world size / stage and for an unsharded model:
    engine = fsdpx.shard(model, cfg, init_fn=fsdpx.per_param_init(my_init, seed=0))

[Note: init on shards] `reset_parameters()` on sharded parameters runs on each rank's
local shard, drawing from the global RNG. On CUDA, DTensor's RNG tracker gives each shard
its own slice of one random stream. On CPU there is no tracker: every rank would draw the
same numbers for its shard, so the default seeds each *shard* differently
(`seed + shard index`); ranks that hold the same shard (ZeRO-0 / HSDP replicas) get the
same seed, or their replicas would differ and never agree again. The result depends on the
world size. For results that are bitwise independent of the world size and stage and equal
to an unsharded model, use `per_param_init`: it builds one full parameter at a time from a
generator seeded by (seed, parameter name) and keeps this rank's shard, so the peak extra
memory is one parameter, not the model.

[Note: meta buffers] `to_empty` gives every meta tensor, buffers included, uninitialised
memory. `reset_parameters()` conventions do not cover buffers computed in `__init__`
(rotary frequencies, causal masks), and garbage there trains silently wrong. So
`materialize_` keeps tensors that were *not* on meta (e.g. buffers created with an
explicit `device="cpu"`, as accelerate's `init_empty_weights()` does by default), fills
every materialised tensor with a sentinel (NaN; the minimum for signed integers) before
initialising, and raises ValueError naming any tensor that still holds the sentinel
afterwards. bool, unsigned and 8-bit float tensors have no sentinel: they start at zero
and are not checked. An init_fn with `writes_every_meta_tensor = True` (the loader of
`fsdpx.hf.from_pretrained`, which checks its coverage before sharding) skips the fill and
the check, two passes over every shard.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdpx.dtensor import to_local

ParamInit = Callable[[str, torch.Tensor, torch.Generator], None]

# Name parts added by wrappers (activation checkpointing, torch.compile, FSDP1) that the
# unwrapped model does not have; per_param_init seeds by the name without them.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def materialize_(
    model: nn.Module,
    device: torch.device,
    *,
    seed: int,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> None:
    """Allocate the meta tensors of a (sharded) meta-built model on `device` and initialise
    them with `init_fn(model)`, else `model.reset_parameters()`.

    Tensors not on meta are kept (moved to `device`). Every rank must call this: it ends
    with one collective that makes all ranks agree on the check in [Note: meta buffers].

    Args:
        model: the model, sharded or not, with some parameters or buffers on meta.
        device: where the local shards are allocated.
        seed: seeds the global RNG for reset_parameters() (see [Note: init on shards]);
            the caller's RNG state is restored afterwards.
        init_fn: initialises the whole model in place (e.g. `per_param_init(...)`).
    Raises:
        ValueError: no init_fn and no model.reset_parameters(), or a materialised tensor
            that the initialisation did not write.

    Example::

        fully_shard(meta_model)
        materialize_(meta_model, torch.device("cpu"), seed=0)
    """
    meta = {name for name, t in _named_tensors(model, buffers=True) if t.is_meta}
    if not meta:
        return
    reset = getattr(model, "reset_parameters", None)
    if init_fn is None and not callable(reset):
        raise ValueError(
            f"{_class_name(model)} was built on the meta device but has no "
            "reset_parameters(); pass init_fn= to fsdpx.shard (e.g. "
            "fsdpx.per_param_init(...)) to initialise it"
        )
    # detach(): to_empty swaps a parameter's data in place (the same Parameter object then
    # holds the empty tensor); the alias keeps the old values alive for the copy back.
    kept = {n: t.detach() for n, t in _named_tensors(model, buffers=True) if not t.is_meta}
    model.to_empty(device=device)  # FSDP2 re-registers the new local shards itself
    # An init_fn that guarantees to write every meta tensor (fsdpx.hf.from_pretrained's,
    # which checks its coverage first) skips the sentinel: two passes over every shard.
    sentinel = not getattr(init_fn, "writes_every_meta_tensor", False)
    with torch.no_grad():
        for name, tensor in _named_tensors(model, buffers=True):
            if name in kept:
                tensor.copy_(kept[name])
            elif name in meta and sentinel:
                _fill_sentinel(to_local(tensor))
    del kept

    if init_fn is not None:
        init_fn(model)
        what = "init_fn"
    else:
        assert callable(reset)
        what = f"{_class_name(model)}.reset_parameters()"
        uses_tracker = device.type != "cpu" and hasattr(
            getattr(torch, device.type, None), "set_rng_state"
        )
        offset = 0 if uses_tracker else _shard_index(model)
        with (
            torch.random.fork_rng(
                devices=[device] if uses_tracker else [],
                device_type=device.type if uses_tracker else "cuda",
            ),
            warnings.catch_warnings(),
        ):
            # Handled by the per-shard seed; torch warns on every CPU random op otherwise.
            warnings.filterwarnings("ignore", "DTensor random operators may not have complete")
            torch.manual_seed(seed + offset)
            reset()
    if sentinel:
        _check_written(model, meta, device, what)


def per_param_init(
    fn: ParamInit, *, seed: int = 0, buffers: bool = False
) -> Callable[[nn.Module], None]:
    """Turn `fn(name, full_tensor, generator)` into an init_fn whose result depends only on
    (seed, tensor name): the same for any world size and stage, and for an unsharded model.

    `fn` gets each parameter as a full-size CPU tensor to fill in place (drawing random
    numbers only from `generator`); this rank keeps its shard of it. Names are those of the
    unwrapped model (wrapper parts such as `_orig_mod.` are dropped). Memory: one full
    parameter at a time (on the accelerator too, while its shard is cut out).

    Args:
        fn: fills one tensor; called once per parameter (and buffer) on every rank.
        seed: the run's seed; each tensor's generator is seeded by (seed, name).
        buffers: also pass buffers to `fn` (for buffers computed in `__init__`, which a
            meta-built model does not have; see [Note: meta buffers]).
    Returns:
        `init(model)`, for `fsdpx.shard(..., init_fn=init)` or to call on any model.

    Example::

        def gpt_init(name, t, g):
            if name.endswith("bias"):
                t.zero_()
            elif t.ndim == 1:                # LayerNorm weights
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)

        with torch.device("meta"):
            model = GPT(GPTConfig())
        engine = fsdpx.shard(model, cfg, init_fn=fsdpx.per_param_init(gpt_init, seed=1))
        # equal, after gathering, to:
        #   reference = GPT(GPTConfig()); fsdpx.per_param_init(gpt_init, seed=1)(reference)
    """

    @torch.no_grad()
    def init(model: nn.Module) -> None:
        for name, tensor in _named_tensors(model, buffers=buffers):
            key = _unwrapped_name(name)
            generator = torch.Generator().manual_seed(_name_seed(seed, key))
            full = torch.empty(tensor.shape, dtype=tensor.dtype)  # CPU: generator is CPU
            _fill_sentinel(full)  # what fn leaves unwritten is caught by materialize_
            fn(key, full, generator)
            if isinstance(tensor, DTensor):
                # src_data_rank=None: each rank cuts its own piece, no communication.
                piece = distribute_tensor(
                    full, tensor.device_mesh, tensor.placements, src_data_rank=None
                )
                tensor.to_local().copy_(piece.to_local())
            else:
                tensor.copy_(full)

    return init


def _class_name(model: nn.Module) -> str:
    # fully_shard swaps the class for a subclass "FSDP<name>"; name the user's class.
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _named_tensors(model: nn.Module, *, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    if buffers:
        yield from model.named_buffers()


def _unwrapped_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")  # torch.Generator takes any 64-bit value


def _sentinel(dtype: torch.dtype) -> float | int | None:
    if dtype.is_complex or (dtype.is_floating_point and torch.finfo(dtype).bits >= 16):
        return float("nan")
    if not dtype.is_floating_point and dtype != torch.bool and torch.iinfo(dtype).min < 0:
        return torch.iinfo(dtype).min
    return None


def _fill_sentinel(tensor: torch.Tensor) -> None:
    value = _sentinel(tensor.dtype)
    if value is None:
        tensor.zero_()
    else:
        tensor.fill_(value)


_CHECK_CHUNK = 1 << 20
"""Elements per sentinel test: the test's bool temporary is at most 1 MiB, not the size of
the largest shard (16 MiB for a 32000 x 1024 embedding's half), which counted in the peak
RSS of a sharded from_pretrained."""


def _unwritten(tensor: torch.Tensor) -> bool:
    local, value = to_local(tensor), _sentinel(tensor.dtype)
    if value is None or local.numel() == 0:
        return False
    for chunk in local.reshape(-1).split(_CHECK_CHUNK):
        if isinstance(value, float):
            if bool(torch.isnan(chunk).any()):
                return True
        elif bool((chunk == value).any()):
            return True
    return False


def _check_written(model: nn.Module, meta: set[str], device: torch.device, what: str) -> None:
    """Raise on every rank if any rank holds a sentinel (a rank's shard may be empty)."""
    bad = [
        name for name, t in _named_tensors(model, buffers=True) if name in meta and _unwritten(t)
    ]
    count = torch.tensor(len(bad), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count) == 0:
        return
    listed = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    raise ValueError(
        f"{what} left tensors of the meta-built {_class_name(model)} unwritten: "
        f"{listed or 'in shards held by other ranks'}. A tensor built on the meta device "
        "has no values: initialise every parameter and buffer in reset_parameters() or "
        "init_fn (recompute buffers made in __init__, such as rotary frequencies or masks; "
        "per_param_init(..., buffers=True) passes buffers to fn), or create such buffers "
        "on a real device (device='cpu'): fsdpx keeps tensors that are not on meta"
    )


def _shard_index(model: nn.Module) -> int:
    """This rank's shard index: equal on ranks holding the same shards (replicas)."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            coordinate = mesh.get_coordinate()
            if coordinate is None:
                return 0
            index = 0
            for axis, placement in enumerate(param.placements):
                if placement.is_shard():
                    index = index * mesh.size(axis) + coordinate[axis]
            return index
    return 0
