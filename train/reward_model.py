"""A reward model: the policy-shaped Transformer whose value head (model.value_head) reads one score
per sequence at its last token, trained on preference pairs by the Bradley-Terry loss.

  spec = RMLossSpec.from_config(cfg)
  step = make_rm_step(graphdef, mesh, cfg, tx, state_shardings=shardings_of(state))
  state, metrics = step(state, batch)                # batch: PairBatch; jitted, state donated
  score = make_scorer(graphdef, mesh, rules)         # (params, extra, tokens, lengths) -> [B]

Score of a row: the value head's output (a [D] -> 1 projection of the final normed hidden state,
model/transformer.py) at the row's last real token, `lengths - 1`; the tokens after it are padding,
which the causal mask keeps out of that position. This is where Hugging Face's
`*ForSequenceClassification` reads its `score` (the last token that is not the pad id), so a model
imported from that layout (model/convert.py) scores as transformers does.

Loss (Bradley & Terry 1952; the reward-model objective of Ouyang et al. 2022, eq. 1, with the
margin of Touvron et al. 2023, Llama 2, section 3.2.2), per pair:
  -log sigmoid(r_chosen - r_rejected - margin),  margin = rm.margin + the pair's own "margin"
averaged over the batch's pairs; MoE models add moe.aux_loss_coef * aux + moe.z_loss_coef * z
(means of the chosen and rejected forwards). Pairwise accuracy: the share of pairs with
r_chosen > r_rejected (a tie counts as wrong).

Axis legend: B pairs (rows of each side), T tokens per row. Rows lie on the batch axes of the mesh
(the TRAIN rules' `batch`), T whole; scores [B] lie as the rows do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.sharding.rules import Rules, logical_to_spec, rules_from_config
from meshrl.train.preferences import PairArrays
from meshrl.train.state import TrainState, update_router_bias
from meshrl.train.stops import guarded_update, keep_unless


@struct.dataclass
class PairBatch:
  """One step's pairs on the devices (`put_pairs`)."""
  chosen: jax.Array  # [B, T] int32 tokens, right-padded
  chosen_lengths: jax.Array  # [B] int32 real tokens of each chosen row (>= 1)
  rejected: jax.Array  # [B, T] int32
  rejected_lengths: jax.Array  # [B] int32
  margins: jax.Array  # [B] float32 the pairs' own margins (rm.margin is added in the loss)


@dataclasses.dataclass(frozen=True)
class RMLossSpec:
  """The numbers the loss needs, read once from the config."""
  margin: float = 0.0  # rm.margin, added to every pair's own
  aux_loss_coef: float = 0.0  # moe.aux_loss_coef
  z_loss_coef: float = 0.0  # moe.z_loss_coef
  aux_free_bias: bool = False  # moe.aux_free_bias: move the router bias by the step's expert load
  bias_update_rate: float = 0.0  # moe.bias_update_rate
  lm_coef: float = 0.0  # rm.lm_coef: next-token loss on the chosen rows beside Bradley-Terry

  @classmethod
  def from_config(cls, cfg) -> "RMLossSpec":
    return cls(margin=float(cfg.rm.margin), lm_coef=float(cfg.rm.get("lm_coef", 0.0)),
               aux_loss_coef=float(cfg.moe.aux_loss_coef),
               z_loss_coef=float(cfg.moe.z_loss_coef), aux_free_bias=bool(cfg.moe.aux_free_bias),
               bias_update_rate=float(cfg.moe.bias_update_rate))


def check_score_head(model_cfg, field: str = "model.value_head") -> None:
  """ValueError unless the model has the value head a reward model scores with."""
  if not model_cfg.value_head:
    raise ValueError(f"{field}=False: a reward model's score is the value head; set "
                     "--config.model.value_head=true.")


# --------------------------------------------------------------------------------------------------
# Pure pieces: scores, loss, accuracy.


def last_token_scores(values: jax.Array, lengths: jax.Array) -> jax.Array:
  """values [B, T] (one number per token), lengths [B] -> [B] float32 values at token lengths - 1."""
  index = jnp.clip(lengths.astype(jnp.int32) - 1, 0, values.shape[1] - 1)
  return jnp.take_along_axis(values, index[:, None], axis=1)[:, 0].astype(jnp.float32)


