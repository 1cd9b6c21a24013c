"""A slot pool's row selection (`HybridCache.select` / `select_packed`): the index tensors it forms from the host's
copy of the block table equal the obviously-correct construction on the device table (the form before session 61,
kept here as the reference), at odd sizes; and a packed selection moves its host ints with ONE copy and runs no
other device op and no device -> host read (the pool's table on the meta device, where every device op is seen)."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import evict.cache as cache_mod
import evict.serve.engine as engine_mod
from evict.cache import HybridCache
from evict.models import LM, presets
from evict.serve.engine import Engine, SamplingParams


def reference(table: torch.Tensor, bs: int, rows: list[int], starts: list[int], T: int, exact: bool = False) -> dict:
    """The reference: every index tensor from the device table, one op at a time."""
    rows_t = torch.tensor(rows, dtype=torch.int64)
    positions = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(T)  # [B, T]
    end = max(starts) + T
    L = end if exact else -(-end // bs) * bs
    blocks = table[rows_t]  # [B, max_blocks]
    where = (blocks.gather(1, positions // bs) * bs + positions % bs).reshape(-1)  # [B*T]
    nb = -(-L // bs)
    gather = (blocks[:, :nb, None] * bs + torch.arange(bs)).reshape(len(rows), nb * bs)[:, :L]  # [B, L]
    mask = torch.arange(L) <= positions[:, :, None]  # [B, T, L]
    return dict(rows=rows_t, positions=positions, where=where, gather=gather, mask=mask, table=blocks,
                lengths=positions[:, -1] + 1, exact=exact and len(rows) == 1)


def same(batch, ref: dict) -> None:
    for name, want in ref.items():
        got = getattr(batch, name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
        else:
            assert got == want, name


def random_pool(rng: random.Random, bs: int, n_slots: int, max_blocks: int) -> HybridCache:
    table = torch.zeros(n_slots, max_blocks, dtype=torch.int64)
    pool = HybridCache([], n_slots, bs * max_blocks, block_size=bs, table=table)
    blocks = list(range(n_slots * max_blocks))
    rng.shuffle(blocks)
    for s in range(n_slots):
        pool.set_blocks(s, blocks[s * max_blocks : (s + 1) * max_blocks][: rng.randint(1, max_blocks)])
    assert torch.equal(pool.host_table, pool.table)
    return pool


@pytest.mark.parametrize("seed", range(40))
def test_select_packed_indices_equal_the_reference(seed):
    """Random block sizes (1 .. 7), slots, starts, chunk lengths and block tables: every index tensor of the packed
    batch and of each part equals the reference's, and the packed ones are the parts' concatenation."""
    rng = random.Random(seed)
    bs, n_slots, max_blocks = rng.randint(1, 7), rng.randint(2, 9), rng.randint(1, 6)
    pool = random_pool(rng, bs, n_slots, max_blocks)
    owned = {s: int((pool.host_table[s] != 0).sum()) for s in range(n_slots)}  # lower bound of each slot's blocks
    slots = rng.sample(range(n_slots), rng.randint(1, n_slots))
    n_dec = rng.randint(0, len(slots) - (1 if len(slots) > 0 and rng.random() < 0.5 else 0))
    cap = {s: max(owned[s], 1) * bs for s in slots}  # positions a slot's set blocks cover (block 0 may be id 0)
    decode = [(s, rng.randrange(cap[s])) for s in slots[:n_dec]]
    chunks = []
    for s in slots[n_dec:]:
        start = rng.randrange(cap[s])
        chunks.append((s, start, rng.randint(1, cap[s] - start)))
    if not decode and not chunks:
        chunks = [(slots[0], 0, 1)]
    pool.select_packed(decode, chunks)
    b = pool.batch
    parts = []
    if decode:
        ref = reference(pool.table, bs, [s for s, _ in decode], [p for _, p in decode], 1)
        same(b.decode, ref)
        parts.append(ref)
    else:
        assert b.decode is None
    assert len(b.chunks) == len(chunks)
    for got, (s, start, n) in zip(b.chunks, chunks):
        ref = reference(pool.table, bs, [s], [start], n, exact=True)
        same(got, ref)
        parts.append(ref)
    assert torch.equal(b.rows, torch.cat([p["rows"] for p in parts]))
    assert torch.equal(b.positions, torch.cat([p["positions"].reshape(-1) for p in parts])[None])
    assert torch.equal(b.where, torch.cat([p["where"] for p in parts]))
    lens = [1] * len(decode) + [n for _, _, n in chunks]
    assert b.offsets == [len(decode) + sum(lens[len(decode) : len(decode) + i]) for i in range(len(chunks) + 1)]
    assert b.cu_seqlens.device.type == "cpu" and b.cu_seqlens.tolist() == [o - len(decode) for o in b.offsets]


@pytest.mark.parametrize("seed", range(20))
def test_select_indices_equal_the_reference(seed):
    """`select` (B rows of T tokens each) at random sizes: the same tensors as the reference (L whole blocks)."""
    rng = random.Random(100 + seed)
    bs, n_slots, max_blocks = rng.randint(1, 7), rng.randint(1, 9), rng.randint(2, 6)
    pool = random_pool(rng, bs, n_slots, max_blocks)
    rows = rng.sample(range(n_slots), rng.randint(1, n_slots))
    T = rng.randint(1, bs)
    starts = [rng.randrange(bs * max_blocks - T + 1) for _ in rows]
    pool.select(rows, starts, T)
    same(pool.batch, reference(pool.table, bs, rows, starts, T))


class DeviceOps(TorchDispatchMode):
    """The ops that make or read a meta tensor (views excluded), by name; a device -> host read raises on meta."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else [out])]
        if not func.is_view and any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
            self.ops.append(str(func.overloadpacket.__name__))
        return out


