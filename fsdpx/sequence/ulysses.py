"""Ulysses sequence parallelism (DeepSpeed-Ulysses) around any attention call.

Each rank of the sp group holds seq/sp tokens. Attention needs every token, so around the
attention call an all-to-all turns sequence-sharded q/k/v (batch, heads, seq/sp, head_dim)
into head-sharded full-sequence q/k/v (batch, heads/sp, seq, head_dim); the attention
kernel runs unchanged on its heads, and a second all-to-all turns the output back. Only
the call is wrapped, never the kernel: SDPA, a user kernel or a Hugging Face attention
function all work.

[Note: Ulysses for native models] A model that calls `F.scaled_dot_product_attention` needs
no change: `UlyssesSDPA`, a TorchFunctionMode, intercepts exactly that function and runs it
through `ulysses_attention`. The engine enters the mode for its forward. Activation checkpointing
recomputes the forward inside backward, where autograd does not run torch function modes,
so the recipe hands the mode to checkpoint as its recompute context
(fsdpx/activation_checkpoint.py). A model with its own kernel wraps it once with
`ulysses_attention(kernel, group)`. Positions are the model's business: under sp the engine
passes `position_ids=` (global positions of the local tokens) to the model's forward.

[Note: GQA under Ulysses] Query heads must divide by sp (each rank gets whole heads). Key/value
heads divisible by sp are split like query heads; with fewer kv heads than sp (sp a multiple
of them) each kv head is repeated sp/kv times first, so rank r gets kv head r*kv/sp: the one
its query heads r*h/sp ... (r+1)*h/sp - 1 use under the usual grouping (query head i reads
kv head i // (h/kv)). The attention call then sees h/sp query heads and one kv head, and
SDPA's enable_gqa (or the caller's own grouping) broadcasts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from fsdpx.sequence._comm import all_to_all
from fsdpx.sequence._sdpa import SDPAMode


def check_heads(q_heads: int, kv_heads: int, sp: int) -> None:
    """Raise the user-facing error when Ulysses cannot split these heads over sp ranks."""
    if q_heads % sp != 0:
        raise ValueError(
            f"Ulysses sequence parallelism gives each of the mesh.sp = {sp} ranks whole "
            f"attention heads, but the model has {q_heads} query heads, which {sp} does not "
            f"divide; choose mesh.sp dividing {q_heads}, or context_parallel.mode 'ring'"
        )
    if kv_heads % sp != 0 and sp % kv_heads != 0:
        raise ValueError(
            f"Ulysses sequence parallelism needs key/value heads divisible by mesh.sp = {sp} "
            f"or dividing it (then they are repeated); the model has {kv_heads} key/value "
            f"heads; choose mesh.sp dividing {kv_heads} or a multiple of it, or "
            "context_parallel.mode 'ring'"
        )


def gather_sequence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    *,
    head_dim: int = 1,
    seq_dim: int = 2,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence-sharded q/k/v -> head-sharded, full-sequence q/k/v ([Note: GQA under Ulysses]).

    Args:
        q, k, v: this rank's tokens, every head; heads on `head_dim`, tokens on `seq_dim`.
        group: the sp group.
    Returns:
        q, k, v with heads/sp heads (kv: see the note) and the whole sequence.
    """
    sp = dist.get_world_size(group)
    check_heads(q.shape[head_dim], k.shape[head_dim], sp)
    if k.shape[head_dim] % sp != 0:
        repeat = sp // k.shape[head_dim]
        k = k.repeat_interleave(repeat, dim=head_dim)
        v = v.repeat_interleave(repeat, dim=head_dim)
    return tuple(  # type: ignore[return-value]
        all_to_all(t, scatter_dim=head_dim, gather_dim=seq_dim, group=group) for t in (q, k, v)
    )


def scatter_sequence(
    out: Tensor, group: dist.ProcessGroup, *, head_dim: int = 1, seq_dim: int = 2
) -> Tensor:
    """The inverse of gather_sequence for the attention output: this rank's tokens, all heads."""
    return all_to_all(out, scatter_dim=seq_dim, gather_dim=head_dim, group=group)


def ulysses_attention(
    attn_fn: Callable[..., Tensor], group: dist.ProcessGroup
) -> Callable[..., Tensor]:
    """Wrap an attention function of SDPA's layout for Ulysses sequence parallelism.

    Args:
        attn_fn: `attn_fn(q, k, v, *args, **kwargs)` with q/k/v and the result shaped
            (batch, heads, seq, head_dim); it must be causal by flag, not by an explicit
            mask over the local sequence.
        group: the sp group (engine.mesh["sp"].get_group()).
    Returns:
        The same function on sequence-sharded inputs and output.

    Example::

        attn = ulysses_attention(my_flash_kernel, engine.mesh["sp"].get_group())
        y = attn(q, k, v, causal=True)   # q: (batch, heads, seq/sp, head_dim)
    """

    def wrapped(q: Tensor, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        q, k, v = gather_sequence(q, k, v, group)
        return scatter_sequence(attn_fn(q, k, v, *args, **kwargs), group)

    return wrapped


class UlyssesSDPA(SDPAMode):
    """Runs every `F.scaled_dot_product_attention` call under it through Ulysses
    ([Note: Ulysses for native models]); every other function passes through."""

    def attend(self, sdpa: Callable[..., Tensor], call: dict[str, Any]) -> Tensor:
        if call["attn_mask"] is not None:
            raise ValueError(
                "scaled_dot_product_attention got an explicit attn_mask under Ulysses "
                "sequence parallelism (mesh.sp > 1); a mask over the local tokens cannot "
                "describe the whole sequence. Use is_causal=True and mark padding with "
                "-100 labels instead"
            )
        q, k, v = gather_sequence(call.pop("query"), call.pop("key"), call.pop("value"), self.group)
        if k.shape[1] != q.shape[1]:
            call["enable_gqa"] = True  # the kv heads were repeated to one per rank
        return scatter_sequence(sdpa(q, k, v, **call), self.group)
