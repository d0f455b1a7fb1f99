"""The HTTP server: OpenAI- and Anthropic-compatible endpoints over one EngineWorker.

    /v1/models  /v1/chat/completions  /v1/completions  /v1/messages  /v1/messages/count_tokens
    /health  /metrics  /tokenize  /detokenize

The engine loads in a background thread after the server starts listening; until it is ready (or after it
has died) /health answers 503 and so does every model endpoint. Requests are validated before admission (a
prompt that does not fit the context is a 400), a full queue is a 503 with Retry-After, a client that goes
away has its request cancelled, and every error uses the OpenAI or Anthropic error object of its endpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.generate import Request as GenRequest
from ..engine.sampling import SamplingParams
from . import protocol as P
from .grammar import GrammarConstraint, GrammarError, json_grammar, lark_grammar, prepare_schema
from .metrics import Metrics
from .parsing import OutputParser
from .vocab import Vocab
from .worker import EngineWorker, QueueFull

log = logging.getLogger("jaxflash.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}


@dataclass
class ServerState:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    max_waiting: int = 256
    engine: Any = None
    tokenizer: Any = None
    vocab: Vocab | None = None
    worker: EngineWorker | None = None
    error: str | None = None  # the load failed
    metrics: Metrics = field(default_factory=Metrics)
    started: float = field(default_factory=time.time)

    @property
    def ready(self) -> bool:
        return self.worker is not None and not self.worker.dead


def _anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error_response(path: str, status: int, message: str, param: str | None = None,
                    headers: dict | None = None) -> JSONResponse:
    if _anthropic_path(path):
        body = P.anthropic_error(status, message)
    else:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}.get(status, "invalid_request_error"
                                                                          if status < 500 else "server_error")
        body = P.openai_error(message, kind, param, status)
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(load: Callable[[], Any], *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = 8 << 20, max_waiting: int = 256) -> FastAPI:
    """The app; `load()` returns (engine, tokenizer) and runs in a background thread at startup."""
    state = ServerState(model_name, api_key, max_body_bytes, max_waiting)

    def load_in_background():
        try:
            engine, tok = load()
            state.engine, state.tokenizer = engine, tok
            state.vocab = Vocab(tok, engine.config.eos_token_ids, engine.config.vocab_size)
            state.worker = EngineWorker(engine.generator, max_waiting=max_waiting, metrics=state.metrics)
            log.info("ready: %s", engine.plan.summary())
        except BaseException as e:  # noqa: BLE001 -- reported by /health
            state.error = f"{type(e).__name__}: {e}"
            log.exception("loading the model failed")

    async def lifespan(app):
        threading.Thread(target=load_in_background, name="jaxflash-load", daemon=True).start()
        yield
        if state.worker is not None:
            state.worker.stop()

    app = FastAPI(title="jaxflash", version="0.1.0", lifespan=lifespan)
    app.state.jaxflash = state

    # ----- cross-cutting: body limit, auth, errors ----------------------------------------------------------
    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return _error_response(path, 400, "invalid Content-Length")
            if int(length) > state.max_body_bytes:
                return _error_response(path, 413, f"request body over {state.max_body_bytes} bytes")
        if request.method == "POST":
            body = await request.body()  # cached by Starlette for the handler
            if len(body) > state.max_body_bytes:
                return _error_response(path, 413, f"request body over {state.max_body_bytes} bytes")
        if state.api_key and path not in ("/health", "/metrics", "/openapi.json", "/docs"):
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if key != state.api_key:
                return _error_response(path, 401, "invalid or missing API key (Authorization: Bearer or x-api-key)")
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error_response(request.url.path, e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return _error_response(request.url.path, 400, "the request body is not valid JSON")
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return _error_response(request.url.path, 400, msg, where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error_response(request.url.path, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return _error_response(request.url.path, 500, f"internal error: {type(e).__name__}")

    def need_ready():
        if state.error:
            raise ApiError(503, f"the model failed to load: {state.error}")
        if not state.ready:
            raise ApiError(503, "the engine has stopped: " + state.worker.dead if state.worker else
                           "the model is still loading", headers={"Retry-After": "5"})

    # ----- health, metrics, models, tokenization --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.ready:
            return {"status": "ok"}
        status = "error" if state.error or (state.worker and state.worker.dead) else "loading"
        return JSONResponse({"status": status, "error": state.error or (state.worker and state.worker.dead)},
                            status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        need_ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "jaxflash",
                                            "max_model_len": state.engine.plan.max_seq_len}]}

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest):
        need_ready()
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages")
        text = body.prompt if body.prompt is not None else render_chat(body.messages, None, {},
                                                                        body.add_generation_prompt)
        ids = state.tokenizer.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.plan.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest):
        need_ready()
        vocab = state.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    # ----- prompt building ------------------------------------------------------------------------------------
    def render_chat(messages: list[P.ChatMessage], tools, kwargs: dict, add_generation_prompt: bool = True) -> str:
        msgs = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            if m.role == "developer":
                d["role"] = "system"
            for call in d.get("tool_calls", []):
                args = call["function"].get("arguments")
                if isinstance(args, str):
                    try:
                        call["function"]["arguments"] = json.loads(args)
                    except ValueError:
                        pass
            msgs.append(d)
        try:
            return state.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                       tools=tools, **kwargs)
        except Exception as e:  # noqa: BLE001 -- template errors are the request's fault
            raise ApiError(400, f"chat template: {e}") from None

    def sampling_of(body, default_temperature: float = 1.0) -> SamplingParams:
        top_k = body.top_k or 0
        seed = getattr(body, "seed", None)
        seed = seed if seed is not None else uuid.uuid4().int % 2**32
        t = body.temperature if body.temperature is not None else default_temperature
        return SamplingParams(float(t), max(0, int(top_k)), float(body.top_p or 1.0),
                              float(getattr(body, "min_p", None) or 0.0), int(seed))

    def make_request(ids: list[int], max_tokens: int | None, sampling: SamplingParams, *, logprobs=None,
                     echo_logprobs=None, constraint=None) -> GenRequest:
        gen = state.engine.generator
        try:
            ids = gen.check_prompt(ids)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        ctx = gen.max_seq_len
        room = ctx - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the context of {ctx}",
                           "max_tokens")
        eos = frozenset(state.engine.config.eos_token_ids)
        return GenRequest(0, ids, room if max_tokens is None else max_tokens, sampling, eos, logprobs=logprobs,
                          echo_logprobs=echo_logprobs, constraint=constraint)

    def constraint(fmt, grammar=None):
        """The constraint of an OpenAI `response_format`, or of `guided_grammar` (a Lark grammar, vLLM's extension
        field); None for plain text."""
        try:
            if grammar is not None:
                if not isinstance(grammar, str) or not grammar.strip():
                    raise GrammarError("guided_grammar must be a Lark grammar string")
                if fmt and fmt.get("type") not in (None, "text"):
                    raise GrammarError("give either response_format or guided_grammar, not both")
                return GrammarConstraint(state.vocab, lark_grammar(grammar), "guided_grammar")
            kind = (fmt or {}).get("type")
            if kind in (None, "text"):
                return None
            if kind == "json_object":
                return GrammarConstraint(state.vocab, json_grammar(None), "JSON object")
            if kind == "json_schema":
                js = fmt.get("json_schema") or {}
                schema = js.get("schema", js if "type" in js or "properties" in js else None)
                schema = prepare_schema(schema, strict=bool(js.get("strict")),
                                        where="response_format.json_schema.schema")
                return GrammarConstraint(state.vocab, json_grammar(schema), "JSON schema")
            raise GrammarError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)")
        except GrammarError as e:
            raise ApiError(400, str(e), "response_format") from None

    def stops(stop) -> list[str]:
        s = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not x for x in s):
            raise ApiError(400, "stop strings must be non-empty", "stop")
        return s

    # ----- running one request ---------------------------------------------------------------------------------
    async def events_of(req: GenRequest, http: Request | None) -> AsyncIterator:
        """The request's events; cancels it in the engine if the consumer stops (a streaming client that
        leaves cancels the stream's task) or, with `http`, when the client disconnects."""
        try:
            ticket = state.worker.submit(req)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}", headers={"Retry-After": "1"}) from None
        except RuntimeError as e:
            raise ApiError(503, str(e)) from None
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(ticket.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if http is not None and await http.is_disconnected():
                        return
                    continue
                yield ev
                if ev.token is None:
                    return
        finally:
            if req.finish is None:
                state.worker.cancel(ticket)

    def token_text(t: int) -> str:
        return state.vocab.token_bytes[t].decode("utf-8", errors="replace")

    def lp_entry(tok: int, lp) -> dict:
        tb = state.vocab.token_bytes  # a token inside a multi-byte character has its own bytes, not U+FFFD's
        return {"token": token_text(tok), "logprob": lp[0], "bytes": list(tb[tok]),
                "top_logprobs": [{"token": token_text(a), "logprob": b, "bytes": list(tb[a])} for a, b in lp[1]]}

    async def collect(req: GenRequest, http: Request, parser: OutputParser, take) -> bool:
        """Run a non-streaming request to its end, handing each event and its parsed deltas to take(ev, deltas).
        False when the client went away first."""
        async for ev, deltas in _parsed(events_of(req, http), parser, req):
            take(ev, deltas)
        if req.finish == "error":
            raise ApiError(500, f"generation failed: {req.error}")
        return req.finish is not None or parser.stopped

    # ----- OpenAI chat ---------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatCompletionRequest, http: Request):
        need_ready()
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []] or None
        if body.tool_choice == "none":
            tools = None
        kwargs = dict(body.chat_template_kwargs or {})
        text = render_chat(body.messages, tools, kwargs)
        ids = state.tokenizer.encode(text)
        n_top = body.top_logprobs or 0
        req = make_request(ids, body.max_completion_tokens or body.max_tokens, sampling_of(body),
                           logprobs=n_top if body.logprobs else None,
                           constraint=constraint(body.response_format, body.guided_grammar))
        reasoning = kwargs.get("enable_thinking", True) is not False
        parser = OutputParser(state.vocab, stop=stops(body.stop), tools=bool(tools), reasoning=reasoning,
                              in_reasoning=text.rstrip().endswith("<think>"))
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(req.out),  # noqa: E731
                         "total_tokens": len(ids) + len(req.out)}

        def finish_reason():
            if req.finish == "error":
                return "error"
            if parser.calls:
                return "tool_calls"
            return "length" if req.finish == "length" and not parser.stopped else "stop"

        if not body.stream:
            content, reasoning_text, lps = [], [], []

            def take(ev, deltas):
                if ev.logprob is not None:
                    lps.append(lp_entry(ev.token, ev.logprob))
                content.extend(d[1] for d in deltas if d[0] == "text")
                reasoning_text.extend(d[1] for d in deltas if d[0] == "reasoning")

            if not await collect(req, http, parser, take):
                return Response(status_code=499)  # the client left
            msg = {"role": "assistant", "content": "".join(content) or (None if parser.calls else "")}
            if reasoning_text:
                msg["reasoning_content"] = "".join(reasoning_text)
            if parser.calls:
                msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in parser.calls]
            return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "message": msg, "logprobs": {"content": lps} if req.logprobs is not None
                                 else None, "finish_reason": finish_reason()}], "usage": usage()}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        agen = events_of(req, None)  # sse-starlette watches for the disconnect
        first = await _first_event(agen)  # errors before streaming starts are plain HTTP errors

        def chunk(delta: dict, finish=None, logprobs=None):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return {"data": json.dumps(c)}

        async def stream():
            yield chunk({"role": "assistant", "content": ""})
            async for ev, deltas in _parsed(_chain(first, agen), parser, req):
                lp = {"content": [lp_entry(ev.token, ev.logprob)]} if ev.logprob is not None else None
                for d in deltas:
                    if d[0] == "text":
                        yield chunk({"content": d[1]}, logprobs=lp)
                        lp = None
                    elif d[0] == "reasoning":
                        yield chunk({"reasoning_content": d[1]}, logprobs=lp)
                        lp = None
                    elif d[0] == "tool_start":
                        yield chunk({"tool_calls": [{"index": d[1], "id": d[2], "type": "function",
                                                     "function": {"name": d[3], "arguments": ""}}]})
                    elif d[0] == "tool_args":
                        yield chunk({"tool_calls": [{"index": d[1], "function": {"arguments": d[2]}}]})
                if lp is not None:
                    yield chunk({}, logprobs=lp)
            if req.finish == "error":
                yield {"data": json.dumps(P.openai_error(f"generation failed: {req.error}", "server_error"))}
            else:
                yield chunk({}, finish=finish_reason())
                if include_usage:
                    yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                               "model": state.model_name, "choices": [], "usage": usage()})}
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), ping=15)

    # ----- OpenAI completions ----------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, http: Request):
        need_ready()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (batches: send concurrent requests)", "prompt")
            prompt = prompt[0]
        ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if body.max_tokens == 0 and not (body.echo and body.logprobs is not None):
            raise ApiError(400, "max_tokens 0 is only meaningful with echo and logprobs (prompt scoring)",
                           "max_tokens")
        echo_lp = body.logprobs if (body.echo and body.logprobs is not None) else None
        req = make_request(ids, body.max_tokens, sampling_of(body), logprobs=body.logprobs, echo_logprobs=echo_lp,
                           constraint=constraint(body.response_format, body.guided_grammar))
        parser = OutputParser(state.vocab, stop=stops(body.stop))
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        prefix = (prompt if isinstance(prompt, str) else state.tokenizer.decode(ids)) if body.echo else ""

        def finish_reason():
            return "length" if req.finish == "length" and not parser.stopped else "stop"

        def legacy_logprobs(pairs, offset0):
            """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            at = offset0
            for tok, lp in pairs:
                s = token_text(tok)
                out["tokens"].append(s)
                out["token_logprobs"].append(None if lp is None else lp[0])
                out["top_logprobs"].append(None if lp is None else {token_text(a): b for a, b in lp[1]})
                out["text_offset"].append(at)
                at += len(s)
            return out

        if not body.stream:
            texts, pairs = [], []

            def take(ev, deltas):
                if ev.token is not None:
                    pairs.append((ev.token, ev.logprob))
                texts.extend(d[1] for d in deltas if d[0] == "text")

            if not await collect(req, http, parser, take):
                return Response(status_code=499)
            logprobs = None
            if body.logprobs is not None:
                head = list(zip(ids, req.prompt_logprobs)) if echo_lp is not None else []
                logprobs = legacy_logprobs(head + pairs, 0)
            n_out = len(req.out)
            return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "text": prefix + "".join(texts), "logprobs": logprobs,
                                 "finish_reason": finish_reason()}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        agen = events_of(req, None)  # sse-starlette watches for the disconnect
        first = await _first_event(agen)

        def chunk(text: str, finish=None, logprobs=None):
            return {"data": json.dumps({"id": rid, "object": "text_completion", "created": created,
                                        "model": state.model_name, "choices": [
                                            {"index": 0, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish}]})}

        async def stream():
            if prefix:
                yield chunk(prefix)
            async for ev, deltas in _parsed(_chain(first, agen), parser, req):
                text = "".join(d[1] for d in deltas if d[0] == "text")
                lp = legacy_logprobs([(ev.token, ev.logprob)], 0) if (ev.token is not None and ev.logprob) else None
                if text or lp:
                    yield chunk(text, logprobs=lp)
            if req.finish == "error":
                yield {"data": json.dumps(P.openai_error(f"generation failed: {req.error}", "server_error"))}
            else:
                yield chunk("", finish=finish_reason())
                if include_usage:
                    n_out = len(req.out)
                    yield {"data": json.dumps({"id": rid, "object": "text_completion", "created": created,
                                               "model": state.model_name, "choices": [], "usage": {
                                                   "prompt_tokens": len(ids), "completion_tokens": n_out,
                                                   "total_tokens": len(ids) + n_out}})}
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), ping=15)

    # ----- Anthropic messages ----------------------------------------------------------------------------------
    def anthropic_chat(body) -> tuple[list[P.ChatMessage], list | None, dict]:
        """Anthropic messages as the chat template's messages (tool_use -> tool_calls, tool_result -> tool)."""
        msgs: list[P.ChatMessage] = []
        if body.system:
            sys_text = body.system if isinstance(body.system, str) else "".join(b.text or "" for b in body.system)
            msgs.append(P.ChatMessage(role="system", content=sys_text))
        for m in body.messages:
            if isinstance(m.content, str):
                msgs.append(P.ChatMessage(role=m.role, content=m.content))
                continue
            text, calls, thinking = [], [], []
            for b in m.content:
                if b.type == "text":
                    text.append(b.text or "")
                elif b.type == "thinking":
                    thinking.append(b.thinking or "")
                elif b.type == "tool_use" and m.role == "assistant":
                    calls.append(P.ToolCall(id=b.id, function=P.FunctionCall(name=b.name or "",
                                                                             arguments=b.input or {})))
                elif b.type == "tool_result":
                    content = b.content if isinstance(b.content, str) else "".join(
                        c.get("text", "") for c in (b.content or []) if isinstance(c, dict))
                    msgs.append(P.ChatMessage(role="tool", content=content, tool_call_id=b.tool_use_id))
                else:
                    raise ApiError(400, f"content block type {b.type!r} is not supported here")
            if text or calls or (m.role == "user" and not any(x.role == "tool" for x in msgs[-1:])):
                msgs.append(P.ChatMessage(role=m.role, content="".join(text), tool_calls=calls or None,
                                          reasoning_content="".join(thinking) or None))
        tools = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema}
                 for t in body.tools or []] or None
        if getattr(body, "tool_choice", None) and body.tool_choice.get("type") == "none":
            tools = None
        thinking = getattr(body, "thinking", None)
        kwargs = {"enable_thinking": bool(thinking and thinking.get("type") == "enabled")}
        return msgs, tools, kwargs

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: P.CountTokensRequest):
        need_ready()
        msgs, tools, kwargs = anthropic_chat(body)
        return {"input_tokens": len(state.tokenizer.encode(render_chat(msgs, tools, kwargs)))}

    @app.post("/v1/messages")
    async def messages(body: P.MessagesRequest, http: Request):
        need_ready()
        msgs, tools, kwargs = anthropic_chat(body)
        text = render_chat(msgs, tools, kwargs)
        ids = state.tokenizer.encode(text)
        req = make_request(ids, body.max_tokens, sampling_of(body), constraint=constraint(None, body.guided_grammar))
        parser = OutputParser(state.vocab, stop=list(body.stop_sequences or []), tools=bool(tools),
                              reasoning=True, in_reasoning=text.rstrip().endswith("<think>"))
        mid = "msg_" + uuid.uuid4().hex[:24]

        def stop_reason():
            if parser.stopped:
                return "stop_sequence"
            if parser.calls:
                return "tool_use"
            return "max_tokens" if req.finish == "length" else "end_turn"

        def matched_stop():
            return parser.stop_hit  # the first to complete in the text, not the first in the list

        if not body.stream:
            blocks: list[dict] = []

            def add(kind, s):
                if blocks and blocks[-1]["type"] == kind:
                    blocks[-1][kind if kind == "thinking" else "text"] += s
                else:
                    blocks.append({"type": kind, "thinking": s, "signature": ""} if kind == "thinking" else
                                  {"type": "text", "text": s})

            def take(ev, deltas):
                for d in deltas:
                    if d[0] in ("text", "reasoning"):
                        add("text" if d[0] == "text" else "thinking", d[1])

            if not await collect(req, http, parser, take):
                return Response(status_code=499)
            for c in parser.calls:
                try:
                    args = json.loads(c["arguments"] or "{}")
                except ValueError:
                    args = {"_raw": c["arguments"]}
                blocks.append({"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["name"], "input": args})
            return {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": blocks,
                    "stop_reason": stop_reason(), "stop_sequence": matched_stop(),
                    "usage": {"input_tokens": len(ids), "output_tokens": len(req.out)}}

        agen = events_of(req, None)  # sse-starlette watches for the disconnect
        first = await _first_event(agen)

        def event(kind: str, data: dict) -> dict:
            return {"event": kind, "data": json.dumps({"type": kind, **data})}

        async def stream():
            yield event("message_start", {"message": {
                "id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
            yield event("ping", {})
            index, open_kind = -1, None
            tool_index: dict[int, int] = {}

            def open_block(kind, extra):
                nonlocal index, open_kind
                out = []
                if open_kind is not None:
                    out.append(event("content_block_stop", {"index": index}))
                index += 1
                open_kind = kind
                out.append(event("content_block_start", {"index": index, "content_block": extra}))
                return out

            async for ev, deltas in _parsed(_chain(first, agen), parser, req):
                for d in deltas:
                    if d[0] in ("text", "reasoning"):
                        kind = "text" if d[0] == "text" else "thinking"
                        if open_kind != kind:
                            for e in open_block(kind, {"type": "text", "text": ""} if kind == "text" else
                                                {"type": "thinking", "thinking": ""}):
                                yield e
                        delta = {"type": "text_delta", "text": d[1]} if kind == "text" else \
                            {"type": "thinking_delta", "thinking": d[1]}
                        yield event("content_block_delta", {"index": index, "delta": delta})
                    elif d[0] == "tool_start":
                        for e in open_block("tool_use", {"type": "tool_use", "id": "toolu_" + d[2][5:], "name": d[3],
                                                         "input": {}}):
                            yield e
                        tool_index[d[1]] = index
                    elif d[0] == "tool_args":
                        yield event("content_block_delta", {"index": tool_index[d[1]], "delta": {
                            "type": "input_json_delta", "partial_json": d[2]}})
            if open_kind is not None:
                yield event("content_block_stop", {"index": index})
            if req.finish == "error":
                yield {"event": "error", "data": json.dumps(P.anthropic_error(500, f"generation failed: {req.error}"))}
                return
            yield event("message_delta", {"delta": {"stop_reason": stop_reason(), "stop_sequence": matched_stop()},
                                          "usage": {"output_tokens": len(req.out)}})
            yield event("message_stop", {})

        return EventSourceResponse(stream(), ping=15)

    return app


async def _first_event(agen):
    """Wait for a request's first event before answering, so that submission errors (queue full, engine
    stopped) become plain HTTP errors instead of a broken stream."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first, agen):
    """The first event (already taken, see _first_event), then the rest."""
    try:
        if first is not None:
            yield first
            if first.token is None:
                return
        async for ev in agen:
            yield ev
    finally:
        await agen.aclose()


async def _parsed(events, parser: OutputParser, req: GenRequest):
    """(event, parsed deltas) for each of a request's events, until its end or a stop string. Closing the
    events on the way out runs events_of's `finally`, which cancels a request stopped early."""
    try:
        async for ev in events:
            yield ev, (parser.finish() if ev.token is None else parser.feed([ev.token]))
            if parser.stopped and req.finish is None:
                return
    finally:
        await events.aclose()
