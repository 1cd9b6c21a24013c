"""The server as a user of the official `openai` client sees it, over a real socket: completions and chat, streaming
and not, n, logprobs (against the model's own log-softmax), echo (with the prompt's logprobs against a float64
log-softmax, max_tokens 0), penalties and logit_bias, EOS ending a choice with
"stop", the api key, OpenAI-shaped 404 / 405, a failing sampler failing only its request, a dead engine thread
reported by /health and answered with errors (never a hang), and a stop failing what is in flight."""

import copy
import threading

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from evict.models import LM, presets  # noqa: E402
from evict.serve.engine import Engine  # noqa: E402
from evict.serve.server import ServerThread, build_app  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402
from tests.serve.conftest import failing_requests_fail_alone  # noqa: E402

NAME = "tiny"


class EosBytes(ByteTokenizer):
    def __init__(self, eos: int):
        super().__init__()
        self.eos_id = eos


@pytest.fixture(scope="module")
def setup():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LM(presets.get("kimi_linear", n_layers=2, init_std=0.2)).eval()
    engine = Engine(model, max_batch=8, cache_budget=8 << 20, block_size=8, prefill_chunk=16, max_len=256)
    engine.start()
    yield model, engine
    engine.stop()
    torch.set_num_threads(n)


def alone(model, prompt, n) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, temperature=0, prefill_chunk=16)[0, len(prompt):].tolist()


def serve(engine, tok=None, **kw):
    return ServerThread(build_app(engine, tok or ByteTokenizer(), NAME, **kw))


def client(url, key="none"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def test_completions_streaming_and_not_equal_generate(setup):
    model, engine = setup
    want = ByteTokenizer().decode(alone(model, list(b"To be"), 12))
    with serve(engine) as url:
        c = client(url)
        r = c.completions.create(model=NAME, prompt="To be", max_tokens=12, temperature=0)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5
        chunks = list(c.completions.create(model=NAME, prompt="To be", max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.completion_tokens == 12
        echo = c.completions.create(model=NAME, prompt="To be", max_tokens=12, temperature=0, echo=True)
        assert echo.choices[0].text == "To be" + want
        assert [m.id for m in c.models.list()] == [NAME]


def test_n_choices_seeds_and_logprobs(setup):
    model, engine = setup
    prompt = list(b"abc")
    with serve(engine) as url:
        c = client(url)
        r = c.completions.create(model=NAME, prompt="abc", max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=3,
                                 extra_body={"return_token_ids": True})
        again = c.completions.create(model=NAME, prompt="abc", max_tokens=6, temperature=1.0, n=3, seed=7,
                                     extra_body={"return_token_ids": True})
        assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
        ids = [ch.model_extra["token_ids"] for ch in r.choices]
        assert ids == [ch.model_extra["token_ids"] for ch in again.choices]  # seed + i per choice: reproducible
        assert len({tuple(x) for x in ids}) > 1  # and the choices differ
        for ch, out in zip(r.choices, ids):  # each token's logprob is the model's log-softmax at its position
            with torch.no_grad():
                lp = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1].double().log_softmax(-1)
            want = [lp[i, t].item() for i, t in enumerate(out)]
            assert ch.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
            assert all(len(top) == 3 for top in ch.logprobs.top_logprobs)
            best = [v for i in range(len(out)) for v in lp[i].topk(3).values.tolist()]
            got = [v for top in ch.logprobs.top_logprobs for v in sorted(top.values(), reverse=True)]
            assert got == pytest.approx(best, abs=1e-4)


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax(LM(ids)) [T, V], the model in float64 (a copy): the obviously-correct form."""
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        return ref(torch.tensor([ids]))[0].log_softmax(-1)


def check_logprobs(lp, ids: list[int], got, n: int) -> None:
    """OpenAI's completion logprobs `got` of tokens `ids` (the first a prompt's first: null) against lp [T, V]. The
    served model is float32 (differences ~3e-5 from float64 here; an off-by-one position differs by ~1): 1e-4, as
    for the completion's logprobs; the float64 engine gives them to 1e-10 (test_engine_packed)."""
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx([lp[j, ids[j + 1]].item() for j in range(len(ids) - 1)], abs=1e-4)
    for j, top in enumerate(got.top_logprobs[1:]):
        values = list(top.values())
        assert values == sorted(values, reverse=True)  # the N most likely, best first
        assert values == pytest.approx(lp[j].topk(n).values.tolist(), abs=1e-4)
        if ids[j + 1] in lp[j].topk(n).indices.tolist():  # the chosen token among them: its own value
            assert top[got.tokens[j + 1]] == got.token_logprobs[j + 1]


def check_offsets(ids: list[int], got, text: str) -> None:
    """Byte tokens: an ASCII token's text is text[offset : next offset]; a multi-byte character's text begins at the
    offset of its first byte (the others add nothing); each token's string is its character or token_id:N."""
    offsets = got.text_offset + [len(text)]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert "".join(text[offsets[k] : offsets[k + 1]] for k in range(len(ids))) == text
    for k, t in enumerate(ids):
        piece = text[offsets[k] : offsets[k + 1]]
        assert (got.tokens[k], piece) == (chr(t), chr(t)) if t < 128 else got.tokens[k] == f"token_id:{t}"


def test_echo_with_logprobs_gives_the_prompts_log_softmax(setup):
    """echo + logprobs: the prompt's tokens (3 prefill chunks of 16) with the model's log-softmax at the position
    before each (the first null) and the top N, then the completion's; text_offset indexes the echoed text."""
    model, engine = setup
    prompt = "To be, or not to be, that is the question: whether"
    with serve(engine) as url:
        c = client(url)
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=3)
        ch = r.choices[0]
        out = alone(model, list(prompt.encode()), 5)
        ids = list(prompt.encode()) + out
        assert ch.text == prompt + ByteTokenizer().decode(out) and ch.finish_reason == "length"
        assert len(ch.logprobs.tokens) == len(ids) and r.usage.completion_tokens == 5
        check_logprobs(reference_logprobs(model, ids), ids, ch.logprobs, 3)
        check_offsets(ids, ch.logprobs, ch.text)
        assert ch.logprobs.text_offset[: len(prompt)] == list(range(len(prompt)))
        # streamed: the echo and the prompt's logprobs come in a choice's first chunk
        chunks = [x.choices[0] for x in c.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0,
                                                              echo=True, logprobs=3, stream=True)]
        assert chunks[0].text.startswith(prompt) and len(chunks[0].logprobs.tokens) == len(prompt) + 1
        assert "".join(x.text for x in chunks) == ch.text
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for x in chunks for v in getattr(x.logprobs, key)] == getattr(ch.logprobs, key)


