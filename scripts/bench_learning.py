"""Learning benchmark: held-out accuracy against cumulative training FLOPs (a compute-to-capability curve),
each named experiment the training job itself (scripts/rl.py) within a fixed CPU-time budget.

Run:  JAX_PLATFORMS=cpu python scripts/bench_learning.py --json runs/bench_learning.json
      (--experiments demo,hard,hard_reverse,hard_copy,hard_sort,joint; --budget_s 1200 CPU-seconds each;
      --keep_runs to keep the runs' folders)

Experiments (issue 33):
  demo  configs/tiny.py: the CPU demo (reversal of three letters from a warm start right ~40% of the time).
  hard  configs/tiny_hard.py: reverse, copy and sort one level harder than the demo, from a warm start
        under 5% held-out greedy there, with the preset's bootstrapping options on (retries of unsolved
        prompts, the replay of successes, rejection-sampling fine-tuning; the level curriculum with
        --config.data.level_curriculum=all).
  hard_reverse, hard_copy, hard_sort  configs/tiny_hard.py:<family>: one family alone, from its own warm
        start under 5% held-out greedy at level 2, with the same options. Target (b): each of the three
        from under 5% to >= 50% held-out (the JSON's target_b; the last evaluation within the budget).
  joint configs/tiny_multi.py: joint training over its n = 8 registry domains (budget --budget_s), then
        each domain alone for the same total compute: the same preset with data.domains a file holding
        that domain's row only, --budget_s / n CPU-seconds, rl.sft_steps and rl.num_steps (--max_steps)
        divided by n (rounded up), eval.num_prompts the joint run's per-domain share (so each domain is
        evaluated on the same held-out prompts: rl/envs/registry.py keys them by the domain's name).
        Writes per domain the joint and the alone run's held-out accuracy (last evaluation), their delta and
        ratio, and whether target (c) holds (joint >= 90% of alone on every domain, above it on the mean).
        --domains chooses which domains run alone (default: all; their budget stays --budget_s / n).

Each runs as `python scripts/rl.py --config=... --workdir=<a fresh folder>` with rl.num_steps raised
and eval.every set (--eval_every); when its CPU time (user + system, this machine's cores together)
passes --budget_s it gets SIGTERM, finishes the step in flight, saves it and exits, as any
preempted run does. The curve's points are the run's evaluations (eval.jsonl): step 0 (after the
warm start) and every --eval_every RL steps; each point's x is the training FLOPs spent up to it:
the warm start (model FLOPs per token x its trained tokens: train/metrics.model_flops_per_token),
then each RL step's generation and update FLOPs (the compiled programs' cost, as the job records them:
gen_flops_per_s x rollout_s + update_flops_per_s x update_s) and its rejection-sampling SFT rounds.
Evaluation is not counted as training.

Writes the JSON (per experiment: points [{step, train_flops, cpu_s, accuracy, per-domain accuracy}],
the first and best accuracy, the CPU time and wall time used) and, when matplotlib is installed, a PNG
beside it (PATH with .png). A run's folder is created under a fresh temporary folder that is removed
at the end (unless --keep_runs); nothing else is written or deleted.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from meshrl.configs import cli
from meshrl.configs.tiny_hard import FAMILY_LEVEL2_WEIGHT

FAMILIES = tuple(FAMILY_LEVEL2_WEIGHT)  # the families configs/tiny_hard.py:<family> takes
EXPERIMENTS = {
    "demo": ("configs/tiny.py", []),
    "hard": ("configs/tiny_hard.py", []),
    **{f"hard_{family}": (f"configs/tiny_hard.py:{family}", []) for family in FAMILIES},
    "joint": ("configs/tiny_multi.py", []),
}
JOINT = ("joint",)  # experiments compared with each of their domains trained alone (issue 33 (c))
TARGET_SHARE = 0.9  # (c): joint reaches this share of each domain's alone accuracy
TARGET_B = (0.05, 0.5)  # (b): a hard family's warm start under 5% held-out, its run at >= 50% at the end
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TICKS = os.sysconf("SC_CLK_TCK")


def _flags(argv):
  parser = cli.ArgumentParser(description=__doc__)
  parser.add_argument("--json", required=True, help="where to write the results (and PATH.png)")
  parser.add_argument("--experiments", default="demo,hard", help=f"comma-separated, of {sorted(EXPERIMENTS)}")
  parser.add_argument("--budget_s", type=float, default=1200.0,
                      help="CPU seconds (user + system, all cores) each experiment may use")
  parser.add_argument("--eval_every", type=int, default=10, help="RL steps between held-out evaluations")
  parser.add_argument("--max_steps", type=int, default=1000, help="rl.num_steps (the budget usually ends a run first)")
  parser.add_argument("--keep_runs", default=None, help="keep the runs' folders under this new folder")
  parser.add_argument("--domains", default="", help="joint: the domains to train alone (default: all of them)")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for every experiment (e.g. --set rl.rft_every=0)")
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.experiments.split(",") if n.strip()]
  unknown = [n for n in names if n not in EXPERIMENTS]
  if unknown or not names:
    parser.error(f"--experiments={args.experiments!r}: choose from {sorted(EXPERIMENTS)}.")
  if not args.budget_s > 0:
    parser.error(f"--budget_s={args.budget_s} must be positive.")
  if args.eval_every < 1 or args.max_steps < 1:
    parser.error(f"--eval_every={args.eval_every} and --max_steps={args.max_steps} must be at least 1.")
  if args.keep_runs and os.path.exists(args.keep_runs):
    parser.error(f"--keep_runs={args.keep_runs!r} exists: name a new folder (nothing is overwritten).")
  for item in args.set:
    if "=" not in item:
      parser.error(f"--set {item!r}: write KEY=VALUE, e.g. rl.rft_every=0.")
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  for name in names:  # a misspelt --set key is refused here, before any run
    path, overrides = EXPERIMENTS[name]
    try:
      cfg = configs.load(os.path.join(_ROOT, path), overrides + args.set)
    except ValueError as error:
      parser.error(f"--set / experiment {name!r}: {error}")
    if name in JOINT:
      try:
        rows = domain_rows(cfg.data.domains)
      except ValueError as error:
        parser.error(f"experiment {name!r}: {error}")
      chosen = [d.strip() for d in args.domains.split(",") if d.strip()]
      unknown = sorted(set(chosen) - set(rows))
      if unknown:
        parser.error(f"--domains={args.domains!r}: {unknown} not among experiment {name!r}'s domains {sorted(rows)}.")
  if args.domains and not set(names) & set(JOINT):
    parser.error(f"--domains={args.domains!r} applies to the experiments {list(JOINT)}, none of which is chosen.")
  json_dir = os.path.dirname(os.path.abspath(args.json))
  if not os.path.isdir(json_dir):
    parser.error(f"--json={args.json!r}: its folder {json_dir} does not exist.")
  return args, names


def cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of process `pid` (every thread) and its waited-for children (/proc)."""
  with open(f"/proc/{pid}/stat", encoding="ascii") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return sum(int(v) for v in fields[11:15]) / _TICKS  # utime, stime, cutime, cstime


