"""A grammar (llguidance's Lark dialect) that allows exactly the DSML tool-call block of DeepSeek-V4.

What ``tool_choice: "required"`` and a named tool choice are enforced with: the output is the block
the encoder renders for an assistant's tool calls (:func:`dsv4.chat.render_tool_calls`, after the
blank line it writes before it) and the parser reads back (:class:`dsv4.chat.DeepseekV4OutputParser`),
each call's parameters constrained by its tool's JSON schema:

* one ``<｜DSML｜parameter …>`` per schema property, in the schema's order, the required ones always
  and the others optionally; a string property is written raw (``string="true"``, as the encoder
  writes strings and the model was taught) when its schema says no more than its length or its
  values (``enum``), and holds anything but a DSML tag (or the EOS text); every other value is JSON (``string="false"``,
  ``%json`` of the property's schema, with the top level's ``$defs`` / ``definitions`` so that
  references resolve);
* a schema that is not a plain object of properties (``anyOf`` at the top, ``patternProperties``, a
  required name without a property …) is one JSON parameter ``arguments`` (``input`` if the schema
  declares ``arguments``) holding the whole object, which the parser unwraps into the call's arguments;
* the function name is a string literal of the grammar: plain text, never a token reference.

The grammar itself starts at the blank line; in thinking mode the caller puts the ``</think>`` that
closes the (empty) reasoning before it. Pure text building: no llguidance import here.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from .encoding import DSML, EOS
from .parser import WRAPPER_KEYS

# JSON values written as the encoder writes them (json.dumps' separators, no other whitespace)
JSON_AS_RENDERED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# what a schema may hold at its top level and still be written one parameter per property
_PLAIN_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema",
                      "$id", "$comment", "$defs", "definitions", "examples", "default", "strict"}
_ANNOTATIONS = {"description", "title", "examples", "default", "$comment"}
PARAM_END = f"</{DSML}parameter>"
# text without a DSML tag or the EOS text in it (the parser would end the value there)
_NO_TAG = f"~/(?s:.*)(<\\/?{DSML}|{EOS})(?s:.*)/"


def _lit(text: str) -> str:
    """A Lark string literal of ``text`` (JSON's escapes are the dialect's)."""
    return json.dumps(text, ensure_ascii=False)


def _json(schema: Any, json_options: Mapping[str, Any]) -> str:
    """``%json {schema}`` written as the server writes JSON outputs (``json_options``: llguidance's
    x-guidance compile options)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return "%json " + json.dumps({**schema, "x-guidance": dict(json_options)}, ensure_ascii=False)


def _raw_string(schema: Any) -> str | None:
    """The terminal of a raw string value and its closing tag (one lexeme, so that where the value ends
    is never ambiguous), or None when the schema constrains the string more than raw text can say."""
    if not isinstance(schema, Mapping) or schema.get("type", "string") != "string":
        return None
    enum = schema.get("enum")
    if enum is not None and set(schema) <= _ANNOTATIONS | {"type", "enum"} and enum \
            and all(isinstance(v, str) and DSML not in v for v in enum):
        return "(" + " | ".join(_lit(v) for v in enum) + ") " + _lit(PARAM_END)
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    if "type" not in schema or not set(schema) <= _ANNOTATIONS | {"type", "minLength", "maxLength"} \
            or not isinstance(lo, int) or not isinstance(hi, (int, type(None))):
        return None
    return f'(/(?s:.{{{lo},{"" if hi is None else hi}}})/ & {_NO_TAG}) {_lit(PARAM_END)}'


def _is_plain_object(schema: Mapping[str, Any]) -> bool:
    props = schema.get("properties", {})
    required = schema.get("required", [])
    return (set(schema) <= _PLAIN_OBJECT_KEYS and schema.get("type", "object") == "object"
            and isinstance(props, Mapping) and all(isinstance(p, (Mapping, bool)) for p in props.values())
            and isinstance(required, list) and all(r in props for r in required))


def _param(key: str, string: bool, value: str) -> str:
    opening = "\n<" + DSML + f'parameter name="{key}" string="{"true" if string else "false"}">'
    return _lit(opening) + " " + value


def _invoke_rules(i: int, name: str, schema: Any, json_options: Mapping[str, Any]) -> list[str]:
    """The rule ``call_<i>`` of one call of function ``name`` and the terminals of its raw values."""
    schema = schema if isinstance(schema, Mapping) else {"type": "object", "properties": {}}
    parts, terminals, required = [], [], None
    if _is_plain_object(schema):
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        required = set(schema.get("required", []))
        for j, (key, sub) in enumerate(schema.get("properties", {}).items()):
            raw = _raw_string(sub)
            if raw is not None:
                terminals.append(f"RAW_{i}_{j}: {raw}")
                item = _param(key, True, f"RAW_{i}_{j}")
            else:
                sub = {**sub, **defs} if isinstance(sub, Mapping) else sub
                item = _param(key, False, f"{_json(sub, json_options)} {_lit(PARAM_END)}")
            parts.append(f"({item})" + ("" if key in required else "?"))
    else:  # the parser unwraps a lone wrapper parameter that the schema does not declare
        props = schema.get("properties")
        wrapper = next((k for k in WRAPPER_KEYS if not isinstance(props, Mapping) or k not in props), WRAPPER_KEYS[0])
        parts.append(_param(wrapper, False, f"{_json(schema, json_options)} {_lit(PARAM_END)}"))
    head = _lit(f'<{DSML}invoke name="{name}">')
    # the encoder writes a call without parameters with a blank line inside; each call ends with the
    # newline before the next call or the block's end, so that no literal of the grammar is a prefix
    # of the one that may follow it (llguidance's lexer is greedy)
    blank = ' "\\n"?' if required is not None and not required else ""
    return [f'call_{i}: {head} {" ".join(parts)}{blank} "\\n</{DSML}invoke>\\n"', *terminals]


def tool_call_grammar(tools: list[Mapping[str, Any]], *, name: str | None = None, parallel: bool = True,
                      json_options: Mapping[str, Any] | None = None) -> str:
    """The Lark grammar of a tool-call block: calls of any of ``tools`` (OpenAI tool specs), or of the
    one called ``name``; several calls when ``parallel``, else exactly one."""
    fns = [t.get("function", t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
    opts = json_options if json_options is not None else JSON_AS_RENDERED
    calls = "call+" if parallel and name is None else "call"
    return "\n".join([
        f'start: "\\n\\n<{DSML}tool_calls>\\n" {calls} "</{DSML}tool_calls>"',
        "call: " + " | ".join(f"call_{i}" for i in range(len(fns))),
        *(line for i, f in enumerate(fns) for line in _invoke_rules(i, f["name"], f.get("parameters"), opts)),
    ])
