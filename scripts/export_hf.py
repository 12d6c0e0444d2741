"""Writes a meshrl checkpoint as a Hugging Face folder that `transformers` loads.

  python scripts/export_hf.py --config=configs/hf_qwen3_moe.py:/models/Qwen3-30B-A3B \
      --checkpoint=runs/hf_Qwen3-30B-A3B --out=/models/Qwen3-30B-A3B-grpo [--step=N] [--dtype=bfloat16]

--config (with any --config.a.b=value) is the run's config: it decides the model the checkpoint is
read into and must agree with the config saved in the checkpoint on every architecture field.
--checkpoint is a work directory or its checkpoints/ folder (the latest step unless --step).
The folder gets config.json and safetensors (model/convert.py `export_checkpoint`, architecture
from --architecture or the config) and, when model.tokenizer is a tokenizer.json, the tokenizer's
files beside it (tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json,
...); a generation_config.json listing the stop tokens is written when the tokenizer has none.
Bad input is one line naming the flag or field, before anything is read into memory or written.
"""

import json
import os
import shutil
import sys

from meshrl.configs import cli

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "added_tokens.json")


def _flags(parser):
  parser.add_argument("--checkpoint", required=True, help="work directory or its checkpoints/ folder")
  parser.add_argument("--out", required=True, help="Hugging Face folder to write (new or empty)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--dtype", default=None, help="tensor dtype written (default: the parameters')")
  parser.add_argument("--architecture", default=None,
                      help="Qwen3MoeForCausalLM, DeepseekV3ForCausalLM or, for a reward model (scripts/"
                           "train_rm.py), Qwen3MoeForSequenceClassification (default: a causal LM of the config)")


def _architecture(cfg, given: str | None) -> str:
  if given:
    return given
  return "DeepseekV3ForCausalLM" if cfg.model.attention_type == "mla" else "Qwen3MoeForCausalLM"


def _tokenizer_folder(cfg) -> str | None:
  name = cfg.model.tokenizer
  if name == "byte":
    return None
  return name if os.path.isdir(name) else os.path.dirname(os.path.abspath(name))


def _check(args, cfg) -> tuple[str, int, str]:
  """Everything that can be checked before reading the checkpoint; returns (folder, step, arch)."""
  from meshrl.model import convert  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import model_config  # pylint: disable=import-outside-toplevel
  from meshrl.train import init_from  # pylint: disable=import-outside-toplevel
  convert.check_export_dtype(args.dtype, field="--dtype")
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    raise ValueError(f"--out={args.out!r} is a file; give a new or empty folder.")
  if os.path.isdir(args.out) and os.listdir(args.out):
    raise ValueError(f"--out={args.out!r} exists and is not empty; give a new or empty folder.")
  if not os.path.exists(args.checkpoint):
    raise ValueError(f"--checkpoint={args.checkpoint!r} does not exist.")
  folder = init_from.checkpoint_dir(args.checkpoint)
  if folder is None:
    raise ValueError(f"--checkpoint={args.checkpoint!r} holds no meshrl checkpoint "
                     "(<step>/state, or checkpoints/<step>/state).")
  steps = init_from.checkpoint_steps(folder)
  step = steps[-1] if args.step is None else args.step
  if step not in steps:
    raise ValueError(f"--step={step} is not in {folder}; saved steps: {steps}.")
  with cfg.unlocked():
    cfg.model.init_from = folder
  try:
    init_from.check_model_source(cfg)
  except ValueError as e:
    raise ValueError(str(e).replace("model.init_from", "--checkpoint")) from None
  architecture = _architecture(cfg, args.architecture)
  if architecture not in convert.ARCHITECTURES:
    raise ValueError(f"--architecture={architecture!r} is not supported; supported: "
                     f"{', '.join(convert.ARCHITECTURES)}.")
  convert.ARCHITECTURES[architecture].write(model_config(cfg))  # raises if inexpressible
  if cfg.model.tokenizer != "byte":
    init_from.check_tokenizer(cfg)
  return folder, step, architecture


def _copy_tokenizer(cfg, out: str, tokenizer) -> list[str]:
  source = _tokenizer_folder(cfg)
  if source is None:
    return []
  written = []
  for name in TOKENIZER_FILES:
    path = os.path.join(source, name)
    if os.path.isfile(path):
      written.append(shutil.copy(path, os.path.join(out, name)))
  if not os.path.isfile(os.path.join(out, "tokenizer.json")):  # model.tokenizer named another file
    written.append(shutil.copy(tokenizer.file, os.path.join(out, "tokenizer.json")))
  generation = os.path.join(out, "generation_config.json")
  if not os.path.isfile(generation):
    with open(generation, "w") as f:
      json.dump({"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.stop_ids),
                 "pad_token_id": tokenizer.pad_id}, f, indent=2)
    written.append(generation)
  return written


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  # jax only now, after --cpu_devices.
  from meshrl.model import convert  # pylint: disable=import-outside-toplevel
  from meshrl.model.tokenizer import tokenizer_from_config  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import model_config  # pylint: disable=import-outside-toplevel
  from meshrl.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  from meshrl.train import init_from  # pylint: disable=import-outside-toplevel
  folder, step, architecture = _check(args, cfg)  # bad input: one line (cli.run), nothing written
  mesh = make_mesh(cfg.mesh)
  model = init_from.restore_params(folder, model_config(cfg, mesh), mesh, step=step)
  # A sequence classifier reads each row's score at its last non-pad token: it needs the pad id.
  pad_id = tokenizer_from_config(cfg).pad_id if architecture.endswith("ForSequenceClassification") else None
  written = convert.export_checkpoint(model, cfg, args.out, architecture, dtype=args.dtype, pad_token_id=pad_id)
  if cfg.model.tokenizer != "byte":
    written += _copy_tokenizer(cfg, args.out, tokenizer_from_config(cfg))
  else:
    print("note: model.tokenizer is 'byte', which has no Hugging Face form; no tokenizer written.")
  print(f"wrote {architecture} from {folder} step {step}: {len(written)} files in {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
