"""The one mesh of a run: `make_mesh(cfg.mesh)`. No other module builds a mesh.

Axes, outermost (slowest interconnect) first:
  data      pure data parallelism (replicated params); multi-slice runs put the DCN here.
  stage     pipeline parallelism: the stacked blocks' `layers` axis split into stages, microbatches
            passed from stage to stage (model/pipeline.py). Across slices (DCN) when
            mesh.num_slices > 1, else inside a slice (ICI).
  fsdp      data parallelism with parameters sharded over it (ZeRO-3 style).
  expert    expert parallelism: MoE experts split over it, tokens exchanged all-to-all.
  sequence  context parallelism: ring attention splits the sequence over it.
  tensor    tensor (Megatron) parallelism: heads and MLP columns split over it.
Rollouts and updates both run on this mesh; only the logical-axis rules differ (rules.py).

Sizes: `cfg.mesh.{data, fsdp, expert, sequence, tensor}` are per slice; `cfg.mesh.stage` counts the
stages of the whole mesh. With num_slices > 1 the slices (DCN) take the stages first: N slices and S
stages give S stages across the slices and N / S data-parallel groups of them when S divides N, or N
stages across the slices of S / N stages each when N divides S.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# The mesh axes, by name; only sharding/ spells them: every other module uses these constants.
DATA_AXIS, STAGE_AXIS, FSDP_AXIS = "data", "stage", "fsdp"
EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS = "expert", "sequence", "tensor"
MESH_AXES = (DATA_AXIS, STAGE_AXIS, FSDP_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS)
PER_SLICE_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS)  # sized per slice in cfg.mesh


def axis_size(mesh, axis: str) -> int:
  """Devices on `axis` of `mesh`; 1 without a mesh or without that axis."""
  return 1 if mesh is None else int(mesh.shape.get(axis, 1))


def _axis_size(mesh_cfg, axis: str) -> int:
  return int(mesh_cfg.get(axis, 1))


def dcn_shape_for(mesh_cfg) -> tuple[int, ...]:
  """The slice (DCN) factor of every axis of MESH_AXES: `num_slices` split between `stage` (first)
  and `data`. Raises ValueError naming mesh.stage and mesh.num_slices when neither divides the other."""
  num_slices, stages = _axis_size(mesh_cfg, "num_slices"), _axis_size(mesh_cfg, STAGE_AXIS)
  if num_slices < 1:
    raise ValueError(f"mesh.num_slices={num_slices} must be at least 1.")
  if stages < 1:
    raise ValueError(f"mesh.stage={stages} must be at least 1 (the number of pipeline stages; 1 = none).")
  if num_slices % stages and stages % num_slices:
    raise ValueError(f"mesh.stage={stages} and mesh.num_slices={num_slices}: one must divide the other "
                     "(stages are laid across slices first, the rest of the slices are data parallel).")
  stage_dcn = min(stages, num_slices)
  dcn = {axis: 1 for axis in MESH_AXES}
  dcn.update({STAGE_AXIS: stage_dcn, DATA_AXIS: num_slices // stage_dcn})
  return tuple(dcn[axis] for axis in MESH_AXES)


def mesh_shape_for(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """Resolves the per-slice (ICI) axis sizes of `mesh_cfg`, over MESH_AXES, for `num_devices` devices
  in all.

  At most one axis may be -1; it takes whatever the others leave. Raises ValueError naming the sizes and
  the device count when they do not multiply out.
  """
  num_slices = _axis_size(mesh_cfg, "num_slices")
  dcn = dict(zip(MESH_AXES, dcn_shape_for(mesh_cfg)))
  sizes = {axis: int(mesh_cfg[axis]) for axis in PER_SLICE_AXES}
  sizes[STAGE_AXIS] = _axis_size(mesh_cfg, STAGE_AXIS) // dcn[STAGE_AXIS]
  described = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if axis != STAGE_AXIS)
  if sizes[STAGE_AXIS] > 1:
    described += f", stage={sizes[STAGE_AXIS]} of mesh.stage={_axis_size(mesh_cfg, 'stage')} inside a slice"
  if num_devices % num_slices:
    raise ValueError(f"{num_devices} devices do not split into mesh.num_slices={num_slices} slices.")
  per_slice = num_devices // num_slices
  fill = [axis for axis, size in sizes.items() if size == -1]
  bad = [f"{axis}={size}" for axis, size in sizes.items() if size == 0 or size < -1]
  if bad:
    raise ValueError(f"mesh sizes must be positive or -1, got {', '.join(bad)}.")
  if len(fill) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {len(fill)} ({described}) for "
                     f"{per_slice} devices per slice.")
  known = math.prod(size for size in sizes.values() if size != -1)
  if fill:
    if per_slice % known:
      raise ValueError(f"mesh ({described}) does not divide {per_slice} devices per slice: the fixed "
                       f"axes multiply to {known}.")
    sizes[fill[0]] = per_slice // known
  elif known != per_slice:
    raise ValueError(f"mesh sizes ({described}) multiply to {known}, but there are {per_slice} devices "
                     f"per slice ({num_devices} devices, {num_slices} slice(s)).")
  return tuple(sizes[axis] for axis in MESH_AXES)


def global_mesh_sizes(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{axis: size} of the whole mesh (every slice): the per-slice sizes times the slices' factor."""
  ici = mesh_shape_for(mesh_cfg, num_devices)
  return {axis: i * d for axis, i, d in zip(MESH_AXES, ici, dcn_shape_for(mesh_cfg))}


