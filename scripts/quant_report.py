"""What int8 generation costs on YOUR model: greedy agreement with full precision and the logits' error
for the int8 KV cache, int8 weights and both (rl/generation/quality.py, through the generation engine).

  python scripts/quant_report.py --config=configs/tiny.py --checkpoint=runs/tiny/checkpoints --json q.json
  python scripts/quant_report.py --config=configs/hf_qwen3_moe.py:/models/qwen3 --prompts=8 --new_tokens=128

The model is `--checkpoint` (a meshrl checkpoint folder or a Hugging Face directory; default: the
config's model.init_from, random weights when that is empty). The prompts are --prompts of the config's
training prompts (data.tasks / data.jsonl), cut or padded to the same length; each is continued by
--new_tokens greedy tokens. Runs on one device. Prints one line per figure and writes them as JSON.
"""

import json
import os
import sys

from meshrl.configs import cli


def _flags(parser):
  parser.add_argument("--checkpoint", default=None, help="meshrl checkpoint folder or HF directory")
  parser.add_argument("--prompts", type=int, default=4, help="prompts continued")
  parser.add_argument("--new_tokens", type=int, default=64, help="greedy tokens generated per prompt")
  parser.add_argument("--json", default=None, help="where to write the figures")


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  # pylint: disable=import-outside-toplevel  (jax only after --cpu_devices)
  import numpy as np

  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.generation.quality import int8_quality
  from meshrl.rl.step.driver import prompt_stream, train_source
  from meshrl.train.init_from import check_initial_model, initial_model, model_config
  from meshrl.train.state import split_model
  # pylint: enable=import-outside-toplevel
  for flag in ("prompts", "new_tokens"):
    if getattr(args, flag) < 1:
      raise ValueError(f"--{flag}={getattr(args, flag)} must be at least 1.")
  if args.json and os.path.isdir(args.json):
    raise ValueError(f"--json={args.json!r} is a folder; give a file path.")
  if args.checkpoint:
    if not os.path.exists(args.checkpoint):
      raise ValueError(f"--checkpoint={args.checkpoint!r} does not exist.")
    cfg.model.init_from = os.path.abspath(args.checkpoint)
  check_initial_model(cfg)
  mc = model_config(cfg)
  tokenizer = tokenizer_from_config(cfg)
  stream = prompt_stream(train_source(cfg))
  encoded = [tokenizer.encode(tokenizer.render_prompt(next(stream)["prompt"])) for _ in range(args.prompts)]
  length = min(len(e) for e in encoded)
  if length + args.new_tokens > mc.max_seq_len:
    raise ValueError(f"prompts of {length} tokens + --new_tokens={args.new_tokens} exceed model.max_seq_len="
                     f"{mc.max_seq_len}.")
  prompts = np.asarray([e[-length:] for e in encoded], np.int32)  # their last `length` tokens: no padding
  _, params, extra = split_model(initial_model(cfg, None))
  report = int8_quality(mc, params, extra, prompts, new_tokens=args.new_tokens)
  for name, value in report.items():
    print(f"{name:<34} {value:.4f}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"checkpoint": cfg.model.init_from, "prompts": args.prompts, "prompt_len": length,
                 "new_tokens": args.new_tokens, **report}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
