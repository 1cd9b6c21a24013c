"""The context-switch task (the lesson's eviction story, figure 8, as a training task): a few facts, a distractor
paragraph, a switch marker, a new topic, then questions about the facts and the new topic — never about the
distractor. A memory that keeps everything holds facts + distractor + new pairs, more than its d channels; one
that clears the distractor at the switch must not clear the facts with it.

Every row has the same layout (F facts, J distractor pairs, N new pairs; the positions are fixed, the tokens are not):

    section      tokens                                           keys drawn from     values
    facts        f1 a1 f2 a2 … fF aF                              fact keys           values
    distractor   g1 b1 … gJ bJ                                    topic keys          values
    switch       SWITCH (token 0)
    new topic    h1 c1 … hN cN                                    topic keys          values
    questions    F + N keys, every fact and every new pair once, in a random order; each labelled with its value

Keys are distinct within a row (the distractor's and the new topic's keys never repeat, so the new topic does not
overwrite the distractor: it must be evicted or it interferes); values are drawn with replacement. Targets are −100
everywhere but at the question positions (next-token prediction: the model reads the key and predicts its value).

Worked example, F = 1, J = 2, N = 1 (fact keys 1…2, topic keys 3…6, values 7…10; vocab 11):

    position   0   1   2   3   4   5   6   7   8   9  10
    inputs     2   8   5   9   3   7   0   6  10   6   2
    targets −100 −100 −100 −100 −100 −100 −100 −100 −100  10   8

Seeds as in MQAR (evict/tasks/mqar.py): batch `step` of a split has a 32-bit seed whose top bit is the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mqar import _sample_distinct, batch_seed, check_split_seeds

SWITCH = 0


@dataclass
class SwitchConfig:
    facts: int = 2  # F
    distractor: int = 8  # J
    new: int = 8  # N
    fact_keys: int = 8  # the fact keys' pool (the story's "cat"s), tokens 1 … fact_keys
    topic_keys: int = 32  # the distractor's and new topic's pool
    values: int = 32
    train_seed: int = 0
    test_seed: int = 1_000_003

    def __post_init__(self) -> None:
        for name in ("facts", "new", "fact_keys", "topic_keys", "values"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        if type(self.distractor) is not int or self.distractor < 0:
            raise ValueError(f"distractor: expected an integer >= 0, got {self.distractor!r}")
        if self.facts > self.fact_keys:
            raise ValueError(f"facts: {self.facts} distinct fact keys do not fit in fact_keys={self.fact_keys}")
        if self.distractor + self.new > self.topic_keys:
            raise ValueError(f"topic_keys: expected >= distractor + new = {self.distractor + self.new} (keys are "
                             f"distinct within a row), got {self.topic_keys}")
        check_split_seeds(self)

    @property
    def vocab_size(self) -> int:
        return 1 + self.fact_keys + self.topic_keys + self.values

    @property
    def switch_at(self) -> int:
        """Position of the SWITCH token."""
        return 2 * (self.facts + self.distractor)

    @property
    def questions_at(self) -> int:
        """Position of the first question."""
        return self.switch_at + 1 + 2 * self.new

    @property
    def seq_len(self) -> int:
        return self.questions_at + self.facts + self.new


def make_switch(cfg: SwitchConfig, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n rows from one seed: inputs [n, L], targets [n, L] (−100 = ignored) and, for every question, which section
    it asks about, asks [n, F + N] (0 = a fact, 1 = the new topic), in question order. All int64, on CPU."""
    if n < 1:
        raise ValueError(f"n: expected >= 1, got {n}")
    F, J, N = cfg.facts, cfg.distractor, cfg.new
    g = torch.Generator().manual_seed(seed)
    fkeys = 1 + _sample_distinct(n, F, cfg.fact_keys, g)  # [n, F]
    tkeys = 1 + cfg.fact_keys + _sample_distinct(n, J + N, cfg.topic_keys, g)  # [n, J + N]
    vals = 1 + cfg.fact_keys + cfg.topic_keys + torch.randint(0, cfg.values, (n, F + J + N), generator=g)
    keys = torch.cat([fkeys, tkeys], dim=1)  # [n, F + J + N] in writing order
    pairs = torch.stack([keys, vals], dim=2).flatten(1)  # [n, 2(F + J + N)]: k v k v …
    s = cfg.switch_at
    inputs = torch.empty(n, cfg.seq_len, dtype=torch.int64)
    inputs[:, :s] = pairs[:, :s]
    inputs[:, s] = SWITCH
    inputs[:, s + 1:cfg.questions_at] = pairs[:, s:]
    asked = torch.cat([torch.arange(F), torch.arange(F + J, F + J + N)]).expand(n, F + N)  # the pairs questioned
    order = torch.rand(n, F + N, generator=g).argsort(dim=1)
    asked = asked.gather(1, order)  # [n, F + N]
    inputs[:, cfg.questions_at:] = keys.gather(1, asked)
    targets = torch.full((n, cfg.seq_len), -100, dtype=torch.int64)
    targets[:, cfg.questions_at:] = vals.gather(1, asked)
    return inputs, targets, (asked >= F).long()


class SwitchTask:
    """The context-switch task as a Task: train batch `step` from (train_seed, step), val from (test_seed, step)."""

    def __init__(self, cfg: SwitchConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else SwitchConfig()
        c = self.cfg
        self.name = f"switch_F{c.facts}_J{c.distractor}_N{c.new}"
        self.vocab_size = c.vocab_size
        self.seq_len = c.seq_len
        self.labels_per_row = c.facts + c.new

    def batch(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """get_batch's inputs and targets, and which section each question asks about (make_switch's `asks`)."""
        base = self.cfg.train_seed if split == "train" else self.cfg.test_seed
        return make_switch(self.cfg, batch_size, batch_seed(split, base, step))

    def get_batch(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(split, step, batch_size)[:2]
