"""Finding the repeated blocks of a model: the units that are sharded (and checkpointed)
one by one."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module, class_names: tuple[str, ...] = ()) -> list[nn.Module]:
    """The model's blocks, outermost only, in module order.

    Args:
        model: the model to search.
        class_names: if given, every submodule (not the model itself) whose class name is
            listed; each name must match some submodule. If empty, the children of every
            nn.ModuleList / nn.Sequential (the model included) whose children (two or
            more) all share one class.
    Returns:
        The blocks; an empty list when the model has none (it is then sharded as one unit).

    Example::

        find_blocks(gpt)                          # -> list(gpt.blocks)
        find_blocks(model, ("LlamaDecoderLayer",))
    """
    if isinstance(class_names, str):
        # `"Block" in "TransformerBlock"` is substring matching: never what was meant.
        raise ValueError(
            f"class_names must be a tuple of class names; got the string {class_names!r}. "
            f"Pass ({class_names!r},)."
        )
    if class_names:
        present = {type(m).__name__ for m in model.modules() if m is not model}
        missing = [n for n in class_names if n not in present]
        if missing:
            raise ValueError(
                f"zero.block_classes {missing} matched no submodule of "
                f"{type(model).__name__}; classes present: {', '.join(sorted(present))}"
            )
    blocks: list[nn.Module] = []
    block_names: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in block_names):
            continue  # blocks inside a block are sharded with it
        if class_names:
            if module is not model and type(module).__name__ in class_names:
                blocks.append(module)
                block_names.append(name)
        elif isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
                blocks.extend(c for _, c in children)
                # The model itself has the name "": its children's names have no prefix.
                block_names.extend(f"{name}.{n}" if name else n for n, _ in children)
    return blocks
