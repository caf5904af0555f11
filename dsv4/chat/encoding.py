"""Render OpenAI-style chat messages into the DeepSeek-V4 prompt string.

DeepSeek-V4 ships no Jinja chat template; the prompt format is defined by the official
``encoding_dsv4.py``. This module re-implements its rules (see the reference notes, model-and-formats
§10.2 and release-and-anchors §3):

* BOS, then (thinking mode only) the reasoning-effort preamble, then the messages.
* ``system``: raw text, no role token, plus a "## Tools" section and/or a "## Response Format"
  section when attached. Request-level ``tools``/``response_format`` are attached to the first
  system message; one (with empty text) is synthesized at the front if there is none.
* ``user``/``developer``: ``<｜User｜>`` + text. ``latest_reminder``: ``<｜latest_reminder｜>`` + text.
* ``tool`` messages are merged into a user turn as ``<tool_result>…</tool_result>`` blocks joined by
  a blank line, reordered to the order of the preceding assistant's ``tool_calls``.
* ``assistant``: ``{reasoning</think>}{content}{DSML tool_calls}<｜end▁of▁sentence｜>``; the
  reasoning part only in thinking mode and only for turns that keep their reasoning.
* After a user/developer message that is last or followed by an assistant/latest_reminder message
  (and after a system message that is last or followed by an assistant message):
  ``<｜Assistant｜>`` + ``<think>`` (thinking, current turn) or ``</think>`` (chat / history).
* ``drop_thinking`` (default on, thinking mode only): reasoning of assistant turns before the last
  user/developer message is removed, and so are developer messages before it. It is forced off
  when any message carries tools.

:func:`render_messages` also records which parts of the prompt are the template's and which came
from the request, so that the tokenizer can keep request text from ever becoming control tokens
(:meth:`dsv4.chat.Tokenizer.encode_prompt`); :func:`encode_messages` returns just the text.

All validation errors are ``ValueError`` whose text starts with ``messages[i].field``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Mapping

# ---------------------------------------------------------------------------------------------
# Special token strings (fullwidth bar U+FF5C, ▁ U+2581)
# ---------------------------------------------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_BLOCK = "tool_calls"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

ROLES = ("system", "user", "developer", "assistant", "tool", "latest_reminder")

# ---------------------------------------------------------------------------------------------
# Verbatim prompt texts (data). Sources, as found with the code search:
#   * EFFORT_ABSOLUTE_MAXIMUM, TOOLS_TEMPLATE, RESPONSE_FORMAT_TEMPLATE: the official
#     encoding/encoding_dsv4.py as copied in supermy/ds4rs `encoding/encoding_dsv4.py` and in
#     vllm-project/vllm `vllm/tokenizers/deepseek_v4_encoding.py` (identical strings).
#   * EFFORT_BEYOND_MAXIMUM (0731 "max"): jasl/vllm `vllm/tokenizers/deepseek_v4_encoding.py`
#     (REASONING_EFFORT_PROMPTS), byte-identical in several independent re-implementations.
# ---------------------------------------------------------------------------------------------
EFFORT_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

EFFORT_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)

# Preamble per accepted effort value, per checkpoint generation.
#   0423 (original Flash): None and "high" add nothing, "max" adds the "Absolute maximum" text.
#        "low" is not accepted by the official 0423 encoder; we accept it as "nothing extra"
#        because the vLLM effort mapping produces it (see map_reasoning_effort).
#   0731: "low" (and None, the encoder default) adds nothing, "high" the old max text,
#        "max" the "Beyond maximum" text.
EFFORT_PREAMBLES: dict[str, dict[str | None, str]] = {
    "0423": {None: "", "low": "", "high": "", "max": EFFORT_ABSOLUTE_MAXIMUM},
    "0731": {None: "", "low": "", "high": EFFORT_ABSOLUTE_MAXIMUM, "max": EFFORT_BEYOND_MAXIMUM},
}

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 (DeepSeek's text, verbatim)

RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

# The templates around the request's schemas, which are request text.
_TOOLS_HEAD, _TOOLS_TAIL = (
    part.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END)
    for part in TOOLS_TEMPLATE.split("{tool_schemas}")
)
_RESPONSE_FORMAT_HEAD, _RESPONSE_FORMAT_TAIL = RESPONSE_FORMAT_TEMPLATE.split("{schema}")


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt and the origin of each part of its text.

    ``pieces`` are ``(text, from_request)`` pairs whose texts concatenate to ``text``. Request pieces
    hold what the caller supplied: message content, reasoning, tool-call names and arguments, tool
    results, the tool and response-format schemas. Template pieces hold the format's own text,
    the only place a control token (BOS, ``<｜User｜>``, ``</think>``, DSML…) may come from.
    """

    text: str
    pieces: tuple[tuple[str, bool], ...]


