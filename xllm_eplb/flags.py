"""gflags-style flags, config files and flagfiles -> one validated :class:`Config`.

Accepted tokens (names use ``_`` or ``-`` interchangeably: ``--ep-size 16`` == ``--ep_size=16``):

- ``--name=value`` and ``--name value``;
- booleans: ``--name``, ``--noname``, ``--no-name``, ``--name=false``; values
  true/false/1/0/yes/no (any case);
- ``--config FILE``: YAML (``yaml.safe_load``) or JSON (``.json``), flat ``{name: value}`` or
  sectioned ``{eplb: {...}, model: {...}}`` (both may be mixed);
- ``--flagfile FILE``: one flag per line, ``#`` comments, nested flagfiles; relative paths are
  resolved against the including file; cycles are an error.

Precedence: defaults < config file < flagfile < command line, whatever the token order; within
one source the last value wins. Repeatable flags (type ``tuple``, e.g. ``--fault_inject``)
collect every occurrence of one source in order (a YAML list in a config file); a higher source
replaces the whole list. NOTE: xLLM lets its JSON file win over flags; we do not.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

from xllm_eplb.config import (
    FIELDS,
    LEGACY_POLICY_KINDS,
    POLICY_KINDS,
    SECTIONS,
    Config,
    format_value,
    known_policy_kind,
    normalize_policy_kind,
    validate,
)
from xllm_eplb.config.aliases import BARE, canonical, short_flag
from xllm_eplb.config.files import META as _META
from xllm_eplb.config.files import (  # noqa: F401  (re-exported)
    _flatten,
    _read_text,
    _suggest,
    coerce,
    parse_bool,
    read_config_file,
)
from xllm_eplb.errors import ConfigError

SOURCES = ("default", "file", "flagfile", "cli")


# --- tokens -----------------------------------------------------------------------------------

class _Layers:
    """Values per source plus the config files named on the way (resolved in order)."""

    def __init__(self, positional_model: bool = False) -> None:
        self.values: dict[str, dict[str, Any]] = {s: {} for s in SOURCES[1:]}
        self.config_files: list[Path] = []
        #: a bare command-line token is the model (``serve DIR``); the one given, if any
        self.positional_model = positional_model
        self.positional = ""

    def take_positional_model(self, tok: str) -> None:
        """``serve DIR`` (vLLM's ``vllm serve MODEL``): the one positional argument is
        ``--model``."""
        if self.positional:
            raise ConfigError(f"unexpected argument '{tok}': the model is already given as "
                              f"'{self.positional}' (one positional argument, the model); "
                              f"flags look like --name=value")
        if "model" in self.values["cli"]:
            raise ConfigError(f"unexpected argument '{tok}': --model="
                              f"{self.values['cli']['model']} already names the model; give "
                              f"it once")
        self.positional = tok
        self.values["cli"]["model"] = coerce(FIELDS["model"], tok)


def _read_flagfile(path: Path, stack: tuple[Path, ...]) -> list[tuple[str, str]]:
    """Tokens of a flagfile with their origin (``file:line``)."""
    try:
        real = path.resolve()
    except OSError:
        real = path
    if real in stack:
        chain = " -> ".join(str(s) for s in (*stack, real))
        raise ConfigError(f"flagfile {path}: include cycle: {chain}")
    text = _read_text(path, "flagfile")
    toks: list[tuple[str, str]] = []
    for i, line in enumerate(text.splitlines(), 1):
        try:
            parts = shlex.split(line, comments=True)
        except ValueError as e:
            raise ConfigError(f"flagfile {path}:{i}: {e}") from None
        toks.extend((t, f"{path}:{i}") for t in parts)
    return toks


def _negated(name: str) -> str:
    """``no_x`` / ``nox`` -> ``x`` (aliases resolved); '' when ``name`` is not negated."""
    neg = name[3:] if name.startswith("no_") else name[2:] if name.startswith("no") else ""
    try:
        return canonical(neg, f"--{name}") if neg else ""
    except ConfigError:
        return ""


def _split(tok: str) -> tuple[str, str | None]:
    body = tok[2:]
    name, eq, value = body.partition("=")
    return name.replace("-", "_"), (value if eq else None)


def _consume(tokens: list[tuple[str, str]], layers: _Layers, source: str,
             base: Path, stack: tuple[Path, ...]) -> None:
    """Walk tokens of one source; flagfiles recurse with source ``flagfile``."""
    i = 0
    while i < len(tokens):
        tok, origin = tokens[i]
        i += 1
        at = "" if origin == "cli" else f"flagfile {origin}: "
        if not tok.startswith("--") or tok == "--":
            if origin == "cli" and layers.positional_model and not tok.startswith("-"):
                layers.take_positional_model(tok)
                continue
            if tok.startswith("-") and tok != "--":
                raise ConfigError(f"{at}{short_flag(tok)}")
            raise ConfigError(f"{at}unexpected argument '{tok}': flags look like --name=value")
        name, value = _split(tok)
        try:
            name = canonical(name, tok.partition("=")[0])
        except ConfigError as e:
            raise ConfigError(f"{at}{e}") from None
        spec = FIELDS.get(name)
        if spec is None and name not in _META:
            neg = _negated(name)
            nspec = FIELDS.get(neg)
            if nspec is not None and (nspec.type == "bool" or neg in BARE):
                if value is not None:
                    raise ConfigError(f"{at}{tok}: --no{neg} takes no value")
                layers.values[source][neg] = BARE[neg][1] if neg in BARE else False
                continue
            raise ConfigError(f"{at}unknown flag '{tok.partition('=')[0]}'{_suggest(name)}")
        if value is None and name in BARE and (i >= len(tokens)
                                               or tokens[i][0].startswith("-")):
            value = BARE[name][0]          # --workload alone: the non-off choice
        if value is None:
            if spec is not None and spec.type == "bool":
                nxt = tokens[i][0] if i < len(tokens) else None
                if nxt is not None and not nxt.startswith("-") and parse_bool(nxt) is not None:
                    value, i = nxt, i + 1
                else:
                    value = "true"
            elif i < len(tokens):
                value, i = tokens[i][0], i + 1
            else:
                raise ConfigError(f"{at}--{name} needs a value")
        if name == "config":
            layers.config_files.append(_resolve(value, base))
        elif name == "flagfile":
            path = _resolve(value, base)
            sub = _read_flagfile(path, stack)
            _consume(sub, layers, "flagfile", path.parent, (*stack, path.resolve()))
        else:
            if name == "model" and source == "cli" and layers.positional:
                raise ConfigError(f"--model={value}: the model is already given as the "
                                  f"positional argument '{layers.positional}'; give it once")
            try:
                got = coerce(spec, value)
                if spec.type == "tuple":      # repeatable: collect within this source
                    got = layers.values[source].get(name, ()) + got
                layers.values[source][name] = got
            except ConfigError as e:
                raise ConfigError(f"{at}{e}") from None


def _resolve(value: str, base: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


# --- public API -------------------------------------------------------------------------------

def config_from_dict(d: dict[str, Any], *, require_ep_size: bool = False) -> Config:
    """A validated Config from ``{name: value}`` (flat or sectioned, like a config file)."""
    flat = _flatten(Path("<dict>"), d, {})
    cfg, _ = _build(flat, {k: "file" for k in flat}, require_ep_size)
    return cfg


def _policy_kind(values: dict[str, Any]) -> dict[str, Any]:
    """``eplb_policy_kind`` canonical; ConfigError (exit 2) for a name that is no policy.
    NOTE: the fallback to greedy stays in ``normalize_policy_kind`` for values that reach a
    running rebalance loop by other ways (xLLM's rule: never crash it)."""
    if "eplb_policy_kind" not in values:
        return values
    kind = values["eplb_policy_kind"]
    if not known_policy_kind(kind):
        raise ConfigError(f"--eplb_policy_kind={format_value(kind)}: must be one of "
                          f"{', '.join(POLICY_KINDS)} (or a legacy name of balanced: "
                          f"{', '.join(LEGACY_POLICY_KINDS)})")
    return dict(values, eplb_policy_kind=normalize_policy_kind(kind))


#: what one EP rank implies, and the rule shown when a flag asks otherwise
_SINGLE_RANK = {"enable_eplb": (False, "needs --ep_size > 1 (one rank has nothing to balance)"),
                "redundant_experts_num": (0, "must be 0 with --ep_size=1 (one rank holds every "
                                             "expert once)")}


def _single_rank(values: dict[str, Any], sources: dict[str, str]) -> None:
    """``--ep_size=1``: the engine's baseline, EPLB off and no redundant slot. A config file or
    the defaults are overridden (source ``ep_size=1``); a flag that asks otherwise is an error."""
    if values.get("ep_size") != 1:
        return
    for name, (want, rule) in _SINGLE_RANK.items():
        if name in values and values[name] != want and sources.get(name) in ("flagfile", "cli"):
            raise ConfigError(f"--{name}={format_value(values[name])}: {rule}")
        if values.get(name, FIELDS[name].default) != want:
            values[name], sources[name] = want, "ep_size=1"


def _build(values: dict[str, Any], sources: dict[str, str],
           require_ep_size: bool) -> tuple[Config, dict[str, str]]:
    values, sources = _policy_kind(dict(values)), dict(sources)
    _single_rank(values, sources)
    per_sec: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, v in values.items():
        per_sec[FIELDS[name].section][name] = v
    cfg = Config(**{s: dataclasses.replace(SECTIONS[s](), **kv) for s, kv in per_sec.items()})
    validate(cfg, require_ep_size=require_ep_size)
    full = {name: sources.get(name, "default") for name in FIELDS}
    return cfg, full


def load_config(argv: list[str], *, require_ep_size: bool = True,
                positional_model: bool = False) -> tuple[Config, dict[str, str]]:
    """Resolve ``argv`` (flags only; ``positional_model``: plus one bare token, the model, as
    vLLM's ``serve MODEL``) into a validated Config and each field's source.

    Returns ``(cfg, sources)``, sources mapping every field name to one of
    ``default``/``file``/``flagfile``/``cli``. Raises ConfigError (a UserError, exit 2) naming
    the file/flag, the value and the rule.
    """
    layers = _Layers(positional_model)
    _consume([(t, "cli") for t in argv], layers, "cli", Path(), ())
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for path in layers.config_files:
        for k, v in read_config_file(path).items():
            values[k], sources[k] = v, "file"
    for src in ("flagfile", "cli"):
        for k, v in layers.values[src].items():
            values[k], sources[k] = v, src
    return _build(values, sources, require_ep_size)