def score_rows(model: nnx.Module, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, dict]:
  """tokens [B, T], lengths [B] -> (scores [B] float32, the MoE aux dict). The vocabulary
  projection is skipped (return_hidden): only the value head runs on the final hidden states."""
  out = model(tokens, return_hidden=True)
  if out.values is None:
    raise ValueError("model.value_head=False: the model has no score head to read rewards from.")
  return last_token_scores(out.values, lengths), out.aux


def chosen_lm_loss(logits: jax.Array, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """logits [B, T, V], tokens [B, T], lengths [B] -> [] mean next-token cross-entropy over each
  row's real tokens (the target at t is token t + 1 < length): the language-modelling term that
  keeps a reward model's hidden states those of a model that writes the chosen responses
  (Yang et al. 2024, "Regularizing Hidden States Enables Learning Generalizable Reward Model")."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
  target = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
  mask = (jnp.arange(tokens.shape[1] - 1)[None, :] < (lengths[:, None] - 1)).astype(jnp.float32)
  return -jnp.sum(target * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array, margins: jax.Array) -> jax.Array:
  """Mean over pairs of -log sigmoid(chosen - rejected - margins); all [B] float32."""
  return -jnp.mean(jax.nn.log_sigmoid(chosen - rejected - margins))


def pairwise_accuracy(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
  """Share of pairs whose chosen response scores strictly higher; [B], [B] -> []."""
  return jnp.mean((chosen > rejected).astype(jnp.float32))


def rm_loss(params: nnx.State, extra: nnx.State, graphdef: nnx.GraphDef, batch: PairBatch, *,
            spec: RMLossSpec) -> tuple[jax.Array, dict]:
  """The reward-model objective on one batch of pairs -> (loss, metrics)."""
  model = nnx.merge(graphdef, params, extra)
  if spec.lm_coef:
    out = model(batch.chosen)
    chosen, chosen_aux = last_token_scores(out.values, batch.chosen_lengths), out.aux
    lm = chosen_lm_loss(out.logits, batch.chosen, batch.chosen_lengths)
  else:
    chosen, chosen_aux = score_rows(model, batch.chosen, batch.chosen_lengths)
  rejected, rejected_aux = score_rows(model, batch.rejected, batch.rejected_lengths)
  # Preference: Bradley-Terry with margins.
  bt = bradley_terry_loss(chosen, rejected, batch.margins + spec.margin)
  loss = bt
  metrics = {"bt_loss": bt, "accuracy": pairwise_accuracy(chosen, rejected),
             "chosen_score": jnp.mean(chosen), "rejected_score": jnp.mean(rejected),
             "score_gap": jnp.mean(chosen - rejected)}
  if spec.lm_coef:
    loss = loss + spec.lm_coef * lm
    metrics["lm_loss"] = lm
  # MoE balance: the two forwards' auxiliary and z-losses, averaged.
  if chosen_aux:
    aux = {k: (chosen_aux[k] + rejected_aux[k]) / 2 for k in ("aux_loss", "z_loss", "expert_load")}
    loss = loss + spec.aux_loss_coef * aux["aux_loss"] + spec.z_loss_coef * aux["z_loss"]
    metrics.update(moe_aux_loss=aux["aux_loss"], moe_z_loss=aux["z_loss"], expert_load=aux["expert_load"])
  metrics["loss"] = loss
  return loss, metrics


# --------------------------------------------------------------------------------------------------
# On the mesh: batches, the training step, the scorer.


def row_shardings(mesh: Mesh, rules: Rules) -> tuple[NamedSharding, NamedSharding]:
  """(tokens [B, T], per-row [B]) shardings: rows on the batch axes, T whole."""
  return (NamedSharding(mesh, logical_to_spec(("batch", None), rules, mesh)),
          NamedSharding(mesh, logical_to_spec(("batch",), rules, mesh)))


def pair_batch_shardings(mesh: Mesh, rules: Rules) -> PairBatch:
  tokens, rows = row_shardings(mesh, rules)
  return PairBatch(chosen=tokens, chosen_lengths=rows, rejected=tokens, rejected_lengths=rows, margins=rows)


def put_pairs(arrays: PairArrays, mesh: Mesh | None, rules: Rules | None = None) -> PairBatch:
  """Host pairs (this host's rows) -> a PairBatch of global arrays laid out by `pair_batch_shardings`."""
  batch = PairBatch(chosen=arrays.chosen, chosen_lengths=arrays.chosen_lengths, rejected=arrays.rejected,
                    rejected_lengths=arrays.rejected_lengths, margins=arrays.margins)
  if mesh is None:
    return jax.tree.map(jax.device_put, batch)
  return jax.tree.map(jax.make_array_from_process_local_data, pair_batch_shardings(mesh, rules), batch)


def make_rm_step(graphdef: nnx.GraphDef, mesh: Mesh | None, cfg, tx: optax.GradientTransformation, *,
                 state_shardings: Any = None, schedule: optax.Schedule | None = None):
  """Returns jitted `rm_step(state, batch: PairBatch) -> (state, metrics)`; `state` is donated.

  Metrics (scalars unless noted): loss, bt_loss, accuracy (this batch's), chosen_score,
  rejected_score, score_gap, grad_norm, lr, nonfinite (1.0 when the NaN guard skipped the step),
  and for MoE models moe_aux_loss, moe_z_loss, expert_load [L, E].
  """
  spec = RMLossSpec.from_config(cfg)
  grad_fn = jax.grad(functools.partial(rm_loss, graphdef=graphdef, spec=spec), has_aux=True)
  accum = int(cfg.optim.grad_accum_steps)

  def rm_step(state: TrainState, batch: PairBatch):
    grads, metrics = grad_fn(state.params, state.extra, batch=batch)
    # NaN guard (train/stops.py): a non-finite loss or gradient leaves the state as it was.
    params, opt_state, grad_norm, finite = guarded_update(tx, state, grads, metrics["loss"])
    metrics.update(grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32))
    if schedule is not None:
      metrics["lr"] = schedule(state.step // accum)
    extra = state.extra
    if spec.aux_free_bias and "expert_load" in metrics:
      extra = keep_unless(finite, update_router_bias(extra, metrics["expert_load"], spec.bias_update_rate),
                          extra)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, extra=extra), metrics

  if mesh is None or state_shardings is None:
    return jax.jit(rm_step, donate_argnums=(0,))
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(rm_step, in_shardings=(state_shardings, pair_batch_shardings(mesh, rules_from_config(cfg.mesh))),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))