class _Builder:
    """Prompt text collected in pieces, each marked template or request text."""

    def __init__(self) -> None:
        self._pieces: list[tuple[list[str], bool]] = []

    def add(self, text: str, from_request: bool = False) -> None:
        if not text:
            return
        if self._pieces and self._pieces[-1][1] == from_request:
            self._pieces[-1][0].append(text)
        else:
            self._pieces.append(([text], from_request))

    def request(self, text: str) -> None:
        self.add(text, True)

    def build(self) -> RenderedPrompt:
        pieces = tuple(("".join(parts), from_request) for parts, from_request in self._pieces)
        return RenderedPrompt("".join(text for text, _ in pieces), pieces)


# ---------------------------------------------------------------------------------------------
# Helpers exposed to the server layer
# ---------------------------------------------------------------------------------------------
def map_reasoning_effort(value: Any) -> tuple[bool, str | None]:
    """Map an OpenAI ``reasoning_effort`` request value to ``(thinking, effort)`` like vLLM.

    ``None`` (not given) → thinking with "high"; ``"none"`` → chat mode; ``"max"`` → "max";
    ``"low"``/``"minimal"``/``"medium"`` → "low"; anything else → "high".
    """
    if not isinstance(value, str):
        return True, "high"
    v = value.strip().lower()
    if v == "none":
        return False, None
    if v == "max":
        return True, "max"
    if v in ("low", "minimal", "medium"):
        return True, "low"
    return True, "high"


def effort_version_for_config(config: Mapping[str, Any]) -> str:
    """``"0731"`` for the DeepSeek-V4-Flash-0731 generation, ``"0423"`` for the original.

    0731 configs carry DSpark fields (``dspark_block_size``) and more ``compress_ratios`` entries
    than ``num_hidden_layers + 1`` (the main layers plus one MTP layer).
    """
    if "dspark_block_size" in config:
        return "0731"
    ratios = config.get("compress_ratios")
    n_layers = config.get("num_hidden_layers", config.get("n_layers"))
    if isinstance(ratios, (list, tuple)) and isinstance(n_layers, int):
        if len(ratios) > n_layers + 1:
            return "0731"
    return "0423"


def effort_preamble(reasoning_effort: str | None, effort_version: str = "0423") -> str:
    """The text prepended (thinking mode only) for ``reasoning_effort`` under ``effort_version``."""
    table = EFFORT_PREAMBLES.get(effort_version)
    if table is None:
        raise ValueError(f"effort_version: unknown {effort_version!r}, expected one of {sorted(EFFORT_PREAMBLES)}")
    if reasoning_effort not in table:
        accepted = ["None" if k is None else repr(k) for k in table]
        raise ValueError(
            f"reasoning_effort: {reasoning_effort!r} is not accepted for effort_version "
            f"{effort_version!r} (accepted: {', '.join(accepted)})"
        )
    return table[reasoning_effort]


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[Mapping[str, Any]]) -> str:
    """The "## Tools" section: DSML instructions and one JSON function schema per line."""
    b = _Builder()
    _add_tools(b, tools)
    return b.build().text


def render_response_format(response_format: Mapping[str, Any]) -> str:
    """The "## Response Format" section for an OpenAI ``response_format`` value.

    ``{"type": "json_schema", "json_schema": {"schema": S, ...}}`` renders ``S``;
    ``{"type": "json_object"}`` renders ``{"type": "object"}``; any other mapping without a
    ``type`` of text/json_* is taken to be the schema itself and rendered whole (this is what the
    official encoder does with a message's ``response_format``).
    """
    b = _Builder()
    _add_response_format(b, response_format)
    return b.build().text


def render_tool_calls(tool_calls: list[Mapping[str, Any]], *, where: str = "tool_calls") -> str:
    """DSML block for OpenAI-shape tool calls (without the leading blank line)."""
    b = _Builder()
    _add_tool_calls(b, tool_calls, where)
    return b.build().text


# ---------------------------------------------------------------------------------------------
# Internal helpers
# ---------------------------------------------------------------------------------------------
def _add_tools(b: _Builder, tools: list[Mapping[str, Any]]) -> None:
    b.add(_TOOLS_HEAD)
    b.request("\n".join(to_json(dict(_function_of(t))) for t in tools))
    b.add(_TOOLS_TAIL)


