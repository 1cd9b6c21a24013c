"""The hybrid cache: one container of typed per-layer states that owns the position.

Three kinds of memory, one per mixer family:
    KVState         attention: keys and values of every past token     [B, L_max, H_kv, D]   grows O(N)
    LatentState     MLA: the compressed latent c and the shared rope key [B, L_max, r + d_rope]  grows O(N), smaller
    RecurrentState  linear / delta family: the fixed-size memory S [B, H, K, V] (float32) + conv tail [B, k-1, C]
Layers read and write their own state at `cache.pos` and never advance it; the model advances once per call.

A slot pool (`LM.new_pool`, used by the serving engine) is the same container laid out for sequences at different
lengths: recurrent states and conv tails have one row per slot; KV and latent buffers are arenas of fixed-size blocks
[n_blocks, block_size, ...] shared by all slots through a block table [n_slots, max_blocks]. Before each forward the
caller `select`s the slots it runs and their start positions; the forward then reads and writes those rows only.
`select_packed` instead lays out one forward over many sequences packed along T (a PackedBatch): decode rows of one
token each and prompt chunks of any lengths, in a batch of one.

A batch cache may also hold left-padded rows (`pad`, set by the first forward's `LM(..., pad=)`): each forward then
runs as a PaddedBatch, every row at its own positions, its pads invisible to what its tokens read.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from evict.host_copy import host_ints, to_device


@dataclass
class KVState:
    k: torch.Tensor  # [B, L_max, H_kv, D]
    v: torch.Tensor  # [B, L_max, H_kv, D]
    conv: torch.Tensor | None = None  # [B, k-1, C] short-conv tail, when the layer has one


@dataclass
class LatentState:
    c: torch.Tensor  # [B, L_max, r]  normalized latent
    k_rope: torch.Tensor  # [B, L_max, d_rope]  rotated (or NoPE) shared key slice
    conv: torch.Tensor | None = None  # [B, k-1, C] short-conv tail, when the layer has one


@dataclass
class RecurrentState:
    S: torch.Tensor | None = None  # [B, H, K, V] float32, None until the first write
    conv: torch.Tensor | None = None  # [B, k-1, C] last inputs of the short conv
    # [B] slot ids, set only on a slot pool's one-token step (`HybridCache.slot_states`): S and conv are then the
    # pool's whole [n_slots, H, K, V] and [n_slots, k-1, C], and the layer's rows are S[rows] and conv[rows], updated
    # in place by the step op and the conv step (no gather, no scatter)
    rows: torch.Tensor | None = None


def write_rows(arena: torch.Tensor, where: torch.Tensor, new: torch.Tensor) -> None:
    """Write new [B, T, ...] into the block arena [n_blocks, block_size, ...] at flat arena rows where [B*T]."""
    flat = arena.view(-1, *arena.shape[2:])  # [n_blocks * block_size, ...]
    flat.index_copy_(0, where, new.reshape(-1, *new.shape[2:]).to(flat.dtype))


class SlotBatch:
    """Where one forward's rows live in a slot pool (B rows of T new tokens each, L = keys read per row).

    rows [B] slot ids; positions [B, T] absolute positions of the new tokens; where [B*T] arena rows they go to;
    lengths [B] the rows' lengths after this step; table [B, max_blocks] the rows' block tables (the paged decode op);
    gather [B, L] arena rows of positions 0..L-1 of each slot; mask [B, T, L]: key j is visible iff j <= position.
    rows, positions, where and lengths come from the host in one copy (`HybridCache.select`); table, gather and mask
    are formed on the device from the pool's block table when first read (a paged decode op reads none of gather and
    mask, an exact row no mask), each with a few device ops and no host sync.
    """

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor, where: torch.Tensor, lengths: torch.Tensor, *,
                 pool_table: torch.Tensor, block_size: int, L: int, exact: bool = False,
                 table: torch.Tensor | None = None):
        self.rows, self.positions, self.where, self.lengths = rows, positions, where, lengths
        self.exact = exact  # gather holds exactly each row's past and new keys (one row): causal attention, no mask
        self.L = L
        self._pool_table, self._bs = pool_table, block_size
        self._table: torch.Tensor | None = table
        self._gather: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = self._pool_table[self.rows]  # [B, max_blocks]
        return self._table

    @property
    def gather(self) -> torch.Tensor:
        if self._gather is None:
            B, bs, L = self.rows.shape[0], self._bs, self.L
            nb = -(-L // bs)
            blocks = self.table[:, :nb, None]  # [B, nb, 1]
            self._gather = (blocks * bs + torch.arange(bs, device=blocks.device)).reshape(B, nb * bs)[:, :L]  # [B, L]
        return self._gather

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = torch.arange(self.L, device=self.positions.device) <= self.positions[:, :, None]  # [B, T, L]
        return self._mask

    def write(self, arena: torch.Tensor, new: torch.Tensor) -> None:
        """Write new [B, T, ...] into the block arena [n_blocks, block_size, ...] at the rows' positions."""
        write_rows(arena, self.where, new)

    def read(self, arena: torch.Tensor) -> torch.Tensor:
        """Every row's positions 0..L-1 from the block arena, contiguous: [B, L, ...] (one copy of what is read)."""
        flat = arena.view(-1, *arena.shape[2:])
        B, L = self.rows.shape[0], self.L
        if L == 0:
            raise ValueError("cache: this selection reads keys in place only (a CUDA-graph decode step): no key gather")
        return flat.index_select(0, self.gather.reshape(-1)).view(B, L, *flat.shape[1:])  # ~10x advanced indexing


