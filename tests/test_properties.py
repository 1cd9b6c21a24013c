"""Property tests (hypothesis), few examples each, derandomized so the suite is reproducible:

- the memory op: random valid small shapes, float32 / float64, gates from 0 down to float32's most negative value
  (hard resets, on consecutive tokens too) -> finite, and equal to the float64 token loop, in every form;
- configs: random valid small configs build, run, and prefill + decode equals the full forward; random invalid
  values of a field raise one ValueError naming that field;
- the CLI: each subcommand given a bad flag value exits with code 2, one line on stderr, no traceback, nothing written.
"""

import contextlib
import io
import os
import string
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from evict import LM, ModelConfig  # noqa: E402
from evict.cli import main  # noqa: E402
from evict.ops import memory, memory_step  # noqa: E402
from evict.ops.memory.reference import memory_reference  # noqa: E402
from tests.conftest import rel  # noqa: E402
from tests.tasks.test_mqar import same_as_step_by_step  # noqa: E402

FAST = settings(max_examples=100, deadline=None, derandomize=True, database=None,  # ~10 ms an example, one thread
                suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the memory op ---------------------------------------------------------------------------------------------

GATE_VALUES = (0.0, -1e-4, -0.05, -0.7, -5.0, -20.0, -200.0, -1e30, torch.finfo(torch.float32).min)


@FAST
@given(B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), K=st.integers(2, 8), V=st.integers(1, 8),
       gate=st.sampled_from(["none", "scalar", "channel"]), delta=st.booleans(), has_beta=st.booleans(),
       init=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]), chunk=st.sampled_from([16, 32]),
       palette=st.lists(st.sampled_from(GATE_VALUES), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_op_is_finite_and_equals_the_reference(B, T, H, K, V, gate, delta, has_beta, init, dtype, chunk, palette, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    la = None
    if gate != "none":
        shape = (B, T, H) if gate == "scalar" else (B, T, H, K)
        pick = torch.randint(0, len(palette), shape, generator=g)
        la = torch.tensor(palette, dtype=torch.float64)[pick]  # every entry one of the palette's gate values
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64) if has_beta else None
    S0 = r(B, H, K, V) if init else None
    cast = lambda x: None if x is None else x.to(dtype)
    x = dict(q=cast(q), k=cast(k), v=cast(v), log_alpha=cast(la), beta=cast(beta),
             initial_state=None if S0 is None else S0.to(torch.float64 if dtype == torch.float64 else torch.float32))
    wide = {n: None if t is None else t.double() for n, t in x.items()}  # the same rounded inputs, in float64
    o_ref, s_ref = memory_reference(wide["q"], wide["k"], wide["v"], log_alpha=wide["log_alpha"], beta=wide["beta"],
                                    delta=delta, scale=K ** -0.5, initial_state=wide["initial_state"])
    assert torch.isfinite(o_ref).all() and torch.isfinite(s_ref).all()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for impl in ("reference", "chunked"):
        o, s = memory(x["q"], x["k"], x["v"], log_alpha=x["log_alpha"], beta=x["beta"], delta=delta,
                      initial_state=x["initial_state"], output_final_state=True, impl=impl, chunk_size=chunk)
        assert torch.isfinite(o).all() and torch.isfinite(s).all(), impl
        assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol, (impl, rel(o, o_ref), rel(s, s_ref))
    S = x["initial_state"] if init else torch.zeros(B, H, K, V, dtype=s_ref.dtype if dtype == torch.float64 else torch.float32)
    outs = []
    for t in range(T):
        at = lambda n: None if x[n] is None else x[n][:, t]
        o, S = memory_step(at("q"), at("k"), at("v"), S, log_alpha=at("log_alpha"), beta=at("beta"), delta=delta)
        outs.append(o)
    o = torch.stack(outs, 1)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel(o, o_ref) <= tol and rel(S, s_ref) <= tol, ("step", rel(o, o_ref), rel(S, s_ref))


@settings(FAST, max_examples=40)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4), H=st.integers(1, 2), K=st.integers(2, 8),
       V=st.integers(1, 8), gate=st.sampled_from(["none", "scalar", "channel"]), delta=st.booleans(),
       init=st.booleans(), chunk=st.sampled_from([8, 16]),
       palette=st.lists(st.sampled_from(GATE_VALUES), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_packed_sequences_equal_each_sequence_alone(lengths, H, K, V, gate, delta, init, chunk, palette, seed):
    """cu_seqlens: random lengths (empty ones too) packed in a batch of one give, sequence by sequence, the float64
    token loop run on that sequence alone from its own initial state (outputs and final states, both forms)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    T, N = offsets[-1], len(lengths)
    q, k, v = r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, H, V)
    la = None
    if gate != "none":
        shape = (1, T, H) if gate == "scalar" else (1, T, H, K)
        la = torch.tensor(palette, dtype=torch.float64)[torch.randint(0, len(palette), shape, generator=g)]
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    S0 = r(N, H, K, V) if init else None
    for impl in ("reference", "chunked"):
        o, s = memory(q, k, v, log_alpha=la, beta=beta, delta=delta, initial_state=S0, output_final_state=True,
                      cu_seqlens=torch.tensor(offsets), impl=impl, chunk_size=chunk)
        assert o.shape == (1, T, H, V) and s.shape == (N, H, K, V)
        for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            cut = lambda x: None if x is None else x[:, a:b]  # noqa: E731
            o_ref, s_ref = memory_reference(cut(q), cut(k), cut(v), log_alpha=cut(la), beta=cut(beta), delta=delta,
                                            scale=K ** -0.5, initial_state=None if S0 is None else S0[n:n + 1])
            assert rel(o[:, a:b], o_ref) <= 1e-10 and rel(s[n:n + 1], s_ref) <= 1e-10, (impl, n)


# -- configs ---------------------------------------------------------------------------------------------------

@st.composite
def valid_configs(draw):
    n_layers = draw(st.integers(1, 3))
    n_heads = draw(st.sampled_from([1, 2]))
    moe = None
    if draw(st.booleans()):
        n_routed = draw(st.integers(2, 4))
        moe = dict(n_routed=n_routed, top_k=draw(st.integers(1, n_routed)), d_expert=draw(st.sampled_from([8, 16])),
                   n_shared=draw(st.integers(0, 1)), latent_dim=draw(st.sampled_from([None, 8])),
                   first_dense=draw(st.integers(0, n_layers)))
    return ModelConfig(
        vocab_size=draw(st.integers(8, 64)), d_model=draw(st.sampled_from([16, 32])), n_layers=n_layers,
        pattern=draw(st.text(alphabet="ALDGKCM", min_size=1, max_size=4)),
        final_mixer=draw(st.sampled_from([None, *"ALDGKCM"])), n_heads=n_heads, head_dim=draw(st.sampled_from([8, 16])),
        n_kv_heads=draw(st.sampled_from([None, 1])), pos=draw(st.sampled_from(["rope", "learned", "none"])),
        bias=draw(st.booleans()), short_conv=draw(st.booleans()), conv_size=draw(st.integers(2, 4)),
        gate_form=draw(st.sampled_from(["softplus", "bounded"])), neg_eigval=draw(st.booleans()),
        out_gate_rank=draw(st.sampled_from([None, 0, 4])), chunk_size=16, q_lora_rank=draw(st.sampled_from([None, 8])),
        kv_lora_rank=draw(st.sampled_from([8, 16])), qk_nope_dim=draw(st.sampled_from([4, 8])),
        qk_rope_dim=draw(st.sampled_from([0, 2, 4])), v_head_dim=draw(st.sampled_from([4, 8])),
        mla_rope=draw(st.booleans()), mla_gate=draw(st.booleans()), ffn=draw(st.sampled_from(["gelu", "swiglu", "situ"])),
        d_ff=draw(st.sampled_from([None, 24])), moe=moe, attn_res=draw(st.booleans()),
        attn_res_block=draw(st.integers(1, 2)), tie_embeddings=draw(st.booleans()),
    )


@FAST
@given(cfg=valid_configs(), T=st.integers(2, 20), cut=st.integers(1, 19), seed=st.integers(0, 2**16))
def test_valid_configs_build_run_and_decode_like_the_full_forward(cfg, T, cut, seed):
    torch.manual_seed(seed)
    m = LM(cfg).double()
    tok = torch.randint(0, cfg.vocab_size, (2, T))
    full = m(tok)
    assert torch.isfinite(full).all()
    cut = min(cut, T - 1)
    cache = m.new_cache(2, T)
    parts = [m(tok[:, :cut], cache=cache)] + [m(tok[:, t : t + 1], cache=cache) for t in range(cut, T)]
    assert rel(torch.cat(parts, 1), full) <= 1e-10


def _not_positive_int():
    return st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none())


def _not_positive_real():
    return st.one_of(st.floats(max_value=0.0), st.just(float("nan")), st.just(float("inf")), st.booleans(),
                     st.text(max_size=3), st.none())


INVALID = st.one_of(
    *(st.tuples(st.just(f), _not_positive_int()) for f in
      ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "kv_lora_rank", "qk_nope_dim", "v_head_dim",
       "attn_res_block")),
    *(st.tuples(st.just(f), st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=2)))
      for f in ("head_dim", "n_kv_heads", "q_lora_rank", "d_ff")),
    st.tuples(st.just("conv_size"), st.one_of(st.integers(max_value=1), st.floats(), st.text(max_size=2))),
    *(st.tuples(st.just(f), _not_positive_real()) for f in ("rope_theta", "norm_eps")),
    st.tuples(st.just("init_std"), st.one_of(st.floats(max_value=-1e-9), st.just(float("nan")), st.text(max_size=2))),
    *(st.tuples(st.just(f), st.one_of(st.integers(), st.text(max_size=3), st.none())) for f in
      ("bias", "short_conv", "neg_eigval", "mla_rope", "mla_gate", "attn_res", "tie_embeddings")),
    st.tuples(st.just("chunk_size"), st.one_of(st.integers().filter(lambda v: v not in (16, 32, 64, 128)),
                                               st.sampled_from([16.0, 32.0, True]))),
    st.tuples(st.just("pos"), st.text(max_size=6).filter(lambda s: s not in ("rope", "learned", "none"))),
    st.tuples(st.just("ffn"), st.text(max_size=6).filter(lambda s: s not in ("gelu", "swiglu", "situ"))),
    st.tuples(st.just("pattern"), st.text(min_size=1, max_size=4).filter(lambda s: any(c not in "ALDGKCM" for c in s))),
)


@FAST
@given(bad=INVALID)
def test_invalid_config_values_raise_naming_the_field(bad):
    field, value = bad
    with pytest.raises(ValueError) as e:
        ModelConfig(**{field: value})
    assert str(e.value).startswith(f"{field}:") and "\n" not in str(e.value)


# -- the CLI ---------------------------------------------------------------------------------------------------

def _bad_int():
    return st.one_of(st.integers(-10**6, 0).map(str), st.text(alphabet=string.ascii_letters, min_size=1, max_size=4),
                     st.floats(0.1, 100).filter(lambda v: v != int(v)).map(str), st.sampled_from(["", "1e3", "nan"]))


def _bad_positive_float():
    return st.one_of(st.floats(max_value=0.0, allow_nan=False).map(str), st.sampled_from(["nan", "inf", "-inf", "", "x"]),
                     st.text(alphabet=string.ascii_letters, min_size=1, max_size=4).filter(
                         lambda s: s.lower() not in ("inf", "nan", "infinity")))


BAD_FLAGS = st.one_of(
    *(st.tuples(st.just(["train"] + extra), st.just(f), _bad_int()) for f, extra in
      (("--seq-len", []), ("--steps", []), ("--batch-size", []), ("--eval-every", []), ("--eval-batches", []),
       ("--threads", []), ("--pairs", ["--task", "mqar"]), ("--vocab", ["--task", "mqar"]), ("--bpe-vocab", []))),
    st.tuples(st.just(["train"]), st.just("--lr"), _bad_positive_float()),
    *(st.tuples(st.just(["recall"]), st.just(f), _bad_int()) for f in ("--steps", "--workers", "--vocab", "--d-model")),
    st.tuples(st.just(["recall"]), st.just("--lr"), _bad_positive_float()),
    *(st.tuples(st.just(["size", "gpt2"]), st.just(f), _bad_int()) for f in ("--context", "--bytes")),
    *(st.tuples(st.just(["bench", "decode"]), st.just(f), _bad_int()) for f in ("--threads", "--d-model", "--n-layers")),
    st.tuples(st.just(["bench", "ops"]), st.just("--lengths"), _bad_int()),
    *(st.tuples(st.just(["generate", "--model", "{model}"]), st.just(f), _bad_int())
      for f in ("--max-new-tokens", "--top-k", "--threads")),
    st.tuples(st.just(["generate", "--model", "{model}"]), st.just("--top-p"),
              st.one_of(st.floats(1.0001, 1e6).map(str), st.floats(max_value=0.0).map(str), st.just("nan"))),
    st.tuples(st.sampled_from([["train"], ["recall"], ["generate", "--model", "{model}"], ["bench", "decode"]]),
              st.just("--device"), st.sampled_from(["gpu", "tpu:0", "cuda:x", "", "cpu:0:1", "npu"])),
)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from evict import presets
    from evict.tasks.tokenizers import CharTokenizer

    folder = tmp_path_factory.mktemp("model")
    chars = "".join(chr(32 + i) for i in range(40))
    LM(presets.get("gpt2", vocab_size=len(chars), n_layers=1, d_model=32, n_heads=2, head_dim=16, d_ff=64)).save(folder)
    CharTokenizer(chars).save(folder / "tokenizer.json")
    return folder


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=BAD_FLAGS)
def test_cli_bad_flag_values_exit_2_one_line_nothing_written(case, saved_model):
    prefix, flag, value = case
    argv = [str(saved_model) if a == "{model}" else a for a in prefix] + [f"{flag}={value}"]
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                with pytest.raises(SystemExit) as e:
                    main(argv)
        finally:
            os.chdir(here)
        lines = err.getvalue().strip().splitlines()
        assert e.value.code == 2, (argv, e.value.code, lines)
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in lines[0], (argv, lines)
        assert not any(Path(tmp).iterdir()), (argv, list(Path(tmp).iterdir()))


# -- the MQAR generator ----------------------------------------------------------------------------------------


@settings(FAST, max_examples=60)
@given(n=st.integers(1, 40), k=st.integers(1, 70), extra=st.integers(0, 90), seed=st.integers(0, 2**32 - 1))
def test_sample_distinct_is_the_step_by_step_loop_everywhere(n, k, extra, seed):
    """mqar._sample_distinct (Floyd's algorithm, vectorised over its steps) against the step-by-step loop: the same
    samples and the generator left in the same place, at any rows, k and pool (pool - k = extra)."""
    same_as_step_by_step(n, k, k + extra, seed)
