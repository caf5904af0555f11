"""Chat layer of dsv4: tokenizer, prompt rendering and output parsing for DeepSeek-V4.

Importing this package is cheap: no torch, no server framework; the ``tokenizers`` library is
imported only when a tokenizer is loaded.

* :func:`load_tokenizer` / :class:`Tokenizer` / :class:`IncrementalDetokenizer`
* :func:`render_messages` renders OpenAI-style messages into a :class:`RenderedPrompt` (the text,
  with what came from the request marked) and :meth:`Tokenizer.encode_prompt` turns it into ids
  in which request text never becomes a control token; :func:`encode_messages` gives just the
  text. :func:`map_reasoning_effort` and :func:`effort_version_for_config` pick their arguments.
* :class:`DeepseekV4OutputParser` splits streamed output into reasoning, content and tool calls;
  :func:`parse_completion` does the same for a whole completion.
* :func:`tool_call_grammar`: the grammar (llguidance Lark) of a DSML tool-call block, which enforces
  ``tool_choice`` "required" or a named function.
"""

from .encoding import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    LATEST_REMINDER,
    THINK_END,
    THINK_START,
    USER,
    RenderedPrompt,
    effort_preamble,
    effort_version_for_config,
    encode_messages,
    map_reasoning_effort,
    render_messages,
    render_tool_calls,
    render_tools,
)
from .parser import DeepseekV4OutputParser, Delta, accumulate, parse_completion
from .tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer, tokenizer_json_path
from .tool_grammar import tool_call_grammar

__all__ = [
    "ASSISTANT",
    "BOS",
    "DSML",
    "EOS",
    "LATEST_REMINDER",
    "THINK_END",
    "THINK_START",
    "USER",
    "Delta",
    "DeepseekV4OutputParser",
    "IncrementalDetokenizer",
    "RenderedPrompt",
    "Tokenizer",
    "accumulate",
    "effort_preamble",
    "effort_version_for_config",
    "encode_messages",
    "load_tokenizer",
    "map_reasoning_effort",
    "parse_completion",
    "render_messages",
    "render_tool_calls",
    "render_tools",
    "tokenizer_json_path",
    "tool_call_grammar",
]
