"""Grammars for response formats and tool calls (pdfabric/structure.py), their masks and state on the
sampling worker (engine/grammar.py, the sampler), and tool calls in OpenAI's shapes
(router/front/tool_calls.py)."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from pdfabric import structure
from pdfabric.engine.byte_tokenizer import build_byte_tokenizer
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.engine.grammar import Grammars
from pdfabric.engine.sampler import History, sample
from pdfabric.engine.sequence import Sequence
from pdfabric.kernels import layer_ops_cpu
from pdfabric.kernels.layer_ops_ref import mask_logits_ref, unpack_bitmask
from pdfabric.router.front.tool_calls import ToolCallStream, message
from pdfabric.sampling_params import SamplingParams
from pdfabric.structure import StructureError, ToolChoice

BYTES = build_byte_tokenizer()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NUMBERS = {  # a long structure: 40 numbers of up to 3 digits
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 40,
    "maxItems": 40,
}


def accepts(grammar: str, text: str) -> bool:
    """Whether ``text`` (byte tokens) is a whole output ``grammar`` accepts."""
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(BYTES.to_str()), grammar, log_level=0)
    ids = BYTES.encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def json_schema(schema: dict, strict: bool = False) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def test_response_formats_compile_to_grammars_that_accept_what_they_describe() -> None:
    assert (
        structure.response_format_grammar(None) == structure.response_format_grammar({"type": "text"}) == ""
    )
    anything = structure.response_format_grammar({"type": "json_object"})
    assert accepts(anything, '{"a": [1, 2, {"b": null}]}') and not accepts(anything, "[1]")
    person = json_schema(
        {"type": "object", "required": ["name", "age"], "additionalProperties": False,
         "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}}}},
        strict=True,
    )  # fmt: skip
    grammar = structure.response_format_grammar(person)
    assert accepts(grammar, '{"name": "Ada", "age": 36, "pets": ["cat"]}')
    assert accepts(grammar, '{"name": "Ada", "age": 36}')
    assert not accepts(grammar, '{"name": "Ada", "age": -1}')
    assert not accepts(grammar, '{"name": "Ada", "age": 36, "pets": ["cow"]}')
    assert not accepts(grammar, '{"name":"Ada","age":36}'), "one JSON shape: json.dumps's separators"
    regex = structure.response_format_grammar({"type": "regex", "regex": "(yes|no)-[0-9]{2}"})
    assert accepts(regex, "yes-42") and not accepts(regex, "maybe")
    lark = structure.response_format_grammar({"type": "grammar", "grammar": 'start: "a" start | "b"'})
    assert accepts(lark, "aaab") and not accepts(lark, "ba")
    # the same format again is a cache lookup, and gives the same grammar
    assert structure.response_format_grammar(person) == grammar


@pytest.mark.parametrize(
    "value, says",
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "must be one of"),
        ({"type": "json_object", "schema": {}}, "has no field"),
        ({"type": "json_schema"}, "json_schema' must be an object"),
        (json_schema({"type": "strin"}), "does not compile"),
        (
            json_schema({"type": "object", "x-unknown": 1, "properties": {"a": {"format": "zz"}}}, True),
            "compile",
        ),
        ({"type": "regex", "regex": "(a"}, "does not compile"),
        ({"type": "regex", "regex": ""}, "non-empty"),
        ({"type": "grammar", "grammar": "start: missing"}, "does not compile"),
        ({"type": "grammar", "grammar": "x" * (structure.MAX_SCHEMA_BYTES + 1)}, "bytes"),
    ],
)
def test_a_bad_response_format_is_an_error_naming_the_field(value: object, says: str) -> None:
    with pytest.raises(StructureError, match=says) as err:
        structure.response_format_grammar(value)
    assert err.value.param == "response_format"


def test_without_strict_unknown_schema_keywords_are_ignored() -> None:
    loose = json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "zz"}}})
    assert accepts(structure.response_format_grammar(loose), '{"a": "x"}')


@pytest.mark.parametrize(
    "tools, choice, says",
    [
        ([], None, "non-empty"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "letters"),
        ([{"type": "function"}], None, "must be"),
        ([WEATHER, WEATHER], None, "named twice"),
        ([{**ADD, "function": {**ADD["function"], "parameters": {"type": "strin"}}}], None, "parameters"),
    ],
)
def test_bad_tools_are_errors_naming_the_field(tools: list, choice: object, says: str) -> None:
    with pytest.raises(StructureError, match=says) as err:
        structure.parse_tools(tools)
    assert err.value.param == "tools"


def test_tool_choice_must_fit_the_tools() -> None:
    tools = structure.parse_tools([WEATHER, ADD])
    assert structure.parse_tool_choice(None, tools) == ToolChoice("auto")
    assert structure.parse_tool_choice(None, ()) == ToolChoice("none")
    assert structure.parse_tool_choice(
        {"type": "function", "function": {"name": "add"}}, tools
    ) == ToolChoice("required", "add")
    for bad, says in [
        ("required", "needs 'tools'"),
        ("sometimes", "must be"),
        ({"type": "function"}, "must be"),
    ]:
        with pytest.raises(StructureError, match=says):
            structure.parse_tool_choice(bad, ())
    with pytest.raises(StructureError, match="not in 'tools'"):
        structure.parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)


def test_tool_grammars_constrain_calls_from_their_first_token() -> None:
    tools = structure.parse_tools([WEATHER, ADD])
    paris = structure.render_call("get_weather", '{"city": "Paris"}')
    sums = structure.render_call("add", '{"a": 1, "b": 2}')
    auto = structure.tool_grammar(tools, ToolChoice("auto"), parallel=True)
    assert accepts(auto, "Sunny, I think.") and accepts(auto, paris) and accepts(auto, "Let me see. " + paris)
    assert accepts(auto, paris + "\n" + sums)
    assert not accepts(auto, structure.render_call("nope", "{}"))
    assert not accepts(auto, structure.render_call("add", '{"a": "one", "b": 2}'))
    single = structure.tool_grammar(tools, ToolChoice("auto"), parallel=False)
    assert accepts(single, paris) and not accepts(single, paris + "\n" + sums)
    required = structure.tool_grammar(tools, ToolChoice("required"), parallel=True)
    assert not accepts(required, "Sunny.") and not accepts(required, "Hi " + paris)
    assert accepts(required, paris + "\n" + sums)
    named = structure.tool_grammar(tools, ToolChoice("required", "add"), parallel=True)
    assert accepts(named, sums) and not accepts(named, paris) and not accepts(named, sums + "\n" + sums)
    assert structure.tool_grammar(tools, ToolChoice("none"), parallel=True) == ""


def test_replies_split_into_text_and_calls() -> None:
    paris = structure.render_call("get_weather", '{"city": "Paris"}')
    sums = structure.render_call("add", '{"a": 1, "b": 2}')
    assert structure.split_calls("no calls") == ("no calls", ())
    text, calls = structure.split_calls("Hi " + paris + "\n" + sums + "\n")
    assert text == "Hi " and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2}),
    ]  # fmt: skip
    cut = paris + "\n" + sums[:20]  # max_tokens ended the second call
    text, calls = structure.split_calls(cut)
    assert [c.name for c in calls] == ["get_weather"] and text == sums[:20]


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_streamed_reply_gives_the_calls_and_text_of_the_whole_reply(piece: int) -> None:
    paris = structure.render_call("get_weather", '{"city": "Paris"}')
    sums = structure.render_call("add", '{"a": 1, "b": 2}')
    replies = [
        "Plain <tool text, no call.",
        "Hi " + paris + "\n" + sums,
        paris + "\n" + sums[:25],  # cut before the second call's name is whole: text
        paris + "\n" + sums[:44],  # cut inside the second call's arguments
    ]
    for reply in replies:
        stream, content, deltas = ToolCallStream(), "", []
        pieces = [reply[i : i + piece] for i in range(0, len(reply), piece)]
        for i, part in enumerate(pieces):
            text, got = stream.feed(part, final=i == len(pieces) - 1)
            content += text
            deltas += got
        whole, calls = message(reply)
        assert content == (whole["content"] or ""), reply
        assert calls == stream.calls, reply
        # each call: its id, type and name first, then its arguments in fragments
        for i, call in enumerate(whole.get("tool_calls", [])):
            head, *fragments = [d for d in deltas if d["index"] == i]
            assert head["id"].startswith("call_") and head["type"] == "function"
            assert head["function"] == {"name": call["function"]["name"], "arguments": ""}
            assert "".join(f["function"]["arguments"] for f in fragments) == call["function"]["arguments"]
            if piece == 1 and i == 0:
                assert len(fragments) > 1, "arguments stream as they are written"
    cut = message(paris + "\n" + sums[:44])[0]["tool_calls"][1]["function"]
    assert cut == {"name": "add", "arguments": sums[structure.CALL_HEAD.match(sums).end() : 44]}


def test_raw_arguments_are_kept_as_written() -> None:
    call = structure.render_call("f", '{"word": "caf\u00e9", "n": [1, 2]}'.replace("\\u00e9", "\u00e9"))
    assert structure.split_calls(call)[1][0].arguments == '{"word": "caf\u00e9", "n": [1, 2]}'


def bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Bools ``[rows, vocab]`` as the bitmasks the grammar engine writes."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_the_sampler_picks_only_allowed_tokens_and_the_grammar_outranks_min_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    allowed = torch.ones(3, 50, dtype=torch.bool)
    allowed[:2] = False
    allowed[:2, [4, 9, 33]] = True
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5, top_p=0.9), SamplingParams()]
    for _ in range(3):
        picks = sample(logits, params, [0, 0, 0], None, bitmask(allowed))
        assert picks[0].token_id in (4, 9, 33) and picks[1].token_id in (4, 9, 33)
        assert picks[2].token_id == int(logits[2].argmax())
        # log-probabilities stay the model's own
        assert picks[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[picks[0].token_id]))
    only_eos = torch.zeros(1, 50, dtype=torch.bool)
    only_eos[0, 7] = True
    held = SamplingParams(min_tokens=5)
    pick = sample(logits[:1], [held], [0], [History((1, 2), [], frozenset({7}))], bitmask(only_eos))[0]
    assert pick.token_id == 7


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 260, 49152])
def test_the_cpu_mask_kernel_equals_its_reference(vocab: int) -> None:
    torch.manual_seed(vocab)
    allowed = torch.rand(5, vocab) < torch.tensor([[0.0], [0.02], [0.5], [0.98], [1.0]])
    allowed[2, : min(vocab, 64)] = True  # whole words set, whole words clear
    words = bitmask(allowed)
    assert torch.equal(unpack_bitmask(words, vocab), allowed)
    logits = torch.randn(5, vocab)
    kernel, reference = logits.clone(), logits.clone()
    layer_ops_cpu.mask_logits_cpu(kernel, words)
    mask_logits_ref(reference, words)
    assert torch.equal(kernel, reference) and torch.equal(kernel.isfinite(), allowed)
    rows = torch.randn(8, vocab + 3)[:, :vocab]  # rows with a stride: as the sampler's gathered logits
    expected = rows.clone()
    mask_logits_ref(expected, bitmask(allowed.repeat(2, 1)[:8]))
    layer_ops_cpu.mask_logits_cpu(rows, bitmask(allowed.repeat(2, 1)[:8]))
    assert torch.equal(rows, expected)


def test_a_bitmask_unpacks_bit_by_bit() -> None:
    words = torch.tensor([[0b1001, -(2**31)], [0, 1]], dtype=torch.int32)  # tokens 0, 3 and 63; 32
    assert unpack_bitmask(words, 64)[0].nonzero().flatten().tolist() == [0, 3, 63]
    assert unpack_bitmask(words, 64)[1].nonzero().flatten().tolist() == [32]
    assert unpack_bitmask(words, 40).shape == (2, 40)
    assert unpack_bitmask(words, 40)[0].nonzero().flatten().tolist() == [0, 3]


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resumed_request_continues_its_structure_token_exact(
    reference: ReferenceEngine, temperature: float
) -> None:
    """A request resumed after k tokens (its prompt then ends with them, output_offset k), as after a
    failover, rebuilds its grammar state from them and ends exactly as the run without a break."""
    grammar = structure.response_format_grammar(json_schema(NUMBERS))
    prompt = reference.tokenizer.encode("numbers:", add_special_tokens=True)
    params = SamplingParams(max_tokens=300, temperature=temperature, seed=11, grammar=grammar)
    whole = reference.generate(prompt, params)
    numbers = json.loads(reference.tokenizer.decode(whole.token_ids, skip_special_tokens=True))
    assert len(numbers) == 40 and all(0 <= n <= 999 for n in numbers)
    assert whole.finish_reason == "stop" and whole.token_ids[-1] in reference.tokenizer.eos_token_ids
    for k in (1, 17, len(whole.token_ids) - 2):
        resumed = SamplingParams(
            max_tokens=300 - k, temperature=temperature, seed=11, grammar=grammar, output_offset=k
        )
        rest = reference.generate(prompt + whole.token_ids[:k], resumed)
        assert whole.token_ids[:k] + rest.token_ids == whole.token_ids, k


def test_a_sequence_state_consumes_only_what_it_has_not_seen() -> None:
    """The matcher follows a sequence's output across steps and a preemption (its output kept)."""
    reference = ReferenceEngine("tiny")
    grammars = Grammars.for_model(reference.path, reference.config.vocab_size)
    grammar = structure.response_format_grammar({"type": "regex", "regex": "ab+c"})
    seq = Sequence("r", (1, 2, 3), SamplingParams(grammar=grammar))
    plain = Sequence("p", (1, 2, 3), SamplingParams())
    assert grammars.masks([plain]) is None

    def allowed() -> set[int]:
        words = grammars.masks([plain, seq])
        assert words is not None
        rows = unpack_bitmask(words, reference.config.vocab_size)
        assert bool(rows[0].all())  # a row without a grammar allows any token
        return set(rows[1].nonzero().flatten().tolist())

    def allowed_alone(seq: Sequence) -> set[int]:
        return set(
            unpack_bitmask(grammars.masks([seq]), reference.config.vocab_size)[0].nonzero().flatten().tolist()
        )

    assert allowed() == {ord("a")}
    seq.output_ids += [ord("a"), ord("b")]
    assert allowed() == {ord("b"), ord("c")}
    seq.output_ids.append(ord("c"))
    assert allowed() == reference.tokenizer.eos_token_ids
    assert seq.grammar_state.consumed == 3
    # resumed after "ab" (its prompt ends with them): the same state once caught up
    resumed = Sequence("r", (1, 2, 3, ord("a"), ord("b")), SamplingParams(grammar=grammar, output_offset=2))
    assert allowed_alone(resumed) == {ord("b"), ord("c")}
    resumed.output_ids.append(ord("b"))
    assert allowed_alone(resumed) == {ord("b"), ord("c")}
    assert resumed.grammar_state.consumed == 3


