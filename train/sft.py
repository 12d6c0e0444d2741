"""Supervised fine-tuning on packed prompt/answer data: the RL warm start, and a check that the model
can learn at all (the tiny model memorises a small batch).

  step = make_sft_step(graphdef, mesh, cfg, tx, state_shardings=shardings_of(state))
  state, metrics = step(state, batch)      # jitted, state donated
  result = run_sft(cfg, workdir, mesh, source=examples)  # the loop: data, metrics, checkpoints, resume

Loss: next-token cross-entropy, counted only where the *target* token has loss_mask 1 (answer tokens
and EOS) and lies in the same packed document as its input, averaged over those tokens; plus the MoE
terms `moe.aux_loss_coef * aux_loss + moe.z_loss_coef * z_loss`. Segment ids go to the model, so
packed documents never attend to each other. With `attention.logits_chunk > 0` the vocabulary
projection and loss run chunk by chunk (train/chunked_loss.py) and [B, T, V] logits never exist.

Targets are taken on the host, in contiguous order (`model_rows`); then, when ring attention runs over
a sequence axis with `attention.zigzag`, every row is laid out zigzag for causal balance. The loss is a
sum over positions, so the layout does not change it.

Axis legend: B batch rows, T packed length, V vocabulary.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.model import pipeline
from meshrl.model.init import build_model
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.sharding.rules import data_parallel_size, logical_to_spec, rules_from_config
from meshrl.train import chunked_loss
from meshrl.train.checkpoint import Checkpointer
from meshrl.model.ring_attention import zigzag
from meshrl.train.data import make_sft_data
from meshrl.train.init_from import model_config
from meshrl.train.profile import StepProfiler
from meshrl.train.metrics import (CompileCounter, MetricsWriter, mfu, model_flops_per_token, peak_flops,
                                  plot_curve)
from meshrl.train.optim import make_optimizer, make_schedule
from meshrl.train.preemption import Preemption
from meshrl.train.state import (TrainState, abstract_train_state, create_train_state, merge_batch_model,
                                merge_model, shardings_of, update_router_bias)
from meshrl.train.stops import NonFiniteStreak, guarded_update, keep_unless
from meshrl.sharding.mesh import SEQUENCE_AXIS, axis_size


MODEL_FIELDS = ("tokens", "positions", "segment_ids", "targets", "weights")


def next_token_targets(batch: dict) -> tuple[np.ndarray, np.ndarray]:
  """(targets [B, T] int32, weights [B, T] float32): position t predicts token t + 1.

  The weight is 1 where token t + 1 is a loss token (loss_mask) of the same document as token t;
  the last position has no target (weight 0). Host side (numpy), on contiguous rows.
  """
  tokens, segments, mask = (np.asarray(batch[k]) for k in ("tokens", "segment_ids", "loss_mask"))
  targets = np.pad(tokens[:, 1:], ((0, 0), (0, 1)))
  same_doc = np.pad((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0), ((0, 0), (0, 1)))
  weights = np.pad(mask[:, 1:], ((0, 0), (0, 1))) * same_doc
  return targets.astype(np.int32), weights.astype(np.float32)


def model_rows(batch: dict, zigzag_shards: int = 1) -> dict[str, np.ndarray]:
  """Packed rows {"tokens", "segment_ids", "positions", "loss_mask"} -> the step's inputs
  MODEL_FIELDS [B, T], laid out zigzag over `zigzag_shards` sequence shards when > 1."""
  targets, weights = next_token_targets(batch)
  rows = {"tokens": np.asarray(batch["tokens"]), "positions": np.asarray(batch["positions"]),
          "segment_ids": np.asarray(batch["segment_ids"]), "targets": targets, "weights": weights}
  if zigzag_shards > 1:
    rows = {k: zigzag(v, zigzag_shards, axis=1) for k, v in rows.items()}
  return rows


def zigzag_shards(cfg, mesh: Mesh | None) -> int:
  """mesh.sequence when ring attention runs with attention.zigzag, else 1."""
  if mesh is None or not cfg.attention.zigzag or cfg.attention.impl != "ring":
    return 1
  return axis_size(mesh, SEQUENCE_AXIS)


def _cross_entropy(model, batch: dict, targets, weights, logits_chunk: int):
  """-> (summed token NLL, ModelOutput)."""
  kw = dict(positions=batch["positions"], segment_ids=batch["segment_ids"])
  if logits_chunk:
    out = model(batch["tokens"], return_hidden=True, **kw)
    nll_sum, _ = chunked_loss.chunked_cross_entropy(out.hidden, model.output_projection(), targets,
                                                    weights, chunk=logits_chunk)
    return nll_sum, out
  out = model(batch["tokens"], **kw)
  logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)  # [B, T, V]
  target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
  return -jnp.sum(target_logp * weights), out


def sft_loss(params: nnx.State, extra: nnx.State, graphdef: nnx.GraphDef, batch: dict, *, moe_cfg,
             logits_chunk: int = 0, zigzag_inputs: bool = False) -> tuple[jax.Array, dict]:
  """The SFT objective on one packed batch -> (loss, metrics). zigzag_inputs: the rows are laid out
  zigzag over `sequence` (`model_rows`), which splash's ring is told (model/attention.py)."""
  model = merge_batch_model(graphdef, params, extra, zigzag_inputs=zigzag_inputs)
  targets, weights = batch["targets"], batch["weights"]
  num_tokens = jnp.sum(weights)
  # Answer tokens: mean next-token cross-entropy.
  nll_sum, out = _cross_entropy(model, batch, targets, weights, logits_chunk)
  ce = nll_sum / jnp.maximum(num_tokens, 1.0)
  loss, metrics = ce, {"ce": ce, "loss_tokens": num_tokens}
  # MoE balance: auxiliary load-balancing and router z-losses.
  if out.aux:
    loss = loss + moe_cfg.aux_loss_coef * out.aux["aux_loss"] + moe_cfg.z_loss_coef * out.aux["z_loss"]
    metrics.update(moe_aux_loss=out.aux["aux_loss"], moe_z_loss=out.aux["z_loss"],
                   expert_load=out.aux["expert_load"], moe_max_load=jnp.max(out.aux["expert_load"]))
  metrics["loss"] = loss
  return loss, metrics


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """The sharding of [B, T] batch arrays: B over the batch axes, T over `sequence` (TRAIN rules)."""
  return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules, mesh))


