"""An OpenAI-compatible HTTP server over the online scheduler (`specjax serve`).

POST /v1/completions and /v1/chat/completions (the model's chat template), `stream: true` as
server-sent events; GET /v1/models, /health and /metrics (Prometheus text). Each response's
`usage` also carries the speculative figures of its request: `draft_tokens` (tree nodes past the
root verified), `accepted_draft_tokens`, `acceptance_rate` and `steps` (target passes), in the
last stream chunk too (with `stream_options.include_usage`, in a chunk of its own after it, as
OpenAI sends it). Bad fields get HTTP 400 with a one-line message naming the field, a full
queue 429 with Retry-After; a client that goes away frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import math
import os
import signal
import time
import uuid

from fastapi import FastAPI, Request  # the serve extra: pip install 'specjax[serve]'
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specjax.batching import MAX_SEED
from specjax.prompts import PromptError, encode_chat
from specjax.sampling import SamplingConfig
from specjax.serving.metrics import RequestMetrics
from specjax.serving.scheduler import LOOP_STOPPED, Finished, QueueFull, RequestError, Unavailable
from specjax.token_logprobs import MAX_TOP_LOGPROBS

DISCONNECT_POLL = 0.5  # seconds between looks at whether a waiting client is still there
MAX_REQUEST_BYTES = 1 << 20  # a request body larger than this gets 413 (--max-request-bytes)
# Fields of OpenAI's API this server does not implement: a request that sets one to anything
# but its neutral value gets 400 naming it, rather than an answer that silently ignores it.
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


class FieldError(ValueError):
    """A request field that is missing, of the wrong type or out of range (HTTP `status`)."""

    def __init__(self, field: str | None, message: str, status: int = 400):
        super().__init__(f"'{field}' {message}" if field else message)
        self.field, self.status = field, status


def _number(body, field, default, kind=float, lo=None, hi=None, lo_open=False):
    value = body.get(field, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not math.isfinite(value))
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        shown = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
        raise FieldError(field, f"must be {'an integer' if kind is int else 'a finite number'}, got {shown}")
    value = kind(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise FieldError(field, f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise FieldError(field, f"must be <= {hi}, got {value}")
    return value


def _text(field: str, value: str) -> str:
    """`value`, refused when it cannot be encoded (a lone surrogate such as "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FieldError(field, "is not valid Unicode text (it holds a lone surrogate)") from None
    return value


def _is_neutral(value, neutral: tuple) -> bool:
    """Whether `value` is one of `neutral` (true/false never stand for 1/0)."""
    return any(
        value is None if v is None else (isinstance(value, bool) == isinstance(v, bool) and value == v) for v in neutral
    )


def _content(content) -> str:
    """A message's content: a string, or a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return _text("messages", content)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return _text("messages", "\n".join(p["text"] for p in content))
    raise FieldError("messages", "content must be a string or a list of text parts ({type: text, text})")


def _logprobs_wanted(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a request's `logprobs` asks for (None: no logprobs).
    Chat: `logprobs: true` and `top_logprobs` N; completions: `logprobs` N (OpenAI's two forms)."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise FieldError("logprobs", f"must be true or false, got {json.dumps(wanted)}")
        top = _number(body, "top_logprobs", None, int, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return (top or 0) if wanted else None
    if body.get("logprobs") is False:  # off, as some clients send it
        return None
    return _number(body, "logprobs", None, int, lo=0, hi=MAX_TOP_LOGPROBS)


def logprobs_body(tokenizer, ids: list[int], entries: list, top: int, chat: bool, offset: int = 0) -> dict:
    """OpenAI's `logprobs` object for tokens `ids` and their (log p, alternatives) `entries`:
    chat's `content` list, or the completions' parallel lists (`text_offset` from `offset`)."""
    text = [tokenizer.decode([i]) for i in ids]
    alternatives = [[(tokenizer.decode([i]), lp) for i, lp in alt[:top]] for _, alt in entries]
    if chat:
        return {
            "content": [
                {
                    "token": t,
                    "logprob": lp,
                    "bytes": list(t.encode("utf-8", "replace")),
                    "top_logprobs": [
                        {"token": a, "logprob": alp, "bytes": list(a.encode("utf-8", "replace"))} for a, alp in alt
                    ],
                }
                for t, (lp, _), alt in zip(text, entries, alternatives)
            ]
        }
    offsets = [offset + sum(map(len, text[:i])) for i in range(len(text))]
    return {
        "tokens": text,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [dict(alt) for alt in alternatives] if top else None,
        "text_offset": offsets,
    }


def parse_options(body: dict, chat: bool = False) -> dict:
    """Sampling and length options of a request body (FieldError naming a bad field)."""
    temperature = _number(body, "temperature", 1.0, lo=0.0, hi=2.0)
    top_p = _number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _number(body, "top_k", 0, int, lo=-1)
    if top_k == -1:  # vLLM's "off"
        top_k = 0
    max_tokens = _number(body, "max_tokens", None, int, lo=1)
    if max_tokens is None:  # None: as many as fit in the context (`create_app`)
        max_tokens = _number(body, "max_completion_tokens", None, int, lo=1)
    for field, neutral in UNSUPPORTED.items():
        if field in body and not _is_neutral(body[field], neutral):
            raise FieldError(field, "is not supported by this server")
    seed = _number(body, "seed", 0, int, lo=-(2**31), hi=MAX_SEED)
    n = _number(body, "n", 1, int, lo=1)
    if n != 1:
        raise FieldError("n", f"must be 1 (one answer per request), got {n}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise FieldError("stop", "must be a string or a list of strings")
    stop = [_text("stop", s) for s in stop if s]
    if len(stop) > 4:
        raise FieldError("stop", f"takes at most 4 sequences, got {len(stop)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise FieldError("stream", f"must be true or false, got {json.dumps(stream)}")
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise FieldError("stream_options", "applies only with stream: true")
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise FieldError("stream_options", "takes {include_usage: true|false} only")
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise FieldError("stream_options", "include_usage must be true or false")
    return dict(
        sampling=SamplingConfig(temperature, top_k, top_p),
        max_tokens=max_tokens,
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        logprobs=_logprobs_wanted(body, chat),
    )


class TextStream:
    """Incremental detokenization with stop strings: `push(tokens)` returns the new text that is
    safe to send (no partial character, nothing that may still become a stop string) and whether
    a stop string ended the answer."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.sent = 0  # characters of the text sent
        self.text = ""
        self.stopped = False

    def push(self, tokens: list[int], final: bool = False) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            text, self.stopped, final = text[: min(hits)], True, True
        safe = len(text)
        if not final:
            while safe > self.sent and text[safe - 1] == "\ufffd":
                safe -= 1  # a character whose bytes have not all arrived
            for s in self.stop:  # the text's end may be the start of a stop string
                for k in range(min(len(s) - 1, safe - self.sent), 0, -1):
                    if text[safe - k : safe] == s[:k]:
                        safe -= k
                        break
        self.text = text
        out, self.sent = text[self.sent : safe], max(self.sent, safe)
        return out


def usage_of(handle, prompt_tokens: int) -> dict:
    completion = len(handle.tokens)
    drafted = handle.draft_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "steps": handle.steps,
        "draft_tokens": drafted,
        "accepted_draft_tokens": handle.accepted_draft_tokens,
        "acceptance_rate": round(handle.accepted_draft_tokens / drafted, 4) if drafted else 0.0,
        "prompt_tokens_details": {"cached_tokens": handle.cached_tokens},
    }


