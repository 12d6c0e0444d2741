"""Tiny Hugging Face model folders built here (no downloads), for the real-model tests.

`save_tiny_qwen3_moe(folder)` writes what a Hugging Face Qwen3-MoE folder holds: config.json and
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
