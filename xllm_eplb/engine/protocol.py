"""OpenAI-compatible request schema and validation: a decoded JSON body -> a :class:`Plan`.

Fields are type-checked strictly (``"ignore_eos": "false"`` and ``"max_tokens": "3"`` are 400s,
never coerced). Unknown fields are a 400 that names them, with these exceptions (OpenAI fields
that do not change the output, accepted and ignored): ``user``, and ``frequency_penalty`` /
``presence_penalty`` at 0, ``logit_bias`` empty, ``echo`` false, ``best_of`` 1, ``suffix`` null
(any other value is a 400). Log-probabilities: completions ``logprobs`` 0..5 (top alternatives
per token), chat ``logprobs: true`` with ``top_logprobs`` 0..20 (``Plan.logprobs``; formatting in
``engine.choices``). ``prompt_token_ids`` is an extension kept from the first API (same as a
token-id ``prompt``). Errors are :class:`ApiError` (HTTP status, message naming the field,
value and rule, OpenAI ``param``/``code``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xllm_eplb.engine.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

#: most choices one request may ask for (``n`` x number of prompts)
MAX_CHOICES = 64
MAX_STOP = 16
#: deepest JSON nesting a body may have (objects and arrays)
MAX_DEPTH = 32
SEED_MOD = 1 << 63


class ApiError(Exception):
    """A request the API refuses: HTTP status, message naming the field and rule."""

    def __init__(self, status: int, message: str, param: str = "", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


@dataclass
class ApiLimits:
    """What a request may ask for (from the config). ``max_prompt_tokens``: the longest
    prompt (the server passes the model length: prompts over ``--max_prefill_tokens`` are
    prefilled in chunks)."""

    vocab_size: int
    max_prompt_tokens: int
    max_position_embeddings: int
    request_timeout_seconds: float = 600.0

    @classmethod
    def served(cls, m) -> "ApiLimits":
        """The server's limits from the resolved ``cfg.model`` (``m``): a prompt up to the
        model length (``--max-model-len`` caps it) is served, chunked over
        ``--max_prefill_tokens``."""
        return cls(m.vocab_size, m.max_position_embeddings, m.max_position_embeddings)


@dataclass
class ServedModel:
    """The one model this server serves: its name, tokenizer and limits."""

    name: str
    tokenizer: Tokenizer
    limits: ApiLimits
    created: int = 0
    quantization: dict | None = None    # the checkpoint's FP8 format (model.fp8.quant_info)
    family: str | None = None           # the checkpoint's model_type (deepseek_v3, glm4_moe ...)
    #: other names a request may use (``--served_model_alias``: vLLM's, the --model string)
    aliases: tuple[str, ...] = ()

    def serves(self, name: str) -> bool:
        return name == self.name or name in self.aliases

    @property
    def names(self) -> str:
        """``'xllm-eplb'`` or ``'xllm-eplb' (or '/models/qwen')`` (the 404 text)."""
        return repr(self.name) + "".join(f" (or {a!r})" for a in self.aliases)


# --- schema ---------------------------------------------------------------------------------

class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class _Common(StrictModel):
    model: str | None = Field(None, description="must be the served model name when given")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False, description="0 = greedy "
                               "(the default; OpenAI's default is 1)")
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = Field(None, description="reproducible sampling; omitted: a fresh draw")
    stop: Any = Field(None, description="a string or a list of up to 16 strings")
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    prompt: Any = Field(None, description="text, list of texts, token ids or list of token-id "
                        "lists")
    prompt_token_ids: list[int] | None = Field(None, description="extension: token ids")
    logprobs: int | None = Field(None, ge=0, le=5, description="top alternatives per token")
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ChatMessage(StrictModel):
    role: str
    content: Any = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# --- the parsed request -----------------------------------------------------------------------

@dataclass
class Plan:
    """A validated request: one prompt (token ids) per entry of ``prompts``, ``n`` choices each
    (choice index = prompt index * n + j)."""

    kind: str                                   # "completion" | "chat"
    prompts: list[list[int]]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seeds: list[int] = field(default_factory=list)     # one per choice
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset = frozenset()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    #: >= 0: return each output token's log-probability and this many top alternatives; -1 = off
    logprobs: int = -1


def _loc(err: dict) -> str:
    return ".".join(str(x) for x in err["loc"])


def _validation_error(e: ValidationError) -> ApiError:
    errs = e.errors()
    unknown = [_loc(x) for x in errs if x["type"] == "extra_forbidden"]
    if unknown:
        return ApiError(400, f"unknown field(s) {', '.join(repr(u) for u in unknown)}: not part "
                        f"of this API (see docs/serving.md)", unknown[0], "unknown_field")
    x = errs[0]
    msg = x["msg"].removeprefix("Value error, ")
    if x["type"] == "missing":
        return ApiError(400, f"'{_loc(x)}' is required", _loc(x))
    return ApiError(400, f"'{_loc(x)}'={x.get('input')!r}: {msg}", _loc(x))


def check_body(obj: Any, limit: int = MAX_DEPTH) -> None:
    """Raise a 400 when ``obj`` nests objects/arrays deeper than ``limit``, or holds a string
    that is not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``: JSON allows the
    escape, no tokenizer can encode it). Iterative; ``param`` is the bad string's path."""
    stack: list[tuple[Any, int, tuple]] = [(obj, 1, ())]
    while stack:
        o, d, where = stack.pop()
        if isinstance(o, str):
            _check_text(o, where)
        elif isinstance(o, (dict, list)):
            if d > limit:
                raise ApiError(400, f"JSON body nests deeper than {limit} levels")
            items = o.items() if isinstance(o, dict) else enumerate(o)
            for k, v in items:
                if isinstance(k, str):
                    _check_text(k, where)
                if isinstance(v, (str, dict, list)):
                    stack.append((v, d + 1, (where, k)))


