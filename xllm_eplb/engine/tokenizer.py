"""Tokenizers the engine serves with, behind one small interface.

``Tokenizer`` is what the scheduler, the workload and the HTTP API use: ``encode(text)``,
``decode(ids)``, ``bos_id`` (or None), ``eos_ids`` (a frozenset; generation stops on any),
``has_text`` (False: the checkpoint ships no tokenizer, only token-id prompts are served) and
``apply_chat_template(messages)`` (raises ``TokenizerError`` when there is no template).

``ByteTokenizer``: UTF-8 bytes are token ids 0..255, then BOS (256) and EOS (257); any id above
EOS is a valid model output that has no text and decodes to nothing. No served model uses it
(a run without ``--model`` serves the generated checkpoint and its BPE tokenizer); it is the
tokenizer of API tests whose backend is not a checkpoint.

``HfTokenizer``: a Hugging Face checkpoint's ``tokenizer.json`` through the ``tokenizers``
library; special tokens and the chat template from ``tokenizer_config.json`` (or
``chat_template.jinja``), rendered with jinja2 in a sandbox the way transformers does; EOS ids from
``generation_config.json`` (int or list), else the config's ``eos_token``, else ``config.json``.
``NoTextTokenizer``: a checkpoint without ``tokenizer.json``: token-id prompts only
(``has_text=False``; text raises TokenizerError naming the folder), EOS ids as above.
``load_tokenizer(model_dir)`` picks one of them for a folder; ``served_tokenizer(cfg)`` is the
one the API serves (``--tokenizer``'s folder, else the model's, with ``--chat-template``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xllm_eplb.errors import UserError

BOS_ID = 256
EOS_ID = 257


class TokenizerError(UserError, ValueError):
    """A tokenizer cannot do what was asked (no tokenizer files, no chat template, bad file).

    A UserError, so a file that fails to load at start-up is one ``error:`` line, exit 2; the
    HTTP API answers a request that raises it with a 400."""


class ChatTemplateError(TokenizerError):
    """The chat template exists but refuses these messages (e.g. an unknown role; the
    template's own ``raise_exception``): the request's fault, not a missing template."""


class Tokenizer:
    """Interface (see the module docstring)."""

    bos_id: int | None = None
    eos_ids: frozenset[int] = frozenset()
    has_text: bool = True
    name: str = "tokenizer"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], *,
                            add_generation_prompt: bool = True) -> str:
        raise TokenizerError(f"{self.name}: this tokenizer has no chat template")


class ByteTokenizer(Tokenizer):
    """The byte-level tokenizer (see the module docstring)."""

    bos_id = BOS_ID
    eos_ids = frozenset({EOS_ID})
    name = "byte"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return encode(text, add_bos=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return decode(ids)


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    """Text -> token ids ``[BOS] + utf8 bytes``."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: list[int]) -> str:
    """Token ids -> text: bytes are joined, special and out-of-byte-range ids dropped,
    invalid UTF-8 replaced (a random model emits arbitrary bytes)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# --- Hugging Face checkpoints -----------------------------------------------------------------

def _read_json(path: Path) -> dict | None:
    """A JSON object file, or None when absent; TokenizerError naming the file otherwise."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value, path: Path, field: str) -> list[int]:
    vals = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise TokenizerError(f"{path}: {field}={value!r} must be a token id or a list of ids")
    return vals


class _Folder:
    """The tokenizer-relevant JSON files of one checkpoint folder."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise TokenizerError(f"{self.dir}: checkpoint folder does not exist")
        self.tok_cfg = _read_json(self.dir / "tokenizer_config.json") or {}
        self.gen_cfg = _read_json(self.dir / "generation_config.json") or {}
        self.cfg = _read_json(self.dir / "config.json") or {}

    def ids_from_configs(self, field: str) -> list[int]:
        """``eos_token_id`` / ``bos_token_id`` from generation_config.json, else config.json."""
        for name, data in (("generation_config.json", self.gen_cfg), ("config.json", self.cfg)):
            if data.get(field) is not None:
                return _ids(data[field], self.dir / name, field)
        return []


class NoTextTokenizer(Tokenizer):
    """A checkpoint without tokenizer files: serves token-id prompts only."""

    has_text = False

    def __init__(self, model_dir: str | os.PathLike):
        f = _Folder(model_dir)
        self.dir, self.name = f.dir, f"no tokenizer ({f.dir})"
        self.eos_ids = frozenset(f.ids_from_configs("eos_token_id"))
        bos = f.ids_from_configs("bos_token_id")
        self.bos_id = bos[0] if bos else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise TokenizerError(f"{self.dir} has no tokenizer files (tokenizer.json): only "
                             "token-id prompts can be served")

    def decode(self, ids: list[int]) -> str:
        return ""


class HfTokenizer(Tokenizer):
    """``tokenizer.json`` + ``tokenizer_config.json`` of a checkpoint folder (module docstring)."""

    def __init__(self, model_dir: str | os.PathLike):
        from tokenizers import Tokenizer as RawTokenizer

        f = _Folder(model_dir)
        self.dir, self.name = f.dir, f"tokenizer of {f.dir}"
        path = f.dir / "tokenizer.json"
        try:
            self.raw = RawTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise TokenizerError(f"{path}: cannot load tokenizer ({why})") from None
        self.size = self.raw.get_vocab_size(with_added_tokens=True)
        self.num_text_tokens = self.raw.get_vocab_size(with_added_tokens=False)
        self.special = {k: _token_text(f.tok_cfg.get(k)) for k in
                        ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_id = self._special_id("bos_token", f) if self.special["bos_token"] else None
        if self.bos_id is None:
            bos = f.ids_from_configs("bos_token_id")
            self.bos_id = bos[0] if bos else None
        eos = _ids(f.gen_cfg["eos_token_id"], f.dir / "generation_config.json", "eos_token_id") \
            if f.gen_cfg.get("eos_token_id") is not None else []
        if not eos and self.special["eos_token"]:
            eos = [self._special_id("eos_token", f)]
        self.eos_ids = frozenset(eos or f.ids_from_configs("eos_token_id"))
        self._template = _chat_template(f)
        self._compiled = _compile(self._template[1], self._template[0]) \
            if self._template else None

    def set_chat_template(self, path: Path, source: str) -> None:
        """Use ``source`` (read from ``path``, named in errors) as the chat template."""
        self._template = (path, source)
        self._compiled = _compile(source, path)

    def _special_id(self, key: str, f: _Folder) -> int:
        i = self.raw.token_to_id(self.special[key])
        if i is None:
            raise TokenizerError(f"{f.dir / 'tokenizer_config.json'}: {key}="
                                 f"{self.special[key]!r} is not a token of tokenizer.json")
        return i

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.raw.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids the tokenizer does not have (padded vocabulary rows) are dropped."""
        known = [int(i) for i in ids if 0 <= int(i) < self.size]
        return self.raw.decode(known, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *,
                            add_generation_prompt: bool = True) -> str:
        """The rendered prompt (it holds the template's BOS: encode it without special tokens)."""
        if self._compiled is None:
            raise TokenizerError(f"{self.name}: this tokenizer has no chat template")
        if not messages:
            raise ChatTemplateError("messages: empty (a chat needs at least one message)")
        import jinja2

        try:
            return self._compiled.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special.items() if v})
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.dir}: {e}") from None


