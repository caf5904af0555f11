"""Request models of the OpenAI-compatible API (pydantic), and their translation to SamplingParams.

Field names, defaults and extensions follow vLLM's server so that existing clients and scripts
work unchanged. Unknown fields are ignored (as vLLM and OpenAI do); wrong types fail validation
and become a 400 whose message names the field (see :mod:`dsv4.serve.errors`).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import SamplingParams


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Model):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, defaults: dict[str, Any], *, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Build SamplingParams; its ValueError messages (``SamplingParams.<field> must be …``) become 400s.

        ``defaults`` holds the model's generation_config.json values, used for fields the request
        leaves unset (vLLM's ``--generation-config auto``).
        """
        def pick(name: str, fallback):
            value = getattr(self, name)
            if value is not None:
                return value
            return defaults.get(name, fallback)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=pick("repetition_penalty", 1.0),
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
        )


# ---- /v1/completions ---------------------------------------------------------------------------
PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM extension: a text prompt gets BOS, as the HF tokenizer adds it


# ---- /v1/chat/completions ----------------------------------------------------------------------
class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message. Extra keys (``task``, ``wo_eos``, ``response_format`` …) pass through to the encoder."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "developer", "assistant", "tool", "latest_reminder"]
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(extra="allow")
    thinking: bool | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None


# ---- /tokenize, /detokenize --------------------------------------------------------------------
class TokenizeRequest(_Model):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]
