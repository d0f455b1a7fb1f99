"""The HTTP server: OpenAI- and Anthropic-compatible endpoints over one EngineWorker.

    /v1/models  /v1/models/{id}  /v1/chat/completions  /v1/completions  /v1/messages  /v1/messages/count_tokens
    /health  /metrics  /tokenize  /detokenize  /tokenizer_info

The engine loads in a background thread after the server starts listening; until it is ready (or after it
has died) /health answers 503 and so does every model endpoint. A request goes through four stages:

1. `Guard` (ASGI middleware) refuses a request without the key before reading its body, and times the body;
   FastAPI's `max_body_size` refuses an oversized body while it is read (by its Content-Length, before).
2. Parsing and validating the body, rendering and tokenising the prompt and compiling a grammar run in worker
   threads (`_offload`): the event loop only moves bytes, so /health and other streams keep their pace. Each of
   these is bounded (protocol.py's limits, the prompt's byte bound, the grammar size), each refusal a 400
   naming its limit.
3. The request is submitted; until it ends, a watcher cancels it the moment its client disconnects, whether it
   streams or not, runs or waits.
4. Its tokens are parsed into the endpoint's format, again off the loop. Every stream ends with its protocol's
   final events, an error included, and every error uses the OpenAI or Anthropic error object of its endpoint.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine.scheduler import Request as GenRequest
from ..engine.sampling import SamplingParams
from . import protocol as P
from .grammar import GrammarConstraint, GrammarError, json_grammar, lark_grammar, prepare_schema, tool_call_grammar
from .metrics import Metrics
from .parsing import OutputParser
from .prompt import PromptError, encode_text, openai_messages, render_chat
from .vocab import Vocab
from .worker import EngineWorker, QueueFull

log = logging.getLogger("jaxflash.server")

OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/docs")  # answered without the key
BODIES = (P.ChatCompletionRequest, P.CompletionRequest, P.MessagesRequest, P.CountTokensRequest,
          P.TokenizeRequest, P.DetokenizeRequest)


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
    body_timeout: float = 30.0
    engine: Any = None
    scheduler: Any = None
    vocab: Vocab | None = None
    worker: EngineWorker | None = None
    phase: str = "loading"  # loading -> warming up (compiling) -> ready
    error: str | None = None  # the load failed
    metrics: Metrics = field(default_factory=Metrics)
    started: float = field(default_factory=time.time)
    # Worker threads: preparing requests (parse, render, tokenise, compile) and parsing output are bounded
    # apart, so a burst of heavy requests cannot starve the streams already running.
    prepare_limiter: Any = field(default_factory=lambda: anyio.CapacityLimiter(4))
    parse_limiter: Any = field(default_factory=lambda: anyio.CapacityLimiter(8))

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
        kind = {401: "authentication_error", 404: "not_found_error", 408: "timeout_error",
                429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error")
        body = P.openai_error(message, kind, param, status)
    return JSONResponse(body, status_code=status, headers=headers)


_LOC_PART = re.compile(r"[a-z_][a-z0-9_]*|\d+")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _validation_message(errors: list) -> tuple[str, str | None]:
    """The first error as "field.path: message" (pydantic's union-member tags left out of the path). Of a
    union's errors, one about the value (too long, out of range) says more than "not a string"."""
    first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0] if errors else {})
    loc = [str(x) for x in first.get("loc", ()) if _LOC_PART.fullmatch(str(x)) and str(x) not in _TYPE_TAGS]
    where = ".".join(loc) or None
    return f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", where


