"""State-tracking tasks (Grazzi et al., ICLR 2025, "negative eigenvalues"; protocol in LAB.md): parity, modular
arithmetic without brackets, S3 and S5 permutation composition, and two bounded counters (a counter mod m, the depth
of a Dyck-1 prefix of depth ≤ k). Train on short sequences, test on longer ones.

Every batch is [B, T] with T the split's longest length (40 to train, 256 to test by default). Each row draws its
own length uniformly from the split's range; positions past it hold the task's PAD token with target −100.

    task       inputs (token ids)                                   labels                        classes
    parity     bits 0/1                                             running parity, every token   2
    mod_arith  n0 o1 n1 o2 n2 … n(m−1) =   (n in 0…4; + − × = 5,6,7; label only at "=": the   5
               "=" is 8)                                            value of the whole expression
    mod_arith_prec   the same rows, × before + and −                the same, with precedence     5
    s3, s5     one permutation per token (index into the           running product, every token  6, 120
               lexicographic list of S3 / S5)
    count_mod<m>   0 stay, 1 step up, 2 step down                   the count mod m after the      m
                                                                    token, every token (from 0)
    dyck<k>    0 "(", 1 ")": a walk on depths 0…k from 0            the depth after the token,     k + 1
               (at 0 the token is "(", at k ")", else either          every token
               with probability ½)

`mod_arith` is evaluated left to right with no operator precedence, mod 5: 3 + 4 × 2 = (3 + 4) × 2 = 4 — each
operator-and-operand pair is a map of the value so far (x ↦ x + n, x − n, x·n), so the state is one of 5 values.
`mod_arith_prec` gives × precedence over + and −, as Deletang et al.'s generator does (a − b × c = a + (−b) × c;
the task Grazzi et al. report, via Beck et al.): 3 + 4 × 2 = 3 + 3 = 1; its state is the sum so far and the
product term being built. Only the final answer is labelled, as in Deletang et al. and Grazzi et al. (the model reads the expression and answers at
"="), so every row carries exactly one label (`labels_per_row = 1`). A row's length is its token count including
"=", always even (m operands → 2m tokens): train rows have 2…20 operands (lengths 4…40), test rows 20…128
(lengths 40…256).

The counters are named with their setting: `count_mod3` counts mod 3, `dyck4` keeps the depth within 0…4
(2 <= m <= 100, 1 <= k <= 100: each class is a token of the vocabulary). `count_mod<m>` is Deletang et al.'s "cycle
navigation" on a cycle of m: the group Z_m, abelian like parity (m = 2 is parity with a "stay" token) but, for m >= 3,
a rotation rather than a sign flip. `dyck<k>` is a bounded counter, not a group: every row is a valid bounded Dyck-1
prefix (never below 0, never above k), and the label is its depth, which an additive (β = 1) memory can hold as a sum
of ±1 — the question is whether a decaying or erasing one keeps it past the training lengths.

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

TASKS = ("parity", "mod_arith", "mod_arith_prec", "s3", "s5")  # the fixed tasks; the counters name a setting:
COUNTERS = {"count_mod": 2, "dyck": 1}  # family -> its setting's least value: count_mod3, dyck4 (COUNTER_MAX at most)
COUNTER_MAX = 100
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
        check_task(self.task)
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
        counter = counter_of(self.task)
        if counter is not None:
            return counter[1] + (counter[0] == "dyck")  # m counts, or depths 0…k
        return {"parity": 2, "mod_arith": MOD, "mod_arith_prec": MOD, "s3": 6, "s5": 120}[self.task]

    @property
    def pad(self) -> int:
        """The PAD token, the last id of the vocabulary (past every input token and every label)."""
        counter = counter_of(self.task)
        if counter is not None:
            return max(3 if counter[0] == "count_mod" else 2, self.classes)
        return {"parity": 2, "mod_arith": 9, "mod_arith_prec": 9, "s3": 6, "s5": 120}[self.task]

    @property
    def vocab_size(self) -> int:
        return self.pad + 1


def counter_of(task: str) -> tuple[str, int] | None:
    """The family and setting a counter task names (count_mod3 -> ("count_mod", 3), dyck4 -> ("dyck", 4)); None for
    any other name (dyck04 included: one spelling per task)."""
    for family in COUNTERS:
        rest = task[len(family):]
        if task.startswith(family) and rest.isascii() and rest.isdigit() and str(int(rest)) == rest:
            return family, int(rest)
    return None


def check_task(task: str) -> str:
    """`task` if it names a task (one of TASKS, or a counter with its setting in range); else ValueError."""
    if not isinstance(task, str):
        raise ValueError(f"task: expected a task name, got {task!r}")
    counter = counter_of(task)
    if task in TASKS or (counter is not None and COUNTERS[counter[0]] <= counter[1] <= COUNTER_MAX):
        return task
    raise ValueError(f"task: expected one of {TASKS} or count_mod<m> (m in 2..{COUNTER_MAX}) or dyck<k> (k in "
                     f"1..{COUNTER_MAX}), got {task!r}")


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
    counter = counter_of(cfg.task)
    if cfg.task == "parity":
        x = torch.randint(0, 2, (n, T), generator=g)  # [n, T]
        y = x.cumsum(1) % 2
    elif counter is not None and counter[0] == "count_mod":
        x = torch.randint(0, 3, (n, T), generator=g)  # [n, T]: stay, up, down
        y = torch.tensor([0, 1, -1])[x].cumsum(1) % counter[1]  # Python's % is never negative, nor is torch's
    elif counter is not None:
        x, y = _dyck(counter[1], n, T, g)
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


def _dyck(k: int, n: int, T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n walks of T steps on depths 0…k from 0: tokens [n, T] (0 "(", 1 ")") and the depth after each [n, T]."""
    coin = torch.randint(0, 2, (n, T), generator=g)  # [n, T]: the token where both are allowed
    x, y = torch.empty_like(coin), torch.empty_like(coin)
    depth = torch.zeros(n, dtype=torch.int64)
    for t in range(T):
        tok = torch.where(depth == 0, 0, torch.where(depth == k, 1, coin[:, t]))
        depth = depth + 1 - 2 * tok
        x[:, t], y[:, t] = tok, depth
    return x, y


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
