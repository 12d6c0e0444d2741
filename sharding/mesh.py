"""The one mesh of a run: `make_mesh(cfg.mesh)`. No other module builds a mesh.

Axes, outermost (slowest interconnect) first:
  data      pure data parallelism (replicated params); multi-slice runs put the DCN here.
  fsdp      data parallelism with parameters sharded over it (ZeRO-3 style).
  expert    expert parallelism: MoE experts split over it, tokens exchanged all-to-all.
  sequence  context parallelism: ring attention splits the sequence over it.
  tensor    tensor (Megatron) parallelism: heads and MLP columns split over it.
Rollouts and updates both run on this mesh; only the logical-axis rules differ (rules.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# The mesh axes, by name; only sharding/ spells them: every other module uses these constants.
DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS = "data", "fsdp", "expert", "sequence", "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, SEQUENCE_AXIS, TENSOR_AXIS)


def axis_size(mesh, axis: str) -> int:
  """Devices on `axis` of `mesh`; 1 without a mesh or without that axis."""
  return 1 if mesh is None else int(mesh.shape.get(axis, 1))


def mesh_shape_for(mesh_cfg, num_devices: int) -> tuple[int, ...]:
  """Resolves the per-slice axis sizes of `mesh_cfg` for `num_devices` devices in all.

  At most one axis may be -1; it takes whatever the others leave. Raises ValueError naming the sizes and
  the device count when they do not multiply out.
  """
  num_slices = int(mesh_cfg.get("num_slices", 1))
  sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
  described = ", ".join(f"{axis}={size}" for axis, size in sizes.items())
  if num_slices < 1:
    raise ValueError(f"mesh.num_slices={num_slices} must be at least 1.")
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


def platform(mesh: Mesh | None) -> str:
  """The platform a program for `mesh` compiles for ("cpu", "tpu", "gpu"): its devices', or JAX's
  default backend without a mesh. A mesh of compile-only TPU devices (rl/step/aot.py) says "tpu" on a CPU
  host, so kernels are picked for where the program will run, not where it is traced."""
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the run's mesh with axes MESH_AXES from `cfg.mesh`.

  Args:
    mesh_cfg: the `mesh` section of a config (data, fsdp, expert, sequence, tensor, num_slices).
    devices: the devices to use; all of `jax.devices()` by default. Compile-only TPU topology devices
      work too (scripts/aot_compile.py).

  Returns:
    A Mesh whose axes are all `AxisType.Auto`, so shardings propagate through jit and shard_map regions
    take whatever layout they are given. With `num_slices > 1` the `data` axis spans the slices (DCN)
    and the other axes stay inside a slice (ICI).
  """
  devices = list(jax.devices() if devices is None else devices)
  ici_shape = mesh_shape_for(mesh_cfg, len(devices))
  num_slices = int(mesh_cfg.get("num_slices", 1))
  if num_slices > 1:
    dcn_shape = (num_slices,) + (1,) * (len(MESH_AXES) - 1)
    device_array = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices=devices)
  else:
    try:
      device_array = mesh_utils.create_device_mesh(ici_shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
      # Unknown physical topology (e.g. simulated CPU devices): plain order is as good as any.
      device_array = np.asarray(devices).reshape(ici_shape)
  return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
