"""Chat layer of dsv4: tokenizer, prompt rendering and output parsing for DeepSeek-V4.

Importing this package is cheap: no torch, no server framework; the ``tokenizers`` library is
imported only when a tokenizer is loaded.

* :func:`load_tokenizer` / :class:`Tokenizer` / :class:`IncrementalDetokenizer`
* :func:`encode_messages` renders OpenAI-style messages into the prompt text;
  :func:`map_reasoning_effort` and :func:`effort_version_for_config` pick its arguments.
* :class:`DeepseekV4OutputParser` splits streamed output into reasoning, content and tool calls;
  :func:`parse_completion` does the same for a whole completion.
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
    effort_preamble,
    effort_version_for_config,
    encode_messages,
    map_reasoning_effort,
    render_tool_calls,
    render_tools,
)
from .parser import DeepseekV4OutputParser, Delta, accumulate, parse_completion
from .tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer, tokenizer_json_path

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
    "Tokenizer",
    "accumulate",
    "effort_preamble",
    "effort_version_for_config",
    "encode_messages",
    "load_tokenizer",
    "map_reasoning_effort",
    "parse_completion",
    "render_tool_calls",
    "render_tools",
    "tokenizer_json_path",
]
