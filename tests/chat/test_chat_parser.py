"""Streaming output parser (reference notes model-and-formats §10.3, release-and-anchors §5
rows 10-12 and 20: DSML leaking into content, fake-streamed arguments, `</｜DSML｜parameter`
leaking into arguments)."""

import json
import random

import pytest

from dsv4.chat import encode_messages
from dsv4.chat.parser import DeepseekV4OutputParser, Delta, accumulate, parse_completion

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "parameters": {"type": "object", "properties": {"input": {"type": "object"}}},
        },
    },
]


def ids(i):
    return f"call_{i}"


def block(*invokes, name="tool_calls"):
    return f"<{D}{name}>\n" + "\n".join(invokes) + f"\n</{D}{name}>"


def invoke(fn, *params):
    return f'<{D}invoke name="{fn}">\n' + "\n".join(params) + f"\n</{D}invoke>"


def param(key, value, string="true"):
    attr = "" if string is None else f' string="{string}"'
    return f'<{D}parameter name="{key}"{attr}>{value}</{D}parameter>'


def run_chunks(text, chunks, thinking=True, tools=TOOLS):
    parser = DeepseekV4OutputParser(thinking, tools, id_factory=ids)
    deltas = []
    pos = 0
    for n in chunks:
        deltas += parser.feed(text[pos : pos + n])
        pos += n
    assert pos == len(text)
    deltas += parser.finish()
    return deltas


def per_char(text, thinking=True, tools=TOOLS):
    return run_chunks(text, [1] * len(text), thinking, tools)


def whole(text, thinking=True, tools=TOOLS):
    return accumulate(run_chunks(text, [len(text)], thinking, tools))


def assert_no_markup(deltas, extra=()):
    for d in deltas:
        for field in ("content", "reasoning_content", "arguments_delta"):
            v = getattr(d, field)
            if v is not None:
                for bad in (D, "｜DSML", "</｜", "<｜", *extra):
                    assert bad not in v, (field, v)


COMPLEX = (
    "The user wants weather. Compare 1 < 2 and a<b.\n\n"
    + "</think>Let me check both cities.\n\n"
    + block(
        invoke(
            "get_weather",
            param("city", '北京 "quoted" back\\slash\nnewline <tag> &amp; 😀'),
            param("days", "3", "false"),
            param("extra", '{"a": [1, 2, {"b": null}], "c": "ü"}', "false"),
        ),
        invoke("get_weather", param("city", "Paris"), param("days", "not json", "false")),
    )
    + EOS
    + "garbage after the end"
)
COMPLEX_EXPECTED = {
    "reasoning_content": "The user wants weather. Compare 1 < 2 and a<b.\n\n",
    "content": "Let me check both cities.",
    "tool_calls": [
        {
            "id": "call_0",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps(
                    {
                        "city": '北京 "quoted" back\\slash\nnewline <tag> &amp; 😀',
                        "days": 3,
                        "extra": {"a": [1, 2, {"b": None}], "c": "ü"},
                    },
                    ensure_ascii=False,
                ),
            },
        },
        {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": "Paris", "days": "not json"}),
            },
        },
    ],
}


def test_complex_whole():
    assert whole(COMPLEX) == COMPLEX_EXPECTED


def test_every_split_point_gives_same_result():
    for i in range(len(COMPLEX) + 1):
        got = accumulate(run_chunks(COMPLEX, [i, len(COMPLEX) - i]))
        assert got == COMPLEX_EXPECTED, i


def test_per_char_and_random_chunkings():
    deltas = per_char(COMPLEX)
    assert accumulate(deltas) == COMPLEX_EXPECTED
    assert_no_markup(deltas)
    rng = random.Random(1234)
    for _ in range(200):
        chunks, left = [], len(COMPLEX)
        while left:
            n = min(left, rng.randint(1, 12))
            chunks.append(n)
            left -= n
        deltas = run_chunks(COMPLEX, chunks)
        assert accumulate(deltas) == COMPLEX_EXPECTED
        assert_no_markup(deltas)


