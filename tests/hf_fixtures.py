"""Tiny Hugging Face model folders built here (no downloads), for the real-model tests.

`save_tokenizer(folder, chat_template=QWEN3_CHAT_TEMPLATE)` gives a tokenizer with Qwen3's real
chat template (tools, tool calls, tool results). `save_tiny_qwen3_moe(folder)` writes what a Hugging
Face Qwen3-MoE folder holds: config.json and
model.safetensors saved by `transformers` (a random 2-layer, 4-expert model in float32), a
byte-level BPE tokenizer.json made with `tokenizers` whose special tokens come after the learnt
vocabulary as Qwen's do, tokenizer_config.json with a Qwen-style ChatML chat template, and
generation_config.json. tests/conftest.py offers it as the session fixture `tiny_qwen3_moe`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

# Qwen2.5-style ChatML: a default system turn, whitespace control and trim/lstrip blocks exercised.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('unknown role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if not (message.role == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
# Qwen3's chat template, as Qwen/Qwen3-0.6B's tokenizer_config.json ships it (Apache-2.0; the
# model's own data format, kept verbatim so tool-call rendering and parsing are tested against
# the real thing): tools in the system turn, <tool_call> blocks in assistant turns, tool results
# as <tool_response> blocks of a user turn, <think> handling.
QWEN3_CHAT_TEMPLATE = (
    '{%- if tools %}\n'
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    '    {%- endif %}\n'
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n'
    '        {{- "\\n" }}\n'
    '        {{- tool | tojson }}\n'
    '    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    '{%- else %}\n'
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n'
    '{%- for message in messages[::-1] %}\n'
    '    {%- set index = (messages|length - 1) - loop.index0 %}\n'
    '    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith(\'<tool_response>\') and message.content.endswith(\'</tool_response>\')) %}\n'
    '        {%- set ns.multi_step_tool = false %}\n'
    '        {%- set ns.last_query_index = index %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- for message in messages %}\n'
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    '        {%- set content = message.content %}\n'
    "        {%- set reasoning_content = '' %}\n"
    '        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}\n'
    '            {%- set reasoning_content = message.reasoning_content %}\n'
    '        {%- else %}\n'
    "            {%- if '</think>' in message.content %}\n"
    "                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\n"
    '            {%- endif %}\n'
    '        {%- endif %}\n'
    '        {%- if loop.index0 > ns.last_query_index %}\n'
    '            {%- if loop.last or (not loop.last and reasoning_content) %}\n'
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    '            {%- else %}\n'
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    '            {%- endif %}\n'
    '        {%- else %}\n'
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    '        {%- endif %}\n'
    '        {%- if message.tool_calls %}\n'
    '            {%- for tool_call in message.tool_calls %}\n'
    '                {%- if (loop.first and content) or (not loop.first) %}\n'
    "                    {{- '\\n' }}\n"
    '                {%- endif %}\n'
    '                {%- if tool_call.function %}\n'
    '                    {%- set tool_call = tool_call.function %}\n'
    '                {%- endif %}\n'
    '                {{- \'<tool_call>\\n{"name": "\' }}\n'
    '                {{- tool_call.name }}\n'
    '                {{- \'", "arguments": \' }}\n'
    '                {%- if tool_call.arguments is string %}\n'
    '                    {{- tool_call.arguments }}\n'
    '                {%- else %}\n'
    '                    {{- tool_call.arguments | tojson }}\n'
    '                {%- endif %}\n'
    "                {{- '}\\n</tool_call>' }}\n"
    '            {%- endfor %}\n'
    '        {%- endif %}\n'
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    '        {%- endif %}\n'
    "        {{- '\\n<tool_response>\\n' }}\n"
    '        {{- message.content }}\n'
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    '        {%- endif %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|im_start|>assistant\\n' }}\n"
    '    {%- if enable_thinking is defined and enable_thinking is false %}\n'
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}')
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_VOCAB = 300  # at most: byte alphabet (256) + merges; the specials follow the learnt ids
MODEL_VOCAB = 320  # the embedding has spare rows, as Qwen's 151936 > 151669 tokens
_CORPUS = ["12+7=19", "3*4=12", "9-5=4", "What is 2+2? The answer is 4.",
           "Compute 15+27 and give the answer.", "the answer is 42", "0 1 2 3 4 5 6 7 8 9"] * 20


@dataclasses.dataclass(frozen=True)
class TinyHF:
  path: str  # the folder
  eos_id: int  # <|endoftext|> (tokenizer_config eos_token, generation_config eos_token_id)
  im_start_id: int
  im_end_id: int  # the chat template's end of turn
  learnt_vocab: int  # ids below this are the BPE vocabulary, above it the specials


def save_tokenizer(folder: str, *, chat_template: str | None = CHATML, **config_fields) -> dict[str, int]:
  """Writes tokenizer.json and tokenizer_config.json into `folder`; returns the special ids and
  "learnt", the size of the learnt vocabulary (the first special's id). `config_fields` replace
  tokenizer_config.json's (e.g. bos_token="<|endoftext|>")."""
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
  tokenizer.add_special_tokens(list(SPECIALS))
  os.makedirs(folder, exist_ok=True)
  tokenizer.save(os.path.join(folder, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
            "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 128}
  if chat_template is not None:
    config["chat_template"] = chat_template
  config.update(config_fields)
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  return {"learnt": tokenizer.get_vocab_size(with_added_tokens=False),
          **{name: tokenizer.token_to_id(name) for name in SPECIALS}}


def save_tiny_qwen3_moe(folder: str, *, seed: int = 0) -> TinyHF:
  """A random tiny Qwen3-MoE saved by transformers (float32) plus its tokenizer files."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  ids = save_tokenizer(folder)
  eos = ids["<|endoftext|>"]
  config = transformers.Qwen3MoeConfig(
      vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
      num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
      tie_word_embeddings=False, initializer_range=0.2,  # large weights: routing far from ties
      bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  model.float().save_pretrained(folder)
  with open(os.path.join(folder, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos}, f)
  return TinyHF(folder, eos, ids["<|im_start|>"], ids["<|im_end|>"], ids["learnt"])


def hf_logits(folder: str, tokens: np.ndarray) -> np.ndarray:
  """[B, S] ids -> [B, S, V] float32 logits of the folder's model, computed by transformers."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, attn_implementation="eager", dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
