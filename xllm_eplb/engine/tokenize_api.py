"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes, on the
served tokenizer (the one the completions use, so the ids are those a completion would run):

- ``/tokenize`` ``{"prompt": str, "add_special_tokens": true, "return_token_strs": false}`` or
  ``{"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, ...}``
  (the chat template, as /v1/chat/completions renders it) -> ``{"count", "max_model_len",
  "tokens", "token_strs"}`` (``token_strs`` null unless asked);
- ``/detokenize`` ``{"tokens": [int]}`` -> ``{"prompt": str}``.

``model``, when given, must be the served name (404 otherwise, as the completions). Errors are
the API's OpenAI error schema (:class:`~xllm_eplb.engine.protocol.ApiError`).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from pydantic import Field

from xllm_eplb.engine.body import read_json
from xllm_eplb.engine.protocol import (
    ApiError,
    ChatMessage,
    ServedModel,
    StrictModel,
    chat_prompt,
    encode_text,
    request_schema,
    token_ids_of,
    validate_body,
)


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's BOS (as a "
                                     "completion's text prompt does)")
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def _check_model(name: str | None, served: ServedModel) -> None:
    if name is not None and not served.serves(name):
        raise ApiError(404, f"'model'={name!r}: this server serves {served.names}", "model",
                       "model_not_found")


def _token_strs(served: ServedModel, ids: list[int]) -> list[str]:
    """One string per id: the vocabulary entry when the tokenizer has one, else its text."""
    tok = served.tokenizer
    raw = getattr(tok, "raw", None)
    if raw is not None:
        return [raw.id_to_token(i) or "" for i in ids]
    return [tok.decode([i]) for i in ids]


def tokenize(body: object, served: ServedModel) -> dict:
    """A /tokenize body (either form) -> vLLM's ``TokenizeResponse``."""
    if isinstance(body, dict) and "messages" in body:
        req = validate_body(TokenizeChatRequest, body)
        if req.continue_final_message:
            raise ApiError(400, "'continue_final_message': not supported by this server",
                           "continue_final_message")
        ids = chat_prompt(req, served.tokenizer, add_generation_prompt=req.add_generation_prompt,
                          special=req.add_special_tokens)
    else:
        req = validate_body(TokenizeCompletionRequest, body)
        ids = encode_text(req.prompt, served.tokenizer, "prompt", special=req.add_special_tokens)
    _check_model(req.model, served)
    return {"count": len(ids), "max_model_len": served.limits.max_position_embeddings,
            "tokens": ids,
            "token_strs": _token_strs(served, ids) if req.return_token_strs else None}


def detokenize(body: object, served: ServedModel) -> dict:
    """A /detokenize body -> vLLM's ``DetokenizeResponse`` ``{"prompt": text}``."""
    req = validate_body(DetokenizeRequest, body)
    _check_model(req.model, served)
    ids = token_ids_of(req.tokens, "tokens", served.limits) if req.tokens else []
    return {"prompt": served.tokenizer.decode(ids)}


def tokenize_router(served: ServedModel) -> APIRouter:
    """The two routes on ``served``'s tokenizer."""
    router = APIRouter()

    @router.post("/tokenize", openapi_extra=request_schema(TokenizeCompletionRequest))
    async def tokenize_route(request: HttpRequest):
        """vLLM's /tokenize: a text prompt or chat messages -> token ids."""
        return tokenize(await read_json(request), served)

    @router.post("/detokenize", openapi_extra=request_schema(DetokenizeRequest))
    async def detokenize_route(request: HttpRequest):
        """vLLM's /detokenize: token ids -> text."""
        return detokenize(await read_json(request), served)

    return router