def _add_response_format(b: _Builder, response_format: Mapping[str, Any]) -> None:
    b.add(_RESPONSE_FORMAT_HEAD)
    b.request(to_json(_response_schema(response_format)))
    b.add(_RESPONSE_FORMAT_TAIL)


def _add_tool_calls(b: _Builder, tool_calls: list[Mapping[str, Any]], where: str) -> None:
    b.add(f"<{DSML}{TOOL_CALLS_BLOCK}>\n")
    for j, call in enumerate(tool_calls):
        name, arguments = _call_name_and_arguments(call, f"{where}[{j}]")
        b.add("\n" if j else "")
        b.add(f'<{DSML}invoke name="')
        b.request(name)
        b.add('">\n')
        for n, (key, value) in enumerate(arguments.items()):
            b.add("\n" if n else "")
            b.add(f'<{DSML}parameter name="')
            b.request(str(key))
            b.add(f'" string="{"true" if isinstance(value, str) else "false"}">')
            b.request(value if isinstance(value, str) else to_json(value))
            b.add(f"</{DSML}parameter>")
        b.add(f"\n</{DSML}invoke>")
    b.add(f"\n</{DSML}{TOOL_CALLS_BLOCK}>")


def _function_of(spec: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = spec.get("function") if isinstance(spec, Mapping) else None
    return fn if isinstance(fn, Mapping) else spec


def _response_schema(rf: Mapping[str, Any]) -> Any:
    kind = rf.get("type")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if isinstance(js, Mapping):
            return js.get("schema", js)
        return rf
    if kind == "json_object":
        return {"type": "object"}
    return rf


def _call_name_and_arguments(call: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(call).__name__}")
    fn = call.get("function")
    if not isinstance(fn, Mapping):
        fn = call  # tolerate the flat {"name", "arguments"} shape
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name: missing or not a string")
    raw = fn.get("arguments")
    if raw is None or raw == "":
        return name, {}
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({exc})") from None
    else:
        parsed = raw
    if parsed is None:
        return name, {}
    if not isinstance(parsed, Mapping):
        raise ValueError(f"{where}.function.arguments: must be a JSON object, got {type(parsed).__name__}")
    return name, dict(parsed)


def _flatten_content(content: Any, where: str) -> str | None:
    """OpenAI content (str, list of parts, or None) → text, parts joined by a blank line as
    DeepSeek's encoder joins content blocks. Images are refused rather than dropped or turned into
    a placeholder: the model is text-only."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: expected a string or a list of content parts")
    parts: list[str] = []
    for k, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}[{k}]: expected a content part object")
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}[{k}].text: missing or not a string")
            parts.append(text)
        elif kind in ("image", "image_url", "input_image"):
            raise ValueError(
                f"{where}[{k}]: images are not supported (DeepSeek-V4-Flash is a text-only model; got a {kind!r} part)"
            )
        else:
            raise ValueError(f"{where}[{k}].type: unsupported content part type {kind!r}")
    return "\n\n".join(parts)


def _normalize(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate and convert messages into an internal form (deep copies; inputs untouched).

    Each output dict carries ``_index`` (the position in the caller's list) for error messages.
    """
    if not isinstance(messages, list):
        raise ValueError("messages: expected a list of message objects")
    if not messages:
        raise ValueError("messages: the list is empty")
    out: list[dict[str, Any]] = []
    last_call_ids: list[str] | None = None  # ids of the latest assistant's tool calls
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}]: expected an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        m: dict[str, Any] = {"role": role, "_index": i}
        for key in ("tools", "response_format", "task", "wo_eos"):
            if msg.get(key) is not None:
                m[key] = copy.deepcopy(msg[key])
        if "task" in m and m["task"] not in TASK_TOKENS:
            raise ValueError(
                f"messages[{i}].task: unknown task {m['task']!r} (expected one of {', '.join(TASK_TOKENS)})"
            )
        if "tools" in m and not isinstance(m["tools"], list):
            raise ValueError(f"messages[{i}].tools: expected a list")
        if "response_format" in m and not isinstance(m["response_format"], Mapping):
            raise ValueError(f"messages[{i}].response_format: expected an object")

        where = f"messages[{i}].content"
        if role == "assistant":
            content = _flatten_content(msg.get("content"), where)
            tool_calls = msg.get("tool_calls") or []
            if not isinstance(tool_calls, list):
                raise ValueError(f"messages[{i}].tool_calls: expected a list")
            reasoning = msg.get("reasoning_content")
            if reasoning is None:
                reasoning = msg.get("reasoning")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"messages[{i}].reasoning_content: expected a string")
            if content is None and not tool_calls and reasoning is None:
                raise ValueError(
                    f"messages[{i}].content: missing (an assistant message needs content, "
                    "tool_calls or reasoning_content)"
                )
            calls = []
            for j, call in enumerate(tool_calls):
                name, args = _call_name_and_arguments(call, f"messages[{i}].tool_calls[{j}]")
                call_id = call.get("id") if isinstance(call, Mapping) else None
                calls.append({"id": call_id, "name": name, "arguments": args})
            m.update(content=content or "", reasoning=reasoning, tool_calls=calls)
            last_call_ids = [c["id"] for c in calls if c["id"]]
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError(f"messages[{i}].tool_call_id: missing or not a string")
            if last_call_ids is None:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {call_id!r} has no matching call (no earlier assistant message)"
                )
            if call_id not in last_call_ids:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {call_id!r} has no matching call in the "
                    f"preceding assistant tool_calls (ids: {', '.join(last_call_ids) or 'none'})"
                )
            content = _flatten_content(msg.get("content"), where)
            if content is None:
                raise ValueError(f"{where}: missing")
            m.update(content=content, tool_call_id=call_id)
        else:
            content = _flatten_content(msg.get("content"), where)
            if content is None and not (role == "system" and ("tools" in m or "response_format" in m)):
                raise ValueError(f"{where}: missing")
            if role == "developer" and not content:
                raise ValueError(f"{where}: a developer message must have non-empty content")
            m["content"] = content or ""
        out.append(m)
    return out


