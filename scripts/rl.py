"""The main job: supervised warm start, then GRPO, on one mesh. Works on a laptop CPU and a TPU pod.

  python scripts/rl.py --config=configs/tiny.py                  # the CPU demo (minutes)
  python scripts/rl.py --config=configs/tiny.py --cpu_devices=8 --config.mesh.fsdp=4 \
      --config.mesh.expert=2                                     # the same program, 8 simulated chips
  python scripts/rl.py --config=configs/tiny.py --cpu_devices=2 --coordinator=localhost:7777 \
      --num_processes=2 --process_id=0 & ... --process_id=1       # two host processes, one mesh

Writes into the work directory (cfg.workdir, or --workdir): config.json, metrics.jsonl (one record
per RL step), eval.jsonl (held-out evaluations, with eval.every > 0), TensorBoard events (tb/),
reward_curve.png, sft/ (warm start) and checkpoints/. Every config error is reported as one line
before anything runs or is written.
"""

import json
import os
import sys

from meshrl.configs import cli


def main(argv):
  def flags(parser):
    parser.add_argument("--workdir", default=None, help="output folder (default: cfg.workdir)")
  args, cfg = cli.parse(argv, add_flags=flags, description=__doc__)
  cli.join_job(args)  # several processes (a pod): join the job before jax touches a device
  import jax  # pylint: disable=import-outside-toplevel  (after --cpu_devices)
  from meshrl.rl import loop  # pylint: disable=import-outside-toplevel
  workdir = args.workdir or cfg.workdir.format(name=cfg.name)
  try:
    loop.check_config(cfg, jax.device_count())
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  records = loop.run(cfg, workdir)
  if records:
    tenth = max(1, len(records) // 10)
    first = sum(r["reward_mean"] for r in records[:tenth]) / tenth
    last = sum(r["reward_mean"] for r in records[-tenth:]) / tenth
    print(f"reward_mean: first {tenth} steps {first:.3f} -> last {tenth} steps {last:.3f} "
          f"({last - first:+.3f}); outputs in {workdir}")
  evals = os.path.join(workdir, "eval.jsonl")
  if os.path.exists(evals):
    with open(evals, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f]
    print(f"held-out greedy accuracy: step {rows[0]['step']} {rows[0]['eval/accuracy']:.3f} -> "
          f"step {rows[-1]['step']} {rows[-1]['eval/accuracy']:.3f} "
          f"({rows[-1]['eval/accuracy'] - rows[0]['eval/accuracy']:+.3f}, "
          f"{rows[-1]['eval/num_prompts']} prompts)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