def _check_text(text: str, where: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        keys = []
        while where:
            where, k = where
            keys.append(str(k))
        path = ".".join(reversed(keys))
        raise ApiError(400, f"'{path or 'body'}': string holds the lone surrogate "
                       f"\\u{ord(text[e.start]):04x}, which is not valid Unicode",
                       path) from None


def _unsupported(req: _Common, noop: dict[str, Any]) -> None:
    for name, ok in noop.items():
        v = getattr(req, name, None)
        if v not in ok:
            raise ApiError(400, f"'{name}'={v!r}: not supported by this server (only "
                           f"{' / '.join(repr(o) for o in ok)})", name, "unsupported")


def token_ids_of(v: Any, what: str, lim: ApiLimits) -> list[int]:
    if not v or not all(isinstance(i, int) and not isinstance(i, bool)
                        and 0 <= i < lim.vocab_size for i in v):
        raise ApiError(400, f"'{what}' must be a non-empty list of integers in "
                       f"[0, {lim.vocab_size})", what)
    return list(v)


def encode_text(text: str, tok: Tokenizer, what: str, *, special: bool = True) -> list[int]:
    if not tok.has_text:
        raise ApiError(400, f"'{what}': this model has no tokenizer files, so text prompts "
                       f"cannot be served; send token ids instead", what, "no_tokenizer")
    ids = tok.encode(text, add_special_tokens=special)
    if not ids:
        raise ApiError(400, f"'{what}' encodes to no tokens", what)
    return ids


def completion_prompts(req: CompletionRequest, tok: Tokenizer, lim: ApiLimits) -> list[list[int]]:
    """``prompt`` (text | [text] | [ids] | [[ids]]) or ``prompt_token_ids`` -> token-id lists."""
    p, ids = req.prompt, req.prompt_token_ids
    if (p is None) == (ids is None):
        raise ApiError(400, "give exactly one of 'prompt' (text or token ids) or "
                       "'prompt_token_ids'", "prompt")
    if ids is not None:
        return [token_ids_of(ids, "prompt_token_ids", lim)]
    if isinstance(p, str):
        return [encode_text(p, tok, "prompt")]
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in p):
        return [token_ids_of(p, "prompt", lim)]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return [encode_text(x, tok, "prompt") for x in p]
    if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        return [token_ids_of(x, "prompt", lim) for x in p]
    raise ApiError(400, f"'prompt'={_short(p)}: must be a string, a list of strings, a list of "
                   f"token ids or a list of token-id lists (non-empty)", "prompt")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def chat_prompt(req: ChatCompletionRequest, tok: Tokenizer, *, add_generation_prompt: bool = True,
                special: bool = False) -> list[int]:
    """Messages -> the chat template's text -> token ids (the template adds special tokens;
    ``special``: also the tokenizer's, as /tokenize's ``add_special_tokens``)."""
    if not req.messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    msgs = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text"), str) and set(c) == {"type", "text"}
                       for c in content):
                raise ApiError(400, f"'messages.{i}.content': parts must be "
                               f"{{'type': 'text', 'text': str}}", f"messages.{i}.content")
            content = "".join(c["text"] for c in content)
        elif not isinstance(content, str):
            raise ApiError(400, f"'messages.{i}.content' must be a string or a list of text "
                           f"parts", f"messages.{i}.content")
        msgs.append({"role": m.role, "content": content} | ({"name": m.name} if m.name else {}))
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as e:
        raise ApiError(400, f"'messages' refused by the chat template: {e}", "messages",
                       "invalid_messages") from None
    except TokenizerError as e:
        raise ApiError(400, f"chat completions need a chat template: {e}; use /v1/completions",
                       "messages", "no_chat_template") from None
    return encode_text(text, tok, "messages", special=special)