def put_batch(batch: dict, sharding: NamedSharding | None, zigzag_over: int = 1) -> dict:
  """Host batch ([B, T] numpy packed rows, this host's) -> the step's inputs (`model_rows`) as global
  jax arrays in `sharding`."""
  rows = model_rows(batch, zigzag_over)
  if sharding is None:
    return {k: jax.device_put(v) for k, v in rows.items()}
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in rows.items()}


def make_sft_step(model_graphdef: nnx.GraphDef, mesh: Mesh | None, cfg, tx: optax.GradientTransformation,
                  *, state_shardings: Any = None, schedule: optax.Schedule | None = None):
  """Returns jitted `sft_step(state, batch) -> (state, metrics)`; `state` is donated.

  Args:
    model_graphdef: from `create_train_state` / `split_model`.
    mesh: the run's mesh (None: one device).
    cfg: the run config (moe.*, attention.logits_chunk, optim.grad_accum_steps, mesh rules).
    tx: the optimizer.
    state_shardings: `shardings_of(state)`; pins the output state to the input layout so the step
      compiles once. Batch arrays are laid out by `batch_sharding`.
    schedule: the optimizer's learning-rate schedule, to report "lr".

  Metrics (scalars unless noted): loss, ce, loss_tokens, grad_norm, lr, nonfinite (1.0 when the step
  was skipped by the NaN guard), and for MoE models moe_aux_loss, moe_z_loss, moe_max_load (largest
  expert share), expert_load [L, E].
  """
  grad_fn = jax.grad(functools.partial(sft_loss, graphdef=model_graphdef, moe_cfg=cfg.moe,
                                       logits_chunk=int(cfg.attention.logits_chunk),
                                       zigzag_inputs=zigzag_shards(cfg, mesh) > 1), has_aux=True)
  accum = int(cfg.optim.grad_accum_steps)

  def sft_step(state: TrainState, batch: dict):
    grads, metrics = grad_fn(state.params, state.extra, batch=batch)
    # NaN guard (train/stops.py): a non-finite loss or gradient leaves params and optimiser state as
    # they were; the router bias is not moved by its loads either.
    params, opt_state, grad_norm, finite = guarded_update(tx, state, grads, metrics["loss"])
    metrics["grad_norm"] = grad_norm
    metrics["nonfinite"] = 1.0 - finite.astype(jnp.float32)
    if schedule is not None:
      metrics["lr"] = schedule(state.step // accum)
    extra = state.extra
    if cfg.moe.aux_free_bias and "expert_load" in metrics:
      extra = keep_unless(finite, update_router_bias(extra, metrics["expert_load"], cfg.moe.bias_update_rate),
                          extra)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, extra=extra), metrics

  if mesh is None or state_shardings is None:
    return jax.jit(sft_step, donate_argnums=(0,))
  rows = batch_sharding(mesh, rules_from_config(cfg.mesh))
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(sft_step, in_shardings=(state_shardings, {k: rows for k in MODEL_FIELDS}),
                 out_shardings=(state_shardings, replicated), donate_argnums=(0,))


