"""The main job: supervised warm start, then GRPO, on one mesh. Works on a laptop CPU and a TPU pod.

  python scripts/rl.py --config=configs/tiny.py                  # the CPU demo (minutes)
  python scripts/rl.py --config=configs/tiny.py --cpu_devices=8 --config.mesh.fsdp=4 \
      --config.mesh.expert=2                                     # the same program, 8 simulated chips
  python scripts/rl.py --config=configs/tiny.py --cpu_devices=2 --coordinator=localhost:7777 \
      --num_processes=2 --process_id=0 & ... --process_id=1       # two host processes, one mesh

Writes into the work directory (cfg.workdir, or --workdir): config.json, metrics.jsonl (one record
per RL step), eval.jsonl (held-out evaluations, with eval.every > 0), TensorBoard events (tb/),
reward_curve.png, eval_curve.png (held-out accuracy, one line per domain), sft/ (warm start) and checkpoints/. Running the same command again resumes from
the latest checkpoint; a folder holding another run is refused unless --overwrite (which removes
that run's outputs). Every bad input (config, files, rows, checkpoints, disk space) is reported as
one line before anything is written. Ctrl-C or SIGTERM saves the step in flight and exits 0.
With rl.num_steps=0 the job is the warm start (and its evaluation) alone. With rm.train_before_rl
(configs/tiny_rm.py) the reward model at rl.reward_model_checkpoint is trained first, or reused when
one of the same settings is there (rl/rewards/rm_first.py).
"""

import os
import sys

from meshrl.configs import cli


def main(argv):
  def flags(parser):
    parser.add_argument("--workdir", default=None, help="output folder (default: cfg.workdir)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a run found in the work directory instead of refusing")
  args, cfg = cli.parse(argv, add_flags=flags, description=__doc__)
  cli.join_job(args)  # several processes (a pod): join the job before jax touches a device
  from meshrl.rl.step import driver as loop  # pylint: disable=import-outside-toplevel  (after --cpu_devices)
  workdir = args.workdir or cfg.workdir.format(name=cfg.name)
  from meshrl.rl.rewards.rm_first import WARM_STARTED, ensure_reward_model  # pylint: disable=import-outside-toplevel
  status = ensure_reward_model(cfg, workdir, overwrite=args.overwrite)  # rm.train_before_rl: the reward model first
  # rm.pairs_from="policy": the warm start is in workdir/sft already (the earlier run's outputs removed
  # first under --overwrite); the driver resumes it.
  records = loop.run(cfg, workdir, overwrite=args.overwrite and status != WARM_STARTED)
  if records:
    tenth = max(1, len(records) // 10)
    first = sum(r["reward_mean"] for r in records[:tenth]) / tenth
    last = sum(r["reward_mean"] for r in records[-tenth:]) / tenth
    print(f"reward_mean: first {tenth} steps {first:.3f} -> last {tenth} steps {last:.3f} "
          f"({last - first:+.3f}); outputs in {workdir}")
  elif cfg.rl.num_steps == 0:
    print(f"rl.num_steps=0: the warm start alone; outputs in {workdir}")
  from meshrl.sharding import hosts  # pylint: disable=import-outside-toplevel
  from meshrl.train.metrics import plot_domains, read_jsonl  # pylint: disable=import-outside-toplevel
  evals = os.path.join(workdir, "eval.jsonl")
  rows = read_jsonl(evals) if os.path.exists(evals) else []
  if rows and cfg.log.plot and hosts.is_primary():  # eval/accuracy and each eval/accuracy/<domain>
    plot_domains(evals, "eval/accuracy", os.path.join(workdir, "eval_curve.png"), title="held-out greedy accuracy")
  if rows:
    print(f"held-out greedy accuracy: step {rows[0]['step']} {rows[0]['eval/accuracy']:.3f} -> "
          f"step {rows[-1]['step']} {rows[-1]['eval/accuracy']:.3f} "
          f"({rows[-1]['eval/accuracy'] - rows[0]['eval/accuracy']:+.3f}, "
          f"{rows[-1]['eval/num_prompts']} prompts)")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
