"""What a compiled program sends over the chips' links: per-chip collective traffic read off its HLO.

rl/step/aot.py's `collective_bytes` adds up each collective's result once; here every collective counts
the bytes one chip sends under the usual ring algorithms, for its group of P chips (from the
instruction's replica groups), times how often its computation runs (a while loop's body as many
times as its trip count):

  all-gather            result x (P - 1) / P      (each chip receives the P - 1 other pieces)
  reduce-scatter        result x (P - 1)          (the operand is P results)
  all-reduce            2 x result x (P - 1) / P  (a reduce-scatter, then an all-gather)
  all-to-all (ragged)   result x (P - 1) / P      (the receive buffer: an upper bound for ragged)
  collective-permute    result

A group whose chips lie on more than one slice crosses DCN; all others stay on ICI. On a multi-slice
TPU topology XLA hands the slice-crossing part of a collective to the megascale runtime as a host
`send` (its `_xla_megascale_transfer_type` names the collective): each such send counts its buffer's
bytes over DCN.

Gradient collectives (`grad_collective_bytes`) are the reductions of parameter gradients: the
all-reduces and reduce-scatters of the backward pass, and every collective of the explicit gradient
reductions (sharding/compress.py, named scope GRAD_SCOPE). In TPU HLO the partitioner's own weight-gradient
reductions carry no op name; they count as backward ones in a program that has a backward pass (any
op named `transpose(...)`), and as nothing else in one that has none (prefill, decode). `explicit` is the part of `grad` in
GRAD_SCOPE: the reductions optim.grad_collective_dtype sets the wire format of (the blocks' Dense and
expert weights); the embedding's, the norms', the router's and the head's stay the partitioner's.

Trip counts: a while loop's `known_trip_count`, else its condition's `counter < constant` (how scans
and fori_loops compile); a loop with neither counts once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import numpy as np

from meshrl.sharding.compress import GRAD_SCOPE  # the explicit gradient reductions' named scope

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_MEGASCALE = re.compile(r"=\s*\((\w+\[[\d,]*\]).*\ssend\(.*_xla_megascale_transfer_type=\"(\w+)\"")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(map(re.escape, COLLECTIVES)) + r")(-start|-done)?\(")


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota device list "[2,4]T(1,0)": arange reshaped to dims, transposed by perm."""
  shape = [int(d) for d in dims.split(",")]
  ids = np.arange(math.prod(shape)).reshape(shape)
  return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str) -> list[frozenset[int]] | None:
  """The device groups of one collective in compiled HLO text, in any of XLA's spellings: {{0,4},{1,5}},
  [4,2]<=[2,4]T(1,0), and mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'} (device_ids
  left out: in order). None when the line names no groups (a collective-permute, or all devices)."""
  found = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
  if found:
    return [frozenset(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([\d,]*)\}", found.group(1))]
  found = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if found:
    ids = _iota(found.group(3), found.group(4)).reshape(int(found.group(1)), int(found.group(2)))
    return [frozenset(row.tolist()) for row in ids]
  found = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                    r"\{([^}]*)\}", line)
  if not found:
    return None
  axes = re.findall(r"'(\w+)'=(\d+)", found.group(1))
  sizes = [int(n) for _, n in axes]
  ids = (_iota(found.group(2), found.group(3)) if found.group(2) else np.arange(math.prod(sizes))).reshape(sizes)
  grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in found.group(4)]
  others = [i for i in range(len(axes)) if i not in grouped]
  ids = ids.transpose(others + grouped).reshape(-1, math.prod(sizes[i] for i in grouped))
  return [frozenset(row.tolist()) for row in ids]


def _result_bytes(text: str) -> int:
  return sum(size for size, _ in shape_bytes(text))


def shape_bytes(text: str) -> list[tuple[int, str]]:
  """(bytes, "dtype[dims]") of every array shape written in `text`."""
  found = []
  for dtype, dims in _SHAPE.findall(text):
    size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    found.append((size * _DTYPE_BYTES.get(dtype, 4), f"{dtype}[{dims}]"))
  return found


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """{op: bytes} summed over the collective ops of a compiled HLO module, each op once (a loop body
  once), by result shape. An asynchronous pair counts at its `-done`, whose result is the output (a
  `-start` result also holds the operand and context scalars)."""
  totals = {op: 0 for op in COLLECTIVES}
  pattern = re.compile(r"=\s*(.*?)\s(" + "|".join(map(re.escape, COLLECTIVES)) + r")(-start|-done)?\(")
  for line in hlo_text.splitlines():
    match = pattern.search(line)
    if match and match.group(3) != "-start":
      totals[match.group(2)] += sum(size for size, _ in shape_bytes(match.group(1)))
  return {op: total for op, total in totals.items() if total}


