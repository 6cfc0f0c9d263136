"""Text to token ids and back for a Hugging Face tokenizer directory.

The vocabulary, normalizer, pre-tokenizer, post-processor (bos) and decoder come from
``tokenizer.json`` through the ``tokenizers`` library; special-token names, ``add_bos_token`` and the
chat template from ``tokenizer_config.json`` (or ``chat_template.jinja``); extra eos ids from
``generation_config.json``. Chat templates are rendered in a sandboxed jinja2 environment with the
same variables and helpers as ``transformers`` (``messages``, ``add_generation_prompt``, the special
tokens, ``raise_exception``), so a checkpoint's template produces the same prompt text here.

Decoding never applies ``clean_up_tokenization_spaces``: the text of a token stream must be the
concatenation of its incremental pieces (see :mod:`pdfabric.engine.detokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A loaded tokenizer: ``encode``, ``decode``, ``apply_chat_template`` and the special ids."""

    def __init__(
        self,
        backend: _Backend,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wraps ``backend``; ``config`` is the parsed ``tokenizer_config.json`` (may be empty)."""
        self._backend = backend
        config = dict(config or {})
        self._tokens = {name: _token_content(config.get(name), name) for name in _SPECIAL_NAMES}
        self._bos_id = self._id_of(self._tokens["bos_token"], "bos_token")
        eos_id = self._id_of(self._tokens["eos_token"], "eos_token")
        extra_eos = _eos_ids(generation_config or {})
        self._eos_ids = frozenset(extra_eos + ([eos_id] if eos_id is not None else []))
        self._chat_template = chat_template if chat_template is not None else _config_template(config)
        # Older configs ask for bos through add_bos_token and leave it out of the post-processor.
        self._prepend_bos = (
            bool(config.get("add_bos_token", False))
            and self._bos_id is not None
            and backend.encode("", add_special_tokens=True).ids[:1] != [self._bos_id]
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Loads the tokenizer files of a Hugging Face model directory."""
        root = Path(path).expanduser()
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {root}: pdfabric needs a Hugging Face 'fast' tokenizer file there"
            )
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json") or {}
        generation_config = _read_json(root / "generation_config.json")
        template_file = root / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(backend, config, generation_config, template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (a model's embedding may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, or None when the tokenizer has none."""
        return self._bos_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the config's eos token and the generation config's eos ids."""
        return self._eos_ids

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of all special tokens (skipped by ``decode(..., skip_special_tokens=True)``)."""
        added = self._backend.get_added_tokens_decoder()
        ids = {i for i, token in added.items() if token.special}
        return frozenset(ids | self._eos_ids | ({self._bos_id} if self._bos_id is not None else set()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's bos (if any) comes first."""
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            return [self._bos_id, *ids]  # type: ignore[list-item]  # _prepend_bos implies an id
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, or None."""
        return self._backend.id_to_token(token_id)

    @property
    def chat_template(self) -> str | None:
        """The jinja2 source of the chat template, or None."""
        return self._chat_template

    @cached_property
    def grammar_tokenizer(self):  # noqa: ANN201 - llguidance.LLTokenizer
        """This tokenizer as the grammar engine reads it (``pdfabric.structure``), built on first use
        (about 0.2 s for a 49k vocabulary): the router checks a request's grammar against it, as
        the worker that samples will."""
        import llguidance

        eos = sorted(self._eos_ids)
        return llguidance.LLTokenizer(self._backend.to_str(), eos_token=eos or None)

    @property
    def renders_tool_calls(self) -> bool:
        """Whether the chat template renders tools and tool calls itself, in the tool format pdfabric
        constrains and parses (it reads ``tools`` and writes ``<tool_call>``, as Qwen2.5's and other
        Hermes-format templates do; ``pdfabric/structure.py``)."""
        template = self._chat_template or ""
        return "tools" in template and "<tool_call>" in template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Renders ``messages`` (dicts with string ``role`` and ``content``, an assistant's also with
        ``tool_calls``) into prompt text; ``tools``: the functions offered, for a template that renders
        them (OpenAI's ``{"type": "function", "function": {...}}`` objects).

        The text already holds the template's special tokens (often bos): encode it with
        ``add_special_tokens=False``. Raises ValueError for a missing template, a malformed message
        or an error raised by the template itself (e.g. roles that do not alternate).
        """
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template ('chat_template' in tokenizer_config.json)")
        _check_messages(messages)
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
                documents=None,
                **{name: value or "" for name, value in self._tokens.items()},
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the messages: {exc}") from None

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self._chat_template or "")
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template is not valid jinja2: {exc}") from None

    def _id_of(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json names {name} {token!r}, which is not in the vocabulary")
        return token_id


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any, name: str) -> str | None:
    """A special token named in tokenizer_config: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: {name} must be a string or an object with 'content'")


def _eos_ids(generation_config: Mapping[str, Any]) -> list[int]:
    value = generation_config.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"generation_config.json: eos_token_id must be an int or a list of ints: {value!r}")
    return values


def _config_template(config: Mapping[str, Any]) -> str | None:
    """The chat template in tokenizer_config: a string, or a list of named templates ("default" wins)."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
        raise ValueError("tokenizer_config.json: chat_template lists no template named 'default'")
    raise ValueError("tokenizer_config.json: chat_template must be a string or a list of named templates")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}].{key} must be a string")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
