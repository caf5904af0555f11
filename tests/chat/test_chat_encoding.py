"""Golden tests for encode_messages, one per rendering rule (reference notes model-and-formats
§10.2 and release-and-anchors §3). Expected strings are written out from the rules."""

import copy
import json
from pathlib import Path

import pytest

from dsv4.chat.encoding import (
    EFFORT_ABSOLUTE_MAXIMUM,
    EFFORT_BEYOND_MAXIMUM,
    effort_version_for_config,
    encode_messages,
    map_reasoning_effort,
    render_tools,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"
LR = "<｜latest_reminder｜>"
TS = "<think>"
TE = "</think>"
D = "｜DSML｜"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def user(text):
    return {"role": "user", "content": text}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# -- basic shapes ----------------------------------------------------------------------------------
def test_non_thinking_single_turn():
    assert encode_messages([user("q")], thinking=False) == f"{BOS}{U}q{A}{TE}"


def test_thinking_single_turn():
    assert encode_messages([user("q")]) == f"{BOS}{U}q{A}{TS}"


def test_add_bos_false():
    assert encode_messages([user("q")], add_bos=False) == f"{U}q{A}{TS}"


def test_multi_turn_example_from_facts():
    messages = [
        {"role": "system", "content": "SYS"},
        user("hello"),
        {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "greet back"},
        user("1+1=?"),
    ]
    expected = (
        "<｜begin▁of▁sentence｜>SYS<｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek."
        "<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>"
    )
    assert encode_messages(messages, thinking=True) == expected
    # Chat mode ends with </think> instead.
    assert encode_messages(messages, thinking=False) == expected[: -len(TS)] + TE


def test_system_has_no_role_token():
    msgs = [{"role": "system", "content": "You are terse."}, user("hi")]
    assert encode_messages(msgs, thinking=False) == f"{BOS}You are terse.{U}hi{A}{TE}"


def test_system_last_or_before_assistant_opens_assistant_turn():
    assert encode_messages([{"role": "system", "content": "S"}]) == f"{BOS}S{A}{TS}"
    msgs = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "a"}]
    assert encode_messages(msgs, thinking=False) == f"{BOS}S{A}{TE}a{EOS}"


def test_openai_content_lists_are_joined_by_a_blank_line():
    """Like DeepSeek's encoder joins a user turn's content blocks (release-and-anchors §3)."""
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}, "c"]
    msgs = [{"role": "user", "content": parts}]
    assert encode_messages(msgs, thinking=False) == f"{BOS}{U}a\n\nb\n\nc{A}{TE}"
    assert encode_messages([{"role": "user", "content": [{"type": "text", "text": "only"}]}], thinking=False) == (
        f"{BOS}{U}only{A}{TE}"
    )
    # The same for every role that takes content.
    def two(a, b):
        return [{"type": "text", "text": a}, {"type": "output_text", "text": b}]

    msgs = [
        {"role": "system", "content": two("s1", "s2")},
        user("q"),
        {"role": "assistant", "content": two("a1", "a2"), "tool_calls": [call("c1", "get_weather", {"city": "A"})]},
        {"role": "tool", "tool_call_id": "c1", "content": two("t1", "t2")},
        {"role": "developer", "content": two("d1", "d2")},
    ]
    prompt = encode_messages(msgs, thinking=False)
    for joined in ("s1\n\ns2", "a1\n\na2", "<tool_result>t1\n\nt2</tool_result>", f"{U}d1\n\nd2"):
        assert joined in prompt


