"""Tool calls in the OpenAI chat API, as pure functions for the server (serve/openai_api.py calls
them): check a request's `tools` / `tool_choice` and its tool-call messages, render the conversation
with the tools, and turn generated text into the response's `tool_calls`.

  request = check_tools_request(body)                  # APIError 400 naming the bad tool schema
  messages = [chat_message(m, i) for i, m in enumerate(body["messages"])]
  prompt = render_with_tools(template, messages, request.tools)        # model/tool_calls.py
  message, finish = tool_calls_message(generated_text, request)        # {"role", "content", "tool_calls"}
  delta = tool_calls_delta(message)                    # the same as one streamed chunk's delta

The format is model/tool_calls.py's (Qwen3's `<tool_call>` blocks). A generated block that names a
tool of the request and holds a JSON object becomes a tool call ("arguments" as a JSON string, as the
API sends them; arguments are not checked against the schema, as OpenAI's non-strict mode does not);
anything else stays in the message's content, so nothing the model wrote is lost. With
tool_choice "none" no text is turned into calls.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from meshrl.model import tool_calls as fmt
from meshrl.serve.openai_api import ROLES, APIError

TOOL_CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolRequest:
  tools: tuple  # checked OpenAI function tools
  choice: str  # "none", "auto", "required" or a tool's name (forced)
  parallel: bool

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(t["function"]["name"] for t in self.tools)


def _bad(message: str, param: str, code: str = "invalid_tools") -> APIError:
  return APIError(400, message, param=param, code=code)


def check_tools_request(body: dict) -> ToolRequest | None:
  """The request's tools (None when it has none); APIError 400 whose message and `param` name the bad
  tool, schema keyword or tool_choice."""
  tools = body.get("tools")
  choice = body.get("tool_choice")
  parallel = body.get("parallel_tool_calls", True)
  if not isinstance(parallel, bool):
    raise _bad(f"`parallel_tool_calls`={parallel!r} must be true or false.", "parallel_tool_calls")
  if tools is None or tools == []:
    if choice not in (None, "none"):
      raise _bad(f"`tool_choice`={choice!r} needs `tools`.", "tool_choice")
    return None
  try:
    fmt.check_tools(tools)
  except fmt.ToolSchemaError as error:
    raise _bad(f"`{error.param}`: {error.message}", error.param) from None
  names = [t["function"]["name"] for t in tools]
  if choice is None:
    choice = "auto"
  elif isinstance(choice, dict):
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
      raise _bad("`tool_choice` must be none, auto, required or {\"type\": \"function\", "
                 "\"function\": {\"name\": ...}}.", "tool_choice")
    if name not in names:
      raise _bad(f"`tool_choice` names {name!r}, which is not one of the tools {names}.",
                 "tool_choice.function.name")
    choice = name
  elif choice not in TOOL_CHOICES:
    raise _bad(f"`tool_choice`={choice!r}; choose none, auto, required or a function.", "tool_choice")
  return ToolRequest(tuple(tools), choice, parallel)


def chat_message(message: Any, i: int) -> dict:
  """One request message with tool fields, as the chat template takes it: assistant turns may carry
  `tool_calls` (arguments decoded from their JSON strings), tool results are {"role": "tool",
  "tool_call_id", "content"}; APIError 400 naming messages[i]... for a malformed one."""
  where = f"messages[{i}]"
  if not isinstance(message, dict) or message.get("role") not in ROLES:
    raise _bad(f"`{where}` must be an object with a role among {', '.join(ROLES)}.", where,
               "invalid_message")
  role = message["role"]
  allowed = {"role", "content", "name"} | ({"tool_calls"} if role == "assistant" else set()) | (
      {"tool_call_id"} if role == "tool" else set())
  extra = sorted(set(message) - allowed)
  if extra:
    raise _bad(f"`{where}` has unsupported fields {extra}.", where, "invalid_message")
  content = message.get("content")
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
    content = "".join(str(p.get("text", "")) for p in content)
  if content is None and role == "assistant" and message.get("tool_calls"):
    content = ""
  if not isinstance(content, str):
    raise _bad(f"`{where}.content` must be a string or a list of text parts.", f"{where}.content",
               "invalid_message")
  out = {"role": "system" if role == "developer" else role, "content": content}
  if role == "tool":
    if not isinstance(message.get("tool_call_id"), str):
      raise _bad(f"`{where}.tool_call_id` must be the id of the call it answers.",
                 f"{where}.tool_call_id", "invalid_message")
    out["tool_call_id"] = message["tool_call_id"]
  if role == "assistant" and message.get("tool_calls") is not None:
    out["tool_calls"] = [_request_call(call, f"{where}.tool_calls[{j}]")
                         for j, call in enumerate(message["tool_calls"])]
  return out


def _request_call(call: Any, where: str) -> dict:
  function = call.get("function") if isinstance(call, dict) else None
  if not isinstance(function, dict) or not isinstance(function.get("name"), str):
    raise _bad(f"`{where}` must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
               f"\"arguments\"}}}}.", where, "invalid_message")
  arguments = function.get("arguments", "{}")
  try:
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
  except ValueError:
    raise _bad(f"`{where}.function.arguments` is not JSON.", f"{where}.function.arguments",
               "invalid_message") from None
  if not isinstance(arguments, dict):
    raise _bad(f"`{where}.function.arguments` must encode a JSON object.",
               f"{where}.function.arguments", "invalid_message")
  return {"id": call.get("id", ""), "type": "function",
          "function": {"name": function["name"], "arguments": arguments}}


def tool_calls_message(text: str, request: ToolRequest | None) -> tuple[dict, str | None]:
  """(the response message, "tool_calls" when it holds calls else None: keep the engine's finish
  reason) for the generated `text`."""
  if request is None or request.choice == "none":
    return {"role": "assistant", "content": text}, None
  calls, spans = [], []
  for item in fmt.parse_tool_calls(text):
    if isinstance(item, fmt.ToolCall) and item.name in request.names:
      calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                    "function": {"name": item.name,
                                 "arguments": json.dumps(item.arguments, ensure_ascii=False)}})
      spans.append(item.span)
      if not request.parallel:
        break
  if not calls:
    return {"role": "assistant", "content": text}, None
  kept, position = [], 0
  for start, end in spans:
    kept.append(text[position:start])
    position = end
  content = ("".join(kept) + text[position:]).strip() or None
  return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def tool_calls_delta(message: dict) -> dict:
  """A streamed chunk's delta carrying a whole message's tool calls (each with its index)."""
  delta = {"role": "assistant", "content": message.get("content")}
  if message.get("tool_calls"):
    delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
  return delta
