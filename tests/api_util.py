"""An API server (FastAPI + uvicorn, real HTTP) in front of a real scheduler and the
single-process reference model of the generated default checkpoint, for the API and bench
tests."""

from __future__ import annotations

import threading
import time

from xllm_eplb.engine.api import ApiBackend, ApiLimits, ApiServer, ServedModel
from xllm_eplb.engine.scheduler import Scheduler
from xllm_eplb.engine.tokenizer import ByteTokenizer
from xllm_eplb.flags import config_from_dict


class ChatByteTokenizer(ByteTokenizer):
    """The byte tokenizer plus a tiny chat template (what a checkpoint's template does:
    messages -> one prompt string ending in the assistant's turn)."""

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return "\x01" + text + ("<assistant>" if add_generation_prompt else "")


class ReferenceLoop:
    """Step loop over one DP rank running the reference model (same weights as the workers)."""

    def __init__(self, cfg, max_batch_size: int = 4):
        from xllm_eplb.model.decoder import Decoder
        from xllm_eplb.model.default_checkpoint import with_default_checkpoint

        self.model = Decoder.reference(with_default_checkpoint(cfg))
        self.sched = Scheduler(1, max_batch_size, cfg.runtime.max_prefill_tokens)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.cancelled = []

    def run(self):
        while not self.stop.is_set():
            self.sched.pull(timeout=0.05)
            self.cancelled += self.sched.reap_cancelled()
            if self.sched.has_work:
                batch = self.sched.schedule()[0]
                if not batch.rows:          # only a release (a cancelled request's KV cache)
                    self.model.release(batch.release)
                    continue
                res = self.model.forward_step(batch)
                self.sched.update(res.sampled, res.logprobs)
                time.sleep(0.01)     # a step takes a while (cancellation tests need that)


def start_api(tokenizer, max_batch_size: int = 4, vocab_size: int | None = None,
              context: int = 96, max_prompt: int = 64, aliases: tuple[str, ...] = ()):
    """An API server on a free loopback port in front of a :class:`ReferenceLoop`
    (``vocab_size``: the generated checkpoint's, e.g. a checkpoint tokenizer's size)."""
    flat = {"ep_size": 4, "max_prefill_tokens": max_prompt, "max_position_embeddings": context}
    if vocab_size is not None:
        flat["vocab_size"] = vocab_size
    cfg = config_from_dict(flat)
    loop = ReferenceLoop(cfg, max_batch_size)
    lim = ApiLimits(cfg.model.vocab_size, max_prompt, context, request_timeout_seconds=30)
    backend = ApiBackend(submit=loop.sched.submit, cancel=loop.sched.cancel,
                         status=lambda: {"policy": "balanced"},
                         metrics=lambda: b"xllm_eplb_up 1\n",
                         health=lambda: (True, {"status": "serving"}),
                         served=ServedModel("tiny", tokenizer, lim, created=1,
                                            aliases=aliases))
    api = ApiServer("127.0.0.1", 0, backend)
    api.start()
    loop.thread.start()
    return api, loop