@pytest.mark.parametrize("kind", ["image_url", "image", "input_image"])
@pytest.mark.parametrize("role", ["user", "system", "assistant", "developer"])
def test_image_parts_are_refused_naming_the_part(kind, role):
    part = {"type": kind, kind: {"url": "data:image/png;base64,AAAA"}}
    msgs = [user("q"), {"role": role, "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(ValueError) as exc:
        encode_messages(msgs)
    assert str(exc.value).startswith("messages[1].content[1]: images are not supported")


def test_image_part_in_a_tool_result_is_refused():
    msgs = [user("q"), {"role": "assistant", "tool_calls": [call("c1", "f", {})]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError) as exc:
        encode_messages(msgs)
    assert str(exc.value).startswith("messages[2].content[0]: images are not supported")


def test_consecutive_user_messages_share_one_turn():
    assert encode_messages([user("a"), user("b")], thinking=False) == f"{BOS}{U}a\n\nb{A}{TE}"


# -- drop_thinking ---------------------------------------------------------------------------------
HISTORY = [
    user("q1"),
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    user("q2"),
]


def test_drop_thinking_default_drops_history_reasoning():
    assert encode_messages(HISTORY) == f"{BOS}{U}q1{A}{TE}a1{EOS}{U}q2{A}{TS}"


def test_drop_thinking_false_keeps_reasoning():
    assert encode_messages(HISTORY, drop_thinking=False) == (
        f"{BOS}{U}q1{A}{TS}r1{TE}a1{EOS}{U}q2{A}{TS}"
    )


def test_reasoning_field_alias():
    msgs = copy.deepcopy(HISTORY)
    msgs[1]["reasoning"] = msgs[1].pop("reasoning_content")
    assert encode_messages(msgs, drop_thinking=False) == (
        f"{BOS}{U}q1{A}{TS}r1{TE}a1{EOS}{U}q2{A}{TS}"
    )


def test_tools_force_drop_thinking_off():
    prompt = encode_messages(HISTORY, tools=[WEATHER_TOOL])
    assert prompt.endswith(f"{U}q1{A}{TS}r1{TE}a1{EOS}{U}q2{A}{TS}")
    # Per-message tools force it off too.
    msgs = [{"role": "system", "content": "S", "tools": [WEATHER_TOOL]}, *HISTORY]
    assert f"{A}{TS}r1{TE}a1" in encode_messages(msgs)


def test_chat_mode_never_renders_reasoning():
    assert encode_messages(HISTORY, thinking=False, drop_thinking=False) == (
        f"{BOS}{U}q1{A}{TE}a1{EOS}{U}q2{A}{TE}"
    )


def test_assistant_after_last_user_keeps_reasoning_and_wo_eos():
    msgs = [user("q"), {"role": "assistant", "content": "par", "reasoning_content": "r", "wo_eos": True}]
    assert encode_messages(msgs) == f"{BOS}{U}q{A}{TS}r{TE}par"


# -- developer / latest_reminder -------------------------------------------------------------------
def test_developer_renders_as_user_turn():
    msgs = [{"role": "developer", "content": "Be brief."}]
    assert encode_messages(msgs) == f"{BOS}{U}Be brief.{A}{TS}"


def test_developer_before_last_user_dropped_when_dropping():
    msgs = [
        {"role": "developer", "content": "D"},
        user("q1"),
        {"role": "assistant", "content": "a1"},
        user("q2"),
    ]
    assert encode_messages(msgs) == f"{BOS}{U}q1{A}{TE}a1{EOS}{U}q2{A}{TS}"
    # Kept when not dropping (chat mode never drops).
    assert encode_messages(msgs, thinking=False) == (
        f"{BOS}{U}D{U}q1{A}{TE}a1{EOS}{U}q2{A}{TE}"
    )
    assert encode_messages(msgs, drop_thinking=False) == (
        f"{BOS}{U}D{U}q1{A}{TS}{TE}a1{EOS}{U}q2{A}{TS}"
    )


def test_latest_reminder():
    assert encode_messages([{"role": "latest_reminder", "content": "R"}, user("q")], thinking=False) == (
        f"{BOS}{LR}R{U}q{A}{TE}"
    )
    # A user turn followed by a reminder still opens the assistant turn first.
    assert encode_messages([user("q"), {"role": "latest_reminder", "content": "R"}]) == (
        f"{BOS}{U}q{A}{TS}{LR}R"
    )


# -- tools -----------------------------------------------------------------------------------------
TOOLS_SECTION_LINES = [
    "## Tools",
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    'by writing a "<｜DSML｜tool_calls>" block like the following:',
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>',
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.',
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.",
    "Otherwise, output directly after </think> with tool calls or final response.",
    "### Available Tool Schemas",
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.",
]


def test_tools_section_content():
    section = render_tools([WEATHER_TOOL, {"name": "noop", "parameters": {}}])
    lines = section.split("\n")
    for line in TOOLS_SECTION_LINES:
        assert line in lines, line
    schema_line = json.dumps(WEATHER_TOOL["function"], ensure_ascii=False)
    i = lines.index("### Available Tool Schemas")
    assert lines[i + 2 : i + 4] == [schema_line, '{"name": "noop", "parameters": {}}']
    assert section.endswith("invoke tool calls.\n")


def test_tools_attached_to_first_system_message():
    msgs = [{"role": "system", "content": "SYS"}, user("q")]
    prompt = encode_messages(msgs, tools=[WEATHER_TOOL], thinking=False)
    assert prompt == f"{BOS}SYS\n\n{render_tools([WEATHER_TOOL])}{U}q{A}{TE}"


def test_tools_synthesize_system_message():
    prompt = encode_messages([user("q")], tools=[WEATHER_TOOL])
    assert prompt == f"{BOS}\n\n{render_tools([WEATHER_TOOL])}{U}q{A}{TS}"


def test_tool_results_merged_and_reordered_by_call_order():
    msgs = [
        user("weather in A and B?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("c1", "get_weather", {"city": "A"}), call("c2", "get_weather", {"city": "B"})],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "B: rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "A: sun"},
        user("thanks"),
    ]
    prompt = encode_messages(msgs, thinking=False)
    assert prompt.endswith(
        f"{EOS}{U}<tool_result>A: sun</tool_result>\n\n<tool_result>B: rain</tool_result>\n\nthanks{A}{TE}"
    )


def test_dsml_rendering_of_tool_call():
    args = {"city": "北京", "days": 3, "detail": True, "opts": {"units": ["c", "f"]}, "note": None}
    msgs = [
        user("q"),
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "get_weather", args)]},
    ]
    expected_block = (
        f"<{D}tool_calls>\n"
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">北京</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
        f'<{D}parameter name="detail" string="false">true</{D}parameter>\n'
        f'<{D}parameter name="opts" string="false">{{"units": ["c", "f"]}}</{D}parameter>\n'
        f'<{D}parameter name="note" string="false">null</{D}parameter>\n'
        f"</{D}invoke>\n"
        f"</{D}tool_calls>"
    )
    assert encode_messages(msgs, thinking=False) == f"{BOS}{U}q{A}{TE}Checking.\n\n{expected_block}{EOS}"


