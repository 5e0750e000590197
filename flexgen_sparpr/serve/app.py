"""The HTTP routes (Starlette): the OpenAI endpoints, /health, /metrics and the chat page.

The model loads on a thread once the server listens, so /health and the endpoints answer 503
until it is ready. Every failure is an OpenAI-shaped JSON error; an unexpected one is a 500 and
one logged line, never a traceback to the client."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.applications import Starlette
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..api.resolved import resolved
from .batcher import Batcher, Ticket
from .errors import ApiError, bad
from .metrics import Metrics
from .requests import parse
from .responses import Shaper

log = logging.getLogger("flexgen_sparpr.serve")
STATIC = Path(__file__).resolve().parent / "static"


class ServerState:
    """One engine per process: make_llm() builds the LLM (on the loading thread); then a
    Batcher runs it. close() drains the batcher and frees the LLM (its offload files)."""

    def __init__(self, make_llm, model_name: str, api_key: str | None = None, max_queue: int = 64,
                 batch_window_s: float = 0.0):
        self.make_llm, self.model_name, self.api_key = make_llm, model_name, api_key
        self.max_queue, self.batch_window_s = max_queue, batch_window_s
        self.llm = self.batcher = None
        self.config: dict | None = None  # the engine's settings as resolved (api/resolved.py), once loaded
        self.load_error: str | None = None
        self.metrics = Metrics()
        self.on_load_error = None  # called with the error line (the command stops the server)

    def load(self) -> None:
        try:
            llm = self.make_llm()
        except BaseException as e:  # noqa: BLE001  (reported as one line by the command)
            self.load_error = e
            if self.on_load_error is not None:
                self.on_load_error(e)
            return
        self.batcher = Batcher(llm, self.max_queue, self.batch_window_s, self.metrics.on_batch)
        self.config = resolved(llm)
        self.llm = llm
        self.metrics.loaded.set(1)

    def ready(self):
        if self.llm is None:
            raise ApiError(503, "the model is loading" if self.load_error is None else "the model failed to load",
                           code="loading")
        return self.llm

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()
        if self.llm is not None:
            self.llm.close()


def build_app(state: ServerState) -> Starlette:
    AppStatus.disable_automatic_graceful_drain()  # a SIGTERM drains the streams in flight, not cuts them

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=state.load, name="flexgen-load", daemon=True).start()
        yield
        await asyncio.to_thread(state.close)

    async def completions(request):
        return await _generate(state, request, "completion")

    async def chat(request):
        return await _generate(state, request, "chat")

    async def health(request):
        if state.llm is None:
            return JSONResponse({"status": "loading" if state.load_error is None else "failed"}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name, "resolved": state.config})

    async def models(request):
        try:
            _auth(state, request)
        except ApiError as e:
            return _error(state, request, e)
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "flexgen-sparpr"}
        if state.llm is not None:
            card["max_model_len"] = state.llm.spec.context_limit()[0]
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request):
        if state.batcher is not None:
            state.metrics.queue.set(state.batcher.queue_depth)
            state.metrics.running.set(len(state.batcher.running))
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4")

    async def page(request):
        return FileResponse(STATIC / "index.html")

    routes = [Route("/", page), Route("/health", health), Route("/metrics", metrics),
              Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]), Mount("/static", StaticFiles(directory=STATIC))]
    return Starlette(routes=routes, lifespan=lifespan)


def _auth(state: ServerState, request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
        raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>' with the server's --api-key",
                       code="invalid_api_key")


def _error(state: ServerState, request, e: ApiError) -> JSONResponse:
    state.metrics.requests.labels(request.url.path, str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status)


async def _generate(state: ServerState, request, kind: str):
    try:
        _auth(state, request)
        llm = state.ready()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise bad("the body is not valid JSON") from None
        req = parse(body, kind, llm, state.model_name)
        state.batcher.check_kv(req)
        ticket = Ticket(req, asyncio.get_running_loop())
        state.batcher.submit(ticket)
    except ApiError as e:
        return _error(state, request, e)
    except Exception as e:  # noqa: BLE001
        log.error("%s failed: %s: %s", request.url.path, type(e).__name__, " ".join(str(e).split())[:300])
        return _error(state, request, ApiError(500, "internal error (logged on the server)"))
    shaper = Shaper(kind, state.model_name, llm.tokenizer)
    if req.stream:
        return EventSourceResponse(_stream(state, request, ticket, shaper), sep="\n", ping=15)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        while True:
            get = asyncio.ensure_future(ticket.events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:  # the client left: the finally cancels its request
                get.cancel()
                state.metrics.requests.labels(request.url.path, "499").inc()
                return Response(status_code=499)
            what, payload = get.result()
            if what == "error":
                return _error(state, request, payload)
            if what == "done":
                state.metrics.requests.labels(request.url.path, "200").inc()
                return JSONResponse(shaper.whole(ticket.answer, len(req.ids), payload))
    finally:
        gone.cancel()
        _ended(state, ticket)


async def _client_gone(request) -> None:
    """Returns once the client of a whole (not streamed) answer has disconnected (a stream's
    leaving cancels its generator instead)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(state: ServerState, request, ticket: Ticket, shaper: Shaper):
    """The SSE events of one request: its chunks, then `[DONE]`. A client that leaves cancels it."""
    status = "200"
    try:
        if shaper.kind == "chat":
            yield json.dumps(shaper.chunk("", role=True))
        while True:
            what, payload = await ticket.events.get()
            if what == "token":
                piece, logprobs = payload
                if piece or logprobs:
                    yield json.dumps(shaper.chunk(piece, logprobs))
            elif what == "error":
                status = str(payload.status)
                yield json.dumps(payload.body())
                break
            else:
                yield json.dumps(shaper.chunk(None, finish_reason=ticket.answer.finish_reason))
                if ticket.req.include_usage:
                    yield json.dumps(shaper.usage_chunk(len(ticket.req.ids), ticket.answer, payload))
                break
        yield "[DONE]"
    except BaseException:
        status = "499"  # the client closed the connection
        raise
    finally:
        state.metrics.requests.labels(request.url.path, status).inc()
        _ended(state, ticket)


def _ended(state: ServerState, ticket: Ticket) -> None:
    """The request's handler is done: a ticket not yet ended is cancelled (its client left)."""
    if not ticket.ended:
        ticket.cancelled = True
        with state.batcher.cond:
            state.batcher.cond.notify()
    state.metrics.on_answer(ticket, time.perf_counter())
