"""Chat templates: the Jinja templates Hugging Face tokenizers ship, rendered in a Jinja sandbox.

  template = load_chat_template("/ckpt/Qwen3-30B-A3B")        # None when the folder has none
  text = template.render([{"role": "user", "content": "2+2="}], add_generation_prompt=True)

Where a template is read from (the order transformers follows): `chat_template.jinja` beside the
tokenizer, else `tokenizer_config.json`'s "chat_template" (a string, or a list of
{"name", "template"} of which "default" is used).

The environment is the one transformers renders with (`transformers/utils/chat_template_utils.py`):
an `ImmutableSandboxedEnvironment` (templates from the Hub are untrusted code) with trim_blocks,
lstrip_blocks and loop controls, a `tojson` filter that does not escape HTML, and the globals
`raise_exception` and `strftime_now`; the special tokens (`bos_token`, `eos_token`, ...) of
tokenizer_config.json are passed as variables, and `{% generation %}` blocks render their body.
Any failure, at compile or render time, is a ValueError naming the template's file.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# tokenizer_config.json keys passed to the template as variables (transformers' special_tokens_map).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token", "additional_special_tokens")


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): the body."""
  tags = {"generation"}

  def parse(self, parser):
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _token_text(value) -> Any:
  """A special token as tokenizer_config.json stores it ("<s>" or {"content": "<s>", ...})."""
  if isinstance(value, dict):
    return value.get("content")
  if isinstance(value, list):
    return [_token_text(v) for v in value]
  return value


class ChatTemplate:
  """A compiled chat template and the special-token variables it is rendered with.

  Args:
    text: the Jinja source.
    source: where it came from (a file path), named in every error.
    special_tokens: {"bos_token": "<s>", "eos_token": "</s>", ...}.
  """

  def __init__(self, text: str, source: str, special_tokens: dict[str, Any] | None = None):
    self.text, self.source = text, source
    self.special_tokens = dict(special_tokens or {})
    try:
      self._template = _environment().from_string(text)
    except jinja2.exceptions.TemplateError as e:
      raise ValueError(f"chat template in {source} does not compile: {type(e).__name__}: {e}") from None

  def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
             tools: Sequence[dict] | None = None, **variables) -> str:
    """The conversation `messages` ([{"role", "content"}, ...], assistant turns may hold
    "tool_calls", tool results are {"role": "tool", ...}) as the model's prompt text.

    `tools`: OpenAI function tool definitions the template offers the model (model/tool_calls.py).
    `variables` (e.g. enable_thinking=False) override the special tokens of the same name.
    Raises ValueError naming the template's file and the Jinja error when rendering fails.
    """
    try:
      return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                   documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **variables})
    except Exception as e:  # pylint: disable=broad-except  (any template bug: TypeError, Undefined...)
      raise ValueError(f"chat template in {self.source} does not render "
                       f"{len(messages)} message(s): {type(e).__name__}: {e}") from None


def _read_config(folder: str) -> dict:
  path = os.path.join(folder, CONFIG_FILE)
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None


def _template_from_config(config: dict, path: str) -> str | None:
  template = config.get("chat_template")
  if template is None or isinstance(template, str):
    return template
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if "default" not in named:
      raise ValueError(f"{path}: chat_template lists templates {sorted(map(str, named))} but none "
                       "named 'default'.")
    return named["default"]
  raise ValueError(f"{path}: chat_template is a {type(template).__name__}, not a string or a list "
                   "of {name, template}.")


def load_chat_template(folder: str) -> ChatTemplate | None:
  """The chat template of the tokenizer in `folder`, or None when it has none."""
  config = _read_config(folder)
  special_tokens = {key: _token_text(config[key]) for key in _SPECIAL_TOKEN_KEYS
                    if config.get(key) is not None}
  jinja_file = os.path.join(folder, TEMPLATE_FILE)
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return ChatTemplate(f.read(), jinja_file, special_tokens)
  config_file = os.path.join(folder, CONFIG_FILE)
  text = _template_from_config(config, config_file)
  return None if text is None else ChatTemplate(text, config_file, special_tokens)
