"""The task contract shared by the training loop and every task (MQAR, text, state tracking, capacity)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Task(Protocol):
    """A source of token batches. Targets use -100 for positions that carry no label."""

    name: str
    vocab_size: int
    seq_len: int

    def get_batch(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number `step` of `split` ("train" or "val"), deterministic in (split, step, batch_size):
        inputs [B, T] int64, targets [B, T] int64 (-100 = ignored). Returned on the CPU."""
        ...