class Guard:
    """Pure ASGI middleware: the key is checked before a byte of the body is read (an unauthenticated upload is
    refused, not buffered), in constant time; a body must arrive within body_timeout seconds. A response sent
    with the body unread closes the connection."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        has_body = scope["method"] in ("POST", "PUT", "PATCH")
        if state.api_key and path not in OPEN_PATHS:
            if not hmac.compare_digest(_presented_key(scope["headers"]), state.api_key.encode()):
                resp = _error_response(path, 401, "invalid or missing API key (Authorization: Bearer or x-api-key)",
                                       headers={"connection": "close"} if has_body else None)
                return await resp(scope, receive, send)
        if not has_body:
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, complete = loop.time() + state.body_timeout, False

        async def timed_receive():
            nonlocal complete
            if complete:  # after the body: the disconnect watcher's wait, untimed
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(408, f"the request body did not arrive within {state.body_timeout:g} s",
                                             headers={"connection": "close"}) from None
            complete = msg["type"] != "http.request" or not msg.get("more_body", False)
            return msg

        await self.app(scope, timed_receive, send)


def _presented_key(headers) -> bytes:
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip()
    for name, value in headers:
        if name == b"x-api-key":
            return value.strip()
    return b""


def _body_doc(model) -> dict:
    """The OpenAPI request body of a route that reads and validates its body itself (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def _offload(limiter, fn, *args):
    return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=limiter)