def test_echo_max_tokens_0_scores_the_prompt(setup):
    """max_tokens 0 with echo + logprobs: the prompt's log-probabilities alone (token ids in, a multi-byte character
    split over tokens: text_offset is where each token's text begins in the decoded text); n choices agree."""
    model, engine = setup
    ids = list("naïve café: ok".encode())
    with serve(engine) as url:
        r = client(url).completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=2, n=2)
        lp = reference_logprobs(model, ids)
        text = bytes(ids).decode()
        for ch in r.choices:
            assert ch.text == text and ch.finish_reason == "length" and len(ch.logprobs.tokens) == len(ids)
            check_logprobs(lp, ids, ch.logprobs, 2)
            check_offsets(ids, ch.logprobs, text)
            assert [o for t, o in zip(ids, ch.logprobs.text_offset) if t >= 128] == [2, 2, 9, 9]  # "naïve café": ï at 2, é at 9
        assert r.choices[0].logprobs == r.choices[1].logprobs and r.usage.completion_tokens == 0


@pytest.mark.parametrize("fields, param", [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": True}, "max_tokens"),
                                           ({"max_tokens": 0, "logprobs": 2}, "max_tokens"),
                                           ({"echo": True, "logprobs": 21}, "logprobs"),
                                           ({"echo": True, "logprobs": -1, "max_tokens": 0}, "logprobs")])
def test_echo_bad_combinations_are_400s_naming_the_field(setup, fields, param):
    _, engine = setup
    with serve(engine) as url:
        with pytest.raises(openai.BadRequestError) as e:
            client(url).completions.create(model=NAME, prompt="hi", **fields)
        body = e.value.body
        assert body["param"] == param and body["message"].startswith(f"{param}:") and body["code"] == 400


