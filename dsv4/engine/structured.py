"""Structured outputs: a grammar (JSON schema, regex, choice, Lark) that every sampled token must follow.

The grammar engine is llguidance (what vLLM's ``guidance`` backend uses): from the tokens a
sequence has produced it computes the tokens that keep the output a prefix of a sentence of the
grammar, as a bitmask (one bit per vocabulary id). The sampler masks the sequence's logits row with
it (on the host, where non-greedy rows are sampled anyway), so greedy and sampled requests, with or
without logprobs, pick only allowed tokens; EOS is allowed exactly where the output may end, and a
sequence whose grammar can take no more tokens stops. ``Guide.rollback`` undoes accepted tokens
(what a speculative step's rejected drafts need).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the output must match (exactly one field set), named as in vLLM's ``StructuredOutputsParams``:
    ``json`` a JSON schema (dict or its JSON text), ``regex`` a regular expression, ``choice`` one of
    the strings, ``grammar`` a Lark grammar (llguidance's dialect: it may embed ``%json {schema}``),
    ``json_object`` any JSON object. JSON is written compactly (``{"a": 1, "b": [2, 3]}``) unless
    ``disable_any_whitespace`` is False: with any whitespace allowed a model can emit newlines until
    max_tokens and never close the object (vLLM's default allows it; the failure is the common one)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    source: str = field(default="structured_outputs", repr=False, compare=False)  # the request field it came from

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source}: exactly one of {', '.join(KINDS)} must be given, got "
                             f"{given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"{self.source}.choice: must be a non-empty list of strings")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{self.source}.json: not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"{self.source}.json: a JSON schema must be an object, got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint."""
        LLMatcher = _llguidance().LLMatcher

        if self.json is not None or self.json_object:
            return LLMatcher.grammar_from_json_schema(self.json if self.json is not None else {"type": "object"},
                                                      {"whitespace_flexible": not self.disable_any_whitespace})
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class Guide:
    """One sequence's grammar state."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into ``row`` (int32 [ceil(V/32)], CPU, contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> None:
        """Advance past a sampled token; a token the mask did not allow is an error naming it."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"structured output: token {token} does not continue the grammar "
                             f"({self.matcher.get_error()})")

    @property
    def done(self) -> bool:
        """The grammar can take no more tokens (the output is complete)."""
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"structured output: could not roll back {num_tokens} tokens")


@functools.lru_cache(maxsize=4)
def _vocabulary(tokenizer_json: str, vocab_size: int, eos_token_id: int):
    """llguidance's view of a vocabulary (built once per process: ~1.5 s for the 129K tokens)."""
    from llguidance import LLTokenizer

    with open(tokenizer_json, encoding="utf-8") as f:
        return LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=eos_token_id)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need the grammar engine llguidance (pip install llguidance)") from None
    return llguidance


class GrammarCompiler:
    """Compiles a request's constraint into a guide per sequence, against the engine's vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        self._tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos_token_id

    def warm(self) -> None:
        """Build the vocabulary now (a server does this at start, off its request path); nothing
        when llguidance or the tokenizer file is missing (the first request says why)."""
        try:
            _llguidance()
            self._vocabulary()
        except ValueError:
            pass

    def _vocabulary(self):
        path = getattr(self._tokenizer, "path", None)
        if path is None:
            raise ValueError("structured outputs need the tokenizer's tokenizer.json (this tokenizer has no path)")
        return _vocabulary(str(path), self.vocab_size, self.eos)

    def guides(self, params: StructuredOutputsParams, n: int) -> list[Guide]:
        """``n`` fresh guides of ``params``; an invalid grammar is a ValueError naming the field."""
        LLMatcher = _llguidance().LLMatcher

        try:
            grammar = params.grammar_text()
        except ValueError as e:
            raise ValueError(f"{params.source}.{params.kind}: {e}") from None
        lltok = self._vocabulary()
        error = LLMatcher.validate_grammar(grammar, lltok)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"{params.source}.{params.kind}: invalid {params.kind}: {error}")
        out = []
        for _ in range(n):
            m = LLMatcher(lltok, grammar, log_level=0)
            if m.is_error():
                raise ValueError(f"{params.source}.{params.kind}: invalid {params.kind}: {m.get_error()}")
            out.append(Guide(m, self.vocab_size))
        return out


def bitmask_rows(guides: list[Guide], vocab_size: int) -> torch.Tensor:
    """int32 [len(guides), ceil(V/32)] allowed-token bitmasks, on the host."""
    mask = torch.empty(len(guides), (vocab_size + 31) // 32, dtype=torch.int32)
    for g, row in zip(guides, mask):
        g.fill_bitmask(row)
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` [n, V] with every token whose bit is 0 in ``mask`` [n, ceil(V/32)] set to −inf."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((mask.to(logits.device).unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    return logits.masked_fill(~allowed, float("-inf"))
