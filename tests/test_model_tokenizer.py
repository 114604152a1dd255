"""Tokenizer wrapper == HF AutoTokenizer on SmolLM2; incremental detokenizer == decode."""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_fixtures import default_model_path

from pdd.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces\n\nnew lines\t tabs",
    "Grüße aus Köln — naïve café, déjà vu.",
    "日本語のテキストと中文字符，한국어 텍스트",
    "emoji 🙂🚀👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(default_model_path())


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def test_encode_decode_match_hf(tok, hf_tok):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok(text).input_ids, text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    # SmolLM2 adds no BOS
    assert tok.encode("Hi")[0] != tok.bos_token_id


def test_chat_template_matches_hf(tok, hf_tok):
    assert tok.chat_template
    for messages in (
        [{"role": "user", "content": "What is 2+2? Réponds en français 🙂"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ):
        ids = tok.apply_chat_template(messages)
        ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ids == list(ref)
        text = tok.decode(ids, skip_special_tokens=False)
        assert messages[-1]["content"] in text and text.endswith("<|im_start|>assistant\n")
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def _stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    deltas = [d.feed(t) for t in ids]
    deltas.append(d.finish())
    return d, deltas


def test_incremental_detokenizer_multilingual(tok):
    text = " ".join(TEXTS[:5])
    ids = tok.encode(text)
    d, deltas = _stream(tok, ids)
    assert "".join(deltas) == d.text == tok.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)  # never a broken character mid-stream
    assert sum(1 for x in deltas if x == "") > 0  # some emoji bytes were held back


def test_incremental_detokenizer_trailing_partial_and_specials(tok):
    ids = tok.encode("ok 🚀")
    cut = ids[:-1]  # ends inside the emoji's bytes
    d, deltas = _stream(tok, cut)
    assert "".join(deltas) == tok.decode(cut)
    im_end = tok.token_to_id("<|im_end|>")
    d, deltas = _stream(tok, tok.encode("done.") + [im_end])
    assert "".join(deltas) == "done."


@functools.lru_cache(maxsize=1)
def _cached_tokenizer():
    return Tokenizer(default_model_path())


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_incremental_detokenizer_property(text):
    tok = _cached_tokenizer()
    ids = tok.encode(text)
    d, deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    if "\ufffd" not in tok.decode(ids):  # (bytes missing from the vocab decode to U+FFFD)
        assert all("\ufffd" not in x for x in deltas[:-1])
