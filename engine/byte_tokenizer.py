"""The built-in byte-level tokenizer: one token per UTF-8 byte plus four special tokens.

It is built, never trained, so every machine writes the same ``tokenizer.json`` and
``tokenizer_config.json``; the default model is saved with it in Hugging Face format and loaded back
through :class:`pdfabric.engine.tokenizer.Tokenizer` like any real checkpoint.

Ids 0..255 are the byte values themselves (spelled in the byte-level alphabet that GPT-2 style
tokenizers use, so the standard ByteLevel decoder reverses them), followed by:

- 256 ``<|begin_of_text|>``: bos, prepended by the post-processor when special tokens are added;
- 257 ``<|end_of_text|>``: eos;
- 258 ``<|im_start|>`` and 259 ``<|im_end|>``: ChatML turn markers used by the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
IM_START_ID = 258
IM_END_ID = 259
BYTE_VOCAB_SIZE = 260

SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML turns, each opened by <|im_start|>role and closed by <|im_end|>, after a leading bos (the
# rendered prompt is encoded without adding special tokens, as Hugging Face does for chat prompts).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def byte_alphabet() -> list[str]:
    """The printable character that stands for each byte value 0..255 in byte-level vocabularies.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, a few Latin-1 gaps)
    are moved, in byte order, to code points 256 and up.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    chars, shifted = [], 0
    for byte in range(NUM_BYTES):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(NUM_BYTES + shifted))
            shifted += 1
    return chars


def build_byte_tokenizer() -> Tokenizer:
    """The byte-level tokenizer as a ``tokenizers.Tokenizer`` (no merges: every byte is a token)."""
    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges, word boundaries change nothing and would only cost time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    added = tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, single_word=False) for t in SPECIAL_TOKENS]
    )
    if added != len(SPECIAL_TOKENS) or tok.token_to_id(IM_END_TOKEN) != IM_END_ID:
        raise RuntimeError("the byte tokenizer's special tokens did not get their fixed ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok


def tokenizer_config() -> dict[str, object]:
    """The ``tokenizer_config.json`` contents that go with :func:`build_byte_tokenizer`."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(BYTE_VOCAB_SIZE - len(SPECIAL_TOKENS) + i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": 1_000_000,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_byte_tokenizer(out_dir: Path) -> int:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``; returns the vocab size."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer()
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(), indent=2, sort_keys=True, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != BYTE_VOCAB_SIZE:
        raise RuntimeError(f"the byte tokenizer has {size} tokens, expected {BYTE_VOCAB_SIZE}")
    return size
