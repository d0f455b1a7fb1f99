"""The HTTP server, driven by the official openai and anthropic SDKs, on the bundled model.

The bundled model ends its turns and writes tool calls by itself (test_the_model_ends_turns_and_calls_tools),
but not reliably the exact text a test needs. Tests of tool calls, reasoning and stop strings therefore force
the output through the same token-mask path as response_format: `guided_grammar`, a Lark grammar naming the
exact text (with the tokenizer's <tool_call>/<think> tokens), so the real engine, sampler, detokenizer, parser
and stream formats are exercised end to end.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import numpy as np
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

import jaxflash  # noqa: E402
from jaxflash.tokenizer import Tokenizer  # noqa: E402
from serving import KEY, forced  # noqa: E402

pytestmark = pytest.mark.xdist_group("server")  # conftest.py's tiny_server, shared with test_server_hostile.py

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(jaxflash.DEFAULT_MODEL)


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)


# ----- OpenAI ------------------------------------------------------------------------------------------------------
def test_chat_stream_equals_non_stream(oai):
    msgs = [{"role": "user", "content": "What is a list?"}]
    full = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    models = oai.models.list()
    assert models.data[0].id == "tiny"


def test_seeded_sampling_and_logprobs(oai):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "And God said"}], max_tokens=8, temperature=0.9,
              seed=11, logprobs=True, top_logprobs=3)
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    lps = a.choices[0].logprobs.content
    assert len(lps) == 8 and all(len(x.top_logprobs) == 3 and x.logprob <= 0 for x in lps)


def test_tool_call_round_trip(oai, tok):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=60, extra_body={"guided_grammar": forced(tok, call)})
    r = oai.chat.completions.create(**kw)
    (tc,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
    # streamed: the same call from its deltas
    name, args = "", ""
    for c in oai.chat.completions.create(stream=True, **kw):
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name += d.function.name or ""
            args += d.function.arguments or ""
    assert name == "get_weather" and json.loads(args) == {"city": "Paris"}
    # the result goes back; the model answers
    msgs += [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
             {"role": "tool", "tool_call_id": tc.id, "content": "sunny, 21 C"}]
    again = oai.chat.completions.create(model="tiny", messages=msgs, tools=[WEATHER], max_tokens=5)
    assert again.choices[0].message.content is not None


def test_the_model_ends_turns_and_calls_tools(oai):
    """Unforced, greedy: the bundled model (trained on chat turns, scripts/train_tiny.py) ends a reply with
    <|im_end|> well before max_tokens, and asked with a tool a question that needs it, it writes a <tool_call>
    block that the server returns as tool_calls. It does not reliably pick the right name or arguments
    (scripts/eval_chat.py measures that), so only the form is checked here."""
    # greedy decoding repeats itself on some verse requests (eval_chat.py: 83% end greedy, 98% sampled), so the
    # prompts are ones it ends greedily; any change of the model that loses end-of-turn shows here
    for q in ("Read Psalms 23:1 to me.", "What is a list?", "What does os.getcwd() do?"):
        r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=200,
                                        temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 200, (q, r.choices[0])
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.chat.completions.create(model="tiny", messages=weather, tools=[WEATHER], max_tokens=100, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls, r.choices[0]
    assert isinstance(json.loads(r.choices[0].message.tool_calls[0].function.arguments), dict)


def test_xml_tool_call_and_reasoning_streamed(oai, tok):
    text = ("<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
            "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[WEATHER], max_tokens=120, stream=True,
                                         extra_body={"guided_grammar": forced(tok, text)})
    reasoning, args, deltas = "", "", 0
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        assert not (d.content or "").strip()
        for t in d.tool_calls or []:
            args += t.function.arguments or ""
            deltas += 1
    assert reasoning.strip() == "The user wants weather."
    # the name, then one delta per parameter (sent together, once the block has parsed)
    assert json.loads(args) == {"city": "Paris", "days": 3} and deltas >= 3


def test_stop_string_never_leaks(oai, tok):
    g = forced(tok, "Hello STOP world")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=30, stop=["STOP"],
              extra_body={"guided_grammar": g})
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].message.content == "Hello " and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == "Hello " and not any("S" in p for p in pieces)


def test_json_response_format(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "word": {"enum": ["yes", "no"]}},
              "required": ["ok", "word"], "additionalProperties": False}
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A number"}], max_tokens=40,
                                    temperature=0, response_format={"type": "json_schema",
                                                                    "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"ok", "word"} and isinstance(out["ok"], bool) and out["word"] in ("yes", "no")
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON"}], max_tokens=60,
                                    seed=3, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # an object the model closes within 60 tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_completions_echo_logprobs_scores_the_prompt(oai, server, tok):
    """lm-evaluation-harness's local-completions: echo + logprobs + max_tokens 0."""
    prompt = "In the beginning God created the heaven"
    r = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    ids = tok.encode(prompt)
    assert r.choices[0].text == prompt and lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    logits = server[1].engine.logits(ids)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert np.allclose(lp.token_logprobs[1:], want, atol=1e-4)
    gen = oai.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert gen.usage.completion_tokens == 4