def test_packed_selection_is_one_copy_and_no_device_op(monkeypatch):
    """100 decode rows and two 64-token chunks, the pool's table on the meta device: select_packed makes one host ->
    device copy (`to_device` once, the only op touching the device) and reads nothing back; the decode rows' table
    and the parts' gathers and masks are formed on the device only when read, with a few ops each."""
    rng = random.Random(0)
    pool = random_pool(rng, 16, 110, 12)
    pool.table = pool.table.to("meta")
    calls = []
    real = cache_mod.to_device
    monkeypatch.setattr(cache_mod, "to_device", lambda t, device: calls.append(t.numel()) or real(t, device))
    decode = [(s, rng.randrange(16)) for s in range(100)]
    with DeviceOps() as seen:
        pool.select_packed(decode, [(100, 0, 64), (101, 5, 64)])
    assert len(calls) == 1 and calls[0] == 2 * 102 + 2 * (100 + 128)
    assert seen.ops == ["_to_copy"], seen.ops
    b = pool.batch
    assert all(t.is_meta for t in (b.rows, b.positions, b.where, b.decode.lengths))
    with DeviceOps() as seen:
        b.decode.table, b.decode.gather, b.decode.mask, b.chunks[1].gather
    assert 0 < len(seen.ops) <= 12, seen.ops


@pytest.mark.parametrize("async_steps", [False, True])
def test_engine_packed_step_moves_its_host_ints_once(monkeypatch, async_steps):
    """An engine's packed step (decode rows + a prompt chunk) calls `to_device` twice: once for the cache's index
    buffer, once for the engine's tokens, head positions, sampled rows and slots; and its tokens equal a step-by-step
    `generate` (the engine's packed tests cover that in full; here one greedy request beside a decode row)."""
    torch.manual_seed(0)
    model = LM(presets.get("kimi_linear", n_layers=4, init_std=0.2)).eval()
    eng = Engine(model, max_batch=4, cache_budget=8 << 20, block_size=8, prefill_chunk=16, async_steps=async_steps)
    calls = {"cache": 0, "engine": 0}
    for mod, key in ((cache_mod, "cache"), (engine_mod, "engine")):
        real = mod.to_device
        monkeypatch.setattr(mod, "to_device", lambda t, d, key=key, real=real: calls.__setitem__(key, calls[key] + 1)
                            or real(t, d))
    a = eng.submit(list(range(5)), SamplingParams(max_tokens=6, temperature=0))
    for _ in range(3):
        eng.step()
    b = eng.submit(list(range(40)), SamplingParams(max_tokens=3, temperature=0))
    before = dict(calls), eng.stats["packed_steps"]
    eng.step()
    assert eng.stats["packed_steps"] == before[1] + 1
    assert calls == {"cache": before[0]["cache"] + 1, "engine": before[0]["engine"] + 1}
    eng.run_until_idle()
    for r in (a, b):
        want = model.generate(torch.tensor([r.prompt]), max_new_tokens=r.params.max_tokens, temperature=0)[0]
        assert r.out == want[len(r.prompt):].tolist()


def test_empty_chunks_and_steps_are_one_line_errors():
    pool = random_pool(random.Random(1), 4, 4, 3)
    with pytest.raises(ValueError, match="at least one token"):
        pool.select_packed([(0, 1)], [(1, 0, 0)])
    with pytest.raises(ValueError, match="at least one token"):
        pool.select([0], [0], 0)


@pytest.mark.gpu
def test_cuda_packed_selection_and_host_ints_never_sync():
    """On CUDA, under torch's sync debug mode (a synchronizing op raises): a pageable `torch.tensor(list,
    device="cuda")` raises (the mode is on), while `to_device(host_ints(...))`, `select_packed` (100 decode rows + two
    odd chunks) and reading its lazy table / gathers / masks do not; and the tensors equal the reference's."""
    from evict.host_copy import host_ints, to_device

    rng = random.Random(2)
    pool = random_pool(rng, 16, 110, 12)
    pool.table = pool.table.cuda()
    torch.cuda.synchronize()
    decode = [(s, rng.randrange(16)) for s in range(100)]
    chunks = [(100, 0, 61), (101, 7, 93)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2, 3], device="cuda")
        ints = to_device(host_ints([4, 5, 6]), torch.device("cuda"))
        pool.select_packed(decode, chunks)
        b = pool.batch
        got = [b.decode.table, b.decode.gather, b.decode.mask] + [t for c in b.chunks for t in (c.table, c.gather, c.mask)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ints.tolist() == [4, 5, 6]
    table = pool.table.cpu()
    ref = reference(table, 16, [s for s, _ in decode], [p for _, p in decode], 1)
    assert all(torch.equal(g.cpu(), ref[k]) for g, k in zip(got[:3], ("table", "gather", "mask")))
    for i, (s, start, n) in enumerate(chunks):
        ref = reference(table, 16, [s], [start], n, exact=True)
        assert all(torch.equal(g.cpu(), ref[k]) for g, k in zip(got[3 + 3 * i : 6 + 3 * i], ("table", "gather", "mask")))
        assert all(torch.equal(getattr(b.chunks[i], k).cpu(), ref[k]) for k in ("rows", "positions", "where", "lengths"))
