"""The tokenizers the GGUF converter builds from a file's byte-level BPE vocabulary: each pre-tokenizer
llama.cpp names splits text as its rule says, and, where llama.cpp's own vocabulary tests are at hand
(``PDFABRIC_LLAMA_CPP_MODELS``: the ``models/`` folder of llama.cpp's sources, which holds
``ggml-vocab-<name>.gguf`` with ``.inp``/``.out`` test vectors), every test string tokenizes to
llama.cpp's ids."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pdfabric.engine.gguf_checkpoint import GGUFError, _write_tokenizer
from tests.test_gguf_file import _byte_tokens


def _tokenizer(
    tmp_path: Path, pre: str, extra: tuple[str, ...] = (), merges: tuple[str, ...] = ()
) -> Tokenizer:
    tokens = [*_byte_tokens(), *extra]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * len(tokens),
        "tokenizer.ggml.merges": list(merges),
    }
    _write_tokenizer(meta, tmp_path)
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("gpt-2", ["12345", " apples", "'s"]),
        ("smollm", ["1", "2", "3", "4", "5", " apples", "'s"]),
        ("llama-bpe", ["123", "45", " apples", "'S"]),
        ("qwen2", ["1", "2", "3", "4", "5", " apples", "'S"]),
    ],
)
def test_each_pre_tokenizer_splits_by_its_rule(tmp_path: Path, pre: str, words: list[str]) -> None:
    text = "12345 apples" + ("'S" if pre in ("llama-bpe", "qwen2") else "'s")  # Llama 3's rule ignores case
    split = _tokenizer(tmp_path, pre).pre_tokenizer.pre_tokenize_str(text)
    as_bytes = {c: b for b, c in enumerate(_byte_tokens())}
    assert [bytes(as_bytes[c] for c in piece).decode() for piece, _ in split] == words


def test_llama3_takes_a_word_in_the_vocabulary_whole(tmp_path: Path) -> None:
    """Llama 3's vocabulary holds words its merges do not build; llama.cpp (and Hugging Face's
    ``ignore_merges``) take such a word as its token."""
    word = "".join(_byte_tokens()[b] for b in b"abc")
    for pre, want in (("llama-bpe", [256]), ("gpt-2", [97, 98, 99])):
        assert _tokenizer(tmp_path, pre, (word,)).encode("abc").ids == want


def test_an_unknown_pre_tokenizer_is_refused_with_the_known_names(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="pre-tokenizer 'deepseek-llm' is not known; known: .*llama-bpe"):
        _tokenizer(tmp_path, "deepseek-llm")


def test_a_sentencepiece_vocabulary_merges_by_score_and_falls_back_to_bytes(tmp_path: Path) -> None:
    """A GGUF "llama" vocabulary (Llama 2, Mistral): a space prefix and spaces as U+2581, pieces merged
    highest score first, a character outside the vocabulary as its UTF-8 bytes; decoding gives the
    text back."""
    pieces = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        "\u2581",
        "a",
        "b",
        "ab",
        "\u2581ab",
    ]
    scores = [0.0] * (len(pieces) - 5) + [-1.0, -2.0, -2.0, -3.0, -4.0]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [2, 3, 3, *([6] * 256), 1, 1, 1, 1, 1],
        "tokenizer.ggml.unknown_token_id": 0,
    }
    _write_tokenizer(meta, tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tokenizer.encode("ab abé", add_special_tokens=False).ids
    assert [pieces[i] for i in ids] == ["\u2581ab", "\u2581ab", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(ids) == "ab abé"


MODELS = os.environ.get("PDFABRIC_LLAMA_CPP_MODELS")


@pytest.mark.skipif(not MODELS, reason="PDFABRIC_LLAMA_CPP_MODELS (llama.cpp's models/ folder) is not set")
@pytest.mark.parametrize("name", ["gpt-2", "starcoder", "refact", "llama-bpe", "qwen2", "llama-spm"])
def test_llama_cpps_vocabulary_tests_tokenize_to_its_ids(tmp_path: Path, name: str) -> None:
    from gguf import GGUFReader

    vocab = Path(MODELS) / f"ggml-vocab-{name}.gguf"
    reader = GGUFReader(str(vocab))
    _write_tokenizer(
        {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}, tmp_path
    )
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = vocab.with_name(vocab.name + ".inp").read_text().split("\n__ggml_vocab_test__\n")
    ids = vocab.with_name(vocab.name + ".out").read_text().split("\n")
    for text, want in zip(texts, ids, strict=False):
        assert tokenizer.encode(text, add_special_tokens=False).ids == [int(i) for i in want.split()], text
