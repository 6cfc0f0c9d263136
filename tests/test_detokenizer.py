"""Incremental detokenization: UTF-8 boundaries, sentencepiece spacing and stop strings (CPU)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from pdfabric.engine import byte_tokenizer as bt
from pdfabric.engine.detokenizer import IncrementalDetokenizer
from pdfabric.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "naïve café — 日本語と中文 ✓",
    "emoji 👋🏽 family 👨‍👩‍👧 flag 🇯🇵",
    "combining e\u0301 and a\u0308, Devanagari \u0915\u094d\u0937",
    "  spaces\tand\nnewlines  ",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("byte-tokenizer")
    bt.write_byte_tokenizer(out)
    return Tokenizer.from_pretrained(out)


def _run(detok: IncrementalDetokenizer, ids: Iterable[int]) -> list[str]:
    pieces = []
    for token_id in ids:
        pieces.append(detok.step(token_id))
        if detok.stopped:
            break
    return pieces


# Byte-level tokenizer: multi-byte characters span several tokens


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_concatenate_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt: "))
    pieces = _run(detok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert sum(1 for piece in pieces if piece) > 1  # streamed, not all at the end
    tail = detok.flush()
    assert tail == ""
    assert "".join(pieces) == detok.text == tok.decode(ids) == text


def test_random_unicode_streams(tok: Tokenizer) -> None:
    rng = random.Random(3)
    alphabet = "ab €中😀\u0301\n"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        ids = tok.encode(text, add_special_tokens=False)
        stop = rng.choice(["", "中", "€ b", "😀\u0301"])
        detok = IncrementalDetokenizer(tok, [bt.BOS_ID], stop=[stop])
        out = "".join(_run(detok, ids)) + detok.flush()
        expected = text.split(stop)[0] if stop else text
        assert out == expected == detok.text
        assert detok.stopped == (bool(stop) and stop in text)


def test_ending_inside_a_character_flushes_the_replacement(tok: Tokenizer) -> None:
    ids = list("a中".encode())[:-1]  # the last byte of 中 never comes
    detok = IncrementalDetokenizer(tok, [])
    assert _run(detok, ids) == ["a", "", ""]
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids)


def test_invalid_utf8_is_not_held_forever(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    pieces = _run(detok, [0xF0] * 40)
    assert "\ufffd" in "".join(pieces)  # emitted before the end, not only by flush()


def test_special_tokens_are_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [104, 105, bt.IM_END_ID, bt.EOS_ID]
    skipped = IncrementalDetokenizer(tok, [])
    assert "".join(_run(skipped, ids)) + skipped.flush() == "hi"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(_run(kept, ids)) + kept.flush() == "hi<|im_end|><|end_of_text|>"


class _CountingDecoder:
    """Records how many ids each decode call sees."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def test_each_step_decodes_a_short_window(tok: Tokenizer) -> None:
    counting = _CountingDecoder(tok)
    text = "long output 長い出力 🎉 " * 100
    ids = tok.encode(text, add_special_tokens=False) + [bt.IM_START_ID] * 50
    detok = IncrementalDetokenizer(counting, tok.encode("a long prompt " * 50), stop=["never appears"])
    _run(detok, ids)
    assert detok.text + detok.flush() == text
    assert max(counting.sizes) <= 8


# Stop strings


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42.\n\nUser: more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["\n\nUser:", "zzz"])
    pieces = _run(detok, ids)
    assert detok.stopped and detok.stop_reason == "\n\nUser:"
    assert "".join(pieces) == detok.text == "The answer is 42."
    assert len(pieces) == len("The answer is 42.\n\nUser:")  # stopped on the token that completed it
    assert detok.step(ord("x")) == "" and detok.flush() == ""


def test_stop_inside_a_multibyte_character_sequence(tok: Tokenizer) -> None:
    ids = tok.encode("ok 世界 more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["界"])
    assert "".join(_run(detok, ids)) == "ok 世"
    assert detok.stop_reason == "界"


def test_stop_at_the_first_token(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=["H"])
    assert detok.step(ord("H")) == ""
    assert detok.stopped and detok.stop_reason == "H" and detok.text == ""


def test_first_completed_stop_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["cdef", "de"])
    assert "".join(_run(detok, tok.encode("abcdef", add_special_tokens=False))) == "abc"
    assert detok.stop_reason == "de"  # completed first; the stream cannot wait for "cdef"
    detok = IncrementalDetokenizer(tok, [], stop=["cd", "bcd"])
    assert "".join(_run(detok, tok.encode("abcd", add_special_tokens=False))) == "a"
    assert detok.stop_reason == "bcd"  # both complete on "d": the one that starts first


def test_possible_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    assert _run(detok, tok.encode("xENEEN", add_special_tokens=False)) == ["x", "", "", "EN", "E", ""]
    assert detok.flush() == "EN"
    assert not detok.stopped and detok.text == "xENEEN"


# A sentencepiece-style tokenizer (Metaspace, byte fallback), trained here on a tiny corpus

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there, general kenobi",
    "a stream of tokens becomes text one piece at a time",
    "spaces matter in sentencepiece vocabularies",
] * 4
SP_DECODERS = {
    "byte-fallback": decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    ),
    "metaspace": decoders.Metaspace(replacement="▁", prepend_scheme="first"),
}


def _sentencepiece_dir(out: Path, decoder: str) -> Path:
    trainer_tok = Backend(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>"], show_progress=False)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    # Llama-2 / Mistral layout: <unk> <s> </s>, then 256 byte tokens, then the learned pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    tok = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = SP_DECODERS[decoder]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=sorted(SP_DECODERS))
def sp_tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(_sentencepiece_dir(tmp_path_factory.mktemp("sp"), request.param))


def test_sentencepiece_tokenizer_loads(sp_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hello world")
    assert ids[0] == sp_tok.bos_token_id == 1 and sp_tok.eos_token_ids == frozenset({2})
    assert len(ids) < len("hello world")  # merges apply
    assert sp_tok.decode(ids) == "hello world"


@pytest.mark.parametrize("text", ["hello world, the lazy fox", "tokens become text  twice", " a piece"])
def test_sentencepiece_spacing(sp_tok: Tokenizer, text: str) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert sp_tok.decode(ids) == text.removeprefix(" ")  # the decoder drops the first word's space
    # No prompt: the stream equals decoding the generated ids alone.
    alone = IncrementalDetokenizer(sp_tok, [])
    pieces = _run(alone, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + alone.flush() == sp_tok.decode(ids)
    # After a prompt: the first word keeps its leading space, as in decode(prompt + generated).
    prompt = sp_tok.encode("hello there")
    after = IncrementalDetokenizer(sp_tok, prompt)
    streamed = "".join(_run(after, ids)) + after.flush()
    full, head = sp_tok.decode(prompt + ids), sp_tok.decode(prompt)
    assert full.startswith(head) and streamed == full[len(head) :] == " " + text.removeprefix(" ")


def test_sentencepiece_byte_fallback_never_splits_characters(tmp_path: Path) -> None:
    sp = Tokenizer.from_pretrained(_sentencepiece_dir(tmp_path, "byte-fallback"))
    text = "the fox 狐狸 jumps 🦊"
    ids = sp.encode(text, add_special_tokens=False)
    assert sp.token_to_id("<0xF0>") in ids  # the emoji is spelled in byte tokens
    detok = IncrementalDetokenizer(sp, sp.encode("hello"), stop=["jumps"])
    pieces = _run(detok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == " the fox 狐狸 " and detok.stop_reason == "jumps"