def create_app(load: Callable[[], Any], *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = 8 << 20, max_waiting: int = 256, body_timeout: float = 30.0,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The app; `load()` returns (engine, tokenizer) and runs in a background thread at startup, then every
    program serving uses is compiled (or read from the compilation cache) before /health says ready.
    on_load_error(message): called if that fails (scripts/serve.py stops the server: it does not stay up half
    alive); without it the server keeps answering 503 with the error."""
    state = ServerState(model_name, api_key, max_body_bytes, max_waiting, body_timeout)

    def load_in_background():
        try:
            engine, tok = load()
            state.phase = "warming up"
            t0 = time.perf_counter()
            seconds = engine.warm_up()
            log.info("compiled %d programs in %.1f s (%s)", len(seconds), time.perf_counter() - t0,
                     ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
            cfg = engine.config
            state.engine, state.scheduler = engine, engine.scheduler
            state.vocab = Vocab(tok, cfg.eos_token_ids, cfg.vocab_size)
            state.vocab.ll_tokenizer  # built now, not by the first constrained request
            # What exists now (model, programs, tokenizer) lives as long as the server. A full garbage collection
            # walks every tracked object holding the GIL, which stalls the event loop and every stream (0.5-0.9 s
            # measured in a large test process); frozen objects are not walked again.
            gc.collect()
            gc.freeze()
            state.worker = EngineWorker(state.scheduler, max_waiting=max_waiting, metrics=state.metrics)
            log.info("ready")
        except BaseException as e:  # noqa: BLE001 -- reported by /health
            state.error = f"{type(e).__name__}: {e}"
            log.debug("loading the model failed", exc_info=True)
            if on_load_error is not None:
                on_load_error(state.error)
            else:
                log.error("loading the model failed: %s", state.error)

    async def lifespan(app):
        threading.Thread(target=load_in_background, name="jaxflash-load", daemon=True).start()
        yield
        if state.worker is not None:
            state.worker.stop()

    app = FastAPI(title="jaxflash", version="0.1.0", lifespan=lifespan, max_body_size=max_body_bytes)
    app.state.jaxflash = state
    app.add_middleware(Guard, state=state)

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in BODIES],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    # ----- errors ---------------------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error_response(request.url.path, e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        msg, where = _validation_message(e.errors())
        return _error_response(request.url.path, 400, msg, where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        headers = dict(e.headers or {})
        if e.status_code == 413:
            headers["connection"] = "close"  # the rest of the body is not read
            detail = f"request body over {state.max_body_bytes} bytes"
        else:
            detail = str(e.detail)
        return _error_response(request.url.path, e.status_code, detail, headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        if isinstance(e, ClientDisconnect):  # nobody to answer, nothing to log
            return Response(status_code=499)
        log.exception("internal error on %s", request.url.path)
        return _error_response(request.url.path, 500, f"internal error: {type(e).__name__}")

    def need_ready():
        if state.error:
            raise ApiError(503, f"the model failed to load: {state.error}")
        if not state.ready:
            raise ApiError(503, "the engine has stopped: " + state.worker.dead if state.worker else
                           f"the model is still {state.phase}", headers={"Retry-After": "5"})

    async def read_body(http: Request, model):
        """The body, parsed and validated in a worker thread. The JSON parser refuses lone surrogates, NaN and
        Infinity, which Python's json module would let through to fail later in the tokenizer or the reply."""
        try:
            raw = await http.body()
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected before sending the whole body") from None

        def parse():
            try:
                data = pydantic_core.from_json(raw, allow_inf_nan=False) if raw else None
            except ValueError as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            try:
                return model.model_validate(data)
            except ValidationError as e:
                raise ApiError(400, *_validation_message(e.errors(include_url=False))) from None

        return await _offload(state.prepare_limiter, parse)

    async def prepare(fn, *args):
        """Run request preparation off the loop, its PromptError/GrammarError as 400s."""

        def run():
            try:
                return fn(*args)
            except PromptError as e:
                raise ApiError(400, str(e), e.param) from None

        return await _offload(state.prepare_limiter, run)

    # ----- health, metrics, models, tokenization --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.ready:
            return {"status": "ok"}
        status = "error" if state.error or (state.worker and state.worker.dead) else state.phase
        return JSONResponse({"status": status, "error": state.error or (state.worker and state.worker.dead)},
                            status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "jaxflash",
                "max_model_len": state.scheduler.max_seq_len}

    @app.get("/v1/models")
    async def models():
        need_ready()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        need_ready()
        if model_id != state.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist (this server has {state.model_name!r})",
                           "model")
        return model_card()

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's endpoint: the tokenizer's configuration, as tokenizer_config.json holds it."""
        need_ready()
        cfg = dict(state.vocab.tokenizer.config)
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        cfg["model_max_length"] = state.scheduler.max_seq_len
        return cfg

    @app.post("/tokenize", openapi_extra=_body_doc(P.TokenizeRequest))
    async def tokenize(http: Request):
        need_ready()
        body = await read_body(http, P.TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages")
        ctx = state.scheduler.max_seq_len

        def run():
            if body.prompt is not None:
                return encode_text(state.vocab, body.prompt, ctx=ctx)
            return render_chat(state.vocab, openai_messages(body.messages), ctx=ctx,
                               allow_special=body.allow_special_tokens,
                               generation_prompt=body.add_generation_prompt).ids

        ids = await prepare(run)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx}

    @app.post("/detokenize", openapi_extra=_body_doc(P.DetokenizeRequest))
    async def detokenize(http: Request):
        need_ready()
        body = await read_body(http, P.DetokenizeRequest)
        vocab = state.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await prepare(state.vocab.tokenizer.decode, body.tokens)}

    # ----- building a request (these run off the event loop) ---------------------------------------------------
    def sampling_of(body, default_temperature: float = 1.0) -> SamplingParams:
        seed = body.seed if body.seed is not None else uuid.uuid4().int % 2**32
        t = body.temperature if body.temperature is not None else default_temperature
        return SamplingParams(float(t), max(0, int(body.top_k or 0)), float(body.top_p or 1.0),
                              float(body.min_p or 0.0), int(seed))

    def make_request(ids: list[int], max_tokens: int | None, sampling: SamplingParams, *, logprobs=None,
                     echo_logprobs=None) -> GenRequest:
        try:
            ids = state.scheduler.check_prompt(ids)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None
        ctx = state.scheduler.max_seq_len
        room = ctx - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the context of {ctx}",
                           "max_tokens")
        eos = frozenset(state.engine.config.eos_token_ids)
        return GenRequest(0, ids, room if max_tokens is None else max_tokens, sampling, eos, logprobs=logprobs,
                          echo_logprobs=echo_logprobs)

    def compile_constraint(*, response_format: P.ResponseFormat | None = None, guided_grammar: str | None = None,
                           forced_tools: list[dict] | None = None, parallel: bool = True,
                           output_schema: dict | None = None):
        """The request's output constraint (or None): at most one of a response_format, a guided_grammar, a
        forced tool choice and an Anthropic output format."""
        json_format = response_format is not None and response_format.type != "text"
        asked = [n for n, on in (("response_format", json_format), ("guided_grammar", guided_grammar is not None),
                                 ("tool_choice", forced_tools is not None),
                                 ("output_config", output_schema is not None)) if on]
        if len(asked) > 1:
            raise ApiError(400, f"give only one of {' and '.join(asked)}", asked[1])
        if not asked:
            return None
        param = asked[0]
        try:
            if guided_grammar is not None:
                if not guided_grammar.strip():
                    raise GrammarError("guided_grammar must be a Lark grammar")
                grammar, what = lark_grammar(_bounded(guided_grammar, "guided_grammar")), "guided_grammar"
            elif forced_tools is not None:
                tools = [{**t, "parameters": prepare_schema(t.get("parameters") or {"type": "object"},
                                                            strict=bool(t.get("strict")),
                                                            where=f"tools.{t['name']}.parameters")}
                         for t in forced_tools]
                lark = _bounded(tool_call_grammar(tools, parallel=parallel), "grammar of the forced tools")
                grammar, what = lark_grammar(lark), "forced tool call grammar"
            elif output_schema is not None:
                schema = prepare_schema(_bounded(output_schema, "schema"), strict=False,
                                        where="output_config.format.schema")
                grammar, what = json_grammar(schema), "JSON schema"
            elif response_format.type == "json_object":
                grammar, what = json_grammar(None), "JSON object"
            else:
                js = response_format.json_schema
                raw = js.schema_
                if raw is None and ("type" in js.model_extra or "properties" in js.model_extra):
                    raw = js.model_extra  # the schema given in place of {"name", "schema"}
                schema = prepare_schema(_bounded(raw, "schema"), strict=bool(js.strict),
                                        where="response_format.json_schema.schema")
                grammar, what = json_grammar(schema), "JSON schema"
            return GrammarConstraint(state.vocab, grammar, what)
        except GrammarError as e:
            raise ApiError(400, str(e), param) from None

    def _bounded(source, what: str):
        """The grammar or schema, if its text is within the limit (compiling costs grow with it)."""
        n = len(source) if isinstance(source, str) else len(json.dumps(source)) if isinstance(source, dict) else 0
        if n > P.MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the {what} is {n} characters; the limit is {P.MAX_GRAMMAR_BYTES}")
        return source

    def no_thinking(kwargs: dict, why: str) -> None:
        """A constrained reply starts at its first token: render the prompt in the model's non-thinking mode."""
        if kwargs.get("enable_thinking") is True:
            raise ApiError(400, f"thinking cannot be combined with {why} on this server", "chat_template_kwargs")
        kwargs["enable_thinking"] = False

    # ----- running one request ---------------------------------------------------------------------------------
    class Run:
        """One request in the engine: submitted on creation; cancelled when its client disconnects (a watcher
        waits for that on the connection) or when a stop string ends it; iterated as (event, parsed deltas),
        the parsing done in a worker thread. `close()` (idempotent) cancels it if it has not ended."""

        def __init__(self, req: GenRequest, parser: OutputParser, http: Request):
            self.req, self.parser, self.tokens = req, parser, 0
            try:
                self.ticket = state.worker.submit(req)
            except QueueFull as e:
                raise ApiError(503, f"server busy: {e}", headers={"Retry-After": "1"}) from None
            except RuntimeError as e:
                raise ApiError(503, str(e)) from None
            self._watch = asyncio.create_task(self._watch_client(http))
            self._ready: list = []

        async def _watch_client(self, http: Request) -> None:
            try:
                while (await http.receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # noqa: BLE001 -- a broken connection is a gone client
                pass
            state.worker.cancel(self.ticket)

        async def _batch(self) -> list:
            q = self.ticket.events
            batch = [await q.get()]
            while not q.empty():
                batch.append(q.get_nowait())
            if batch[-1].token is None:
                self.ticket.ended = True
            return batch

        def _parse(self, batch) -> list:
            out = []
            for ev in batch:
                if ev.token is None:
                    out.append((ev, self.parser.finish()))
                else:
                    self.tokens += 1
                    out.append((ev, self.parser.feed([ev.token])))
                if self.parser.stopped:
                    break
            return out

        async def start(self) -> None:
            """Wait for the first events (a streaming reply starts only then): a request that fails or is
            refused before its first token becomes a plain HTTP error, not a broken stream."""
            self._ready = await _offload(state.parse_limiter, self._parse, await self._batch())
            if self.ticket.ended and self.tokens == 0 and not self.parser.stopped:
                self.check()

        def check(self) -> None:
            """Raise the request's failure as an ApiError, if it failed."""
            fail = failure(self.req)
            if fail is not None:
                raise ApiError(*fail)

        def gone(self) -> bool:
            """It was cancelled because its client left."""
            return self.req.finish == "cancelled" and not self.parser.stopped

        async def __aiter__(self):
            while True:
                for ev, deltas in self._ready:
                    yield ev, deltas
                self._ready = []
                if self.parser.stopped:
                    state.worker.cancel(self.ticket, "stop")
                    return
                if self.ticket.ended:
                    return
                self._ready = await _offload(state.parse_limiter, self._parse, await self._batch())

        def close(self) -> None:
            self._watch.cancel()
            state.worker.cancel(self.ticket)

    def failure(req: GenRequest) -> tuple[int, str] | None:
        """(status, message) when the request ended in an error: an engine failure, or its grammar dead-ending."""
        if req.finish == "error":
            return 500, f"generation failed: {req.error}"
        failed = getattr(req.constraint, "failed", None) if req.finish == "stop" else None
        if failed:
            return 400, f"the output grammar failed: {failed}"
        return None

    async def collect(run: Run, take) -> bool:
        """Run a non-streaming request to its end, handing each event and its parsed deltas to take(ev, deltas).
        False when the client went away first."""
        try:
            await run.start()
            async for ev, deltas in run:
                take(ev, deltas)
        finally:
            run.close()
        if run.gone():
            return False
        run.check()
        return True

    async def begin_stream(run: Run) -> bool:
        """Start a streaming request (Run.start). False, with the run closed, when its client went away
        first; a failure before the first token closes it and raises (a plain HTTP error, not a broken stream)."""
        try:
            await run.start()
        except BaseException:
            run.close()
            raise
        if run.gone():
            run.close()
            return False
        return True

    def stream_error(path: str, status: int, message: str) -> dict:
        if _anthropic_path(path):
            return {"event": "error", "data": json.dumps(P.anthropic_error(status, message))}
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"data": json.dumps(P.openai_error(message, kind, code=status))}

    def token_text(t: int) -> str:
        return state.vocab.token_bytes[t].decode("utf-8", errors="replace")

    def lp_entry(tok: int, lp) -> dict:
        tb = state.vocab.token_bytes
        return {"token": token_text(tok), "logprob": lp[0], "bytes": list(tb[tok]),
                "top_logprobs": [{"token": token_text(a), "logprob": b, "bytes": list(tb[a])} for a, b in lp[1]]}

    # ----- OpenAI chat ---------------------------------------------------------------------------------------
    def prepare_chat(body: P.ChatCompletionRequest):
        tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []] or None
        choice, forced = body.tool_choice, None
        if choice == "none":
            tools = None
        elif choice == "required" or isinstance(choice, P.NamedToolChoice):
            if not tools:
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            forced = tools
            if isinstance(choice, P.NamedToolChoice):
                forced = [t for t in tools if t["name"] == choice.function.name]
                if not forced:
                    raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                                   "tool_choice")
        kwargs = dict(body.chat_template_kwargs or {})
        if forced is not None or (body.response_format is not None and body.response_format.type != "text"):
            no_thinking(kwargs, "a forced tool choice or a JSON response_format")
        prompt = render_chat(state.vocab, openai_messages(body.messages), tools=tools, kwargs=kwargs,
                             ctx=state.scheduler.max_seq_len, allow_special=body.allow_special_tokens,
                             continue_final=body.continue_final_message)
        req = make_request(prompt.ids, body.max_completion_tokens or body.max_tokens, sampling_of(body),
                           logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        req.constraint = compile_constraint(response_format=body.response_format, guided_grammar=body.guided_grammar,
                                            forced_tools=forced, parallel=body.parallel_tool_calls is not False)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        parser = OutputParser(state.vocab, stop=stop, tools=bool(tools),
                              reasoning=kwargs.get("enable_thinking", True) is not False,
                              in_reasoning=prompt.in_reasoning)
        return req, parser, len(prompt.ids)

    @app.post("/v1/chat/completions", openapi_extra=_body_doc(P.ChatCompletionRequest))
    async def chat(http: Request):
        need_ready()
        body = await read_body(http, P.ChatCompletionRequest)
        req, parser, n_prompt = await prepare(prepare_chat, body)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        run = Run(req, parser, http)

        def usage():
            return {"prompt_tokens": n_prompt, "completion_tokens": run.tokens,
                    "total_tokens": n_prompt + run.tokens}

        def finish_reason():
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

            if not await collect(run, take):
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
        if not await begin_stream(run):
            return Response(status_code=499)

        def chunk(delta: dict, finish=None, logprobs=None):
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return {"data": json.dumps(c)}

        async def stream():
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for ev, deltas in run:
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
                fail = failure(req)
                if fail is not None:
                    yield stream_error(http.url.path, *fail)
                else:
                    yield chunk({}, finish=finish_reason())
                    if include_usage:
                        yield {"data": json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                                   "model": state.model_name, "choices": [], "usage": usage()})}
            except Exception:  # noqa: BLE001 -- the stream still ends as the protocol says
                log.exception("the stream of %s failed", rid)
                yield stream_error(http.url.path, 500, "internal error while streaming")
            finally:
                run.close()
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), ping=15)

    # ----- OpenAI completions ----------------------------------------------------------------------------------
    def prepare_completion(body: P.CompletionRequest):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request (batches: send concurrent requests)", "prompt")
            prompt = prompt[0]
        ctx = state.scheduler.max_seq_len
        ids = encode_text(state.vocab, prompt, ctx=ctx) if isinstance(prompt, str) else list(prompt)
        if body.max_tokens == 0 and not (body.echo and body.logprobs is not None):
            raise ApiError(400, "max_tokens 0 is only meaningful with echo and logprobs (prompt scoring)",
                           "max_tokens")
        echo_lp = body.logprobs if (body.echo and body.logprobs is not None) else None
        req = make_request(ids, body.max_tokens, sampling_of(body), logprobs=body.logprobs, echo_logprobs=echo_lp)
        req.constraint = compile_constraint(response_format=body.response_format, guided_grammar=body.guided_grammar)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        prefix = (prompt if isinstance(prompt, str) else state.vocab.tokenizer.decode(req.prompt)) if body.echo else ""
        return req, OutputParser(state.vocab, stop=stop), prefix

    @app.post("/v1/completions", openapi_extra=_body_doc(P.CompletionRequest))
    async def completions(http: Request):
        need_ready()
        body = await read_body(http, P.CompletionRequest)
        req, parser, prefix = await prepare(prepare_completion, body)
        ids = req.prompt
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        offsets = _TextOffsets(state.vocab.token_bytes)
        run = Run(req, parser, http)

        def finish_reason():
            return "length" if req.finish == "length" and not parser.stopped else "stop"

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": run.tokens, "total_tokens": len(ids) + run.tokens}

        def legacy_logprobs(pairs):
            """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (the character
            in the returned text where each token's first byte falls)."""
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for tok, lp in pairs:
                out["tokens"].append(token_text(tok))
                out["token_logprobs"].append(None if lp is None else lp[0])
                out["top_logprobs"].append(None if lp is None else {token_text(a): b for a, b in lp[1]})
                out["text_offset"].append(offsets.at(tok))
            return out

        if not body.stream:
            texts, pairs = [], []

            def take(ev, deltas):
                if ev.token is not None:
                    pairs.append((ev.token, ev.logprob))
                texts.extend(d[1] for d in deltas if d[0] == "text")

            if not await collect(run, take):
                return Response(status_code=499)
            logprobs = None
            if body.logprobs is not None:
                head = list(zip(ids, req.prompt_logprobs)) if req.echo_logprobs is not None else []
                logprobs = legacy_logprobs(head + pairs)
            return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [{"index": 0, "text": prefix + "".join(texts), "logprobs": logprobs,
                                 "finish_reason": finish_reason()}], "usage": usage()}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if not await begin_stream(run):
            return Response(status_code=499)

        def chunk(text: str, finish=None, logprobs=None):
            return {"data": json.dumps({"id": rid, "object": "text_completion", "created": created,
                                        "model": state.model_name, "choices": [
                                            {"index": 0, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish}]})}

        async def stream():
            try:
                if prefix:
                    head = list(zip(ids, req.prompt_logprobs)) if req.echo_logprobs is not None else []
                    yield chunk(prefix, logprobs=legacy_logprobs(head) if head else None)
                async for ev, deltas in run:
                    text = "".join(d[1] for d in deltas if d[0] == "text")
                    lp = legacy_logprobs([(ev.token, ev.logprob)]) if (ev.token is not None and ev.logprob) else None
                    if text or lp:
                        yield chunk(text, logprobs=lp)
                fail = failure(req)
                if fail is not None:
                    yield stream_error(http.url.path, *fail)
                else:
                    yield chunk("", finish=finish_reason())
                    if include_usage:
                        yield {"data": json.dumps({"id": rid, "object": "text_completion", "created": created,
                                                   "model": state.model_name, "choices": [], "usage": usage()})}
            except Exception:  # noqa: BLE001 -- the stream still ends as the protocol says
                log.exception("the stream of %s failed", rid)
                yield stream_error(http.url.path, 500, "internal error while streaming")
            finally:
                run.close()
            yield {"data": "[DONE]"}

        return EventSourceResponse(stream(), ping=15)

    # ----- Anthropic messages ----------------------------------------------------------------------------------
    def anthropic_prompt(body, *, constrained: str | None = None):
        """The prompt of a Messages or count_tokens body (tool_use -> tool_calls, tool_result -> tool), with the
        tools it shows the model and the forced tool list (or None)."""
        msgs: list[dict] = []
        if body.system:
            sys_text = body.system if isinstance(body.system, str) else "".join(
                b.text or "" for b in body.system if b.type == "text")
            msgs.append({"role": "system", "content": sys_text})
        for m in body.messages:
            if isinstance(m.content, str):
                msgs.append({"role": m.role, "content": m.content})
                continue
            text, calls, thinking = [], [], []
            for b in m.content:
                if b.type == "text":
                    text.append(b.text or "")
                elif b.type == "thinking":
                    thinking.append(b.thinking or "")
                elif b.type == "redacted_thinking":
                    continue
                elif b.type == "tool_use" and m.role == "assistant":
                    calls.append({"id": b.id, "type": "function",
                                  "function": {"name": b.name or "", "arguments": b.input or {}}})
                elif b.type == "tool_result" and m.role == "user":
                    content = b.content if isinstance(b.content, str) else "".join(
                        c.text or "" for c in (b.content or []) if c.type == "text")
                    msgs.append({"role": "tool", "content": content, "tool_call_id": b.tool_use_id})
                else:
                    raise ApiError(400, f"a {m.role} message cannot hold a {b.type!r} block here", "messages")
            if text or calls or (m.role == "user" and not (msgs and msgs[-1]["role"] == "tool")):
                d = {"role": m.role, "content": "".join(text)}
                if calls:
                    d["tool_calls"] = calls
                if thinking:
                    d["reasoning_content"] = "".join(thinking)
                msgs.append(d)
        tools = [{"name": t.name, "description": t.description or "", "parameters": t.input_schema,
                  **({"strict": t.strict} if t.strict is not None else {})} for t in body.tools or []] or None
        choice, forced = body.tool_choice, None
        if choice is not None and choice.type == "none":
            tools = None
        elif choice is not None and choice.type in ("any", "tool"):
            if not tools:
                raise ApiError(400, f"tool_choice {choice.type} needs tools", "tool_choice")
            forced = [t for t in tools if choice.type == "any" or t["name"] == choice.name]
            if not forced:
                raise ApiError(400, f"tool_choice names {choice.name!r}, which is not in tools", "tool_choice")
        thinking_on = body.thinking is not None and body.thinking.type != "disabled"
        if thinking_on and (forced is not None or constrained):
            raise ApiError(400, f"thinking cannot be combined with {constrained or 'a forced tool_choice'}",
                           "thinking")
        prompt = render_chat(state.vocab, msgs, tools=tools, kwargs={"enable_thinking": thinking_on},
                             ctx=state.scheduler.max_seq_len, allow_special=body.allow_special_tokens)
        return prompt, tools, forced

    @app.post("/v1/messages/count_tokens", openapi_extra=_body_doc(P.CountTokensRequest))
    async def count_tokens(http: Request):
        need_ready()
        body = await read_body(http, P.CountTokensRequest)
        prompt, _, _ = await prepare(anthropic_prompt, body)
        return {"input_tokens": len(prompt.ids)}

    def prepare_messages(body: P.MessagesRequest):
        fmt = body.output_config.format if body.output_config is not None else None
        prompt, tools, forced = anthropic_prompt(body, constrained="output_config.format" if fmt else None)
        req = make_request(prompt.ids, body.max_tokens, sampling_of(body))
        parallel = not (body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use)
        req.constraint = compile_constraint(guided_grammar=body.guided_grammar, forced_tools=forced,
                                            parallel=parallel, output_schema=fmt.schema_ if fmt else None)
        parser = OutputParser(state.vocab, stop=list(body.stop_sequences or []), tools=bool(tools), reasoning=True,
                              in_reasoning=prompt.in_reasoning)
        return req, parser, len(prompt.ids)

    @app.post("/v1/messages", openapi_extra=_body_doc(P.MessagesRequest))
    async def messages(http: Request):
        need_ready()
        body = await read_body(http, P.MessagesRequest)
        req, parser, n_prompt = await prepare(prepare_messages, body)
        mid = "msg_" + uuid.uuid4().hex[:24]
        run = Run(req, parser, http)

        def stop_reason():
            if parser.stopped:
                return "stop_sequence"
            if parser.calls:
                return "tool_use"
            return "max_tokens" if req.finish == "length" else "end_turn"

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

            if not await collect(run, take):
                return Response(status_code=499)
            for c in parser.calls:
                blocks.append({"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["name"],
                               "input": json.loads(c["arguments"])})
            return {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": blocks,
                    "stop_reason": stop_reason(), "stop_sequence": parser.stop_hit,
                    "usage": {"input_tokens": n_prompt, "output_tokens": run.tokens}}

        if not await begin_stream(run):
            return Response(status_code=499)

        def event(kind: str, data: dict) -> dict:
            return {"event": kind, "data": json.dumps({"type": kind, **data})}

        async def stream():
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

            try:
                yield event("message_start", {"message": {
                    "id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
                yield event("ping", {})
                async for ev, deltas in run:
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
                            for e in open_block("tool_use", {"type": "tool_use", "id": "toolu_" + d[2][5:],
                                                             "name": d[3], "input": {}}):
                                yield e
                            tool_index[d[1]] = index
                        elif d[0] == "tool_args":
                            yield event("content_block_delta", {"index": tool_index[d[1]], "delta": {
                                "type": "input_json_delta", "partial_json": d[2]}})
                if open_kind is not None:
                    yield event("content_block_stop", {"index": index})
                fail = failure(req)
                if fail is not None:
                    yield stream_error(http.url.path, *fail)
                    return
                yield event("message_delta", {"delta": {"stop_reason": stop_reason(),
                                                        "stop_sequence": parser.stop_hit},
                                              "usage": {"output_tokens": run.tokens}})
                yield event("message_stop", {})
            except Exception:  # noqa: BLE001 -- the stream still ends as the protocol says
                log.exception("the stream of %s failed", mid)
                yield stream_error(http.url.path, 500, "internal error while streaming")
            finally:
                run.close()

        return EventSourceResponse(stream(), ping=15)

    return app


class _TextOffsets:
    """Character offsets of tokens in the text they decode to, fed in order: a token's offset is that of the
    character its first byte belongs to (a token that continues a multi-byte character shares its offset)."""

    def __init__(self, token_bytes):
        self.token_bytes, self.chars = token_bytes, 0

    def at(self, tok: int) -> int:
        b = self.token_bytes[tok]
        here = self.chars - 1 if (b and (b[0] & 0xC0) == 0x80 and self.chars) else self.chars
        self.chars += sum(1 for x in b if (x & 0xC0) != 0x80)
        return here
