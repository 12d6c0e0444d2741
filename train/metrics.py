"""Metrics at the edge of the loop: JSONL, TensorBoard, a progress bar, curves, MFU and compile counts.

  writer = MetricsWriter(workdir, total_steps=cfg.rl.num_steps)
  writer.write(step, {"reward": ..., "kl": ..., "tokens_per_s": ...})   # jax/numpy scalars are fine
  writer.close()
  plot_curve(f"{workdir}/metrics.jsonl", "reward", f"{workdir}/reward_curve.png")
  plot_domains(f"{workdir}/eval.jsonl", "eval/accuracy", f"{workdir}/eval_curve.png")  # one line per domain

Files in `workdir`: `metrics.jsonl` (one JSON object per write, with "step"), `tb/` (TensorBoard
events). `CompileCounter` counts XLA compilations by function name, so a loop can log (and a test
assert) that no step compiles after the first.
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import os
import re
import threading
from typing import Any, Iterable, Mapping, NamedTuple

import jax
import numpy as np

from meshrl.model.init import parameter_counts

BAR_KEYS = ("loss", "reward", "kl", "entropy", "tokens_per_s")

# Dense bf16 peak FLOP/s per chip, matched against jax's `device_kind` (first match wins).
PEAK_FLOPS = (
    ("TPU v6 lite", 918e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12),
)


def to_python(value: Any) -> Any:
  """A JSON-ready value: jax/numpy scalars -> float/int/bool, arrays -> (nested) lists."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    value = np.asarray(jax.device_get(value))
    return value.item() if value.ndim == 0 else value.tolist()
  if isinstance(value, Mapping):
    return {str(k): to_python(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_python(v) for v in value]
  return value


def _is_scalar(value: Any) -> bool:
  return isinstance(value, numbers.Number) and not isinstance(value, bool)


def _json_safe(value: Any) -> Any:
  """NaN and inf are not JSON; write them as strings so every line still parses."""
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


class MetricsWriter:
  """Writes one record per step to metrics.jsonl, TensorBoard and a tqdm bar.

  Args:
    workdir: output folder (created).
    tensorboard: log.tensorboard; write `workdir/tb` event files.
    progress_bar: log.progress_bar; show a tqdm bar with `bar_keys`.
    total_steps: length of the bar.
    bar_keys: metrics shown on the bar, when present.
    resume_step: on a resumed run, drop records after this step from metrics.jsonl so the file
      holds each step once (the steps after the checkpoint are trained again).
    primary: whether this process writes (files, bar); default: process 0 of a multi-process job
      only. The others' `write` returns the record and writes nothing.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True, progress_bar: bool = True,
               total_steps: int | None = None, bar_keys: Iterable[str] = BAR_KEYS,
               resume_step: int | None = None, primary: bool | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.primary = jax.process_index() == 0 if primary is None else bool(primary)
    self._file = self._tb = self._bar = None
    self._bar_keys = tuple(bar_keys)
    self._last_step = resume_step or 0
    if not self.primary:
      return
    os.makedirs(workdir, exist_ok=True)
    if resume_step is not None:
      truncate_jsonl(self.path, resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import FileWriter  # pylint: disable=import-outside-toplevel
      self._tb = FileWriter(os.path.join(workdir, "tb"))
    if progress_bar:
      from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm(total=total_steps, initial=resume_step or 0, dynamic_ncols=True)

  def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
    """TensorBoard only: `metrics`' scalars at `step` (a record kept elsewhere, e.g. the evaluation
    before the first step, which eval.jsonl holds and metrics.jsonl does not)."""
    self._board(step, to_python(dict(metrics)))

  def _board(self, step: int, record: Mapping[str, Any]) -> None:
    """The record's scalars ("step" left out) as one TensorBoard event: one Summary of many values,
    where SummaryWriter.add_scalar writes an event per scalar (80 of them took 5.3 ms a step; one event
    0.4 ms). A NaN is written as NaN (metrics.jsonl: "nan")."""
    if self._tb is None:
      return
    from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=import-outside-toplevel
    values = [Summary.Value(tag=key, simple_value=float(value)) for key, value in record.items()
              if key != "step" and _is_scalar(value)]
    if values:
      self._tb.add_summary(Summary(value=values), int(step))

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    """Records `metrics` for `step`; returns the record as written (plain Python values)."""
    record = {"step": int(step), **to_python(dict(metrics))}
    if self._file is None:  # not the primary process
      return record
    self._file.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
    self._file.flush()
    self._board(step, record)
    if self._bar is not None:
      self._bar.update(max(int(step) - self._last_step, 0))
      shown = {k: f"{record[k]:.4g}" for k in self._bar_keys if _is_scalar(record.get(k))}
      self._bar.set_postfix(shown, refresh=False)
    self._last_step = int(step)
    return record

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._bar is not None:
      self._bar.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def truncate_jsonl(path: str, step: int) -> None:
  """Drops the records after `step` (and a torn last line) from a JSONL file of {"step", ...}
  records, e.g. metrics.jsonl or eval.jsonl of a run resumed from the checkpoint of `step`. The file
  is replaced atomically, so a crash here leaves either the old or the new file."""
  if not os.path.exists(path):
    return
  kept = [line for line in read_jsonl(path) if line.get("step", 0) <= step]
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(line) + "\n" for line in kept)
  os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
  """The records of a metrics.jsonl file (a torn last line, from a crash, is ignored)."""
  records = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def tensorboard_events(folder: str):
  """The Events of the tensorboardX event files under `folder` (the writer's tb/), in file order
  (TFRecord framing: an 8-byte length, 4 bytes of its CRC, the Event, 4 bytes of its CRC)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  for name in sorted(os.listdir(folder)):
    if not name.startswith("events.out.tfevents"):
      continue
    with open(os.path.join(folder, name), "rb") as f:
      data = f.read()
    offset = 0
    while offset + 12 <= len(data):
      length = int.from_bytes(data[offset:offset + 8], "little")
      yield event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4


def read_tensorboard(folder: str) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of the scalars in the event files under `folder` (`tensorboard_events`)."""
  scalars = collections.defaultdict(dict)
  for event in tensorboard_events(folder):
    for value in event.summary.value:
      scalars[value.tag][event.step] = value.simple_value
  return dict(scalars)


def plot_curve(metrics_jsonl: str, key: str, out_png: str, *, smooth: int = 1,
               title: str | None = None) -> str:
  """Plots `key` against step from a metrics.jsonl file into `out_png` (matplotlib, Agg).

  Args:
    metrics_jsonl: the file written by MetricsWriter.
    key: the metric, e.g. "reward" (reward_curve.png) or "loss".
    out_png: the image to write.
    smooth: moving-average window drawn over the raw curve (1 = raw only).

  Raises:
    ValueError when no record holds a number for `key`.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  points = [(r["step"], r[key]) for r in read_jsonl(metrics_jsonl) if _is_scalar(r.get(key))]
  if not points:
    raise ValueError(f"{metrics_jsonl} has no numeric {key!r} values to plot.")
  steps, values = (np.asarray(v, np.float64) for v in zip(*points))
  fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
  ax.plot(steps, values, alpha=0.4 if smooth > 1 else 1.0, label=key)
  if smooth > 1 and len(values) >= smooth:
    kernel = np.ones(smooth) / smooth
    ax.plot(steps[smooth - 1:], np.convolve(values, kernel, mode="valid"), label=f"{key} ({smooth}-avg)")
  ax.set_xlabel("step")
  ax.set_ylabel(key)
  ax.set_title(title or key)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png)
  plt.close(fig)
  return out_png