def make_scorer(graphdef: nnx.GraphDef, mesh: Mesh | None = None, rules: Rules | None = None):
  """Returns jitted `score(params, extra, tokens [B, T], lengths [B]) -> [B] float32`, the rows'
  rewards; with a mesh the rows lie on its batch axes (B must divide over them) and the parameters
  stay where they are (frozen: nothing is donated)."""
  def score(params, extra, tokens, lengths):
    return score_rows(nnx.merge(graphdef, params, extra), tokens, lengths)[0]
  if mesh is None:
    return jax.jit(score)
  tokens_sharding, rows_sharding = row_shardings(mesh, rules)
  return jax.jit(score, in_shardings=(None, None, tokens_sharding, rows_sharding), out_shardings=rows_sharding)


def score_pairs(score, params, extra, arrays: PairArrays, *, batch_size: int, mesh: Mesh | None = None,
                rules: Rules | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(chosen [N], rejected [N]) scores of every pair, `batch_size` rows per call (the last batch
  padded by repeating its first row, so one program serves every call); host numpy out."""
  outs = {"chosen": [], "rejected": []}
  for start in range(0, len(arrays), batch_size):
    part = arrays.take(np.arange(start, min(start + batch_size, len(arrays))))
    filled = part.take(np.concatenate([np.arange(len(part)), np.zeros(batch_size - len(part), int)]))
    for side, tokens, lengths in (("chosen", filled.chosen, filled.chosen_lengths),
                                  ("rejected", filled.rejected, filled.rejected_lengths)):
      if mesh is not None:
        tokens_sharding, rows_sharding = row_shardings(mesh, rules)
        tokens = jax.make_array_from_process_local_data(tokens_sharding, tokens)
        lengths = jax.make_array_from_process_local_data(rows_sharding, lengths)
      outs[side].append(np.asarray(jax.device_get(score(params, extra, tokens, lengths)))[:len(part)])
  return np.concatenate(outs["chosen"]), np.concatenate(outs["rejected"])
