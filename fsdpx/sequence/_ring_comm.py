"""The one communication primitive of ring attention: pass a tensor one step around the sp
ring (to the next rank, from the previous one), started before the compute it overlaps
and waited for after it (picotron's split of `*_comm.py` from the code that uses it).

Not differentiable by itself: ring attention's custom backward (fsdpx/sequence/ring.py)
passes the gradients around the ring explicitly, with the same primitive.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class RingShift:
    """One step of the ring: send `x` to group rank (r + 1) % n, receive the previous
    rank's tensor of the same shape. Point-to-point over `group` (gloo and NCCL both
    implement it), so each rank moves 1/n of what an all-gather would per step.

    Two shifts may be in flight at once (ring attention's backward passes K/V and their
    gradients); each kind has its own `tag`, and every rank starts them in the same order,
    so sends and receives pair up on gloo (matched by tag) and NCCL (matched by order).

    Example::

        shift = RingShift(kv, group)   # starts the exchange
        ...                            # compute on kv meanwhile
        kv = shift.wait()              # the previous rank's kv
    """

    def __init__(self, x: Tensor, group: dist.ProcessGroup, *, tag: int = 0) -> None:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        self._send = x.contiguous()
        self._recv = torch.empty_like(self._send)
        nxt, prev = (rank + 1) % n, (rank - 1) % n
        ops = [
            dist.P2POp(dist.isend, self._send, group=group, group_peer=nxt, tag=tag),
            dist.P2POp(dist.irecv, self._recv, group=group, group_peer=prev, tag=tag),
        ]
        self._works = dist.batch_isend_irecv(ops)

    def wait(self) -> Tensor:
        for work in self._works:
            work.wait()
        return self._recv