def _chat_template(f: _Folder) -> tuple[Path, str] | None:
    """(file, source) of the chat template: ``chat_template.jinja``, else tokenizer_config's
    ``chat_template`` (a string, or a list of ``{name, template}`` whose ``default`` is used)."""
    jinja = f.dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja, jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja}: cannot read ({e})") from None
    t = f.tok_cfg.get("chat_template")
    path = f.dir / "tokenizer_config.json"
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    if t is None:
        return None
    if not isinstance(t, str):
        raise TokenizerError(f"{path}: chat_template must be a string or a list of "
                             "{name, template} with a 'default'")
    return path, t


def _compile(source: str, path: Path):
    """Compile a chat template as transformers does: an immutable sandbox, trim/lstrip blocks,
    loop controls, ``raise_exception``, ``tojson`` without HTML escaping, ``strftime_now``."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{path}: chat template does not compile (line {e.lineno}: "
                             f"{e.message})") from None


def load_tokenizer(model_dir: str | None) -> Tokenizer:
    """The tokenizer of a checkpoint folder: ``HfTokenizer`` when it has ``tokenizer.json``,
    else a ``has_text=False`` tokenizer (token-id prompts only). ``model_dir`` empty or None:
    a ``ByteTokenizer`` (no folder to read). Raises TokenizerError for a file that fails to
    load (naming the file and the reason)."""
    if not model_dir:
        return ByteTokenizer()
    if (Path(model_dir) / "tokenizer.json").is_file():
        return HfTokenizer(model_dir)
    return NoTextTokenizer(model_dir)


def read_chat_template(value: str) -> tuple[Path, str]:
    """``--chat-template``: a file (read) or the template text itself (as vLLM takes it);
    TokenizerError for a path that names no file."""
    p = Path(value).expanduser()
    if p.is_file():
        try:
            return p, p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"--chat_template={value}: cannot read ({e})") from None
    if "{" not in value:
        raise TokenizerError(f"--chat_template={value}: no such file (give a Jinja file or the "
                             "template text itself)")
    return Path("--chat_template"), value


def check_chat_template(value: str) -> None:
    """``--chat-template`` reads and compiles (TokenizerError naming the flag or file)."""
    _compile(*reversed(read_chat_template(value)))


def served_tokenizer(model_dir: str | None, tokenizer: str = "",
                     chat_template: str = "") -> Tokenizer:
    """The API's tokenizer: ``tokenizer`` (a folder, ``--tokenizer``) else ``model_dir``'s,
    with ``chat_template`` (``--chat-template``: file or text) replacing its own template.
    TokenizerError (exit 2 at start-up) for files that do not load or a template without a
    text tokenizer to encode it."""
    if tokenizer and not Path(tokenizer).is_dir():
        raise TokenizerError(f"--tokenizer={tokenizer}: not a folder (one with tokenizer.json, "
                             "or a Hugging Face ORG/NAME in the local cache)")
    tok = load_tokenizer(tokenizer or model_dir or None)
    if chat_template:
        if not isinstance(tok, HfTokenizer):
            raise TokenizerError(f"--chat_template: {tok.name} cannot encode text (no "
                                 "tokenizer.json); give --tokenizer a folder that has one")
        tok.set_chat_template(*read_chat_template(chat_template))
    return tok