def _finish_reason(finished: Finished, stream: TextStream) -> str:
    if stream.stopped or finished.reason == "stop":
        return "stop"
    return "length"


def create_app(
    scheduler,
    tokenizer,
    model_name: str,
    exit_on_failure: bool = False,
    *,
    aliases: tuple = (),
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    max_input_tokens: int | None = None,
    method: str = "",
    access_log: bool = False,
):
    """The FastAPI application serving `scheduler` (started and stopped with the app).

    model_name and its `aliases` are the names a request's `model` may give (others: 404).
    api_key: /v1 requests need `Authorization: Bearer <api_key>` (401). Bodies over
    max_request_bytes get 413; prompts over max_input_tokens tokens get 400.

    exit_on_failure (`specjax serve`): when the decoding loop stops for good, the process gets
    SIGTERM a second later (every waiting request has had its 503 by then), so that the command
    exits non-zero and a supervisor restarts it. method: the label of /metrics' acceptance
    histogram. access_log: one line per request on the `specjax.access` logger (`AccessLog`)."""

    async def watch():
        while scheduler.error is None:
            await asyncio.sleep(0.25)
        await asyncio.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if scheduler._thread is None:
            scheduler.start()
        watcher = asyncio.create_task(watch()) if exit_on_failure else None
        yield
        if watcher is not None:
            watcher.cancel()
        # requests still running when the server stops are cancelled (uvicorn waited for them)
        await asyncio.get_running_loop().run_in_executor(None, lambda: scheduler.stop(drain=False, timeout=5))

    app = FastAPI(title="specjax", lifespan=lifespan)
    names = {model_name, *aliases}
    created = int(time.time())

    statuses: collections.Counter = collections.Counter()  # HTTP responses by status, for /metrics
    request_metrics = RequestMetrics((method or "speculative") if scheduler.proposer is not None else None)
    if access_log:
        app.add_middleware(AccessLog)

    def error(status: int, message: str, param: str | None = None, headers=None):
        statuses[status] += 1
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": param, "code": None}},
            status_code=status,
            headers=headers,
        )

    async def read_body(request: Request) -> dict:
        """The request's JSON object, read no further than `max_request_bytes` (413 past it)."""
        too_large = FieldError(None, f"the request body is larger than {max_request_bytes} bytes", 413)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_request_bytes:
            raise too_large
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_request_bytes:
                raise too_large
        try:
            body = json.loads(bytes(data))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FieldError("body", "is not valid JSON") from None
        if not isinstance(body, dict):
            raise FieldError("body", "must be a JSON object")
        return body

    def unauthorized(request: Request):
        """401 unless the request carries the server's API key (when it has one)."""
        given = request.headers.get("authorization", "")
        if api_key is None or hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return error(
            401, "a valid API key is needed (Authorization: Bearer <key>)", headers={"WWW-Authenticate": "Bearer"}
        )

    def room_for(prompt: list[int], field: str) -> int:
        """The most new tokens that fit after `prompt` in the context and the KV pool."""
        engine = scheduler.engine
        if max_input_tokens is not None and len(prompt) > max_input_tokens:
            raise FieldError(field, f"has {len(prompt)} tokens, more than this server's {max_input_tokens}")
        pool = engine.allocator.num_pages * engine.page_size - scheduler.scratch
        room = min(engine.max_context, pool) - len(prompt)
        if room < 1:
            raise FieldError(
                field,
                f"has {len(prompt)} tokens, leaving no room for an answer in the model's context of "
                f"{engine.max_context} tokens and the server's KV cache",
            )
        return room

    async def serve(request: Request, chat: bool):
        if (denied := unauthorized(request)) is not None:
            return denied
        field = "messages" if chat else "prompt"
        try:
            body = await read_body(request)
            options = parse_options(body, chat)
            if body.get("model") is not None and body["model"] not in names:
                raise FieldError(
                    "model", f"'{body['model']}' is not served here (this server serves {model_name})", 404
                )
            if chat:
                messages = body.get("messages")
                if not (
                    isinstance(messages, list)
                    and messages
                    and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
                ):
                    raise FieldError("messages", "must be a non-empty list of {role, content} objects")
                try:
                    turns = [
                        {"role": _text("messages", m["role"]), "content": _content(m.get("content"))} for m in messages
                    ]
                    prompt = encode_chat(tokenizer, turns)
                except PromptError as e:
                    raise FieldError("messages", str(e)) from None
            else:
                text = body.get("prompt")
                if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                    text = text[0]
                if not isinstance(text, str) or not text:
                    raise FieldError("prompt", "must be a non-empty string")
                _text("prompt", text)
                prompt = list(tokenizer(text).input_ids)
            room = room_for(prompt, field)
            if options["max_tokens"] is None:
                options["max_tokens"] = room
        except FieldError as e:
            return error(e.status, str(e), e.field)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        try:
            handle = scheduler.submit(
                prompt,
                options["max_tokens"],
                sampling=options["sampling"],
                seed=options["seed"],
                notify=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                logprobs=options["logprobs"] is not None,
            )
        except Unavailable as e:
            return error(503, str(e))
        except QueueFull as e:
            return error(429, str(e), headers={"Retry-After": "1"})
        except RequestError as e:
            return error(400, str(e), "max_tokens" if "max_tokens" in str(e) else field)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        text = TextStream(tokenizer, options["stop"])

        def token_logprobs_since(first: int) -> dict | None:
            """The `logprobs` of the answer's tokens from `first` on (None when not asked)."""
            if options["logprobs"] is None:
                return None
            n = len(text.tokens)
            offset = len(tokenizer.decode(text.tokens[:first], skip_special_tokens=True)) if first else 0
            return logprobs_body(
                tokenizer, text.tokens[first:n], handle.token_logprobs[first:n], options["logprobs"], chat, offset
            )

        async def next_text():
            """(new text, Finished or None) after the next event; cancels on a stop string."""
            ev = await events.get()
            if isinstance(ev, Finished):
                return text.push([], final=True), ev
            piece = text.push(ev)
            if text.stopped:
                handle.cancel()
            return piece, None

        if not options["stream"]:
            try:
                pieces, finished = [], None
                while finished is None:
                    try:  # a client that has gone is noticed within DISCONNECT_POLL seconds
                        piece, finished = await asyncio.wait_for(next_text(), DISCONNECT_POLL)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            scheduler.stats["disconnected"] += 1
                            return None  # the finally below cancels it: its slot frees next round
                        continue
                    pieces.append(piece)
                    if text.stopped and finished is None:
                        finished = Finished("stop")  # the rest of the answer is not needed
            finally:
                handle.cancel()  # the client may have gone; a finished request ignores it
            if finished.reason == "error":
                return error(503 if finished.message == LOOP_STOPPED else 500, finished.message)
            usage = usage_of(handle, len(prompt))
            usage["completion_tokens"] = len(text.tokens)
            usage["total_tokens"] = len(prompt) + len(text.tokens)
            request.state.tokens = (len(prompt), len(text.tokens))
            request_metrics.observe(handle)
            reason = _finish_reason(finished, text)
            answer = "".join(pieces)
            logprobs = token_logprobs_since(0)
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": answer},
                    "finish_reason": reason,
                    "logprobs": logprobs,
                }
            else:
                choice = {"index": 0, "text": answer, "finish_reason": reason, "logprobs": logprobs}
            statuses[200] += 1
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": model_name,
                    "choices": [choice],
                    "usage": usage,
                }
            )

        logged = [0]  # tokens whose logprobs a chunk has carried

        def chunk(piece: str | None, reason: str | None, usage=None, first=False, choices=True) -> str:
            logprobs = None
            if choices and not first and options["logprobs"] is not None:
                logprobs, logged[0] = token_logprobs_since(logged[0]), len(text.tokens)
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": reason, "logprobs": logprobs}
            out = {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice] if choices else [],
            }
            if usage is not None or options["include_usage"]:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        async def sse():
            try:
                if chat:
                    yield chunk(None, None, first=True)
                finished = None
                while finished is None:
                    piece, finished = await next_text()
                    if text.stopped and finished is None:
                        finished = Finished("stop")
                    if finished is not None and finished.reason == "error":
                        yield f"data: {json.dumps({'error': {'message': finished.message}})}\n\n"
                        return
                    if finished is None:
                        if piece:
                            yield chunk(piece, None)
                        continue
                    usage = usage_of(handle, len(prompt))
                    usage["completion_tokens"] = len(text.tokens)
                    usage["total_tokens"] = len(prompt) + len(text.tokens)
                    request.state.tokens = (len(prompt), len(text.tokens))
                    request_metrics.observe(handle)
                    if options["include_usage"]:  # OpenAI's form: a last chunk without choices
                        yield chunk(piece, _finish_reason(finished, text))
                        yield chunk(None, None, usage, choices=False)
                    else:
                        yield chunk(piece, _finish_reason(finished, text), usage)
                yield "data: [DONE]\n\n"
            finally:
                handle.cancel()  # a client that went away frees its slot; no-op when finished

        statuses[200] += 1
        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specjax"}],
        }

    @app.get("/health")
    async def health():
        if scheduler.error is not None:
            return error(503, LOOP_STOPPED)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            prometheus_text(scheduler, statuses, request_metrics), media_type="text/plain; version=0.0.4"
        )

    return app


