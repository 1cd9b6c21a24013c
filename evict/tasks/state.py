"""State-tracking tasks (Grazzi et al., ICLR 2025, "negative eigenvalues"; protocol in LAB.md): parity, modular
arithmetic without brackets, S3 and S5 permutation composition. Train on short sequences, test on longer ones.

Every batch is [B, T] with T the split's longest length (40 to train, 256 to test by default). Each row draws its
own length uniformly from the split's range; positions past it hold the task's PAD token with target −100.

    task       inputs (token ids)                                   labels                        classes
    parity     bits 0/1                                             running parity, every token   2
    mod_arith  n0 o1 n1 o2 n2 … n(m−1) =   (n in 0…4; + − × = 5,6,7; label only at "=": the   5
               "=" is 8)                                            value of the whole expression
    mod_arith_prec   the same rows, × before + and −                the same, with precedence     5
    s3, s5     one permutation per token (index into the           running product, every token  6, 120
               lexicographic list of S3 / S5)

`mod_arith` is evaluated left to right with no operator precedence, mod 5: 3 + 4 × 2 = (3 + 4) × 2 = 4 — each
operator-and-operand pair is a map of the value so far (x ↦ x + n, x − n, x·n), so the state is one of 5 values.
`mod_arith_prec` gives × precedence over + and −, as Deletang et al.'s generator does (a − b × c = a + (−b) × c;
the task Grazzi et al. report, via Beck et al.): 3 + 4 × 2 = 3 + 3 = 1; its state is the sum so far and the
product term being built. Only the final answer is labelled, as in Deletang et al. and Grazzi et al. (the model reads the expression and answers at
"="), so every row carries exactly one label (`labels_per_row = 1`). A row's length is its token count including
"=", always even (m operands → 2m tokens): train rows have 2…20 operands (lengths 4…40), test rows 20…128
(lengths 40…256).

Permutations compose as functions applied in reading order: the running product after tokens x1 … xt is the
permutation i ↦ xt(…x2(x1(i))), so P_t = x_t ∘ P_{t−1}; the label at t is P_t's index.

Scaled accuracy (Grazzi et al., after Beck et al.'s xLSTM paper): (accuracy − chance) / (1 − chance) with chance
= 1 / classes, so guessing scores 0 and a perfect model 1 (it can go below 0: the model's argmax ranges over the
whole vocabulary, PAD included).

Seeds as in MQAR (evict/tasks/mqar.py): batch `step` of a split uses a 32-bit seed whose top bit is the split, so
train and test never share a seed. Generation is vectorised over rows; only the scans (permutation products,
left-to-right arithmetic) loop over positions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .mqar import batch_seed, check_split_seeds

TASKS = ("parity", "mod_arith", "mod_arith_prec", "s3", "s5")
ARITH = ("mod_arith", "mod_arith_prec")  # the tasks of expressions answered at "="
MOD = 5
PLUS, MINUS, TIMES, EQUALS = 5, 6, 7, 8  # the arithmetic tasks' operator and "=" tokens


@dataclass
class StateConfig:
    """One state-tracking task; lengths are inclusive ranges of tokens per row."""

    task: str = "parity"
    train_lengths: tuple[int, int] = (3, 40)
    test_lengths: tuple[int, int] = (40, 256)
    train_seed: int = 0
    test_seed: int = 1_000_003

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: expected one of {TASKS}, got {self.task!r}")
        for name in ("train_lengths", "test_lengths"):
            lo, hi = getattr(self, name)
            if not (type(lo) is int and type(hi) is int and 1 <= lo <= hi):
                raise ValueError(f"{name}: expected two integers 1 <= lo <= hi, got {(lo, hi)!r}")
            if self.task in ARITH and 2 * max(2, (lo + 1) // 2) > hi:
                raise ValueError(f"{name}: {self.task} rows have an even length >= 4 (two operands and '='); "
                                 f"{(lo, hi)!r} holds none")
            setattr(self, name, (lo, hi))
        check_split_seeds(self)

    @property
    def classes(self) -> int:
        """Number of possible answers: chance accuracy is 1 / classes."""
        return {"parity": 2, "mod_arith": MOD, "mod_arith_prec": MOD, "s3": 6, "s5": 120}[self.task]

    @property
    def pad(self) -> int:
        """The PAD token, the last id of the vocabulary."""
        return {"parity": 2, "mod_arith": 9, "mod_arith_prec": 9, "s3": 6, "s5": 120}[self.task]

    @property
    def vocab_size(self) -> int:
        return self.pad + 1


def permutations(n: int) -> torch.Tensor:
    """Every permutation of 0…n−1 in lexicographic order: [n!, n] int64."""
    return torch.tensor(list(itertools.permutations(range(n))), dtype=torch.int64)


def compose_table(n: int) -> torch.Tensor:
    """[n!, n!] int64: table[a, b] = index of b ∘ a (apply a, then b), i.e. the map i ↦ b[a[i]]."""
    perms = permutations(n)  # [N, n]
    N = perms.shape[0]
    composed = perms[None, :, :].expand(N, N, n).gather(2, perms[:, None, :].expand(N, N, n))  # [a, b, i] = b[a[i]]
    weights = n ** torch.arange(n - 1, -1, -1)  # a permutation's base-n code, monotone in lexicographic order
    code = (composed * weights).sum(-1)  # [N, N]
    sorted_codes = (perms * weights).sum(-1)  # [N], ascending
    return torch.searchsorted(sorted_codes, code)


def _lengths(n: int, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(lo, hi + 1, (n,), generator=g)  # [n]


def make_state(cfg: StateConfig, n: int, seed: int, lengths: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows from one seed, each of a length drawn from `lengths`: inputs, targets [n, T] int64 (T = lengths[1])."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= seed < 1 << 32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    if cfg.task in ARITH:
        return _mod_arith(cfg, n, lo, hi, g)
    T = hi
    length = _lengths(n, lo, hi, g)  # [n]
    valid = torch.arange(T)[None, :] < length[:, None]  # [n, T]
    if cfg.task == "parity":
        x = torch.randint(0, 2, (n, T), generator=g)  # [n, T]
        y = x.cumsum(1) % 2
    else:
        table = compose_table(3 if cfg.task == "s3" else 5)  # [N, N]
        x = torch.randint(0, table.shape[0], (n, T), generator=g)  # [n, T]
        y = torch.empty_like(x)
        y[:, 0] = x[:, 0]
        for t in range(1, T):
            y[:, t] = table[y[:, t - 1], x[:, t]]
    inputs = torch.where(valid, x, torch.full_like(x, cfg.pad))
    targets = torch.where(valid, y, torch.full_like(y, -100))
    return inputs, targets


def _mod_arith(cfg: StateConfig, n: int, lo: int, hi: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows n0 o1 n1 … n(m−1) "=" with m operands, 2m tokens, lo <= 2m <= hi; the label at "=" is the value (left to
    right, or with × first for mod_arith_prec)."""
    M = hi // 2  # most operands
    m = torch.randint(max(2, (lo + 1) // 2), M + 1, (n,), generator=g)  # [n] operands per row
    nums = torch.randint(0, MOD, (n, M), generator=g)  # [n, M]
    ops = torch.randint(0, 3, (n, M), generator=g)  # [n, M]; ops[:, j] joins operand j to the value so far (j >= 1)
    value = torch.empty_like(nums)  # [n, M]: value of the expression's first j+1 operands
    value[:, 0] = nums[:, 0]
    if cfg.task == "mod_arith":  # left to right
        for j in range(1, M):
            a, b, o = value[:, j - 1], nums[:, j], ops[:, j]
            value[:, j] = torch.where(o == 0, a + b, torch.where(o == 1, a - b, a * b)) % MOD
    else:  # × first: the sum of the closed terms, and the term being multiplied (signed: a − b × c = a + (−b) × c)
        total, term = torch.zeros_like(nums[:, 0]), nums[:, 0]
        for j in range(1, M):
            b, o = nums[:, j], ops[:, j]
            total = torch.where(o == 2, total, (total + term) % MOD)
            term = torch.where(o == 0, b, torch.where(o == 1, (MOD - b) % MOD, (term * b) % MOD))
            value[:, j] = (total + term) % MOD
    T = 2 * M
    inputs = torch.full((n, T), cfg.pad, dtype=torch.int64)  # [n, T]
    inputs[:, 0::2] = nums
    inputs[:, 1::2] = PLUS + ops.roll(-1, dims=1)  # position 2j+1 holds the operator before operand j+1
    pos = torch.arange(T)[None, :]
    end = 2 * m[:, None] - 1  # [n, 1]: position of "="
    inputs = torch.where(pos == end, torch.full_like(inputs, EQUALS), inputs)
    inputs = torch.where(pos > end, torch.full_like(inputs, cfg.pad), inputs)
    targets = torch.full((n, T), -100, dtype=torch.int64)
    targets.scatter_(1, end, value.gather(1, m[:, None] - 1))
    return inputs, targets


def scaled_accuracy(accuracy: float, classes: int) -> float:
    """(accuracy − 1/classes) / (1 − 1/classes): chance → 0, perfect → 1."""
    chance = 1.0 / classes
    return (accuracy - chance) / (1.0 - chance)


class StateTask:
    """A state-tracking task as a Task: "train" batches at train lengths from train_seed, "val" at test lengths."""

    def __init__(self, cfg: StateConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else StateConfig()
        c = self.cfg
        self.name = c.task
        self.vocab_size = c.vocab_size
        self.seq_len = max(c.train_lengths[1], c.test_lengths[1])
        if c.task in ARITH:
            self.labels_per_row = 1  # exactly one label, at "="

    def get_batch(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        base, lengths = (c.train_seed, c.train_lengths) if split == "train" else (c.test_seed, c.test_lengths)
        return make_state(c, batch_size, batch_seed(split, base, step), lengths)

    def __repr__(self) -> str:
        return f"StateTask({self.cfg})"
