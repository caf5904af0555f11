"""The request fields that constrain the output, as one engine constraint (dsv4.engine.structured).

A request may constrain its output by one of: OpenAI's ``response_format`` (``json_object`` /
``json_schema``), vLLM's ``structured_outputs`` {json, regex, choice, grammar, json_object}, vLLM's
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and (chat) a
``tool_choice`` of "required" or a named function, which is the grammar of the DSML tool-call block
(:func:`dsv4.chat.tool_call_grammar`). Two of them are a 400 naming both; so is a constraint that
does not compile (an invalid schema, regex or grammar), naming its field, before the request reaches
the engine. ``logit_bias`` (token-id strings → bias) is checked here too: ids are the vocabulary's.

A chat prompt in thinking mode ends in ``<think>``: the constrained output then starts with the
``</think>`` that closes the (empty) reasoning, so that the parser reads what follows as the answer.
"""

from __future__ import annotations

import json
import re

from ..chat import THINK_END, tool_call_grammar
from ..engine.structured import KINDS, StructuredOutputsParams
from .errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_TOKEN_ID = re.compile(r"-?[0-9]+")


def _constraints(req) -> list[tuple[str, dict]]:
    """(request field, StructuredOutputsParams arguments) of every output constraint the request sets."""
    found = []
    rf = req.response_format
    if rf is not None and rf["type"] == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or js.get("schema") is None:
            raise bad_request("response_format.json_schema.schema: a json_schema response format needs a schema",
                              param="response_format.json_schema.schema")
        found.append(("response_format.json_schema.schema", {"json": js["schema"]}))
    so = req.structured_outputs
    if so is not None:
        given = [(f"structured_outputs.{k}", {k: v}) for k in KINDS if (v := getattr(so, k)) not in (None, False)]
        if not given:
            raise bad_request(f"structured_outputs: one of {', '.join(KINDS)} must be given",
                              param="structured_outputs")
        found += given
    found += [(name, {kind: getattr(req, name)}) for name, kind in GUIDED.items() if getattr(req, name) is not None]
    return found


def _tool_grammar(req) -> str | None:
    """The tool-call grammar a chat request's tool_choice enforces, or None ("auto", "none")."""
    choice = getattr(req, "tool_choice", None)
    if choice is None or isinstance(choice, str) and choice in ("auto", "none"):
        return None
    specs = [t.model_dump(exclude_none=True) for t in req.tools or []]
    names = [t["function"]["name"] for t in specs]
    if choice == "required":
        if not specs:
            raise bad_request("tool_choice: 'required' needs a non-empty tools list", param="tool_choice")
        return tool_call_grammar(specs, parallel=req.parallel_tool_calls is not False)
    if choice.function.name not in names:
        raise bad_request(f"tool_choice: function {choice.function.name!r} is not among the request's tools "
                          f"({', '.join(names) or 'none given'})", param="tool_choice")
    return tool_call_grammar(specs, name=choice.function.name)


def _compiled(field: str, kwargs: dict) -> StructuredOutputsParams:
    """The constraint, checked by the grammar engine; a 400 naming ``field`` if it does not compile."""
    kind = next(iter(kwargs))
    try:
        so = StructuredOutputsParams(**kwargs, source=field)
        text = so.grammar_text()
    except ValueError as e:  # (the engine names "<source>.<kind>"; here the field is the request's)
        raise bad_request(str(e).replace(f"{field}.{kind}", field, 1), param=field) from None
    from llguidance import LLMatcher  # (grammar_text imported it)

    error = LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise bad_request(f"{field}: invalid {kind}: {error}", param=field)
    return so


def _after_reasoning(so: StructuredOutputsParams) -> StructuredOutputsParams:
    """``so`` preceded by ``</think>`` (as a token: it is one of the vocabulary's control tokens)."""
    text = so.grammar_text()
    inner = json.loads(text)["grammars"][0] if text.lstrip().startswith("{") else {"lark_grammar": text}
    top = {"grammars": [{"lark_grammar": f"start: {THINK_END} @answer"}, {**inner, "name": "answer"}]}
    return StructuredOutputsParams(grammar=json.dumps(top, ensure_ascii=False), source=so.source)


def output_constraint(req, *, thinking: bool = False) -> StructuredOutputsParams | None:
    """The request's output constraint (None if it has none); ``thinking``: a chat prompt that ends in
    ``<think>``."""
    found = _constraints(req)
    tools = _tool_grammar(req)
    if tools is not None:
        found.append(("tool_choice", {"grammar": tools}))
    if len(found) > 1:
        names = [f for f, _ in found]
        raise bad_request(f"{', '.join(names)}: only one output constraint may be given per request",
                          param=names[0])
    if not found:
        return None
    so = _compiled(*found[0])
    return _after_reasoning(so) if thinking else so


def token_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """``logit_bias`` with its keys as token ids; a key that is not the id of a vocabulary token is a 400."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key.strip()):
            raise bad_request(f"logit_bias: key {key!r} is not a token id", param="logit_bias")
        tid = int(key)
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        out[tid] = value
    return out