def test_arguments_stream_incrementally_and_form_valid_json():
    text = "r</think>" + block(invoke("get_weather", param("city", "abcdefghij"), param("days", "7", "false")))
    parser = DeepseekV4OutputParser(True, TOOLS, id_factory=ids)
    cut = text.index("abcdefghij") + 5  # in the middle of the string value
    early = parser.feed(text[:cut])
    args_so_far = "".join(d.arguments_delta for d in early if d.arguments_delta)
    assert args_so_far == '{"city": "abcde'  # not fake-streamed: arrives before </parameter>
    start = [d for d in early if d.tool_name is not None]
    assert start == [Delta(tool_call_index=0, tool_call_id="call_0", tool_name="get_weather")]
    rest = parser.feed(text[cut:]) + parser.finish()
    args = args_so_far + "".join(d.arguments_delta for d in rest if d.arguments_delta)
    assert json.loads(args) == {"city": "abcdefghij", "days": 7}
    assert args == json.dumps({"city": "abcdefghij", "days": 7})


def test_parameter_close_tag_never_leaks_into_arguments():
    text = "thinking</think>" + block(invoke("get_weather", param("city", "Lyon<"), param("days", "2", "false")))
    deltas = per_char(text)
    args = "".join(d.arguments_delta for d in deltas if d.arguments_delta)
    assert "parameter" not in args and D not in args
    assert json.loads(args) == {"city": "Lyon<", "days": 2}


def test_reasoning_content_split():
    assert whole("I think.</think>Answer.") == {
        "reasoning_content": "I think.",
        "content": "Answer.",
        "tool_calls": [],
    }


def test_non_thinking_starts_in_content():
    assert whole("Just an answer.", thinking=False)["content"] == "Just an answer."
    assert whole("Just an answer.", thinking=False)["reasoning_content"] == ""


def test_unterminated_reasoning_stays_reasoning():
    assert whole("still thinking")["reasoning_content"] == "still thinking"


def test_stray_and_duplicate_think_tags_swallowed():
    got = whole("<think>a<think>b</think>c</think>d</think>")
    assert got["reasoning_content"] == "ab"
    assert got["content"] == "cd"
    # In content <think> is not markup (only a stray </think> is swallowed there).
    got = whole("<think>x</think>y", thinking=False)
    assert got["content"] == "<think>xy"


@pytest.mark.parametrize(
    "text,thinking,reasoning,content",
    [
        ("r</think>Use <think> tags?", True, "r", "Use <think> tags?"),
        ("Use <think> tags?", False, "", "Use <think> tags?"),
        ("r</think><think>", True, "r", "<think>"),
        ("r</think>a <think>b</think> c", True, "r", "a <think>b c"),
        ("<think>r<think></think>x<think>y<think", True, "r", "x<think>y<think"),
        ("A <think> then a tool\n\n" + block(invoke("get_weather", param("city", "Oslo"))), False, "",
         "A <think> then a tool"),
    ],
)
def test_literal_think_in_content_is_kept(text, thinking, reasoning, content):
    """Only the structural markers are consumed: ``</think>`` and, while reasoning, a duplicate
    ``<think>`` (reference §10.3). Char-by-char streaming gives what the whole text gives."""
    for deltas in (per_char(text, thinking), run_chunks(text, [len(text)], thinking)):
        got = accumulate(deltas)
        assert (got["reasoning_content"], got["content"]) == (reasoning, content)
    assert parse_completion(text, thinking)["content"] == content


def test_partial_tags_held_then_released_at_finish():
    for tail in ("<｜DS", "</thi", "<", "<｜end▁of", "</"):
        text = "answer " + tail
        parser = DeepseekV4OutputParser(False, None)
        streamed = "".join(d.content or "" for d in parser.feed(text))
        assert streamed == "answer", tail  # trailing space and the tag prefix are held
        assert "".join(d.content or "" for d in parser.finish()) == " " + tail
    # A <think> prefix is a possible tag only while reasoning; in content it streams at once.
    parser = DeepseekV4OutputParser(True, None)
    assert "".join(d.reasoning_content or "" for d in parser.feed("thought <think")) == "thought"
    assert "".join(d.reasoning_content or "" for d in parser.finish()) == " <think"
    parser = DeepseekV4OutputParser(False, None)
    assert "".join(d.content or "" for d in parser.feed("answer <think")) == "answer <think"


