"""Supervised fine-tuning (the RL warm start) on packed prompt/answer data.

  python scripts/sft.py --config=configs/tiny.py --config.data.seq_len=64
  python scripts/sft.py --cpu_devices=8 --config=configs/tiny.py --config.mesh.fsdp=4 \
      --config.mesh.tensor=2 --config.data.jsonl=tasks.jsonl

Writes to the work directory (--workdir, default cfg.workdir with "{name}" filled in): config.json,
metrics.jsonl, tb/, checkpoints/ and loss_curve.png. Run it again to resume from the latest
checkpoint; a folder holding another run is refused unless --overwrite (which removes that run's
outputs). Every bad input is one line before anything is written; Ctrl-C or SIGTERM saves the step in
flight and exits 0.
"""

import os
import sys

from meshrl.configs import checks, cli, save_config


def _flags(parser):
  parser.add_argument("--steps", type=int, default=None, help="SFT steps (default: rl.sft_steps)")
  parser.add_argument("--workdir", default=None, help="output folder (default: cfg.workdir)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace a run found in the work directory instead of refusing")


def main(argv):
  args, cfg = cli.parse(argv, description=__doc__, add_flags=_flags)
  cli.join_job(args)  # several processes (a pod): join the job before jax touches a device
  # pylint: disable=import-outside-toplevel  (jax only now, after --cpu_devices)
  from meshrl.model.tokenizer import tokenizer_from_config
  from meshrl.rl.step.driver import checkpoint_bytes, skipped_rows, train_source
  from meshrl.sharding import make_mesh
  from meshrl.train import checkpoint, workdir as workdir_lib
  from meshrl.train.init_from import check_initial_model, model_config
  from meshrl.train.optim import check_optim
  from meshrl.train.preemption import Preemption
  from meshrl.train.sft import check_shapes, run_sft
  # pylint: enable=import-outside-toplevel
  steps = cfg.rl.sft_steps if args.steps is None else args.steps
  if steps < 1:
    raise ValueError(f"--steps={args.steps} must be at least 1." if args.steps is not None else
                     "rl.sft_steps=0 and no --steps: there is nothing to train (give --steps=N).")
  workdir = args.workdir or cfg.workdir.format(name=cfg.name)
  # Everything that can refuse the run, before anything is written.
  checks.check_sections(cfg, "run", "data", "checkpoint", "log")
  checks.at_least(cfg, "rl.sft_batch_size", 1)
  numbers = model_config(cfg)  # model.*, moe.*, attention.* (the mesh's layout comes with run_sft)
  check_optim(cfg.optim, learning_rate=cfg.rl.sft_learning_rate, field="rl.sft_learning_rate")
  mesh = make_mesh(cfg.mesh)
  check_shapes(cfg, mesh)
  check_initial_model(cfg)
  folder = os.path.join(workdir, "checkpoints")
  saved = checkpoint.committed_steps(folder)
  resuming = bool(cfg.checkpoint.enabled and cfg.checkpoint.restore and saved and not args.overwrite)
  leftovers = workdir_lib.check_workdir(workdir, cfg, resuming=resuming, overwrite=args.overwrite)
  if resuming:
    checkpoint.check_readable(os.path.join(folder, str(saved[-1])))
    checkpoint.check_saved_config(os.path.join(folder, str(saved[-1])), cfg)
  source = train_source(cfg)  # the task mixture and data.jsonl, minus the held-out prompts
  if skipped_rows(source):
    print(skipped_rows(source))
  tokenizer = tokenizer_from_config(cfg)
  if cfg.checkpoint.enabled:
    workdir_lib.check_free_space(workdir, checkpoint_bytes(numbers, cfg.optim))
  workdir_lib.clear_outputs(workdir, leftovers)
  print(f"config: {save_config(cfg, workdir)}")
  # Builds the model sharded on the mesh, or on a resume reads the checkpoint straight into it.
  # SIGTERM or Ctrl-C finishes the step in flight, saves it and exits 0; run again to resume.
  with Preemption() as preemption:
    result = run_sft(cfg, workdir, mesh, source=source, tokenizer=tokenizer, num_steps=steps,
                     preemption=preemption)
  if result.history:
    last = result.history[-1]
    print(f"step {last['step']}: loss {last['loss']:.4f}, ce {last['ce']:.4f}, "
          f"{last['tokens_per_s']:.0f} tokens/s; outputs in {workdir}")
  return 0


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