class SFTResult(NamedTuple):
  model: nnx.Module  # the trained model (shares the state's arrays)
  state: TrainState
  graphdef: nnx.GraphDef
  history: list[dict]  # the metrics records written
  preempted: bool = False  # stopped early by a preemption request, saved at its last step


def check_shapes(cfg, mesh: Mesh | None) -> None:
  """Raises ValueError (naming the fields) unless rl.sft_batch_size and data.seq_len split over the
  mesh and the length fits the model; called before anything compiles."""
  seq_len, batch_size = cfg.data.seq_len, cfg.rl.sft_batch_size
  if seq_len > cfg.model.max_seq_len:
    raise ValueError(f"data.seq_len={seq_len} is longer than model.max_seq_len={cfg.model.max_seq_len}.")
  if mesh is None:
    return
  rows = data_parallel_size(mesh)
  if batch_size % rows:
    raise ValueError(f"rl.sft_batch_size={batch_size} is not divisible by the {rows} batch shards "
                     f"(mesh data * fsdp * expert = {dict(mesh.shape)}).")
  pipeline.resolve_microbatches(int(cfg.mesh.get("microbatches", 0)), rows=batch_size, row_shards=rows,
                                stages=int(cfg.mesh.get("stage", 1)), what="rl.sft_batch_size")
  sequence = axis_size(mesh, SEQUENCE_AXIS)
  multiple = sequence * (2 if zigzag_shards(cfg, mesh) > 1 else 1)
  if seq_len % multiple:
    twice = ", x2 for attention.zigzag" if multiple > sequence else ""
    raise ValueError(f"data.seq_len={seq_len} is not divisible by {multiple} (mesh.sequence={sequence}{twice}).")


def _initial_state(cfg, mesh: Mesh | None, mc: ModelConfig, model: nnx.Module | None, tx, resuming: bool):
  """(graphdef, state): the model's, or on a resume an abstract target (nothing initialised), of
  model numbers `mc`."""
  rules = rules_from_config(cfg.mesh)
  if resuming and model is None and mesh is not None:
    return abstract_train_state(lambda: Transformer(mc, rngs=nnx.Rngs(cfg.seed)), tx, mesh, rules)
  if model is None:
    model = build_model(mc, mesh, seed=cfg.seed, rules=rules)
  return create_train_state(model, tx, mesh)