def test_unfinished_dsml_tag_dropped_at_finish():
    assert whole("ok\n\n<｜DSML｜tool_ca", thinking=False) == {
        "content": "ok",
        "reasoning_content": "",
        "tool_calls": [],
    }


def test_tool_block_inside_reasoning_ends_reasoning():
    text = "need a tool\n\n" + block(invoke("get_weather", param("city", "Oslo")))
    got = whole(text)
    assert got["reasoning_content"] == "need a tool"
    assert got["content"] == ""
    assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("name", ["tool_calls", "toolcalls", "tool"])
def test_block_name_variants(name):
    text = "pre " + block(invoke("get_weather", param("city", "Rome")), name=name) + " post"
    got = whole(text, thinking=False)
    assert got["content"] == "pre"
    assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather"]


def test_bare_invoke_opens_block_implicitly():
    text = "x" + invoke("get_weather", param("city", "Oslo"))
    got = whole(text, thinking=False)
    assert got["content"] == "x"
    assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_text_after_block_dropped_and_eos_ends():
    text = block(invoke("get_weather")) + "\nmore text <think>"
    got = whole(text, thinking=False)
    assert got["content"] == ""
    assert got["tool_calls"][0]["function"]["arguments"] == "{}"
    assert whole("a" + EOS + "b", thinking=False)["content"] == "a"


def test_missing_string_attribute_is_non_string():
    text = block(invoke("get_weather", param("days", "5", None), param("city", "Nice", None)))
    args = json.loads(whole(text, thinking=False)["tool_calls"][0]["function"]["arguments"])
    assert args == {"days": 5, "city": "Nice"}  # JSON first, raw text as the fallback


def test_duplicate_parameter_ignored():
    text = block(invoke("get_weather", param("city", "A"), param("city", "B")))
    args = whole(text, thinking=False)["tool_calls"][0]["function"]["arguments"]
    assert args == '{"city": "A"}'


