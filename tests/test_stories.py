"""The lesson's fade curve and twin boards (figures 7 and 8): the numbers LESSON.md pins, and the op's boards checked
against hand-computed outer products and against the sequence form of the op."""

import json
import math

import pytest
import torch

from evict import stories
from evict.ops import memory
from evict.stories import FACTS, K_CAT, QUERY, SWITCH, TOKENS, V_MOCHI, fade_curve, twin_boards


def outer(k, v, c=1.0):
    return [[c * a * b for b in v] for a in k]


def close(a, b, tol=1e-12):
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ta.shape == tb.shape and bool(torch.allclose(ta, tb, rtol=0, atol=tol))


def test_story_vectors_are_the_lessons():
    assert (stories.K_CAT, stories.V_MOCHI, stories.K_DOG, stories.V_REX, stories.V_BISCUIT) == (
        (1, 0, 0, 0), (2, 1, 0, 1), (0.6, 0.8, 0, 0), (0, 3, 1, 2), (1, 0, 2, 2))
    assert {n: t for n, (t, _, _) in FACTS.items()} == {"mochi": 2, "junk": 6, "tax": 14}
    assert (SWITCH, QUERY, TOKENS) == (12, 24, 25)
    keys = [torch.tensor(k) for _, k, _ in FACTS.values()]
    gram = torch.stack(keys) @ torch.stack(keys).T
    assert torch.allclose(gram, torch.eye(3, dtype=gram.dtype))  # unit, orthogonal: reads are survival × value


def test_fade_curve_slam_takes_mochi_and_junk_down_together():
    """Slam α = 0.2 with no other decay: both at 20 %; the tax fact, written after the switch, untouched."""
    f = fade_curve(0.2, baseline=1.0)
    assert f["survival"]["mochi"][QUERY] == pytest.approx(0.2, abs=1e-12)
    assert f["survival"]["junk"][QUERY] == pytest.approx(0.2, abs=1e-12)
    assert f["survival"]["tax"][QUERY] == pytest.approx(1.0, abs=1e-12)
    assert close(f["read_cat"], [0.2 * x for x in V_MOCHI])
    assert f["gates"][SWITCH] == pytest.approx(0.2) and f["gates"].count(1.0) == TOKENS - 1


@pytest.mark.parametrize("slam", [0.0, 0.2, 0.5, 0.9])
def test_fade_curve_survival_is_slam_times_baseline_decay(slam):
    """With a baseline decay on every token, the slam multiplies both facts written before the switch by exactly
    slam (the 20 % × baseline decay of the lesson), and each survival is the product of the gates since its write."""
    base, f = fade_curve(1.0), fade_curve(slam)
    for name in ("mochi", "junk"):
        assert f["survival"][name][QUERY] == pytest.approx(slam * base["survival"][name][QUERY], abs=1e-12)
    assert f["survival"]["tax"][QUERY] == pytest.approx(base["survival"]["tax"][QUERY], abs=1e-12)
    for name, (at, _, _) in FACTS.items():
        want = [None] * at + [math.prod(f["gates"][at + 1:t + 1]) for t in range(at, TOKENS)]
        got = f["survival"][name]
        assert got[:at] == want[:at] and close(got[at:], want[at:])


def test_fade_curve_survival_is_the_product_of_gates():
    """The lesson's 0.9 · 0.5 · 0.9 = 0.405: three gates after Mochi's write, none elsewhere."""
    gates = [1.0] * TOKENS
    gates[3:6] = [0.9, 0.5, 0.9]
    f = fade_curve(gates=gates)
    assert f["survival"]["mochi"][QUERY] == pytest.approx(0.405, abs=1e-12)
    assert close(f["read_cat"], [0.405 * x for x in V_MOCHI])
    assert f["slam"] is None and f["baseline"] is None
    assert close([c[0] for c in f["survival_per_channel"]], [math.prod(gates[:t + 1]) for t in range(TOKENS)])


