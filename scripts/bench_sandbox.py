"""Sandbox start-up latency and pool throughput, next to a plain subprocess of the same program;
per-command latency in a persistent session next to one sandbox per command.

  python scripts/bench_sandbox.py --json /tmp/bench_sandbox.json

Prints and writes: start-up latency p50/p99 of a trivial program (`true`; and `python3 -c pass`)
as the time from the call to the program starting (`SandboxResult.startup_s`) and as the whole
round trip, against `subprocess.run` of the same argv, for a cold `Sandbox.run` (bwrap and the
supervisor start inside the call) and through a warm one-worker `SandboxPool` (the next sandbox
starts while the current program runs); then runs per second at pool sizes 1, 2, 4, 8 for
`true` and for `sleep 0.1`, sandboxed and plain, with the cost of isolation as a ratio. Targets
(issue 10): start-up p50 < 50 ms; pool of 4 >= 3x a pool of 1 for the 100 ms sleep.

Sessions (issue 32): the round trip of `true` (the call to its result) in a warm persistent session
(`session_cmd_p50_ms`, top level of the JSON), side by side with the round trip of one sandbox per
command (cold, and from a warm one-worker pool), as a ratio; and 8 sessions at once on their own
threads, each running commands that echo its own token (commands/s, p50/p99 latency, and whether any
output held another session's token). Targets: session p50 <= 5 ms; 8 concurrent sessions, no
cross-talk.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time

import numpy as np

from meshrl.configs import cli
from meshrl.rl.sandbox import Limits, Sandbox, SandboxPool, Session, SessionSpec

TRIVIAL = {"true": ["true"], "python": ["python3", "-c", "pass"]}
SLEEP = ["sleep", "0.1"]
POOL_SIZES = (1, 2, 4, 8)


def _ms(values) -> dict:
  values = np.asarray(values) * 1e3
  return {"p50_ms": round(float(np.percentile(values, 50)), 2),
          "p99_ms": round(float(np.percentile(values, 99)), 2)}


def _plain(argv: list[str]) -> float:
  start = time.monotonic()
  subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
  return time.monotonic() - start


def latency(run, argv: list[str], runs: int) -> dict:
  """Start-up and round-trip latency of `argv`, run one at a time by `run(argv)`."""
  run(argv)  # warm the page cache (and a warm pool)
  startups, walls = [], []
  for _ in range(runs):
    start = time.monotonic()
    result = run(argv)
    walls.append(time.monotonic() - start)
    if not result.ok:
      raise RuntimeError(f"{argv} failed in the sandbox: {result.summary()}")
    startups.append(result.startup_s)
  plain = [_plain(argv) for _ in range(runs)]
  return {"startup": _ms(startups), "round_trip": _ms(walls), "plain_subprocess": _ms(plain),
          "round_trip_ratio_p50": round(float(np.median(walls) / np.median(plain)), 2)}


def throughput(argv: list[str], workers: int, runs: int, limits: Limits) -> dict:
  """Runs per second of `argv` with `workers` at once: sandboxed (a SandboxPool) and plain."""
  with SandboxPool(workers, limits=limits) as pool:
    start = time.monotonic()
    results = [f.result() for f in [pool.submit(argv) for _ in range(runs)]]
    sandboxed = runs / (time.monotonic() - start)
    failed = sum(not r.ok for r in results)
  with concurrent.futures.ThreadPoolExecutor(workers) as threads:
    start = time.monotonic()
    list(threads.map(lambda _: _plain(argv), range(runs)))
    plain = runs / (time.monotonic() - start)
  return {"workers": workers, "runs": runs, "failed": failed,
          "sandbox_runs_per_s": round(sandboxed, 2), "plain_runs_per_s": round(plain, 2),
          "plain_over_sandbox": round(plain / sandboxed, 2)}


def session_latency(limits: Limits, runs: int) -> dict:
  """Round trip of `true` in one warm session (its shell already started)."""
  with Session.start(SessionSpec(limits)) as session:
    for _ in range(5):
      session.run("true")
    walls = []
    for _ in range(runs):
      start = time.monotonic()
      result = session.run("true")
      walls.append(time.monotonic() - start)
      if not result.ok:
        raise RuntimeError(f"`true` failed in the session: {result}")
  return {"round_trip": _ms(walls)}


def concurrent_sessions(limits: Limits, sessions: int, commands: int) -> dict:
  """`sessions` sessions at once, `commands` commands each (a token echo, a variable, a file)."""
  tokens = [f"token{i:02d}x{os.getpid()}" for i in range(sessions)]

  def one(token):
    walls, outputs = [], []
    with Session.start(SessionSpec(limits)) as session:
      session.run(f"T={token}; echo $T > mine")
      for _ in range(commands):
        start = time.monotonic()
        outputs.append(session.run("echo $T; cat mine").stdout)
        walls.append(time.monotonic() - start)
    return walls, outputs

  start = time.monotonic()
  with concurrent.futures.ThreadPoolExecutor(sessions) as threads:
    results = list(threads.map(one, tokens))
  seconds = time.monotonic() - start
  cross_talk = sum(out != f"{token}\n{token}\n".encode()
                   for token, (_, outs) in zip(tokens, results) for out in outs)
  walls = [w for ws, _ in results for w in ws]
  return {"sessions": sessions, "commands": sessions * commands, "seconds": round(seconds, 2),
          "commands_per_s": round(sessions * commands / seconds, 1), **_ms(walls),
          "wrong_outputs": cross_talk}


def main(argv=None) -> dict:
  parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--json", help="write the figures here")
  parser.add_argument("--runs", type=int, default=40, help="runs per latency measurement")
  args = parser.parse_args(argv)
  limits = Limits(timeout_s=10.0)
  box = Sandbox(limits)
  report = {"machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
            "latency": {f"{name} cold": latency(box.run, cmd, args.runs)
                        for name, cmd in TRIVIAL.items()}, "throughput": {}}
  with SandboxPool(1, limits=limits) as pool:
    for name, cmd in TRIVIAL.items():
      report["latency"][f"{name} warm pool"] = latency(lambda a: pool.submit(a).result(), cmd,
                                                       args.runs)
  session = session_latency(limits, args.runs * 5)
  session["round_trip_ratio_to_cold_sandbox_p50"] = round(
      report["latency"]["true cold"]["round_trip"]["p50_ms"] / session["round_trip"]["p50_ms"], 1)
  session["round_trip_ratio_to_warm_pool_p50"] = round(
      report["latency"]["true warm pool"]["round_trip"]["p50_ms"] / session["round_trip"]["p50_ms"], 1)
  session["concurrent"] = concurrent_sessions(limits, 8, 20)
  report["session"] = session
  report["session_cmd_p50_ms"] = session["round_trip"]["p50_ms"]
  for name, cmd, runs in (("true", TRIVIAL["true"], 32), ("sleep_100ms", SLEEP, 24)):
    rows = [throughput(cmd, workers, max(runs, 3 * workers), limits) for workers in POOL_SIZES]
    report["throughput"][name] = rows
  sleep_rows = {row["workers"]: row["sandbox_runs_per_s"] for row in report["throughput"]["sleep_100ms"]}
  cold = report["latency"]["true cold"]["startup"]["p50_ms"]
  report["targets"] = {
      "startup_p50_ms_true_cold": cold, "startup_p50_under_50ms_cold": cold < 50,
      "startup_p50_ms_true_warm_pool": report["latency"]["true warm pool"]["startup"]["p50_ms"],
      "pool4_over_pool1_sleep_100ms": round(sleep_rows[4] / sleep_rows[1], 2),
      "pool4_at_least_3x_pool1": sleep_rows[4] >= 3 * sleep_rows[1],
      "session_cmd_p50_ms": report["session_cmd_p50_ms"],
      "session_cmd_p50_at_most_5ms": report["session_cmd_p50_ms"] <= 5.0,
      "eight_sessions_no_cross_talk": report["session"]["concurrent"]["wrong_outputs"] == 0}
  report["machine"]["loadavg_after"] = os.getloadavg()
  _print(report)
  if args.json:
    with open(args.json, "w") as handle:
      json.dump(report, handle, indent=2)
  return report


def _print(report: dict):
  print(f"{'latency (ms)':<28}{'startup p50':>12}{'p99':>8}{'round trip p50':>16}{'p99':>8}"
        f"{'plain p50':>11}{'p99':>8}{'ratio':>7}")
  for name, row in report["latency"].items():
    print(f"{name:<28}{row['startup']['p50_ms']:>12}{row['startup']['p99_ms']:>8}"
          f"{row['round_trip']['p50_ms']:>16}{row['round_trip']['p99_ms']:>8}"
          f"{row['plain_subprocess']['p50_ms']:>11}{row['plain_subprocess']['p99_ms']:>8}"
          f"{row['round_trip_ratio_p50']:>7}")
  print(f"\n{'runs/s':<28}{'workers':>8}{'sandbox':>10}{'plain':>10}{'plain/sandbox':>15}")
  for name, rows in report["throughput"].items():
    for row in rows:
      print(f"{name:<28}{row['workers']:>8}{row['sandbox_runs_per_s']:>10}"
            f"{row['plain_runs_per_s']:>10}{row['plain_over_sandbox']:>15}")
  session = report["session"]
  print(f"\n{'round trip of `true` (ms)':<40}{'p50':>8}{'p99':>8}")
  print(f"{'persistent session (warm)':<40}{session['round_trip']['p50_ms']:>8}"
        f"{session['round_trip']['p99_ms']:>8}")
  for name in ("true cold", "true warm pool"):
    row = report["latency"][name]["round_trip"]
    print(f"{'one sandbox per command, ' + name[5:]:<40}{row['p50_ms']:>8}{row['p99_ms']:>8}")
  print(f"session is {session['round_trip_ratio_to_cold_sandbox_p50']}x faster than a cold sandbox, "
        f"{session['round_trip_ratio_to_warm_pool_p50']}x than a warm pool's")
  c = session["concurrent"]
  print(f"{c['sessions']} concurrent sessions: {c['commands']} commands in {c['seconds']} s "
        f"({c['commands_per_s']}/s), p50 {c['p50_ms']} ms, p99 {c['p99_ms']} ms, "
        f"wrong outputs {c['wrong_outputs']}")
  print("\ntargets:", json.dumps(report["targets"]))


if __name__ == "__main__":
  main(sys.argv[1:])
