"""Host -> device copies that never wait for the device.

A copy from pageable host memory to a CUDA device synchronizes the stream (PyTorch's copy_ waits for it to finish),
so a step that moves a host list to the GPU that way stalls the host until the GPU has run everything queued before.
`to_device` copies through pinned memory with non_blocking=True on CUDA: the copy is queued on the stream like a
kernel and the host goes on (PyTorch's pinned-memory allocator keeps the pinned block until the copy has run, and the
returned tensor is stream-ordered for every op queued after it). On another device it is a plain `.to`.
"""

from __future__ import annotations

import array

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor t on `device` (t itself on its own device), without a host sync on CUDA (eager; a plain `.to`
    while torch.compile traces)."""
    if torch.device(device).type == "cuda" and not torch.compiler.is_compiling():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_ints(xs: list[int]) -> torch.Tensor:
    """Python ints as an int64 host tensor [len(xs)], through an array (~3x faster than torch.tensor of a list)."""
    return torch.frombuffer(array.array("q", xs), dtype=torch.int64) if xs else torch.zeros(0, dtype=torch.int64)
