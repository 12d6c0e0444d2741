"""Held-out evaluation of a policy: greedy accuracy, pass@k and response length per domain.

  python scripts/eval.py --config=configs/tiny.py --checkpoint=runs/tiny/checkpoints --json runs/eval.json
  python scripts/eval.py --config=configs/hf_qwen3_moe.py:/models/qwen3 --config.eval.jsonl=heldout.jsonl

The policy is `--checkpoint` (a meshrl checkpoint folder or a Hugging Face directory; default: the
config's model.init_from, random weights when that is empty too). The prompts are the config's held-out
ones: eval.jsonl, or the held-out side of the data.tasks hash split (data.eval_fraction), which the
training job never trains on. Prints one line per metric and writes them as JSON.
"""

import json
import os
import sys

from meshrl.configs import cli


def _flags(parser):
  parser.add_argument("--checkpoint", default=None, help="meshrl checkpoint folder or HF directory")
  parser.add_argument("--json", default=None, help="where to write the metrics")


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  # pylint: disable=import-outside-toplevel  (jax only after --cpu_devices)
  import jax

  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.step.evaluation import Evaluator, held_out_examples
  from meshrl.rl.step.driver import check_config, train_prompts, train_source
  from meshrl.sharding import make_mesh
  from meshrl.train.init_from import check_initial_model, initial_model
  from meshrl.train.state import split_model
  # pylint: enable=import-outside-toplevel
  # Everything that can refuse the evaluation, before anything is computed or written.
  check_config(cfg)  # the config a run would accept (rl.* sizes and sampling, data, eval, model)
  if args.checkpoint:
    if not os.path.exists(args.checkpoint):
      raise ValueError(f"--checkpoint={args.checkpoint!r} does not exist.")
    cfg.model.init_from = os.path.abspath(args.checkpoint)
  check_initial_model(cfg)
  mesh = make_mesh(cfg.mesh)
  source = train_source(cfg)
  examples = held_out_examples(cfg, train_prompts=train_prompts(source))
  if not examples:
    raise ValueError("there are no held-out prompts to evaluate (eval.jsonl, data.eval_fraction).")
  tokenizer = tokenizer_from_config(cfg)
  _, params, extra = split_model(initial_model(cfg, mesh))
  evaluator = Evaluator(cfg, mesh, tokenizer, examples)
  metrics = evaluator(params, extra, jax.random.key(cfg.seed))
  evaluator.close()
  for name, value in metrics.items():
    print(f"{name:<32} {value:.4f}" if isinstance(value, float) else f"{name:<32} {value}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"checkpoint": cfg.model.init_from, **metrics}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
