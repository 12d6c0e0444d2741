"""Trains a reward model on preference pairs (Bradley-Terry), reports held-out pairwise accuracy.

  python scripts/train_rm.py --config=configs/tiny_rm.py
  python scripts/train_rm.py --config=configs/tiny_rm.py --config.rm.train_jsonl=prefs.jsonl \
      --config.rm.eval_jsonl=prefs_eval.jsonl --config.rm.margin=0.5

The reward model is the config's model (model.*, from model.init_from when set: a policy checkpoint
or a Hugging Face folder, Qwen3MoeForSequenceClassification included) with a value head as its score
(model.value_head is set for it), read at each row's last token (train/reward_model.py); the job is
rl/rewards/rm_job.py's, which scripts/rl.py also runs first under rm.train_before_rl. Pairs come from rm.train_jsonl
({"prompt", "chosen", "rejected", "margin"?} per line) or, when it is "", are made from the data.tasks
mixture: chosen = the task's answer, rejected = a near miss the task's verifier calls wrong. Held-out
pairs: rm.eval_jsonl, else the pairs whose prompts fall in the held-out data.eval_fraction. With
rm.pairs_from=policy (configs/tiny_rm.py's default) the pairs are the warm-started policy's own samples
labelled by the verifier (rl/rewards/policy_pairs.py; the warm start runs in a temporary folder first), and
with rm.init=policy the reward model starts from that policy. The job also writes calibration.json,
the threshold that rl.rm_binarize reads.

Writes to the work directory (--workdir; default rl.reward_model_checkpoint, the reward model the
config's RL run reads, when set, else cfg.workdir with "{name}" filled in): config.json,
metrics.jsonl (training metrics and eval/pairwise_accuracy), tb/, checkpoints/ (a later RL run loads
them as its reward model; `scripts/export_hf.py --architecture=Qwen3MoeForSequenceClassification`
writes a Hugging Face folder) and loss_curve.png. Every bad input (a malformed pair, named by file and
line; a pair over rm.max_len with rm.overflow=reject; a field out of range) is one line before
anything is written.
"""

import sys
import time

from meshrl.configs import cli


def _flags(parser):
  parser.add_argument("--steps", type=int, default=None, help="training steps (default: rm.steps)")
  parser.add_argument("--workdir", default=None,
                      help="output folder (default: rl.reward_model_checkpoint when set, else cfg.workdir)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a run found in the work directory instead of refusing")


def main(argv):
  args, cfg = cli.parse(argv, description=__doc__, add_flags=_flags)
  cli.join_job(args)
  # pylint: disable-next=import-outside-toplevel  (jax only now, after --cpu_devices)
  from meshrl.rl.rewards.rm_job import prepare_reward_model, reward_model_config, train_reward_model
  workdir = args.workdir or cfg.rl.reward_model_checkpoint or cfg.workdir.format(name=cfg.name)
  from meshrl.rl.rewards.rm_first import temporary_warm_start  # pylint: disable=import-outside-toplevel
  # rm.pairs_from="policy": the pairs are the warm-started policy's samples; its warm start runs in a
  # temporary folder (an RL run trains its own).
  job = prepare_reward_model(reward_model_config(cfg, steps=args.steps), workdir, overwrite=args.overwrite,
                             warm_policy=lambda: temporary_warm_start(cfg))
  start = time.perf_counter()
  result = train_reward_model(job)
  evals = [r for r in result.history if "eval/pairwise_accuracy" in r]
  if evals:
    print(f"held-out pairwise accuracy {evals[0]['eval/pairwise_accuracy']:.3f} (step {evals[0]['step']}) -> "
          f"{evals[-1]['eval/pairwise_accuracy']:.3f} (step {evals[-1]['step']}) in "
          f"{time.perf_counter() - start:.0f} s; outputs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
