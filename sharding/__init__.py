"""The one mesh and the logical-axis rules that lay arrays out on it."""

from meshrl.sharding.mesh import MESH_AXES, make_mesh, mesh_shape_for
from meshrl.sharding.rules import (
    ROLLOUT_RULES,
    TRAIN_RULES,
    batch_axes,
    data_parallel_size,
    constrain,
    logical_to_spec,
    named_shardings,
    rules_from_config,
)
