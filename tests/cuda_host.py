"""Whether host memory is page-locked with CUDA, asked without leaving a CUDA error behind.

torch's ``is_pinned()`` knows only its own pinned allocator's blocks, not memory registered
in place (``fsdpx.ops.aio.page_lock_``). Registering it a second time would answer too
(cudaErrorHostMemoryAlreadyRegistered, 712), but a failed cudaHostRegister stays the CUDA
runtime's last error, and torch's next launch check raises it in whichever test runs
next (seen on an H200: ``test_ops_adam``'s first ``.cuda()`` failed with "part or all of
the requested memory range is already mapped"). Unregistering succeeds exactly when the
memory is registered; registering it again restores that.
"""

from __future__ import annotations

import torch


def page_locked(t: torch.Tensor) -> bool:
    cudart = torch.cuda.cudart()
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    if int(cudart.cudaHostUnregister(ptr)) != 0:
        return False
    assert int(cudart.cudaHostRegister(ptr, nbytes, 0)) == 0
    return True
