"""HTTP API of the engine: an OpenAI-compatible FastAPI app served by uvicorn on its own thread
(loopback by default); the engine's step loop keeps its own thread.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes,
:mod:`~xllm_eplb.engine.tokenize_api`), ``GET /version``, ``GET /health``, ``GET /metrics``
(Prometheus text), ``GET /eplb/status``, ``GET /openapi.json`` and the ``ApiBackend.routers``
(``/eplb/record/*``: :mod:`~xllm_eplb.engine.record_api`). With ``ApiBackend.api_key`` set,
``/v1/*``, ``/tokenize``, ``/detokenize`` and ``/eplb/record/*`` need ``Authorization: Bearer
<key>`` (401 otherwise; health, metrics, status and version stay open, as in vLLM). Every error
is JSON in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad input,
401 missing or wrong API key, 404 unknown route or model, 405 wrong method (with ``Allow``),
413 body too large, 503 not serving / stalled / overloaded, 504 timed out. Request schema and validation: :mod:`~xllm_eplb.engine.protocol`; choices and
response shapes: :mod:`~xllm_eplb.engine.choices`; token hand-over and SSE:
:mod:`~xllm_eplb.engine.streaming`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from xllm_eplb import __version__
from xllm_eplb.engine import choices as ch
from xllm_eplb.engine.body import read_json
from xllm_eplb.engine.protocol import (
    ApiError,
    ApiLimits,
    ChatCompletionRequest,
    CompletionRequest,
    Plan,
    ServedModel,
    parse_chat,
    parse_completion,
    request_schema,
)
from xllm_eplb.engine.scheduler import Request
from xllm_eplb.engine.streaming import EventStream, TokenBridge, sse, until_disconnect
from xllm_eplb.engine.tokenize_api import TokenizeChatRequest, tokenize_router
from xllm_eplb.obs.logs import event

__all__ = ["ApiBackend", "ApiError", "ApiLimits", "ApiServer", "ServedModel", "create_app"]

log = logging.getLogger(__name__)

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 503: "service_unavailable", 504: "timeout"}


@dataclass
class ApiBackend:
    """What the handlers call; the engine provides these (all thread-safe).

    ``health() -> (serving, info)``; ``admit() -> None or a reason to refuse new work (503)``.
    """

    submit: Callable[[Request], Request]
    #: ``cancel(req_id, why)``
    cancel: Callable[[int, str], None]
    status: Callable[[], dict]
    metrics: Callable[[], bytes]
    health: Callable[[], tuple[bool, dict]]
    served: ServedModel
    admit: Callable[[], str | None] = lambda: None
    #: extra route groups (e.g. ``record_api.record_router``), included as they are
    routers: tuple = ()
    #: non-empty: the bearer token the protected routes need (``--api-key``)
    api_key: str = ""


def error_body(status: int, message: str, param: str = "", code: str | None = None) -> dict:
    etype = _TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
    return {"error": {"message": message, "type": etype, "param": param or None, "code": code}}


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status, e.headers)


class _Run:
    """One HTTP request's choices in the engine: submit, follow, cancel."""

    def __init__(self, backend: ApiBackend, plan: Plan):
        self.backend, self.plan = backend, plan
        tok = backend.served.tokenizer
        self.bridge = TokenBridge(asyncio.get_running_loop(), final_only=not plan.stream)
        self.reqs = ch.make_requests(plan, tok, self.bridge)
        self.bridge.attach(self.reqs)
        self.choices = [ch.Choice(k, r.prompt, tok, plan.stop,
                                  r.token_logprobs if plan.logprobs >= 0 else None)
                        for k, r in enumerate(self.reqs)]
        self.open = len(self.reqs)
        self.rid = ch.new_id(plan.kind)

    def submit(self) -> None:
        for r in self.reqs:
            self.backend.submit(r)

    async def next_event(self) -> None:
        k, ids, reason = await self.bridge.get()
        self._apply(k, ids, reason)

    def _apply(self, k: int, ids: list[int], reason: str) -> None:
        if reason == "error":
            raise ApiError(503, f"request failed: {self.reqs[k].error}")
        self.choices[k].add(ids, reason)
        if reason:
            self.open -= 1

    def cancel(self, why: str) -> None:
        """Cancel the unfinished choices; the engine logs the one info line per request."""
        left = [r for r in self.reqs if not r.done.is_set()]
        for r in left:
            self.backend.cancel(r.req_id, why)
        if left:
            log.debug(event("api request cancelled", id=self.rid, choices=len(left), reason=why))


