"""GRPO from a local Qwen3-MoE Hugging Face folder (e.g. Qwen3-30B-A3B): its weights, tokenizer,
chat template and stop tokens.

Run it:
  python scripts/rl.py --config=configs/hf_qwen3_moe.py:/models/Qwen3-30B-A3B \
      --config.data.jsonl=math.jsonl --config.mesh.fsdp=16 --config.mesh.expert=4
  python scripts/export_hf.py --config=configs/hf_qwen3_moe.py:/models/Qwen3-30B-A3B \
      --checkpoint=runs/hf_Qwen3-30B-A3B --out=/models/Qwen3-30B-A3B-grpo
Expect: the model starts from the folder's weights (model.init_from) with no warm start; prompts
(the JSONL rows, or the built-in arithmetic tasks) are rendered as one user turn of its chat template
and a response ends at <|im_end|> or <|endoftext|>. Every model.* / moe.* architecture field comes
from the folder's config.json, so the import checks pass by construction.

The argument (the folder) is required. Loading this preset reads config.json with
configs/hf_config.py (no jax is imported, so --cpu_devices works as with any preset).
"""

import json
import os

from meshrl.configs.hf_config import load_hf_config
from meshrl.configs.loader import ConfigError, load_preset


def _check_folder(folder: str) -> None:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"configs/hf_qwen3_moe.py:{folder}: {path} does not exist; the argument must be a "
                      "Hugging Face Qwen3-MoE folder.")
  with open(path, encoding="utf-8") as f:
    model_type = json.load(f).get("model_type")
  if model_type != "qwen3_moe":
    raise ConfigError(f"configs/hf_qwen3_moe.py:{folder} holds model_type={model_type!r}, not "
                      "'qwen3_moe'.")


def get_config(arg=None):
  if not arg:
    raise ConfigError("configs/hf_qwen3_moe.py needs the model folder: "
                      "--config=configs/hf_qwen3_moe.py:/path/to/Qwen3-MoE-folder")
  folder = os.path.abspath(os.path.expanduser(arg))
  _check_folder(folder)
  try:
    config = load_hf_config(folder, base=load_preset("base"))  # every model.* / moe.* field of the folder
  except ValueError as e:
    raise ConfigError(f"configs/hf_qwen3_moe.py:{folder}: {e}") from None
  config.unlock()
  config.name = "hf_" + os.path.basename(folder.rstrip(os.sep))
  config.model.init_from = folder
  config.model.tokenizer = folder  # tokenizer.json, its chat template and generation_config.json
  config.model.dtype = "bfloat16"  # compute; parameters and optimizer moments stay float32
  config.model.remat = "full"
  config.attention.impl = "blockwise"  # never builds the [S, S] score matrix
  config.moe.aux_loss_coef = 0.001  # Qwen3-MoE's router_aux_loss_coef
  config.moe.z_loss_coef = 0.0
  config.optim.learning_rate = 1e-6
  config.optim.warmup_steps = 10
  config.optim.weight_decay = 0.01
  config.rl.num_steps = 500
  config.rl.sft_steps = 0  # the checkpoint is already a chat model
  config.rl.prompts_per_step = 32
  config.rl.group_size = 8
  config.rl.num_minibatches = 4
  config.rl.max_prompt_len = 512
  config.rl.max_new_tokens = 2048  # room to reason before the answer
  config.rl.kl_coef = 0.0
  config.rl.overlong_buffer = 256  # DAPO overlong shaping over the last 256 tokens
  config.data.tasks = "arithmetic:1.0"  # replace or extend with data.jsonl
  config.data.difficulty = 4
  config.checkpoint.every = 20
  return config
