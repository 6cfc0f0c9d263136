"""Text prompts of an exact token count: with a merging (BPE) tokenizer, decoding N random ids does not
give N tokens back, so the builder must trim and extend until re-encoding gives exactly the count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from pdfabric.bench.prompts import PromptBuilder, PromptConfig
from pdfabric.bench.workload import PREFIX_BLOCK_TOKENS, Request
from pdfabric.engine.tokenizer import Tokenizer
from tests.test_gguf import packaged

CORPUS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun",
    "prefill and decode run in separate pools and the router picks a route for every request",
    "tokens tokens tokens merge into longer pieces when the same pairs come up again and again",
] * 50


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with a bos post-processor, saved like a Hugging Face checkpoint."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    out = tmp_path_factory.mktemp("bpe")
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return out


def test_text_prompts_encode_to_exactly_the_asked_length(bpe_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(bpe_dir)
    assert len(tok.encode("", add_special_tokens=True)) == 1  # bos counts toward the length
    builder = PromptBuilder(PromptConfig(vocab_size=600, format="text", tokenizer=str(bpe_dir)))
    builder.check()
    merged = 0
    for n in [*range(2, 80), 255, 512, 1000]:
        req = Request(n, 0.0, n, 1)
        ids = builder.tokens(req)
        merged += len(tok.encode(tok.decode(ids), add_special_tokens=True)) != n
        text = builder.prompt(req)
        assert isinstance(text, str)
        assert len(tok.encode(text, add_special_tokens=True)) == n, n
        assert builder.prompt(req) == text  # seeded: the same prompt every time
    assert merged > 0  # the case the trimming exists for did come up


def test_text_prompts_keep_shared_prefixes(bpe_dir: Path) -> None:
    builder = PromptBuilder(PromptConfig(vocab_size=600, format="text", tokenizer=str(bpe_dir)))
    a = builder.text(Request(0, 0.0, 3 * PREFIX_BLOCK_TOKENS, 1, hash_ids=(7, 8, 9)))
    b = builder.text(Request(1, 0.0, 3 * PREFIX_BLOCK_TOKENS, 1, hash_ids=(7, 8, 10)))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common > len(a) / 3  # at least the first block's text is shared


def test_text_prompt_errors_are_clear(bpe_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        PromptConfig(format="text")
    with pytest.raises(ValueError, match="format"):
        PromptConfig(format="xml")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        PromptBuilder(PromptConfig(format="text", tokenizer=str(tmp_path / "missing"))).check()
    builder = PromptBuilder(PromptConfig(format="text", tokenizer=str(bpe_dir)))
    with pytest.raises(ValueError, match="no room"):
        builder.text(Request(0, 0.0, 1, 1))  # bos alone is one token
    ids = PromptBuilder(PromptConfig()).prompt(Request(0, 0.0, 9, 1))
    assert isinstance(ids, list) and len(ids) == 9


@pytest.mark.parametrize("fmt, asks", [("edit", "Copy the following Python code"),
                                        ("chat", "Explain in plain words what the following")])  # fmt: skip
@pytest.mark.parametrize("tokenizer", ["tiny", pytest.param("smollm2-135m", marks=packaged)])
def test_code_prompts_are_chat_requests_about_stdlib_code_of_the_exact_length(
    tokenizer: str, fmt: str, asks: str
) -> None:
    from pdfabric.engine.default_model import resolve_model

    tok = Tokenizer.from_pretrained(resolve_model(tokenizer))
    builder = PromptBuilder(PromptConfig(format=fmt, tokenizer=tokenizer, seed=3))
    builder.check()
    prompts = [builder.prompt(Request(i, 0.0, 120 + 40 * i, 16)) for i in range(4)]
    for i, text in enumerate(prompts):
        assert isinstance(text, str) and asks in text and "```python" in text
        assert len(tok.encode(text, add_special_tokens=True)) == 120 + 40 * i
    assert len(set(prompts)) == 4  # each request its own excerpt
    again = PromptBuilder(PromptConfig(format=fmt, tokenizer=tokenizer, seed=3))
    assert again.prompt(Request(2, 0.0, 200, 16)) == prompts[2]  # the seed and the index decide it
    with pytest.raises(ValueError, match="tokenizer"):
        PromptConfig(format=fmt)