def test_twin_boards_scalar_fades_mochi_with_the_junk_per_channel_keeps_it():
    t = twin_boards()
    s, p = t["scalar"], t["per_channel"]
    assert close(s["read_cat"], [0.1 * x for x in V_MOCHI])  # one knob: Mochi faded with the junk
    assert close(p["read_cat"], [0.95 * x for x in V_MOCHI])  # four knobs: Mochi ≈ 95 %
    assert s["survival"]["junk"][QUERY] == pytest.approx(0.1, abs=1e-12)
    assert p["survival"]["junk"][QUERY] == pytest.approx(0.1, abs=1e-12)  # junk ≈ 10 % on both
    assert p["survival"]["mochi"][QUERY] == pytest.approx(0.95, abs=1e-12)
    assert close(p["survival_per_channel"][QUERY], [0.95, 0.1, 0.1, 0.1])
    assert close(s["survival_per_channel"][QUERY], [0.1] * 4)
    assert p["gates"][SWITCH] == [0.95, 0.1, 0.1, 0.1] and s["gates"][SWITCH] == pytest.approx(0.1)


def test_twin_boards_every_board_by_hand():
    """Every cell at every step: the sum of each written fact's kᵀv times its channels' gates so far."""
    t = twin_boards(keep=0.9, clear=0.3, baseline=0.98)
    for board in ("scalar", "per_channel"):
        run = t[board]
        for step in range(TOKENS):
            want = torch.zeros(4, 4, dtype=torch.float64)
            for at, k, v in FACTS.values():
                if at <= step:
                    decay = torch.ones(4, dtype=torch.float64)
                    for g in run["gates"][at + 1:step + 1]:
                        decay = decay * torch.tensor(g, dtype=torch.float64)
                    want += decay[:, None] * torch.tensor(outer(k, v), dtype=torch.float64)
            assert close(run["boards"][step], want.tolist()), (board, step)


def test_boards_agree_with_the_sequence_form_of_the_op():
    """The stories step the op token by token; the whole sequence through `memory` (reference and chunked) ends on
    the same board and reads cat the same at every token."""
    run = twin_boards()["per_channel"]
    T = TOKENS
    k = torch.zeros(1, T, 1, 4, dtype=torch.float64)
    v = torch.zeros_like(k)
    for at, key, value in FACTS.values():
        k[0, at, 0], v[0, at, 0] = torch.tensor(key, dtype=torch.float64), torch.tensor(value, dtype=torch.float64)
    q = torch.tensor(K_CAT, dtype=torch.float64).expand(1, T, 1, 4)
    la = torch.tensor(run["gates"], dtype=torch.float64).log()[None, :, None]
    for impl in ("reference", "chunked"):
        o, S = memory(q, k, v, log_alpha=la, beta=torch.ones(1, T, 1, dtype=torch.float64), delta=True, scale=1.0,
                      output_final_state=True, impl=impl, chunk_size=16)
        assert close(S[0, 0].tolist(), run["boards"][-1])
        assert close(o[0, :, 0].tolist(), run["reads"]["mochi"])


def test_results_are_plain_json():
    for out in (fade_curve(), twin_boards()):
        assert json.loads(json.dumps(out)) == out


@pytest.mark.parametrize("call, name", [
    (lambda: fade_curve(1.5), "slam"), (lambda: fade_curve(float("nan")), "slam"), (lambda: fade_curve("0.2"), "slam"),
    (lambda: fade_curve(baseline=0.0), "baseline"), (lambda: fade_curve(gates=[1.0] * 3), "gates"),
    (lambda: fade_curve(gates=[1.0] * 24 + [-0.1]), "gates[24]"),
    (lambda: fade_curve(gates=[[1.0, 0.5, 1.0, 1.0]] * TOKENS), "gates"),
    (lambda: twin_boards(keep=2), "keep"), (lambda: twin_boards(clear=-1), "clear"),
    (lambda: twin_boards(baseline=True), "baseline"),
])
def test_bad_values_are_one_line_errors_naming_the_argument(call, name):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value).startswith(f"{name}") and "\n" not in str(e.value)
