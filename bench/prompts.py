"""Prompts of an exact token count, so the server sees exactly the input length the workload asks for.

Two formats. ``ids`` (the default) sends token id lists, which any OpenAI-compatible completions endpoint
takes and which need no tokenizer. ``text`` sends text that the served model's tokenizer turns into
exactly the asked number of tokens (special tokens it adds, such as bos, included), for servers or
endpoints that only take text: the ids below are decoded, and the text is trimmed or extended until
re-encoding it gives the count (byte-level BPE merges across piece boundaries, so decoding N ids does
not always give N tokens back).

A third, ``edit``, is an editing workload for chat models (what speculative decoding is for): each
prompt is the model's chat template around a request to copy an excerpt of the Python standard
library's sources on this machine with its mistakes fixed, the excerpt cut so that the whole prompt
is exactly the asked number of tokens. The file and the excerpt's first line come from the seed and
the request's index. A fourth, ``chat``, wraps the same excerpts in a request to explain what the
code does: an answer in the model's own words, which prompt lookup rarely guesses (a workload for a
draft model).

Ids are drawn uniformly from ``[0, vocab_size)`` with a seeded generator, so the same workload and seed
give the same prompts against every deployment. A request with Mooncake ``hash_ids`` is built block by
block: block ``h`` is the same ``PREFIX_BLOCK_TOKENS`` ids wherever ``h`` appears (their first
``hash_block`` where scaling shrank the blocks), so requests that share leading hash ids share a real
token prefix (the last block is cut to the prompt's length).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from pdfabric.bench.workload import PREFIX_BLOCK_TOKENS, Request

if TYPE_CHECKING:
    from pdfabric.engine.tokenizer import Tokenizer

FORMATS = ("ids", "text", "edit", "chat")
EDIT_ASK = "Copy the following Python code, fixing any mistakes you find:\n\n```python\n{code}\n```"
CHAT_ASK = "Explain in plain words what the following Python code does and why:\n\n```python\n{code}\n```"
ASKS = {"edit": EDIT_ASK, "chat": CHAT_ASK}  # the formats that wrap standard library code in a request
_FIX_ROUNDS = 64  # trim/extend rounds before giving up on an exact text length

_BLOCK_STREAM = 1  # keeps hash-block ids and per-request ids in separate random streams
_REQUEST_STREAM = 2


@dataclass(frozen=True)
class PromptConfig:
    """``vocab_size`` bounds the random ids (keep it <= the served model's vocabulary); ``format`` is
    ``ids`` or ``text``; ``tokenizer`` (text only) is the served model's directory or a built-in preset."""

    vocab_size: int = 256
    seed: int = 0
    format: str = "ids"
    tokenizer: str = ""

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.format not in FORMATS:
            raise ValueError(f"prompt format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.format != "ids" and not self.tokenizer:
            raise ValueError(
                f"{self.format} prompts need the served model's tokenizer (--tokenizer DIR or preset)"
            )

    def describe(self) -> dict[str, Any]:
        """What the report says about the prompts."""
        out: dict[str, Any] = {"vocab_size": self.vocab_size, "seed": self.seed, "format": self.format}
        if self.format != "ids":
            out["tokenizer"] = self.tokenizer
        return out


class PromptBuilder:
    """Makes the token-id prompt of each request; blocks named by hash ids are cached (LRU)."""

    def __init__(self, cfg: PromptConfig, cache_blocks: int = 4096) -> None:
        self.cfg = cfg
        self._block = lru_cache(maxsize=cache_blocks)(self._make_block)

    def _make_block(self, hash_id: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, _BLOCK_STREAM, hash_id])
        return rng.integers(0, self.cfg.vocab_size, size=PREFIX_BLOCK_TOKENS, dtype=np.int32)

    def _random(self, index: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([self.cfg.seed, _REQUEST_STREAM, index])
        return rng.integers(0, self.cfg.vocab_size, size=n, dtype=np.int32)

    def check(self) -> None:
        """Loads what the format needs now (the tokenizer for text), so a bad setting fails before a run."""
        if self.cfg.format == "text":
            _ = self._text_ids
        if self.cfg.format in ASKS:
            _ = self._sources, self._tokenizer.apply_chat_template([{"role": "user", "content": "x"}])

    def prompt(self, req: Request) -> list[int] | str:
        """What the client sends as ``prompt``: token ids, or text of exactly ``req.input_len`` tokens."""
        if self.cfg.format == "ids":
            return self.tokens(req)
        if self.cfg.format in ASKS:
            return self.edit(req, ASKS[self.cfg.format])
        return self.text(req)

    @cached_property
    def _sources(self) -> list[str]:
        """The standard library's Python files on this machine, in name order."""
        import sysconfig
        from pathlib import Path

        files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        if not files:
            raise ValueError("no Python standard library sources found for edit prompts")
        return files

    def edit(self, req: Request, ask: str = EDIT_ASK) -> str:
        """A chat prompt of exactly ``req.input_len`` tokens asking to copy a stretch of standard
        library code with its mistakes fixed (``EDIT_ASK``), or what ``ask`` asks of it."""
        from pathlib import Path

        tok = self._tokenizer
        rng = np.random.default_rng([self.cfg.seed, _REQUEST_STREAM, req.index, 2])
        empty = tok.apply_chat_template([{"role": "user", "content": ask.format(code="")}])
        room = req.input_len - len(tok.encode(empty, add_special_tokens=True))
        if room < 1:
            raise ValueError(f"request {req.index}: {req.input_len} tokens leave no room for code")
        for _ in range(_FIX_ROUNDS):
            lines = Path(self._sources[int(rng.integers(len(self._sources)))]).read_text().splitlines()
            start = int(rng.integers(max(1, len(lines) - 20)))
            ids = tok.encode("\n".join(lines[start:]), add_special_tokens=False)
            if len(ids) < room:
                continue
            code = tok.decode(ids[:room])
            for _ in range(_FIX_ROUNDS):  # the chat wrapper's tokens can merge with the code's ends
                text = tok.apply_chat_template([{"role": "user", "content": ask.format(code=code)}])
                have = len(tok.encode(text, add_special_tokens=True))
                if have == req.input_len:
                    return text
                cut = tok.encode(code, add_special_tokens=False)
                code = (
                    tok.decode(cut[: len(cut) - max(1, have - req.input_len)])
                    if have > req.input_len
                    else code + " "
                )
        raise ValueError(f"request {req.index}: no edit prompt of exactly {req.input_len} tokens found")

    @cached_property
    def _tokenizer(self) -> Tokenizer:
        from pdfabric.engine.default_model import resolve_model
        from pdfabric.engine.tokenizer import Tokenizer

        try:
            return Tokenizer.from_pretrained(resolve_model(self.cfg.tokenizer))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer {self.cfg.tokenizer!r}: {exc}") from None

    @cached_property
    def _text_ids(self) -> np.ndarray:
        """Ids that decode on their own to printable text (no special tokens, no partial characters)."""
        tok = self._tokenizer
        special = tok.all_special_ids
        ok = []
        for i in range(tok.vocab_size):
            if i in special:
                continue
            piece = tok.decode([i])
            if piece.strip() and "\ufffd" not in piece and piece.isprintable():
                ok.append(i)
        if not ok:
            raise ValueError(f"tokenizer {self.cfg.tokenizer!r} has no token that decodes to plain text")
        return np.asarray(ok, dtype=np.int64)

    def text(self, req: Request) -> str:
        """Text that the tokenizer encodes (with its special tokens) to exactly ``req.input_len`` ids."""
        tok, usable = self._tokenizer, self._text_ids
        want = req.input_len - len(tok.encode("", add_special_tokens=True))
        if want < 1:
            raise ValueError(f"request {req.index}: {req.input_len} tokens leave no room for text")
        ids = usable[np.asarray(self.tokens(req)) % len(usable)]
        rng = np.random.default_rng([self.cfg.seed, _REQUEST_STREAM, req.index, 1])
        text = tok.decode(ids.tolist())
        for _ in range(_FIX_ROUNDS):
            have = tok.encode(text, add_special_tokens=False)
            if len(have) == want:
                return text
            if len(have) > want:
                text = tok.decode(have[:want])
            else:
                text += tok.decode(rng.choice(usable, size=want - len(have)).tolist())
        raise ValueError(f"request {req.index}: no text of exactly {req.input_len} tokens found")

    def tokens(self, req: Request) -> list[int]:
        """Exactly ``req.input_len`` token ids."""
        if not req.hash_ids:
            return self._random(req.index, req.input_len).tolist()
        parts: list[np.ndarray] = []
        have = 0
        for h in req.hash_ids:
            if have >= req.input_len:
                break
            block = self._block(h)[: min(req.hash_block, req.input_len - have)]
            parts.append(block)
            have += len(block)
        if have < req.input_len:  # fewer hash ids than blocks: the rest is private to this request
            parts.append(self._random(req.index, req.input_len - have))
        return np.concatenate(parts).tolist()