def per_domain_keys(records: Iterable[Mapping[str, Any]], metric: str) -> list[str]:
  """`metric` and every `metric/<domain>` key holding a number in `records` (the evaluator's
  eval/accuracy and eval/accuracy/<domain>), the mean first, then the domains sorted."""
  keys = {k for r in records for k, v in r.items() if k.startswith(metric + "/") and _is_scalar(v)}
  return [metric] + sorted(keys)


def plot_domains(jsonl: str, metric: str, out_png: str, *, title: str | None = None) -> list[str]:
  """Plots `metric` (bold: the mean) and each `metric/<domain>` against step from a JSONL file of
  {"step", ...} records (eval.jsonl) into `out_png`: one line per domain. Returns the keys drawn.

  Raises:
    ValueError when no record holds a number for `metric`.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  records = read_jsonl(jsonl)
  if not any(_is_scalar(r.get(metric)) for r in records):
    raise ValueError(f"{jsonl} has no numeric {metric!r} values to plot.")
  fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
  drawn = []
  for key in per_domain_keys(records, metric):
    points = [(r["step"], r[key]) for r in records if _is_scalar(r.get(key))]
    steps, values = zip(*points)
    mean = key == metric
    ax.plot(steps, values, marker="o", markersize=3, linewidth=2.5 if mean else 1.0, color="black" if mean else None,
            label="mean" if mean else key[len(metric) + 1:])
    drawn.append(key)
  ax.set_xlabel("step")
  ax.set_ylabel(metric)
  ax.set_title(title or f"{metric} per domain")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png)
  plt.close(fig)
  return drawn


def model_flops_per_token(mc, *, seq_len: int, causal: bool = True, training: bool = True) -> float:
  """Model FLOPs per token: matmuls with the active parameters plus attention scores.

  Args:
    mc: a ModelConfig (model/transformer.py).
    seq_len: tokens each token attends over (the packed length T).
    causal: halve the attention term (a token sees T/2 keys on average).
    training: forward + backward (x3) if True, else forward only (generation).

  Returns:
    Training: 6 * N + 3 * A; generation: 2 * N + A. N counts the active parameters (k of E routed
    experts, the output projection, not the embedding lookup, which has no FLOPs); A is the forward
    attention per token, 2 * T * H * (d_qk + d_v) per layer, halved when causal.
  """
  counts = parameter_counts(mc)
  matmul_params = counts["active_per_token"] - (0 if mc.tie_embeddings else counts["embedding"])
  if mc.attention_type == "mla":
    d_qk, d_v = mc.qk_nope_head_dim + mc.qk_rope_head_dim, mc.v_head_dim
  else:
    d_qk = d_v = mc.head_dim
  attention_forward = 2 * seq_len * mc.num_heads * (d_qk + d_v) * mc.num_layers
  if causal:
    attention_forward /= 2
  passes = 3 if training else 1
  return float(2 * passes * matmul_params + passes * attention_forward)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak (all chips)."""
  if peak_flops <= 0:
    raise ValueError(f"peak_flops={peak_flops} must be positive.")
  return tokens_per_s * flops_per_token / peak_flops


