"""The environment quality gate over terminal task directories (rl/envs/quality.py).

  python scripts/env_qa.py --tasks DIR [DIR ...] --json report.json [--quarantine q.jsonl] \
      [--k 3] [--repeats 5] [--workers 2] [--policy module:factory --samples 4]

Each DIR is a task directory or a folder of them. Writes {"tasks": n, "quarantined": [ids],
"reasons": {id: reason}, "curriculum": {id: flag}, "seconds": {...}, "wall_s": s} to --json and
appends the quarantined ids to the quarantine list (default: quarantine.jsonl beside the JSON), the
file data.quarantine points training at. --policy names a factory `() -> generate(conversation)`
whose episodes flag tasks it always or never solves (a checkpoint's policy plugs in the same way).
Exit status 0 even when tasks are quarantined; 2 for bad flags.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from meshrl.rl.envs.quality import Quarantine, run_gate


def _policy(spec: str):
  module, _, name = spec.partition(":")
  if not module or not name:
    raise ValueError(f"--policy={spec!r} must be module:factory")
  return getattr(importlib.import_module(module), name)()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tasks", nargs="+", required=True)
  parser.add_argument("--json", required=True)
  parser.add_argument("--quarantine", default="")
  parser.add_argument("--k", type=int, default=3, help="oracle runs that must all pass")
  parser.add_argument("--repeats", type=int, default=5, help="repeated checks that must agree")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--policy", default="")
  parser.add_argument("--samples", type=int, default=4)
  args = parser.parse_args(argv)
  for path in args.tasks:
    if not os.path.isdir(path):
      parser.error(f"--tasks {path!r}: no such directory")
  if args.k < 1 or args.repeats < 2 or args.workers < 1 or args.samples < 1:
    parser.error("--k, --workers and --samples must be >= 1 and --repeats >= 2")
  try:
    policy = _policy(args.policy) if args.policy else None
  except (ValueError, ImportError, AttributeError) as error:
    parser.error(str(error))
  quarantine_path = args.quarantine or os.path.join(os.path.dirname(os.path.abspath(args.json)),
                                                    "quarantine.jsonl")
  started = time.monotonic()
  report = run_gate(args.tasks, k=args.k, repeats=args.repeats, workers=args.workers, policy=policy,
                    samples=args.samples, quarantine=Quarantine(quarantine_path))
  report["wall_s"] = round(time.monotonic() - started, 2)
  report["quarantine_file"] = quarantine_path
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  for task_id in report["quarantined"]:
    print(f"QUARANTINED {task_id}: {report['reasons'][task_id][:150]}")
  for task_id, flag in sorted(report["curriculum"].items()):
    print(f"curriculum {task_id}: {flag}")
  print(f"{report['tasks']} tasks, {len(report['quarantined'])} quarantined, "
        f"{report['wall_s']} s; report {args.json}, quarantine list {quarantine_path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
