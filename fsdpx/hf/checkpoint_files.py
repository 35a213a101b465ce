"""A Hugging Face checkpoint directory's safetensors files and how its names map onto a
model's names (renames, the base-model prefix, tied weights).

[Note: checkpoint names] A checkpoint key reaches a model name by, in order: the caller's
`key_mapping` (regex -> replacement, as `from_pretrained(key_mapping=...)` in
transformers) and the model class's `_checkpoint_conversion_mapping` when it has one;
the legacy LayerNorm names `gamma` / `beta` -> `weight` / `bias` (transformers renames them
on load too); then the base-model prefix, added when a headless checkpoint
(`layers.0...`) is loaded into a model with a head (`model.layers.0...`) and removed in
the opposite case. A tensor shared by several modules (tied embeddings) is one tensor
with several names: any one of them in the checkpoint provides it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fsdpx.hf.safetensors_read import SafetensorsError, SafetensorsFile, TensorInfo

__all__ = ["CheckpointFiles", "NameMatch", "match_names", "model_tensors"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class CheckpointFiles:
    """The safetensors file(s) of a directory, every header read and checked up front."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        if (self.dir / INDEX).is_file():
            index_path = self.dir / INDEX
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (KeyError, TypeError, json.JSONDecodeError) as exc:
                raise SafetensorsError(f"{index_path}: not a safetensors index ({exc!r})") from None
            names = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE).is_file():
            weight_map, names = None, [SINGLE]
        else:
            found = sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else []
            raise FileNotFoundError(
                f"no {SINGLE} or {INDEX} in {self.dir} (found: {found or 'nothing'}); "
                "fsdpx.hf.from_pretrained reads safetensors only (pickled .bin files are "
                "not loaded): save the model with save_pretrained(safe_serialization=True)"
            )
        self.files: dict[str, SafetensorsFile] = {}
        try:
            for name in names:
                if "/" in name or name.startswith(".."):
                    raise SafetensorsError(f"{self.dir / INDEX}: file name {name!r} leaves the dir")
                self.files[name] = SafetensorsFile(self.dir / name)
        except BaseException:
            self.close()
            raise
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for key in f.tensors:
                self.where[key] = f
        if weight_map is not None:
            for key, file_name in weight_map.items():
                if key not in self.files[file_name].tensors:
                    raise SafetensorsError(
                        f"{self.dir / INDEX} maps {key!r} to {file_name}, which has no such tensor"
                    )

    def info(self, key: str) -> TensorInfo:
        return self.where[key].tensors[key]

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def model_tensors(model: nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """(every name, tensor) of each distinct parameter and persistent buffer."""
    seen: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for buf_name, b in mod.named_buffers(recurse=False):
            if b is None or buf_name in mod._non_persistent_buffers_set:
                continue
            name = f"{mod_name}.{buf_name}" if mod_name else buf_name
            seen.setdefault(id(b), []).append(name)
            tensors[id(b)] = b
    for key, names in seen.items():
        yield names, tensors[key]


@dataclass
class NameMatch:
    source: dict[str, str] = field(default_factory=dict)
    """Model name (the first of a tensor's names) -> checkpoint key."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _rename(key: str, mapping: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, repl in mapping:
        key, n = pattern.subn(repl, key)
        if n:
            break  # transformers applies the first matching pattern only
    if key.endswith(".gamma"):
        key = key[: -len("gamma")] + "weight"
    elif key.endswith(".beta"):
        key = key[: -len("beta")] + "bias"
    return key


def match_names(
    model: nn.Module, keys: list[str], key_mapping: dict[str, str] | None = None
) -> NameMatch:
    """Pair the model's tensors with checkpoint keys ([Note: checkpoint names])."""
    mapping = dict(getattr(model, "_checkpoint_conversion_mapping", None) or {})
    mapping.update(key_mapping or {})
    compiled = [(re.compile(p), r) for p, r in mapping.items()]
    prefix = getattr(model, "base_model_prefix", "") or ""
    owner: dict[str, str] = {}  # any model name -> the first name of its tensor
    persistent: list[list[str]] = []
    for names, _ in model_tensors(model):
        persistent.append(names)
        for n in names:
            owner[n] = names[0]
    has_prefix = bool(prefix) and any(n.startswith(prefix + ".") for n in owner)
    match = NameMatch()
    for key in keys:
        name = _rename(key, compiled)
        if name not in owner and prefix:
            if has_prefix and f"{prefix}.{name}" in owner:
                name = f"{prefix}.{name}"
            elif name.startswith(prefix + ".") and name[len(prefix) + 1 :] in owner:
                name = name[len(prefix) + 1 :]
        first = owner.get(name)
        if first is None:
            match.unexpected.append(key)
        elif first not in match.source:
            match.source[first] = key
        # a second key for one tensor (both tied names saved) is read once
    match.missing = [names[0] for names in persistent if names[0] not in match.source]
    return match