# ----- Anthropic ---------------------------------------------------------------------------------------------------
def test_messages_and_stream_events(claude, server):
    greedy = {"temperature": 0}  # sent as an extra field: this SDK version has no temperature argument
    m = claude.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "Hello"}],
                               extra_body=greedy)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10 and m.content[0].type == "text"
    with claude.messages.stream(model="tiny", max_tokens=10, messages=[{"role": "user", "content": "Hello"}],
                                extra_body=greedy) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text
    raw = httpx.post(server[0] + "/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        "model": "tiny", "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "Hello"}],
        **greedy})  # sampled with a fresh seed, the stream could end at its first token without a content block
    kinds = re.findall(r"^event: (\w+)", raw.text, re.M)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "ping" in kinds and kinds.index("content_block_start") < kinds.index("content_block_delta")
    assert kinds.count("content_block_start") == kinds.count("content_block_stop")
    n = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hello there"}])
    assert n.input_tokens > 2


def test_anthropic_tool_use_round_trip(claude, tok):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}]
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    m = claude.messages.create(model="tiny", max_tokens=60, tools=tools, messages=msgs,
                               extra_body={"guided_grammar": forced(tok, text)})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and use.input == {"city": "Oslo"}
    with claude.messages.stream(model="tiny", max_tokens=60, tools=tools, messages=msgs,
                                extra_body={"guided_grammar": forced(tok, text)}) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Oslo"}]
    msgs += [{"role": "assistant", "content": [use.model_dump()]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}]
    again = claude.messages.create(model="tiny", max_tokens=4, tools=tools, messages=msgs,
                                   extra_body={"temperature": 0})
    assert again.stop_reason in ("end_turn", "max_tokens") and again.usage.input_tokens > m.usage.input_tokens


# ----- errors ------------------------------------------------------------------------------------------------------
def test_errors(server, oai):
    url = server[0]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5)
    with pytest.raises(openai.BadRequestError, match="context"):  # refused before admission
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 1000}])
    h = {"x-api-key": KEY, "content-type": "application/json"}
    r = httpx.post(url + "/v1/chat/completions", headers=h, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/messages", headers=h, json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(url + "/v1/completions", headers=h, content=b"x" * (2 << 20))
    assert r.status_code == 413
    r = httpx.post(url + "/v1/chat/completions", headers=h, json={
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                         "json_schema": {"schema": 7}}})
    assert r.status_code == 400
    assert httpx.get(url + "/nope", headers=h).status_code == 404


