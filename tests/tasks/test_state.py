"""State-tracking generators: determinism, labels against slow Python references, padding, lengths, seeds."""

import itertools

import pytest
import torch

from evict.tasks.mqar import batch_seed
from evict.tasks.state import (ARITH, EQUALS, MINUS, PLUS, TASKS, TIMES, StateConfig, StateTask, check_task, compose_table,
                               counter_of, make_state, scaled_accuracy)

COUNTER_TASKS = ("count_mod2", "count_mod3", "count_mod5", "dyck1", "dyck4")


def _rows(x, y, pad):
    """Each row's unpadded inputs and targets as Python lists."""
    for xr, yr in zip(x.tolist(), y.tolist()):
        n = next((i for i, t in enumerate(xr) if t == pad), len(xr))
        assert all(t == pad for t in xr[n:]), "padding only at the end"
        assert all(t == -100 for t in yr[n:]), "no labels on padding"
        yield xr[:n], yr[:n], yr


def _perm_reference(n, tokens):
    """Running product, composing the permutations as functions in reading order: i -> x_t(...x_1(i))."""
    perms = list(itertools.permutations(range(n)))
    cur, out = tuple(range(n)), []
    for t in tokens:
        cur = tuple(perms[t][cur[i]] for i in range(n))
        out.append(perms.index(cur))
    return out


def _arith_reference(tokens):
    """Left to right, no precedence, mod 5: tokens n0 o1 n1 … n(m-1) '='."""
    assert tokens[-1] == EQUALS and len(tokens) % 2 == 0
    value = tokens[0]
    for op, num in zip(tokens[1:-1:2], tokens[2:-1:2]):
        value = {PLUS: value + num, MINUS: value - num, TIMES: value * num}[op] % 5
    return value


def _precedence_reference(tokens):
    """× before + and −, mod 5: the expression as Python source, evaluated by Python (whose % is never negative)."""
    assert tokens[-1] == EQUALS and len(tokens) % 2 == 0
    return eval("".join({PLUS: "+", MINUS: "-", TIMES: "*"}.get(t, str(t)) if i % 2 else str(t)
                        for i, t in enumerate(tokens[:-1]))) % 5


def _count_mod_reference(m, tokens):
    """One state, one Python int: 0 stays, 1 adds one, 2 takes one away, mod m."""
    count, out = 0, []
    for t in tokens:
        count = (count + {0: 0, 1: 1, 2: m - 1}[t]) % m
        out.append(count)
    return out


def _dyck_reference(k, tokens):
    """The depth after each bracket of a string of "(" (0) and ")" (1); None once the string leaves 0…k."""
    text = "".join("()"[t] for t in tokens)
    depths = [text[: i + 1].count("(") - text[: i + 1].count(")") for i in range(len(text))]
    return None if any(d < 0 or d > k for d in depths) else depths


@pytest.mark.parametrize("task", COUNTER_TASKS)
def test_counter_labels_match_slow_reference(task):
    family, n = counter_of(task)
    cfg = StateConfig(task=task)
    x, y = make_state(cfg, 16, seed=77, lengths=(3, 64))
    seen = set()
    for xs, ys, _ in _rows(x, y, cfg.pad):
        if family == "count_mod":
            assert set(xs) <= {0, 1, 2} and ys == _count_mod_reference(n, xs)
        else:
            assert set(xs) <= {0, 1} and ys == _dyck_reference(n, xs)  # a valid bounded prefix, its depths
        seen |= set(ys)
    assert seen == set(range(cfg.classes)), "every count / depth occurs in 16 rows of up to 64 tokens"
    assert cfg.classes == (n if family == "count_mod" else n + 1) and cfg.pad >= cfg.classes and cfg.pad > x[x != cfg.pad].max()


def test_counter_names_and_settings():
    assert counter_of("count_mod3") == ("count_mod", 3) and counter_of("dyck12") == ("dyck", 12)
    assert counter_of("parity") is None and counter_of("dyck04") is None and counter_of("dyck") is None
    assert check_task("dyck100") == "dyck100" and check_task("count_mod2") == "count_mod2"
    for bad in ("count_mod1", "count_mod101", "dyck0", "dyck04", "dyck-1", "dyck١", "count_mod", "s4", 3):
        with pytest.raises(ValueError, match=r"^task: expected .* got"):
            check_task(bad)  # type: ignore[arg-type]
    # count_mod2 is parity with a "stay" token (up and down are both a flip): the parity of the moves so far
    x, y = make_state(StateConfig(task="count_mod2"), 4, seed=3, lengths=(40, 40))
    assert torch.equal((x != 0).long().cumsum(1) % 2, y)


