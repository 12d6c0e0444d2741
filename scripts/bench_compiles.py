"""What an RL run compiles, and when: the programs XLA compiled in each case's first steps, side by
side with another checkout of meshrl (the code before a change) in the same run.

Run:  JAX_PLATFORMS=cpu python scripts/bench_compiles.py --json runs/compiles.json
      (--vs /tmp/old: a folder holding an older `meshrl/` package, run the same way for the ratio;
      --cases partial,agent; --steps 4; --runs 2)

Each case runs `--steps` RL steps of its preset (scripts/rl.py's run, no warm start, no evaluation)
in a fresh Python process, so no compile cache carries over, and counts jax's backend-compile events
by program name. A program compiled more than once for one shape is a cache miss: an argument that
reached it in another layout (an uncommitted array the first time, a replicated one after), or a
static argument that changed. Cases:
  partial         configs/tiny.py, partial rollouts (rl.rollout_token_budget=512) with asynchronous RL
  agent           configs/tiny_agent.py (episodic engine, MoE policy, asynchronous RL)
  agent_partial   the same with partial episodes (rl.rollout_token_budget=512)
  static          configs/tiny.py as it is (static engine, synchronous)
The table gives, per case and code: programs compiled, their seconds, the compiles after step 1,
and the programs compiled more than once.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

from meshrl.configs import cli

CASES = {
    "partial": ("configs/tiny.py", ["rl.rollout_token_budget=512", "rl.engine=continuous", "rl.max_staleness=1",
                                    "rl.tis_level=token", "rl.max_resample_rounds=0"]),
    "agent": ("configs/tiny_agent.py", []),
    "agent_partial": ("configs/tiny_agent.py", ["rl.rollout_token_budget=512"]),
    "static": ("configs/tiny.py", []),
}
COMMON = ["rl.sft_steps=0", "eval.every=0", "log.progress_bar=false", "log.tensorboard=false", "log.plot=false"]


def _child(case: str, steps: int) -> dict:
  """Runs the case here; returns its compile events."""
  import jax  # pylint: disable=import-outside-toplevel
  events = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: events.append((str(kw.get("fun_name", "?")), duration))
      if event == "/jax/core/compile/backend_compile_duration" else None)
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import driver  # pylint: disable=import-outside-toplevel
  path, overrides = CASES[case]
  cfg = configs.load(path, COMMON + overrides + [f"rl.num_steps={steps}"])
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    records = driver.run(cfg, workdir)
  return {"events": events, "wall_s": time.perf_counter() - start,
          "compiles_after_step_1": records[-1]["compiles"] - records[0]["compiles"]}


def _run(case: str, steps: int, package_root: str | None) -> dict:
  env = dict(os.environ)
  if package_root:  # the other checkout's `meshrl/` first on the path
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, __file__, "--child", case, "--steps", str(steps)], env=env,
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise SystemExit(f"{case} ({package_root or 'this checkout'}) failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(result: dict) -> dict:
  count, seconds = collections.Counter(), collections.Counter()
  for name, duration in result["events"]:
    count[name] += 1
    seconds[name] += duration
  return {"programs": sum(count.values()), "compile_s": round(sum(seconds.values()), 2),
          "compiles_after_step_1": result["compiles_after_step_1"], "wall_s": round(result["wall_s"], 1),
          "repeated": {name: [n, round(seconds[name], 2)] for name, n in count.most_common()
                       if n > 1 and seconds[name] > 0.2}}


def main(argv=None) -> int:
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--cases", default="partial,agent,agent_partial", help=",".join(CASES))
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--runs", type=int, default=1, help="runs of each case and code (the median is reported)")
  parser.add_argument("--vs", default="", help="a folder holding another checkout's meshrl/ package")
  parser.add_argument("--json", default="", help="where to write the results")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(_child(args.child, args.steps)))
    return 0
  cases = [c for c in args.cases.split(",") if c]
  unknown = [c for c in cases if c not in CASES]
  if unknown:
    parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
  if args.vs and not os.path.isdir(os.path.join(args.vs, "meshrl")):
    parser.error(f"--vs={args.vs!r} holds no meshrl/ folder")
  codes = [("this", None)] + ([("vs", args.vs)] if args.vs else [])
  results = {}
  for case in cases:
    for run in range(args.runs):
      for code, root in codes if run % 2 == 0 else codes[::-1]:  # alternating order: A B B A ...
        results.setdefault(case, {}).setdefault(code, []).append(_summary(_run(case, args.steps, root)))
  print(f"{'case':14s} {'code':5s} {'programs':>8s} {'compile s':>9s} {'after step 1':>12s} {'wall s':>7s}  "
        "repeated programs")
  for case, by_code in results.items():
    for code, runs in by_code.items():
      mid = sorted(runs, key=lambda r: r["compile_s"])[len(runs) // 2]
      by_code[code] = {"median": mid, "runs": runs}
      print(f"{case:14s} {code:5s} {mid['programs']:8d} {mid['compile_s']:9.1f} {mid['compiles_after_step_1']:12d} "
            f"{mid['wall_s']:7.1f}  {mid['repeated']}")
    if "vs" in by_code:
      this, other = by_code["this"]["median"], by_code["vs"]["median"]
      by_code["ratio_compile_s"] = round(this["compile_s"] / max(other["compile_s"], 1e-9), 3)
      print(f"{case:14s} ratio compile s this / vs: {by_code['ratio_compile_s']:.2f}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"steps": args.steps, "vs": args.vs, "cases": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
