"""Packed updates (rl/batches/packing.py): the plan maps both ways, rows are token-balanced, bad input is
refused by name, and on real rollouts a packed update equals the padded one (loss, gradients,
parameters after a step) while segment ids keep packed samples apart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.ring_attention import unzigzag
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.batches import packing
from meshrl.rl.batches.handover import ScoredBatch, UpdateBatch, align_for_update
from meshrl.rl.step.driver import check_config
from meshrl.rl.step.run_spec import update_row_ladder
from meshrl.rl.step.program import _rollout_arrays, build_run, prepare
from meshrl.sharding import make_mesh

TOK = ByteTokenizer()


def _padded_segments(prompt_lens, response_lens, prompt_len, budget):
  """segment_ids [B, S] of left-padded prompts followed by responses."""
  seg = np.zeros((len(prompt_lens), prompt_len + budget), np.int32)
  for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
    seg[b, prompt_len - p:prompt_len + r] = 1
  return seg


def _long_tailed(count, budget, seed=0):
  rng = np.random.default_rng(seed)
  return np.clip(np.round(4 * np.exp(1.2 * rng.standard_normal(count))), 1, budget).astype(int)


@pytest.mark.parametrize("zigzag_shards", [1, 2])
def test_plan_round_trip_balance_and_left_out_samples(zigzag_shards):
  b, lp, n = 64, 8, 56
  prompt_lens = np.random.default_rng(1).integers(2, lp + 1, b)
  seg = _padded_segments(prompt_lens, _long_tailed(b, n), lp, n)
  include = np.ones(b, bool)
  include[[3, 17]] = False  # groups kept only for the static shape are not packed
  spec = packing.PackingSpec(rows=16, row_len=lp + n, zigzag_shards=zigzag_shards)
  plan = packing.plan_packing(seg, include, spec)
  lengths = (seg != 0).sum(1)
  # Every real token of every included sample sits in exactly one packed cell, and nothing else does.
  values = np.random.default_rng(2).normal(size=seg.shape).astype(np.float32)
  back = plan.unpack(plan.pack(values, 0.0), np.nan)
  want = np.where((seg != 0) & include[:, None], values, np.nan)
  np.testing.assert_array_equal(back, want)
  assert plan.valid.sum() == lengths[include].sum()
  # Each sample lies in one row, contiguous and in order (before zigzag), so positions stay valid.
  plan_rows = packing.plan_packing(seg, include, packing.PackingSpec(rows=16, row_len=lp + n))
  for s in np.nonzero(include)[0]:
    rows, cols = np.nonzero(plan_rows.sample == s)
    assert len(set(rows)) == 1 and np.all(np.diff(cols) == 1)
    np.testing.assert_array_equal(plan_rows.column[rows, cols], np.nonzero(seg[s])[0])
  # Token balance: rows differ by at most one trajectory (LPT), far tighter than first fit in order.
  tokens = plan.row_tokens()
  assert tokens.max() - tokens.min() <= lengths[include].max(), tokens
  naive = np.zeros(16, int)
  for s in np.nonzero(include)[0]:
    naive[np.nonzero(naive + lengths[s] <= lp + n)[0][0]] += lengths[s]
  assert tokens.max() - tokens.min() < naive.max() - naive.min()
  # Any split of the rows into minibatches is balanced to within one trajectory per row.
  minibatches = tokens[np.random.default_rng(3).permutation(16)].reshape(4, 4).sum(1)
  assert minibatches.max() - minibatches.min() <= 4 * lengths[include].max()


def test_first_fit_when_least_loaded_leaves_no_room():
  """Lengths 5, 5, 4, 4, 2 into 2 rows of 10: least-loaded spreads them and strands the 2; first
  fit decreasing packs them exactly."""
  rows = packing.assign_rows(np.array([5, 5, 4, 4, 2]), rows=2, row_len=10)
  assert np.bincount(rows, weights=[5, 5, 4, 4, 2]).tolist() == [10.0, 10.0]


def test_row_buckets_take_the_fewest_rows_that_hold_the_kept_trajectories():
  """rl.packed_row_buckets=4 over 64 rows of 10: ladder 8, 16, 32, 64. Dynamic sampling's dropped
  samples (length 0) cost no rows; a step takes the fewest rows that hold the rest, every rung
  tried from the bottom, the largest named when even it is too small. The ladder stops halving where
  a half would not split into the minibatches over the data-parallel axes."""
  spec = packing.PackingSpec(rows=64, row_len=10, ladder=(8, 16, 32, 64))
  for kept, want in ((0, 8), (3, 8), (8, 8), (9, 16), (17, 32), (33, 64), (64, 64)):
    lengths = np.zeros(64, int)
    lengths[:kept] = 10  # one trajectory fills a row
    row_of, rows = packing.fit_rows(lengths, spec.row_ladder, spec.row_len)
    assert rows == want and (row_of >= 0).sum() == kept and row_of.max(initial=-1) < rows
  # Short trajectories share rows: 24 of 5 tokens fit in 16 rows (not 24).
  assert packing.fit_rows(np.full(24, 5), spec.row_ladder, 10)[1] == 16
  # The plan has the rung's rows, and its cells round-trip the kept samples.
  seg = _padded_segments([2] * 8, [3] * 8, 4, 6)
  include = np.zeros(8, bool)
  include[:3] = True
  plan = packing.plan_packing(seg, include, packing.PackingSpec(rows=8, row_len=10, ladder=(2, 4, 8)))
  assert plan.sample.shape == (2, 10) and plan.valid.sum() == 15
  with pytest.raises(ValueError, match=r"do not fit in rl.packed_rows=2 rows of rl.packed_row_len=10"):
    packing.plan_packing(seg, np.ones(8, bool), packing.PackingSpec(rows=2, row_len=10, ladder=(1, 2)))
  with pytest.raises(ValueError, match=r"ladder \(2, 4\) must rise to rl.packed_rows=8"):
    packing.PackingSpec(rows=8, row_len=10, ladder=(2, 4))
  # The run's ladder: halvings while each half splits into minibatches over the data-parallel axes.
  base = ["rl.pack_updates=true", "rl.prompts_per_step=4", "rl.group_size=4", "rl.num_minibatches=2"]
  for overrides, devices, want in (
      (["rl.packed_row_buckets=4"], None, (2, 4, 8, 16)),
      (["rl.packed_row_buckets=9"], None, (2, 4, 8, 16)),  # 1 row does not split into 2 minibatches
      (["rl.packed_row_buckets=4", "mesh.fsdp=4", "mesh.tensor=2"], 8, (8, 16)),  # 2 rows per minibatch over 4
      (["rl.packed_row_buckets=4", "rl.packed_rows=12"], None, (6, 12)),  # 3 is odd: no halving
      (["rl.packed_row_buckets=1"], None, (16,)),
      # Even spacing: 16 * k / 4, each splitting into 2 minibatches (over 4 shards: 2 rows each).
      (["rl.packed_row_buckets=4", "rl.packed_row_spacing=even"], None, (4, 8, 12, 16)),
      (["rl.packed_row_buckets=8", "rl.packed_row_spacing=even"], None, (2, 4, 6, 8, 10, 12, 14, 16)),
      (["rl.packed_row_buckets=16", "rl.packed_row_spacing=even"], None, (2, 4, 6, 8, 10, 12, 14, 16)),
      (["rl.packed_row_buckets=8", "rl.packed_row_spacing=even", "mesh.fsdp=4", "mesh.tensor=2"], 8, (8, 16)),
      (["rl.packed_row_buckets=3", "rl.packed_row_spacing=even", "rl.packed_rows=12"], None, (4, 8, 12))):
    assert update_row_ladder(configs.load("configs/tiny.py", base + overrides), devices) == want, overrides


def test_bad_packing_input_is_refused_by_name():
  seg = _padded_segments([3, 4], [5, 6], 4, 8)
  with pytest.raises(ValueError, match=r"sample 1 has 10 real tokens, more than rl.packed_row_len=8"):
    packing.plan_packing(seg, np.ones(2, bool), packing.PackingSpec(rows=2, row_len=8))
  with pytest.raises(ValueError, match=r"do not fit in rl.packed_rows=1 rows of rl.packed_row_len=12"):
    packing.plan_packing(seg, np.ones(2, bool), packing.PackingSpec(rows=1, row_len=12))
  broken = seg.copy()
  broken[0, 5] = 0
  with pytest.raises(ValueError, match="sample 0's real tokens .* are not contiguous"):
    packing.plan_packing(broken, np.ones(2, bool), packing.PackingSpec(rows=2, row_len=12))
  with pytest.raises(ValueError, match=r"rl.packed_row_len=10 is not divisible by 4"):
    packing.PackingSpec(rows=2, row_len=10, zigzag_shards=2)
  base = ["rl.pack_updates=true", "rl.prompts_per_step=4", "rl.group_size=4", "rl.num_minibatches=2"]
  for overrides, match in (
      (["rl.packed_row_len=20"], r"rl.packed_row_len=20 must lie between .* = 24"),
      (["rl.packed_rows=5"], r"rl.num_minibatches=2 must divide the rl.packed_rows=5"),
      (["rl.packed_rows=-1"], r"rl.packed_rows=-1 must be at least 0"),
      (["rl.tis_level=seq"], r"rl.tis_level='seq'; choose one of"),
      (["rl.tis_cap=0.5"], r"rl.tis_cap=0.5 must be >= 1"),
      (["attention.logits_chunk=-1"], r"attention.logits_chunk=-1 must be at least 0"),
      (["rl.packed_row_buckets=0"], r"rl.packed_row_buckets=0 must be at least 1"),
      (["rl.pack_updates=false", "rl.packed_row_buckets=2"],
       r"rl.packed_row_buckets=2 sizes packed update batches: set rl.pack_updates=true"),
      (["rl.packed_row_spacing=linear"], r"rl.packed_row_spacing='linear' is not one of 'halve', 'even'"),
      (["rl.packed_row_spacing=even"], r"rl.packed_row_spacing='even' spaces the row counts of "
                                       r"rl.packed_row_buckets, which is 1")):
    with pytest.raises(ValueError, match=match):
      check_config(configs.load("configs/tiny.py", base + overrides))
  with pytest.raises(ValueError, match=r"rl.packed_rows=6 / rl.num_minibatches=2 packed rows per minibatch "
                                       r"are not divisible by the data-parallel axes data\*fsdp\*expert = 2"):
    check_config(configs.load("configs/tiny.py", base + ["rl.packed_rows=6", "mesh.fsdp=2", "mesh.tensor=4"]),
                 num_devices=8)


# --- on real rollouts ---------------------------------------------------------------------------

SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "moe.first_k_dense=1", "rl.max_prompt_len=12", "rl.max_new_tokens=8",
         "model.max_seq_len=40", "rl.prompts_per_step=4", "rl.group_size=4", "rl.dynamic_sampling=false",
         "rl.num_minibatches=1", "rl.sft_steps=0", "optim.name=sgd", "optim.learning_rate=0.5", "optim.grad_clip=0",
         "moe.aux_loss_coef=0", "moe.z_loss_coef=0", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]
PROMPTS = ["1+2=", "13+24+5=", "5*6=", "100+200+300="]
PACKED = ["rl.pack_updates=true", "rl.packed_rows=4", "rl.packed_row_len=40"]


def _scored(run) -> ScoredBatch:
  """A real rollout whose responses are cut to long-tailed lengths (as stop tokens would)."""
  tokens, mask = TOK.encode_batch(PROMPTS, length=run.cfg.rl.max_prompt_len)
  arrays = _rollout_arrays(run.rollout(run.state.params, run.state.extra, tokens, mask, jax.random.key(0)))
  lp, n = run.cfg.rl.max_prompt_len, run.cfg.rl.max_new_tokens
  cut = np.array([1, 8, 2, 3, 1, 1, 5, 2, 8, 1, 2, 4, 1, 3, 1, 6])
  cols = np.arange(lp + n)[None, :]
  drop = (cols >= lp + cut[:, None])
  for name in ("response_mask", "segment_ids", "positions", "logprobs", "tokens"):
    arrays[name] = np.where(drop, 0, arrays[name]).astype(arrays[name].dtype)
  arrays["lengths"] = np.minimum(arrays["lengths"], cut)
  rewards = np.random.RandomState(0).rand(16).astype(np.float32)
  valid = np.ones(16, bool)
  valid[12:] = False  # a group kept only for the static shape: not packed, no gradient either way
  return ScoredBatch(arrays=arrays, rewards=rewards, correct=rewards, sample_valid=valid,
                     domains=[""] * 16, texts=[""] * 16)


def _runs(extra, packed_options=PACKED):
  out = []
  for packed in (False, True):
    cfg = configs.load("configs/tiny.py", SMALL + extra + (packed_options if packed else []))
    check_config(cfg, 8)
    mesh = make_mesh(cfg.mesh)
    out.append(build_run(cfg, mesh, build_model(ModelConfig.from_config(cfg, mesh), mesh, seed=0), TOK))
  return out


CASES = {
    "gspo_seqmean_kl_tis": ["rl.policy_loss=gspo", "rl.loss_agg=seq_mean_token_mean", "rl.kl_coef=0.1",
                            "rl.entropy_coef=0.01", "rl.tis_level=sequence", "rl.tis_cap=1.5"],
    "gae_constnorm_critic": ["rl.advantage=gae", "model.value_head=true", "rl.loss_agg=constant_norm",
                             "rl.kl_coef=0.05", "rl.kl_in_reward=true", "rl.tis_level=token"],
}


def _prepared(extra, packed_options=PACKED):
  """(padded run, packed run, scored batch, padded batch, packed batch, packing metrics, plan,
  initial (params, extra)) for the config overrides `extra` (the packed run's: `packed_options`)."""
  padded_run, packed_run = _runs(extra, packed_options)
  scored = _scored(padded_run)
  padded, _ = prepare(padded_run, scored)
  packed, metrics = prepare(packed_run, scored)
  plan = packing.plan_packing(align_for_update(scored)["segment_ids"], scored.sample_valid,
                              packing.PackingSpec.from_config(packed_run.cfg,
                                                              zigzag_shards=packed_run.zigzag_shards,
                                                              ladder=packed_run.run_spec.update_row_ladder))
  initial = jax.tree.map(jnp.copy, (padded_run.state.params, padded_run.state.extra))  # survives donation
  return padded_run, packed_run, scored, padded, packed, metrics, plan, initial


@pytest.fixture(scope="module")
def gspo_case(devices):  # pylint: disable=unused-argument
  return _prepared(CASES["gspo_seqmean_kl_tis"])


def _check_packed_equals_padded(prepared):
  padded_run, packed_run, scored, padded, packed, metrics, plan, initial = prepared
  assert packed.tokens.shape == (4, 40) and padded.tokens.shape == (16, 20)
  real = (np.asarray(scored.arrays["segment_ids"]) != 0)[:12].sum()
  assert np.asarray(packed.sequence_ids >= 0).sum() == real
  assert metrics["packed_fill"] == pytest.approx(real / 160)
  # Per-sample quantities computed packed (proximal/ref log-probs, values) and per sample
  # (advantages, returns) land on the same tokens in both layouts.
  shards = padded_run.zigzag_shards
  contiguous = lambda x: unzigzag(np.asarray(x), shards) if shards > 1 else np.asarray(x)  # noqa: E731
  mask = contiguous(padded.loss_mask)
  assert mask.sum() > 20
  for name in ("old_logprobs", "advantages", "ref_logprobs", "behaviour_logprobs", "old_values", "returns"):
    if getattr(padded, name) is None:
      continue
    unpacked = plan.unpack(np.asarray(getattr(packed, name)), 0.0)
    np.testing.assert_allclose(unpacked[mask], contiguous(getattr(padded, name))[mask], atol=2e-5, err_msg=name)
  states, losses = [], []
  for run, batch in ((padded_run, padded), (packed_run, packed)):
    state, update_metrics = run.update(run.state, batch, jax.random.key(1))
    run.state = state
    states.append(jax.tree.map(np.asarray, state.params))
    losses.append(float(update_metrics["loss"]))
  assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
  steps = [jax.tree.map(lambda a, b: a - np.asarray(b), s, initial[0]) for s in states]
  scale = max(np.abs(x).max() for x in jax.tree.leaves(steps[0]))
  assert scale > 1e-4  # the step is not trivially zero
  for want, got in zip(jax.tree.leaves(steps[0]), jax.tree.leaves(steps[1])):
    np.testing.assert_allclose(got, want, atol=2e-4 * scale)


def test_packed_update_equals_padded(gspo_case):
  """Same rollout, padded [16, 20] vs packed [4, 40], GSPO with a per-sequence mean, KL in the loss,
  entropy bonus and sequence-level TIS: the update's loss, its gradient (SGD without clipping: the
  parameter step is -lr x gradient) and so the parameters after one step agree; the packed batch
  holds only the valid samples' real tokens."""
  _check_packed_equals_padded(gspo_case)


def test_bucketed_packed_update_equals_padded(devices):  # pylint: disable=unused-argument
  """rl.packed_row_buckets=3 over 16 rows: the step's 12 kept samples (4 dynamic-sampling drops) take
  the ladder's fewest rows, 4 of 4, 8, 16, and the update on them equals the padded one on all 16
  samples (loss, gradient, parameters); the step reports the rows it took."""
  prepared = _prepared(CASES["gspo_seqmean_kl_tis"], ["rl.pack_updates=true", "rl.packed_rows=16",
                                                      "rl.packed_row_len=40", "rl.packed_row_buckets=3"])
  assert prepared[5]["update_rows"] == 4
  _check_packed_equals_padded(prepared)


@pytest.mark.slow
def test_packed_update_equals_padded_with_a_critic(devices):  # pylint: disable=unused-argument
  """As above for GAE with a critic (values computed packed, GAE per sample, returns packed back),
  constant_norm, KL in the reward and token-level TIS."""
  _check_packed_equals_padded(_prepared(CASES["gae_constnorm_critic"]))


def test_packed_rows_keep_samples_apart(gspo_case):
  """Log-probs of packed samples equal those of the same samples alone in padded rows; with the
  segment ids dropped (one segment per row) the later samples of a row see the earlier ones."""
  padded_run, packed_run, _, padded, packed, _, plan, (params, extra) = gspo_case
  mask = np.asarray(padded.loss_mask)
  want = np.asarray(padded_run.logprob_fn(params, extra, padded)[0])[mask]
  got = plan.unpack(np.asarray(packed_run.logprob_fn(params, extra, packed)[0]), 0.0)[mask]
  np.testing.assert_allclose(got, want, atol=2e-5)
  merged = packed.replace(segment_ids=jax.device_put((np.asarray(packed.sequence_ids) >= 0).astype(np.int32),
                                                     packed.segment_ids.sharding))  # same program
  leaked = plan.unpack(np.asarray(packed_run.logprob_fn(params, extra, merged)[0]), 0.0)[mask]
  assert np.abs(leaked - want).max() > 1e-2
  # A batch built for the packed loss without its sequence ids is refused by name.
  with pytest.raises(ValueError, match=r"lacks \['sequence_ids'\].*packed rows"):
    UpdateBatch.check(packed.replace(sequence_ids=None), packed_run.spec)


@pytest.mark.slow
def test_packed_update_equals_padded_under_ring_attention_zigzag(devices):  # pylint: disable=unused-argument
  """Ring attention over mesh.sequence=2 with the zigzag layout: the plan's columns are zigzagged, so
  the packed rows are too; loss, gradient and per-sample advantages (GAE, which scans columns in
  order, computed per sample in contiguous order for both layouts) agree with the padded batch."""
  ring = ["attention.impl=ring", "attention.block_q=8", "attention.block_kv=8", "mesh.sequence=2",
          "mesh.expert=1", "rl.advantage=gae", "model.value_head=true"]
  prepared = _prepared(ring)
  padded_run, packed_run = prepared[0], prepared[1]
  assert padded_run.zigzag_shards == 2 and packed_run.zigzag_shards == 2
  _check_packed_equals_padded(prepared)

