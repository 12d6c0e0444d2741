"""model/tool_calls.py: tool calls round-trip through Qwen3's chat template (rendered as transformers
renders it, parsed back to the same names and arguments), malformed calls become CallErrors, tool
schemas and arguments are checked with errors naming their place."""

import json

import pytest

from meshrl.model.chat_template import load_chat_template
from meshrl.model.tool_calls import (CallError, ToolCall, ToolSchemaError, check_arguments, check_tools,
                                     format_call, function_tool, parse_tool_calls, plain_tool_results,
                                     render_tool_results, render_with_tools, text_outside_calls)

BASH = function_tool("bash", "Run a shell command in the task's terminal.", {
    "type": "object", "properties": {"command": {"type": "string", "minLength": 1},
                                     "timeout": {"type": "number", "exclusiveMinimum": 0}},
    "required": ["command"], "additionalProperties": False})
WRITE = function_tool("write_file", "Write a file.", {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]})
CALLS = [("bash", {"command": "grep -n 'a\"b' *.py | head -3 && echo $((1+2))"}),
         ("write_file", {"path": "notes/ünïcode.txt", "content": "line 1\nline 2\t{\"json\": [1, 2]}\n"})]


def _qwen3(hf_fixtures, tmp_path):
  hf_fixtures.save_tokenizer(str(tmp_path), chat_template=hf_fixtures.QWEN3_CHAT_TEMPLATE)
  return load_chat_template(str(tmp_path))


def _conversation(calls, as_string=False):
  tool_calls = [{"id": f"call_{i}", "type": "function", "function": {
      "name": name, "arguments": json.dumps(args) if as_string else args}} for i, (name, args) in
                enumerate(calls)]
  return [{"role": "system", "content": "You solve terminal tasks."},
          {"role": "user", "content": "Find the bug."},
          {"role": "assistant", "content": "", "tool_calls": tool_calls}]


@pytest.mark.parametrize("as_string", [False, True])
def test_tool_calls_round_trip_through_the_qwen3_chat_template(hf_fixtures, tmp_path, as_string):
  """What the template writes for an assistant's tool calls (the text a model is trained to emit)
  parses back to the same calls; the rendering equals transformers' apply_chat_template."""
  template = _qwen3(hf_fixtures, tmp_path)
  messages = _conversation(CALLS, as_string)
  prompt = render_with_tools(template, messages[:2], [BASH, WRITE])
  full = render_with_tools(template, messages, [BASH, WRITE], add_generation_prompt=False)
  assert full.startswith(prompt)
  generated = full[len(prompt):]
  assert generated.endswith("<|im_end|>\n") and "<tool_call>" in generated
  calls = parse_tool_calls(generated)
  assert [(c.name, c.arguments) for c in calls] == CALLS
  assert all(isinstance(c, ToolCall) for c in calls)
  assert text_outside_calls(generated).split() == ["<think>", "</think>", "<|im_end|>"]  # Qwen3's last turn
  for tool in (BASH, WRITE):  # the tools are offered in the system turn, as JSON
    assert json.dumps(tool, ensure_ascii=False) in prompt
  transformers = pytest.importorskip("transformers")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for msgs, gen in ((messages[:2], True), (messages, False)):
    want = tokenizer.apply_chat_template(msgs, tools=[BASH, WRITE], tokenize=False,
                                         add_generation_prompt=gen)
    assert render_with_tools(template, msgs, [BASH, WRITE], add_generation_prompt=gen) == want


