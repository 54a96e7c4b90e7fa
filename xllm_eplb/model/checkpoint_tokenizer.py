"""The tokenizer of generated checkpoints: a small byte-level BPE trained on a fixed corpus.

``train_tokenizer(vocab_size)`` trains a ``tokenizers`` BPE (byte-level pre-tokenizer and
decoder, NFC normaliser, the 256 byte symbols as the initial alphabet) with
``vocab_size - NUM_SPECIAL`` entries on :func:`corpus`, then appends the special tokens
``<|bos|>``, ``<|eos|>``, ``<|im_start|>``, ``<|im_end|>`` (ids ``n .. n+3``, n = the trained
size). Encoding with special tokens prepends ``<|bos|>`` (a TemplateProcessing post-processor).
The corpus is text generated from a fixed English word list and seeded pseudo-words, so the
result is the same on every machine and run (checked by a test).

``tokenizer_config()`` is the ``tokenizer_config.json``: special tokens and a ChatML chat
template (rendered prompt = ``<|bos|>`` + ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message
+ ``<|im_start|>assistant\\n`` with ``add_generation_prompt``); encode it without special tokens.
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers, trainers

BOS, EOS, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)
NUM_SPECIAL = len(SPECIAL_TOKENS)
CORPUS_SEED = 20261201

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role'] + ': use system, user or assistant') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = (
    "the of and to in is was for that with as on by it at from this be are or an which have "
    "not has but had they were their one all been can more there when will would who so if "
    "what about into than them only other some time could these two may first then do any "
    "like new now after also made over such most very well where just through long because "
    "each those people how many year work world state part way day back good high small large "
    "place great old city country water light right left number system model expert token "
    "layer load balance rank slot route router engine process memory weight tensor batch "
    "prefill decode cache shard group policy placement migration request response server "
    "capital France Paris Germany Berlin Italy Rome Spain Madrid river mountain ocean north "
    "south east west question answer hello thank please yes no what why which how"
).split()
SYLLABLES = ("ka ri to ne mu sa lo vi de pa zu ho fe gi ba ru mi te so na ki lu po ve ra "
             "xi jo qua ste pri").split()


def _pseudo_words(rng: np.random.Generator, n: int) -> list[str]:
    return ["".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 5)))) for _ in range(n)]


def corpus(num_sentences: int = 3000) -> list[str]:
    """The fixed training corpus: sentences over WORDS and seeded pseudo-words (Zipf-like
    word frequencies), with capitals, digits, punctuation and a few chat turns."""
    rng = np.random.default_rng(CORPUS_SEED)
    vocab = list(WORDS) + _pseudo_words(rng, 400)
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    p /= p.sum()
    out = []
    for i in range(num_sentences):
        words = list(rng.choice(vocab, size=int(rng.integers(4, 16)), p=p))
        if rng.random() < 0.2:
            words.insert(int(rng.integers(0, len(words))), str(int(rng.integers(0, 2000))))
        s = " ".join(words)
        s = s[0].upper() + s[1:] + str(rng.choice([".", ".", ".", "?", "!", ","]))
        if i % 50 == 0:
            s = f"{IM_START}user\n{s}{IM_END}\n{IM_START}assistant\n"
        out.append(s)
    return out


#: the untrained pipeline in the ``tokenizer.json`` format (what ``Tokenizer.from_str``
#: reads): NFC normaliser, byte-level pre-tokenizer and decoder, an empty BPE model
UNTRAINED = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                "use_regex": True},
    "model": {"type": "BPE", "vocab": {}, "merges": []},
}


def _bos_template(bos: int) -> dict:
    """The ``tokenizer.json`` post-processor that prepends ``<|bos|>`` (id ``bos``) to each
    sequence: ``single`` = ``<|bos|> $A``, ``pair`` = ``<|bos|> $A <|bos|> $B``."""
    def seq(name: str) -> dict:
        return {"Sequence": {"id": name, "type_id": 0}}
    tok = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {"type": "TemplateProcessing", "single": [tok, seq("A")],
            "pair": [tok, seq("A"), tok, seq("B")],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos], "tokens": [BOS]}}}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens, special tokens last. Built from its
    ``tokenizer.json`` spec: :data:`UNTRAINED`, trained, then the ``<|bos|>`` template."""
    tok = Tokenizer.from_str(json.dumps(UNTRAINED))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - NUM_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(corpus(), trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    spec = json.loads(tok.to_str())
    spec["post_processor"] = _bos_template(tok.token_to_id(BOS))
    return Tokenizer.from_str(json.dumps(spec))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """``bos``, ``eos``, ``im_start``, ``im_end`` token ids."""
    return {name: tok.token_to_id(t)
            for name, t in zip(("bos", "eos", "im_start", "im_end"), SPECIAL_TOKENS, strict=True)}


def num_text_tokens(tok: Tokenizer) -> int:
    """Ids ``0 .. n-1`` are ordinary (non-special) tokens."""
    return tok.get_vocab_size(with_added_tokens=False)


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json``: special tokens, chat template, fast tokenizer class."""
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": None, "unk_token": None,
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
            "model_max_length": int(model_max_length),
            "tokenizer_class": "PreTrainedTokenizerFast"}
