"""The per-layer prepare/activate state machine of one rebalance round (pure, clock passed in).

Each published layer goes ``IDLE -> PREPARING -> READY -> (activation sent) -> committed``:

- ``command(now)`` emits at most one activation (``update_layer_id`` + ``activation_token``)
  and at most one prepare (``prepare_layer_id`` + a new unique monotonic ``prepare_token`` +
  ``expert_ids``) per forward; both may ride the same forward.
- ``observe_prepared(tokens, now)``: a layer is READY only when every rank has reported exactly
  its token; any other non ``-1`` token is stale (late after an abort, or foreign) and ignored.
- ``observe_activation(token)``: the activation commits only when the output of the forward
  that carried it returns the token (= the prepare token); late/duplicate tokens are ignored.
- ``check_timeout(now, timeout)``: ``timeout`` seconds from the first worker output observed
  after dispatch, or ``2 * timeout`` from dispatch when no output arrived at all; the layer is
  aborted and skipped for this round. The manager checks it on every ``tick`` and *before*
  each output's tokens are observed, so a token that arrives after the deadline (a rank that
  froze or slept also blocks the forward that would carry it) is late and ignored.

NOTE (xLLM's overlap-mode bug: the next layer became READY over a pending one): a READY layer
whose activation has not been sent must never be overwritten. We guarantee it at dispatch: the
next prepare is only sent when no activation is pending, so at most one layer is ever
READY-but-unsent.

The pipeline and the manager are the only owners of round state: the published round lives here
(``candidate``/``enable``) until each layer commits (the manager writes the row into its deployed
placement) or is aborted (``enable`` cleared; nothing to undo, it was never deployed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.info import NO_LAYER, NO_TOKEN, EplbInfo

IDLE, PREPARING, READY = "idle", "preparing", "ready"


@dataclass(frozen=True)
class Abort:
    """A layer skipped by a timeout: ``kind`` is ``output`` or ``prepare progress``."""

    layer: int
    token: int
    kind: str
    elapsed: float
    limit: float


class LayerPipeline:
    """Tokens, barrier, pending/awaiting activation and timeouts for one round at a time.

    ``candidate`` int64 ``[layers, ranks*slots]`` (rows valid where ``enable``), ``enable`` bool
    ``[layers]``; ``pending`` / ``awaiting`` are ``(layer, token)`` or None.
    """

    def __init__(self, num_layers: int, ep_size: int):
        self.num_layers = num_layers
        self.ep_size = ep_size
        self.state = [IDLE] * num_layers
        self.enable = np.zeros(num_layers, dtype=bool)
        self.candidate: np.ndarray | None = None
        self.active_layer = NO_LAYER
        self.active_token = NO_TOKEN
        self.next_token = 1
        self.dispatch_at: float | None = None
        self.observed_at: float | None = None
        self.prepared = np.full(ep_size, NO_TOKEN, dtype=np.int64)
        self.pending: tuple[int, int] | None = None
        self.awaiting: tuple[int, int] | None = None
        self.layers_completed = 0
        self.layers_timed_out = 0

    # --- round ------------------------------------------------------------------------------

    @property
    def in_progress(self) -> bool:
        """True while any layer of the round is preparing, READY-unsent or awaiting activation."""
        return (self.active_layer != NO_LAYER or self.pending is not None
                or self.awaiting is not None)

    def start_round(self, candidate: np.ndarray, update: np.ndarray) -> None:
        """Publish a policy round: ``candidate [layers, ranks*slots]``, ``update [layers]``."""
        assert not self.in_progress, "a new round while the previous one is in flight"
        self.candidate = np.array(candidate, dtype=np.int64, copy=True)
        self.enable = np.array(update, dtype=bool, copy=True)
        self.state = [IDLE] * self.num_layers
        self.active_layer = self._next_enabled(NO_LAYER)

    def abort_round(self) -> bool:
        """Drop what is left of the round (elastic recovery: the workers' prepared buffers are
        gone); committed layers stay deployed. False, and nothing changed, while an activation
        is awaited (the caller settles it first: commit or :meth:`drop_awaited`)."""
        if self.awaiting is not None:
            return False
        self.enable[:] = False
        self.state = [IDLE] * self.num_layers
        self.active_layer, self.active_token, self.pending = NO_LAYER, NO_TOKEN, None
        return True

    def drop_awaited(self) -> None:
        """The awaited activation never happened on any rank: the layer is not deployed."""
        if self.awaiting is not None:
            self.state[self.awaiting[0]] = IDLE
            self.awaiting = None

    def _next_enabled(self, after: int) -> int:
        for layer in range(after + 1, self.num_layers):
            if self.enable[layer]:
                return layer
        return NO_LAYER

    def waiting_on(self) -> str:
        """What the round waits for, for logs and /eplb/status."""
        if self.active_token != NO_TOKEN:
            return f"prepare:layer={self.active_layer}:token={self.active_token}"
        if self.pending is not None:
            return f"activation_send:layer={self.pending[0]}"
        if self.awaiting is not None:
            return f"activation_output:layer={self.awaiting[0]}"
        return "none"

    def layer_in_flight(self) -> int:
        """The layer the round is working on (awaiting > pending > preparing), or -1."""
        for item in (self.awaiting, self.pending):
            if item is not None:
                return item[0]
        return self.active_layer

    # --- engine -> workers ------------------------------------------------------------------

    def command(self, now: float) -> EplbInfo:
        """The control message for the next forward (``allow`` already checked by the caller)."""
        update, activation = NO_LAYER, NO_TOKEN
        if self.awaiting is None and self.pending is not None:
            update, activation = self.pending
            self.awaiting, self.pending = self.pending, None
        layer = self.active_layer
        # NOTE: overwrite guard -- no new prepare while a READY activation is still unsent.
        if layer != NO_LAYER and self.state[layer] == IDLE and self.pending is None:
            token = self.next_token
            self.next_token += 1
            self.active_token, self.dispatch_at, self.observed_at = token, now, None
            self.prepared[:] = NO_TOKEN
            self.state[layer] = PREPARING
            return EplbInfo(prepare_layer_id=layer, prepare_token=token,
                            expert_ids=self.candidate[layer].copy(), update_layer_id=update,
                            activation_token=activation)
        return EplbInfo(update_layer_id=update, activation_token=activation)

    # --- workers -> engine ------------------------------------------------------------------

    def observe_prepared(self, tokens: list[int], now: float) -> list[int]:
        """Record one output round's prepared tokens (one per rank); returns stale tokens."""
        stale = [int(t) for t in tokens if t != NO_TOKEN and t != self.active_token]
        if self.active_token == NO_TOKEN:
            return stale
        if self.observed_at is None:
            self.observed_at = now
        for rank, tok in enumerate(tokens):
            if tok == self.active_token:
                self.prepared[rank] = tok
        if (self.prepared == self.active_token).all():
            self._mark_ready()
        return stale

    def _mark_ready(self) -> None:
        layer = self.active_layer
        assert self.pending is None, "overwrite guard broken: a READY activation is unsent"
        self.state[layer] = READY
        self.pending = (layer, self.active_token)
        self.active_token, self.dispatch_at, self.observed_at = NO_TOKEN, None, None
        self.active_layer = self._next_enabled(layer)

    def observe_activation(self, token: int) -> int | None:
        """The activation token of a returned forward: the committed layer, or None.

        A token that is neither ``-1`` nor the awaited one is stale: the caller logs it.
        """
        if self.awaiting is not None and token == self.awaiting[1]:
            layer = self.awaiting[0]
            self.awaiting = None
            self.state[layer] = IDLE
            self.layers_completed += 1
            return layer
        return None

    def awaited_token(self) -> int:
        return self.awaiting[1] if self.awaiting is not None else NO_TOKEN

    # --- timeouts ---------------------------------------------------------------------------

    def check_timeout(self, now: float, timeout: float) -> Abort | None:
        """Abort the preparing layer if its deadline passed (see module docstring)."""
        if self.active_token == NO_TOKEN:
            return None
        if self.observed_at is None:
            elapsed, limit, kind = now - self.dispatch_at, 2.0 * timeout, "output"
        else:
            elapsed, limit, kind = now - self.observed_at, timeout, "prepare progress"
        if elapsed <= limit:
            return None
        layer, token = self.active_layer, self.active_token
        self.enable[layer] = False
        self.state[layer] = IDLE
        self.active_token, self.dispatch_at, self.observed_at = NO_TOKEN, None, None
        self.prepared[:] = NO_TOKEN
        self.active_layer = self._next_enabled(layer)
        self.layers_timed_out += 1
        return Abort(layer, token, kind, elapsed, limit)
