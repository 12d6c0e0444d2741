"""The OpenAI HTTP API's request and response bodies, without a web framework: parse and check a
`/v1/completions` or `/v1/chat/completions` body into a `Generation`, and build the JSON objects
(whole responses and server-sent-event chunks) the official clients read.

Every problem is an `APIError` with an HTTP status and OpenAI's error body
{"error": {"message", "type", "param", "code"}}, the message naming the parameter. Parameters the
engine cannot honour (penalties, top log-probs, tools, ...) are rejected, not ignored. `n` samples
run as n requests of the engine; `logprobs` returns each chosen token's log-prob (the distribution it
was drawn from).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from meshrl.model.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the API's default for /v1/completions
MAX_STOP_STRINGS = 4
MAX_N = 16  # samples per request
ROLES = ("system", "developer", "user", "assistant", "tool")

# Accepted only at the value that changes nothing (each names what is allowed).
_NEUTRAL = {
    "best_of": (1, None), "echo": (False,), "suffix": ("",), "top_logprobs": (0, None), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "logit_bias": ({},), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    "parallel_tool_calls": (False, True), "response_format": ({"type": "text"},)}
_IGNORED = ("user", "metadata", "store", "service_tier")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
           "logprobs")
COMPLETION_KEYS = frozenset(_COMMON + ("prompt",))
CHAT_KEYS = frozenset(_COMMON + ("messages", "max_completion_tokens"))


class APIError(Exception):
  """An error response: HTTP `status` and OpenAI's error body."""

  def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Generation:
  """A checked request: what to generate and how to answer."""
  prompt_ids: tuple[int, ...]
  max_tokens: int
  temperature: float
  top_p: float
  seed: int | None
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  chat: bool
  n: int = 1  # samples
  logprobs: bool = False  # each chosen token's log-prob in the answer


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
  return APIError(400, message, param=param, code=code)


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open=False) -> float:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise _bad(f"`{name}` must be a number (got {value!r}).", name)
  if value < low or value > high or (low_open and value == low):
    interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
    raise _bad(f"`{name}`={value} must be in {interval}.", name)
  return float(value)


def _integer(body: dict, name: str) -> int | None:
  value = body.get(name)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int):
    raise _bad(f"`{name}` must be an integer (got {value!r}).", name)
  return value


def _check_keys(body: Any, allowed: frozenset) -> None:
  if not isinstance(body, dict):
    raise _bad("the request body must be a JSON object.", None)
  for key, value in body.items():
    if key in allowed or key in _IGNORED:
      continue
    if key in _NEUTRAL:
      if value is not None and value not in _NEUTRAL[key]:
        allowed_values = " or ".join(repr(v) for v in _NEUTRAL[key])
        raise _bad(f"`{key}`={value!r} is not supported by this server (only {allowed_values}).", key,
                   "unsupported_parameter")
      continue
    raise _bad(f"unrecognized request argument supplied: `{key}`.", key, "unsupported_parameter")


def check_model(body: dict, model_name: str) -> None:
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise _bad("`model` is required (a string).", "model")
  if model != model_name:
    raise APIError(404, f"the model `{model}` does not exist; this server serves `{model_name}`.",
                   param="model", code="model_not_found")


def _stop_strings(body: dict) -> tuple[str, ...]:
  stop = body.get("stop")
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
    raise _bad("`stop` must be a string or a list of strings.", "stop")
  if len(stops) > MAX_STOP_STRINGS:
    raise _bad(f"`stop` has {len(stops)} strings; at most {MAX_STOP_STRINGS}.", "stop")
  return tuple(s for s in stops if s)


def _generation(body: dict, prompt_ids: list[int], context: int, *, chat: bool,
                max_tokens_key: str = "max_tokens") -> Generation:
  if not prompt_ids:
    raise _bad("the prompt is empty (0 tokens).", "messages" if chat else "prompt")
  room = context - len(prompt_ids)
  if room < 1:
    raise _bad(f"the prompt is {len(prompt_ids)} tokens; this model's context length is {context} "
               "(prompt + completion).", "messages" if chat else "prompt", "context_length_exceeded")
  max_tokens = _integer(body, max_tokens_key)
  if max_tokens is None and max_tokens_key != "max_tokens":
    max_tokens = _integer(body, "max_tokens")
  if max_tokens is None:
    max_tokens = room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
  elif max_tokens < 1:
    raise _bad(f"`{max_tokens_key}`={max_tokens} must be at least 1.", max_tokens_key)
  elif len(prompt_ids) + max_tokens > context:
    raise _bad(f"the prompt ({len(prompt_ids)} tokens) plus `{max_tokens_key}` ({max_tokens}) exceeds "
               f"this model's context length of {context} tokens.", max_tokens_key, "context_length_exceeded")
  stream = body.get("stream") or False
  if not isinstance(stream, bool):
    raise _bad("`stream` must be true or false.", "stream")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict) or set(options) - {"include_usage"}:
    raise _bad("`stream_options` supports only {\"include_usage\": bool}.", "stream_options")
  seed = _integer(body, "seed")
  n = _integer(body, "n")
  n = 1 if n is None else n
  if not 1 <= n <= MAX_N:
    raise _bad(f"`n`={n} must lie in [1, {MAX_N}].", "n")
  logprobs = body.get("logprobs")
  if chat:
    if logprobs not in (None, True, False):
      raise _bad("`logprobs` must be true or false.", "logprobs")
  elif logprobs not in (None, False, 0):  # the legacy API's integer: how many top log-probs
    raise _bad(f"`logprobs`={logprobs!r}: only 0 (each chosen token's log-prob, no alternatives) is "
               "supported.", "logprobs")
  return Generation(n=n, logprobs=logprobs is not None and logprobs is not False, prompt_ids=tuple(prompt_ids), max_tokens=max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                    seed=None if seed is None else seed % 2**31, stop=_stop_strings(body), stream=stream,
                    include_usage=bool(options.get("include_usage")), chat=chat)


