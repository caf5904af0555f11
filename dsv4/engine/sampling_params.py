"""Per-request sampling parameters (names and meanings as in vLLM)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .structured import StructuredOutputsParams

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# what torch.Generator.manual_seed takes (negative seeds wrap around); the server's own range is the
# narrower int64 one of vLLM and OpenAI, so that the engine's seed + i for n > 1 stays inside this one
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # "cumulative": ``step()`` returns the whole output so far every step the request advances (a
    # copy of its token list: O(output length) per step); "delta": only what the step added (new
    # token ids, logprobs, text: what the server streams; ``outputs.merge_delta`` joins them);
    # "final_only": only once it finishes (what ``LLM.generate`` uses). As vLLM's ``RequestOutputKind``.
    output_kind: str = "cumulative"
    # the output must follow this grammar (JSON schema, regex, choice, Lark): dsv4.engine.structured
    structured_outputs: StructuredOutputsParams | None = None
    # token id → value added to its logit before sampling (OpenAI's logit_bias: −100..100)
    logit_bias: dict[int, float] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        self._validate_adjustments()

    def _validate_adjustments(self) -> None:
        """The logit adjustments: structured outputs and logit_bias."""
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"SamplingParams.logit_bias: key {k!r} is not a token id") from None
                if tid < 0 or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                        or not -100 <= v <= 100:
                    raise ValueError(f"SamplingParams.logit_bias[{k!r}] must be a finite number in [-100, 100] "
                                     f"for a token id ≥ 0, got {v!r}")
                bias[tid] = float(v)
            self.logit_bias = bias

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before sampling (a grammar mask, a bias)."""
        return self.structured_outputs is not None or bool(self.logit_bias)

    def validate(self) -> None:
        def bad(name, value, rule):
            raise ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            # NaN passes every range check below (its comparisons are all false); inf passes the open ones
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                bad(name, v, "a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "an integer ≥ 1")
        if self.temperature < 0:
            bad("temperature", self.temperature, "≥ 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer ≥ 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer ≥ 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"≤ max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                bad(name, v, "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            bad("stop", self.stop, "a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of token ids")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", self.seed, "an integer in [-2**63, 2**64 - 1]")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", self.output_kind, f"one of {', '.join(OUTPUT_KINDS)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
