"""Chat templates render as transformers' apply_chat_template does; stop tokens; errors; sandbox."""

import json
import os

import pytest

from meshrl.model.chat_template import load_chat_template
from meshrl.model.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_config

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12+7?"}],
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "3*4="}],
    [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
     {"role": "user", "content": "naïve ∑ \"quoted\" <b>"}],
]
# Another family: BOS written by the template, tojson, loop controls, generation blocks, and block
# tags on their own indented lines (trim_blocks / lstrip_blocks decide the whitespace).
LLAMA_LIKE = """{{ bos_token }}
{% for message in messages %}
  {% if loop.index0 > 4 %}{% break %}{% endif %}
<|im_start|>{{ message['role'] }}
  {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{% endgeneration %}
  {% else %}
{{ message['content'] | tojson }}
  {% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _reference(folder, messages, add_generation_prompt):
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
  return tokenizer, tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", ["chatml", "llama_like"])
def test_renders_like_transformers(template, hf_fixtures, tmp_path):
  extra = {} if template == "chatml" else {"bos_token": "<|endoftext|>"}
  hf_fixtures.save_tokenizer(str(tmp_path), chat_template=(
      hf_fixtures.CHATML if template == "chatml" else LLAMA_LIKE), **extra)
  ours = load_chat_template(str(tmp_path))
  tok = HFTokenizer(str(tmp_path))
  for messages in CONVERSATIONS:
    for add_generation_prompt in (True, False):
      reference_tok, want = _reference(tmp_path, messages, add_generation_prompt)
      assert ours.render(messages, add_generation_prompt=add_generation_prompt) == want
  text = "What is 12+7?"
  reference_tok, want = _reference(tmp_path, CONVERSATIONS[0], True)
  assert tok.has_chat_template and tok.render_prompt(text) == want
  want_ids = reference_tok(want, add_special_tokens=False).input_ids
  assert tok.encode(tok.render_prompt(text)) == want_ids  # one BOS: the template's
  if template == "llama_like":
    assert want_ids[0] == tok.bos_id and want_ids[1] != tok.bos_id
    assert tok.encode("12+7=")[0] == tok.bos_id  # plain text still gets its BOS


def test_jinja_file_wins_and_named_template_lists(hf_fixtures, tmp_path):
  hf_fixtures.save_tokenizer(str(tmp_path), chat_template=[
      {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": hf_fixtures.CHATML}])
  _, want = _reference(tmp_path, CONVERSATIONS[1], True)
  assert load_chat_template(str(tmp_path)).render(CONVERSATIONS[1]) == want
  (tmp_path / "chat_template.jinja").write_text(LLAMA_LIKE)
  _, want = _reference(tmp_path, CONVERSATIONS[1], True)
  rendered = load_chat_template(str(tmp_path)).render(CONVERSATIONS[1])
  assert rendered == want and "\"Answer with a number.\"" in rendered


def test_stop_ids_hold_eos_end_of_turn_and_generation_config(hf_fixtures, tmp_path):
  ids = hf_fixtures.save_tokenizer(str(tmp_path))
  eos, im_start, im_end = ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]
  tok = HFTokenizer(str(tmp_path))
  assert (tok.eos_id, tok.stop_ids) == (eos, (eos, im_end))  # <|im_end|> found in the template
  assert tok.vocab_size == ids["learnt"] + 3  # the added specials count
  assert tok.decode(tok.encode("12+7=19", add_bos=False) + [im_end, tok.encode("5", add_bos=False)[0]]) \
      == "12+7=19"  # stops at the end of turn
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, im_start]}))
  assert HFTokenizer(str(tmp_path)).stop_ids == (eos, im_start, im_end)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 10**6]}))
  with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id \[1000000\] outside"):
    HFTokenizer(str(tmp_path))
  os.remove(tmp_path / "generation_config.json")
  hf_fixtures.save_tokenizer(str(tmp_path), chat_template=None)
  tok = HFTokenizer(str(tmp_path))
  assert (tok.has_chat_template, tok.stop_ids, tok.render_prompt("2+2=")) == (False, (eos,), "2+2=")


def test_byte_tokenizer_from_config():
  class Cfg:
    class model:  # pylint: disable=invalid-name
      tokenizer = "byte"
  tok = tokenizer_from_config(Cfg)
  assert isinstance(tok, ByteTokenizer)
  assert (tok.stop_ids, tok.has_chat_template, tok.render_prompt("1+1=")) == ((257,), False, "1+1=")
  Cfg.model.tokenizer = "/no/such/tokenizer.json"
  with pytest.raises(ValueError, match="model.tokenizer='/no/such/tokenizer.json'"):
    tokenizer_from_config(Cfg)


@pytest.mark.parametrize("template, error", [
    ("{% for m in messages %}{{ m.content }", "does not compile: TemplateSyntaxError"),
    ("{{ raise_exception('only one user turn') }}", "does not render 1 message.*only one user turn"),
    ("{{ messages[3].content.upper() }}", "does not render 1 message.*UndefinedError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),  # the sandbox holds
])
def test_template_errors_name_the_file(template, error, hf_fixtures, tmp_path):
  hf_fixtures.save_tokenizer(str(tmp_path), chat_template=template)
  with pytest.raises(ValueError, match="tokenizer_config.json.*" + error):
    load_chat_template(str(tmp_path)).render(CONVERSATIONS[0])
  with pytest.raises(ValueError, match="tokenizer_config.json.*" + error):
    HFTokenizer(str(tmp_path)).render_prompt("1+1=")  # loads (stop-token probe tolerates it), raises here
  (tmp_path / "chat_template.jinja").write_text(template)
  with pytest.raises(ValueError, match="chat_template.jinja.*" + error):
    load_chat_template(str(tmp_path)).render(CONVERSATIONS[0])

