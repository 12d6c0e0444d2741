"""The layout planner: which mesh shape should a config run on a topology? (scripts/plan_layout.py)

1. `candidates`: every assignment of sizes to the mesh axes (data, stage, fsdp, expert, sequence,
   tensor) that multiplies to the chips of a slice (`stage` counts the whole mesh's stages, across the
   slices first: sharding/mesh.py) and splits what each axis splits: the batch axes (data x fsdp x
   expert) every training batch's rows, `expert` the experts, `sequence` (twice with zigzag) every
   sequence length, `tensor` the heads and hidden widths, `stage` every stack of blocks and its
   microbatches every batch shard. Each is checked by building the config (`mesh_shape_for`, the model's
   own checks) as a run would; a shape that fails is never proposed.
2. `estimate`: a quick analytic figure per candidate, no compile: per-chip bytes of the parameters,
   optimizer state and layer inputs kept for the backward (is it likely to fit?), and a step time of
   compute / (1 - bubble) plus the bytes each axis makes a chip send (FSDP's weight gathers and
   gradient reduce-scatters, tensor parallelism's activation all-reduces, the ring's key/value blocks,
   the experts' token exchange) over ICI or DCN. It only picks which candidates to compile.
3. `rank`: the most promising candidates (and the config's own mesh, the hand-chosen layout) compiled
   for each step (rl/step/aot.py `compile_step`); a candidate fits when every step fits in HBM_FRACTION of a
   chip; its projected RL step time comes from the compiled figures: for each program, model FLOPs /
   (chips x peak x MFU) / (1 - bubble) plus the bytes the compiled program sends per chip over ICI and
   DCN (sharding/traffic.py: loops counted as they run) over those links' bandwidths, summed as
   update + prefill + rl.max_new_tokens x decode. Candidates that fit, fastest first.

Bandwidths are public per-chip figures (LINKS); DCN per chip assumes a host's 4 chips share its NICs.
Communication is not assumed to overlap compute, so projected times are upper bounds that favour layouts
moving fewer bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from typing import Callable, Sequence

from meshrl.configs import loader
from meshrl.model import pipeline
from meshrl.model.init import parameter_counts
from meshrl.rl.step.run_spec import model_numbers
from meshrl.sharding.mesh import (DATA_AXIS, EXPERT_AXIS, FSDP_AXIS, MESH_AXES, SEQUENCE_AXIS, STAGE_AXIS, TENSOR_AXIS,
                                  global_mesh_sizes, mesh_shape_for)
from meshrl.sharding.rules import rules_from_config
from meshrl.train.metrics import model_flops_per_token

# (device kind, HBM bytes/s, ICI bytes/s, DCN bytes/s) per chip: Google Cloud's TPU pages (v4: 1.2 TB/s
# HBM, 2,400 Gbps ICI; v5e: 819 GB/s, 1,600 Gbps; v5p: 2,765 GB/s, 4,800 Gbps; v6e: 1,640 GB/s, 3,584
# Gbps); DCN: 200 Gbps per host of 4 chips (an assumption; the figure a multislice job gets varies).
LINKS = (("TPU v6 lite", 1640e9, 448e9, 6.25e9), ("TPU v5 lite", 819e9, 200e9, 6.25e9),
         ("TPU v5", 2765e9, 600e9, 6.25e9), ("TPU v4", 1200e9, 300e9, 6.25e9))
RL_STEPS = ("update", "prefill", "decode")
ASSUMED_MFU = 0.4  # as rl/step/aot.py's projection


def links(device_kind: str) -> tuple[float, float, float]:
  """(HBM, ICI, DCN) bytes/s per chip of a TPU kind; ValueError for an unknown kind."""
  for kind, hbm, ici, dcn in LINKS:
    if kind in device_kind:
      return hbm, ici, dcn
  raise ValueError(f"no link bandwidths known for {device_kind!r}; known: {[k for k, *_ in LINKS]}.")


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def with_mesh(cfg, sizes: dict[str, int]):
  """A copy of `cfg` with mesh.{axis} = sizes[axis] (num_slices kept)."""
  trial = copy.deepcopy(cfg)
  with trial.unlocked():
    loader.apply_overrides(trial, [f"mesh.{axis}={size}" for axis, size in sizes.items()])
  return trial


def _splits_evenly(cfg, mc: ModelConfig, whole: dict[str, int]) -> bool:
  """Arithmetic only: whether the whole-mesh sizes `whole` split what each axis splits (module doc)."""
  rl = cfg.rl
  batch_shards = whole[DATA_AXIS] * whole[FSDP_AXIS] * whole[EXPERT_AXIS]
  rows = [rl.prompts_per_step * rl.group_size, rl.prompts_per_step * rl.group_size // rl.num_minibatches]
  if rl.sft_steps:
    rows.append(rl.sft_batch_size)
  if any(r % batch_shards for r in rows):
    return False
  if (mc.num_experts % whole[EXPERT_AXIS]) if mc.num_experts else whole[EXPERT_AXIS] > 1:
    return False
  sequence = whole[SEQUENCE_AXIS] * (2 if cfg.attention.zigzag and cfg.attention.impl == "ring" else 1)
  lengths = [rl.max_prompt_len + rl.max_new_tokens] + ([cfg.data.seq_len] if rl.sft_steps else [])
  if whole[SEQUENCE_AXIS] > 1 and (cfg.attention.impl != "ring" or any(n % sequence for n in lengths)):
    return False
  widths = [mc.num_heads, mc.num_kv_heads, mc.mlp_dim] + ([mc.expert_mlp_dim] if mc.num_experts else [])
  if any(w % whole[TENSOR_AXIS] for w in widths):
    return False
  stage = whole[STAGE_AXIS]
  if mc.num_dense_layers % stage or mc.num_moe_layers % stage:
    return False
  try:
    for count in rows:
      pipeline.resolve_microbatches(int(cfg.mesh.microbatches), rows=count, row_shards=batch_shards, stages=stage)
  except ValueError:
    return False
  return True


def _builds(cfg, sizes: dict[str, int], num_chips: int) -> bool:
  """Whether the config with these mesh sizes builds as a run builds it (mesh and model checks)."""
  trial = with_mesh(cfg, sizes)
  try:
    mesh_shape_for(trial.mesh, num_chips)
    model_numbers(trial).model
  except ValueError:
    return False
  return True


def candidates(cfg, num_chips: int) -> list[dict[str, int]]:
  """Every mesh (per-slice sizes of data, fsdp, expert, sequence, tensor, and mesh.stage) for
  `num_chips` chips in cfg.mesh.num_slices slices that the config builds on: the arithmetic of
  `_splits_evenly`, then the run's own checks (`_builds`)."""
  num_slices = int(cfg.mesh.num_slices)
  if num_chips % num_slices:
    raise ValueError(f"{num_chips} chips do not split into mesh.num_slices={num_slices} slices.")
  per_slice = num_chips // num_slices
  mc = model_numbers(with_mesh(cfg, {STAGE_AXIS: 1})).model
  found = []
  for stage in _divisors(mc.num_layers):
    if stage % num_slices and num_slices % stage:
      continue
    inside = stage // num_slices if stage > num_slices else 1  # stages within a slice
    data_slices = num_slices // stage if stage < num_slices else 1  # slice groups that are data parallel
    if per_slice % inside:
      continue
    rest = per_slice // inside
    for fsdp, expert, sequence, tensor in itertools.product(_divisors(rest), repeat=4):
      if rest % (fsdp * expert * sequence * tensor):
        continue
      data = rest // (fsdp * expert * sequence * tensor)
      sizes = {DATA_AXIS: data, STAGE_AXIS: stage, FSDP_AXIS: fsdp, EXPERT_AXIS: expert, SEQUENCE_AXIS: sequence,
               TENSOR_AXIS: tensor}
      whole = {**sizes, DATA_AXIS: data * data_slices}
      if _splits_evenly(cfg, mc, whole) and _builds(cfg, sizes, num_chips):
        found.append(sizes)
  return found