@dataclass
class PackedBatch:
    """One forward over N sequences of a slot pool packed along T in a batch of one (tokens [1, T]).

    The first D tokens are D decode rows (one token each, `decode` their SlotBatch [D, 1]); then P prompt chunks, chunk
    i at T offsets [offsets[i], offsets[i + 1]) (`chunks[i]` its SlotBatch [1, T_i], reading exactly its L_i = start +
    T_i keys). rows [N] slot ids in that order; positions [1, T]; where [T] arena rows of the new tokens;
    cu_seqlens [P + 1] (CPU int64) the chunks' bounds within the prompt part (offsets - D), for the memory op.
    Every index tensor of every part is a view of one device buffer, copied from the host once (`select_packed`).
    Mixers project, convolve and run the memory op packed; attention runs per part (`split` / `join`).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    where: torch.Tensor
    decode: SlotBatch | None
    chunks: list[SlotBatch]
    offsets: list[int]
    cu_seqlens: torch.Tensor

    @property
    def n_decode(self) -> int:
        return self.offsets[0]

    def write(self, arena: torch.Tensor, new: torch.Tensor) -> None:
        """Write the packed new [1, T, ...] into the block arena at the sequences' positions."""
        write_rows(arena, self.where, new)

    def parts(self) -> list[tuple[SlotBatch, slice]]:
        """(SlotBatch, rows of the packed states) of each part: the decode rows, then each chunk."""
        D = self.n_decode
        out = [] if self.decode is None else [(self.decode, slice(0, D))]
        return out + [(c, slice(D + i, D + i + 1)) for i, c in enumerate(self.chunks)]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [1, T, ...] -> the parts: decode rows [D, 1, ...], then each chunk [1, T_i, ...] (views)."""
        D = self.n_decode
        out = [] if self.decode is None else [x[0, :D, None]]
        return out + [x[:, a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of split: [1, T, ...]."""
        if self.decode is not None:
            parts = [parts[0].transpose(0, 1), *parts[1:]]
        return torch.cat(parts, dim=1)


