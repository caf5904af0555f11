"""Streaming parser for DeepSeek-V4 completions: reasoning, content and DSML tool calls.

One state machine (reference notes, model-and-formats §10.3) fed with text deltas:

* It starts in REASONING when thinking is on (the prompt already ended in ``<think>``), else in
  CONTENT. ``</think>`` ends reasoning; a stray ``</think>`` in content and a duplicate ``<think>``
  in reasoning are swallowed. In content ``<think>`` is not markup and stays: an answer may talk
  about the tag.
* ``<｜DSML｜tool_calls>`` (also ``<｜DSML｜toolcalls>`` and ``<｜DSML｜tool>``) opens a tool block,
  from content or from inside reasoning (which it ends). A bare ``<｜DSML｜invoke …>`` opens one
  implicitly. Whitespace right before the block (the renderer writes ``\\n\\n``) is not content.
* In the block, ``<｜DSML｜invoke name="…">`` starts a call and ``</｜DSML｜invoke>`` ends it; the
  block's closing tag (or EOS) ends the turn and everything after it is dropped.
* Parameters: ``string="true"`` values are raw text; anything else (also a missing attribute) is
  parsed as JSON, falling back to the raw text. A duplicate parameter name is ignored.
* Arguments stream incrementally: the ``arguments_delta`` pieces of a call concatenate to
  ``json.dumps(args, ensure_ascii=False)``. String values stream as they arrive (JSON-escaped);
  other values are emitted once complete.
* Wrapper unwrapping: arguments that are exactly ``{"arguments": {...}}`` or ``{"input": {...}}``
  become the inner object unless the tool's schema declares that property.
* No DSML markup, and no partial tag, ever reaches content, reasoning or argument text: text that
  could be the start of a tag is held back until it is disambiguated, and released by
  :meth:`DeepseekV4OutputParser.finish` if it turned out not to be a tag (text that already holds
  the ``｜DSML｜`` marker is dropped, and so is a possible closing tag at the end of a value).
* A call cut off by the end of the stream is closed at ``finish()`` with what it has, so its
  arguments are still valid JSON.
* ``<｜end▁of▁sentence｜>`` in the text ends the turn.

``<think>``, ``</think>`` and ``｜DSML｜`` are added tokens that are *not* flagged special in the
shipped tokenizer, so they survive ``skip_special_tokens=True``; EOS does not, which is fine (the
parser treats it only as an optional terminator).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping

THINK_START = "<think>"
THINK_END = "</think>"
EOS = "<｜end▁of▁sentence｜>"
DSML = "｜DSML｜"
DSML_OPEN = "<" + DSML
DSML_CLOSE = "</" + DSML
PARAM_CLOSE = DSML_CLOSE + "parameter>"

BLOCK_NAMES = ("tool_calls", "toolcalls", "tool")
WRAPPER_KEYS = ("arguments", "input")
_WS = " \t\r\n"

_CONTENT_TAG_RE = re.compile(re.escape(THINK_END) + "|" + re.escape(EOS) + "|</?" + re.escape(DSML) + "[^>]*>")
_REASONING_TAG_RE = re.compile(re.escape(THINK_START) + "|" + _CONTENT_TAG_RE.pattern)
_TOOL_TAG_RE = re.compile("</?" + re.escape(DSML) + "[^>]*>|" + re.escape(EOS))
_TAG_PARTS_RE = re.compile("<(/?)" + re.escape(DSML) + r"\s*([A-Za-z_]*)(.*)>\Z", re.S)
_NAME_RE = re.compile(r"""name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")
_STRING_RE = re.compile(r"""string\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")

_CONTENT_STARTERS = (THINK_END, EOS, DSML_OPEN, DSML_CLOSE)
_REASONING_STARTERS = (THINK_START, *_CONTENT_STARTERS)
_TOOL_STARTERS = (DSML_OPEN, DSML_CLOSE, EOS)

REASONING, CONTENT, TOOL_BLOCK, TOOL_INVOKE, TOOL_PARAM, DONE = (
    "reasoning", "content", "tool_block", "tool_invoke", "tool_param", "done",
)


@dataclass
class Delta:
    """One piece of parsed output. Unset fields are ``None``.

    A tool call's first delta carries ``tool_call_index``, ``tool_call_id`` and ``tool_name``;
    later ones carry ``tool_call_index`` and ``arguments_delta``.
    """

    reasoning_content: str | None = None
    content: str | None = None
    tool_call_index: int | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None
    arguments_delta: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def default_tool_call_id(index: int) -> str:  # noqa: ARG001 - index kept for custom factories
    return "call_" + secrets.token_hex(12)


def _attr(regex: re.Pattern[str], text: str) -> str | None:
    m = regex.search(text)
    if not m:
        return None
    return next(g for g in m.groups() if g is not None)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse_nonstring(raw: str) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool_properties(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, set[str] | None]:
    props: dict[str, set[str] | None] = {}
    for spec in tools or ():
        if not isinstance(spec, Mapping):
            continue
        fn = spec.get("function") if isinstance(spec.get("function"), Mapping) else spec
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        params = fn.get("parameters")
        p = params.get("properties") if isinstance(params, Mapping) else None
        props[name] = set(p) if isinstance(p, Mapping) else None
    return props


def _holdback_start(buf: str, starters: tuple[str, ...]) -> int:
    """Index from which ``buf`` must be held: an unfinished DSML tag or a tag prefix at the end."""
    k = len(buf)
    for marker in (DSML_OPEN, DSML_CLOSE):
        j = buf.find(marker)
        if j != -1:
            k = min(k, j)
    longest = max(len(s) for s in starters)
    for p in range(max(0, len(buf) - longest + 1), k):
        if buf[p] == "<":
            tail = buf[p:]
            if any(s.startswith(tail) for s in starters):
                return p
    return k


class _Call:
    __slots__ = (
        "index", "id", "name", "params", "arg_parts", "started", "pending_wrapper",
        "p_open", "p_key", "p_string", "p_raw", "p_skip", "final_args",
    )

    def __init__(self, index: int, call_id: str, name: str):
        self.index = index
        self.id = call_id
        self.name = name
        self.params: dict[str, Any] = {}
        self.arg_parts: list[str] = []
        self.started = False  # "{" emitted
        self.pending_wrapper: tuple[str, Any] | None = None
        self.p_open = False  # a parameter value is being read
        self.p_key: str | None = None
        self.p_string = False
        self.p_raw: list[str] = []
        self.p_skip = False
        self.final_args: dict[str, Any] | None = None

    @property
    def arguments(self) -> str:
        return "".join(self.arg_parts)


class DeepseekV4OutputParser:
    """Incremental parser: ``feed(text_delta) -> list[Delta]``, then ``finish() -> list[Delta]``."""

    def __init__(
        self,
        thinking: bool = True,
        tools: list | None = None,
        *,
        id_factory: Callable[[int], str] | None = None,
    ):
        self.thinking = thinking
        self._props = _tool_properties(tools)
        self._id_factory = id_factory or default_tool_call_id
        self.state = REASONING if thinking else CONTENT
        self._buf = ""
        self._ws = ""  # trailing whitespace of reasoning/content not yet released
        self._out: list[Delta] = []
        self.calls: list[_Call] = []
        self._call: _Call | None = None
        self.finished = False

    # -- public -----------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        if self.finished:
            raise RuntimeError("feed() after finish()")
        if not text or self.state == DONE:
            return []
        self._buf += text
        self._out = []
        self._run()
        return self._take()

    def finish(self) -> list[Delta]:
        if self.finished:
            return []
        self._out = []
        self._run()
        self._finalize()
        self.finished = True
        return self._take()

    # -- output helpers ---------------------------------------------------------------------------
    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _push(self, delta: Delta) -> None:
        last = self._out[-1] if self._out else None
        if last is not None:
            if delta.content is not None and last.content is not None and _only(last, "content"):
                if _only(delta, "content"):
                    last.content += delta.content
                    return
            if (
                delta.reasoning_content is not None
                and last.reasoning_content is not None
                and _only(last, "reasoning_content")
                and _only(delta, "reasoning_content")
            ):
                last.reasoning_content += delta.reasoning_content
                return
            if (
                delta.arguments_delta is not None
                and _only(delta, "arguments_delta", "tool_call_index")
                and _only(last, "arguments_delta", "tool_call_index")
                and last.arguments_delta is not None
                and last.tool_call_index == delta.tool_call_index
            ):
                last.arguments_delta += delta.arguments_delta
                return
        self._out.append(delta)

    def _emit_text(self, text: str) -> None:
        """Send text to the current channel, keeping trailing whitespace pending."""
        if not text:
            return
        combined = self._ws + text
        body = combined.rstrip(_WS)
        self._ws = combined[len(body):]
        if body:
            self._send(body)

    def _flush_ws(self) -> None:
        if self._ws:
            ws, self._ws = self._ws, ""
            self._send(ws)

    def _send(self, text: str) -> None:
        if self.state == REASONING:
            self._push(Delta(reasoning_content=text))
        else:
            self._push(Delta(content=text))

    def _args(self, call: _Call, text: str) -> None:
        call.arg_parts.append(text)
        self._push(Delta(tool_call_index=call.index, arguments_delta=text))

    # -- main loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._buf and self.state != DONE:
            if self.state in (REASONING, CONTENT):
                progressed = self._step_text()
            elif self.state == TOOL_PARAM:
                progressed = self._step_param()
            else:
                progressed = self._step_tool()
            if not progressed:
                break
        if self.state == DONE:
            self._buf = ""

    def _step_text(self) -> bool:
        buf = self._buf
        reasoning = self.state == REASONING
        m = (_REASONING_TAG_RE if reasoning else _CONTENT_TAG_RE).search(buf)
        if m is None:
            k = _holdback_start(buf, _REASONING_STARTERS if reasoning else _CONTENT_STARTERS)
            self._emit_text(buf[:k])
            self._buf = buf[k:]
            return False
        self._emit_text(buf[: m.start()])
        self._buf = buf[m.end():]
        tag = m.group(0)
        if tag == THINK_START:
            return True  # duplicate <think> while reasoning: swallowed
        if tag == THINK_END:
            if self.state == REASONING:
                self._flush_ws()
                self.state = CONTENT
            return True  # in content: stray </think>, swallowed
        if tag == EOS:
            self._flush_ws()
            self.state = DONE
            return True
        closing, name, _rest = _tag_parts(tag)
        if not closing and name in BLOCK_NAMES:
            self._ws = ""  # the blank line before the block is not content
            self.state = TOOL_BLOCK
        elif not closing and name == "invoke":
            self._ws = ""
            self.state = TOOL_BLOCK
            self._buf = tag + self._buf  # let the block state start the call
        # any other DSML tag in text is stray markup: swallowed
        return True

    def _step_tool(self) -> bool:
        buf = self._buf
        m = _TOOL_TAG_RE.search(buf)
        if m is None:
            self._buf = buf[_holdback_start(buf, _TOOL_STARTERS):]  # text between tags: dropped
            return False
        self._buf = buf[m.end():]
        tag = m.group(0)
        if tag == EOS:
            self._end_call()
            self.state = DONE
            return True
        closing, name, rest = _tag_parts(tag)
        if self.state == TOOL_BLOCK:
            if not closing and name == "invoke":
                self._start_call(rest)
            elif closing and name in BLOCK_NAMES:
                self.state = DONE
            return True
        # TOOL_INVOKE
        if not closing and name == "parameter":
            self._start_param(rest)
        elif closing and name == "invoke":
            self._end_call()
            self.state = TOOL_BLOCK
        elif closing and name in BLOCK_NAMES:
            self._end_call()
            self.state = DONE
        elif not closing and name == "invoke":  # missing </invoke>: next call begins
            self._end_call()
            self.state = TOOL_BLOCK
            self._buf = tag + self._buf
        return True

    def _step_param(self) -> bool:
        buf = self._buf
        positions = [p for p in (buf.find(DSML_OPEN), buf.find(DSML_CLOSE), buf.find(EOS)) if p != -1]
        if not positions:
            k = _holdback_start(buf, _TOOL_STARTERS)
            self._param_text(buf[:k])
            self._buf = buf[k:]
            return False
        p = min(positions)
        self._param_text(buf[:p])
        rest = buf[p:]
        if rest.startswith(PARAM_CLOSE):
            self._buf = rest[len(PARAM_CLOSE):]
            self._end_param()
            self.state = TOOL_INVOKE
            return True
        if PARAM_CLOSE.startswith(rest):
            self._buf = rest  # an unfinished closing tag: wait for more
            return False
        # any other tag (or EOS) closes the value implicitly; the invoke state handles it
        self._buf = rest
        self._end_param()
        self.state = TOOL_INVOKE
        return True

    def _finalize(self) -> None:
        tail, self._buf = self._buf, ""
        if self.state in (REASONING, CONTENT):
            if DSML in tail:
                self._ws = ""  # an unfinished DSML tag: it and the blank line before it go
            else:
                self._emit_text(tail)
            self._flush_ws()
        elif self.state == TOOL_PARAM:
            # What is held here is the start of a closing tag of a truncated call: dropped.
            self._end_param()
            self._end_call()
        elif self.state == TOOL_INVOKE:
            self._end_call()
        self.state = DONE

    # -- tool calls -------------------------------------------------------------------------------
    def _start_call(self, attrs: str) -> None:
        index = len(self.calls)
        call = _Call(index, self._id_factory(index), _attr(_NAME_RE, attrs) or "")
        self.calls.append(call)
        self._call = call
        self.state = TOOL_INVOKE
        self._push(Delta(tool_call_index=index, tool_call_id=call.id, tool_name=call.name))

    def _key_prefix(self, call: _Call, key: str) -> str:
        sep = ", " if call.started else "{"
        call.started = True
        return sep + _dumps(key) + ": "

    def _flush_wrapper(self, call: _Call) -> None:
        if call.pending_wrapper is not None:
            key, value = call.pending_wrapper
            call.pending_wrapper = None
            call.params[key] = value
            self._args(call, self._key_prefix(call, key) + _dumps(value))

    def _start_param(self, attrs: str) -> None:
        call = self._call
        self.state = TOOL_PARAM
        if call is None:  # pragma: no cover - TOOL_INVOKE always has a call
            return
        key = _attr(_NAME_RE, attrs)
        string_attr = _attr(_STRING_RE, attrs)
        call.p_open = True
        call.p_key = key
        call.p_string = string_attr is not None and string_attr.lower() == "true"
        call.p_raw = []
        dup = key in call.params or (call.pending_wrapper is not None and call.pending_wrapper[0] == key)
        call.p_skip = key is None or dup
        if call.p_skip:
            return
        self._flush_wrapper(call)
        if call.p_string:
            self._args(call, self._key_prefix(call, key) + '"')

    def _param_text(self, text: str) -> None:
        call = self._call
        if not text or call is None or call.p_skip:
            return
        call.p_raw.append(text)
        if call.p_string:
            self._args(call, _dumps(text)[1:-1])

    def _end_param(self) -> None:
        call = self._call
        if call is None or not call.p_open:
            return
        key, raw = call.p_key, "".join(call.p_raw)
        skip = call.p_skip
        call.p_open, call.p_key, call.p_raw, call.p_skip = False, None, [], False
        if skip or key is None:
            return
        if call.p_string:
            call.params[key] = raw
            self._args(call, '"')
            return
        value = _parse_nonstring(raw)
        props = self._props.get(call.name)
        if (
            not call.started
            and key in WRAPPER_KEYS
            and isinstance(value, dict)
            and (props is None or key not in props)
        ):
            call.pending_wrapper = (key, value)  # decided when the next parameter or the end comes
            return
        call.params[key] = value
        self._args(call, self._key_prefix(call, key) + _dumps(value))

    def _end_call(self) -> None:
        call = self._call
        if call is None:
            return
        self._end_param()  # a value cut off by the end of the call
        if call.pending_wrapper is not None and not call.started:
            _key, value = call.pending_wrapper
            call.pending_wrapper = None
            call.final_args = dict(value)
            call.started = True
            self._args(call, _dumps(value))
        else:
            self._flush_wrapper(call)
            call.final_args = dict(call.params)
            self._args(call, "}" if call.started else "{}")
        self._call = None


def _only(delta: Delta, *names: str) -> bool:
    return all((getattr(delta, f.name) is None) == (f.name not in names) for f in fields(delta))


def _tag_parts(tag: str) -> tuple[bool, str, str]:
    m = _TAG_PARTS_RE.match(tag)
    if m is None:  # pragma: no cover - regexes agree
        return False, "", ""
    return m.group(1) == "/", m.group(2), m.group(3)


def accumulate(deltas: Iterable[Delta]) -> dict[str, Any]:
    """Fold deltas into ``{"content", "reasoning_content", "tool_calls"}`` (raw strings, ids)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.content is not None:
            content.append(d.content)
        if d.reasoning_content is not None:
            reasoning.append(d.reasoning_content)
        if d.tool_call_index is not None:
            c = calls.setdefault(d.tool_call_index, {"id": None, "name": None, "arguments": []})
            if d.tool_call_id is not None:
                c["id"] = d.tool_call_id
            if d.tool_name is not None:
                c["name"] = d.tool_name
            if d.arguments_delta is not None:
                c["arguments"].append(d.arguments_delta)
    tool_calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": "".join(c["arguments"])},
        }
        for _, c in sorted(calls.items())
    ]
    return {"content": "".join(content), "reasoning_content": "".join(reasoning), "tool_calls": tool_calls}


def parse_completion(
    text: str,
    thinking: bool = True,
    tools: list | None = None,
    *,
    id_factory: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """Parse a whole completion into an OpenAI assistant message (via the streaming parser).

    Returns ``{"role": "assistant", "content", "reasoning_content", "tool_calls"}``: ``content``
    is ``None`` when it is empty and there are tool calls; ``reasoning_content`` is ``None`` when
    empty; ``tool_calls`` is a (possibly empty) list of
    ``{"id": "call_…", "type": "function", "function": {"name", "arguments": json}}``.
    """
    parser = DeepseekV4OutputParser(thinking, tools, id_factory=id_factory)
    agg = accumulate([*parser.feed(text), *parser.finish()])
    content = agg["content"]
    return {
        "role": "assistant",
        "content": None if (not content and agg["tool_calls"]) else content,
        "reasoning_content": agg["reasoning_content"] or None,
        "tool_calls": agg["tool_calls"],
    }
