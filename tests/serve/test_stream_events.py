"""The streamed events rendered from string templates (CompletionAnswer.event, ChatAnswer.event) are the bytes
json.dumps writes for the chunk dicts (the reference form), for any text, finish reason, index and token ids; and
over a real socket, streams with the templates on and off parse to the same events (chat's valid for the official
`openai` client's pydantic chunk type) (logprobs, echo, n > 1, stop strings, stop token ids, token ids, usage, chat)."""

import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from evict.serve import server as srv  # noqa: E402
from evict.serve.protocol import ChatRequest, CompletionRequest  # noqa: E402
from evict.serve.server import ChatAnswer, CompletionAnswer, Delta, Served, ServerThread, build_app, dict_event  # noqa: E402
from evict.tasks.tokenizers import ByteTokenizer  # noqa: E402
from tests.serve.test_openai import setup  # noqa: E402, F401  (the fixture: a tiny model's engine, started)

TEXT = st.text(alphabet=st.characters(codec=None), max_size=12) | st.sampled_from(['"', "\\", "\n\t\x00\x1f", "é€😀", ""])
FINISH = st.sampled_from([None, "stop", "length", "cancelled"])


class Quiet:  # what Served needs of an engine to render events: nothing is submitted
    max_len = 64


def answers(return_ids: bool):
    served = Served(Quiet(), ByteTokenizer(), 'tiny "é" \\ model', "{{ messages }}")  # a name JSON must escape
    comp = CompletionRequest(prompt="x", stream=True, return_token_ids=return_ids)
    chat = ChatRequest(messages=[{"role": "user", "content": "x"}], stream=True, return_token_ids=return_ids)
    return CompletionAnswer(served, comp, None), ChatAnswer(served, chat, None)


@settings(max_examples=300, deadline=None)
@given(text=TEXT, finish=FINISH, index=st.integers(0, 15), ids=st.lists(st.integers(0, 1 << 20), max_size=3),
       return_ids=st.booleans())
def test_template_events_are_the_bytes_of_the_chunk_dicts(text, finish, index, ids, return_ids):
    for answer in answers(return_ids):
        d = Delta(index, text, ids, [], finish)
        fast, ref = answer.event(d), dict_event(answer.chunk, d)
        assert fast == ref
        if fast is not None:
            assert fast.startswith("data: ") and fast.endswith("\n\n") and json.loads(fast[6:])["choices"][0]["index"] == index


def events(url: str, path: str, body: dict) -> list:
    """The stream's events, parsed, with the per-request id and time taken out."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    out = []
    for line in lines[:-1]:
        e = json.loads(line)
        e.pop("id"), e.pop("created")
        out.append(e)
    return out


BODIES = [
    ("/v1/completions", {"prompt": "To be", "max_tokens": 9, "temperature": 0, "return_token_ids": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "To be", "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2}),
    ("/v1/completions", {"prompt": "To be", "max_tokens": 5, "echo": True, "n": 3, "seed": 7}),
    ("/v1/completions", {"prompt": [84, 111], "max_tokens": 12, "n": 2, "seed": 1, "stop": ["e", "a"],
                         "stop_token_ids": [32]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \"é\""}], "max_tokens": 7, "n": 2, "seed": 3,
                              "return_token_ids": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
                              "logprobs": True, "top_logprobs": 2}),
]


def test_streams_with_and_without_templates_are_the_same_events(setup, monkeypatch):
    engine = setup[1]
    with ServerThread(build_app(engine, ByteTokenizer(), "tiny")) as url:
        for path, body in BODIES:
            monkeypatch.setattr(srv, "FAST_EVENTS", True)
            fast = events(url, path, body)
            monkeypatch.setattr(srv, "FAST_EVENTS", False)
            ref = events(url, path, body)
            assert fast == ref, (path, body)
            assert sum(len(e["choices"]) for e in fast) > body.get("n", 1)  # tokens came, one event each at least
            for e in fast if path.startswith("/v1/chat") else []:  # valid for the official client's chunk type
                e = {**e, "id": "x", "created": 0}  # (its Completion type wants a finish_reason in every event)
                assert openai.types.chat.ChatCompletionChunk.model_validate(e).model_dump(exclude_unset=True) == e


@pytest.mark.parametrize("interval, want", [
    (1, [[0], [1], [2], [3], [4], [5], [6], ["length"]]),
    (3, [[0], [1, 2, 3], [4, 5, 6], ["length"]]),  # the first token at once, then three at a time, the end at once
    (64, [[0], [1, 2, 3, 4, 5, 6, "length"]]),
])
def test_an_inbox_wakes_its_reader_at_the_first_token_every_interval_and_the_end(interval, want):
    import asyncio

    async def go():
        box, got = srv.Inbox(interval), []

        async def reader():
            while not got or got[-1][-1] != "length":
                got.append([e[2] for e in await box.take()])

        task = asyncio.create_task(reader())
        for t in range(7):
            box.put_nowait((0, "token", t, None))
            for _ in range(3):  # the reader runs, if it was woken, before the next token
                await asyncio.sleep(0)
        box.put_nowait((0, "finish", "length", None))
        await task
        return got

    assert asyncio.run(go()) == want


@pytest.mark.parametrize("interval", [3, 64])
def test_a_stream_interval_sends_the_same_events(setup, interval):
    """--stream-interval N groups a stream's writes, never its events: every body streams the same parsed events."""
    engine = setup[1]
    with ServerThread(build_app(engine, ByteTokenizer(), "tiny")) as one, \
            ServerThread(build_app(engine, ByteTokenizer(), "tiny", stream_interval=interval)) as grouped:
        for path, body in BODIES:
            assert events(grouped, path, body) == events(one, path, body), (path, body)
