"""MQAR: multi-query associative recall (Zoology, Arora et al. 2023), generated from the spec in LAB.md.

Vocabulary V, K key-value pairs, sequence length L. Keys come from 1 … V/2−1 and values from V/2 … V−1,
each drawn without replacement within one example. The context is k1 v1 k2 v2 … kK vK (2K tokens). The
K keys then come back as queries, in a random order, in the gap after the context: there are
space = (L − 2K) // 2 slots, slot i is drawn with probability ∝ a·(i+1)^(a−1) (a = power_a = 0.01, so
queries crowd near the context), K slots without replacement, and a query key sits at position 2K + 2·slot.
The label (the key's value) is the target at the query-key position: the model reads the key and must
predict the value as the next token. Every other target is −100 (ignored); every other input is 0, or a
uniformly random token of the whole vocabulary if random_filler. The `simple` variant puts the K queries
consecutively right after the context (positions 2K … 3K−1).

Worked example, V = 16, L = 16, K = 2 (keys from 1…7, values from 8…15; space = 6 slots at positions
4, 6, 8, 10, 12, 14). Pairs (3→12), (5→9); the queries drew slot 0 for key 5 and slot 3 for key 3:

    position  0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15
    inputs    3   12    5    9    5    0    0    0    0    0    3    0    0    0    0    0
    targets −100 −100 −100 −100   9 −100 −100 −100 −100 −100  12 −100 −100 −100 −100 −100

Seeds. torch seeds its CPU generator from the low 32 bits only, so every batch seed is a 32-bit number
whose top bit is the split (0 = train, 1 = val): train and val batches can never share a seed, whatever
train_seed and test_seed are. Within a split, batch `step` uses (mix(seed) + step) mod 2^31, so distinct
steps of one stream never repeat a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SPLITS = {"train": 0, "val": 1}
_SEED_SPAN = 1 << 31


@dataclass
class MQARConfig:
    """One MQAR setting. Paper sweep: (seq_len, num_pairs) ∈ {(64,4), (128,8), (256,16), (512,64)}."""

    vocab_size: int = 8192
    seq_len: int = 64
    num_pairs: int = 4
    power_a: float = 0.01
    simple: bool = False
    random_filler: bool = False
    train_seed: int = 0
    test_seed: int = 1_000_003
    # None: every training batch is fresh. N: training cycles through one fixed set of N examples (Zoology's regime:
    # a finite training set seen for several epochs), reshuffled every epoch; the val batches stay fresh either way.
    train_examples: int | None = None

    def __post_init__(self) -> None:
        V, L, K = self.vocab_size, self.seq_len, self.num_pairs
        if K < 1:
            raise ValueError(f"num_pairs must be >= 1, got {K}")
        if V < 4:
            raise ValueError(f"vocab_size must be >= 4, got {V}")
        if K > V // 2 - 1:
            raise ValueError(f"vocab_size={V} holds only {V // 2 - 1} distinct keys (1 … V/2-1) for num_pairs={K}")
        if K > V - V // 2:
            raise ValueError(f"vocab_size={V} holds only {V - V // 2} distinct values for num_pairs={K}")
        need = 3 * K if self.simple else 4 * K
        if L < need:
            raise ValueError(f"seq_len={L} too short for num_pairs={K}: needs seq_len >= {need}")
        if not self.power_a > 0:
            raise ValueError(f"power_a must be > 0, got {self.power_a}")
        if self.train_examples is not None and (isinstance(self.train_examples, bool) or not isinstance(
                self.train_examples, int) or self.train_examples < 1):
            raise ValueError(f"train_examples: expected None or an integer >= 1, got {self.train_examples!r}")
        if self.train_examples is not None and V > 1 << 15:
            raise ValueError(f"train_examples: the fixed set is held as int16, so vocab_size must be <= 32768, got {V}")
        check_split_seeds(self)

    @property
    def num_slots(self) -> int:
        """Query slots in the gap after the context: (L − 2K) // 2."""
        return (self.seq_len - 2 * self.num_pairs) // 2


