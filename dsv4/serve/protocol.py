"""Request models of the OpenAI-compatible API (pydantic), and their translation to SamplingParams.

Field names, defaults and extensions follow vLLM's server so that existing clients and scripts
work unchanged. Unknown fields are ignored (as vLLM and OpenAI do); wrong types fail validation
and become a 400 whose message names the field (see :mod:`dsv4.serve.errors`). Float fields
refuse NaN and ±inf (JSON's ``NaN`` literal, ``"NaN"``, ``1e400``): the sampler cannot use them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError
from typing_extensions import Required, TypedDict

from ..engine.sampling_params import SamplingParams

# vLLM's VLLM_MAX_N_SEQUENCES default: one request cannot fan out into more sequences than this
MAX_N = 16384
# torch.long, as vLLM and OpenAI bound ``seed``
SEED_RANGE = (-(2**63), 2**63 - 1)
# what dsv4.chat.map_reasoning_effort understands (it compares case-insensitively, so does this);
# OpenAI's values plus DeepSeek's "max"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _check_effort(value: str) -> str:
    if value.strip().lower() not in REASONING_EFFORTS:
        raise PydanticCustomError("reasoning_effort", "Input should be one of {allowed}, got {got}",
                                  {"allowed": ", ".join(REASONING_EFFORTS), "got": repr(value)})
    return value


ReasoningEffort = Annotated[str, AfterValidator(_check_effort)]


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Model):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
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
def _prompt_kind(value: Any) -> str | None:
    """The union member a prompt is meant to be, from its first element.

    Trying the members in turn would validate a 4-million-id prompt once per member (seconds,
    holding the GIL); the first element decides, and the errors then name the bad element.
    """
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


PromptType = Annotated[
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list[str]")], Annotated[list[int], Tag("list[int]")],
          Annotated[list[list[int]], Tag("list[list[int]]")]],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="Input should be a string, a list of strings, a list of token ids or a list "
                                       "of token-id lists"),
]


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
    """One message. Extra keys (``task``, ``wo_eos``, ``response_format`` …) pass through to the encoder;
    those it uses without checking their type are typed here, so that a wrong one is a 400."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "developer", "assistant", "tool", "latest_reminder"]
    content: str | list[ContentPart | str] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tools: list[dict[str, Any]] | None = None
    task: str | None = None
    wo_eos: bool | None = None


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
    reasoning_effort: ReasoningEffort | None = None


class ResponseFormat(TypedDict, total=False):
    """Only ``type`` is checked here; the rest (``json_schema`` …) passes through to the encoder."""

    __pydantic_config__ = ConfigDict(extra="allow")
    type: Required[Literal["text", "json_object", "json_schema"]]


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
    reasoning_effort: ReasoningEffort | None = None
    response_format: ResponseFormat | None = None


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
