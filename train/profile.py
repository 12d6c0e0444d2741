"""Profiling a few steps of a training loop: an XLA trace, and the time of each compiled program.

`log.profile_start = N` (0 = off) traces steps N .. N + log.profile_steps - 1 of the loop that runs
(SFT, the reward model's training, the RL steps; each loop its own steps, into its own workdir) with
`jax.profiler` into <workdir>/profile: a TensorBoard profile folder (`plugins/profile/<run>/*.xplane.pb`,
each traced step marked as a step for the profile plugin's step view) and `summary.json`, which the
loop also prints as a table: the time each compiled program (`hlo_module`, e.g. jit__decode,
jit_update) ran over the traced steps, its share of all programs' time, its calls and its longest
operations. It answers "where does the step go" without TensorBoard, e.g. on a pod's host.

Program time is read where the trace records it: on TPU and GPU the device planes' "XLA Modules"
line (the programs' run time on the chips; operations from the "XLA Ops" line, attributed to the
program they ran inside); on the CPU the operations of every thread that ran them, summed over the
threads (two threads busy for 1 ms count 2 ms: the CPU time of the program).

Like MaxText's `profiler=xplane` with `skip_first_n_steps_for_profiler` and `profiler_steps`: start
after the compiles (a step that compiles is traced with its compile), and trace few steps (the trace
of one agent step on the CPU with the Python tracer is tens of MB).
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import re

import jax

TOP_OPS = 8  # operations listed per program


class StepProfiler:
  """Traces steps start .. start + steps - 1 of a loop into `folder` (start 0: does nothing).

  Use: `with profiler.step(step): <the step>` for each step, and `profiler.close()` when the loop
  ends (it stops a trace that the loop's last traced step did not reach, e.g. after a preemption)."""

  def __init__(self, folder: str, start: int, steps: int, *, name: str = "train"):
    if start < 0 or (start and steps < 1):
      raise ValueError(f"log.profile_start={start} must be >= 0 and log.profile_steps={steps} >= 1.")
    self.folder, self.start, self.steps, self.name = folder, start, steps, name
    self.active, self.summary, self.first = False, None, None

  @classmethod
  def from_config(cls, cfg, workdir: str, *, name: str) -> "StepProfiler":
    folder = os.path.join(workdir, "profile")
    if jax.process_count() > 1:  # each process writes its own trace (same host name on a CPU test)
      folder = os.path.join(folder, f"process_{jax.process_index()}")
    return cls(folder, int(cfg.log.profile_start), int(cfg.log.profile_steps), name=name)

  @property
  def last(self) -> int:
    return self.start + self.steps - 1

  @contextlib.contextmanager
  def step(self, step: int):
    """Runs the step inside the trace when it is one of the traced steps."""
    if not self.start or not self.start <= step <= self.last:
      yield
      return
    if not self.active:  # the first traced step (or the first after a resume inside the window)
      os.makedirs(self.folder, exist_ok=True)
      # Work dispatched before the window finishes first: a loop that waits on one device's scalar
      # (e.g. a replicated flag) may leave the previous step still running on the others, and its
      # run would be traced and counted as a call of the traced steps.
      jax.block_until_ready(jax.live_arrays())
      jax.profiler.start_trace(self.folder)
      self.active, self.first = True, step
    try:
      with jax.profiler.StepTraceAnnotation(self.name, step_num=step):
        yield
    except BaseException:
      self._stop(summarize=False)  # the trace is kept; the step's error is what the user sees
      raise
    if step == self.last:
      self._stop(summarize=True, steps=(self.first, step))

  def close(self) -> None:
    if self.active:
      self._stop(summarize=True, steps=(self.first, None))

  def _stop(self, *, summarize: bool, steps=None) -> None:
    jax.profiler.stop_trace()
    self.active = False
    if not summarize:
      return
    try:
      self.summary = {"steps": list(steps), **program_times(self.folder)}
    except (OSError, ValueError, RuntimeError) as error:  # the trace stays; the run goes on
      print(f"profile of {self.name}: the trace in {self.folder} could not be summarized: {error}", flush=True)
      return
    with open(os.path.join(self.folder, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(self.summary, f, indent=1)
    print(format_summary(self.summary, self.name), flush=True)


def newest_trace(folder: str) -> str:
  """The newest .xplane.pb under `folder` (jax writes plugins/profile/<time>/<host>.xplane.pb)."""
  paths = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb trace under {folder}/plugins/profile")
  return max(paths, key=os.path.getmtime)


def program_times(folder: str) -> dict:
  """{"source", "total_ms", "programs": [{program, ms, share, calls, top_ops: [[op, ms, calls]]}]},
  programs by time, longest first, from the newest trace in `folder`."""
  planes = list(jax.profiler.ProfileData.from_file(newest_trace(folder)).planes)  # an iterator
  devices = [p for p in planes if p.name.startswith("/device:")]
  source, events = ("device", _device_events(devices)) if any(
      line.name == "XLA Modules" for p in devices for line in p.lines) else ("cpu threads", _cpu_events(planes))
  time, calls = collections.Counter(), collections.Counter()
  op_time, op_calls = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
  for program, op, ns, is_call in events:
    if op is None:
      time[program] += ns
      calls[program] += is_call
    else:
      op_time[program][op] += ns
      op_calls[program][op] += 1
  total = sum(time.values())
  programs = [{"program": p, "ms": ns / 1e6, "share": ns / total if total else 0.0, "calls": calls[p],
               "top_ops": [[op, t / 1e6, op_calls[p][op]] for op, t in op_time[p].most_common(TOP_OPS)]}
              for p, ns in time.most_common()]
  return {"source": source, "total_ms": total / 1e6, "programs": programs}


def _module_name(name: str) -> str:
  return re.sub(r"\(\d+\)$", "", name)  # "jit_update(12)" -> "jit_update"


def _device_events(devices):
  """(program, None, ns, 1) per program run on a device's "XLA Modules" line; (program, op, ns, 0)
  per operation of its "XLA Ops" line, attributed to the program run it lies in."""
  for plane in devices:
    lines = {line.name: sorted(line.events, key=lambda e: e.start_ns) for line in plane.lines}
    runs = [(e.start_ns, e.start_ns + e.duration_ns, _module_name(e.name)) for e in lines.get("XLA Modules", [])]
    for start, end, program in runs:
      yield program, None, end - start, 1
    i = 0
    for op in lines.get("XLA Ops", []):
      while i < len(runs) and runs[i][1] < op.start_ns:
        i += 1
      if i < len(runs) and runs[i][0] <= op.start_ns:
        yield runs[i][2], op.name, op.duration_ns, 0


def _cpu_events(planes):
  """On the CPU each thread that runs XLA operations records them with the program (`hlo_module`)
  they belong to; an operation that contains others (a loop, a conditional) is counted once, and the
  ones it contains are not counted again. Yields (program, None, ns, calls) for the program's time
  and (program, op, ns, 0) per top-level operation."""
  for plane in planes:
    if plane.name != "/host:CPU":
      continue
    runs = set()  # (program, run_id): a run's operations spread over several threads
    for line in plane.lines:  # XLA's threads, and the caller's for a small program run inline
      covered_until = -1
      for event in sorted(line.events, key=lambda e: e.start_ns):
        stats = dict(event.stats)
        program = stats.get("hlo_module")
        if program is None or event.start_ns < covered_until:
          continue
        covered_until = event.start_ns + event.duration_ns
        is_new_run = (program, stats.get("run_id")) not in runs
        runs.add((program, stats.get("run_id")))
        yield program, None, event.duration_ns, int(is_new_run)
        yield program, event.name, event.duration_ns, 0


def format_summary(summary: dict, name: str, rows: int = 10) -> str:
  """The summary as a table: the `rows` longest programs."""
  first, last = summary["steps"]
  steps = f"{first}-{last}" if last is not None else f"{first}-"
  lines = [f"profile of {name} steps {steps} ({summary['source']}, {summary['total_ms']:.1f} ms in programs):",
           f"  {'program':40s} {'ms':>10s} {'share':>6s} {'calls':>6s}  longest operation"]
  for p in summary["programs"][:rows]:
    top = p["top_ops"][0][0] if p["top_ops"] else ""
    lines.append(f"  {p['program'][:40]:40s} {p['ms']:10.1f} {p['share']:6.1%} {p['calls']:6d}  {top}")
  return "\n".join(lines)
