"""serve/tools.py: a request's tools and tool_choice are checked (a bad schema is a 400 naming it),
tool-call messages become template messages, generated `<tool_call>` blocks become the response's
tool_calls, and that response (whole or streamed) parses in the official `openai` client."""

import json
import types

import httpx
import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.model.tool_calls import PLAIN_TOOLS_HEADER, RESPONSE_OPEN, format_call
from meshrl.serve.app import ServerThread, make_app
from meshrl.serve.engine import Engine, EngineSpec, Event
from meshrl.serve.openai_api import APIError, render_chat
from meshrl.serve.tools import chat_message, check_tools_request, tool_calls_delta, tool_calls_message

openai = pytest.importorskip("openai")
TOK = ByteTokenizer()

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
BASH = {"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}


@pytest.mark.parametrize("body, param, text", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/x"}}}}}]},
     "tools[0].function.parameters.properties.x.$ref", "keyword '$ref' is not supported"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name"}}]},
     "tools[1].function.name", "must be 1-64 letters"),
    ({"tools": {"name": "f"}}, "tools", "must be a list"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name", "not one of the tools ['get_weather']"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "choose none, auto, required"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_bad_tools_are_a_400_naming_the_schema(body, param, text):
  with pytest.raises(APIError) as caught:
    check_tools_request(body)
  error = caught.value
  assert error.status == 400 and error.param == param and text in error.message
  assert error.body()["error"]["param"] == param


def test_good_requests():
  assert check_tools_request({}) is None and check_tools_request({"tools": []}) is None
  request = check_tools_request({"tools": [WEATHER, BASH]})
  assert request.choice == "auto" and request.names == ("get_weather", "bash") and request.parallel
  forced = check_tools_request({"tools": [WEATHER], "tool_choice": {
      "type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False})
  assert forced.choice == "get_weather" and not forced.parallel


def test_tool_call_messages_become_template_messages():
  assistant = chat_message({"role": "assistant", "content": None, "tool_calls": [
      {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                        "arguments": "{\"city\": \"Oslo\"}"}}]}, 1)
  assert assistant == {"role": "assistant", "content": "", "tool_calls": [
      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
  assert chat_message({"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}, 2) == {
      "role": "tool", "tool_call_id": "call_1", "content": "-3 C"}
  for message, param in (({"role": "tool", "content": "x"}, "messages[2].tool_call_id"),
                         ({"role": "assistant", "content": "", "tool_calls": [
                             {"function": {"name": "f", "arguments": "{nope"}}]},
                          "messages[2].tool_calls[0].function.arguments"),
                         ({"role": "user", "content": "x", "tool_calls": []}, "messages[2]")):
    with pytest.raises(APIError) as caught:
      chat_message(message, 2)
    assert caught.value.param == param and caught.value.status == 400


def _response(message, finish):
  return {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
          "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}


def test_generated_calls_become_tool_calls_that_the_openai_client_parses():
  request = check_tools_request({"tools": [WEATHER, BASH]})
  text = ("<think>two cities</think>\nLet me check. " + format_call("get_weather", {"city": "Oslo"})
          + "\n" + format_call("get_weather", {"city": "Zürich"}) + "\n" + format_call("unknown", {})
          + " <tool_call>{broken</tool_call>")
  message, finish = tool_calls_message(text, request)
  assert finish == "tool_calls"
  assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
      {"city": "Oslo"}, {"city": "Zürich"}]
  # what is not a call of a requested tool stays in the content
  assert message["content"] == ("<think>two cities</think>\nLet me check. \n\n" + format_call("unknown", {})
                                + " <tool_call>{broken</tool_call>")
  served = []

  def handler(http_request):
    served.append(json.loads(http_request.content))
    return httpx.Response(200, json=_response(message, finish))

  client = openai.OpenAI(base_url="http://server/v1", api_key="x", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))
  completion = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "?"}],
                                              tools=[WEATHER, BASH])
  choice = completion.choices[0]
  assert choice.finish_reason == "tool_calls" and served[0]["tools"] == [WEATHER, BASH]
  assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
      ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Zürich"})]
  assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
  chunk = openai.types.chat.ChatCompletionChunk.model_validate(
      {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m",
       "choices": [{"index": 0, "delta": tool_calls_delta(message), "finish_reason": finish}]})
  assert [c.index for c in chunk.choices[0].delta.tool_calls] == [0, 1]


def test_no_calls_choice_none_and_a_single_call_when_not_parallel():
  request = check_tools_request({"tools": [WEATHER]})
  assert tool_calls_message("It is sunny.", request) == ({"role": "assistant", "content": "It is sunny."}, None)
  text = format_call("get_weather", {"city": "A"}) + format_call("get_weather", {"city": "B"})
  none = check_tools_request({"tools": [WEATHER], "tool_choice": "none"})
  assert tool_calls_message(text, none) == ({"role": "assistant", "content": text}, None)
  single = check_tools_request({"tools": [WEATHER], "parallel_tool_calls": False})
  message, _ = tool_calls_message(text, single)
  assert len(message["tool_calls"]) == 1 and message["content"] == format_call("get_weather", {"city": "B"})


# --- the server (serve/app.py) with tools, driven by the openai client ------------------------------

class ScriptedEngine:
  """The engine interface the app uses, replying with scripted texts (a policy whose output is
  known) and keeping each request's prompt ids."""

  def __init__(self, replies, max_len=4096):
    self.replies, self.prompts = list(replies), []
    self.spec = types.SimpleNamespace(max_len=max_len)

  def is_alive(self):
    return True

  def submit(self, request):
    self.prompts.append(list(request.prompt))
    request.id = len(self.prompts)
    tokens = tuple(TOK.encode(self.replies.pop(0))[:request.max_tokens])
    request.emit(Event(tokens, logprobs=(0.0,) * len(tokens)))
    request.emit(Event(finish_reason="stop"))
    return request.id

  def cancel(self, request_id, finish_reason="cancelled"):
    pass

  def metrics(self):
    return {}


def _scripted_server(replies):
  engine = ScriptedEngine(replies)
  thread = ServerThread(make_app(engine, TOK, model_name="m")).start()
  client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0, timeout=60)
  return engine, thread, client


def _streamed(events):
  """(content, tool calls [(id, name, arguments)], finish reason) assembled from stream chunks."""
  content, calls, finish = "", {}, None
  for event in events:
    for choice in event.choices:
      content += choice.delta.content or ""
      for call in choice.delta.tool_calls or []:
        calls[call.index] = (call.id, call.function.name, call.function.arguments)
      finish = choice.finish_reason or finish
  return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_client_agent_loop_over_two_tool_turns(stream):
  """A policy that calls bash, then submit, then answers: the client gets tool_calls (finish reason
  "tool_calls"), sends the results back as role: tool messages, and each later prompt holds the
  tools, the earlier calls and their results as the server renders them."""
  replies = ["Listing. " + format_call("bash", {"command": "ls /data"}),
             format_call("submit", {"answer": "a.txt"}), "Submitted a.txt."]
  engine, thread, client = _scripted_server(replies)
  submit = {"type": "function", "function": {"name": "submit", "parameters": {
      "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
  outputs = {"bash": "a.txt\n", "submit": "accepted"}
  messages = [{"role": "user", "content": "Which file is in /data? Submit its name."}]
  finishes, executed = [], []
  try:
    for _ in range(3):
      kwargs = dict(model="m", messages=messages, tools=[BASH, submit], max_tokens=200)
      if stream:
        content, calls, finish = _streamed(client.chat.completions.create(**kwargs, stream=True))
      else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
      finishes.append(finish)
      messages.append({"role": "assistant", "content": content, "tool_calls": [
          {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]
                       or None})
      if not calls:
        break
      for call_id, name, arguments in calls:
        executed.append((name, json.loads(arguments)))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": outputs[name]})
  finally:
    thread.stop()
  assert finishes == ["tool_calls", "tool_calls", "stop"]
  assert executed == [("bash", {"command": "ls /data"}), ("submit", {"answer": "a.txt"})]
  assert messages[1]["content"] == "Listing." and messages[-1]["content"] == "Submitted a.txt."
  prompts = [TOK.decode(p) for p in engine.prompts]
  assert all(PLAIN_TOOLS_HEADER in p and '"name": "submit"' in p for p in prompts)
  assert format_call("bash", {"command": "ls /data"}) in prompts[1]  # the call, rendered back
  assert f"{RESPONSE_OPEN}\na.txt\n" in prompts[1] and f"{RESPONSE_OPEN}\naccepted\n" in prompts[2]
  assert prompts[2].endswith("<|assistant|>\n")


@pytest.fixture(scope="module")
def long_engine():
  """A tiny dense policy with room for a prompt that lists tools (320 tokens; the shared one has 64)."""
  cfg = configs.load("configs/tiny.py:dense", ["model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
                                                    "model.max_seq_len=320", "model.init_std=0.5"])
  model = build_model(ModelConfig.from_config(cfg, None), None, seed=3)
  engine = Engine(model, EngineSpec(slots=1, max_len=320, chunk=4, prefix_block=8,
                                    prefix_cache_bytes=1 << 20), stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  yield engine.start()
  engine.close()


def test_tools_through_a_tiny_policy_and_bad_schemas_are_a_400(long_engine):
  """The real tiny engine: the tools are in the prompt it decodes from (usage counts them), a forced
  tool_choice opens the call in the prompt so the reply continues it, and a bad schema is a 400."""
  engine = long_engine
  thread = ServerThread(make_app(engine, TOK, model_name="m")).start()
  client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0, timeout=120)
  tool = {"type": "function", "function": {"name": "f"}}
  messages = [{"role": "user", "content": "go"}]
  try:
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    forced = client.chat.completions.create(
        model="m", messages=messages, tools=[tool], max_tokens=4, temperature=0,
        tool_choice={"type": "function", "function": {"name": "f"}})
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters") as raised:
      client.chat.completions.create(model="m", messages=messages, tools=[
          {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}])
  finally:
    thread.stop()
  turns = [{"role": "user", "content": "go"}]
  prefix = '<tool_call>\n{"name": "f", "arguments": '
  assert forced.usage.prompt_tokens == len(TOK.encode(render_chat(TOK, turns, (tool,)) + prefix))
  assert forced.usage.prompt_tokens > plain.usage.prompt_tokens + len(PLAIN_TOOLS_HEADER)
  assert forced.choices[0].message.content.startswith(prefix)  # the tiny policy writes no valid call
  assert forced.choices[0].finish_reason == "length" and not forced.choices[0].message.tool_calls
  assert raised.value.status_code == 400 and raised.value.body["param"] == "tools[0].function.parameters.if"
