"""Finding the repeated blocks of a model: the units that are sharded (and checkpointed)
one by one."""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module, class_names: tuple[str, ...] = ()) -> list[nn.Module]:
    """The model's blocks, outermost only, in module order.

    Args:
        model: the model to search.
        class_names: if given, every submodule whose class name is listed. If empty, the
            children of every nn.ModuleList / nn.Sequential whose children (two or more)
            all share one class.
    Returns:
        The blocks; an empty list when the model has none (it is then sharded as one unit).

    Example::

        find_blocks(gpt)                          # -> list(gpt.blocks)
        find_blocks(model, ("LlamaDecoderLayer",))
    """
    blocks: list[nn.Module] = []
    block_names: list[str] = []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(p + ".") for p in block_names):
            continue  # blocks inside a block are sharded with it
        if class_names:
            if type(module).__name__ in class_names:
                blocks.append(module)
                block_names.append(name)
        elif isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            if len(children) >= 2 and len({type(c) for _, c in children}) == 1:
                blocks.extend(c for _, c in children)
                block_names.extend(f"{name}.{n}" for n, _ in children)
    if class_names and not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"zero.block_classes {list(class_names)} matched no submodule of "
            f"{type(model).__name__}; classes present: {', '.join(present)}"
        )
    return blocks
