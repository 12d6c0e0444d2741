"""What an AOT compile of one RL program reports (rl/step/aot.py builds and compiles the programs):
`StepReport` (bytes per chip, fit against HBM, FLOPs, collective bytes, projected step time, the host
tier's figures), the diagnosis of a program that does not fit, and the "Will it fit?" table.
The compiled HLO text is read by sharding/traffic.py (shape bytes, collectives, largest buffers)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import jax


HBM_FRACTION = 0.9  # a step "fits" when its bytes per chip are at most this share of HBM
ASSUMED_MFU = 0.4  # model FLOPs utilisation the projected step time assumes


def largest_arguments(args: Any, count: int = 5) -> list[str]:
  """The `count` largest per-chip shards among abstract arguments ("path dtype[shard shape] GiB")."""
  found = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(args):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
      shard = leaf.sharding.shard_shape(leaf.shape)
      size = math.prod(shard) * leaf.dtype.itemsize
      name = jax.tree_util.keystr(path, simple=True, separator="/")
      found.append((size, f"{name} {leaf.dtype}{list(shard)} {size / 2 ** 30:.2f} GiB"))
  found.sort(key=lambda f: -f[0])
  return [text for _, text in found[:count]]


@dataclasses.dataclass
class StepReport:
  """What one compiled step needs per chip, and what it would take (see the module docstring)."""
  step: str
  topology: str
  chips: int
  mesh: dict
  per_chip: dict  # {argument, output, temp, code, alias, total} bytes; empty if compile ran out of HBM
  hbm_per_chip: int | None
  fits: bool | None  # None: no HBM size known (not a TPU)
  flops: float | None  # XLA cost analysis per chip; loop bodies counted once
  model_flops: float  # the step's model FLOPs over all chips (train/metrics.py)
  tokens: int
  collective_bytes: dict
  projected_step_s: float | None  # model_flops / (chips x peak x ASSUMED_MFU) / (1 - bubble_fraction)
  compile_s: float
  diagnosis: str = ""  # why it does not fit: bytes needed vs available, largest buffers
  microbatches: int | None = None  # pipelined training steps: microbatches per forward
  bubble_fraction: float | None = None  # pipelined training steps: (S - 1) / (M + S - 1)
  grad_collective_bytes: float | None = None  # bytes a chip sends reducing gradients per step (sharding/traffic.py)
  ici_bytes: float | None = None  # bytes a chip sends over ICI per step, loops counted as they run
  dcn_bytes: float | None = None  # bytes a chip sends across slices (DCN) per step
  kv_host_bytes: int | None = None  # the decode step with a host tier: rl.kv_host_bytes
  kv_host_row_bytes: int | None = None  # bytes of one paused slot's row (host_tier_row_bytes)
  kv_host_rows: int | None = None  # rows rl.kv_host_bytes holds

  @classmethod
  def from_json(cls, record: dict) -> "StepReport":
    """The report `to_json` wrote (its explanatory keys dropped; a field it lacks is None)."""
    return cls(**{f.name: record.get(f.name) for f in dataclasses.fields(cls)})

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(hbm_fraction=HBM_FRACTION, assumed_mfu=ASSUMED_MFU,
               flops_counting="XLA cost_analysis per chip; scan/while bodies counted once",
               projection="model_flops / (chips * peak_bf16_flops * assumed_mfu) / (1 - bubble_fraction)")
    return out


def oom_diagnosis(step: str, message: str, hbm: int | None, args: Any) -> str:
  """libtpu's RESOURCE_EXHAUSTED (bytes required vs available) and the largest argument shards."""
  needed = re.search(r"(total memory required.*?available HBM \([\d.]+[GMK]?\))", message)
  head = needed.group(1) if needed else message.strip().splitlines()[0][:300]
  if "Vmem" in message:  # a Pallas kernel's blocks overflow the core's scoped VMEM, not HBM
    head = f"a kernel's blocks exceed the TPU core's scoped VMEM (smaller blocks fit): {head}"
  return (f"step {step!r} does not fit: {head}, HBM per chip {hbm} bytes; largest arguments per "
          f"chip: " + " | ".join(largest_arguments(args)))


def markdown_table(reports: Sequence[StepReport]) -> str:
  """The "Will it fit?" table of docs/benchmarks.md; with a pipelined step among the reports, a last
  column gives each step's microbatches and bubble fraction."""
  gib = lambda b: f"{b / 2 ** 30:.1f}"  # noqa: E731
  piped = any(r.bubble_fraction is not None for r in reports)
  lines = ["| step | topology | chips | argument GiB | temp GiB | total GiB / chip | HBM GiB | "
           "fits (<= 90%) | model PFLOP | projected s (MFU 40%) |" + (" microbatches, bubble |" if piped else ""),
           "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if piped else "")]
  for r in reports:
    total = gib(r.per_chip["total"]) if r.per_chip else "OOM"
    bubble = "-" if r.bubble_fraction is None else f"{r.microbatches}, {r.bubble_fraction:.0%}"
    lines.append(
        f"| {r.step} | {r.topology} | {r.chips} | {gib(r.per_chip['argument']) if r.per_chip else '-'} | "
        f"{gib(r.per_chip['temp']) if r.per_chip else '-'} | {total} | "
        f"{gib(r.hbm_per_chip) if r.hbm_per_chip else '-'} | {'yes' if r.fits else 'NO'} | "
        f"{r.model_flops / 1e15:.3g} | "
        f"{'-' if r.projected_step_s is None else f'{r.projected_step_s:.3g}'} |" + (f" {bubble} |" if piped else ""))
  lines += [f"\n{host_tier_line(r)}" for r in reports if r.kv_host_rows is not None]
  return "\n".join(lines)


def host_tier_line(report: StepReport) -> str:
  """The host tier's figures in a sentence (rl.kv_host_bytes, one row's bytes, the rows it holds)."""
  return (f"Host tier (rl.kv_host_bytes={report.kv_host_bytes}, {report.kv_host_bytes / 2 ** 30:.2f} GiB): one "
          f"paused slot's row (target + draft caches, logits, position) is {report.kv_host_row_bytes} bytes "
          f"({report.kv_host_row_bytes / 2 ** 20:.2f} MiB); the tier holds {report.kv_host_rows} rows.")