def test_wrapper_unwrapped_when_schema_lacks_it():
    text = block(invoke("get_weather", param("arguments", '{"city": "Oslo", "days": 2}', "false")))
    args = whole(text, thinking=False)["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"city": "Oslo", "days": 2}
    # Unknown tool / no tools: unwrapped too.
    text2 = block(invoke("other", param("input", '{"q": 1}', "false")))
    assert json.loads(whole(text2, thinking=False, tools=None)["tool_calls"][0]["function"]["arguments"]) == {"q": 1}


def test_wrapper_kept_when_schema_declares_it_or_more_params():
    text = block(invoke("run", param("input", '{"q": 1}', "false")))
    args = whole(text, thinking=False)["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"input": {"q": 1}}
    text = block(invoke("get_weather", param("arguments", '{"q": 1}', "false"), param("city", "X")))
    for deltas in (per_char(text, thinking=False), run_chunks(text, [len(text)], thinking=False)):
        args = accumulate(deltas)["tool_calls"][0]["function"]["arguments"]
        assert args == json.dumps({"arguments": {"q": 1}, "city": "X"})


def test_truncated_mid_parameter_still_valid_json():
    text = ("r</think>" + f"<{D}tool_calls>\n" + f'<{D}invoke name="get_weather">\n'
            + f'<{D}parameter name="city" string="true">Ber')
    for extra in ("", "</", "</｜DSML｜para"):
        deltas = per_char(text + extra)
        assert_no_markup(deltas)
        args = accumulate(deltas)["tool_calls"][0]["function"]["arguments"]
        assert json.loads(args) == {"city": "Ber"}


def test_truncated_after_invoke_tag():
    text = block(invoke("get_weather", param("days", "4", "false")))
    text = text[: text.index(f"</{D}invoke>")]
    args = whole(text, thinking=False)["tool_calls"][0]["function"]["arguments"]
    assert args == '{"days": 4}'


def test_no_dsml_fragment_in_content_for_streaming_tool_mode():
    # vLLM #40801 shape: content then a tool block, streamed token-sized.
    text = "Sure, calling it now." + "\n\n" + block(invoke("get_weather", param("city", "Kyiv")))
    deltas = per_char(text, thinking=False)
    assert_no_markup(deltas)
    content = "".join(d.content for d in deltas if d.content is not None)
    assert content == "Sure, calling it now."


def test_parse_completion_shape():
    msg = parse_completion(COMPLEX)
    assert msg["role"] == "assistant"
    assert msg["content"] == COMPLEX_EXPECTED["content"]
    assert msg["reasoning_content"] == COMPLEX_EXPECTED["reasoning_content"]
    assert [c["function"] for c in msg["tool_calls"]] == [c["function"] for c in COMPLEX_EXPECTED["tool_calls"]]
    for c in msg["tool_calls"]:
        assert c["type"] == "function"
        assert c["id"].startswith("call_") and len(c["id"]) > 10
        int(c["id"][5:], 16)
    only_tools = parse_completion(block(invoke("get_weather")), thinking=False)
    assert only_tools["content"] is None and only_tools["reasoning_content"] is None
    plain = parse_completion("hi", thinking=False)
    assert plain == {"role": "assistant", "content": "hi", "reasoning_content": None, "tool_calls": []}


def test_feed_after_finish_raises():
    parser = DeepseekV4OutputParser(False, None)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


@pytest.mark.parametrize("thinking", [True, False])
def test_round_trip_encode_then_parse(thinking):
    args1 = {"city": '北京 "x"', "days": 3}
    args2 = {"query": "a\nb", "limit": 10, "flags": [True, None], "opts": {"k": "v"}}
    assistant = {
        "role": "assistant",
        "reasoning_content": "I need two tools.",
        "content": "Checking.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args1)}},
            {"id": "c2", "type": "function", "function": {"name": "search", "arguments": json.dumps(args2)}},
        ],
    }
    prompt = encode_messages([{"role": "user", "content": "q"}, assistant], thinking=thinking, tools=TOOLS)
    opener = "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
    completion = prompt[prompt.rindex(opener) + len(opener) :]
    assert completion.endswith(EOS)
    for deltas in (per_char(completion, thinking=thinking), run_chunks(completion, [len(completion)], thinking)):
        got = accumulate(deltas)
        assert got["content"] == "Checking."
        assert got["reasoning_content"] == ("I need two tools." if thinking else "")
        assert [c["function"]["name"] for c in got["tool_calls"]] == ["get_weather", "search"]
        parsed = [json.loads(c["function"]["arguments"]) for c in got["tool_calls"]]
        assert parsed == [args1, args2]
        assert [c["function"]["arguments"] for c in got["tool_calls"]] == [
            json.dumps(a, ensure_ascii=False) for a in parsed
        ]


FUZZ_FRAGMENTS = [
    "a",
    " ",
    "\n",
    "\n\n",
    "<",
    "</",
    "x<y",
    "你好",
    "😀",
    '"',
    "\\",
    "<think>",
    "</think>",
    "</thi",
    "<｜",
    "<｜DS",
    f"<{D}tool_calls>",
    f"</{D}tool_calls>",
    f"<{D}tool>",
    f'<{D}invoke name="f">',
    f"</{D}invoke>",
    f'<{D}parameter name="a" string="true">',
    f'<{D}parameter name="b" string="false">',
    f'<{D}parameter name="arguments" string="false">',
    f'<{D}parameter name="c">',
    f"</{D}parameter>",
    EOS,
    "123",
    '{"k": [1]}',
    f"<{D}",
    f"</{D}par",
    ">",
]


def test_fuzz_chunking_invariance_and_no_leaks():
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_FRAGMENTS) for _ in range(rng.randint(1, 20)))
        thinking = rng.random() < 0.5
        ref = accumulate(run_chunks(text, [len(text)], thinking, None))
        for c in ref["tool_calls"]:
            args = c["function"]["arguments"]
            assert json.dumps(json.loads(args), ensure_ascii=False) == args
        chunks, left = [], len(text)
        while left:
            n = min(left, rng.randint(1, 5))
            chunks.append(n)
            left -= n
        for split in ([1] * len(text), chunks):
            deltas = run_chunks(text, split, thinking, None)
            assert accumulate(deltas) == ref, text
            for d in deltas:
                for v in (d.content, d.reasoning_content, d.arguments_delta):
                    assert v is None or D not in v