@dataclasses.dataclass
class Estimate:
  """The analytic figures of one candidate (see the module docstring); `step_s` ranks the compiles."""
  sizes: dict
  bytes_per_chip: float
  step_s: float
  bubble: float


def estimate(cfg, sizes: dict[str, int], *, num_chips: int, peak: float, hbm_bytes: float, ici: float,
             dcn: float) -> Estimate:
  """Rough per-chip memory and RL step time of `cfg` on mesh `sizes`, from shapes alone."""
  trial = with_mesh(cfg, sizes)
  mc = model_numbers(trial).model
  whole = global_mesh_sizes(trial.mesh, num_chips)
  counts = parameter_counts(mc)
  rules = dict(rules_from_config(trial.mesh))
  embed_split = math.prod(whole[a] for a in rules["embed"] if a in whole)
  expert_params = counts["total"] - counts["active_per_token"]
  expert_params = expert_params * mc.num_experts // max(mc.num_experts - mc.num_experts_per_tok, 1)
  dense_params = counts["total"] - expert_params
  per_chip_params = (dense_params / (embed_split * whole[TENSOR_AXIS] * whole[STAGE_AXIS])
                     + expert_params / (whole[EXPERT_AXIS] * embed_split * whole[TENSOR_AXIS] * whole[STAGE_AXIS]))
  rl = cfg.rl
  rows = rl.prompts_per_step * rl.group_size
  length = rl.max_prompt_len + rl.max_new_tokens
  batch_shards = whole[DATA_AXIS] * whole[FSDP_AXIS] * whole[EXPERT_AXIS]
  tokens_per_chip = rows * length / (batch_shards * whole[SEQUENCE_AXIS])
  act = 2.0 * mc.embed_dim * tokens_per_chip * (mc.num_layers / whole[STAGE_AXIS] + 8)  # bf16 layer inputs + a layer's work
  bytes_per_chip = 16.0 * per_chip_params + act
  microbatches = pipeline.resolve_microbatches(int(cfg.mesh.microbatches), rows=rows // rl.num_minibatches,
                                               row_shards=batch_shards, stages=whole[STAGE_AXIS])
  bubble = pipeline.bubble_fraction(whole[STAGE_AXIS], microbatches)
  flops = rows * length * rl.epochs * model_flops_per_token(mc, seq_len=length, training=True)
  compute_s = flops / (num_chips * peak * ASSUMED_MFU) / (1.0 - bubble)
  # Bytes a chip sends per update (forward, backward, weights gathered twice, gradients reduced once).
  gather_group = embed_split
  weights_bf16 = 2.0 * per_chip_params * gather_group
  fsdp_bytes = 3.0 * weights_bf16 * (gather_group - 1) / gather_group if gather_group > 1 else 0.0
  act_bytes = 2.0 * tokens_per_chip * mc.embed_dim
  tensor_bytes = 3 * 4 * act_bytes * mc.num_layers / whole[STAGE_AXIS] * (whole[TENSOR_AXIS] - 1) / whole[TENSOR_AXIS]
  ring_bytes = 3 * act_bytes * (mc.num_kv_heads * mc.head_dim / mc.embed_dim) * 2 * mc.num_layers / whole[STAGE_AXIS] \
      * (whole[SEQUENCE_AXIS] - 1)
  expert_bytes = (3 * 2 * act_bytes * mc.num_experts_per_tok * mc.num_moe_layers / whole[STAGE_AXIS]
                  * (whole[EXPERT_AXIS] - 1) / whole[EXPERT_AXIS]) if mc.num_experts else 0.0
  stage_bytes = 3 * act_bytes * (microbatches + whole[STAGE_AXIS] - 1) if whole[STAGE_AXIS] > 1 else 0.0
  across = dcn if int(cfg.mesh.num_slices) > 1 else ici
  comm_s = (fsdp_bytes + tensor_bytes + ring_bytes + expert_bytes) / ici + stage_bytes / across
  if int(cfg.mesh.num_slices) > 1 and whole[STAGE_AXIS] < int(cfg.mesh.num_slices):  # data parallel over DCN
    comm_s += 2.0 * 2.0 * per_chip_params / dcn
  decode_s = rl.max_new_tokens * 2.0 * per_chip_params * whole[STAGE_AXIS] / hbm_bytes  # weights read per token
  return Estimate(sizes=sizes, bytes_per_chip=bytes_per_chip, step_s=compute_s + comm_s + decode_s,
                  bubble=bubble)


