"""Distils a speculative-decoding draft from a target policy on the target's own completions of the
run's training prompts (rl/algo/distill.py), and saves it as a checkpoint rl.draft_checkpoint reads.

  python scripts/distill_draft.py --config=configs/tiny.py --config.model.init_from=runs/tiny \\
      --draft_config="configs/tiny.py:dense;model.num_layers=1;model.embed_dim=64" --out=runs/tiny_draft
  python scripts/rl.py --config=configs/tiny.py --config.rl.speculative=draft \\
      --config.rl.draft_config="configs/tiny.py:dense;model.num_layers=1;model.embed_dim=64" \
      --config.rl.draft_checkpoint=runs/tiny_draft

The target is the config's model (model.init_from); the draft is --draft_config ("preset[:arg]" then
";"-separated overrides, the syntax of rl.draft_config), randomly initialised. The completions are sampled at rl.temperature (greedy at 0), --group_size per prompt.
"""

import os
import sys

from meshrl.configs import cli


def _flags(parser):
  parser.add_argument("--draft_config", required=True, help='the draft: "path[:arg];a.b=value;..."')
  parser.add_argument("--out", required=True, help="folder of the draft checkpoint")
  parser.add_argument("--prompts", type=int, default=256, help="training prompts completed by the target")
  parser.add_argument("--group_size", type=int, default=1)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--loss", default="kl", help="kl (to the target's distribution) or ce (on its tokens)")


def check_flags(args) -> None:
  """ValueError naming the flag: counts below 1, a rate <= 0, an unknown loss, and an --out that
  holds anything (the draft checkpoint keeps one step, so saving into a folder of checkpoints would
  delete its other steps)."""
  for flag in ("prompts", "group_size", "steps"):
    if getattr(args, flag) < 1:
      raise ValueError(f"--{flag}={getattr(args, flag)} must be at least 1.")
  if args.batch_size < 0:
    raise ValueError(f"--batch_size={args.batch_size} must be >= 0 (0 = every sequence in each step).")
  if not args.learning_rate > 0:
    raise ValueError(f"--learning_rate={args.learning_rate} must be positive.")
  if args.loss not in ("kl", "ce"):
    raise ValueError(f"--loss={args.loss!r} is not one of 'kl', 'ce'.")
  if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
    raise ValueError(f"--out={args.out!r} exists and is not an empty folder; give a new or empty folder "
                     "(saving there would replace what it holds).")


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  # pylint: disable=import-outside-toplevel  (jax only after --cpu_devices)
  import jax

  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.step.driver import prompt_stream, train_source
  from meshrl.rl.algo.distill import DistillConfig, distill
  from meshrl.rl.generation.generator import check_draft
  from meshrl.rl.step.spec import draft_run_config, make_generator
  from meshrl.sharding import make_mesh
  from meshrl.train.checkpoint import Checkpointer
  from meshrl.train.init_from import check_initial_model, initial_model
  from meshrl.train.state import split_model
  # pylint: enable=import-outside-toplevel
  check_flags(args)
  draft_cfg = draft_run_config(args.draft_config)
  dc = DistillConfig(steps=args.steps, learning_rate=args.learning_rate, loss=args.loss,
                     batch_size=args.batch_size)
  check_initial_model(cfg)
  mesh = make_mesh(cfg.mesh)
  target, draft = initial_model(cfg, mesh), initial_model(draft_cfg, mesh)
  check_draft(target.config, draft.config)
  tokenizer = tokenizer_from_config(cfg)
  stream = prompt_stream(train_source(cfg))
  texts = [tokenizer.render_prompt(next(stream)["prompt"]) for _ in range(args.prompts)]
  prompts, mask = tokenizer.encode_batch(texts, length=cfg.rl.max_prompt_len, padding="left")
  generator = make_generator(cfg, mesh, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                             group_size=args.group_size, multi_turn=False, complete=True)
  _, target_params, target_extra = split_model(target)
  batch = generator(target_params, target_extra, prompts, mask, jax.random.key(cfg.seed))  # its completions
  history = distill(target, draft, batch, jax.random.key(cfg.seed + 1), dc)
  for i in sorted({0, len(history) // 2, len(history) - 1}):
    print(f"step {i:>5}  loss {history[i]['loss']:.4f}  greedy agreement {history[i]['greedy_agreement']:.3f}")
  _, params, _ = split_model(draft)
  saver = Checkpointer(os.path.abspath(args.out), max_to_keep=1)
  saver.save(dc.steps, {"params": params}, config=draft_cfg, force=True)
  saver.close()
  print(f"draft saved to {args.out} (rl.draft_config={args.draft_config}, rl.draft_checkpoint={args.out})")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
