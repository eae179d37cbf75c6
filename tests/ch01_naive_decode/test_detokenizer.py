"""Streaming detokenization never emits a broken character, and its pieces add up to `decode`."""

import pytest

from tests.tiny_models import make_tiny_tokenizer

TEXTS = [
    "Café, naïve, jalapeño, déjà vu.",
    "你好，世界。大语言模型推理引擎。",
    "Rocket 🚀, fire 🔥, family 👨‍👩‍👧, flag 🇫🇷.",
    "mixed: Größe 😀 日本語 ok",
]


def stream(checkpoint, tokenizer, token_ids):
    detokenizer = checkpoint.detokenizer.IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add(t) for t in token_ids]
    pieces.append(detokenizer.flush())
    return pieces


def check_streaming(checkpoint, tokenizer):
    cut_characters = 0
    for text in TEXTS:
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        cut_characters += sum("\ufffd" in tokenizer.decode([t]) for t in token_ids)
        pieces = stream(checkpoint, tokenizer, token_ids)
        assert not any("\ufffd" in piece for piece in pieces)
        assert "".join(pieces) == tokenizer.decode(token_ids) == text
    assert cut_characters > 0, "no token cut a character: the test would prove nothing"


def test_tiny_tokenizer_streams_multibyte_text(checkpoint):
    check_streaming(checkpoint, make_tiny_tokenizer())


@pytest.mark.model
def test_smollm2_tokenizer_streams_multibyte_text(checkpoint, smollm2_llm):
    check_streaming(checkpoint, smollm2_llm.tokenizer)


def test_a_dangling_cut_character_is_flushed_at_the_end(checkpoint):
    tokenizer = make_tiny_tokenizer()
    token_ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(token_ids) > 1
    pieces = stream(checkpoint, tokenizer, token_ids[:-1])  # generation stopped mid-character
    assert "".join(pieces) == tokenizer.decode(token_ids[:-1])
