"""A device value on its way to the host, read without waiting for the work queued after it.

The training loop never reads the device in the middle of a step (a read would stall the host until the
GPU drains, and CUDA graphs need the host a step ahead). Values the host needs one step later (the
spike guard's verdict, the ranks' agreed elapsed time) are copied into pinned memory behind the work
queued so far, with an event; reading them waits for that copy only."""
from __future__ import annotations

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