def _stops(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOP:
        raise ApiError(400, f"'stop'={_short(v)}: must be a non-empty string or a list of up to "
                       f"{MAX_STOP} non-empty strings", "stop")
    return list(stops)


def _max_tokens(requested: int | None, prompts: list[list[int]], lim: ApiLimits,
                default: int | None, names: tuple[str, str] = ("prompt", "max_tokens")) -> int:
    """The output budget; ``names``: the request's prompt and max-tokens fields (for errors)."""
    longest = max(len(p) for p in prompts)
    prompt, field = names
    if longest > lim.max_prompt_tokens:
        raise ApiError(400, f"'{prompt}': the prompt has {longest} tokens: must be <= "
                       f"{lim.max_prompt_tokens} (the model length, --max-model-len; longer "
                       f"than --max_prefill_tokens is prefilled in chunks)", prompt,
                       "context_length_exceeded")
    room = lim.max_position_embeddings - longest
    mt = (room if default is None else min(default, room)) if requested is None else requested
    if longest + mt > lim.max_position_embeddings:
        raise ApiError(400, f"prompt ({longest} tokens) + {field} ({mt}) must be <= "
                       f"--max_position_embeddings={lim.max_position_embeddings}", field,
                       "context_length_exceeded")
    return mt


def _seeds(seed: int | None, count: int, n: int) -> list[int]:
    """Choice k of a prompt uses ``seed + k`` (mod 2^63); without a seed every choice draws a
    fresh one, so two identical requests sample differently."""
    if seed is None:
        return [secrets.randbits(63) for _ in range(count)]
    return [(seed + (k % n)) % SEED_MOD for k in range(count)]


def _common(req: _Common, kind: str, prompts: list[list[int]], mt: int, served: ServedModel,
            logprobs: int = -1):
    if req.model is not None and not served.serves(req.model):
        raise ApiError(404, f"'model'={req.model!r}: this server serves {served.names}",
                       "model", "model_not_found")
    if len(prompts) * req.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={req.n}: at most {MAX_CHOICES} "
                       f"choices per request", "n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true",
                       "stream_options")
    lim = served.limits
    stop_ids = req.stop_token_ids or []
    if not all(0 <= i < lim.vocab_size for i in stop_ids):
        raise ApiError(400, f"'stop_token_ids' must be integers in [0, {lim.vocab_size})",
                       "stop_token_ids")
    count = len(prompts) * req.n
    return Plan(kind, prompts, mt, req.n, float(req.temperature), float(req.top_p),
                max(0, req.top_k), _seeds(req.seed, count, req.n), _stops(req.stop),
                frozenset(stop_ids), req.ignore_eos, req.stream,
                bool(req.stream_options and req.stream_options.include_usage),
                req.return_token_ids, logprobs)


_NOOPS = {"frequency_penalty": (0.0,), "presence_penalty": (0.0,), "logit_bias": (None, {})}


def parse_completion(body: Any, served: ServedModel) -> Plan:
    """``POST /v1/completions`` body -> :class:`Plan` (or :class:`ApiError`)."""
    req = validate_body(CompletionRequest, body)
    _unsupported(req, _NOOPS | {"echo": (False,),
                                "best_of": (None, 1), "suffix": (None,)})
    prompts = completion_prompts(req, served.tokenizer, served.limits)
    mt = _max_tokens(req.max_tokens, prompts, served.limits, 16)
    return _common(req, "completion", prompts, mt, served,
                   -1 if req.logprobs is None else req.logprobs)


def parse_chat(body: Any, served: ServedModel) -> Plan:
    """``POST /v1/chat/completions`` body -> :class:`Plan` (or :class:`ApiError`)."""
    req = validate_body(ChatCompletionRequest, body)
    _unsupported(req, _NOOPS)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, f"'top_logprobs'={req.top_logprobs} requires 'logprobs': true",
                       "top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise ApiError(400, "give at most one of 'max_tokens' and 'max_completion_tokens'",
                       "max_completion_tokens")
    prompt = chat_prompt(req, served.tokenizer)
    requested = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    names = ("messages", "max_tokens" if req.max_completion_tokens is None
             else "max_completion_tokens")
    mt = _max_tokens(requested, [prompt], served.limits, None, names)
    return _common(req, "chat", [prompt], mt, served,
                   (req.top_logprobs or 0) if req.logprobs else -1)


def validate_body(model: type[BaseModel], body: Any):
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    check_body(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def request_schema(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that reads its body itself (schema in /openapi.json)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}
