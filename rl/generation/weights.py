"""The weights generation reads, made from the train state's parameters once per generation call.

  full / train     the train state's own arrays, read in place (no copy): the default.
  int8             int8 matmul weights with per-channel scales (model/quant.py), quantised on the
                   devices by a jitted program; the scanned blocks dequantise one layer at a time.
  gathered layout  the weights resharded to split over tensor / expert only
                   (sharding/rules.generation_shardings), so a decode step reads them locally instead
                   of all-gathering them over fsdp at every token: one reshard per call.
Both at once quantise first (less to move) and land the int8 weights in the generation layout. Every
scheduler and proposer takes what `prepare` returns, so every one of them has both options.

A caller that must keep the weights beyond the train state's next update (an episodic rollout running
beside the update: asynchronous multi-turn RL, whose update donates the parameters) asks for `own`: a
copy when neither option made one already.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshrl.model import quant
from meshrl.sharding.rules import Rules, generation_shardings

LAYOUTS = ("train", "gathered")


@dataclasses.dataclass(frozen=True)
class WeightsSpec:
  """weights: "full" or "int8" (quant.GENERATION_WEIGHTS); layout: "train" or "gathered"."""
  weights: str = "full"
  layout: str = "train"

  def __post_init__(self):
    if self.weights not in quant.GENERATION_WEIGHTS:
      raise ValueError(f"rl.generation_weights={self.weights!r}; choose one of "
                       f"{', '.join(quant.GENERATION_WEIGHTS)}.")
    if self.layout not in LAYOUTS:
      raise ValueError(f"rl.generation_layout={self.layout!r}; choose one of {', '.join(LAYOUTS)}.")


def make_prepare(spec: WeightsSpec, abstract_params: Any, mesh: Mesh | None, rules: Rules, *,
                 own: bool = False) -> Callable[[Any], Any]:
  """`prepare(params) -> generation params` for `spec` (abstract_params: the model's param State, for
  the quantiser's shardings). own: the result never aliases the input (a copy for "full"/"train")."""
  quantize = quant.make_weight_quantizer(abstract_params, mesh, rules) if spec.weights == "int8" else None
  gathered = spec.layout == "gathered" and mesh is not None
  relayout = {}

  def to_layout(params):
    if "fn" not in relayout:  # a jitted identity with new out_shardings, built on first use
      shardings = generation_shardings(jax.tree.map(lambda x: x.sharding, params))
      relayout["fn"] = jax.jit(lambda p: p, out_shardings=shardings)
    return relayout["fn"](params)
  copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))

  def prepare(params):
    out = params if quantize is None else quantize(params)
    out = to_layout(out) if gathered else out
    return copy(out) if own and out is params else out
  return prepare