def test_two_calls_and_dict_arguments():
    msgs = [
        user("q"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": "1"}}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
    ]
    out = encode_messages(msgs, thinking=False)
    assert out.endswith(
        f'{TE}\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="true">1</{D}parameter>\n'
        f'</{D}invoke>\n<{D}invoke name="g">\n\n</{D}invoke>\n</{D}tool_calls>{EOS}'
    )


# -- response_format -------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
RF_HEAD = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def test_response_format_json_schema():
    rf = {"type": "json_schema", "json_schema": {"name": "ans", "schema": SCHEMA}}
    msgs = [{"role": "system", "content": "SYS"}, user("q")]
    assert encode_messages(msgs, response_format=rf, thinking=False) == (
        f"{BOS}SYS{RF_HEAD}{json.dumps(SCHEMA)}{U}q{A}{TE}"
    )


def test_response_format_after_tools_and_synthesized():
    rf = {"type": "json_schema", "json_schema": {"name": "ans", "schema": SCHEMA}}
    out = encode_messages([user("q")], tools=[WEATHER_TOOL], response_format=rf, thinking=False)
    assert out == f"{BOS}\n\n{render_tools([WEATHER_TOOL])}{RF_HEAD}{json.dumps(SCHEMA)}{U}q{A}{TE}"
    assert encode_messages([user("q")], response_format={"type": "text"}) == f"{BOS}{U}q{A}{TS}"


def test_developer_message_response_format():
    msgs = [{"role": "developer", "content": "D", "response_format": SCHEMA}]
    assert encode_messages(msgs, thinking=False) == f"{BOS}{U}D{RF_HEAD}{json.dumps(SCHEMA)}{A}{TE}"


# -- reasoning effort ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "version,effort,preamble",
    [
        ("0423", None, ""),
        ("0423", "high", ""),
        ("0423", "low", ""),
        ("0423", "max", EFFORT_ABSOLUTE_MAXIMUM),
        ("0731", None, ""),
        ("0731", "low", ""),
        ("0731", "high", EFFORT_ABSOLUTE_MAXIMUM),
        ("0731", "max", EFFORT_BEYOND_MAXIMUM),
    ],
)
def test_reasoning_effort_preambles(version, effort, preamble):
    msgs = [{"role": "system", "content": "SYS"}, user("q")]
    out = encode_messages(msgs, reasoning_effort=effort, effort_version=version)
    assert out == f"{BOS}{preamble}SYS{U}q{A}{TS}"
    # Chat mode never carries a preamble.
    assert encode_messages(msgs, thinking=False, reasoning_effort=effort, effort_version=version) == (
        f"{BOS}SYS{U}q{A}{TE}"
    )


