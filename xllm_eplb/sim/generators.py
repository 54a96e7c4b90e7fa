"""Synthetic load traces and the ``--generate SPEC`` mini-language.

Grammar: ``KIND:ITEM[,ITEM...]`` with ``ITEM`` = ``key=value`` (or, for ``sglang``, the source
chain as the first item). Every step draws ``tokens * topk`` expert picks per layer from that
step's expert distribution (multinomial sampling), so each step is a realistic noisy batch.

``zipf:layers=8,experts=64,steps=2000,tokens=4096,topk=8,skew=1.0,depth=1.0,drift=0.02,shift_every=500,seed=0``
    Zipf-like skew: expert popularity ``1 / rank ** s_l`` with a random rank order per layer;
    ``s_l`` grows linearly from ``skew`` (first layer) to ``skew * (1 + depth)`` (last layer),
    so deeper layers are more skewed. ``drift``: std of a per-step Gaussian random walk of the
    log-popularity (gradual drift). ``shift_every=N``: every N steps each layer's ranking is
    redrawn (sudden topic shift; 0 = never).

``sglang:decode_in1000out1000->decode_in500out1500,steps=2000,tokens=4096,topk=8,mode=switch,ramp=0,seed=0,dir=PATH,layers=0``
    Series built from real static dumps (SGLang ``{"logical_count": [[E] x layers]}`` JSON or
    ``.npy [layers, E]``; leading all-zero dense rows are dropped). ``A->B->C`` splits the steps evenly
    between the files; ``mode=switch`` changes distribution at each boundary (blended linearly
    over ``ramp`` steps), ``mode=interp`` interpolates continuously from the first to the last.
    A name without a suffix is looked up as ``DIR/NAME.json``: ``dir`` in the spec, else the
    ``data_dir`` :func:`generate` is given (``xllm-eplb simulate --data-dir``, whose default is
    ``../shared/data/sglang_ep_statistics``). ``layers=N`` keeps the first N MoE layers (0 = all).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xllm_eplb.eplb.loads import read_loads
from xllm_eplb.errors import ConfigError, InputFileError
from xllm_eplb.sim.trace import Trace

ZIPF_KEYS = dict(layers=8, experts=64, steps=1000, tokens=4096, topk=8, skew=1.0, depth=1.0,
                 drift=0.0, shift_every=0, seed=0)
SGLANG_KEYS = dict(steps=1000, tokens=4096, topk=8, mode="switch", ramp=0, seed=0, dir="",
                   layers=0)


def parse_spec(spec: str) -> tuple[str, list[str], dict[str, str]]:
    """``KIND:ITEM,...`` -> (kind, positional items, {key: raw value})."""
    kind, sep, rest = spec.partition(":")
    if not sep or not kind:
        raise ConfigError(f"--generate {spec!r}: expected KIND:key=value,... "
                          f"(KIND one of zipf, sglang)")
    pos, kv = [], {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        if eq:
            kv[k.strip()] = v.strip()
        else:
            pos.append(item)
    return kind.strip().lower(), pos, kv


def _typed(spec: str, kv: dict[str, str], defaults: dict) -> dict:
    unknown = sorted(set(kv) - set(defaults))
    if unknown:
        raise ConfigError(f"--generate {spec!r}: unknown key '{unknown[0]}' (known: "
                          f"{', '.join(defaults)})")
    out = dict(defaults)
    for k, raw in kv.items():
        want = type(defaults[k])
        try:
            if want is int:
                f = float(raw)
                if not f.is_integer():
                    raise ValueError
                out[k] = int(f)
            else:
                out[k] = want(raw)
        except ValueError:
            raise ConfigError(f"--generate {spec!r}: {k}={raw}: must be "
                              f"{'an integer' if want is int else 'a number'}") from None
    for k in ("steps", "tokens", "topk"):
        if out[k] < 1:
            raise ConfigError(f"--generate {spec!r}: {k}={out[k]}: must be >= 1")
    return out


def _sample(probs_at, steps: int, picks: int, rng: np.random.Generator) -> np.ndarray:
    """``probs_at(step) -> [layers, experts]`` (None = same as previous) -> int64 loads
    ``[steps, layers, experts]`` by multinomial sampling of ``picks`` per layer per step."""
    first = probs_at(0)
    out = np.empty((steps, *first.shape), dtype=np.int64)
    p, start = first, 0
    for t in range(1, steps + 1):
        nxt = probs_at(t) if t < steps else None
        if nxt is None and t < steps:
            continue
        out[start:t] = rng.multinomial(picks, p, size=(t - start, p.shape[0]))
        p, start = nxt, t
    return out


def _normalise(w: np.ndarray) -> np.ndarray:
    return w / w.sum(axis=-1, keepdims=True)


def zipf_trace(spec: str, kv: dict[str, str]) -> Trace:
    o = _typed(spec, kv, ZIPF_KEYS)
    L, E, rng = o["layers"], o["experts"], np.random.default_rng(o["seed"])
    s = o["skew"] * (1.0 + o["depth"] * np.linspace(0.0, 1.0, L))         # [L]
    ranks = np.stack([rng.permutation(E) for _ in range(L)])              # [L, E]
    logw = -s[:, None] * np.log1p(ranks)
    state = {"logw": logw}

    def probs_at(t: int):
        changed = False
        if o["shift_every"] and t and t % o["shift_every"] == 0:
            state["logw"] = -s[:, None] * np.log1p(np.stack([rng.permutation(E)
                                                              for _ in range(L)]))
            changed = True
        if o["drift"] and t:
            state["logw"] = state["logw"] + o["drift"] * rng.standard_normal((L, E))
            changed = True
        if t and not changed:
            return None
        w = np.exp(state["logw"] - state["logw"].max(axis=1, keepdims=True))
        return _normalise(w)

    loads = _sample(probs_at, o["steps"], o["tokens"] * o["topk"], rng)
    return Trace(loads, {"generator": "zipf", "spec": spec, **o})


def read_static_loads(path: Path) -> np.ndarray:
    """A static load file (SGLang dump, JSON table or ``.npy``; read by
    :func:`xllm_eplb.eplb.loads.read_loads`, leading dense rows dropped) -> float64
    ``[moe_layers, E]``. A later all-zero layer becomes uniform (it has no preference)."""
    a = read_loads(path).loads.astype(np.float64)
    zero = a.sum(axis=1) == 0
    a[zero] = 1.0
    return a


def _resolve(spec: str, name: str, data_dir: str | Path | None) -> Path:
    p = Path(name)
    if p.suffix in (".json", ".npy"):
        return p
    if not data_dir:
        raise ConfigError(f"--generate {spec!r}: '{name}' has no .json/.npy suffix, so it needs "
                          f"a folder: dir=PATH in the spec (or simulate --data-dir)")
    path = Path(data_dir) / f"{name}.json"
    if not path.is_file():
        raise InputFileError(f"load file {name}.json: not found in {data_dir}")
    return path


def _mix_weights(steps: int, n: int, mode: str, ramp: int) -> np.ndarray:
    """Per step: weight of each of the ``n`` chained files, float64 ``[steps, n]``."""
    t = np.arange(steps, dtype=np.float64)
    w = np.zeros((steps, n))
    if n == 1:
        w[:, 0] = 1.0
        return w
    if mode == "interp":
        x = t / max(steps - 1, 1) * (n - 1)
    else:
        bounds = np.arange(1, n) * (steps / n)                           # [n-1] switch steps
        if ramp > 0:
            x = np.clip((t[:, None] - bounds[None, :]) / ramp, 0.0, 1.0).sum(axis=1)
        else:
            x = (t[:, None] >= bounds[None, :]).sum(axis=1).astype(np.float64)
    lo = np.clip(np.floor(x).astype(int), 0, n - 1)
    hi = np.clip(lo + 1, 0, n - 1)
    frac = x - lo
    w[np.arange(steps), lo] += 1.0 - frac
    w[np.arange(steps), hi] += frac
    return w


def sglang_trace(spec: str, pos: list[str], kv: dict[str, str],
                 data_dir: str | Path | None = None) -> Trace:
    o = _typed(spec, kv, SGLANG_KEYS)
    if len(pos) != 1:
        raise ConfigError(f"--generate {spec!r}: sglang needs one source chain like "
                          f"decode_in1000out1000->decode_in500out1500")
    if o["mode"] not in ("switch", "interp"):
        raise ConfigError(f"--generate {spec!r}: mode={o['mode']}: must be switch or interp")
    names = [s.strip() for s in pos[0].split("->")]
    dists = [read_static_loads(_resolve(spec, n, o["dir"] or data_dir)) for n in names]
    shapes = {d.shape for d in dists}
    if len(shapes) != 1:
        raise InputFileError(f"--generate {spec!r}: files differ in shape: "
                             f"{', '.join(f'{n}={d.shape}' for n, d in zip(names, dists, strict=True))}")
    if o["layers"]:
        dists = [d[: o["layers"]] for d in dists]
    probs = np.stack([_normalise(d) for d in dists])                 # [n, L, E]
    mix = _mix_weights(o["steps"], len(names), o["mode"], o["ramp"])
    rng = np.random.default_rng(o["seed"])

    def probs_at(t: int):
        if t and np.array_equal(mix[t], mix[t - 1]):
            return None
        return np.tensordot(mix[t], probs, axes=1)

    loads = _sample(probs_at, o["steps"], o["tokens"] * o["topk"], rng)
    return Trace(loads, {"generator": "sglang", "spec": spec, "files": names, **o})


def generate(spec: str, *, data_dir: str | Path | None = None) -> Trace:
    """Build a trace from a ``--generate`` spec (see module docstring); ``data_dir``: where
    ``sglang`` source names without a suffix are looked up when the spec has no ``dir=``."""
    kind, pos, kv = parse_spec(spec)
    if kind == "zipf":
        if pos:
            raise ConfigError(f"--generate {spec!r}: unexpected item '{pos[0]}' (zipf takes "
                              f"only key=value items)")
        return zipf_trace(spec, kv)
    if kind == "sglang":
        return sglang_trace(spec, pos, kv, data_dir)
    raise ConfigError(f"--generate {spec!r}: unknown kind '{kind}' (one of zipf, sglang)")
