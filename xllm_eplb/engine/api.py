"""HTTP API of the engine (stdlib ``ThreadingHTTPServer``, loopback by default).

Routes: ``POST /v1/completions``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /eplb/status`` (JSON). Bad input gets a 4xx with ``{"error": {"message", "type",
"param"}}``; a handler error never stops the server.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from xllm_eplb.engine import tokenizer
from xllm_eplb.engine.scheduler import Request

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class ApiError(Exception):
    """A request the API refuses: HTTP status, message naming the field and rule."""

    def __init__(self, status: int, message: str, param: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ApiLimits:
    """What a request may ask for (from the config)."""

    vocab_size: int
    max_prompt_tokens: int
    max_position_embeddings: int
    request_timeout_seconds: float = 600.0


@dataclass
class ApiBackend:
    """What the handlers call; the engine provides these (all thread-safe)."""

    submit: Callable[[Request], Request]
    status: Callable[[], dict]
    metrics: Callable[[], bytes]
    health: Callable[[], tuple[bool, dict]]
    limits: ApiLimits


# --- request parsing (pure) -----------------------------------------------------------------

def _int_field(body: dict, name: str, default: int, lo: int) -> int:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {v!r}", name)
    if v < lo:
        raise ApiError(400, f"'{name}'={v}: must be >= {lo}", name)
    return v


def _float_field(body: dict, name: str, default: float, lo: float) -> float:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ApiError(400, f"'{name}' must be a number, got {v!r}", name)
    if v < lo:
        raise ApiError(400, f"'{name}'={v}: must be >= {lo}", name)
    return float(v)


def _prompt_ids(body: dict, lim: ApiLimits) -> list[int]:
    has_text, has_ids = "prompt" in body, "prompt_token_ids" in body
    if has_text == has_ids:
        raise ApiError(400, "give exactly one of 'prompt' (text) or 'prompt_token_ids'",
                       "prompt")
    if has_text:
        if not isinstance(body["prompt"], str):
            raise ApiError(400, "'prompt' must be a string", "prompt")
        return tokenizer.encode(body["prompt"])
    ids = body["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < lim.vocab_size
            for i in ids):
        raise ApiError(400, f"'prompt_token_ids' must be a non-empty list of integers in "
                       f"[0, {lim.vocab_size})", "prompt_token_ids")
    return list(ids)


def parse_completion(body: Any, lim: ApiLimits) -> Request:
    """A decoded JSON body -> a :class:`Request`, or :class:`ApiError` naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    ids = _prompt_ids(body, lim)
    max_tokens = _int_field(body, "max_tokens", 16, 0)
    temperature = _float_field(body, "temperature", 0.0, 0.0)
    seed = _int_field(body, "seed", 0, 0)
    if len(ids) > lim.max_prompt_tokens:
        raise ApiError(400, f"prompt has {len(ids)} tokens: must be <= --max_prefill_tokens="
                       f"{lim.max_prompt_tokens}", "prompt")
    if len(ids) + max_tokens > lim.max_position_embeddings:
        raise ApiError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) must be "
                       f"<= --max_position_embeddings={lim.max_position_embeddings}",
                       "max_tokens")
    return Request(prompt=ids, max_tokens=max_tokens, temperature=temperature,
                   seed=seed % (1 << 63), stop_at_eos=not bool(body.get("ignore_eos", False)))


def completion_response(req: Request) -> dict:
    return {
        "id": f"cmpl-{req.req_id}", "object": "text_completion", "model": "xllm-eplb",
        "choices": [{"index": 0, "text": tokenizer.decode(req.output),
                     "token_ids": list(req.output), "finish_reason": req.finish_reason}],
        "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
                  "total_tokens": len(req.prompt) + len(req.output)},
    }


# --- HTTP plumbing --------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    server_version = "xllm-eplb"
    protocol_version = "HTTP/1.1"
    backend: ApiBackend  # set on the subclass built by make_server

    def log_message(self, fmt, *args):  # noqa: D401 - route access logs to debug level
        log.debug("http %s %s", self.address_string(), fmt % args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, e: ApiError) -> None:
        etype = HTTPStatus(e.status).phrase.lower().replace(" ", "_")
        self._json(e.status, {"error": {"message": e.message, "type": etype,
                                        "param": e.param or None}})

    def _guard(self, fn) -> None:
        try:
            fn()
        except ApiError as e:
            self._error(e)
        except Exception as e:  # noqa: BLE001 - keep serving; report as 500
            log.exception("http handler failed path=%s", self.path)
            self._error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    def do_GET(self):  # noqa: N802
        self._guard(self._get)

    def do_POST(self):  # noqa: N802
        self._guard(self._post)

    def _other_method(self):
        """PUT, DELETE, PATCH, OPTIONS: 405 on a known route, 404 elsewhere (always JSON)."""
        self.close_connection = True          # the body, if any, is never read
        path = self.path.split("?", 1)[0]
        if path in _ROUTES:
            raise ApiError(405, f"use {_ROUTES[path]} for {path}")
        raise ApiError(404, f"no route {self.command} {path}")

    def do_PUT(self):  # noqa: N802
        self._guard(self._other_method)

    do_DELETE = do_PATCH = do_OPTIONS = do_PUT  # noqa: N815

    def _get(self):
        b, path = self.backend, self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, b.metrics(), PROMETHEUS_TEXT)
        elif path == "/health":
            ok, info = b.health()
            self._json(200 if ok else 503, info)
        elif path == "/eplb/status":
            self._json(200, b.status())
        elif path == "/v1/completions":
            raise ApiError(405, "use POST for /v1/completions")
        else:
            raise ApiError(404, f"no route GET {path}")

    def _read_json(self) -> Any:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"body of {n} bytes: must be <= {MAX_BODY_BYTES}")
        raw = self.rfile.read(n) if n > 0 else b""
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None

    def _post(self):
        path = self.path.split("?", 1)[0]
        if path != "/v1/completions":
            self.close_connection = True      # the body, if any, is never read
            if path in _ROUTES:
                raise ApiError(405, f"use {_ROUTES[path]} for {path}")
            raise ApiError(404, f"no route POST {path}")
        req = parse_completion(self._read_json(), self.backend.limits)
        ok, info = self.backend.health()
        if not ok:
            raise ApiError(503, f"engine not serving: {info.get('status')}")
        req = self.backend.submit(req)
        if not req.done.wait(self.backend.limits.request_timeout_seconds):
            raise ApiError(504, f"request {req.req_id} not finished within "
                           f"{self.backend.limits.request_timeout_seconds:g}s")
        if req.finish_reason == "error":
            raise ApiError(503, f"request {req.req_id} failed: {req.error}")
        self._json(200, completion_response(req))


_ROUTES = {"/metrics": "GET", "/health": "GET", "/eplb/status": "GET",
           "/v1/completions": "POST"}


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    request_queue_size = 1024   # listen backlog: many clients connect at once (default 5)
    daemon_threads = True


class ApiServer:
    """The bound server; :meth:`start` serves on a daemon thread, :meth:`close` stops it."""

    def __init__(self, host: str, port: int, backend: ApiBackend):
        handler = type("Handler", (_Handler,), {"backend": backend})
        self.httpd = _Server((host, port), handler)  # OSError if the port is taken
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http",
                                        kwargs={"poll_interval": 0.5}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()