def _merge_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turn ``tool`` messages into user turns made of blocks; consecutive user turns merge.

    Mirrors the official preprocessing: a tool result joins the previous user turn when there is
    one directly before it, and a user message directly after a block-user turn (without a task)
    joins it too. Blocks are rendered joined by a blank line.
    """
    merged: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        prev = merged[-1] if merged else None
        prev_is_user = prev is not None and prev["role"] == "user"
        if role == "tool":
            block = {"type": "tool_result", "id": m["tool_call_id"], "content": m["content"]}
            if prev_is_user:
                prev["blocks"].append(block)
            else:
                merged.append({"role": "user", "_index": m["_index"], "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "content": m["content"]}
            if prev_is_user and prev.get("task") is None:
                prev["blocks"].append(block)
                for key in ("task", "wo_eos"):
                    if key in m:
                        prev[key] = m[key]
            else:
                new = {k: v for k, v in m.items() if k != "content"}
                new["blocks"] = [block]
                merged.append(new)
        else:
            merged.append(m)
    return merged


def _sort_tool_results(messages: list[dict[str, Any]]) -> None:
    """Reorder tool_result blocks of each user turn to the preceding assistant's call order."""
    order: dict[str, int] = {}
    for m in messages:
        if m["role"] == "assistant" and m["tool_calls"]:
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c["id"]}
        elif m["role"] == "user":
            results = [b for b in m["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                results.sort(key=lambda b: order.get(b["id"], 0))  # stable
                it = iter(results)
                m["blocks"] = [next(it) if b["type"] == "tool_result" else b for b in m["blocks"]]


def _last_user_index(messages: list[dict[str, Any]]) -> int:
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] in ("user", "developer"):
            return k
    return -1


def _drop_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Before the last user/developer turn: drop assistant reasoning and developer messages."""
    last_user = _last_user_index(messages)
    kept = []
    for k, m in enumerate(messages):
        if k >= last_user or m["role"] in ("system", "user", "latest_reminder"):
            kept.append(m)
        elif m["role"] == "assistant":
            kept.append({**m, "reasoning": None})
        # developer messages before the last user turn are removed
    return kept


def _attach_request_level(
    messages: list[dict[str, Any]],
    tools: list[Mapping[str, Any]] | None,
    response_format: Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    if not tools and response_format is None:
        return messages
    target = next((m for m in messages if m["role"] == "system"), None)
    if target is None:
        target = {"role": "system", "content": "", "_index": None}
        messages = [target, *messages]
    if tools:
        target["tools"] = copy.deepcopy(list(tools))  # request-level tools take precedence
    if response_format is not None:
        target["response_format"] = copy.deepcopy(dict(response_format))
    return messages


def _add_user_blocks(b: _Builder, blocks: list[dict[str, Any]]) -> None:
    for k, block in enumerate(blocks):
        b.add("\n\n" if k else "")
        if block["type"] == "tool_result":
            b.add(TOOL_RESULT_OPEN)
            b.request(block["content"])
            b.add(TOOL_RESULT_CLOSE)
        else:
            b.request(block["content"])


def _add_sections(b: _Builder, m: dict[str, Any]) -> None:
    if m.get("tools"):
        b.add("\n\n")
        _add_tools(b, m["tools"])
    if m.get("response_format") is not None:
        b.add("\n\n")
        _add_response_format(b, m["response_format"])


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------
def encode_messages(
    messages: list[dict],
    *,
    thinking: bool = True,
    reasoning_effort: str | None = None,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
    effort_version: str = "0423",
) -> str:
    """The prompt text of :func:`render_messages` (same arguments).

    To tokenize a chat prompt use :func:`render_messages` and
    :meth:`dsv4.chat.Tokenizer.encode_prompt`: encoding this text with ``Tokenizer.encode`` lets
    message text such as ``<｜end▁of▁sentence｜>`` become control tokens.
    """
    return render_messages(
        messages, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools, response_format=response_format,
        drop_thinking=drop_thinking, add_bos=add_bos, effort_version=effort_version,
    ).text


def render_messages(
    messages: list[dict],
    *,
    thinking: bool = True,
    reasoning_effort: str | None = None,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
    effort_version: str = "0423",
) -> RenderedPrompt:
    """Render ``messages`` (OpenAI chat format) into the DeepSeek-V4 prompt, its text in pieces.

    ``thinking`` selects thinking mode (the prompt ends in ``<think>``) or chat mode (``</think>``).
    ``reasoning_effort`` picks the preamble for ``effort_version`` ("0423": None/"low"/"high" add
    nothing, "max" the "Absolute maximum" text; "0731": None/"low" nothing, "high" the
    "Absolute maximum" text, "max" the "Beyond maximum" text); it only matters in thinking mode
    but is validated always. ``tools`` (OpenAI tool specs) and ``response_format`` are attached
    to the first system message (synthesized if absent). Message extensions understood:
    ``reasoning_content``/``reasoning`` (assistant), ``wo_eos`` (assistant: omit EOS, for
    continuing a prefilled turn), ``task`` (quick-instruction task token), per-message
    ``tools``/``response_format`` on system/developer messages.

    Tokenize the result with :meth:`dsv4.chat.Tokenizer.encode_prompt`: control tokens only where
    the template put them, everything from the request as plain text.
    """
    preamble = effort_preamble(reasoning_effort, effort_version)
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools: expected a list of tool specs")
    if response_format is not None and not isinstance(response_format, Mapping):
        raise ValueError("response_format: expected an object")
    if response_format is not None and response_format.get("type") == "text":
        response_format = None

    msgs = _normalize(messages)
    msgs = _attach_request_level(msgs, tools, response_format)
    msgs = _merge_tool_messages(msgs)
    _sort_tool_results(msgs)

    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_history(msgs)
    last_user = _last_user_index(msgs)

    def opener(k: int) -> str:
        """``<think>`` or ``</think>`` after the ``<｜Assistant｜>`` that follows message k."""
        if thinking and (not drop or k >= last_user):
            return THINK_START
        return THINK_END

    b = _Builder()
    b.add(BOS if add_bos else "")
    n = len(msgs)
    for k, m in enumerate(msgs):
        role = m["role"]
        if k == 0 and thinking:
            b.add(preamble)

        if role == "system":
            b.request(m["content"])
            _add_sections(b, m)
        elif role == "developer":
            b.add(USER)
            b.request(m["content"])
            _add_sections(b, m)
        elif role == "user":
            b.add(USER)
            _add_user_blocks(b, m["blocks"])
        elif role == "latest_reminder":
            b.add(LATEST_REMINDER)
            b.request(m["content"])
        elif role == "assistant":
            prev_task = k > 0 and msgs[k - 1].get("task") is not None
            if thinking and not prev_task and (not drop or k > last_user):
                b.request(m["reasoning"] or "")
                b.add(THINK_END)
            b.request(m["content"])
            if m["tool_calls"]:
                b.add("\n\n")
                _add_tool_calls(
                    b,
                    [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]],
                    f"messages[{m['_index']}].tool_calls",
                )
            if not m.get("wo_eos"):
                b.add(EOS)
        else:  # pragma: no cover - tool messages were merged, roles validated
            raise AssertionError(role)

        # Transition into the next assistant turn.
        next_role = msgs[k + 1]["role"] if k + 1 < n else None
        if next_role is not None and next_role not in ("assistant", "latest_reminder"):
            continue
        task = m.get("task")
        if task is not None:
            if task == "action":
                b.add(ASSISTANT + (THINK_START if thinking else THINK_END))
            b.add(TASK_TOKENS[task])
        elif role in ("user", "developer") or (role == "system" and next_role in (None, "assistant")):
            b.add(ASSISTANT + opener(k))
    return b.build()
