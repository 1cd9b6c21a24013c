"""The capacity task of Schlag, Irie, Schmidhuber (ICML 2021, "Linear Transformers Are Secretly Fast Weight
Programmers", synthetic retrieval): write key → value pairs into a memory, then query every key and regress its value.

A batch holds B independent sequences over S key tokens (ids 0…S−1) and S one-hot values (ids 0…S−1; the value
vector of id j is e_j in R^S, so predicting zeros costs exactly ½ per query):

    overwrite=False   S writes: the S keys in a random order, each with its own value (a random permutation of
                      the S value ids), then S queries (the S keys in another random order), target = its value.
    overwrite=True    2S writes: every key twice, at random positions of the sequence, the second time with a
                      different value (first value + a random shift in 1…S−1, mod S); the target of a query is the
                      key's later value. This is our reading of the paper's "2S writes, keys repeated" (LAB.md).

The pairing of keys and values is new in every sequence, so it can only be read from the memory, never learnt into
the weights. Batch `step` is drawn from its own torch.Generator seeded with (seed, step): deterministic, and any
batch can be made without the ones before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CapacityBatch:
    write_keys: torch.Tensor  # [B, W] key ids written, W = S or 2S
    write_values: torch.Tensor  # [B, W] value ids written with them
    query_keys: torch.Tensor  # [B, S] every key once
    targets: torch.Tensor  # [B, S] the value id each query must return (the latest one written for its key)


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**63)


def _perms(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(rows, n, generator=g).argsort(dim=1)  # [rows, n] a random permutation per row


def make_batch(S: int, batch_size: int, *, overwrite: bool, seed: int, step: int) -> CapacityBatch:
    """Batch `step` of the capacity task with S keys (module docstring)."""
    if S < 2 or batch_size < 1:
        raise ValueError(f"capacity batch: need S >= 2 and batch_size >= 1, got S={S}, batch_size={batch_size}")
    g = _generator(seed, step)
    first = _perms(batch_size, S, g)  # [B, S] the value id of key i's (first) write
    if overwrite:
        second = (first + torch.randint(1, S, (batch_size, S), generator=g)) % S  # [B, S] never equal to first
        order = _perms(batch_size, 2 * S, g)  # [B, 2S] a random order of two copies of every key
        keys = order % S  # [B, 2S]: key j is written where order holds j and where it holds j + S
        at = order.argsort(dim=1)  # [B, 2S] the position of each order value
        later = at.gather(1, (order + S) % (2 * S)) < torch.arange(2 * S)  # [B, 2S] its key's other copy came first
        values = torch.where(later, second.gather(1, keys), first.gather(1, keys))
        latest = second
    else:
        keys = _perms(batch_size, S, g)  # [B, S]
        values = first.gather(1, keys)
        latest = first
    queries = _perms(batch_size, S, g)  # [B, S]
    return CapacityBatch(keys, values, queries, latest.gather(1, queries))
