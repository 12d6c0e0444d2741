"""serve/tools.py: a request's tools and tool_choice are checked (a bad schema is a 400 naming it),
tool-call messages become template messages, generated `<tool_call>` blocks become the response's
tool_calls, and that response (whole or streamed) parses in the official `openai` client."""

import json

import httpx
import pytest

from meshrl.model.tool_calls import format_call
from meshrl.serve.openai_api import APIError
from meshrl.serve.tools import chat_message, check_tools_request, tool_calls_delta, tool_calls_message

openai = pytest.importorskip("openai")

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
