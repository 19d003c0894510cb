"""A device value on its way to the host, read without waiting for the work queued after it.

The training loop never reads the device in the middle of a step (a read would stall the host until the
GPU drains, and CUDA graphs need the host a step ahead). Values the host needs one step later (the
spike guard's verdict, the ranks' agreed elapsed time) are copied into pinned memory behind the work
queued so far, with an event; reading them waits for that copy only (``HostCopy``). ``LaggedAllReduceMax``
agrees on a value across ranks the same way, one call late."""
from __future__ import annotations

from typing import Optional

import torch


class HostCopy:
    """``t`` copied to the host asynchronously on CUDA (pinned memory + an event); on the CPU, ``t`` itself."""

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            self.values = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.values.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.values, self.done = t, None

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (the caller reads it)."""
        if self.done is not None:
            self.done.synchronize()
        return self.values


class LaggedAllReduceMax:
    """MAX of one float over the default process group, read one call late: each call starts the
    reduction of this rank's value and returns the agreed value of the call before (None on the first), so
    the host never waits for the step it just launched. On CUDA the result comes back as a ``HostCopy``
    recorded behind the previous step's work, as the guard's verdicts do; on the CPU (gloo) the
    collective itself blocks. Identity (no lag) without a group or with one rank."""

    def __init__(self, device):
        self.device = torch.device(device)
        self._pending: Optional[HostCopy] = None

    def __call__(self, x: float) -> Optional[float]:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return x
        cuda = self.device.type == "cuda"
        t = torch.tensor([x], dtype=torch.float64, pin_memory=cuda)
        if cuda:
            t = t.to(self.device, non_blocking=True)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        previous, self._pending = self._pending, HostCopy(t)
        return None if previous is None else float(previous.wait()[0])

    def peek(self) -> Optional[float]:
        """The agreed value of the last call (waits for it), still to be returned by the next call; None
        when there is none. For a checkpoint: it holds the time the next step will be given."""
        return None if self._pending is None else float(self._pending.wait()[0])
