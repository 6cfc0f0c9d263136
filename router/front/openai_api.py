"""Parsing and validating OpenAI-style request bodies (a bad one is an ``errors.ApiError``).

Everything a client can get wrong is caught here and reported as HTTP 400 with an OpenAI-style error
body that names the field. The result is a ``ParsedRequest`` the dispatcher can run as it is.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from pdfabric import structure
from pdfabric.router.errors import bad
from pdfabric.router.front import fields, inputs
from pdfabric.sampling_params import SamplingParams
from pdfabric.structure import Tool

MAX_STOP_STRINGS = 16
MAX_TIMEOUT_S = 86_400.0  # a request's own deadline, at most a day
MAX_LOGPROBS = 20  # top log-probabilities per token

# Every field a request may carry (front/openapi.py describes each). Fields outside these sets are a
# 400 naming the field: a field this server does not implement is never ignored, since it may change
# the answer.
_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
        "seed", "user", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos", "return_token_ids", "timeout", "slo",
        "response_format", "speculative",
        # Accepted and without effect on the output: bookkeeping fields some clients always send.
        "metadata", "store", "service_tier",
    }
)  # fmt: skip
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    model: str
    # Completions: each prompt, as text to tokenize or token ids given directly (chat: none).
    prompts: tuple[str | tuple[int, ...], ...]
    # Chat: each message's role and content (tool calls and results already in the default tool
    # format, ``prompts.tokenize``); completions: None.
    messages: tuple[dict[str, Any], ...] | None
    max_tokens: int | None  # None: until the context is full
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    logprobs: int | None  # top log-probabilities per token (0: the chosen token's only); None: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    top_k: int = 0
    user: str | None = None  # the end user, as the client names them (no effect on the output)
    return_token_ids: bool = False  # extension: each choice also carries the generated token ids
    timeout_s: float | None = None  # extension: the whole request's deadline, seconds from arrival
    speculative_k: int = -1  # extension: at most this many proposed tokens a step (-1: the worker's; 0: off)
    n: int = 1  # outputs returned per prompt
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt
    best_of: int = 1  # outputs generated per prompt, of which the ``n`` most likely are returned
    grammar: str = ""  # what each output must follow: response_format or the tools (pdfabric.structure)
    tools: tuple[Tool, ...] = ()  # chat: the functions offered (tool_choice not "none")
    parallel_tool_calls: bool = True

    def sampling_params(self, max_tokens: int, seed: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs or 0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=min(self.min_tokens, max_tokens),  # more could never be generated
            top_k=self.top_k,
            prompt_logprobs=self.echo and self.logprobs is not None,
            grammar=self.grammar,
            speculative_k=self.speculative_k,
            # a picked token's log-probability: returned, or what best_of ranks outputs by
            token_logprob=self.logprobs is not None or self.best_of > self.n,
        )


def parse_request(body: Any, chat: bool, served_models: tuple[str, ...], vocab_size: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in body:
        if name not in (CHAT_FIELDS if chat else COMPLETION_FIELDS):
            raise bad(f"'{name}' is not supported by this server", name)
    for name, kind in (("metadata", dict), ("store", bool), ("service_tier", str)):
        fields.typed(body, name, kind, None)  # accepted without effect, but of the type the API documents
    model = fields.typed(body, "model", str, None)
    if model is None:
        raise bad("'model' is required", "model")
    if model not in served_models:
        raise bad(f"model {model!r} is not served here; available: {', '.join(served_models)}", "model")
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages = None
    if chat:
        messages = inputs.messages(body)
    else:
        prompts = inputs.prompts(body, vocab_size)
    max_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = fields.typed(body, max_name, int, 16 if not chat else None)
    if max_tokens is not None and max_tokens < 1:
        raise bad(f"'{max_name}' must be at least 1, got {max_tokens}", max_name)
    temperature = float(fields.typed(body, "temperature", (int, float), 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise bad(f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = float(fields.typed(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    seed = fields.typed(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise bad("'seed' must be in [0, 2**63)", "seed")
    stream = fields.typed(body, "stream", bool, False)
    options = fields.typed(body, "stream_options", dict, {})
    if options and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = fields.typed(options, "include_usage", bool, False)
    logprobs = _logprobs(body, chat)
    n, best_of = _n_best_of(body, chat, stream, max(1, len(prompts)))
    min_tokens = fields.typed(body, "min_tokens", int, 0)
    if not 0 <= min_tokens <= (max_tokens if max_tokens is not None else min_tokens):
        raise bad(f"'min_tokens' must be in [0, {max_name}], got {min_tokens}", "min_tokens")
    top_k = fields.typed(body, "top_k", int, 0)
    if top_k < -1:
        raise bad(f"'top_k' must be -1 or 0 (no limit) or positive, got {top_k}", "top_k")
    grammar, tools, parallel = _structure(body, chat)
    return ParsedRequest(
        chat=chat,
        model=model,
        prompts=prompts,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, vocab_size),
        ignore_eos=fields.typed(body, "ignore_eos", bool, False),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        presence_penalty=_penalty(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_penalty(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_penalty(body, "repetition_penalty", 1.0, 0.0, 10.0, open_low=True),
        logit_bias=_logit_bias(body, vocab_size),
        min_tokens=min_tokens,
        top_k=0 if top_k >= vocab_size else max(top_k, 0),  # the whole vocabulary is no limit
        user=fields.typed(body, "user", str, None),
        return_token_ids=fields.typed(body, "return_token_ids", bool, False),
        timeout_s=timeout_seconds(fields.typed(body, "timeout", (int, float), None), "timeout"),
        n=n,
        best_of=best_of,
        echo=not chat and fields.typed(body, "echo", bool, False),
        grammar=grammar,
        tools=tools,
        parallel_tool_calls=parallel,
        speculative_k=_speculative(body.get("speculative")),
    )


MAX_SPECULATIVE_K = 32


def _speculative(value: Any) -> int:
    """The ``speculative`` extension, which can only turn speculative decoding off or lower how many
    tokens a step proposes: ``false`` (off), ``true`` or null (the worker's setting), ``{"k": N}``."""
    if value is None or value is True:
        return -1
    if value is False:
        return 0
    k = fields.integral(value.get("k")) if isinstance(value, dict) and set(value) == {"k"} else None
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_SPECULATIVE_K:
        raise bad(
            f"'speculative' must be a boolean or {{\"k\": N}} with N in [0, {MAX_SPECULATIVE_K}], "
            f"got {value!r}",
            "speculative",
        )
    return k


def _structure(body: dict[str, Any], chat: bool) -> tuple[str, tuple[Tool, ...], bool]:
    """The grammar of ``response_format`` or of the tools (``tools``, ``tool_choice``,
    ``parallel_tool_calls``), the tools offered and whether several calls may come; compiled and
    checked here, before any worker is touched."""
    parallel = fields.typed(body, "parallel_tool_calls", bool, True)
    try:
        grammar = structure.response_format_grammar(body.get("response_format"))
        tools = structure.parse_tools(body.get("tools")) if chat else ()
        choice = structure.parse_tool_choice(body.get("tool_choice"), tools)
        if choice.mode == "none":
            tools = ()
        elif grammar:
            raise structure.StructureError(
                "'response_format' cannot be combined with tools; set 'tool_choice' to 'none'",
                "response_format",
            )
        else:
            grammar = structure.tool_grammar(tools, choice, parallel)
    except structure.StructureError as exc:
        raise bad(str(exc), exc.param) from None
    if grammar and fields.typed(body, "ignore_eos", bool, False):
        raise bad("'ignore_eos' cannot be combined with a response format or tools", "ignore_eos")
    return grammar, tools, parallel


def timeout_seconds(value: float | str | None, param: str) -> float | None:
    """A request's ``timeout`` (body field) or ``X-Request-Timeout`` (header): seconds in
    (0, 86400]; None when not given."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise bad(f"'{param}' must be a number of seconds, got {value!r}", param) from None
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise bad(f"'{param}' must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value}", param)
    return seconds


MAX_N, MAX_BEST_OF, MAX_OUTPUTS = 128, 20, 256


def _n_best_of(body: dict[str, Any], chat: bool, stream: bool, prompts: int) -> tuple[int, int]:
    """``n`` and ``best_of`` (completions only; never streamed), checked against each other and the
    bound on the outputs one request may ask for."""
    n = fields.typed(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    best_of = None if chat else fields.typed(body, "best_of", int, None)
    if best_of is None:
        best_of = n
    elif not n <= best_of <= MAX_BEST_OF:
        raise bad(f"'best_of' must be in [n, {MAX_BEST_OF}] (n is {n}), got {best_of}", "best_of")
    if best_of > n and stream:
        raise bad("'best_of' greater than 'n' cannot be streamed", "best_of")
    if prompts * best_of > MAX_OUTPUTS:
        param = "best_of" if best_of > n else "n"
        raise bad(
            f"the request asks for {prompts * best_of} outputs; at most {MAX_OUTPUTS} are allowed", param
        )
    return n, best_of


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or an array of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"'stop' holds at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stop)


def _stop_token_ids(body: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    ids = fields.token_ids(fields.typed(body, "stop_token_ids", list, []))
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise bad("'stop_token_ids' must be token ids inside the vocabulary", "stop_token_ids")
    return tuple(ids)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top log-probabilities per token (0: the chosen token's only), None when not asked.
    Completions: ``logprobs`` is that number; chat: ``logprobs`` is a flag and ``top_logprobs`` the
    number."""
    if chat:
        top = fields.typed(body, "top_logprobs", int, None)
        if not fields.typed(body, "logprobs", bool, False):
            if top:
                raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        name, count = "top_logprobs", top or 0
    else:
        name, count = "logprobs", fields.typed(body, "logprobs", int, None)
        if count is None:
            return None
    if not 0 <= count <= MAX_LOGPROBS:
        raise bad(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {count}", name)
    return count


def _penalty(
    body: dict[str, Any], name: str, default: float, low: float, high: float, open_low: bool = False
) -> float:
    value = float(fields.typed(body, name, (int, float), default))
    if not (low < value <= high if open_low else low <= value <= high):
        raise bad(f"'{name}' must be in {'(' if open_low else '['}{low:g}, {high:g}], got {value:g}", name)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` (JSON keys are strings) to sorted (id, bias) pairs."""
    given = fields.typed(body, "logit_bias", dict, {})
    pairs: list[tuple[int, float]] = []
    for key, value in given.items():
        if not (key.isascii() and key.isdigit()):  # int() would also take " 5", "+5" and "5_0"
            raise bad(f"'logit_bias' keys must be token ids (decimal digits), got {key!r}", "logit_bias")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise bad(f"'logit_bias' token id {token} is outside the vocabulary", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