def largest_buffers(hlo_text: str, count: int = 5) -> list[str]:
  """The `count` largest array results of the compiled HLO's instructions ("name dtype[dims] GiB")."""
  results = []
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)", line)
    if match:
      shapes = shape_bytes(match.group(2))
      if shapes:
        size, shape = max(shapes)
        results.append((size, f"{match.group(1)} {shape} {size / 2 ** 30:.2f} GiB"))
  results.sort(key=lambda r: -r[0])
  return [text for _, text in results[:count]]


def loop_counts(hlo_text: str) -> dict[str, int]:
  """{computation: how many times it runs per call of the program}: ENTRY once, a while body (and
  condition) as often as the loop's trip count times its caller, other called computations as often
  as their caller."""
  computations: dict[str, list[str]] = {}
  current, entry = None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header is not None:
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is not None and line.strip() == "}":
      current = None
    elif current is not None:
      computations[current].append(line)

  def trips(rest: str) -> int:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
    if known:
      return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", rest)
    lines = computations.get(condition.group(1), []) if condition else []
    constants = {m.group(1): int(m.group(2)) for m in
                 (re.search(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", l) for l in lines) if m}
    for line in lines:
      compare = re.search(r"ROOT .*compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT", line)
      if compare and compare.group(1) in constants:
        return constants[compare.group(1)]
    return 1

  counts: dict[str, int] = {}

  def visit(name: str, times: int, depth: int = 0) -> None:
    if depth > 64 or name not in computations:
      return
    counts[name] = counts.get(name, 0) + times
    for line in computations[name]:
      if " while(" in line:
        body = re.search(r"body=%?([\w.\-]+)", line)
        condition = re.search(r"condition=%?([\w.\-]+)", line)
        n = trips(line)
        for callee in (body, condition):
          if callee:
            visit(callee.group(1), times * n, depth + 1)
        continue
      for callee in re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)", line):
        visit(callee, times, depth + 1)
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        for callee in branches.group(1).split(","):
          visit(callee.strip().lstrip("%"), times, depth + 1)

  if entry is not None:
    visit(entry, 1)
  return counts


@dataclasses.dataclass
class Traffic:
  """Bytes one chip sends per call of a program, by collective and link (see the module docstring)."""
  by_op: dict  # {collective: bytes}, ICI and DCN together
  ici: float
  dcn: float
  grad: float  # gradient collectives (backward reductions and the GRAD_SCOPE collectives)
  explicit: float = 0.0  # of `grad`, the GRAD_SCOPE collectives (sharding/compress.py's reductions)


def traffic(hlo_text: str, slice_of: Callable[[int], int] | None = None) -> Traffic:
  """The per-chip collective traffic of a compiled HLO module. slice_of(device id) -> slice index
  tells DCN groups from ICI ones (None: every group on ICI)."""
  counts = loop_counts(hlo_text)
  has_backward = "transpose(" in hlo_text  # a forward-only program (prefill, decode) reduces no gradient
  by_op = {op: 0.0 for op in COLLECTIVES}
  ici = dcn = grad = explicit = 0.0
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header is not None:
      current = header.group(1)
      continue
    megascale = _MEGASCALE.search(line)
    if megascale is not None:  # the DCN part of a collective, sent by the megascale runtime
      op = megascale.group(2).lower().replace("_", "-")
      sent = float(_result_bytes(megascale.group(1))) * counts.get(current, 1)
      by_op[op] = by_op.get(op, 0.0) + sent
      dcn += sent
      grad += sent if op in ("all-reduce", "reduce-scatter") else 0.0
      continue
    match = _OP.search(line)
    if match is None or match.group(3) == "-start":
      continue
    op, result = match.group(2), _result_bytes(match.group(1))
    groups = replica_groups(line)
    size = max((len(g) for g in groups), default=1) if groups else 1
    if op == "collective-permute":
      sent = float(result)
    elif size <= 1:
      continue
    elif op == "reduce-scatter":
      sent = result * (size - 1.0)
    elif op == "all-reduce":
      sent = 2.0 * result * (size - 1) / size
    else:
      sent = result * (size - 1) / size
    sent *= counts.get(current, 1)
    by_op[op] += sent
    crosses = slice_of is not None and groups and any(len({slice_of(d) for d in g}) > 1 for g in groups)
    if slice_of is not None and op == "collective-permute":
      pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[-1].split("}}")[0] + "}")
      crosses = any(slice_of(int(a)) != slice_of(int(b)) for a, b in pairs)
    if crosses:
      dcn += sent
    else:
      ici += sent
    name = re.search(r'op_name="([^"]*)"', line)
    backward = has_backward and (name is None or "transpose(" in name.group(1))
    scoped = GRAD_SCOPE in (name.group(1) if name else "")
    if scoped or (op in ("all-reduce", "reduce-scatter") and backward):
      grad += sent
    explicit += sent if scoped else 0.0
  return Traffic(by_op={op: b for op, b in by_op.items() if b}, ici=ici, dcn=dcn, grad=grad, explicit=explicit)