def peak_flops(devices: Iterable[jax.Device] | None = None) -> float | None:
  """Summed bf16 peak FLOP/s of `devices` (all by default), or None for unknown kinds (CPU)."""
  total = 0.0
  for device in jax.devices() if devices is None else devices:
    per_chip = next((flops for kind, flops in PEAK_FLOPS if kind in device.device_kind), None)
    if per_chip is None:
      return None
    total += per_chip
  return total


class CompileCounter:
  """Counts XLA compilations (jax's '/jax/core/compile/backend_compile_duration' event).

  Every jit cache miss that reaches the backend fires it once, persistent-cache hits included, with
  the jitted function's name. Use it around a loop:

    counter = CompileCounter()
    ... steps ...
    counter.count("step")  # compilations of functions whose name contains "step"
    counter.close()
  """

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self._lock = threading.Lock()
    self.by_function: collections.Counter[str] = collections.Counter()
    self.seconds = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    if event != self.EVENT:
      return
    with self._lock:
      self.by_function[str(kwargs.get("fun_name", "?"))] += 1
      self.seconds += duration

  def count(self, name_contains: str = "") -> int:
    """Compilations so far of functions whose name contains `name_contains` (all by default)."""
    with self._lock:
      return sum(n for name, n in self.by_function.items() if name_contains in name)

  def close(self) -> None:
    """Stops counting."""
    try:
      jax.monitoring.unregister_event_duration_listener(self._on_event)
    except (AssertionError, ValueError):
      pass

  def __enter__(self) -> "CompileCounter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# --- FLOPs of compiled programs ------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^()]*\)|[^\s(]+)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"^[a-z]+\d*\[([\d,]*)\]")


def _dims(type_text: str) -> tuple[int, ...] | None:
  match = _ARRAY.match(type_text)
  if match is None:
    return None
  return tuple(int(d) for d in match.group(1).split(",") if d)


class ProgramFlops(NamedTuple):
  """Matmul FLOPs of one run of a compiled program: `fixed + per_iteration * n`, where n is the
  trip count of its loops whose count XLA does not know (a decode loop that stops early)."""
  fixed: float
  per_iteration: float

  def at(self, iterations: float) -> float:
    return self.fixed + self.per_iteration * iterations


