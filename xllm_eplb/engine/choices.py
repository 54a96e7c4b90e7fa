"""From a :class:`~xllm_eplb.engine.protocol.Plan` to scheduler requests and back to OpenAI
response objects: per-choice text (stop strings cut, incremental decoding for streams) and the
``text_completion`` / ``chat.completion`` (``.chunk``) JSON shapes.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

from xllm_eplb.engine.protocol import Plan
from xllm_eplb.engine.scheduler import Request
from xllm_eplb.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def new_id(kind: str) -> str:
    """``cmpl-<32 hex>`` / ``chatcmpl-<32 hex>``: unique across runs."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def stop_checker(tok: Tokenizer, stops: list[str]) -> Callable[[list[int]], bool] | None:
    """``check(output_ids) -> True`` once the decoded tail contains a stop string (evaluated on
    the step-loop thread after each token; decodes only the last few tokens)."""
    if not stops:
        return None
    window = max(len(s) for s in stops) + 8

    def check(out: list[int]) -> bool:
        tail = tok.decode(out[-window:])
        return any(s in tail for s in stops)
    return check


def make_requests(plan: Plan, tok: Tokenizer, listener) -> list[Request]:
    """One scheduler :class:`Request` per choice (prompt i, sample j -> index i * n + j)."""
    check = stop_checker(tok, plan.stop)
    out = []
    for k in range(len(plan.prompts) * plan.n):
        out.append(Request(prompt=list(plan.prompts[k // plan.n]), max_tokens=plan.max_tokens,
                           temperature=plan.temperature, seed=plan.seeds[k],
                           stop_at_eos=not plan.ignore_eos, top_p=plan.top_p, top_k=plan.top_k,
                           eos_ids=frozenset(tok.eos_ids), stop_ids=plan.stop_token_ids,
                           stop_check=check, listener=listener))
    return out


class Choice:
    """Output of one choice as it grows: token ids, text emitted so far, finish reason."""

    def __init__(self, index: int, prompt: list[int], tok: Tokenizer, stops: list[str]):
        self.index, self.prompt, self.tok, self.stops = index, prompt, tok, stops
        self.ids: list[int] = []
        self.sent_text = ""
        self.sent_ids = 0
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int], reason: str) -> None:
        self.ids.extend(ids)
        if reason:
            self.finish_reason = reason

    def text(self) -> str:
        """The choice's whole text: decoded ids, cut before the first stop string."""
        text = self.tok.decode(self.ids)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

    def delta(self) -> tuple[str, list[int]]:
        """New text and ids since the last call. While running, text that may still change
        (an incomplete UTF-8 character, a possible stop-string prefix) is held back, so the
        deltas always add up to :meth:`text`."""
        text = self.text()
        if self.finish_reason is None:
            end = len(text) - self.hold
            while end > 0 and text[end - 1] == REPLACEMENT:
                end -= 1
            text = text[:max(end, len(self.sent_text))]
        new = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        self.sent_text += new
        ids, self.sent_ids = self.ids[self.sent_ids:], len(self.ids)
        return new, ids


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(ch.ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _envelope(rid: str, obj: str, created: int, model: str) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model}


def response(plan: Plan, choices: list[Choice], rid: str, model: str) -> dict:
    """The non-streamed reply."""
    created = int(time.time())
    out = []
    for ch in choices:
        if plan.kind == "chat":
            c = {"index": ch.index, "message": {"role": "assistant", "content": ch.text()},
                 "logprobs": None, "finish_reason": ch.finish_reason}
        else:
            c = {"index": ch.index, "text": ch.text(), "logprobs": None,
                 "finish_reason": ch.finish_reason}
        if plan.return_token_ids:
            c.update(token_ids=list(ch.ids), prompt_token_ids=list(ch.prompt))
        out.append(c)
    obj = "chat.completion" if plan.kind == "chat" else "text_completion"
    body = _envelope(rid, obj, created, model) | {"choices": out,
                                                   "usage": usage(choices, plan.prompts)}
    if plan.return_token_ids and plan.kind == "chat":
        body["prompt_token_ids"] = list(plan.prompts[0])
    return body


def chunk(plan: Plan, ch: Choice, rid: str, created: int, model: str, *, first: bool
          ) -> dict | None:
    """One streamed chunk for choice ``ch`` (None when it has nothing new to say)."""
    text, ids = ch.delta()
    done = ch.finish_reason
    if not (text or ids or done or first):
        return None
    if plan.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else (
            {"content": text} if text else {})
        c = {"index": ch.index, "delta": delta, "logprobs": None, "finish_reason": done}
        obj = "chat.completion.chunk"
    else:
        c = {"index": ch.index, "text": text, "logprobs": None, "finish_reason": done}
        obj = "text_completion"
    if plan.return_token_ids:
        c["token_ids"] = ids
        if first:
            c["prompt_token_ids"] = list(ch.prompt)
    return _envelope(rid, obj, created, model) | {"choices": [c]}


def usage_chunk(plan: Plan, choices: list[Choice], rid: str, created: int, model: str) -> dict:
    obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
    return _envelope(rid, obj, created, model) | {"choices": [],
                                                   "usage": usage(choices, plan.prompts)}