def run_experiment(name: str, workdir: str, args) -> dict:
  """The training job of experiment `name` in `workdir` under the CPU budget -> its raw outcome."""
  config, overrides = EXPERIMENTS[name]
  return run_job(config, overrides, workdir, args, budget_s=args.budget_s)


def run_job(config: str, overrides: list[str], workdir: str, args, *, budget_s: float) -> dict:
  """scripts/rl.py on `config` with `overrides` (after the bench's own: rl.num_steps=--max_steps,
  eval.every=--eval_every, which they may replace) in `workdir`, stopped by SIGTERM once its CPU time
  passes `budget_s` -> {"wall_s", "cpu_s", "stopped_by_budget", "log_tail"}."""
  name = os.path.basename(workdir)
  command = [sys.executable, os.path.join(_ROOT, "scripts", "rl.py"), f"--config={os.path.join(_ROOT, config)}",
             f"--workdir={workdir}", f"--config.rl.num_steps={args.max_steps}",
             f"--config.eval.every={args.eval_every}", "--config.log.progress_bar=false",
             "--config.checkpoint.every=100000", "--config.log.plot=false"]
  command += [f"--config.{item}" for item in overrides + args.set]
  start, used, stopped = time.perf_counter(), 0.0, False
  with open(os.path.join(workdir + ".log"), "w", encoding="utf-8") as log:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=_ROOT)
    while process.poll() is None:
      try:
        used = cpu_seconds(process.pid)
      except (FileNotFoundError, ProcessLookupError):
        break
      if used > budget_s and not stopped:
        process.send_signal(signal.SIGTERM)  # the job saves the step in flight and exits 0
        stopped = True
      time.sleep(0.5)
    process.wait()
  wall = time.perf_counter() - start
  with open(workdir + ".log", encoding="utf-8") as f:
    tail = f.read()[-2000:]
  if process.returncode:
    raise RuntimeError(f"experiment {name!r} exited {process.returncode}: {tail}")
  return {"wall_s": wall, "cpu_s": used, "stopped_by_budget": stopped, "log_tail": tail}


