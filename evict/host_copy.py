"""Host -> device copies that never wait for the device.

A copy from pageable host memory to a CUDA device synchronizes the stream (PyTorch's copy_ waits for it to finish),
so a step that moves a host list to the GPU that way stalls the host until the GPU has run everything queued before.
`to_device` copies through pinned memory with non_blocking=True on CUDA: the copy is queued on the stream like a
kernel and the host goes on (PyTorch's pinned-memory allocator keeps the pinned block until the copy has run, and the
returned tensor is stream-ordered for every op queued after it). On another device it is a plain `.to`.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor t on `device` (t itself on its own device), without a host sync on CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def ints_to_device(xs: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor [len(xs)] on `device` (one copy, no host sync on CUDA)."""
    return to_device(torch.tensor(xs, dtype=torch.int64), device)