def prometheus_text(scheduler, statuses=None, request_metrics: RequestMetrics | None = None) -> str:
    """The scheduler's counters and gauges, the KV pool's use, the HTTP responses by status
    (`statuses`) and the requests' histograms, in Prometheus' text format."""
    s = scheduler.stats
    allocator = scheduler.engine.allocator
    rows = [
        ("specjax_requests_total", "counter", "requests accepted into the queue", s["requests"]),
        ("specjax_requests_finished_total", "counter", "requests answered in full", s["finished"]),
        (
            "specjax_requests_cancelled_total",
            "counter",
            "requests cancelled (client gone, stop string)",
            s["cancelled"],
        ),
        ("specjax_queue_depth", "gauge", "requests waiting for a slot", scheduler.queue_depth()),
        ("specjax_kv_pages_total", "gauge", "pages of the KV cache pool", allocator.num_pages),
        (
            "specjax_kv_pages_used",
            "gauge",
            "pages held by requests or cached prefixes",
            allocator.num_pages - allocator.num_free,
        ),
        ("specjax_running_requests", "gauge", "requests holding a slot", scheduler.busy()),
        ("specjax_generated_tokens_total", "counter", "tokens generated", s["new_tokens"]),
        ("specjax_steps_total", "counter", "decoding steps (target passes) of the batch", s["steps"]),
        ("specjax_step_seconds_total", "counter", "seconds spent in decoding steps", round(s["step_seconds"], 6)),
        (
            "specjax_accepted_draft_tokens_total",
            "counter",
            "drafted tokens accepted (finished requests)",
            s["accepted_draft_tokens"],
        ),
        (
            "specjax_tokens_per_step",
            "gauge",
            "tokens generated per batch step so far",
            round(s["new_tokens"] / s["steps"], 4) if s["steps"] else 0.0,
        ),
    ]
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    if statuses is not None:
        name = "specjax_http_responses_total"
        out += [f"# HELP {name} HTTP responses by status", f"# TYPE {name} counter"]
        out += [f'{name}{{status="{code}"}} {n}' for code, n in sorted(statuses.items())]
    if request_metrics is not None:
        out += request_metrics.text()
    return "\n".join(out) + "\n"


class AccessLog:
    """ASGI middleware: one line per HTTP request on the `specjax.access` logger once its
    response has gone out (a stream's last chunk included): client, method, path, status,
    milliseconds and, for a generation, its prompt/completion tokens."""

    def __init__(self, app):
        self.app, self.log = app, logging.getLogger("specjax.access")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]

        async def send_noting_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            client = scope.get("client") or ("-", 0)
            tokens = scope.get("state", {}).get("tokens")
            self.log.info(
                '%s "%s %s" %d %.1f ms%s',
                client[0],
                scope["method"],
                scope["path"],
                status[0],
                1000 * (time.perf_counter() - t0),
                f" tokens {tokens[0]}/{tokens[1]}" if tokens else "",
            )


@contextlib.contextmanager
def running_in_thread(app, host: str = "127.0.0.1", port: int = 0):
    """Serve `app` with uvicorn on a thread of this process (tests, benchmarks); yields its base
    URL (port 0: a free port), and stops it on exit."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(60)
