"""Logical axis rules: how named array dimensions map onto the one mesh.

Model code names every dimension of its parameters and main activations with a logical name
(`batch`, `length`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `experts`, `expert_mlp`, `vocab`,
`layers`); a rule set maps each name to zero or more mesh axes. Training and rollouts use different
rule sets over the same mesh (../shared/DESIGN.md).

A mesh axis is used at most once per array: names are resolved left to right and an axis already
taken by an earlier dimension is skipped. So with `batch -> (data, fsdp)` and `embed -> fsdp`, an
activation `[batch, length, embed]` is split on batch only, while a weight `[embed, mlp]` is split on
embed over `fsdp` (ZeRO-3) and on mlp over `tensor`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.sharding.mesh import MESH_AXES, STAGE_AXIS, in_context

Rules = tuple[tuple[str, tuple[str, ...]], ...]

LOGICAL_AXES = ("batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts",
                "expert_mlp", "vocab", "layers", "cache_length")

TRAIN_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", ("sequence",)),
    ("cache_length", ("sequence",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("experts", ("expert",)),
    ("expert_mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("layers", ("stage",)),  # pipeline stages hold contiguous blocks of layers (model/pipeline.py)
)

# Generation keeps the parameter layout of training (the same arrays, no copy) and differs in the
# activations: a decode step has length 1, so the sequence axis carries the KV cache, not the tokens;
# and it never runs through the pipeline, so its per-layer arrays (the KV cache [layers, ...]) are not
# split over `stage` (with stages, the weights are resharded stage-free: `stage_free_shardings`).
ROLLOUT_RULES: Rules = tuple(
    (name, () if name in ("length", "layers") else axes) for name, axes in TRAIN_RULES)


def batch_axes(rules: Rules = TRAIN_RULES) -> tuple[str, ...]:
  """The mesh axes a batch's rows are split over (the logical `batch` axis): data parallelism.

  The one place the rest of the code learns which axes those are."""
  return dict(rules)["batch"]


def data_parallel_size(mesh_sizes, rules: Rules = TRAIN_RULES) -> int:
  """How many ways a batch's rows are split: the product of the batch axes' sizes.

  Args:
    mesh_sizes: a Mesh, or a {axis: size} mapping (e.g. resolved from a config before the mesh is
      built, with `data` already multiplied by the number of slices).
  """
  shape = mesh_sizes.shape if isinstance(mesh_sizes, Mesh) else mesh_sizes
  return math.prod(int(shape[axis]) for axis in batch_axes(rules))


def parse_rules(text: str) -> dict[str, tuple[str, ...]]:
  """Parses `"embed=fsdp;mlp=tensor,expert;vocab=none"` into {name: mesh axes}."""
  parsed = {}
  for item in filter(None, (part.strip() for part in text.split(";"))):
    name, sep, axes = item.partition("=")
    name = name.strip()
    if not sep or name not in LOGICAL_AXES:
      raise ValueError(f"bad rule {item!r}: expected NAME=AXIS[,AXIS] with NAME one of {LOGICAL_AXES}.")
    axes = tuple(a.strip() for a in axes.split(",") if a.strip() and a.strip().lower() != "none")
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
      raise ValueError(f"rule {item!r} names mesh axes {unknown}; the mesh axes are {MESH_AXES}.")
    parsed[name] = axes
  return parsed


def rules_from_config(mesh_cfg, kind: str = "train") -> Rules:
  """TRAIN_RULES or ROLLOUT_RULES with `cfg.mesh.{kind}_rules` overrides applied."""
  base = {"train": TRAIN_RULES, "rollout": ROLLOUT_RULES}[kind]
  text = str(mesh_cfg.get(f"{kind}_rules", "") or "")
  try:
    overrides = parse_rules(text)
  except ValueError as error:
    raise ValueError(f"mesh.{kind}_rules={text!r}: {error}") from None
  return tuple((name, overrides.get(name, axes)) for name, axes in base)


def logical_to_spec(names: Sequence[str | None], rules: Rules = TRAIN_RULES,
                    mesh: Mesh | None = None, shape: Sequence[int] | None = None) -> PartitionSpec:
  """Turns one array's logical dimension names into a PartitionSpec.

  Mesh axes of size 1 (when `mesh` is given) and axes already taken by an earlier dimension are
  dropped. With `shape`, a mesh axis that does not divide its dimension (a vocabulary of 259 on
  2 devices) is dropped too, so that dimension stays whole. `None` names a dimension never split.
  """
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in names:
    if name is None:
      spec.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}.")
    axes = [a for a in table[name] if a not in used and (mesh is None or mesh.shape[a] > 1)]
    if shape is not None and mesh is not None:
      kept, parts = [], 1
      for a in axes:
        if shape[len(spec)] % (parts * mesh.shape[a]) == 0:
          kept.append(a)
          parts *= mesh.shape[a]
      axes = kept
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*spec)


def _is_names(leaf: Any) -> bool:
  return isinstance(leaf, tuple) and all(n is None or isinstance(n, str) for n in leaf)


def named_shardings(logical_tree: Any, mesh: Mesh, rules: Rules = TRAIN_RULES) -> Any:
  """Maps a pytree whose leaves are tuples of logical names to a pytree of NamedShardings."""
  return jax.tree.map(lambda names: NamedSharding(mesh, logical_to_spec(names, rules, mesh)),
                      logical_tree, is_leaf=_is_names)


def constrain(x: jax.Array, names: Sequence[str | None], mesh: Mesh | None,
              rules: Rules = TRAIN_RULES) -> jax.Array:
  """`with_sharding_constraint` by logical names; a no-op without a mesh (single-device code)."""
  if mesh is None:
    return x
  if len(names) != x.ndim:
    raise ValueError(f"constrain got {len(names)} names {tuple(names)} for an array of shape {x.shape}.")
  spec = logical_to_spec(names, rules, mesh, shape=x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(in_context(mesh), spec))



GENERATION_KEEP_AXES = ("tensor", "expert")


def regather_spec(spec: PartitionSpec, keep: Sequence[str] = GENERATION_KEEP_AXES) -> PartitionSpec:
  """`spec` with every mesh axis not in `keep` dropped: those dimensions become replicated over the
  dropped axes (e.g. a weight split over fsdp x tensor -> split over tensor only)."""
  def entry(e):
    if e is None:
      return None
    axes = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in keep)
    return None if not axes else axes[0] if len(axes) == 1 else axes
  return PartitionSpec(*(entry(e) for e in spec))


def generation_shardings(shardings: Any, keep: Sequence[str] = GENERATION_KEEP_AXES) -> Any:
  """The generation layout of a pytree of parameter NamedShardings: each weight kept split over
  `keep` (tensor, expert) and replicated over the other axes (data, fsdp, sequence), so a decode step
  reads its weights locally instead of all-gathering them over fsdp at every token. Costs one
  reshard per RL step (an all-gather of the weights) and the memory of the less split copy."""
  return jax.tree.map(lambda s: NamedSharding(s.mesh, regather_spec(s.spec, keep)), shardings,
                      is_leaf=lambda s: isinstance(s, NamedSharding))


def stage_free_spec(spec: PartitionSpec) -> PartitionSpec:
  """`spec` without the `stage` axis: the dimension it split becomes replicated over the stages."""
  return regather_spec(spec, keep=tuple(a for a in MESH_AXES if a != STAGE_AXIS))


def stage_free_shardings(shardings: Any) -> Any:
  """The stage-free generation layout of a pytree of parameter NamedShardings: every block's `layers`
  axis, split over `stage` for the pipelined update (model/pipeline.py), replicated over the stages
  instead; every other axis kept. Generation (prefill, decode) never runs through the pipeline: a
  decode step is one token deep, so a pipeline would leave all stages but one idle. Each stage group
  (a slice, when the stages lie across slices) holds every layer and runs the generation program; the
  ROLLOUT rules do not split the batch over `stage`, so the groups compute the same rows.
  Costs one all-gather of the blocks' weights over `stage` per RL step (the AOT report's `reshard`
  step) and S times the blocks' bytes per chip while generating. A pytree without `stage` in it comes
  back unchanged, so callers need not ask whether the mesh has stages."""
  return jax.tree.map(lambda s: NamedSharding(s.mesh, stage_free_spec(s.spec)), shardings,
                      is_leaf=lambda s: isinstance(s, NamedSharding))


def generation_param_shardings(layout: str, shardings: Any) -> Any:
  """The layout generation reads the parameters in (rl.generation_layout), from their train-layout
  NamedShardings: "gathered" -> split over tensor/expert only (`generation_shardings`, which has no
  `stage` either); "train" -> the train layout itself, without `stage` when the update is pipelined
  (`stage_free_shardings`; unchanged otherwise). A rollout reshards to it once per step:
  `jax.jit(lambda p: p, out_shardings=generation_param_shardings(layout, shardings_of(params)))`."""
  if layout == "gathered":
    return generation_shardings(shardings)
  return stage_free_shardings(shardings)
