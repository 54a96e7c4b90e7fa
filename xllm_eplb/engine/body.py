"""The JSON body of an API request, read with the API's limits (size, malformed JSON, depth);
errors are :class:`~xllm_eplb.engine.protocol.ApiError` (400 / 413) in the OpenAI schema."""

from __future__ import annotations

import json

from fastapi import Request as HttpRequest

from xllm_eplb.engine.protocol import ApiError

MAX_BODY_BYTES = 1 << 20


async def read_json(request: HttpRequest) -> object:
    """The body as JSON: 413 over :data:`MAX_BODY_BYTES` (header or streamed), 400 malformed
    (NaN/Infinity included) or nested too deep for the decoder."""
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise ApiError(400, "bad Content-Length header") from None
    if declared > MAX_BODY_BYTES:
        raise ApiError(413, f"body of {declared} bytes: must be <= {MAX_BODY_BYTES}")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"body over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")