def parse_completion(body: Any, tokenizer: Tokenizer, *, context: int, model_name: str) -> Generation:
  """A /v1/completions body: `prompt` is a string, a list of token ids, or a list of one of those."""
  _check_keys(body, COMPLETION_KEYS)
  check_model(body, model_name)
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]
  if isinstance(prompt, str):
    ids = tokenizer.encode(prompt)
  elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
    if not all(0 <= t < tokenizer.vocab_size for t in prompt):
      raise _bad(f"`prompt` token ids must be in [0, {tokenizer.vocab_size}).", "prompt")
    ids = list(prompt)
  elif isinstance(prompt, list) and len(prompt) > 1:
    raise _bad("`prompt` with several prompts is not supported; send one request per prompt.", "prompt")
  else:
    raise _bad("`prompt` is required: a string or a list of token ids.", "prompt")
  return _generation(body, ids, context, chat=False)


def _message_text(message: Any, i: int) -> dict:
  where = f"messages[{i}]"
  if not isinstance(message, dict):
    raise _bad(f"`{where}` must be an object with `role` and `content`.", where)
  role = message.get("role")
  if role not in ROLES:
    raise _bad(f"`{where}.role`={role!r}; choose one of {', '.join(ROLES)}.", f"{where}.role")
  if set(message) - {"role", "content", "name"}:
    extra = sorted(set(message) - {"role", "content", "name"})
    raise _bad(f"`{where}` has unsupported fields {extra} (tool calls are not supported).", where)
  content = message.get("content")
  if isinstance(content, list):
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
      raise _bad(f"`{where}.content` parts must all be {{\"type\": \"text\", \"text\": ...}} "
                 "(images and audio are not supported).", f"{where}.content")
    content = "".join(p["text"] for p in content)
  if not isinstance(content, str):
    raise _bad(f"`{where}.content` must be a string or a list of text parts.", f"{where}.content")
  return {"role": "system" if role == "developer" else role, "content": content}


def render_chat(tokenizer: Tokenizer, messages: list[dict]) -> str:
  """The conversation as prompt text: the tokenizer's chat template (model/chat_template.py), or,
  for a tokenizer without one (the byte tokenizer), "<|role|>\\ncontent\\n" turns then "<|assistant|>\\n"."""
  template = getattr(tokenizer, "chat_template", None)
  if template is not None:
    return template.render(messages, add_generation_prompt=True)
  return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def parse_chat(body: Any, tokenizer: Tokenizer, *, context: int, model_name: str) -> Generation:
  """A /v1/chat/completions body: a non-empty `messages` list rendered by the chat template."""
  _check_keys(body, CHAT_KEYS)
  check_model(body, model_name)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _bad("`messages` must be a non-empty list of {role, content} objects.", "messages")
  turns = [_message_text(m, i) for i, m in enumerate(messages)]
  try:
    text = render_chat(tokenizer, turns)
  except ValueError as e:
    raise _bad(f"`messages` cannot be rendered: {e}", "messages") from None
  return _generation(body, tokenizer.encode(text), context, chat=True,
                     max_tokens_key="max_completion_tokens" if "max_completion_tokens" in body
                     else "max_tokens")


# --- responses ----------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
  return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def token_logprobs(gen: Generation, tokenizer: Tokenizer, tokens, logprobs):
  """The `logprobs` object of a choice for chosen tokens and their log-probs (None unless asked)."""
  if not gen.logprobs:
    return None
  texts = [tokenizer.decode([t], stop_at_eos=False) for t in tokens]
  if gen.chat:
    return {"content": [{"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")),
                         "top_logprobs": []} for text, lp in zip(texts, logprobs)]}
  offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
  return {"tokens": texts, "token_logprobs": [float(lp) for lp in logprobs], "top_logprobs": None,
          "text_offset": offsets}


def response(rid: str, model: str, gen: Generation, choices: list[dict], completion_tokens: int) -> dict:
  """A whole (non-streamed) completion or chat completion; choices: [{text, finish, logprobs}]."""
  out = []
  for index, c in enumerate(choices):
    if gen.chat:
      out.append({"index": index, "message": {"role": "assistant", "content": c["text"]},
                  "finish_reason": c["finish"], "logprobs": c.get("logprobs")})
    else:
      out.append({"index": index, "text": c["text"], "finish_reason": c["finish"], "logprobs": c.get("logprobs")})
  return {"id": rid, "object": "chat.completion" if gen.chat else "text_completion",
          "created": int(time.time()), "model": model, "choices": out,
          "usage": usage(len(gen.prompt_ids), completion_tokens)}


def chunk(rid: str, model: str, gen: Generation, text: str | None, finish: str | None = None, *,
          role: bool = False, index: int = 0, logprobs=None) -> dict:
  """One streamed event of choice `index`: a text delta (with its tokens' log-probs) and/or the
  finish reason."""
  if gen.chat:
    delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
    choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
  else:
    choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
  return {"id": rid, "object": "chat.completion.chunk" if gen.chat else "text_completion",
          "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, gen: Generation, completion_tokens: int) -> dict:
  """The last streamed event with stream_options.include_usage: no choices, the usage."""
  return {"id": rid, "object": "chat.completion.chunk" if gen.chat else "text_completion",
          "created": int(time.time()), "model": model, "choices": [],
          "usage": usage(len(gen.prompt_ids), completion_tokens)}
