"""Trains a reward model on preference pairs (Bradley-Terry), reports held-out pairwise accuracy.

  python scripts/train_rm.py --config=configs/tiny_rm.py
  python scripts/train_rm.py --config=configs/tiny_rm.py --config.rm.train_jsonl=prefs.jsonl \
      --config.rm.eval_jsonl=prefs_eval.jsonl --config.rm.margin=0.5

The reward model is the config's model (model.*, from model.init_from when set: a policy checkpoint
or a Hugging Face folder, Qwen3MoeForSequenceClassification included) with model.value_head as its
score head, read at each row's last token (train/reward_model.py). Pairs come from rm.train_jsonl
({"prompt", "chosen", "rejected", "margin"?} per line) or, when it is "", are made from the data.tasks
mixture: chosen = the task's answer, rejected = a near miss the task's verifier calls wrong. Held-out
pairs: rm.eval_jsonl, else the pairs whose prompts fall in the held-out data.eval_fraction.

Writes to the work directory (--workdir, default cfg.workdir with "{name}" filled in): config.json,
metrics.jsonl (training metrics and eval/pairwise_accuracy), tb/, checkpoints/ (a later RL run loads
them as its reward model; `scripts/export_hf.py --architecture=Qwen3MoeForSequenceClassification`
writes a Hugging Face folder) and loss_curve.png. Every bad input (a malformed pair, named by file and
line; a pair over rm.max_len with rm.overflow=reject; a field out of range) is one line before
anything is written.
"""

import os
import sys
import time

from meshrl.configs import checks, cli, save_config


def _flags(parser):
  parser.add_argument("--steps", type=int, default=None, help="training steps (default: rm.steps)")
  parser.add_argument("--workdir", default=None, help="output folder (default: cfg.workdir)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a run found in the work directory instead of refusing")


def _file_pairs(cfg):
  """(train, held-out) pairs of rm.train_jsonl (and rm.eval_jsonl)."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.mixture import in_eval_split
  from meshrl.train.preferences import read_pairs, split_pairs
  pairs = read_pairs(cfg.rm.train_jsonl, field="rm.train_jsonl")
  if cfg.rm.eval_jsonl:
    held_out = read_pairs(cfg.rm.eval_jsonl, field="rm.eval_jsonl")
    shared = sorted({p.prompt for p in pairs} & {p.prompt for p in held_out})
    if shared:
      raise ValueError(f"rm.eval_jsonl={cfg.rm.eval_jsonl!r} shares {len(shared)} prompt(s) with "
                       f"rm.train_jsonl, e.g. {shared[0]!r}; held-out prompts must be disjoint.")
    return pairs, held_out
  train, held_out = split_pairs(pairs, lambda prompt: in_eval_split(prompt, cfg.data.eval_fraction))
  for side, name in ((train, "training"), (held_out, "held-out")):
    if not side:
      raise ValueError(f"rm.train_jsonl={cfg.rm.train_jsonl!r}: no pair lands on the {name} side of "
                       f"data.eval_fraction={cfg.data.eval_fraction} (a hash of the prompt); change it "
                       "or give rm.eval_jsonl.")
  return train, held_out


def _synthetic_pairs(cfg):
  """(train, held-out) pairs made from the data.tasks mixture, each side of its prompt split."""
  # pylint: disable=import-outside-toplevel
  from meshrl.rl.envs.mixture import TaskMixture
  from meshrl.rl.rewards import answer_reward
  from meshrl.train.synthetic_pairs import synthetic_pairs

  def side(split, seed, count):
    mixture = TaskMixture(cfg.data.tasks, difficulty=cfg.data.difficulty, seed=seed, split=split,
                          eval_fraction=cfg.data.eval_fraction)
    return synthetic_pairs(mixture.take(count), seed=seed, origin=f"synthetic {split} example",
                           is_correct=lambda text, example: answer_reward(text, example) >= 1.0)
  return side("train", cfg.seed, cfg.rm.synthetic_pairs), side("eval", cfg.seed + 7919, cfg.rm.eval_pairs)


def main(argv):
  args, cfg = cli.parse(argv, description=__doc__, add_flags=_flags)
  cli.join_job(args)
  # pylint: disable=import-outside-toplevel  (jax only now, after --cpu_devices)
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.model.transformer import ModelConfig
  from meshrl.sharding import make_mesh
  from meshrl.train import workdir as workdir_lib
  from meshrl.train.init_from import check_initial_model, initial_model
  from meshrl.train.optim import check_optim
  from meshrl.train.preferences import encode_pairs
  from meshrl.train.reward_model import check_score_head
  from meshrl.train.rm_training import check_rm_shapes, rm_max_len, run_reward_model
  # pylint: enable=import-outside-toplevel
  steps = cfg.rm.steps if args.steps is None else args.steps
  if steps < 1:
    raise ValueError(f"--steps={steps} must be at least 1.")
  workdir = args.workdir or cfg.workdir.format(name=cfg.name)
  # Everything that can refuse the run, before anything is written.
  checks.check_sections(cfg, "run", "moe", "checkpoint", "log", "rm")
  check_score_head(cfg.model)
  ModelConfig.from_config(cfg)
  check_optim(cfg.optim, learning_rate=cfg.rm.learning_rate, field="rm.learning_rate")
  mesh = make_mesh(cfg.mesh)
  check_rm_shapes(cfg, mesh)
  check_initial_model(cfg)
  train, held_out = _file_pairs(cfg) if cfg.rm.train_jsonl else _synthetic_pairs(cfg)
  tokenizer = tokenizer_from_config(cfg)
  encode = lambda pairs: encode_pairs(pairs, tokenizer, max_len=rm_max_len(cfg),  # noqa: E731
                                      overflow=cfg.rm.overflow)
  train_arrays, held_out_arrays = encode(train), encode(held_out[:cfg.rm.eval_pairs])
  from meshrl.train import checkpoint  # pylint: disable=import-outside-toplevel
  saved = checkpoint.committed_steps(os.path.join(workdir, "checkpoints"))
  resuming = bool(cfg.checkpoint.enabled and cfg.checkpoint.restore and saved and not args.overwrite)
  leftovers = workdir_lib.check_workdir(workdir, cfg, resuming=resuming, overwrite=args.overwrite)
  if resuming:
    checkpoint.check_readable(os.path.join(workdir, "checkpoints", str(saved[-1])))
    checkpoint.check_saved_config(os.path.join(workdir, "checkpoints", str(saved[-1])), cfg)
  workdir_lib.clear_outputs(workdir, leftovers)
  print(f"config: {save_config(cfg, workdir)}")
  print(f"pairs: {len(train_arrays)} training, {len(held_out_arrays)} held out "
        f"({'rm.train_jsonl' if cfg.rm.train_jsonl else 'synthetic, from ' + cfg.data.tasks})")
  start = time.perf_counter()
  result = run_reward_model(cfg, workdir, mesh, initial_model(cfg, mesh), train=train_arrays,
                            held_out=held_out_arrays, num_steps=steps)
  evals = [r for r in result.history if "eval/pairwise_accuracy" in r]
  if evals:
    print(f"held-out pairwise accuracy {evals[0]['eval/pairwise_accuracy']:.3f} (step {evals[0]['step']}) -> "
          f"{evals[-1]['eval/pairwise_accuracy']:.3f} (step {evals[-1]['step']}) in "
          f"{time.perf_counter() - start:.0f} s; outputs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
