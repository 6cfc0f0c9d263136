"""Tokenizer loading, the built-in byte tokenizer and chat templates (CPU, no network)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from pdfabric.engine import byte_tokenizer as bt
from pdfabric.engine.tokenizer import Tokenizer

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld",
    "日本語のテキスト 中文",
    "emoji 👋🏽 👨‍👩‍👧 🇫🇷",
    "combining e\u0301 a\u0308 \u0915\u094d\u0937",
    "\x00\x01\x7f control",
    "\U0010fffd last plane",
]


def _random_text(rng: random.Random, length: int) -> str:
    chars = []
    while len(chars) < length:
        cp = rng.choice(
            [rng.randrange(0x20, 0x80), rng.randrange(0x80, 0x800), rng.randrange(0x800, 0x10000)]
        )
        cp = cp if rng.random() < 0.9 else rng.randrange(0x10000, 0x110000)
        if not 0xD800 <= cp <= 0xDFFF:  # lone surrogates are not text
            chars.append(chr(cp))
    return "".join(chars)


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("byte-tokenizer")
    assert bt.write_byte_tokenizer(out) == bt.BYTE_VOCAB_SIZE
    return out


@pytest.fixture(scope="module")
def tok(byte_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(byte_dir)


def _variant(byte_dir: Path, tmp_path: Path, **config_changes: object) -> Path:
    """A copy of the byte tokenizer directory with tokenizer_config.json edited (None deletes a key)."""
    out = tmp_path / "variant"
    shutil.copytree(byte_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


# The byte tokenizer


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_ids_are_utf8_bytes_and_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_round_trip_random_unicode(tok: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(200):
        text = _random_text(rng, rng.randrange(1, 40))
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_bos_is_prepended_by_the_post_processor(tok: Tokenizer, byte_dir: Path) -> None:
    assert tok.bos_token_id == bt.BOS_ID
    assert tok.encode("ab") == [bt.BOS_ID, 97, 98]
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]
    assert tok.encode("") == [bt.BOS_ID]
    spec = json.loads((byte_dir / "tokenizer.json").read_text())
    assert spec["post_processor"]["type"] == "TemplateProcessing"


def test_special_tokens_have_fixed_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == bt.BYTE_VOCAB_SIZE == 260
    assert tok.eos_token_ids == frozenset({bt.EOS_ID})
    assert tok.all_special_ids == frozenset({256, 257, 258, 259})
    for token, token_id in zip(
        bt.SPECIAL_TOKENS, (bt.BOS_ID, bt.EOS_ID, bt.IM_START_ID, bt.IM_END_ID), strict=True
    ):
        assert tok.token_to_id(token) == token_id
    ids = tok.encode("a<|im_end|>b", add_special_tokens=False)
    assert ids == [97, bt.IM_END_ID, 98]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"


def test_byte_tokenizer_files_are_deterministic(tmp_path: Path, byte_dir: Path) -> None:
    bt.write_byte_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (byte_dir / name).read_bytes()


def test_byte_tokenizer_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 世界"}]
    assert tok.apply_chat_template(messages) == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 世界<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert without.endswith("Hi 世界<|im_end|>\n")
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert ids[:2] == [bt.BOS_ID, bt.IM_START_ID] and ids.count(bt.BOS_ID) == 1
    assert ids[-len("assistant\n") - 1 :] == [bt.IM_START_ID, *b"assistant\n"]


def test_matches_transformers(byte_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(byte_dir))
    ours = Tokenizer.from_pretrained(byte_dir)
    messages = [{"role": "user", "content": "2 + 2 = ?"}, {"role": "assistant", "content": "4"}]
    for gen in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    for text in SAMPLES:
        assert ours.encode(text) == hf.encode(text)


# Loading real-checkpoint variations


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_token_dicts_and_generation_config_eos(byte_dir: Path, tmp_path: Path) -> None:
    out = _variant(
        byte_dir,
        tmp_path,
        bos_token={"__type": "AddedToken", "content": bt.BOS_TOKEN, "special": True},
        eos_token={"content": bt.IM_END_TOKEN},
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [bt.EOS_ID, bt.IM_END_ID]}))
    tok = Tokenizer.from_pretrained(out)
    assert tok.bos_token_id == bt.BOS_ID
    assert tok.eos_token_ids == frozenset({bt.EOS_ID, bt.IM_END_ID})
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": bt.IM_START_ID}))
    assert Tokenizer.from_pretrained(out).eos_token_ids == frozenset({bt.IM_END_ID, bt.IM_START_ID})


def test_no_bos_like_qwen(byte_dir: Path, tmp_path: Path) -> None:
    out = _variant(byte_dir, tmp_path, bos_token=None, add_bos_token=False)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_pretrained(out)
    assert tok.bos_token_id is None
    assert tok.encode("hi") == [104, 105]


def test_add_bos_token_without_post_processor(byte_dir: Path, tmp_path: Path) -> None:
    out = _variant(byte_dir, tmp_path)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (out / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer.from_pretrained(out)
    assert tok.encode("hi") == [bt.BOS_ID, 104, 105]
    assert tok.encode("hi", add_special_tokens=False) == [104, 105]


def test_unknown_special_token_is_a_clear_error(byte_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eos_token '<eos>'"):
        Tokenizer.from_pretrained(_variant(byte_dir, tmp_path, eos_token="<eos>"))


def test_bad_generation_config_eos(byte_dir: Path, tmp_path: Path) -> None:
    out = _variant(byte_dir, tmp_path)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_pretrained(out)


# Chat templates

MISTRAL_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_mistral_style_template_and_raise_exception(byte_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_variant(byte_dir, tmp_path, chat_template=MISTRAL_STYLE))
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.apply_chat_template(messages) == (
        "<|begin_of_text|>[INST] Hi [/INST]Hello<|end_of_text|>[INST] Bye [/INST]"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_trim_blocks_tojson_and_tools(byte_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% if tools is not none %}TOOLS{% endif %}\n"
        "{% for m in messages %}\n"
        "    {{ m | tojson }}\n"
        "{% endfor %}\n"
    )
    tok = Tokenizer.from_pretrained(_variant(byte_dir, tmp_path, chat_template=template))
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == (
        '    {"role": "user", "content": "é<b>"}\n'
    )


def test_named_templates_and_template_file(byte_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    out = _variant(byte_dir, tmp_path, chat_template=named)
    assert Tokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "x"}]) == (
        "D<|end_of_text|>"
    )
    (out / "chat_template.jinja").write_text("F{{ messages | length }}")
    assert Tokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "x"}]) == "F1"


def test_no_chat_template(byte_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_variant(byte_dir, tmp_path, chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ("hello", "non-empty"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role must be a string"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": None}], r"messages\[1\]\.content"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], r"messages\[0\]\.content"),
    ],
)
def test_malformed_messages(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_template_cannot_escape_the_sandbox(byte_dir: Path, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_pretrained(_variant(byte_dir, tmp_path, chat_template=template))
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