def program_flops(hlo_text: str) -> ProgramFlops:
  """The dot (matmul) FLOPs of an optimised HLO module (`jitted.lower(...).compile().as_text()`),
  with every while loop's body counted as often as it runs.

  XLA's `cost_analysis()` counts a loop body once, so a scan over L layers or a T-step decode
  loop is undercounted L or T times. Here a loop with `known_trip_count` (scans, fori_loops)
  multiplies its body; a loop without one (lax.while_loop with a data-dependent stop) is returned
  as `per_iteration`, to be multiplied by the trip count the caller observed. A dot costs
  2 * prod(result dims) * prod(contracted dims), a convolution (TPU HLO writes matmuls as
  convolutions) 2 * prod(result dims) * prod(kernel dims) / output features; elementwise work is not counted (MFU counts
  matmuls, as `model_flops_per_token` does). Nested unknown loops are counted as one level.
  """
  computations: dict[str, list[str]] = {}
  params: dict[str, dict[str, tuple]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header is not None:
      current = header.group(1)
      computations[current] = []
      params[current] = {}
      for part in re.finditer(r"([\w.\-]+):\s*([a-z]+\d*\[[\d,]*\])", header.group(2)):
        params[current][part.group(1)] = _dims(part.group(2))
      continue
    if current is not None and line.strip() == "}":
      current = None
      continue
    if current is not None:
      computations[current].append(line)
  memo: dict[str, ProgramFlops] = {}

  def cost(name: str) -> ProgramFlops:
    if name in memo:
      return memo[name]
    memo[name] = ProgramFlops(0.0, 0.0)  # guards against cycles
    shapes = dict(params.get(name, {}))
    fixed = per_iteration = 0.0
    for line in computations.get(name, []):
      match = _INSTRUCTION.match(line)
      if match is None:
        continue
      result, type_text, opcode, rest = match.groups()
      shapes[result] = _dims(type_text)
      if opcode == "dot":
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        lhs = shapes.get(operands[0]) if operands else None
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        if lhs is not None and shapes[result] is not None and contracting is not None:
          inner = int(np.prod([lhs[int(d)] for d in contracting.group(1).split(",") if d]))
          fixed += 2.0 * float(np.prod(shapes[result])) * inner
      elif opcode == "convolution":  # how TPU HLO writes most matmuls
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        rhs = shapes.get(operands[1]) if len(operands) > 1 else None
        labels = re.search(r"dim_labels=\w+_(\w+)->\w+", rest)
        if rhs is not None and shapes[result] is not None and labels is not None and "o" in labels.group(1):
          # each output element sums kernel spatial x input features = prod(rhs) / output features
          per_output = float(np.prod(rhs)) / rhs[labels.group(1).index("o")]
          fixed += 2.0 * float(np.prod(shapes[result])) * per_output
      elif opcode == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest)
        condition = re.search(r"condition=%?([\w.\-]+)", rest)
        inner = cost(body.group(1)) if body else ProgramFlops(0.0, 0.0)
        if condition:
          inner = ProgramFlops(inner.fixed + cost(condition.group(1)).fixed, inner.per_iteration)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
        if trips is not None:
          fixed += int(trips.group(1)) * inner.fixed
          per_iteration += int(trips.group(1)) * inner.per_iteration
        else:
          per_iteration += inner.fixed + inner.per_iteration
      else:
        called = re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)", rest)
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        if branches is not None:  # a conditional runs one branch: count the dearest
          options = [cost(b.strip().lstrip("%")) for b in branches.group(1).split(",") if b.strip()]
          if options:
            dearest = max(options, key=lambda c: c.fixed)
            fixed, per_iteration = fixed + dearest.fixed, per_iteration + dearest.per_iteration
        for callee in called:
          inner = cost(callee)
          fixed, per_iteration = fixed + inner.fixed, per_iteration + inner.per_iteration
    memo[name] = ProgramFlops(fixed, per_iteration)
    return memo[name]

  entry = next((re.match(r"^ENTRY\s+%?([\w.\-]+)", l).group(1) for l in hlo_text.splitlines()
                if l.startswith("ENTRY")), None)
  if entry is None:
    raise ValueError("program_flops: the HLO text has no ENTRY computation.")
  return cost(entry)