def test_logit_bias_and_penalties_reach_the_sampler(setup):
    model, engine = setup
    with serve(engine) as url:
        c = client(url)
        r = c.completions.create(model=NAME, prompt="hi", max_tokens=8, temperature=1.0, seed=1,
                                 logit_bias={str(ord("z")): 100}, extra_body={"return_token_ids": True})
        assert r.choices[0].text == "z" * 8
        # a strong presence penalty forbids repeating a token under greedy decoding
        r = c.completions.create(model=NAME, prompt="hi", max_tokens=10, temperature=0, presence_penalty=2.0,
                                 extra_body={"return_token_ids": True, "repetition_penalty": 1.0})
        plain = alone(model, list(b"hi"), 10)
        assert len(set(plain)) < 10  # greedy repeats ...
        got = r.choices[0].model_extra["token_ids"]
        assert got != plain and got[0] == plain[0]  # ... the penalty changes the output after the first token


def test_chat_streaming_and_not_ends_at_eos_with_stop(setup):
    model, engine = setup
    from evict.serve.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt = list(ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(messages).encode())
    out = alone(model, prompt, 12)
    eos = out[5]
    k = out.index(eos)
    want = bytes(out[:k]).decode("utf-8", errors="replace")
    with serve(engine, EosBytes(eos)) as url:
        c = client(url)
        r = c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == k + 1
        chunks = list(c.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
        lp = c.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2, stop=None)
        assert len(lp.choices[0].logprobs.content) == min(3, k + 1)
        assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)


def test_chat_template_from_the_request_side_errors(setup):
    model, engine = setup
    with serve(engine, chat_template="{{ raise_exception('no') if messages[0]['role'] != 'user' }}{{ messages[0]['content'] }}") as url:
        c = client(url)
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=[{"role": "bogus", "content": "hi"}], max_tokens=2)
        assert e.value.body["param"] == "messages"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      extra_body={"tools_choice": "auto"})
        assert e.value.body["param"] == "tools_choice" and "refused" in e.value.body["message"]


def test_api_key_404_405_are_openai_errors(setup):
    _, engine = setup
    with serve(engine, api_key="sesame") as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, "wrong").completions.create(model=NAME, prompt="hi", max_tokens=1)
        assert client(url, "sesame").completions.create(model=NAME, prompt="hi", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.NotFoundError):
            client(url, "sesame").completions.create(model="gpt-4", prompt="hi", max_tokens=1)
        for r in (httpx.get(f"{url}/nope"), httpx.get(f"{url}/v1/completions", headers={"authorization": "Bearer sesame"})):
            assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(f"{url}/health").status_code == 200  # not behind the key


def test_a_failing_sampler_fails_only_its_request(setup, flaky_sampler):
    model, engine = setup
    with serve(engine) as url:
        failing_requests_fail_alone(client(url), NAME, alone(model, list(b"hi"), 4))
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert engine.alive and not engine.running


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_is_reported_and_requests_get_errors():
    torch.manual_seed(0)
    model = LM(presets.get("kimi_linear", n_layers=1, d_model=64, init_std=0.2)).eval()
    engine = Engine(model, max_batch=2, cache_budget=2 << 20, block_size=8, max_len=64)
    started = threading.Event()
    real_step = engine.step

    def dying_step():
        if engine.running:
            started.set()
            raise SystemExit("the thread dies")  # not an Exception: nothing in the loop catches it
        return real_step()

    engine.step = dying_step
    engine.start()
    with serve(engine) as url:
        c = client(url)
        with pytest.raises(openai.APIStatusError) as e:  # in flight when the thread died: an error, not a hang
            c.completions.create(model=NAME, prompt="hi", max_tokens=4)
        assert e.value.status_code == 503
        engine._thread.join(5)
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and h.json()["engine"] == "not running"
        with pytest.raises(openai.APIStatusError) as e:  # later requests: refused at once
            c.completions.create(model=NAME, prompt="hi", max_tokens=4)
        assert e.value.status_code == 503


def test_stop_fails_requests_in_flight():
    torch.manual_seed(0)
    model = LM(presets.get("deltanet", n_layers=1, d_model=64)).eval()  # recurrent: a long generation fits
    engine = Engine(model, max_batch=2, cache_budget=2 << 20, block_size=8)
    engine.start()
    with serve(engine) as url:
        c = client(url)
        result = {}

        def ask():
            try:
                c.completions.create(model=NAME, prompt="hi", max_tokens=100_000)
            except openai.APIStatusError as e:
                result["status"] = e.status_code

        t = threading.Thread(target=ask)
        t.start()
        while not engine.running:
            pass
        engine.stop()
        t.join(10)
        assert not t.is_alive() and result["status"] == 503