def run_sft(cfg, workdir: str, mesh: Mesh | None = None, model: nnx.Module | None = None, *,
            source: Any, tokenizer=None, num_steps: int | None = None, bad_rows: int = 0,
            preemption: Preemption | None = None, numbers: ModelConfig | None = None) -> SFTResult:
  """Trains `rl.sft_steps` steps of SFT, writing metrics and checkpoints to `workdir`.

  Args:
    cfg: the locked run config (rl.sft_*, optim.*, data.*, checkpoint.*, log.*).
    workdir: outputs: metrics.jsonl, tb/, checkpoints/, loss_curve.png.
    mesh: the run's mesh (None: one device).
    model: a built model to fine-tune (e.g. converted weights); built from cfg when None.
    source: the examples ({"prompt", "answer"}): an endless random-access source (the RL task
      mixture) or a finite list, as `train.data.example_source` takes.
    tokenizer: defaults to the byte tokenizer.
    num_steps: overrides rl.sft_steps.
    preemption: a `Preemption` (train/preemption.py) entered by the caller: once it is requested
      (SIGTERM), the step in flight finishes, is saved, and the run returns with preempted=True.
    numbers: the model numbers on `mesh` (an RL warm start: its run spec's), built once from cfg by
      train/init_from.model_config when None; the model, the state and the FLOPs read them.

  Returns:
    SFTResult(model, state, graphdef, history, preempted). With checkpoint.restore, a run finds its
    latest checkpoint in workdir/checkpoints and continues from it (state, data position, metrics file).

  Raises:
    NonFiniteError (train/stops.py) after rl.max_nonfinite_steps skipped steps in a row, once the
    last of them is saved (the parameters in it are those before the streak).
  """
  num_steps = cfg.rl.sft_steps if num_steps is None else num_steps
  check_shapes(cfg, mesh)
  tx = make_optimizer(cfg.optim, learning_rate=cfg.rl.sft_learning_rate, rate_field="rl.sft_learning_rate")
  ckpt = None
  if cfg.checkpoint.enabled:
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), every=cfg.checkpoint.every,
                        max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save)
  resuming = ckpt is not None and cfg.checkpoint.restore and ckpt.latest_step() is not None
  mc = model_config(cfg, mesh) if numbers is None else numbers
  graphdef, state = _initial_state(cfg, mesh, mc, model, tx, resuming)
  data = make_sft_data(cfg, source=source, tokenizer=tokenizer, bad_rows=bad_rows)
  zigzag_over = zigzag_shards(cfg, mesh)
  start = 0
  if resuming:
    restored = ckpt.restore(state)
    state, start = restored.state, restored.step
    data.set_state(restored.data_state)
  flops_per_token = model_flops_per_token(mc, seq_len=cfg.data.seq_len)
  peak = peak_flops(mesh.devices.flat if mesh is not None else jax.devices()[:1])

  step_fn = make_sft_step(graphdef, mesh, cfg, tx, state_shardings=shardings_of(state),
                          schedule=make_schedule(cfg.optim, learning_rate=cfg.rl.sft_learning_rate))
  row_sharding = None
  if mesh is not None:
    row_sharding = batch_sharding(mesh, rules_from_config(cfg.mesh))
  writer = MetricsWriter(workdir, tensorboard=cfg.log.tensorboard, progress_bar=cfg.log.progress_bar,
                         total_steps=num_steps, resume_step=start)
  history, counter = [], CompileCounter()
  profiler = StepProfiler.from_config(cfg, workdir, name="sft")
  streak = NonFiniteStreak(cfg.rl.max_nonfinite_steps, what="SFT", field="rl.max_nonfinite_steps")
  tokens, last_time, skipped, preempted = 0, time.perf_counter(), 0, False
  try:
    for step in range(start + 1, num_steps + 1):
      host_batch = next(data)
      tokens += int(np.sum(host_batch["segment_ids"] > 0))
      # The batch's own (explicit) transfer stays outside the guard: with several processes
      # make_array_from_process_local_data counts as an implicit one and would be refused.
      batch = put_batch(host_batch, row_sharding, zigzag_over)
      with profiler.step(step):
        with jax.transfer_guard("disallow"):
          state, metrics = step_fn(state, batch)
        # One scalar read per step: the streak must be known before the next step is dispatched.
        nonfinite = bool(jax.device_get(metrics["nonfinite"]))
      skipped += nonfinite
      stop_nonfinite = streak.update(nonfinite)
      preempted = preemption is not None and preemption.requested() and step < num_steps
      stopping = stop_nonfinite or preempted or step == num_steps
      if step % cfg.log.every == 0 or stopping:
        metrics = {k: v for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
        elapsed, last_time = time.perf_counter() - last_time, time.perf_counter()
        metrics.update(tokens_per_s=tokens / elapsed, compiles=counter.count("sft_step"),
                       nonfinite_steps=skipped, **data.stats)
        if peak:
          metrics["mfu"] = mfu(metrics["tokens_per_s"], flops_per_token, peak)
        tokens = 0
        history.append(writer.write(step, metrics))
      if ckpt is not None and (ckpt.should_save(step) or stopping):
        ckpt.save(step, state, data_state=data.get_state(), config=cfg, force=True)
      if stop_nonfinite:
        raise streak.error(step, saved=ckpt is not None)
      if preempted:
        print(preemption.stopped_message("SFT", step, num_steps, saved=ckpt is not None), flush=True)
        break
  finally:
    counter.close()
    profiler.close()
    writer.close()
    if ckpt is not None:
      ckpt.close()
  if cfg.log.plot and history and writer.primary:
    plot_curve(writer.path, "loss", os.path.join(workdir, "loss_curve.png"), title="SFT loss")
  return SFTResult(model=merge_model(graphdef, state), state=state, graphdef=graphdef, history=history,
                   preempted=preempted)
