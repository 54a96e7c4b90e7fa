"""Flag values and config files: the coercion of one raw value to its field's type, and the
YAML/JSON config-file reader (``--config FILE``) with line numbers in its errors. Used by
:mod:`xllm_eplb.flags`, which merges the sources."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import yaml

from xllm_eplb.config import (
    FIELDS,
    SECTIONS,
    FieldSpec,
    format_value,
)
from xllm_eplb.config.aliases import canonical
from xllm_eplb.errors import ConfigError

#: names that are flags of the parser itself, not config fields
META = ("config", "flagfile")
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


# --- values -----------------------------------------------------------------------------------

def parse_bool(text: str) -> bool | None:
    """``true/false/1/0/yes/no`` (any case) -> bool; anything else -> None."""
    t = str(text).strip().lower()
    return True if t in _TRUE else False if t in _FALSE else None


def coerce(spec: FieldSpec, raw: Any) -> Any:
    """A string (command line) or a YAML/JSON value -> the field's Python type.

    Raises ConfigError naming the flag, the value and the expected type; range and choice
    checks happen later in :func:`xllm_eplb.config.validate`.
    """
    t = spec.type
    if raw is None and spec.default is None:
        return None
    try:
        if t == "bool":
            if isinstance(raw, bool):
                return raw
            if isinstance(raw, int) and raw in (0, 1):
                return bool(raw)
            v = parse_bool(raw) if isinstance(raw, str) else None
            if v is None:
                raise ValueError
            return v
        if t == "int":
            if isinstance(raw, bool):
                raise ValueError
            if isinstance(raw, float):
                if not raw.is_integer():
                    raise ValueError
                return int(raw)
            if isinstance(raw, int):
                return raw
            text = str(raw).strip()
            try:
                return int(text)
            except ValueError:
                return int(text, 0)
        if t == "tuple":
            items = tuple(raw) if isinstance(raw, (list, tuple)) else (raw,)
            if not all(isinstance(x, str) for x in items):
                raise ValueError
            return items
        if t == "float":
            if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
                raise ValueError
            v = float(raw)
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError
            return v
        if not isinstance(raw, str):
            raise ValueError
        return raw
    except (TypeError, ValueError):
        what = {"bool": "a boolean (true/false/1/0/yes/no)", "int": "an integer",
                "float": "a finite number", "str": "a string",
                "tuple": "a string or a list of strings"}[t]
        shown = format_value(raw) if isinstance(raw, (str, int, float, bool)) else repr(raw)
        raise ConfigError(f"--{spec.name}={shown}: must be {what}") from None


def _suggest(name: str, extra: tuple[str, ...] = META) -> str:
    cands = list(FIELDS) + list(extra)
    close = difflib.get_close_matches(name, cands, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean section '{close[0]}'?)" if close[0] in SECTIONS else \
        f" (did you mean --{close[0]}?)"


# --- config files -----------------------------------------------------------------------------

def _yaml_error(path: Path, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return ConfigError(f"config file {where}: YAML syntax error: {problem}")


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """1-based line of every mapping key of a YAML text (top level and one level down)."""
    lines: dict[tuple[str, ...], int] = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return lines
    if not isinstance(node, yaml.MappingNode):
        return lines
    for k, v in node.value:
        lines[(str(k.value),)] = k.start_mark.line + 1
        if isinstance(v, yaml.MappingNode):
            for k2, _ in v.value:
                lines[(str(k.value), str(k2.value))] = k2.start_mark.line + 1
    return lines


def _read_text(path: Path, what: str) -> str:
    """UTF-8 text of ``path``; ConfigError naming ``what`` and the path when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: cannot read: {e}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML/JSON config file -> flat ``{name: typed value}``; ConfigError on any problem."""
    p = Path(path)
    text = _read_text(p, "config file")
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file {p}:{e.lineno}: JSON syntax error: {e.msg}") from None
        lines: dict[tuple[str, ...], int] = {}
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise _yaml_error(p, e) from None
        lines = _key_lines(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping of flag names to "
                          f"values (or of sections {', '.join(SECTIONS)}), got "
                          f"{type(data).__name__}")
    return _flatten(p, data, lines)


def _flatten(p: Path, data: dict, lines: dict[tuple[str, ...], int]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def where(*key: str) -> str:
        return f"{p}:{lines[key]}" if key in lines else str(p)

    def put(name: str, value: Any, key: tuple[str, ...]) -> None:
        try:
            norm = canonical(name.replace("-", "_"), f"key '{name}'")
        except ConfigError as e:
            raise ConfigError(f"config file {where(*key)}: {e}") from None
        spec = FIELDS.get(norm)
        if spec is None:
            raise ConfigError(f"config file {where(*key)}: unknown key '{name}'"
                              f"{_suggest(norm, tuple(SECTIONS))}")
        if len(key) == 2 and key[0] != spec.section:
            raise ConfigError(f"config file {where(*key)}: key '{name}' belongs to section "
                              f"'{spec.section}', not '{key[0]}'")
        try:
            out[norm] = coerce(spec, value)
        except ConfigError as e:
            raise ConfigError(f"config file {where(*key)}: {e}") from None

    for k, v in data.items():
        k = str(k)
        if k in SECTIONS and isinstance(v, dict):
            for k2, v2 in v.items():
                put(str(k2), v2, (k, str(k2)))
        elif k in SECTIONS and v is None:
            continue
        elif k in SECTIONS:
            raise ConfigError(f"config file {where(k)}: section '{k}' must be a mapping of "
                              f"flag names to values, got {type(v).__name__}")
        else:
            put(k, v, (k,))
    return out