def test_effort_texts_verbatim_heads():
    assert EFFORT_ABSOLUTE_MAXIMUM.startswith(
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough"
    )
    assert EFFORT_BEYOND_MAXIMUM.startswith(
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor"
    )
    for text in (EFFORT_ABSOLUTE_MAXIMUM, EFFORT_BEYOND_MAXIMUM):
        assert text.endswith(".\n\n") and text.count("\n") == 4


def test_effort_preamble_precedes_synthesized_tools_system():
    out = encode_messages([user("q")], tools=[WEATHER_TOOL], reasoning_effort="max")
    assert out.startswith(f"{BOS}{EFFORT_ABSOLUTE_MAXIMUM}\n\n## Tools\n")


@pytest.mark.parametrize("version,effort", [("0423", "ultra"), ("0731", "medium"), ("0999", None)])
def test_bad_effort_rejected(version, effort):
    with pytest.raises(ValueError):
        encode_messages([user("q")], reasoning_effort=effort, effort_version=version)


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, (True, "high")),
        ("none", (False, None)),
        ("max", (True, "max")),
        ("low", (True, "low")),
        ("minimal", (True, "low")),
        ("medium", (True, "low")),
        ("high", (True, "high")),
        ("xhigh", (True, "high")),
        ("HIGH", (True, "high")),
    ],
)
def test_map_reasoning_effort(value, expected):
    assert map_reasoning_effort(value) == expected


def test_effort_version_for_config():
    ratios_0423 = [0, 0] + [4, 128] * 20 + [4, 0]
    assert effort_version_for_config({"num_hidden_layers": 43, "compress_ratios": ratios_0423}) == "0423"
    assert effort_version_for_config({"num_hidden_layers": 43, "compress_ratios": ratios_0423 + [0, 0]}) == "0731"
    assert effort_version_for_config({"dspark_block_size": 5}) == "0731"
    assert effort_version_for_config({}) == "0423"


def test_effort_version_for_real_configs():
    configs = Path(__file__).resolve().parents[3] / "shared" / "reference" / "configs"
    if not configs.is_dir():
        pytest.skip("shared/reference/configs not available")
    load = lambda name: json.loads((configs / name).read_text())  # noqa: E731
    assert effort_version_for_config(load("DeepSeek-V4-Flash.config.json")) == "0423"
    assert effort_version_for_config(load("DeepSeek-V4-Flash-0731.config.json")) == "0731"


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "messages,fragment",
    [
        ([user("q"), {"role": "wizard", "content": "x"}], "messages[1].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "system", "content": None}, user("q")], "messages[0].content"),
        ([user("q"), {"role": "developer", "content": ""}], "messages[1].content"),
        ([user("q"), {"role": "tool", "tool_call_id": "c1", "content": "r"}], "messages[1].tool_call_id"),
        (
            [user("q"), {"role": "assistant", "tool_calls": [call("c1", "f", {})]},
             {"role": "tool", "tool_call_id": "zzz", "content": "r"}],
            "messages[2].tool_call_id",
        ),
        (
            [user("q"), {"role": "assistant", "tool_calls": [call("c1", "f", {})]},
             {"role": "tool", "content": "r"}],
            "messages[2].tool_call_id",
        ),
        (
            [user("q"), {"role": "assistant", "tool_calls": [call("c1", "f", {})]},
             {"role": "tool", "tool_call_id": "c1"}],
            "messages[2].content",
        ),
        (
            [user("q"), {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([user("q"), {"role": "assistant"}], "messages[1].content"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type"),
        ([user("q"), {"role": "user", "content": "x", "task": "dance"}], "messages[1].task"),
    ],
)
def test_bad_messages_raise_value_error(messages, fragment):
    with pytest.raises(ValueError) as exc:
        encode_messages(messages)
    assert fragment in str(exc.value)


def test_input_messages_not_mutated():
    msgs = [
        {"role": "system", "content": "S"},
        user("q"),
        {"role": "assistant", "content": "a", "reasoning_content": "r",
         "tool_calls": [call("c1", "get_weather", {"city": "A"})]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    before = copy.deepcopy(msgs)
    encode_messages(msgs, tools=[WEATHER_TOOL])
    assert msgs == before


def test_task_tokens():
    msgs = [{"role": "user", "content": "q", "task": "query"}]
    assert encode_messages(msgs) == f"{BOS}{U}q<｜query｜>"
    msgs = [{"role": "user", "content": "q", "task": "action"}]
    assert encode_messages(msgs, thinking=False) == f"{BOS}{U}q{A}{TE}<｜action｜>"
