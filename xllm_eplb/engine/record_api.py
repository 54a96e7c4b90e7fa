"""HTTP routes of the expert-distribution recorder (:mod:`~xllm_eplb.eplb.recorder`), as SGLang's
``start/stop/dump_expert_distribution_record``:

- ``POST /eplb/record/start`` body ``{}`` or ``{"trace": true}`` (also keep per-step loads) ->
  the recording's status; 409 when one is already running;
- ``POST /eplb/record/stop`` -> the final status; 409 when none is running;
- ``GET /eplb/record/dump`` -> ``{"logical_count": [[E] x L], ...}`` (``xllm-eplb plan --load``
  reads it as it is); ``?format=npz`` -> the per-step trace ``.npz`` (``loads`` int64
  ``[steps, L, E]``, ``meta``) that ``xllm-eplb simulate --trace`` reads; 409 when nothing was
  recorded (or no trace was asked for); works while recording too (a snapshot).

Errors use the API's OpenAI error schema (:class:`~xllm_eplb.engine.protocol.ApiError`); 503
while the engine is starting.
"""

from __future__ import annotations

import io
import json
from typing import Callable

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from xllm_eplb.engine.protocol import ApiError
from xllm_eplb.eplb.recorder import ExpertRecorder, RecordStateError
from xllm_eplb.sim.trace import Trace, write_trace

MAX_START_BODY = 4096
FORMATS = ("json", "npz")


async def _start_options(request: HttpRequest) -> bool:
    """The start body: empty or ``{"trace": bool}`` -> trace."""
    raw = await request.body()
    if len(raw) > MAX_START_BODY:
        raise ApiError(413, f"body of {len(raw)} bytes: must be <= {MAX_START_BODY}")
    if not raw.strip():
        return False
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object like {\"trace\": true}")
    unknown = sorted(set(body) - {"trace"})
    if unknown:
        raise ApiError(400, f"unknown field '{unknown[0]}' (known: trace)", param=unknown[0],
                       code="unknown_field")
    trace = body.get("trace", False)
    if not isinstance(trace, bool):
        raise ApiError(400, f"trace={json.dumps(trace)}: must be true or false", param="trace")
    return trace


def _npz(rec: ExpertRecorder) -> bytes:
    loads = rec.trace_loads()
    buf = io.BytesIO()
    write_trace(Trace(loads, {"generator": "xllm-eplb record", "ep_size": rec.D,
                              "steps": int(loads.shape[0])}), buf)
    return buf.getvalue()


def record_router(recorder: Callable[[], ExpertRecorder | None]) -> APIRouter:
    """The three routes over ``recorder()`` (None while the engine starts: 503)."""
    router = APIRouter()

    def rec() -> ExpertRecorder:
        r = recorder()
        if r is None:
            raise ApiError(503, "engine not serving: starting", code="starting")
        return r

    def conflict(e: RecordStateError) -> ApiError:
        return ApiError(409, str(e), code="record_state")

    @router.post("/eplb/record/start")
    async def record_start(request: HttpRequest):
        """Start recording the expert distribution (``{"trace": true}``: per step too)."""
        trace = await _start_options(request)
        try:
            return rec().start(trace=trace)
        except RecordStateError as e:
            raise conflict(e) from None

    @router.post("/eplb/record/stop")
    async def record_stop():
        """Stop the running recording; its data stays available to dump."""
        try:
            return rec().stop()
        except RecordStateError as e:
            raise conflict(e) from None

    @router.get("/eplb/record/dump")
    async def record_dump(format: str = "json"):
        """SGLang's ``logical_count`` JSON, or (``format=npz``) the per-step trace."""
        if format not in FORMATS:
            raise ApiError(400, f"format={format}: must be one of {', '.join(FORMATS)}",
                           param="format")
        try:
            if format == "json":
                return rec().dump()
            return Response(_npz(rec()), media_type="application/octet-stream", headers={
                "Content-Disposition": 'attachment; filename="expert_trace.npz"'})
        except RecordStateError as e:
            raise conflict(e) from None

    return router