@dataclasses.dataclass
class Planned:
  """One compiled candidate: its mesh, whether every step fits, and the projected RL step time."""
  sizes: dict
  fits: bool
  step_s: float | None
  steps: dict  # {step: {"total_gib", "fits", "projected_s", "compute_s", "ici_s", "dcn_s", "bubble"}}
  estimate_s: float
  baseline: bool = False  # the config's own mesh (the hand-chosen layout)
  error: str = ""  # a compile that failed (not for lack of memory): the step and the compiler's message


def projected_step_s(report, *, ici: float, dcn: float) -> tuple[float, dict]:
  """One compiled step's projected seconds: compute (the report's projection, bubble included) plus its
  compiled per-chip ICI and DCN bytes over the links' bandwidths."""
  compute = report.projected_step_s or 0.0
  ici_s = (report.ici_bytes or 0.0) / ici
  dcn_s = (report.dcn_bytes or 0.0) / dcn
  total_gib = report.per_chip["total"] / 2 ** 30 if report.per_chip else None
  return compute + ici_s + dcn_s, dict(total_gib=total_gib, fits=report.fits, projected_s=compute + ici_s + dcn_s,
                                       compute_s=compute, ici_s=ici_s, dcn_s=dcn_s, bubble=report.bubble_fraction)