def test_health_and_queue_limits(tiny_server_start):
    """/health through the shared server's start (conftest.py holds its loading until the server has answered):
    "loading" and model endpoints 503 while the model loads, "warming up" while it compiles, ok only once every
    program serving uses is compiled; then a full queue and a dead engine thread are 503s."""
    url, state, start = tiny_server_start
    assert start["health"][0] == (503, "loading") and start["models"] == 503
    seen = [status for _, status in start["health"]]
    assert start["health"][-1] == (200, "ok") and "warming up" in seen  # ready means compiled: it compiles first
    assert start["compiled"] == {"admit", "release", "prefill", "prefill[logprobs]", "prefill[score]"} | {
        f"decode{w}@{b}" for b in (1, 2, 4)  # max_batch 4
        for w in ("", "[logprobs,masks,filters]")}, start["compiled"]
    worker, h = state.worker, {"Authorization": f"Bearer {KEY}"}
    limit, worker.max_waiting = worker.max_waiting, 0  # what create_app(max_waiting=0) sets: always full
    try:
        r = httpx.post(url + "/v1/completions", headers=h, json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"], r.text
    finally:
        worker.max_waiting = limit
    worker.dead = "simulated failure"
    try:
        assert httpx.get(url + "/health").status_code == 503
    finally:
        worker.dead = None
    assert httpx.get(url + "/health").status_code == 200


def test_concurrency_with_cancellations(server):
    """64 mixed requests at concurrency 16; every 4th streaming one is dropped after its first chunks."""
    url, state = server
    h = {"Authorization": f"Bearer {KEY}"}

    async def one(client, i):
        kind = i % 4
        body = {"model": "tiny", "max_tokens": 6 + i % 5, "temperature": 0.7, "seed": i}
        if kind == 0:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"Say {i}"}]
        elif kind == 1:
            path, body["prompt"] = "/v1/completions", f"Number {i}:"
        else:
            path, body["messages"] = "/v1/messages", [{"role": "user", "content": f"Hi {i}"}]
        body["stream"] = i % 2 == 0
        if not body["stream"]:
            r = await client.post(url + path, json=body, headers=h)
            assert r.status_code == 200, r.text
            return "done"
        async with client.stream("POST", url + path, json=body, headers=h) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data:")
                if i % 8 == 0 and n >= 2:
                    return "cancelled"  # leaving the block closes the connection mid-stream
            return "done"

    async def main():
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120) as client:
            async def guarded(i):
                async with sem:
                    return await one(client, i)
            return await asyncio.gather(*(guarded(i) for i in range(64)))

    results = asyncio.run(main())
    assert results.count("cancelled") == 8 and results.count("done") == 56
    gen = state.engine.scheduler
    for _ in range(100):  # cancellations land within a step
        if gen.idle and len(gen.free_slots) == gen.max_batch:
            break
        time.sleep(0.1)
    assert gen.idle and len(gen.free_slots) == gen.max_batch and len(gen.free_pages) == gen.plan.num_pages
    assert httpx.get(url + "/health").status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert "jaxflash:time_to_first_token_seconds_count" in metrics and 'finished_reason="cancelled"' in metrics


def test_schemathesis_finds_no_server_errors(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    url = server[0]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    schema.config.headers = {"Authorization": f"Bearer {KEY}"}
    failures, codes = [], {}
    for op in schema.get_all_operations():
        op = op.ok()

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case):
            if isinstance(case.body, dict) and "max_tokens" in case.body:
                case.body["max_tokens"] = min(int(case.body.get("max_tokens") or 1), 4) or 1
            r = case.call(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            if r.status_code >= 500:
                failures.append((op.label, case.body, r.status_code, r.text[:300]))

        check()
    assert not failures, failures[:3]
    assert sum(codes.values()) >= 60 and codes.get(200, 0) > 0 and any(400 <= c < 500 for c in codes), codes


def test_a_failing_request_ends_alone(server, oai):
    """A step that fails (here: the prefill program raising as an out-of-memory would) fails its request with a
    500; the engine keeps serving."""
    runner = server[1].engine.scheduler.runner
    real = runner.prefill

    def boom(*args):
        runner.prefill = real
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (simulated)")

    runner.prefill = boom
    with pytest.raises(openai.InternalServerError, match="out of memory"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    ok = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                     temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop") and httpx.get(server[0] + "/health").status_code == 200
