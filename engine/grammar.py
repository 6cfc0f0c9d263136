"""Token masks for requests whose output follows a grammar (``SamplingParams.grammar``; built and
checked by ``pdfabric.structure``).

A sequence's grammar state is a matcher that has consumed every output token so far: the earlier
output that a resumed request's prompt ends with (``SamplingParams.output_offset`` tokens) and then
this run's. It is built the first time the sequence samples, on whichever worker that is, so a
request moved to another worker mid-structure, a branch of ``n`` > 1 and a preempted sequence all
continue the structure where it stood. Compiled grammars are cached (bounded); a sequence's matcher
is a copy of the cached one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pdfabric.engine.sequence import Sequence

log = logging.getLogger("pdfabric.engine.grammar")

MAX_CACHED_GRAMMARS = 256


@dataclass
class GrammarState:
    """A sequence's matcher and how many of its output tokens (earlier output included) it consumed."""

    matcher: object  # llguidance.LLMatcher
    consumed: int = 0
    failed: bool = False  # an output token the grammar refused (never masked again; logged once)


class Grammars:
    """The grammar engine of one model: its tokenizer as llguidance reads it (built on first use from
    the model directory's ``tokenizer.json``, about 0.2 s for a 49k vocabulary) and compiled grammars."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size  # the width of the model's logits
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int) -> Grammars:
        from pdfabric.engine.tokenizer import Tokenizer

        return cls(model_dir, vocab_size, Tokenizer.from_pretrained(model_dir).eos_token_ids)

    @property
    def tokenizer(self):  # noqa: ANN201 - llguidance.LLTokenizer
        if self._tokenizer is None:
            import llguidance

            text = (self.model_dir / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(
                text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def matcher(self, grammar: str):  # noqa: ANN201 - llguidance.LLMatcher
        """A fresh matcher for ``grammar`` (a copy of the cached compiled one)."""
        import llguidance

        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if compiled.is_error():  # checked by the router; a worker of another version may differ
                raise ValueError(f"the grammar does not compile: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def masks(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The tokens each of ``seqs`` may sample next, as bitmasks: int32 ``[len(seqs), ceil(vocab /
        32)]``, bit ``t % 32`` of word ``t // 32`` set where token ``t`` is allowed (a row without a
        grammar allows every token; ``kernels.dispatch.mask_logits`` applies them); None when none of
        them has a grammar. Each matcher first consumes the output tokens it has not seen."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.grammar]
        if not rows:
            return None
        words = torch.full((len(seqs), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row_bytes = words.shape[1] * 4
        for i in rows:
            state = self._state(seqs[i])
            if state is not None:  # the mask written straight into row i
                state.matcher.unsafe_compute_mask_ptr(words[i].data_ptr(), row_bytes)  # type: ignore[attr-defined]
        return words

    def masks_ahead(self, seq: Sequence, proposal: tuple[int, ...]) -> torch.Tensor:
        """Bitmasks for ``seq``'s next token and for the token after each of ``proposal``'s first
        ``i`` tokens (``[1 + len(proposal), words]``), to check a speculative proposal in one step.
        Rows past the first proposed token the grammar refuses allow every token: that row's mask
        already excludes the refused token, so nothing after it is kept. The matcher is left as it
        was."""
        words = torch.full((1 + len(proposal), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        state = self._state(seq)
        if state is None:
            return words
        matcher, row_bytes = state.matcher, words.shape[1] * 4
        valid = matcher.validate_tokens(list(proposal))  # type: ignore[attr-defined]
        for i in range(valid + 1):
            matcher.unsafe_compute_mask_ptr(words[i].data_ptr(), row_bytes)  # type: ignore[attr-defined]
            if i < valid:
                matcher.consume_token(proposal[i])  # type: ignore[attr-defined]
        matcher.rollback(valid)  # type: ignore[attr-defined]
        return words

    def _state(self, seq: Sequence) -> GrammarState | None:
        """``seq``'s matcher, caught up with its output (None: its output left the grammar)."""
        state = seq.grammar_state
        if state is None:
            try:
                state = seq.grammar_state = GrammarState(self.matcher(seq.params.grammar))
            except ValueError as exc:  # the router checked it against the same tokenizer: a version skew
                log.error("%s: %s; its output is not constrained", seq.request_id, exc)
                seq.grammar_state = GrammarState(None, failed=True)
                return None
        if state.failed:
            return None
        offset, output = seq.params.output_offset, seq.output_ids
        if state.consumed < offset + len(output):
            earlier = (
                seq.prompt_ids[len(seq.prompt_ids) - offset + state.consumed :]
                if state.consumed < offset
                else ()
            )
            pending = [*earlier, *output[max(0, state.consumed - offset) :]]
            if not state.matcher.consume_tokens(pending):  # type: ignore[attr-defined]
                error = state.matcher.get_error()  # type: ignore[attr-defined]
                log.warning("%s: its output left its grammar: %s", seq.request_id, error)
                state.failed = True
                return None
            state.consumed = offset + len(output)
        return state