def platform(mesh: Mesh | None) -> str:
  """The platform a program for `mesh` compiles for ("cpu", "tpu", "gpu"): its devices', or JAX's
  default backend without a mesh. A mesh of compile-only TPU devices (rl/step/aot.py) says "tpu" on a CPU
  host, so kernels are picked for where the program will run, not where it is traced."""
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def in_context(mesh: Mesh | None):
  """The mesh a sharding constraint or shard_map traced now must name: `mesh`, or inside a shard_map
  that made some of its axes manual (the pipeline's stages, model/pipeline.py) the context's abstract
  mesh, on which those axes are manual (such code must not name them in its specs). None stays None."""
  if mesh is None:
    return None
  context = jax.sharding.get_abstract_mesh()
  if context.empty or not context.manual_axes:
    return mesh
  return context


def _hybrid_device_array(ici_shape, dcn_shape, devices) -> np.ndarray:
  """Devices laid out [dcn_0 * ici_0, dcn_1 * ici_1, ...], each axis's slice index outermost.

  TPU devices know their slice (`slice_index`) and go through mesh_utils, which lays each slice's
  axes along its physical torus (splitting a physical axis where a mesh axis needs it); where it finds
  no such layout, and for devices without a slice (the simulated CPU devices of the tests), each slice
  is its devices in order, slices by index (consecutive devices without one)."""
  if all(hasattr(d, "slice_index") for d in devices):
    try:
      return mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices=devices,
                                                  allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
      devices = sorted(devices, key=lambda d: (d.slice_index, d.id))
  num_slices = math.prod(dcn_shape)
  per_slice = len(devices) // num_slices
  slices = np.asarray(devices).reshape((num_slices, per_slice))
  grid = slices.reshape(tuple(dcn_shape) + tuple(ici_shape))  # [*dcn, *ici]
  n = len(ici_shape)
  grid = grid.transpose([j for k in range(n) for j in (k, n + k)])  # [dcn_0, ici_0, dcn_1, ici_1, ...]
  return grid.reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the run's mesh with axes MESH_AXES from `cfg.mesh`.

  Args:
    mesh_cfg: the `mesh` section of a config (data, stage, fsdp, expert, sequence, tensor, num_slices).
    devices: the devices to use; all of `jax.devices()` by default. Compile-only TPU topology devices
      work too (scripts/aot_compile.py).

  Returns:
    A Mesh whose axes are all `AxisType.Auto`, so shardings propagate through jit and shard_map regions
    take whatever layout they are given. With `num_slices > 1` the `stage` and `data` axes span the
    slices (DCN, `dcn_shape_for`) and the other axes stay inside a slice (ICI).
  """
  devices = list(jax.devices() if devices is None else devices)
  ici_shape = mesh_shape_for(mesh_cfg, len(devices))
  dcn_shape = dcn_shape_for(mesh_cfg)
  if math.prod(dcn_shape) > 1:
    device_array = _hybrid_device_array(ici_shape, dcn_shape, devices)
  else:
    try:
      device_array = mesh_utils.create_device_mesh(ici_shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
      # Unknown physical topology (e.g. simulated CPU devices): plain order is as good as any.
      device_array = np.asarray(devices).reshape(ici_shape)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
