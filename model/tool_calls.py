"""Tool calls in the model's text: OpenAI-style function tools, their JSON schemas, and the
`<tool_call>` format Qwen3's chat template renders and its models emit.

  schemas = [function_tool("bash", "Run a shell command.", {"type": "object", ...}), ...]
  check_tools(schemas)                        # ToolSchemaError naming e.g. tools[1].function.parameters
  prompt = render_with_tools(template, messages, schemas)      # the chat template (None: plain text)
  calls = parse_tool_calls(text)              # [ToolCall | CallError], never raises
  errors = check_arguments(schema, call.arguments)            # [] when they match

The format (Qwen3's template, e.g. Qwen/Qwen3-0.6B tokenizer_config.json, and Hermes-style models):
an assistant turn holds zero or more blocks

  <tool_call>
  {"name": "bash", "arguments": {"command": "ls"}}
  </tool_call>

around free text (and a <think> block, which is free text here). Tool results go back as messages
{"role": "tool", "tool_call_id", "name", "content"}, which that template renders inside
<tool_response> tags of a user turn. A tokenizer without a chat template (the byte tokenizer) gets
the same call syntax with the tools listed in plain text (`PLAIN_TOOLS_HEADER`), results rendered as
<tool_response> blocks (`plain_tool_results`).

JSON schemas: the subset tool definitions use in practice, checked when a tool is defined and used to
validate a call's arguments (`check_arguments`): type (one or a list), properties, required,
additionalProperties, items, enum, const, minimum / maximum / exclusiveMinimum / exclusiveMaximum,
minLength / maxLength, minItems / maxItems, pattern, anyOf / oneOf / allOf; annotations (title,
description, default, examples, format, $schema, ...) are accepted and not checked. Any other
keyword ($ref, if/then, patternProperties, ...) is refused by name, so a schema is never silently
half-checked.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
STOP_STRINGS = (CALL_CLOSE,)  # a turn may end once a call is complete (engines may stop here)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_CALLS = 16  # per turn
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
_ASSERTIONS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const",
               "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
               "minItems", "maxItems", "pattern", "anyOf", "oneOf", "allOf"}
_ANNOTATIONS = {"title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "strict"}
PLAIN_TOOLS_HEADER = ("You can call these tools. To call one, write\n"
                      f"{CALL_OPEN}\n{{\"name\": <tool name>, \"arguments\": <arguments as a JSON "
                      f"object>}}\n{CALL_CLOSE}\nTools:\n")


class ToolSchemaError(ValueError):
  """A tool definition that is not usable; `param` names where (e.g. tools[1].function.parameters)."""

  def __init__(self, message: str, param: str):
    super().__init__(f"{param}: {message}")
    self.param, self.message = param, message


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed call: `arguments` is the decoded JSON object; `raw` the block's text."""
  name: str
  arguments: dict
  raw: str
  index: int  # position among the turn's blocks
  span: tuple[int, int] = (0, 0)  # [start, end) of the whole block, tags included, in the turn


@dataclasses.dataclass(frozen=True)
class CallError:
  """A block that is not a usable call, and why (shown to the policy as an error observation)."""
  error: str
  raw: str
  index: int
  name: str | None = None  # when the block named a tool


# --- tool definitions -----------------------------------------------------------------------------


def function_tool(name: str, description: str, parameters: dict) -> dict:
  """An OpenAI function tool definition, checked (ToolSchemaError)."""
  tool = {"type": "function", "function": {"name": name, "description": description,
                                           "parameters": parameters}}
  check_tools([tool])
  return tool