def choose(estimates: Sequence[Estimate], *, top: int, limit_bytes: float,
           baseline: dict | None = None) -> list[tuple[Estimate, bool]]:
  """The candidates worth compiling: the `top` fastest by estimate among those estimated to fit in
  `limit_bytes` per chip, and the config's own mesh `baseline` whatever its estimate -> [(estimate,
  is_baseline)]."""
  likely = sorted((e for e in estimates if e.bytes_per_chip <= limit_bytes), key=lambda e: e.step_s)[:top]
  chosen = [(e, e.sizes == baseline) for e in likely]
  if baseline is not None and not any(is_base for _, is_base in chosen):
    chosen += [(e, True) for e in estimates if e.sizes == baseline]
  return chosen


def rank(cfg, chosen: Sequence[tuple[Estimate, bool]], compile_fn: Callable, *, steps: Sequence[str] = RL_STEPS,
         ici: float, dcn: float) -> list[Planned]:
  """Compiles the steps of each chosen candidate (up to the first that does not fit) and ranks them by
  projected RL step time from the compiled reports: those that fit fastest first, then those that do
  not (no time). A compile that fails otherwise (the compiler refusing a program) rules its candidate
  out with the error kept, and the others are still ranked.

  compile_fn(cfg_with_mesh, step) -> rl/step/aot.py StepReport."""
  planned = []
  for est, is_baseline in chosen:
    trial = with_mesh(cfg, est.sizes)
    figures, total, fits, error = {}, 0.0, True, ""
    for step in steps:  # the first step that does not fit settles it: the rest are not compiled
      try:
        report = compile_fn(trial, step)
      except Exception as failure:  # pylint: disable=broad-except  (one candidate's compiler error)
        error = f"{step}: {type(failure).__name__}: {str(failure).strip().splitlines()[0][:300]}"
        fits = False
        break
      seconds, figures[step] = projected_step_s(report, ici=ici, dcn=dcn)
      fits = bool(figures[step]["fits"])
      total += seconds * (cfg.rl.max_new_tokens if step == "decode" else 1)
      if not fits:
        break
    planned.append(Planned(sizes=est.sizes, fits=fits, step_s=total if fits else None, steps=figures,
                           estimate_s=est.step_s, baseline=is_baseline, error=error))
  return sorted(planned, key=lambda p: (not p.fits, p.step_s or 0.0))


def baseline_sizes(cfg) -> dict[str, int]:
  """The config's own mesh as per-slice sizes (stage: the whole mesh's), -1 resolved by the caller."""
  return {axis: int(cfg.mesh.get(axis, 1)) for axis in MESH_AXES}


def markdown(planned: Sequence[Planned]) -> str:
  """The planner's table: one row per compiled candidate, best first."""
  lines = ["| rank | data | stage | fsdp | expert | sequence | tensor | fits | update GiB | projected RL step s | "
           "update s | prefill s | decode s (x new tokens) | estimate s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for i, p in enumerate(planned, 1):
    s = p.sizes
    step = lambda name, key="projected_s": p.steps.get(name, {}).get(key)  # noqa: E731
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    mark = " (hand-chosen)" if p.baseline else ""
    lines.append(f"| {i}{mark} | {s[DATA_AXIS]} | {s[STAGE_AXIS]} | {s[FSDP_AXIS]} | {s[EXPERT_AXIS]} | {s[SEQUENCE_AXIS]} | "
                 f"{s[TENSOR_AXIS]} | {'yes' if p.fits else 'compile error' if p.error else 'NO'} | {fmt(step('update', 'total_gib'))} | "
                 f"{fmt(p.step_s)} | {fmt(step('update'))} | {fmt(step('prefill'))} | {fmt(step('decode'))} | "
                 f"{fmt(p.estimate_s)} |")
  lines += [f"\nCandidate {i} failed to compile: {p.error}" for i, p in enumerate(planned, 1) if p.error]
  return "\n".join(lines)
