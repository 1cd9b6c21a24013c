"""The context-switch task: determinism, the fixed layout, labels only at the questions and equal to the pair's
value (checked against a slow reading of each row), train/val seeds disjoint, bad configs."""

import pytest
import torch

from evict.tasks.switch import SWITCH, SwitchConfig, SwitchTask, make_switch

CFG = SwitchConfig(facts=3, distractor=5, new=4, fact_keys=6, topic_keys=11, values=7)


def test_layout_and_sizes():
    c = CFG
    assert (c.switch_at, c.questions_at, c.seq_len) == (16, 25, 32)
    assert c.vocab_size == 1 + 6 + 11 + 7
    x, y, asks = make_switch(c, 9, seed=4)
    assert x.shape == y.shape == (9, 32) and asks.shape == (9, 7)
    assert (x[:, c.switch_at] == SWITCH).all() and (x[:, :c.switch_at] != SWITCH).all()
    assert x.min() >= 0 and x.max() < c.vocab_size


def test_labels_are_the_values_of_the_questioned_keys():
    c = CFG
    x, y, asks = make_switch(c, 16, seed=11)
    fact_pool, topic_lo = range(1, 1 + c.fact_keys), 1 + c.fact_keys
    for row in range(16):
        toks = x[row].tolist()
        before, after = toks[:c.switch_at], toks[c.switch_at + 1:c.questions_at]
        facts = dict(zip(before[0:2 * c.facts:2], before[1:2 * c.facts:2]))
        distractor = dict(zip(before[2 * c.facts::2], before[2 * c.facts + 1::2]))
        new = dict(zip(after[0::2], after[1::2]))
        assert all(k in fact_pool for k in facts) and len(facts) == c.facts
        assert all(k >= topic_lo for k in [*distractor, *new]) and len({*distractor, *new}) == c.distractor + c.new
        assert all(v >= topic_lo + c.topic_keys for v in [*facts.values(), *distractor.values(), *new.values()])
        questions = toks[c.questions_at:]
        assert sorted(questions) == sorted([*facts, *new])  # every fact and new pair once, never the distractor
        assert y[row, :c.questions_at].tolist() == [-100] * c.questions_at
        answers = {**facts, **new}
        assert y[row, c.questions_at:].tolist() == [answers[q] for q in questions]
        assert asks[row].tolist() == [int(q in new) for q in questions]


def test_deterministic_and_splits_disjoint():
    t = SwitchTask(CFG)
    a, b = t.get_batch("train", 3, 8), t.get_batch("train", 3, 8)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], t.get_batch("train", 4, 8)[0])
    assert not torch.equal(a[0], t.get_batch("val", 3, 8)[0])
    assert not torch.equal(a[0], SwitchTask(SwitchConfig(**{**vars(CFG), "train_seed": 1})).get_batch("train", 3, 8)[0])
    orders = {tuple(make_switch(CFG, 1, seed=s)[2][0].tolist()) for s in range(20)}
    assert len(orders) > 1  # the questions come in a random order
    assert t.labels_per_row == 7 and t.seq_len == 32 and t.vocab_size == CFG.vocab_size


@pytest.mark.parametrize("kw, name", [
    (dict(facts=0), "facts"), (dict(new=0), "new"), (dict(distractor=-1), "distractor"),
    (dict(facts=9, fact_keys=8), "facts"), (dict(distractor=30, new=8, topic_keys=32), "topic_keys"),
    (dict(train_seed=-1), "train_seed"), (dict(values=1.5), "values"),
])
def test_bad_configs_name_the_field(kw, name):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        SwitchConfig(**kw)
