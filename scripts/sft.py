"""Supervised fine-tuning (the RL warm start) on packed prompt/answer data.

  python scripts/sft.py --config=configs/tiny.py --config.data.seq_len=64
  python scripts/sft.py --cpu_devices=8 --config=configs/tiny.py --config.mesh.fsdp=4 \
      --config.mesh.tensor=2 --config.data.jsonl=tasks.jsonl

Writes to the work directory (cfg.workdir, "{name}" filled in): config.json, metrics.jsonl, tb/,
checkpoints/ and loss_curve.png. Run it again to resume from the latest checkpoint.
"""

import sys

from meshrl.configs import cli, save_config


def main(argv):
  args, cfg = cli.parse(argv, description=__doc__, add_flags=lambda p: p.add_argument(
      "--steps", type=int, default=None, help="SFT steps (default: rl.sft_steps)"))
  cli.join_job(args)  # several processes (a pod): join the job before jax touches a device
  # jax only now, after --cpu_devices.
  from meshrl.model.tokenizer import tokenizer_from_config  # pylint: disable=import-outside-toplevel
  from meshrl.rl.loop import train_source  # pylint: disable=import-outside-toplevel
  from meshrl.sharding import make_mesh  # pylint: disable=import-outside-toplevel
  from meshrl.train.init_from import check_initial_model  # pylint: disable=import-outside-toplevel
  from meshrl.train.preemption import Preemption  # pylint: disable=import-outside-toplevel
  from meshrl.train.sft import check_shapes, run_sft  # pylint: disable=import-outside-toplevel

  workdir = cfg.workdir.format(name=cfg.name)
  try:
    mesh = make_mesh(cfg.mesh)
    check_shapes(cfg, mesh)
    check_initial_model(cfg)
    source = train_source(cfg)  # the task mixture and data.jsonl, minus the held-out prompts
    tokenizer = tokenizer_from_config(cfg)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"config: {save_config(cfg, workdir)}")
  # Builds the model sharded on the mesh, or on a resume reads the checkpoint straight into it.
  # SIGTERM (preemption) finishes the step in flight, saves it and exits 0; run again to resume.
  with Preemption() as preemption:
    result = run_sft(cfg, workdir, mesh, source=source, tokenizer=tokenizer, num_steps=args.steps,
                     preemption=preemption)
  if result.history:
    last = result.history[-1]
    print(f"step {last['step']}: loss {last['loss']:.4f}, ce {last['ce']:.4f}, "
          f"{last['tokens_per_s']:.0f} tokens/s; outputs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