@dataclass
class PaddedBatch:
    """One forward over a batch cache whose rows start at different columns (left padding): row b's first pad[b]
    columns are pads, its tokens follow. The call feeds T columns [start, start + T).

    real [B, T] bool: the column holds a token; positions [B, T] int64: its position in its own row (column - pad[b];
    0 at a pad); mask [B, T, L = start + T] bool: query t sees key j iff pad[b] <= j <= start + t (a pad's query sees
    itself only, so its softmax stays finite). Every mixer leaves what a real token reads unchanged by pads: attention
    masks pad keys, the short conv sees zeros there, and the memory gets k = 0 with log-decay 0 (S_t = S_{t-1}).
    `padded`: some column of this call is a pad (False once every row is past its pads, e.g. each decode step)."""

    start: int
    real: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    padded: bool

    @classmethod
    def build(cls, pad: list[int], start: int, T: int, device) -> PaddedBatch:
        cols = torch.arange(start, start + T, device=device)  # [T]
        p = torch.tensor(pad, dtype=torch.int64, device=device)[:, None]  # [B, 1]
        keys = torch.arange(start + T, device=device)  # [L]
        own = keys[None, None] >= p[:, :, None]  # [B, 1, L] the row's real columns
        mask = (keys <= cols[:, None]) & (own | (keys == cols[:, None]))  # [B, T, L]
        return cls(start, cols >= p, (cols - p).clamp(min=0), mask, start < max(pad))

    def zero_pads(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] with zeros at the pad columns (x itself when this call has none)."""
        if not self.padded:
            return x
        return torch.where(self.real.view(*self.real.shape, *[1] * (x.dim() - 2)), x, torch.zeros((), dtype=x.dtype,
                                                                                                   device=x.device))


def _distinct(rows: list[int]) -> None:
    """One slot once per step: a recurrent state stepped in place (`memory_step(rows=)`) would be written twice."""
    if len(set(rows)) != len(rows):
        raise ValueError(f"cache: a step's slots must be distinct, got {rows}")


class HybridCache:
    """Per-layer states for a batch of sequences, all at the same position — or a slot pool (see the module doc)."""

    def __init__(self, states: list, batch_size: int, max_len: int, *, block_size: int | None = None,
                 table: torch.Tensor | None = None, owner: str | None = None):
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.states = states
        self.batch_size = batch_size
        self.max_len = max_len
        self.pos = 0
        self.block_size = block_size  # None: one batch at one position; else a slot pool
        self.table = table  # [n_slots, max_blocks] int64 block ids (pool only)
        # its host copy (written with it by set_blocks): each step's arena rows are computed on the host
        self.host_table = None if table is None else (torch.zeros(table.shape, dtype=torch.int64) if table.is_meta
                                                      else table.to("cpu", copy=True))  # a meta table holds no data
        self.batch: SlotBatch | PackedBatch | None = None  # the pool's rows of the next forward
        self.owner = owner  # the model it was built for (LM._cache_owner), checked by the forward; None: unchecked
        self.pad: list[int] | None = None  # left padding: each row's count of leading pad columns (PaddedBatch)

    @property
    def device(self) -> torch.device | None:
        """The device of the states (the first tensor's), None while no state holds a tensor."""
        for st in self.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    return t.device
        return None

    # -- slot pool ----------------------------------------------------------------------------------------------
    def set_blocks(self, slot: int, blocks: list[int], *, non_blocking: bool = False) -> None:
        """The blocks that hold slot's positions, in order (block i holds positions [i bs, (i + 1) bs)).
        `non_blocking` (a CUDA pool): copied from pinned memory without waiting for the device's queued work.
        The host keeps its own copy of the table (`host_table`), from which each step's arena rows are computed."""
        if self.table is None or self.host_table is None:
            raise ValueError("cache: set_blocks needs a slot pool (LM.new_pool), not a batch cache")
        if blocks:
            src = torch.tensor(blocks, dtype=torch.int64)
            self.host_table[slot, : len(blocks)] = src
            self.table[slot, : len(blocks)].copy_(src.pin_memory() if non_blocking else src, non_blocking=non_blocking)

    def select(self, rows: list[int], starts: list[int], T: int) -> None:
        """The next forward runs T new tokens for each slot of `rows`, the slot's first new token at `starts[i]`.

        Every slot must own blocks up to position start + T - 1 (`set_blocks`); its earlier positions hold its past."""
        if self.block_size is None or self.table is None:
            raise ValueError("cache: select needs a slot pool (LM.new_pool), not a batch cache")
        _distinct(rows)
        if type(T) is not int or T < 1:
            raise ValueError(f"cache: select runs at least one token per row, got T={T!r}")
        B, bs = len(rows), self.block_size
        end = max(starts) + T
        buf = self._indices(rows, starts, [T] * B)
        self.batch = SlotBatch(buf[:B], buf[B : B + B * T].view(B, T), buf[B + B * T : B + 2 * B * T],
                               buf[B + 2 * B * T :], pool_table=self.table, block_size=bs, L=-(-end // bs) * bs)

    def _indices(self, slots: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
        """N sequences' new tokens (slot, first position, count), packed in that order (T = sum(lens) tokens), as ONE
        int64 device buffer [N + T + T + N]: the slots, each token's position, each token's arena row, each sequence's
        length after this step. Formed on the host (the block table's host copy), moved by one copy (no sync on CUDA)."""
        assert self.host_table is not None and self.table is not None and self.block_size is not None
        bs = self.block_size
        seg = host_ints(slots + starts + lens).view(3, -1)  # [3, N]
        T = sum(lens)
        if T == len(lens) and max(lens) == 1:  # one token each (decode rows)
            positions, tok_slots = seg[1], seg[0]
        else:
            first = seg[2].cumsum(0) - seg[2]  # [N] each sequence's first packed index
            positions = torch.arange(T) + (seg[1] - first).repeat_interleave(seg[2], output_size=T)  # [T]
            tok_slots = seg[0].repeat_interleave(seg[2], output_size=T)  # [T]
        where = self.host_table[tok_slots, positions // bs] * bs + positions % bs  # [T]
        return to_device(torch.cat([seg[0], positions, where, seg[1] + seg[2]]), self.table.device)

    def select_packed(self, decode: list[tuple[int, int]], chunks: list[tuple[int, int, int]]) -> None:
        """The next forward runs tokens [1, T] packed: one token of each (slot, start) of `decode`, then each prompt
        chunk (slot, start, n) of `chunks` (n tokens from position start). Blocks as for `select`."""
        if self.block_size is None or self.table is None:
            raise ValueError("cache: select_packed needs a slot pool (LM.new_pool), not a batch cache")
        if not decode and not chunks:
            raise ValueError("cache: select_packed needs at least one decode row or prompt chunk")
        if any(type(n) is not int or n < 1 for _, _, n in chunks):
            raise ValueError(f"cache: a prompt chunk runs at least one token, got chunks {chunks}")
        slots = [r for r, _ in decode] + [r for r, _, _ in chunks]
        _distinct(slots)
        D, N, bs = len(decode), len(slots), self.block_size
        offsets = [D]
        for _, _, n in chunks:
            offsets.append(offsets[-1] + n)
        T = offsets[-1]
        buf = self._indices(slots, [s for _, s in decode] + [s for _, s, _ in chunks], [1] * D + [n for _, _, n in chunks])
        rows, positions, where, lengths = buf[:N], buf[N : N + T], buf[N + T : N + 2 * T], buf[N + 2 * T :]
        table = self.table
        dec = None
        if decode:
            end = max(s for _, s in decode) + 1
            dec = SlotBatch(rows[:D], positions[:D, None], where[:D], lengths[:D], L=-(-end // bs) * bs,
                            pool_table=table, block_size=bs)
        parts = [SlotBatch(rows[D + i : D + i + 1], positions[None, a:b], where[a:b], lengths[D + i : D + i + 1],
                           L=s + n, exact=True, pool_table=table, block_size=bs)
                 for i, ((_, s, n), a, b) in enumerate(zip(chunks, offsets[:-1], offsets[1:]))]
        self.batch = PackedBatch(rows=rows, positions=positions[None], where=where, decode=dec, chunks=parts,
                                 offsets=offsets, cu_seqlens=torch.tensor(offsets, dtype=torch.int64) - D)

    def select_static(self, rows: torch.Tensor, starts: torch.Tensor) -> SlotBatch:
        """A one-token step for the slots `rows` [B] (device) at positions `starts` [B], computed on the device without
        a host sync (CUDA-graph capture): the paged decode ops read keys in place, so no gather is laid out (L = 0)."""
        assert self.block_size is not None and self.table is not None
        bs = self.block_size
        positions = starts[:, None]  # [B, 1]
        blocks = self.table[rows]  # [B, max_blocks]
        where = (blocks.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
        self.batch = SlotBatch(rows, positions, where, starts + 1, pool_table=self.table, block_size=bs, L=0, table=blocks)
        return self.batch

    def _selected(self) -> SlotBatch | PackedBatch:
        if self.batch is None:
            raise ValueError("cache: no rows selected: call select(rows, starts, T) before the forward")
        return self.batch

    def slot_states(self) -> list:
        """Per-layer states of the selected rows: recurrent states and conv tails gathered, KV / latent arenas shared.
        A one-token step (a SlotBatch of T = 1) leaves each RecurrentState's S and conv tails whole, with `rows` set:
        the step op and the conv step update the rows in place (no copy of the states out and back)."""
        batch = self._selected()
        rows = batch.rows
        step = isinstance(batch, SlotBatch) and batch.positions.shape[1] == 1
        out = []
        for st in self.states:
            whole = ("S", "conv") if step and isinstance(st, RecurrentState) and st.S is not None else ()
            new = replace(st, **{f.name: getattr(st, f.name)[rows] for f in fields(st) if f.name in ("S", "conv")
                                 and f.name not in whole and getattr(st, f.name) is not None})
            out.append(replace(new, rows=rows) if whole else new)
        return out

    def write_back(self, states: list) -> None:
        """Copy the selected rows' new recurrent states and conv tails into the pool (a state updated in place, the
        pool's own tensor, is left as it is); the selection is used up."""
        rows = self._selected().rows
        for st, new in zip(self.states, states):
            for name in ("S", "conv"):
                old, now = getattr(st, name, None), getattr(new, name, None)
                if old is not None and now is not None and now is not old:
                    old[rows] = now.to(old.dtype)
        self.batch = None

    def reset_slot(self, slot: int) -> None:
        """Zero a slot's recurrent states and conv tails (its KV blocks are rewritten before they are read)."""
        for st in self.states:
            for name in ("S", "conv"):
                if getattr(st, name, None) is not None:
                    getattr(st, name)[slot].zero_()

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int):
        return self.states[i]

    def reserve(self, n: int) -> None:
        """Check that n more tokens fit (call before a forward; layers then write at [pos, pos + n))."""
        if self.pos + n > self.max_len:
            raise ValueError(f"tokens: cache holds {self.max_len} positions, {self.pos} used, cannot add {n}")

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        """Forget every sequence: zero all states and conv tails in place (their buffers keep their addresses, so a
        captured decode graph stays valid) and return to position 0. Reuse then equals a fresh cache exactly."""
        for st in self.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    t.zero_()
        self.pos = 0
        self.batch = None
        self.pad = None

    def bytes_per_sequence(self) -> int:
        """Bytes this cache holds per sequence, as allocated (KV and latent at full max_len)."""
        total = 0
        for st in self.states:
            for f in fields(st):
                t = getattr(st, f.name)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total // max(self.batch_size, 1)
