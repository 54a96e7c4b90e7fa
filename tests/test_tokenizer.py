"""`HfTokenizer` / `load_tokenizer` against transformers' AutoTokenizer on generated folders:
same ids, same text, same rendered chat prompt; EOS ids; folders without tokenizer files; every
broken file named in one TokenizerError."""

from __future__ import annotations

import json
import os
import shutil

import jinja2
import numpy as np
import pytest

from xllm_eplb.engine.tokenizer import (
    ByteTokenizer,
    HfTokenizer,
    NoTextTokenizer,
    TokenizerError,
    load_tokenizer,
)
from xllm_eplb.errors import UserError
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.checkpoint_tokenizer import corpus, train_tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers  # noqa: E402 (the oracle; a dev dependency, never skipped)

pytestmark = pytest.mark.oracle

TEXTS = ["", "Hello world", "The capital of France is Paris.", "  leading and trailing  ",
         "tabs\tand\nnewlines\n\n", "numbers 1234567 and 3.14", "ünïcödé — 東京 😀 ﬁ",
         "e\u0301 (a combining accent: NFC makes it one character)",
         "<|im_start|>user\nhi<|im_end|>", "<|bos|><|eos|> inside text", "expert load balance"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "ünï 東京"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tok") / "ck",
                           num_experts=8, top_k=2, num_layers=2)


