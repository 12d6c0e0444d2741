"""make_mesh: every factorisation of 8 devices, -1 filling, and the errors."""

import itertools

import ml_collections
import pytest

from meshrl.sharding import MESH_AXES, make_mesh, mesh_shape_for


def _mesh_cfg(**sizes):
  base = dict(data=1, fsdp=1, expert=1, sequence=1, tensor=1, num_slices=1)
  base.update(sizes)
  return ml_collections.ConfigDict(base)


def _factorisations(n, k):
  for combo in itertools.product([1, 2, 4, 8], repeat=k):
    if combo[0] * combo[1] * combo[2] * combo[3] * combo[4] == n:
      yield combo


@pytest.mark.parametrize("sizes", list(_factorisations(8, 5)))
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
  assert mesh_shape_for(_mesh_cfg(num_slices=2, fsdp=-1), 8) == (1, 4, 1, 1, 1)
  with pytest.raises(ValueError, match="num_slices=3"):
    mesh_shape_for(_mesh_cfg(num_slices=3, fsdp=-1), 8)