@pytest.mark.parametrize("task", TASKS)
def test_labels_match_slow_reference(task):
    cfg = StateConfig(task=task)
    x, y = make_state(cfg, 6, seed=123, lengths=(3, 40))
    for xs, ys, _ in _rows(x, y, cfg.pad):
        assert 3 <= len(xs) <= 40
        if task == "parity":
            assert ys == [sum(xs[: i + 1]) % 2 for i in range(len(xs))]
        elif task in ARITH:
            want = (_arith_reference if task == "mod_arith" else _precedence_reference)(xs)
            assert ys[:-1] == [-100] * (len(xs) - 1) and ys[-1] == want
            assert all(0 <= t < 5 for t in xs[0:-1:2]) and all(t in (PLUS, MINUS, TIMES) for t in xs[1:-1:2])
        else:
            assert ys == _perm_reference(3 if task == "s3" else 5, xs)


def test_compose_table_is_composition_and_a_group():
    for n in (3, 5):
        table = compose_table(n)
        N = table.shape[0]
        assert sorted(table[0].tolist()) == list(range(N)) and table[0].tolist() == list(range(N))  # index 0 = identity
        assert all(sorted(row) == list(range(N)) for row in table.tolist())  # Latin square
    assert compose_table(3)[1, 2].item() == _perm_reference(3, [1, 2])[-1]


def test_arith_is_left_to_right_and_prec_multiplies_first():
    # 3 + 4 × 2 = (3 + 4) × 2 = 14 = 4 mod 5 left to right; with × first 3 + 8 = 11 = 1
    assert _arith_reference([3, PLUS, 4, TIMES, 2, EQUALS]) == 4
    assert _precedence_reference([3, PLUS, 4, TIMES, 2, EQUALS]) == 1
    assert _precedence_reference([1, MINUS, 2, TIMES, 3, PLUS, 4, EQUALS]) == (1 - 6 + 4) % 5
    # the two tasks share their rows (same seed, same tokens); with one operator the labels agree, with more they differ
    for lengths, agree in (((4, 4), lambda r: r == 1), ((20, 40), lambda r: r < 0.5)):
        x, a = make_state(StateConfig(task="mod_arith"), 256, seed=9, lengths=lengths)
        x2, b = make_state(StateConfig(task="mod_arith_prec"), 256, seed=9, lengths=lengths)
        assert torch.equal(x, x2) and agree((a == b)[a != -100].float().mean().item())


@pytest.mark.parametrize("task", TASKS + COUNTER_TASKS)
def test_deterministic_split_lengths_and_shapes(task):
    t = StateTask(StateConfig(task=task))
    a, b = t.get_batch("train", 7, 32), t.get_batch("train", 7, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], t.get_batch("train", 8, 32)[0])
    xt, yt = a
    xv, yv = t.get_batch("val", 7, 32)
    assert xt.shape == (32, 40) and xv.shape == (32, 256) and t.seq_len == 256
    assert xt.dtype == yt.dtype == torch.int64
    lt = (xt != t.cfg.pad).sum(1)
    lv = (xv != t.cfg.pad).sum(1)
    assert lt.min() >= 3 and lt.max() <= 40 and lv.min() >= 40 and lv.max() <= 256
    assert lv.float().std() > 0, "lengths vary within a batch"
    assert xt.max() < t.vocab_size and yt.max() < t.cfg.classes and xv.max() < t.vocab_size
    labelled = (yv != -100).sum(1)
    if task in ARITH:
        assert (labelled == 1).all() and t.labels_per_row == 1
        assert (lt % 2 == 0).all() and lt.min() >= 4
    else:
        assert torch.equal(labelled, lv) and not hasattr(t, "labels_per_row")


def test_train_and_test_seeds_disjoint():
    # the split is the seed's top bit, so no train batch seed equals a test batch seed, whatever the base seeds
    train = {batch_seed("train", 5, s) for s in range(2000)}
    test = {batch_seed("val", 5, s) for s in range(2000)}
    assert not train & test
    t = StateTask(StateConfig(task="parity", train_seed=5, test_seed=5, test_lengths=(3, 40)))
    assert not torch.equal(t.get_batch("train", 0, 16)[0], t.get_batch("val", 0, 16)[0])


def test_bad_configs_and_scaled_accuracy():
    with pytest.raises(ValueError, match="task"):
        StateConfig(task="s4")
    with pytest.raises(ValueError, match="train_lengths"):
        StateConfig(train_lengths=(10, 5))
    for task in ARITH:
        with pytest.raises(ValueError, match=f"train_lengths: {task} rows"):
            StateConfig(task=task, train_lengths=(5, 5))
    assert scaled_accuracy(0.5, 2) == 0.0 and scaled_accuracy(1.0, 120) == 1.0 and abs(scaled_accuracy(0.6, 5) - 0.5) < 1e-12