def _jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def warm_start_flops(workdir: str):
  """(the warm start's training FLOPs, model FLOPs per trained token, the run's config): model FLOPs
  per token (forward + backward, train/metrics.model_flops_per_token) x the tokens it trained on."""
  # pylint: disable=import-outside-toplevel
  from ml_collections import ConfigDict
  from meshrl.train.init_from import model_config
  from meshrl.train.metrics import model_flops_per_token
  # pylint: enable=import-outside-toplevel
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    cfg = ConfigDict(json.load(f))
  per_token = model_flops_per_token(model_config(cfg), seq_len=cfg.data.seq_len)
  return per_token * cfg.rl.sft_steps * cfg.rl.sft_batch_size * cfg.data.seq_len, per_token, cfg


def curve(workdir: str) -> tuple[list[dict], dict]:
  """The evaluations of the run in `workdir` with the training FLOPs spent up to each."""
  warm, per_token, cfg = warm_start_flops(workdir)
  steps = _jsonl(os.path.join(workdir, "metrics.jsonl"))
  rft_flops = per_token * cfg.rl.get("rft_steps", 0) * cfg.rl.sft_batch_size * cfg.data.seq_len
  spent, by_step = warm, {0: warm}
  for record in steps:
    spent += (record.get("gen_flops_per_s", 0.0) * record.get("rollout_s", 0.0)
              + record.get("update_flops_per_s", 0.0) * record.get("update_s", 0.0))
    spent += rft_flops if "rft_loss" in record else 0.0
    by_step[record["step"]] = spent
  points = []
  for row in _jsonl(os.path.join(workdir, "eval.jsonl")):
    if row["step"] not in by_step:
      continue
    points.append({"step": row["step"], "train_flops": by_step[row["step"]], "accuracy": row["eval/accuracy"],
                   **{k.split("/", 2)[2]: v for k, v in row.items() if k.startswith("eval/accuracy/")}})
  summary = {"rl_steps": len(steps), "warm_start_flops": warm,
             "solved_frac_first10": _mean(r.get("solved_frac") for r in steps[:10]),
             "solved_frac_last10": _mean(r.get("solved_frac") for r in steps[-10:])}
  return points, summary


def _mean(values) -> float | None:
  values = [v for v in values if v is not None]
  return sum(values) / len(values) if values else None


