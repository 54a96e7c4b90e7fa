"""From a :class:`~xllm_eplb.engine.protocol.Plan` to scheduler requests and back to OpenAI
response objects: per-choice text (stop strings cut, incremental decoding for streams) and the
``text_completion`` / ``chat.completion`` (``.chunk``) JSON shapes, incl. ``logprobs`` (legacy
completions format and the chat ``content`` list; :meth:`Choice.logprobs`).
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
                           stop_check=check, listener=listener, logprobs=plan.logprobs))
    return out


class Choice:
    """Output of one choice as it grows: token ids, text emitted so far, finish reason."""

    def __init__(self, index: int, prompt: list[int], tok: Tokenizer, stops: list[str],
                 lps: list | None = None):
        self.index, self.prompt, self.tok, self.stops = index, prompt, tok, stops
        #: ``Request.token_logprobs`` (filled by the step loop ahead of the ids) or None = off
        self.lps = lps
        self.strs: list[str] = []          # decoded text of each output token (cache)
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


    def _str(self, i: int) -> str:
        return self.tok.decode([i])

    def logprobs(self, kind: str, a: int, b: int) -> dict | None:
        """OpenAI ``logprobs`` of output tokens [a, b) (None when not asked for). Every output
        token is reported, also those of a stop string cut from the text.

        - completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}]
          (the top alternatives plus the sampled token), "text_offset"}`` (offsets: characters
          into the completion text, from the token strings' lengths);
        - chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
          "logprob", "bytes"}]}]}``.
        """
        if self.lps is None:
            return None
        while len(self.strs) < b:
            self.strs.append(self._str(self.ids[len(self.strs)]))
        if kind == "chat":
            return {"content": [_chat_entry(self.strs[k], *self.lps[k], self._str)
                                for k in range(a, b)]}
        off = sum(len(x) for x in self.strs[:a])
        out = {"tokens": self.strs[a:b], "token_logprobs": [], "top_logprobs": [],
               "text_offset": []}
        for k in range(a, b):
            lp, top = self.lps[k]
            alts: dict[str, float] = {}
            for t, x in [(self._str(i), x) for i, x in top] + [(self.strs[k], lp)]:
                alts.setdefault(t, x)       # two ids with one text: the more likely one
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(off)
            off += len(self.strs[k])
        return out


def _chat_entry(text: str, lp: float, top: list, decode) -> dict:
    def one(t: str, x: float) -> dict:
        return {"token": t, "logprob": x, "bytes": list(t.encode("utf-8"))}
    return one(text, lp) | {"top_logprobs": [one(decode(i), x) for i, x in top]}


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
                 "logprobs": ch.logprobs("chat", 0, len(ch.ids)),
                 "finish_reason": ch.finish_reason}
        else:
            c = {"index": ch.index, "text": ch.text(),
                 "logprobs": ch.logprobs("completion", 0, len(ch.ids)),
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
    """One streamed chunk for choice ``ch`` (None when it has nothing new to say); its
    ``logprobs`` are those of the chunk's new token ids (null in a chunk without new ids)."""
    a = ch.sent_ids
    text, ids = ch.delta()
    lps = ch.logprobs(plan.kind, a, a + len(ids)) if ids else None
    done = ch.finish_reason
    if not (text or ids or done or first):
        return None
    if plan.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else (
            {"content": text} if text else {})
        c = {"index": ch.index, "delta": delta, "logprobs": lps, "finish_reason": done}
        obj = "chat.completion.chunk"
    else:
        c = {"index": ch.index, "text": text, "logprobs": lps, "finish_reason": done}
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