def _sample_distinct(n: int, k: int, pool: int, g: torch.Generator) -> torch.Tensor:
    """k distinct integers from [0, pool) per row, uniformly random subset in random order: [n, k].

    Floyd's algorithm, vectorised over rows and over its k steps, memory O(n·k), not O(n·pool). Step i (j = pool − k + i)
    draws t_i from [0, j] and takes t_i, or j when t_i is already taken. The k draws are k generator calls in step
    order (the same random stream as the step-by-step loop, so the same samples: tests keep that loop as the
    reference); the rest is whole-tensor work. What step i finds taken: the earlier draws t_m (each taken at its step:
    itself or, already taken, j_m) and the j_m of earlier steps whose draw was taken. j_m > every earlier draw, so t_i
    is taken iff it repeats an earlier draw, or it equals j_m (m = t_i − (pool − k) < i) of a step m whose draw was
    taken: a chain of steps, resolved by pointer jumping (at most ⌈log2 k⌉ + 1 rounds).
    """
    base = pool - k
    t = torch.stack([torch.randint(0, base + i + 1, (n,), generator=g) for i in range(k)], dim=1)  # [n, k]
    by_value = torch.sort(t, dim=1, stable=True).indices  # [n, k]: equal draws stay in step order
    st = t.gather(1, by_value)  # [n, k]
    repeat = torch.zeros(n, k, dtype=torch.bool)  # [n, k]: t_i equals an earlier draw
    repeat.scatter_(1, by_value[:, 1:], st[:, 1:] == st[:, :-1])
    step = torch.arange(k)  # [k]
    m = t - base  # [n, k]: the step whose j_m equals t_i (when 0 <= m < i)
    nxt = torch.where((m >= 0) & (m < step), m, -1)  # [n, k]
    taken = repeat
    on = nxt >= 0  # [n, k]: a link still to follow
    while on.any():  # each round doubles the links followed: at most ⌈log2 k⌉ + 1 rounds, often one or two
        at = nxt.clamp(min=0)
        taken = taken | (on & taken.gather(1, at))
        nxt = torch.where(on, nxt.gather(1, at), nxt)
        on = nxt >= 0
    out = torch.where(taken, base + step, t)  # [n, k]
    order = torch.rand(n, k, generator=g).argsort(dim=1)  # [n, k]; Floyd's order is not uniform
    return out.gather(1, order)


def slot_probs(cfg: MQARConfig) -> torch.Tensor:
    """Probability of each query slot, ∝ a·(i+1)^(a−1): [num_slots] float64."""
    a = cfg.power_a
    i = torch.arange(cfg.num_slots, dtype=torch.float64)
    p = a * (i + 1) ** (a - 1)
    return p / p.sum()


