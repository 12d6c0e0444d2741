"""The single-program MoE dispatchers (model/moe_dispatch.py) run on each device's own tokens.

Without expert parallelism (the mesh's 'expert' axis of size 1) an MoE call's tokens are split over
the batch axes. Run as one global program, a dispatcher's sort, scatter and gather span every
device's tokens, and GSPMD partitions them with collectives inside every layer: at the issue-9 peer
shape on fsdp=2 the update had, per MoE layer, an all-gather of the slot experts, all-to-alls of
tokens and, since the experts' D is split over 'fsdp', an all-reduce of each expert matmul's
partial sums ([47, 128, 512] floats); 48 collectives in the update's program, 40 with this module.

Here, in training calls (forward and backward), each device runs the dispatcher on its own
n = N / shards tokens (`token_axes`: every axis of size > 1 but 'tensor'), with the expert weights
gathered over the D-split axes once in the forward and once more in the backward, as FSDP gathers
every dense weight (their gradients are reduce-scattered back by the gather's transpose); F stays
split over 'tensor' and the outputs are summed over it. Kept for the backward instead, the gathered
experts of every layer of a scan stayed alive at once: at fsdp=8 with 8 layers the peer-shape
update's temporaries went from 228 to 110 MiB per device when the backward gathered again. Exact
dispatchers give the global result; "capacity" sizes its buffers from the device's own n tokens
(per-device capacity, as MaxText and GShard count it).

Generation calls (prefill, decode) keep the global program: in a decode loop XLA hoists the
loop-invariant weight gathers out of the loop, so every layer's gathered experts would stay alive
for the whole rollout, a second copy of the expert weights (tests/rl/test_step.py measures the
rollout's bytes per device: 82 MB against 52 MB of parameters that way, 24 MB as it is).

Axes as in model/moe_dispatch.py, plus n = N / shards tokens on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshrl.model import moe_dispatch
from meshrl.model.expert_parallel import (FSDP_AXIS, TENSOR_AXIS, d_split_axes, tensor_split_axis, token_axes,
                                          token_shards)
from meshrl.model.moe_dispatch import ExpertWeights
from meshrl.sharding import compress
from meshrl.sharding.mesh import in_context


def local_token_count(mesh: Mesh | None, num_tokens: int) -> int | None:
  """n, the tokens each device dispatches on its own, or None when the call runs as one program:
  no mesh, a mesh of one device per token shard and no 'tensor' split, or N not divisible by the
  token shards (the global program is exact for any N)."""
  if mesh is None:
    return None
  shards = token_shards(mesh)
  if num_tokens % shards or (shards == 1 and mesh.shape[TENSOR_AXIS] == 1):
    return None
  return num_tokens // shards


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """x marked as varying over those of `axes` it does not vary over yet (inside shard_map)."""
  missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def run_per_device(name: str, xs: jax.Array, expert_choices: jax.Array, combine_weights: jax.Array,
                   w: ExpertWeights, *, mesh: Mesh, capacity_factor: float,
                   d_axes: tuple[str, ...] = (FSDP_AXIS,), grad_reduce=None) -> tuple[jax.Array, jax.Array]:
  """moe_dispatch.run(name, ...) inside shard_map, each device on its own tokens.

  The weights enter split as the parameter rules lay them out (D over `d_split_axes`, F over
  'tensor') and are all-gathered over D inside. The call is checkpointed so that everything but the
  all-gathers' outputs is saved for the backward pass, which gathers the weights again, as FSDP does:
  saved, every layer's gathered experts would stay alive until its backward (a scan of L layers
  stacks them: L x E x 3 x D x F per device, the whole model's experts on every device).

  Args:
    xs: [N, D] tokens, N divisible by the token shards (`local_token_count` is not None).
    expert_choices, combine_weights: [N, K] as for moe_dispatch.run.
    w: expert weights [E, D, F] / [E, F, D]; inside, E and D whole and F split over 'tensor' where
      it divides.
    d_axes: the mesh axes the parameter rules put the experts' D ('embed') on.
    grad_reduce: sharding/compress.GradReduce or None: with it the weights are gathered by
      compress.gather_for_use, whose backward reduces their gradients in its wire dtype.

  Returns:
    ys [N, D] split like xs, and the dropped slot count summed over the devices.
  """
  axes = token_axes(mesh)
  tensor = tensor_split_axis(mesh, w.gate.shape[2])
  d_split = d_split_axes(mesh, w.gate.shape[1], d_axes) or None  # None: D enters whole
  inner = PartitionSpec(None, d_split, tensor)  # [E, D, F]: E whole ('expert' has size 1)
  specs = (inner, inner, PartitionSpec(None, tensor, d_split))

  def local(xs_, choices_, weights_, gate_, up_, down_):
    # The weights' cotangents are summed over the token axes here, not inside a dispatcher's switch
    # branches (where the first use with the tokens would put the sum), whose devices may each take
    # another branch and wait for the others forever.
    if grad_reduce is not None:
      gate_, up_ = (compress.gather_for_use(x, d_split, 1, axes, grad_reduce) for x in (gate_, up_))
      down_ = compress.gather_for_use(down_, d_split, 2, axes, grad_reduce)
    else:
      if d_split:
        gate_, up_ = (jax.lax.all_gather(x, d_split, axis=1, tiled=True) for x in (gate_, up_))
        down_ = jax.lax.all_gather(down_, d_split, axis=2, tiled=True)
      gate_, up_, down_ = (_varying(x, axes) for x in (gate_, up_, down_))
    ys_, dropped_ = moe_dispatch.run(name, xs_, choices_, weights_, ExpertWeights(gate_, up_, down_),
                                     capacity_factor=capacity_factor)
    if tensor:  # each device's hidden F-slice gave a partial sum of every output
      ys_ = jax.lax.psum(ys_, TENSOR_AXIS)
    return ys_, jax.lax.psum(dropped_.astype(jnp.int32), axes) if axes else dropped_

  def policy(prim, *_, **__) -> bool:  # save all but the gathered weights (the only all-gathers here)
    return prim.name != "all_gather" and not (grad_reduce is not None and prim.name.startswith("custom_vjp"))

  tokens = PartitionSpec(axes or None)
  run_ = jax.shard_map(jax.checkpoint(local, policy=policy), mesh=in_context(mesh),
                       in_specs=(tokens, tokens, tokens, *specs), out_specs=(tokens, PartitionSpec()))
  return run_(xs, expert_choices, combine_weights, w.gate, w.up, w.down)