def check_tools(tools: Any, where: str = "tools") -> list[dict]:
  """`tools` after checking each is {"type": "function", "function": {"name", "description"?,
  "parameters"?}} with a usable schema and a distinct name; ToolSchemaError naming the first bad one
  (a request with it deserves a 400)."""
  if not isinstance(tools, list):
    raise ToolSchemaError(f"must be a list of tools, got {type(tools).__name__}", where)
  names = set()
  for index, tool in enumerate(tools):
    at = f"{where}[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
      raise ToolSchemaError("must be an object with \"type\": \"function\"", at)
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
      raise ToolSchemaError(f"unknown key(s) {unknown}", at)
    function = tool.get("function")
    if not isinstance(function, dict):
      raise ToolSchemaError("must be an object", f"{at}.function")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
      raise ToolSchemaError(f"unknown key(s) {unknown}; allowed: name, description, parameters, "
                            f"strict", f"{at}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
      raise ToolSchemaError(f"name {name!r} must be 1-64 letters, digits, _ or -", f"{at}.function.name")
    if name in names:
      raise ToolSchemaError(f"name {name!r} is used by an earlier tool", f"{at}.function.name")
    names.add(name)
    if not isinstance(function.get("description", ""), str):
      raise ToolSchemaError("must be a string", f"{at}.function.description")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
      raise ToolSchemaError("must be a JSON schema of type \"object\"", f"{at}.function.parameters")
    check_schema(parameters, f"{at}.function.parameters")
  return tools


def check_schema(schema: Any, where: str) -> None:
  """ToolSchemaError naming the first keyword of `schema` outside the supported subset (see the
  module docstring) or of the wrong shape."""
  if not isinstance(schema, dict):
    raise ToolSchemaError(f"a schema must be an object, got {type(schema).__name__}", where)
  for key, value in schema.items():
    at = f"{where}.{key}"
    if key in _ANNOTATIONS:
      continue
    if key not in _ASSERTIONS:
      raise ToolSchemaError(f"keyword {key!r} is not supported (supported: "
                            f"{', '.join(sorted(_ASSERTIONS))})", at)
    if key == "type":
      kinds = value if isinstance(value, list) else [value]
      bad = [k for k in kinds if k not in (*_TYPES, "integer", "number")]
      if not kinds or bad:
        raise ToolSchemaError(f"unknown type(s) {bad or value!r}", at)
    elif key == "properties":
      if not isinstance(value, dict):
        raise ToolSchemaError("must be an object of schemas", at)
      for name, sub in value.items():
        check_schema(sub, f"{at}.{name}")
    elif key in ("items",) or (key == "additionalProperties" and not isinstance(value, bool)):
      check_schema(value, at)
    elif key in ("anyOf", "oneOf", "allOf"):
      if not isinstance(value, list) or not value:
        raise ToolSchemaError("must be a non-empty list of schemas", at)
      for index, sub in enumerate(value):
        check_schema(sub, f"{at}[{index}]")
    elif key == "required":
      if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ToolSchemaError("must be a list of property names", at)
    elif key == "enum":
      if not isinstance(value, list) or not value:
        raise ToolSchemaError("must be a non-empty list", at)
    elif key == "pattern":
      try:
        re.compile(value)
      except (re.error, TypeError) as error:
        raise ToolSchemaError(f"is not a regular expression: {error}", at) from None
    elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolSchemaError("must be a number", at)
    elif key in ("minLength", "maxLength", "minItems", "maxItems"):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ToolSchemaError("must be a whole number >= 0", at)


def _is_type(value: Any, kind: str) -> bool:
  if kind == "integer":
    return isinstance(value, int) and not isinstance(value, bool) or (
        isinstance(value, float) and value.is_integer())
  if kind == "number":
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  return isinstance(value, _TYPES[kind]) and not (kind != "boolean" and isinstance(value, bool))


def check_arguments(schema: dict, value: Any, where: str = "arguments") -> list[str]:
  """The ways `value` breaks `schema` (a checked schema), each naming its place; [] when it fits."""
  errors: list[str] = []
  kinds = schema.get("type")
  if kinds is not None:
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if not any(_is_type(value, k) for k in kinds):
      return [f"{where} must be {' or '.join(kinds)}, got {type(value).__name__} {_short(value)}"]
  if "enum" in schema and value not in schema["enum"]:
    errors.append(f"{where}={_short(value)} is not one of {schema['enum']}")
  if "const" in schema and value != schema["const"]:
    errors.append(f"{where}={_short(value)} must be {schema['const']!r}")
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    for key, test, word in (("minimum", lambda v, b: v >= b, ">="), ("maximum", lambda v, b: v <= b, "<="),
                            ("exclusiveMinimum", lambda v, b: v > b, ">"),
                            ("exclusiveMaximum", lambda v, b: v < b, "<")):
      if key in schema and not test(value, schema[key]):
        errors.append(f"{where}={value} must be {word} {schema[key]}")
  if isinstance(value, str):
    if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", float("inf")):
      errors.append(f"{where} has {len(value)} characters, outside "
                    f"[{schema.get('minLength', 0)}, {schema.get('maxLength', 'inf')}]")
    if "pattern" in schema and not re.search(schema["pattern"], value):
      errors.append(f"{where}={_short(value)} does not match {schema['pattern']!r}")
  if isinstance(value, list):
    if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", float("inf")):
      errors.append(f"{where} has {len(value)} items, outside "
                    f"[{schema.get('minItems', 0)}, {schema.get('maxItems', 'inf')}]")
    if "items" in schema:
      for index, item in enumerate(value):
        errors += check_arguments(schema["items"], item, f"{where}[{index}]")
  if isinstance(value, dict):
    properties = schema.get("properties", {})
    for name in schema.get("required", []):
      if name not in value:
        errors.append(f"{where} lacks the required {name!r}")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
      if name in properties:
        errors += check_arguments(properties[name], item, f"{where}.{name}")
      elif extra is False:
        errors.append(f"{where} has the unknown property {name!r} (known: {sorted(properties)})")
      elif isinstance(extra, dict):
        errors += check_arguments(extra, item, f"{where}.{name}")
  for key in ("allOf", "anyOf", "oneOf"):
    if key not in schema:
      continue
    fits = [not check_arguments(sub, value, where) for sub in schema[key]]
    if key == "allOf" and not all(fits):
      errors.append(f"{where} does not match every schema of allOf")
    if key == "anyOf" and not any(fits):
      errors.append(f"{where} matches no schema of anyOf")
    if key == "oneOf" and sum(fits) != 1:
      errors.append(f"{where} matches {sum(fits)} schemas of oneOf, not exactly one")
  return errors


def _short(value: Any) -> str:
  text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


# --- parsing --------------------------------------------------------------------------------------


def parse_tool_calls(text: Any) -> list[ToolCall | CallError]:
  """Every `<tool_call>` block of a turn in order, each a ToolCall or a CallError saying what is
  wrong (never raises); [] when the turn holds no block."""
  if not isinstance(text, str):
    return [CallError(f"the turn is a {type(text).__name__}, not text", "", 0)]
  found: list[ToolCall | CallError] = []
  position = 0
  while True:
    start = text.find(CALL_OPEN, position)
    stray = text.find(CALL_CLOSE, position)
    if stray != -1 and (start == -1 or stray < start):
      found.append(CallError(f"{CALL_CLOSE} without a {CALL_OPEN} before it", text[stray:stray + 40],
                             len(found)))
      position = stray + len(CALL_CLOSE)
      continue
    if start == -1:
      return found
    end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
    if end == -1:
      found.append(CallError(f"{CALL_OPEN} is never closed with {CALL_CLOSE}", text[start:start + 200],
                             len(found)))
      return found
    body = text[start + len(CALL_OPEN):end]
    position = end + len(CALL_CLOSE)
    block = _parse_block(body, len(found))
    found.append(dataclasses.replace(block, span=(start, position)) if isinstance(block, ToolCall)
                 else block)
    if len(found) > MAX_CALLS:
      return found[:MAX_CALLS] + [CallError(f"more than {MAX_CALLS} tool calls in one turn", "",
                                            MAX_CALLS)]


def _parse_block(body: str, index: int) -> ToolCall | CallError:
  raw = body.strip()
  try:
    call = json.loads(raw)
  except ValueError as error:
    return CallError(f"tool call {index + 1} is not valid JSON ({error})", raw[:200], index)
  if not isinstance(call, dict):
    return CallError(f"tool call {index + 1} must be a JSON object with \"name\" and \"arguments\"",
                     raw[:200], index)
  name = call.get("name")
  if not isinstance(name, str) or not name:
    return CallError(f"tool call {index + 1} has no \"name\" string", raw[:200], index)
  unknown = sorted(set(call) - {"name", "arguments"})
  if unknown:
    return CallError(f"tool call {index + 1} has unknown key(s) {unknown}; write "
                     f"{{\"name\": ..., \"arguments\": {{...}}}}", raw[:200], index, name)
  arguments = call.get("arguments", {})
  if isinstance(arguments, str):  # some models (and OpenAI's wire format) send a JSON string
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except ValueError as error:
      return CallError(f"tool call {index + 1}: \"arguments\" is a string that is not JSON ({error})",
                       raw[:200], index, name)
  if not isinstance(arguments, dict):
    return CallError(f"tool call {index + 1}: \"arguments\" must be a JSON object, got "
                     f"{type(arguments).__name__}", raw[:200], index, name)
  return ToolCall(name, arguments, raw, index)


def text_outside_calls(text: str) -> str:
  """The turn's text with every complete `<tool_call>` block removed, stripped."""
  return re.sub(re.escape(CALL_OPEN) + r".*?" + re.escape(CALL_CLOSE), "", text, flags=re.S).strip()


def format_call(name: str, arguments: dict) -> str:
  """A call as Qwen3's template writes it in an assistant turn (what a model learns to emit)."""
  body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
  return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


# --- rendering ------------------------------------------------------------------------------------


def render_with_tools(template, messages: Sequence[dict], tools: Sequence[dict], *,
                      add_generation_prompt: bool = True, **variables) -> str:
  """The conversation with `tools` offered: through the chat template (`template.render(...,
  tools=...)`), or, with `template=None`, as plain text: the tools under PLAIN_TOOLS_HEADER before
  the first message, tool results as <tool_response> blocks."""
  if template is not None:
    return template.render(messages, add_generation_prompt=add_generation_prompt, tools=list(tools),
                           **variables)
  parts = [PLAIN_TOOLS_HEADER + "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in tools)]
  for message in messages:
    if message["role"] == "tool":
      parts.append(plain_tool_results([message]))
    else:
      content = message.get("content") or ""
      calls = "".join("\n" + format_call(c["function"]["name"], _arguments_of(c))
                      for c in message.get("tool_calls") or [])
      parts.append(content + calls + ("\n" if message["role"] != "assistant" else ""))
  return "".join(parts)


def render_tool_results(template, results: Sequence[dict], tools: Sequence[dict] = ()) -> str:
  """The text an observation adds after an assistant turn: the tool messages `results` and the next
  generation prompt, as `template` renders them (plain_tool_results without a template).

  Computed as render(base + results) minus render(base) for a fixed base conversation whose
  assistant turn carries a reasoning block: Qwen3's template drops an empty <think> block from an
  assistant turn once it is no longer the last message, so re-rendering a conversation is not
  prefix-stable; an engine keeps the turn it generated and appends this text. ValueError (naming the
  template) if the template's rendering of the base is not a prefix even then."""
  if template is None:
    return plain_tool_results(results)
  calls = [{"id": r.get("tool_call_id", f"call_{i}"), "type": "function",
            "function": {"name": r.get("name", "tool"), "arguments": {}}} for i, r in enumerate(results)]
  base = [{"role": "user", "content": "."},
          {"role": "assistant", "content": "<think>\n.\n</think>\n\n.", "tool_calls": calls}]
  before = template.render(base, add_generation_prompt=False, tools=list(tools) or None)
  after = template.render(base + list(results), add_generation_prompt=True, tools=list(tools) or None)
  if not after.startswith(before):
    raise ValueError(f"chat template in {template.source}: adding tool results rewrites the "
                     f"conversation before them, so they cannot be appended as an observation.")
  return after[len(before):]


def plain_tool_results(messages: Sequence[dict]) -> str:
  """Tool messages as the plain format shows them: one <tool_response> block each."""
  return "".join(f"\n{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}\n" for m in messages)


def _arguments_of(call: dict) -> dict:
  arguments = call["function"].get("arguments", {})
  return json.loads(arguments) if isinstance(arguments, str) else arguments