def test_tool_results_render_as_the_observation_after_a_turn(hf_fixtures, tmp_path):
  """Qwen3's template drops the empty <think> of an assistant turn once a tool message follows it, so
  re-rendering is not prefix-stable; render_tool_results gives the text to append after the turn the
  model generated, and that text is what the template puts between a turn and the next prompt."""
  template = _qwen3(hf_fixtures, tmp_path)
  messages = _conversation(CALLS[:1])
  results = [{"role": "tool", "tool_call_id": "call_0", "name": "bash", "content": "x.py:3: a\"b\n3"}]
  before = render_with_tools(template, messages, [BASH], add_generation_prompt=False)
  after = render_with_tools(template, messages + results, [BASH])
  assert not after.startswith(before)  # the rewrite that makes a plain delta wrong
  observation = render_tool_results(template, results, [BASH])
  assert observation == ("<|im_start|>user\n<tool_response>\nx.py:3: a\"b\n3\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
  assert after.endswith("<|im_end|>\n" + observation)
  assert render_tool_results(None, results) == plain_tool_results(results)


def test_plain_format_for_a_tokenizer_without_a_template():
  messages = [{"role": "user", "content": "Find the bug."}]
  prompt = render_with_tools(None, messages, [BASH])
  assert prompt.startswith("You can call these tools.") and json.dumps(BASH) in prompt
  turn = "Let me look.\n" + format_call("bash", CALLS[0][1])
  assert [(c.name, c.arguments) for c in parse_tool_calls(turn)] == [CALLS[0]]
  assert plain_tool_results([{"role": "tool", "content": "ok"}]) == "\n<tool_response>\nok\n</tool_response>\n"


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"}", "never closed"),
    ("<tool_call>{'name': 'bash'}</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", "no \"name\" string"),
    ("<tool_call>{\"name\": \"bash\", \"arguments\": \"{not json\"}</tool_call>", "string that is not JSON"),
    ("<tool_call>{\"name\": \"bash\", \"arguments\": [\"ls\"]}</tool_call>", "must be a JSON object, got list"),
    ("<tool_call>{\"name\": \"bash\", \"args\": {}}</tool_call>", "unknown key(s) ['args']"),
    ("done here </tool_call>", "without a <tool_call> before it"),
    (b"<tool_call>", "not text"),
])
def test_malformed_calls_become_errors_never_exceptions(text, error):
  parsed = parse_tool_calls(text)
  assert isinstance(parsed[0], CallError) and error in parsed[0].error, parsed


def test_several_calls_and_free_text_and_the_call_limit():
  text = "<think>plan</think>\n" + format_call("bash", {"command": "ls"}) + " then " + \
      format_call("bash", {"command": "pwd"}) + "<tool_call>{\"name\": \"bash\", \"arguments\": " \
      "\"{\\\"command\\\": \\\"id\\\"}\"}</tool_call>"
  calls = parse_tool_calls(text)
  assert [c.arguments["command"] for c in calls] == ["ls", "pwd", "id"] and [c.index for c in calls] == [0, 1, 2]
  assert text_outside_calls(text) == "<think>plan</think>\n then"
  assert parse_tool_calls("no calls at all") == []
  many = parse_tool_calls(format_call("bash", {"command": "x"}) * 20)
  assert len(many) == 17 and "more than 16" in many[-1].error


@pytest.mark.parametrize("tools, param", [
    ("bash", "tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([BASH, BASH], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/defs/x"}}}}}],
     "tools[0].function.parameters.properties.x.$ref"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "text"}}}}}],
     "tools[0].function.parameters.properties.x.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}],
     "tools[0].function.parameters.properties.x.pattern"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], "tools[0].function"),
])
def test_bad_tool_schemas_are_refused_naming_the_place(tools, param):
  with pytest.raises(ToolSchemaError) as caught:
    check_tools(tools)
  assert caught.value.param == param and str(caught.value).startswith(param + ":")


def test_arguments_are_checked_against_the_schema():
  schema = {"type": "object", "required": ["command"], "additionalProperties": False, "properties": {
      "command": {"type": "string", "minLength": 1},
      "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 60},
      "mode": {"enum": ["fast", "slow"]}, "count": {"type": "integer"},
      "paths": {"type": "array", "items": {"type": "string", "pattern": "^[a-z/]+$"}, "maxItems": 2},
      "either": {"anyOf": [{"type": "string"}, {"type": "null"}]},
      "flag": {"type": "boolean"}}}
  check_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])
  assert check_arguments(schema, {"command": "ls", "timeout": 5, "mode": "fast", "count": 3,
                                  "paths": ["a/b"], "either": None, "flag": True}) == []
  errors = check_arguments(schema, {"timeout": 0, "mode": "medium", "count": 2.5, "flag": 1,
                                    "paths": ["A", "b", "c"], "either": 3, "extra": 1})
  assert set(errors) == {
      "arguments lacks the required 'command'", "arguments.timeout=0 must be > 0",
      "arguments.mode='medium' is not one of ['fast', 'slow']",
      "arguments.count must be integer, got float 2.5", "arguments.flag must be boolean, got int 1",
      "arguments.paths has 3 items, outside [0, 2]", "arguments.paths[0]='A' does not match '^[a-z/]+$'",
      "arguments.either matches no schema of anyOf",
      "arguments has the unknown property 'extra' (known: ['command', 'count', 'either', 'flag', "
      "'mode', 'paths', 'timeout'])"}, errors
  assert check_arguments(schema, {"command": ""}) == ["arguments.command has 0 characters, outside [1, inf]"]
  assert check_arguments({"type": "integer"}, True) == ["arguments must be integer, got bool true"]
