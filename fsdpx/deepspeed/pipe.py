"""`deepspeed.pipe`: `PipelineModule`, `LayerSpec` and `TiedLayerSpec` on fsdpx's pipeline
parallelism.

A `PipelineModule` is the layer list run in order, like DeepSpeed's. Each layer is a child
named by its index (`"0"`, `"3"`: DeepSpeed's names, so `state_dict` keys match), a
function layer becomes a parameter-free child. `initialize(model=PipelineModule(...))`
hands it to fsdpx's pipeline split with a split point at the first layer of each stage
of `parts` (the `partition_method`'s boundaries), `mesh.pp = num_stages`, and DeepSpeed's
micro-batches (gradient_accumulation_steps) through a torch schedule
(fsdpx/deepspeed/_initialize.py).

[Note: whole model on every rank] DeepSpeed builds only the layers of a rank's own stage.
Here every rank builds the whole list and fsdpx's split prunes it (as it does any model,
after rank 0's initial weights are broadcast), so a rank briefly holds every layer.

[Note: tied layers] A `TiedLayerSpec` key is built once and every use calls that one
module, as DeepSpeed does. Uses on one stage are plain shared parameters. Uses on
different stages (an embedding tied to the LM head on the first and last stage) become one
copy per stage after fsdpx's split, whose gradients are summed between the stages holding
them after each step's backward, the norm counting them once, as DeepSpeed's tied-weight
groups do ([Note: tied parameters across stages] in fsdpx/pipeline_tied.py). Each copy
keeps its layer's name (`0.module.weight` on the first stage, `5.module.weight` on the
last), so a checkpoint holds both, equal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fsdpx.deepspeed import checkpointing as _checkpointing
from fsdpx.deepspeed._partition import partition_balanced, partition_uniform, type_weights
from fsdpx.deepspeed.runtime.utils import set_random_seed


class LayerSpec:
    """A layer built later: `LayerSpec(nn.Linear, 4, 8, bias=False)` builds
    `nn.Linear(4, 8, bias=False)` when the PipelineModule is made."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(
                f"LayerSpec takes an nn.Module subclass; got {typename!r}. Put a plain "
                "function straight into the layer list instead"
            )
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """The layer (a new module on each call)."""
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer shared by every spec with the same `key` (e.g. embedding and unembedding).
    `forward_fn(module, x)`, if given, replaces `module(x)` at this use."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )


class _TiedUse(nn.Module):
    """One use of a tied module (see [Note: tied layers])."""

    def __init__(self, key: str, module: nn.Module, forward_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        self.key = key
        self.module = module
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        if self.forward_fn is None:
            return self.module(x)
        return self.forward_fn(self.module, x)


class _Function(nn.Module):
    """A function in the layer list, as a parameter-free layer the split can place."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule`: `layers` run in order, split into `num_stages`
    pipeline stages by `partition_method` ('parameters', 'uniform' or 'type:REGEX').

    Args mirror DeepSpeed's. `topology` is refused (fsdpx builds its mesh from the
    config: pass num_stages). `loss_fn(outputs, labels)` runs on the last stage; without
    it the last layer's output is the loss. `seed_layers` seeds each LayerSpec's build
    with `base_seed + index` and each layer's forward with `base_seed * micro + index`
    (through `seed_fn`, default `runtime.utils.set_random_seed`).
    `activation_checkpoint_interval` > 0 runs each run of that many layers of a stage
    through `activation_checkpoint_func`, when the run holds parameters (or, with
    `checkpointable_layers`, when every layer's class is listed).

    Example::

        net = PipelineModule(layers=[nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)],
                             num_stages=2, loss_fn=nn.CrossEntropyLoss())
        engine, _, _, _ = deepspeed.initialize(model=net, config=ds_config)
    """

    loss_fn: Callable[..., torch.Tensor] | None
    parts: list[int]
    """Stage boundaries: stage s holds layers parts[s] to parts[s + 1] - 1 (DeepSpeed's)."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] = _checkpointing.checkpoint,
        checkpointable_layers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if topology is not None:
            raise ValueError(
                "PipelineModule(topology=...) is not supported: fsdpx builds its mesh from "
                "the config; pass num_stages (data parallelism takes the remaining ranks)"
            )
        if num_stages is None or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages >= 1; got {num_stages!r}")
        if activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval must be >= 0; got {activation_checkpoint_interval}"
            )
        self.num_stages = num_stages
        # Not registered as a child: a loss module is no pipeline layer ([Note: stage
        # modules] splits the children).
        self.__dict__["loss_fn"] = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.__dict__["activation_checkpoint_func"] = activation_checkpoint_func
        self.checkpointable_layers = (
            None if checkpointable_layers is None else list(checkpointable_layers)
        )
        self.micro_offset = 0
        specs = list(layers)
        if not specs:
            raise ValueError("PipelineModule needs at least one layer")
        self._tied_keys: dict[str, list[int]] = {}
        self._build(specs)
        self.parts = self._partition(specs, partition_method.lower())

    # --- construction ------------------------------------------------------------------

    def _seed(self, seed: int) -> None:
        (self.seed_fn or set_random_seed)(seed)

    def _build(self, specs: list[Any]) -> None:
        tied: dict[str, nn.Module] = {}
        for idx, spec in enumerate(specs):
            if self.seed_layers and isinstance(spec, LayerSpec):
                self._seed(self.base_seed + idx)
            if isinstance(spec, PipelineModule):
                raise TypeError("a PipelineModule inside a PipelineModule is not supported")
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                self._tied_keys.setdefault(spec.key, []).append(idx)
                layer: nn.Module = _TiedUse(spec.key, tied[spec.key], spec.forward_fn)
            elif isinstance(spec, LayerSpec):
                layer = spec.build()
            elif isinstance(spec, nn.Module):
                layer = spec
            elif callable(spec):
                layer = _Function(spec)
            else:
                raise TypeError(
                    f"layer {idx} is a {type(spec).__name__}; PipelineModule takes nn.Module "
                    "instances, LayerSpec / TiedLayerSpec and functions"
                )
            self.add_module(str(idx), layer)

    def _partition(self, specs: list[Any], method: str) -> list[int]:
        count = len(specs)
        if method == "uniform":
            return partition_uniform(count, self.num_stages)
        if method == "parameters":
            weights = [
                sum(p.numel() for p in self._layer(i).parameters() if p.requires_grad)
                for i in range(count)
            ]
            return partition_balanced(weights, self.num_stages)
        if method.startswith("type:"):
            names = [_layer_name(s) for s in specs]
            return partition_balanced(type_weights(names, method[5:]), self.num_stages)
        raise ValueError(
            f"partition_method {self.partition_method!r} is not supported; use 'parameters', "
            "'uniform' or 'type:REGEX' (DeepSpeed's 'profile' is not implemented there either)"
        )

    # --- what DeepSpeed exposes --------------------------------------------------------

    def _layer(self, idx: int) -> nn.Module:
        """Layer `idx` (a pruned stage's other layers are absent: KeyError)."""
        module = self._modules[str(idx)]
        if module is None:
            raise KeyError(f"layer {idx} is not on this pipeline stage")
        return module

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer `layer_idx` (DeepSpeed's name)."""
        return next(s for s in range(self.num_stages) if layer_idx < self.parts[s + 1])

    def split_points(self) -> tuple[str, ...]:
        """fsdpx's pipeline.split_points: the first layer of each stage after the first.

        Raises:
            ValueError: a stage without layers (more stages than layers).
        """
        if any(self.parts[s] == self.parts[s + 1] for s in range(self.num_stages)):
            raise ValueError(
                f"PipelineModule: {self.num_stages} stages but only {self.parts[-1]} layers "
                f"(partition {self.parts}); every stage needs a layer. Lower num_stages"
            )
        return tuple(str(self.parts[s]) for s in range(1, self.num_stages))

    def block_class_names(self) -> tuple[str, ...]:
        """Class names of the layers FSDP shards one by one: those with parameters, tied
        uses excepted (their shared module belongs to the stage root)."""
        return tuple(
            sorted(
                {
                    type(m).__name__
                    for m in self.children()
                    if not isinstance(m, _TiedUse) and any(True for _ in m.parameters())
                }
            )
        )

    # --- forward -----------------------------------------------------------------------

    def forward(self, forward_input: Any) -> Any:
        self.micro_offset += 1
        present = [(int(n), m) for n, m in self._modules.items() if m is not None]
        micro = self.micro_offset + 1

        def run(chunk: list[tuple[int, nn.Module]]) -> Callable[..., Any]:
            def fn(*inputs: Any) -> Any:
                x = inputs[0] if len(inputs) == 1 else inputs
                for idx, layer in chunk:
                    if self.seed_layers:
                        self._seed(self.base_seed * micro + idx)
                    x = layer(x)
                return x

            return fn

        interval = self.activation_checkpoint_interval
        if interval == 0:
            return run(present)(forward_input)
        x = forward_input
        for start in range(0, len(present), interval):
            chunk = present[start : start + interval]
            args = x if isinstance(x, tuple) else (x,)
            if self._checkpointable([m for _, m in chunk]):
                x = self.__dict__["activation_checkpoint_func"](run(chunk), *args)
            else:
                x = run(chunk)(*args)
        return x

    def _checkpointable(self, layers: list[nn.Module]) -> bool:
        inner = [m.module if isinstance(m, _TiedUse) else m for m in layers]
        if self.checkpointable_layers is not None:
            return all(type(m).__name__ in self.checkpointable_layers for m in inner)
        return any(any(True for _ in m.parameters()) for m in inner)


def _layer_name(spec: Any) -> str | None:
    """The name 'type:REGEX' matches: a spec's class, a module's class, a function's name."""
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    if isinstance(spec, functools.partial):
        return getattr(spec.func, "__name__", None)
    return getattr(spec, "__name__", None)


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
