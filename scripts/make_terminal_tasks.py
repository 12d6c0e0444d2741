"""Writes generated terminal tasks (and, optionally, the planted-fault suite) in the task directory
format of rl/envs/terminal.py.

  python scripts/make_terminal_tasks.py --out /tmp/tasks [--per-family 12] [--seed 0] \
      [--faults /tmp/faults]

Six families (rl/envs/terminal_tasks.py) x --per-family tasks; check them with scripts/env_qa.py.
"""

from __future__ import annotations

import os
import sys

from meshrl.configs import cli
from meshrl.rl.envs import terminal_tasks


def main(argv=None) -> int:
  parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="folder the task folders are written into")
  parser.add_argument("--per-family", type=int, default=12)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--faults", default="", help="also write the planted faults into this folder")
  args = parser.parse_args(argv)
  if args.per_family < 1:
    parser.error(f"--per-family={args.per_family} must be >= 1")
  for folder in filter(None, (args.out, args.faults)):
    if os.path.isdir(folder) and os.listdir(folder):
      parser.error(f"{folder} is not empty; give a new or empty folder (nothing was written)")
  names = terminal_tasks.write_tasks(args.out, per_family=args.per_family, seed=args.seed)
  print(f"wrote {len(names)} tasks ({len(terminal_tasks.FAMILIES)} families) to {args.out}")
  if args.faults:
    faults = terminal_tasks.write_planted_faults(args.faults)
    print(f"wrote {len(faults)} planted faults to {args.faults}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
