"""make_mesh: every factorisation of 8 devices, -1 filling, stages across slices, and the errors."""

import itertools
import math

import ml_collections
import pytest

from meshrl.sharding import MESH_AXES, make_mesh, mesh_shape_for
from meshrl.sharding.mesh import dcn_shape_for, global_mesh_sizes


def _mesh_cfg(**sizes):
  base = dict(data=1, stage=1, fsdp=1, expert=1, sequence=1, tensor=1, num_slices=1)
  base.update(sizes)
  return ml_collections.ConfigDict(base)


def _factorisations(n, k):
  for combo in itertools.product([1, 2, 4, 8], repeat=k):
    if math.prod(combo) == n:
      yield combo


@pytest.mark.parametrize("sizes", list(_factorisations(8, 6)))
def test_every_factorisation_of_8_devices(devices, sizes):
  mesh = make_mesh(_mesh_cfg(**dict(zip(MESH_AXES, sizes))))
  assert mesh.axis_names == MESH_AXES
  assert tuple(mesh.shape[a] for a in MESH_AXES) == sizes
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_minus_one_fills_the_rest(devices):
  mesh = make_mesh(_mesh_cfg(fsdp=-1, tensor=2))
  assert mesh.shape["fsdp"] == 4


def test_sizes_that_do_not_multiply_name_sizes_and_devices(devices):
  with pytest.raises(ValueError, match=r"fsdp=3.*8 devices"):
    make_mesh(_mesh_cfg(fsdp=3))


def test_two_minus_ones_rejected(devices):
  with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
    make_mesh(_mesh_cfg(fsdp=-1, tensor=-1))


def test_minus_one_that_cannot_divide(devices):
  with pytest.raises(ValueError, match="does not divide 8 devices"):
    make_mesh(_mesh_cfg(fsdp=-1, tensor=3))


def test_multi_slice_shape():
  # Pure shape logic: 2 slices of 4 devices, the DCN dimension lands on `data`.
  assert mesh_shape_for(_mesh_cfg(num_slices=2, fsdp=-1), 8) == (1, 1, 4, 1, 1, 1)
  with pytest.raises(ValueError, match="num_slices=3"):
    mesh_shape_for(_mesh_cfg(num_slices=3, fsdp=-1), 8)


@pytest.mark.parametrize("stage,num_slices,dcn,ici_stage", [
    (2, 2, dict(stage=2, data=1), 1),  # one stage per slice
    (2, 4, dict(stage=2, data=2), 1),  # two groups of two slices, data parallel across the groups
    (4, 2, dict(stage=2, data=1), 2),  # two stages inside each slice
    (4, 1, dict(stage=1, data=1), 4)])
def test_stages_lie_across_slices_first(stage, num_slices, dcn, ici_stage):
  cfg = _mesh_cfg(stage=stage, num_slices=num_slices, fsdp=-1)
  got = dict(zip(MESH_AXES, dcn_shape_for(cfg)))
  assert {axis: got[axis] for axis in dcn} == dcn and got["fsdp"] == 1
  ici = dict(zip(MESH_AXES, mesh_shape_for(cfg, 16)))
  assert ici["stage"] == ici_stage and ici["fsdp"] == 16 // num_slices // ici_stage
  assert global_mesh_sizes(cfg, 16)["stage"] == stage


def test_two_simulated_slices_put_one_stage_on_each(devices):
  """CPU devices carry no slice index: slices are runs of consecutive devices, so stage 0 is devices
  0-3 (slice 0) and stage 1 devices 4-7; within a slice the other axes are laid as usual."""
  mesh = make_mesh(_mesh_cfg(stage=2, num_slices=2, fsdp=2, tensor=2))
  assert dict(mesh.shape) == dict(data=1, stage=2, fsdp=2, expert=1, sequence=1, tensor=2)
  by_stage = mesh.devices.reshape(2, 4)
  assert [sorted(d.id for d in row) for row in by_stage] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  four = make_mesh(_mesh_cfg(stage=2, num_slices=4, fsdp=2))  # data over slice pairs
  assert dict(four.shape)["data"] == 2 and dict(four.shape)["stage"] == 2
  assert sorted(d.id for d in four.devices[0, 0].flat) == [0, 1]  # slice 0
  assert sorted(d.id for d in four.devices[0, 1].flat) == [2, 3]  # slice 1: the next stage


def test_stage_and_slices_that_do_not_divide_are_refused():
  with pytest.raises(ValueError, match=r"mesh.stage=3 and mesh.num_slices=2: one must divide the other"):
    mesh_shape_for(_mesh_cfg(stage=3, num_slices=2, fsdp=-1), 8)
  with pytest.raises(ValueError, match=r"mesh.stage=0 must be at least 1"):
    mesh_shape_for(_mesh_cfg(stage=0, fsdp=-1), 8)