@pytest.fixture(scope="module")
def hf(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_encode_matches_transformers(folder, hf):
    ours = HfTokenizer(folder)
    more = corpus(40)[::3]
    for text in TEXTS + more:
        assert ours.encode(text) == hf(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == \
            hf(text, add_special_tokens=False).input_ids, text
    assert ours.encode("x")[0] == ours.bos_id == hf.bos_token_id


def test_decode_matches_transformers(folder, hf):
    ours = HfTokenizer(folder)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    rng = np.random.default_rng(0)
    for _ in range(50):                              # arbitrary model output, specials included
        ids = [int(i) for i in rng.integers(0, len(hf), size=int(rng.integers(1, 20)))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), ids
    assert ours.decode([ours.size, ours.size + 3]) == ""    # padded vocabulary rows: no text


def test_chat_template_matches_transformers(folder, hf):
    ours = HfTokenizer(folder)
    for chat in CHATS:
        for gen in (True, False):
            want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            got = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert got == want
            ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert ours.encode(got, add_special_tokens=False) == list(ids)
    with pytest.raises(ValueError, match="empty conversation"):
        hf.apply_chat_template([], tokenize=False)
    with pytest.raises(TokenizerError, match="messages: empty"):
        ours.apply_chat_template([])
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        ours.apply_chat_template(bad)


def test_eos_ids_from_generation_config_then_tokenizer_config_then_config(folder, tmp_path):
    ours = HfTokenizer(folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert ours.eos_ids == frozenset(gen["eos_token_id"]) and len(ours.eos_ids) == 2
    d = tmp_path / "c"
    shutil.copytree(folder, d)
    eos = ours.raw.token_to_id("<|eos|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))   # an int
    assert HfTokenizer(d).eos_ids == {eos}
    (d / "generation_config.json").unlink()                      # -> tokenizer_config eos_token
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["eos_token"] = {"content": "<|im_end|>", "special": True}   # AddedToken spelling
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    assert HfTokenizer(d).eos_ids == {ours.raw.token_to_id("<|im_end|>")}
    del tc["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(tc))     # -> config.json eos_token_id
    assert HfTokenizer(d).eos_ids == {json.loads((d / "config.json").read_text())["eos_token_id"]}


def test_folder_saved_by_transformers_loads_too(hf, tmp_path):
    """transformers 5 writes the chat template to chat_template.jinja: read it from there."""
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    ours = HfTokenizer(tmp_path)
    chat = CHATS[1]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True)
    assert ours.encode(TEXTS[2]) == hf(TEXTS[2]).input_ids


def test_folder_without_tokenizer_serves_ids_only(folder, tmp_path):
    d = tmp_path / "weights_only"
    d.mkdir()
    shutil.copy(folder / "config.json", d)
    shutil.copy(folder / "generation_config.json", d)
    tok = load_tokenizer(str(d))
    assert isinstance(tok, NoTextTokenizer) and tok.has_text is False
    assert tok.eos_ids == HfTokenizer(folder).eos_ids
    with pytest.raises(TokenizerError, match=f"{d} has no tokenizer files"):
        tok.encode("hello")
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    assert load_tokenizer(str(d)).eos_ids == {cfg["eos_token_id"]}
    assert isinstance(load_tokenizer(str(folder)), HfTokenizer) and \
        load_tokenizer(str(folder)).has_text
    assert isinstance(load_tokenizer(""), ByteTokenizer)


def _broken(folder, tmp_path, name, text):
    d = tmp_path / f"{name.replace('.', '_')}_{len(list(tmp_path.iterdir()))}"
    shutil.copytree(folder, d)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize("name,text,why", [
    ("tokenizer.json", '{"version": "1.0", "model": {"type": "nonsense"}}', "cannot load tokenizer"),
    ("tokenizer.json", "not json at all", "cannot load tokenizer"),
    ("tokenizer_config.json", "{bad json", "cannot read JSON"),
    ("generation_config.json", "[1, 2]", "expected a JSON object"),
])
def test_broken_files_are_named(folder, tmp_path, name, text, why):
    d = _broken(folder, tmp_path, name, text)
    with pytest.raises(TokenizerError, match=why) as e:
        load_tokenizer(str(d))
    assert str(d / name) in str(e.value) and isinstance(e.value, UserError)
    assert len(str(e.value).splitlines()) == 1


def test_bad_template_bad_special_token_bad_eos(folder, tmp_path):
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    d = _broken(folder, tmp_path, "tokenizer_config.json",
                json.dumps(dict(tc, chat_template="{% for m in messages %}")))
    with pytest.raises(TokenizerError, match="chat template does not compile"):
        HfTokenizer(d)
    d = _broken(folder, tmp_path, "tokenizer_config.json", json.dumps(dict(tc, bos_token="<s>")))
    with pytest.raises(TokenizerError, match="bos_token='<s>' is not a token of tokenizer.json"):
        HfTokenizer(d)
    d = _broken(folder, tmp_path, "generation_config.json", json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id='x' must be a token id"):
        HfTokenizer(d)
    with pytest.raises(TokenizerError, match="checkpoint folder does not exist"):
        load_tokenizer(str(tmp_path / "missing"))


def test_training_is_deterministic_and_fills_the_vocabulary():
    a, b = train_tokenizer(512), train_tokenizer(512)
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 512
    assert a.token_to_id("<|bos|>") == 508 and a.token_to_id("<|im_end|>") == 511
    big = train_tokenizer(1024)
    assert big.get_vocab_size() == 1024
    text = "the capital of France is Paris"
    assert len(big.encode(text).ids) < len(a.encode(text).ids) < len(text.encode())


def test_the_trained_pipeline_normalises_prepends_bos_and_round_trips_bytes():
    """What train_tokenizer's tokenizer.json spec sets up: NFC, byte-level BPE (any text
    round-trips), ``<|bos|>`` before each sequence only when special tokens are asked for."""
    tok = train_tokenizer(512)
    bos = tok.token_to_id("<|bos|>")
    enc = tok.encode("Caf\u00e9 \U0001F600 ok")
    assert enc.ids[0] == bos and bos not in enc.ids[1:]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "Caf\u00e9 \U0001F600 ok"
    assert tok.encode("Cafe\u0301").ids == tok.encode("Caf\u00e9").ids
    a, b = (tok.encode(t, add_special_tokens=False).ids for t in ("one", "two"))
    assert bos not in a and tok.encode("one", "two").ids == [bos, *a, bos, *b]