def test_generate_takes_a_response_format(capsys: pytest.CaptureFixture[str]) -> None:
    from pdfabric.cli.main import main

    regex = '{"type": "regex", "regex": "(yes|no)!"}'
    assert main(["generate", "--prompt", "x", "--response-format", regex, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes!", "no!")
    assert main(["generate", "--prompt", "x", "--response-format", '{"type": "regex", "regex": "(a"}']) == 2
    assert "does not compile" in capsys.readouterr().err


# A chat template that renders tools and calls itself, in the default tool format (as Qwen2.5's does).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_renders_tool_calls_gets_the_tools_and_calls_as_objects() -> None:
    from pdfabric.engine.tokenizer import Tokenizer
    from pdfabric.router.front import openai_api, prompts

    path = ReferenceEngine("tiny").path
    plain = Tokenizer.from_pretrained(path)
    hermes = Tokenizer(plain._backend, {"eos_token": "<|end_of_text|>"}, None, HERMES_TEMPLATE)
    assert hermes.renders_tool_calls and not plain.renders_tool_calls
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    body = {"model": "tiny", "tools": [ADD], "messages": messages}
    parsed = openai_api.parse_request(body, True, ("tiny",), 260)
    (ids,) = prompts.tokenize(hermes, parsed)
    text = hermes.decode(list(ids), skip_special_tokens=False)
    assert '"name": "add"' in text.split("<|im_end|>")[0]  # the template's own tool list
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<|im_start|>tool\n3<|im_end|>" in text and "<tools>" not in text
    # the plain template gets the default format instead
    (ids,) = prompts.tokenize(plain, parsed)
    text = plain.decode(list(ids), skip_special_tokens=False)
    assert "<tools>" in text and "<tool_response>\n3\n</tool_response>" in text


def test_a_grammar_a_worker_cannot_compile_never_fails_the_worker() -> None:
    """The router checks a grammar against the model's tokenizer (a 400 for a special token the model
    lacks); a worker that still meets one (another version's tokenizer) logs it and leaves that
    request unconstrained instead of failing every request it holds."""
    from pdfabric.engine.tokenizer import Tokenizer

    reference = ReferenceEngine("tiny")
    grammar = structure.response_format_grammar({"type": "grammar", "grammar": "start: <|nope|>"})
    with pytest.raises(StructureError, match="for this model"):
        structure.check_for_tokenizer(
            grammar, Tokenizer.from_pretrained(reference.path).grammar_tokenizer, "x"
        )
    grammars = Grammars.for_model(reference.path, reference.config.vocab_size)
    seq = Sequence("r", (1, 2), SamplingParams(grammar=grammar))
    words = grammars.masks([seq])
    assert words is not None and bool((words == -1).all()) and seq.grammar_state.failed


def test_a_worker_without_a_grammar_engine_serves_structured_requests_unconstrained() -> None:
    from pdfabric.control import Generate
    from pdfabric.decode.core import ColocatedCore
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.engine.stepper import Stepper
    from pdfabric.profile import WorkerProfile
    from pdfabric.worker.spec import FixedProfile
    from tests.core_helpers import core_spec

    reference = ReferenceEngine("tiny")
    core = ColocatedCore(core_spec("colocated", 32, worker_id="c"), FixedProfile(WorkerProfile()))
    stepper = Stepper(ModelRunner(reference.model, 32, 16))  # no grammar engine
    grammar = structure.response_format_grammar({"type": "regex", "regex": "a+"})
    params = SamplingParams(max_tokens=5, ignore_eos=True, grammar=grammar)
    core.handle(Generate("r", (1, 2, 3), params, ()))
    seq = core.scheduler.get("r")
    while core.has_work:
        step = core.schedule()
        core.complete(step, stepper.run(step.chunks, core.tables), 0.0)
    plain = reference.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    assert seq.output_ids == plain.token_ids  # as if no grammar had been asked for