def domain_rows(path: str) -> dict[str, dict]:
  """{domain name: its registry row as written} of the data.domains file `path` (checked by
  rl/envs/registry.load_domains first; ValueError naming the file and line)."""
  from meshrl.rl.envs.registry import load_domains  # pylint: disable=import-outside-toplevel
  if not path:
    raise ValueError("its config has no data.domains registry to train domain by domain.")
  load_domains(path)
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  base = os.path.dirname(os.path.abspath(path))
  for row in rows:  # a file-backed source is relative to the registry: keep it valid from elsewhere
    kind, _, target = row["source"].partition(":")
    if kind != "generator":
      row["source"] = f"{kind}:{os.path.normpath(os.path.join(base, target))}"
  return {row["name"]: row for row in rows}


def alone_plans(cfg, budget_s: float, folder: str, chosen: list[str] | None = None) -> list[dict]:
  """The single-domain runs that match joint run `cfg` (its n registry domains, CPU budget
  `budget_s`): for each domain of `chosen` (default all), {"domain", "budget_s": budget_s / n,
  "overrides"}: data.domains a one-row file written in `folder`, rl.sft_steps and rl.num_steps divided
  by n (rounded up), eval.every likewise, eval.num_prompts the joint run's share per domain."""
  rows = domain_rows(cfg.data.domains)
  n = len(rows)
  share = lambda value: max(1, math.ceil(value / n))  # noqa: E731
  plans = []
  for domain in chosen or sorted(rows):
    path = os.path.join(folder, f"domain_{domain}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      f.write(json.dumps(rows[domain]) + "\n")
    overrides = [f"data.domains={path}", f"rl.sft_steps={math.ceil(cfg.rl.sft_steps / n)}",
                 f"rl.num_steps={share(cfg.rl.num_steps)}", f"eval.every={share(cfg.eval.every)}",
                 f"eval.num_prompts={max(1, cfg.eval.num_prompts // n)}"]
    plans.append({"domain": domain, "budget_s": budget_s / n, "overrides": overrides})
  return plans


def run_joint(name: str, base: str, args, runner=run_job) -> dict:
  """Experiment `name` of JOINT: the joint run under --budget_s, then each domain alone
  (`alone_plans`), each through `runner(config, overrides, workdir, args, budget_s=...)` (run_job; a
  test injects its own) -> the result with per-domain deltas (joint - alone, last evaluations)."""
  from meshrl import configs  # pylint: disable=import-outside-toplevel
  config, overrides = EXPERIMENTS[name]
  overrides = overrides + [f"rl.num_steps={args.max_steps}", f"eval.every={args.eval_every}"]
  cfg = configs.load(os.path.join(_ROOT, config), overrides + args.set)
  chosen = [d.strip() for d in args.domains.split(",") if d.strip()] or None
  workdir = os.path.join(base, name)
  outcome = runner(config, overrides, workdir, args, budget_s=args.budget_s)
  joint = _result(config, workdir, outcome)
  alone, plans = {}, alone_plans(cfg, args.budget_s, base, chosen)
  for plan in plans:
    alone_dir = os.path.join(base, f"{name}_alone_{plan['domain']}")
    # after the joint run's own overrides, so the divided steps replace them
    outcome = runner(config, overrides + plan["overrides"], alone_dir, args, budget_s=plan["budget_s"])
    alone[plan["domain"]] = {**_result(config, alone_dir, outcome, allow_empty=True),
                             "budget_cpu_s": plan["budget_s"], "overrides": plan["overrides"]}
  last = joint["points"][-1] if joint["points"] else {}
  deltas = {}
  for domain, result in alone.items():
    mine = last.get(domain)
    theirs = result["points"][-1].get(domain) if result["points"] else None
    deltas[domain] = {"joint": mine, "alone": theirs,
                      "delta": None if mine is None or theirs is None else mine - theirs,
                      "ratio": None if mine is None or not theirs else mine / theirs,
                      "alone_train_flops": result["points"][-1]["train_flops"] if result["points"] else None}
  known = [d for d in deltas.values() if d["joint"] is not None and d["alone"] is not None]
  mean_joint = _mean(d["joint"] for d in known)
  mean_alone = _mean(d["alone"] for d in known)
  holds = bool(known) and len(known) == len(deltas) and mean_joint > mean_alone and all(
      d["joint"] >= TARGET_SHARE * d["alone"] for d in known)
  return {**joint, "domains": len(domain_rows(cfg.data.domains)), "alone": alone, "deltas": deltas,
          "alone_curve": alone_curve(alone),
          "mean_joint": mean_joint, "mean_alone": mean_alone,
          "joint_train_flops": last.get("train_flops"),
          "alone_train_flops": sum(d["alone_train_flops"] or 0.0 for d in deltas.values()),
          "target_c": holds}


def alone_curve(alone: dict) -> list[dict]:
  """The runs alone taken together: their i-th evaluations as one point, the training FLOPs summed
  and the accuracy the mean over domains (as many points as the shortest run has)."""
  runs = [(domain, result["points"]) for domain, result in alone.items()]
  count = min((len(points) for _, points in runs), default=0)
  return [{"train_flops": sum(points[i]["train_flops"] for _, points in runs),
           "accuracy": sum(points[i].get(domain, 0.0) for domain, points in runs) / len(runs)}
          for i in range(count)]


def _result(config: str, workdir: str, outcome: dict, *, allow_empty: bool = False) -> dict:
  """One run's curve and summary (see `curve`); RuntimeError when it ended before an RL step,
  unless `allow_empty` (a domain alone whose budget share ends in its warm start: its step 0 counts)."""
  points, summary = curve(workdir)
  if summary["rl_steps"] == 0 and not allow_empty:
    raise RuntimeError(f"the run in {workdir} ended before its first RL step (the warm start and "
                       f"compilation used the budget); give a larger --budget_s.")
  return {"config": config, "points": points, **summary,
          "first_accuracy": points[0]["accuracy"] if points else None,
          "best_accuracy": max((p["accuracy"] for p in points), default=None),
          "last_accuracy": points[-1]["accuracy"] if points else None,
          **{k: v for k, v in outcome.items() if k != "log_tail"}}


def target_b(results: dict) -> dict | None:
  """Issue 33 (b) over the hard_<family> experiments among `results`: {"families": {family: {"first",
  "last", "met"}}, "met": every family of FAMILIES ran, started under TARGET_B[0] and ended at or above
  TARGET_B[1]}; None when none of them ran."""
  low, high = TARGET_B
  families = {}
  for family in FAMILIES:
    result = results.get(f"hard_{family}")
    if result is None:
      continue
    first, last = result["first_accuracy"], result["last_accuracy"]
    families[family] = {"first": first, "last": last,
                        "met": first is not None and last is not None and first < low and last >= high}
  if not families:
    return None
  return {"families": families, "met": len(families) == len(FAMILIES) and all(f["met"] for f in families.values())}


def plot(results: dict, path: str) -> bool:
  """Accuracy against training FLOPs, one line per experiment; False when matplotlib is missing."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, result in results.items():
    points = result["points"]
    if result.get("alone_curve"):  # a JOINT experiment: the mean over its domains, as the runs alone's
      domains = list(result["deltas"])
      points = [{"train_flops": p["train_flops"], "accuracy": sum(p.get(d, 0.0) for d in domains) / len(domains)}
                for p in points]
      name = f"{name} (mean over domains)"
    ax.plot([p["train_flops"] for p in points], [100 * p["accuracy"] for p in points], marker="o", label=name)
    if result.get("alone_curve"):  # its domains alone, FLOPs summed, mean over domains
      together = result["alone_curve"]
      ax.plot([p["train_flops"] for p in together], [100 * p["accuracy"] for p in together], marker="s",
              linestyle="--", label="each domain alone (FLOPs summed, mean over domains)")
  ax.set_xlabel("cumulative training FLOPs (warm start + RL)")
  ax.set_ylabel("held-out greedy accuracy (%)")
  ax.set_xscale("log")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def deltas_table(result: dict) -> str:
  """The per-domain table of a JOINT experiment's result (markdown)."""
  pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
  lines = [f"| domain | joint (%) | alone (%) | delta (points) | joint / alone | alone steps | alone train FLOPs |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for domain, d in result["deltas"].items():
    ratio = "-" if d["ratio"] is None else f"{d['ratio']:.2f}"
    flops = "-" if d["alone_train_flops"] is None else f"{d['alone_train_flops']:.3g}"
    lines.append(f"| {domain} | {pct(d['joint'])} | {pct(d['alone'])} | {pct(d['delta'])} | {ratio} | "
                 f"{result['alone'][domain]['rl_steps']} | {flops} |")
  lines.append(f"| **mean** | {pct(result['mean_joint'])} | {pct(result['mean_alone'])} | "
               f"{pct(None if result['mean_joint'] is None else result['mean_joint'] - result['mean_alone'])} | | | |")
  joint_flops = result["joint_train_flops"] or 0.0
  lines.append(f"joint: {result['rl_steps']} RL steps, {joint_flops:.3g} training FLOPs, {result['cpu_s']:.0f} CPU-s; "
               f"alone together: {result['alone_train_flops']:.3g} training FLOPs, "
               f"{sum(a['cpu_s'] for a in result['alone'].values()):.0f} CPU-s; target (c) "
               f"{'met' if result['target_c'] else 'not met'}")
  return "\n".join(lines)


def main(argv) -> int:
  args, names = _flags(argv)
  base = args.keep_runs or tempfile.mkdtemp(prefix="bench_learning_")
  os.makedirs(base, exist_ok=bool(not args.keep_runs))
  results = {}
  try:
    for name in names:
      if name in JOINT:
        results[name] = run_joint(name, base, args)
        continue
      workdir = os.path.join(base, name)
      try:
        results[name] = _result(EXPERIMENTS[name][0], workdir, run_experiment(name, workdir, args))
      except RuntimeError as error:
        raise RuntimeError(f"--budget_s={args.budget_s}: experiment {name!r}: {error}") from None
  finally:
    if not args.keep_runs:
      shutil.rmtree(base, ignore_errors=True)
  report = {"budget_cpu_s": args.budget_s, "eval_every": args.eval_every, "overrides": args.set,
            "experiments": results, "target_b": target_b(results)}
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)
  png = os.path.splitext(args.json)[0] + ".png"
  drew = plot(results, png)
  print(f"{'experiment':<12} {'steps':>6} {'cpu_s':>7} {'wall_s':>7} {'first':>7} {'best':>7} {'last':>7} "
        f"{'train FLOPs':>12}")
  for name, r in results.items():
    flops = r["points"][-1]["train_flops"] if r["points"] else 0.0
    print(f"{name:<12} {r['rl_steps']:>6} {r['cpu_s']:>7.0f} {r['wall_s']:>7.0f} {r['first_accuracy']:>7.3f} "
          f"{r['best_accuracy']:>7.3f} {r['last_accuracy']:>7.3f} {flops:>12.3g}")
  for name, r in results.items():
    if "deltas" in r:
      print(deltas_table(r))
  if report["target_b"]:
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    held = ", ".join(f"{family} {pct(f['first'])} -> {pct(f['last'])}"
                     for family, f in report["target_b"]["families"].items())
    print(f"target (b), each family from a warm start under {100 * TARGET_B[0]:.0f}% to >= "
          f"{100 * TARGET_B[1]:.0f}%: {'met' if report['target_b']['met'] else 'not met'} ({held})")
  print(f"wrote {args.json}" + (f" and {png}" if drew else " (no matplotlib: no PNG)"))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