def _guard_admission(backend: ApiBackend) -> None:
    ok, info = backend.health()
    # NOTE: an elastic recovery (or a fenced silent worker) is a pause: /health says 503
    # ``recovering`` for a load balancer, but a new request waits in the queue and is served
    # once the ranks re-form (refused, a client with one server lost it: bench_elastic run 4)
    if not ok and info.get("status") != "recovering":
        raise ApiError(503, f"engine not serving: {info.get('status')}", code=info.get("status"))
    why = backend.admit()
    if why:
        raise ApiError(503, why, code="overloaded")


async def _complete(request: HttpRequest, run: _Run) -> dict:
    """Non-streamed: wait for every choice, or cancel when the client goes or time runs out."""
    timeout = run.backend.served.limits.request_timeout_seconds
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    work = asyncio.ensure_future(_all_events(run))
    try:
        done, _ = await asyncio.wait({work, gone}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        work.cancel()
    if work in done:
        work.result()            # ApiError of a failed choice
        return ch.response(run.plan, run.choices, run.rid, run.backend.served.name)
    if gone in done:
        run.cancel("client disconnected")
        raise asyncio.CancelledError
    run.cancel("timeout")
    raise ApiError(504, f"request not finished within {timeout:g}s")


async def _all_events(run: _Run) -> None:
    while run.open:
        await run.next_event()


async def _stream(run: _Run):
    """Streamed: SSE chunks as tokens arrive, then the usage chunk (if asked) and [DONE]."""
    created, name, plan = int(time.time()), run.backend.served.name, run.plan
    first = [True] * len(run.choices)
    closed = [False] * len(run.choices)
    try:
        while True:
            for k, c in enumerate(run.choices):
                if closed[k]:
                    continue
                obj = ch.chunk(plan, c, run.rid, created, name, first=first[k])
                if obj is not None:
                    first[k] = False
                    closed[k] = c.finish_reason is not None
                    yield sse(obj)
            if not run.open:
                break
            try:
                await run.next_event()
                for ev in run.bridge.drain():
                    run._apply(*ev)
            except ApiError as e:
                yield sse(error_body(e.status, e.message, e.param, e.code))
                return
        if plan.include_usage:
            yield sse(ch.usage_chunk(plan, run.choices, run.rid, created, name))
        yield sse("[DONE]")
    finally:
        run.cancel("client disconnected")


async def _serve(request: HttpRequest, backend: ApiBackend, parse) -> Response:
    body = await read_json(request)
    plan = parse(body, backend.served)
    _guard_admission(backend)
    run = _Run(backend, plan)
    run.submit()
    if plan.stream:
        return EventStream(_stream(run))
    try:
        return JSONResponse(await _complete(request, run))
    except asyncio.CancelledError:
        return Response(status_code=499)   # the client has gone; nobody reads this


def _routes(app: FastAPI, backend: ApiBackend) -> None:
    @app.post("/v1/completions", openapi_extra=request_schema(CompletionRequest))
    async def completions(request: HttpRequest):
        """OpenAI text completions (text, token-id or batched prompts; ``stream``)."""
        return await _serve(request, backend, parse_completion)

    @app.post("/v1/chat/completions", openapi_extra=request_schema(ChatCompletionRequest))
    async def chat_completions(request: HttpRequest):
        """OpenAI chat completions through the checkpoint's chat template."""
        return await _serve(request, backend, parse_chat)

    @app.get("/v1/models")
    async def models():
        s = backend.served
        return {"object": "list", "data": [_model_card(s, n) for n in (s.name, *s.aliases)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """The served model (the openai client's ``models.retrieve``); 404 for any other id."""
        s = backend.served
        if not s.serves(model_id):
            raise ApiError(404, f"model {model_id!r} not found: this server serves {s.names}",
                           "model", "model_not_found")
        return _model_card(s, model_id)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        ok, info = backend.health()
        return JSONResponse(info, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(backend.metrics(), media_type=PROMETHEUS_TEXT)

    @app.get("/eplb/status")
    async def eplb_status():
        return backend.status()


def _model_card(s: ServedModel, name: str) -> dict:
    """The card of ``name`` (the served name or an alias: the same model)."""
    return {"id": name, "object": "model", "created": s.created, "owned_by": "xllm-eplb",
            "max_model_len": s.limits.max_position_embeddings, "quantization": s.quantization,
            "family": s.family}


#: path prefixes that need the API key when one is set
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/eplb/record/")


def _require_key(app: FastAPI, key: str) -> None:
    """401 in the OpenAI schema for a protected path without ``Authorization: Bearer <key>``."""
    want = f"Bearer {key}".encode()

    @app.middleware("http")
    async def api_key(request: HttpRequest, call_next):
        if request.url.path.startswith(PROTECTED):
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, want):
                why = "wrong API key" if got else "no API key given"
                return JSONResponse(error_body(401, f"{why}: send the header 'Authorization: "
                                               f"Bearer <key>' (--api-key)",
                                               code="invalid_api_key"), 401,
                                    {"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        path, method = request.url.path, request.method
        if e.status_code == 405:
            allow = [m for m in (e.headers or {}).get("Allow", "").split(", ") if m != "HEAD"]
            return _error(ApiError(405, f"use {' or '.join(allow)} for {path}",
                                   headers=e.headers))
        if e.status_code == 404:
            return _error(ApiError(404, f"no route {method} {path}"))
        return _error(ApiError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):
        log.exception("api handler failed path=%s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), 500)


def create_app(backend: ApiBackend) -> FastAPI:
    app = _EngineApp(title="xllm-eplb", docs_url=None, redoc_url=None,
                     description="OpenAI-compatible API of the xllm-eplb engine")
    _routes(app, backend)
    for router in (tokenize_router(backend.served), *backend.routers):
        app.include_router(router)
    if backend.api_key:
        _require_key(app, backend.api_key)
    _handlers(app)
    return app


class _EngineApp(FastAPI):
    """The engine's FastAPI app: its OpenAPI document (``/openapi.json``) also lists the
    request models' nested definitions under ``components.schemas`` (FastAPI's documented way
    to extend the schema: override :meth:`openapi`, which caches it in ``openapi_schema``)."""

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            _lift_defs(super().openapi())
        return self.openapi_schema


def _lift_defs(doc: dict) -> None:
    """Move the request models' nested ``$defs`` of OpenAPI ``doc`` into
    ``components.schemas`` (in place)."""
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeChatRequest):
        defs = model.model_json_schema(
            ref_template="#/components/schemas/{model}").get("$defs", {})
        comps.update(defs)
    for path in doc.get("paths", {}).values():
        for op in path.values():
            op.get("requestBody", {}).get("content", {}).get(
                "application/json", {}).get("schema", {}).pop("$defs", None)


def _bind(host: str, port: int) -> socket.socket:
    """Listening socket on ``host:port`` (OSError if taken or unresolvable)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)   # many clients connect at once
    except OSError:
        sock.close()
        raise
    return sock


def _json_h11_protocol() -> type:
    """uvicorn's h11 protocol whose own 400 (a request h11 cannot parse: a bad
    ``Content-Length``, a broken request line) is an OpenAI JSON error too, not text/plain."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(400, f"malformed HTTP request: {msg}")).encode()
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            for ev in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                       h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(ev))
            self.transport.close()
    return JsonH11Protocol


def _stoppable_server() -> type:
    """``uvicorn.Server`` with ``request_exit()``. uvicorn (0.55) has no method that stops a
    server run on a thread: its loop polls its own ``should_exit`` flag, set by the signal
    handler ``handle_exit`` (which also records the signal to re-raise it later)."""
    from uvicorn import Server

    class StoppableServer(Server):
        def request_exit(self) -> None:
            """Ask the serve loop to stop at its next tick (thread-safe: a flag it polls)."""
            self.should_exit = True
    return StoppableServer


class ApiServer:
    """The bound server; :meth:`start` serves on a daemon thread, :meth:`close` stops it."""

    def __init__(self, host: str, port: int, backend: ApiBackend):
        import uvicorn

        # uvicorn's own start/stop lines are noise next to the engine's
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        self.sock = _bind(host, port)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(create_app(backend), log_config=None, access_log=False,
                                lifespan="off", loop="asyncio", http=_json_h11_protocol(),
                                timeout_keep_alive=30, backlog=2048)
        self.server = _stoppable_server()(config)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.run, name="http",
                                        kwargs={"sockets": [self.sock]}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.server.request_exit()
            self._thread.join(timeout=5)
        self.sock.close()