def make_mqar(cfg: MQARConfig, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n MQAR examples from one seed: inputs [n, L] int64, targets [n, L] int64 (−100 = ignored), on CPU."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= seed < 1 << 32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    V, L, K = cfg.vocab_size, cfg.seq_len, cfg.num_pairs
    g = torch.Generator().manual_seed(seed)
    half = V // 2
    keys = 1 + _sample_distinct(n, K, half - 1, g)  # [n, K] in 1 … V/2−1
    values = half + _sample_distinct(n, K, V - half, g)  # [n, K] in V/2 … V−1

    inputs = torch.zeros(n, L, dtype=torch.int64)  # [n, L]
    targets = torch.full((n, L), -100, dtype=torch.int64)  # [n, L]
    inputs[:, 0 : 2 * K : 2] = keys
    inputs[:, 1 : 2 * K : 2] = values

    order = torch.rand(n, K, generator=g).argsort(dim=1)  # [n, K]: which pair each query asks for
    q_keys, q_values = keys.gather(1, order), values.gather(1, order)  # [n, K]
    if cfg.simple:
        pos = 2 * K + torch.arange(K).expand(n, K)  # [n, K]
    else:
        p = slot_probs(cfg).float().expand(n, cfg.num_slots)  # [n, S]
        slots = torch.multinomial(p, K, replacement=False, generator=g)  # [n, K]
        pos = 2 * K + 2 * slots  # [n, K]
    inputs.scatter_(1, pos, q_keys)
    targets.scatter_(1, pos, q_values)

    if cfg.random_filler:
        filler = torch.ones(n, L, dtype=torch.bool)  # [n, L]
        filler[:, : 2 * K] = False
        filler.scatter_(1, pos, False)
        noise = torch.randint(0, V, (n, L), generator=g)  # [n, L]
        inputs = torch.where(filler, noise, inputs)
    return inputs, targets


def _mix31(x: int) -> int:
    """splitmix64 finaliser of x, reduced to 31 bits: spreads nearby seeds far apart."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % _SEED_SPAN


def check_split_seeds(cfg) -> None:
    """A task config's `train_seed` and `test_seed` are 32-bit numbers (the base seeds of `batch_seed`)."""
    for name in ("train_seed", "test_seed"):
        s = getattr(cfg, name)
        if not 0 <= s < 1 << 32:
            raise ValueError(f"{name}: expected an integer in [0, 2**32), got {s}")


def batch_seed(split: str, base_seed: int, step: int) -> int:
    """The 32-bit seed of batch `step` of `split`: top bit = split, low 31 bits = (mix(base) + step) mod 2^31."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    if not 0 <= step < _SEED_SPAN:
        raise ValueError(f"step must be in [0, 2**31), got {step}")
    return (_SPLITS[split] << 31) | ((_mix31(base_seed) + step) % _SEED_SPAN)


_BLOCK = 4096  # rows of the fixed training set made from one seed


class MQARTask:
    """MQAR as a Task: train batch `step` from (train_seed, step), val batch from (test_seed, step).

    With `train_examples` = N the training batches instead walk one fixed set of N examples: example i is row
    i mod 4096 of the block made from batch_seed("train", train_seed, i // 4096), and the stream visits the set in a
    fresh order each epoch (epoch e's order from batch_seed("train", train_seed ^ 1, e)): batch `step` holds stream
    positions step·B … step·B + B − 1, position p being example order_{p // N}[p mod N]. The set is made once, on the
    first training batch, and held as int16 (4 bytes per token with its targets).
    """

    def __init__(self, cfg: MQARConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else MQARConfig()
        c = self.cfg
        self.name = f"mqar_L{c.seq_len}_K{c.num_pairs}" + ("_simple" if c.simple else "")
        self.vocab_size = c.vocab_size
        self.seq_len = c.seq_len
        self.labels_per_row = c.num_pairs  # every example labels exactly K positions (the training loop may use it)
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None
        self._orders: dict[int, torch.Tensor] = {}

    def fixed_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed training set (train_examples = N): inputs, targets [N, L] int16."""
        n = self.cfg.train_examples
        if n is None:
            raise ValueError("fixed_set: this task has no fixed training set (train_examples is None)")
        if self._fixed is None:
            xs, ys = [], []
            for b in range(0, n, _BLOCK):
                x, y = make_mqar(self.cfg, min(_BLOCK, n - b), batch_seed("train", self.cfg.train_seed, b // _BLOCK))
                xs.append(x.to(torch.int16))
                ys.append(y.to(torch.int16))
            self._fixed = torch.cat(xs), torch.cat(ys)
        return self._fixed

    def _order(self, epoch: int, n: int) -> torch.Tensor:
        """Epoch `epoch`'s order of the fixed set's n examples (the last few epochs' orders are kept)."""
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            g = torch.Generator().manual_seed(batch_seed("train", self.cfg.train_seed ^ 1, epoch))
            self._orders[epoch] = torch.randperm(n, generator=g)
        return self._orders[epoch]

    def get_batch(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "train" and self.cfg.train_examples is not None:
            if not 0 <= step < _SEED_SPAN:
                raise ValueError(f"step must be in [0, 2**31), got {step}")
            n, (x, y) = self.cfg.train_examples, self.fixed_set()
            pos = step * batch_size + torch.arange(batch_size)  # [B] stream positions
            epochs = pos // n
            idx = torch.empty(batch_size, dtype=torch.int64)
            for e in epochs.unique().tolist():  # one epoch, or two where the batch crosses an epoch's end
                at = epochs == e
                idx[at] = self._order(e, n)[pos[at] % n]
            return x[idx].long(), y[idx].long()
        base = self.cfg.train_seed if split == "train" else self.cfg.test_seed
        return make_mqar(self.cfg, batch_size, batch_seed(split, base, step))

    def __repr__(self) -> str:
        return f"MQARTask({self.cfg})"
