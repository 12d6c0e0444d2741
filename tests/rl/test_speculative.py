"""Speculative decoding: greedy output identical to plain decoding (draft and n-gram), the rejection
sampler keeps the target's distribution, rejected cache slots are forgotten, bad drafts are refused,
distillation raises the acceptance rate."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from meshrl import configs
from meshrl.model.layers import RopeConfig
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl import speculative as sp
from meshrl.rl.rollout import RolloutSpec, generate
from meshrl.rl.sampling import Sampler
from meshrl.train.distill import DistillConfig, distill

VOCAB = 32
PROMPTS = jnp.array([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 3, 4, 5, 3, 4], [0, 9, 9, 1, 2, 9, 1, 2],
                     [0, 0, 0, 0, 11, 12, 13, 11]], jnp.int32)
MASK = PROMPTS != 0
GREEDY = RolloutSpec(group_size=2, max_new_tokens=12, sampler=Sampler(0.0), stop_tokens=(), pad_id=0)


def _mc(layers, width, vocab=VOCAB, std=0.5, max_len=40):
  return ModelConfig(vocab_size=vocab, num_layers=layers, embed_dim=width, num_heads=2, num_kv_heads=1,
                     head_dim=width // 2, mlp_dim=2 * width, max_seq_len=max_len,
                     rope=RopeConfig(head_dim=width // 2), init_std=std)


@functools.cache
def _models(small=False):
  """(target, draft); small: a 1-layer width-32 target and a width-16 draft (cheaper to compile)."""
  if small:
    return Transformer(_mc(1, 32), rngs=nnx.Rngs(8)), Transformer(_mc(1, 16), rngs=nnx.Rngs(9))
  target = Transformer(_mc(2, 64), rngs=nnx.Rngs(0))
  draft = Transformer(_mc(1, 32), rngs=nnx.Rngs(1))
  return target, draft


@functools.cache
def _plain(spec=GREEDY):
  target, _ = _models()
  return jax.jit(lambda: generate(target, spec, PROMPTS, MASK, jax.random.key(0)))()


@functools.cache
def _spec_fn(method, spec=GREEDY, k=3, small=False):
  """One compiled speculative generate per method; the draft's params are an argument."""
  target, draft = _models(small)
  graphdef, _, rest = nnx.split(draft, nnx.Param, ...)
  sc = sp.SpecConfig(method=method, k=k, ngram_n=2)

  @jax.jit
  def run(draft_params, key):
    d = nnx.merge(graphdef, draft_params, rest) if method == "draft" else None
    return sp.speculative_generate(target, d, spec, sc, PROMPTS, MASK, key, return_caches=True)
  return run


def _draft_params(draft):
  return nnx.split(draft, nnx.Param, ...)[1]


def _check_identical(out, plain):
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=1e-4)


def _check_cache(cache, n, prompt_lengths):
  """Every row's cache holds its prompt and its n - 1 fed tokens at their positions, nothing more."""
  positions = np.asarray(cache.positions)
  for row, (count, plen) in enumerate(zip(np.asarray(n), np.asarray(prompt_lengths))):
    written = positions[row][positions[row] != sp.kvc.EMPTY_POSITION]
    response = np.sort(written[written >= plen])
    np.testing.assert_array_equal(response, plen + np.arange(count - 1))
    assert len(written) == PROMPTS.shape[1] + count - 1


def test_greedy_identical_with_bad_draft():
  _, draft = _models()
  plain = _plain()
  prompt_lengths = np.repeat(np.asarray(MASK.sum(1)), 2)
  out, metrics, (cache, draft_cache, n) = _spec_fn("draft")(_draft_params(draft), jax.random.key(0))
  _check_identical(out, plain)
  assert float(metrics.acceptance_rate) < 0.5  # a random draft: mostly rejected, yet the output is exact
  assert int(metrics.target_forwards) < GREEDY.max_new_tokens  # still fewer forwards than tokens
  _check_cache(cache, n, prompt_lengths)
  _check_cache(draft_cache, n, prompt_lengths)


@pytest.mark.parametrize("loop", ["static", pytest.param("continuous", marks=pytest.mark.slow)])
def test_ngram_from_config_equals_plain_decoding_with_moe_routing(loop):
  """rl.speculative="ngram" from the config (tiny MoE), through make_rollout (static) or make_engine
  (rl.engine="continuous", 3 slots): the plain loop's tokens, log-probs and replayed expert choices,
  and the acceptance metrics on the returned function's `.metrics`."""
  from meshrl.rl.engine import make_engine  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rollout import make_rollout  # pylint: disable=import-outside-toplevel
  make, overrides = {"static": (make_rollout, []),
                     "continuous": (make_engine, ["rl.engine=continuous", "rl.decode_slots=3"])}[loop]
  plain_cfg, spec_cfg, args = _moe_ngram_case(overrides)
  plain = make(plain_cfg, None, stop_ids=(1,), pad_id=0)(*args)
  speculative = make(spec_cfg, None, stop_ids=(1,), pad_id=0)
  out = speculative(*args)
  _check_identical(out, plain)
  assert int(speculative.metrics.accepted) > 0  # the periodic prompt
  _check_same_routing(out, plain)


def _moe_ngram_case(overrides):
  """(plain config, the same + rl.speculative=ngram, rollout args) of a tiny greedy MoE whose prompts
  repeat periodically (so n-gram proposals get accepted)."""
  from meshrl.model.init import build_model  # pylint: disable=import-outside-toplevel
  small = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
           "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=10", "model.max_seq_len=24",
           "model.init_std=0.5", "rl.temperature=0.0", "rl.group_size=2", "rl.speculative_k=3",
           "rl.ngram_n=2"] + overrides
  plain_cfg = configs.load("configs/tiny.py", small)
  spec_cfg = configs.load("configs/tiny.py", small + ["rl.speculative=ngram"])
  params, extra = nnx.split(build_model(ModelConfig.from_config(plain_cfg)), nnx.Param, ...)[1:]
  prompts = PROMPTS % 200 + 3
  return plain_cfg, spec_cfg, (params, extra, prompts, jnp.ones_like(prompts, bool), jax.random.key(0))


def _check_same_routing(out, plain):
  """Equal expert choices for every response token but the last (which speculation never feeds)."""
  last = 8 + np.asarray(plain.lengths)[None, :, None, None] - 1
  column = np.arange(out.routing.shape[2])[None, None, :, None]
  np.testing.assert_array_equal(np.where(column < last, out.routing, 0), np.where(column < last, plain.routing, 0))


def test_rollback_forgets_rejected_slots():
  target, _ = _models()
  prompt = jnp.array([[5, 6, 7, 8]], jnp.int32)

  @jax.jit
  def far_logits(extra_tokens, keep):
    cache = sp.kvc.with_row_index(target(prompt, cache=target.init_cache(1, 16)).cache)
    cache = target(extra_tokens, positions=4 + jnp.arange(extra_tokens.shape[1])[None], cache=cache).cache
    cache = sp.rollback(cache, jnp.array([keep], jnp.int32))
    # A query far ahead (position 12) would attend every slot whose position is <= 12.
    return target(jnp.array([[3]]), positions=jnp.array([[12]]), cache=cache).logits[0, 0]

  rolled = far_logits(jnp.array([[9, 10, 11, 12]], jnp.int32), 5)  # kept: prompt + token 9
  clean = far_logits(jnp.array([[9, 0, 0, 0]], jnp.int32)[:, :1], 5)
  np.testing.assert_allclose(np.asarray(rolled), np.asarray(clean), atol=1e-5)
  stale = far_logits(jnp.array([[9, 10, 11, 12]], jnp.int32), 8)  # nothing forgotten
  assert float(jnp.max(jnp.abs(stale - clean))) > 1e-3


def test_ngram_propose_finds_the_latest_occurrence():
  history = jnp.array([[-1, 1, 2, 3, 1, 2, 4, 5, 1, 2, 0, 0], [7, 8, 9, 7, 8, 9, 7, 8, 0, 0, 0, 0]],
                      jnp.int32)
  propose = jax.jit(sp.ngram_propose, static_argnums=(2, 3))
  got = propose(history, jnp.array([10, 8]), 2, 3)
  # row 0: "1 2" last occurred at 4 -> 4 5 1; row 1: "7 8" at 3 -> 9 7 8
  np.testing.assert_array_equal(np.asarray(got), [[4, 5, 1], [9, 7, 8]])
  none = propose(history, jnp.array([3, 2]), 2, 3)[:, :2]  # no earlier occurrence
  np.testing.assert_array_equal(np.asarray(none), [[0, 0], [0, 0]])


def _chi2_pvalue(samples, probs):
  """Pearson's chi-square test of samples (ints) against probs, over cells expecting > 5."""
  counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
  expected = np.asarray(probs, np.float64) * len(samples)
  keep = expected > 5
  statistic = np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])
  return stats.chi2.sf(statistic, keep.sum() - 1)


def test_rejection_sampling_keeps_the_target_distribution():
  """First committed token of `verify` (k=2) over 40k rows ~ p_0; planted bugs fail the same test."""
  rows, vocab = 20000, 6
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(vocab) * 0.7, size=3)  # [K1, V]
  q = rng.dirichlet(np.ones(vocab) * 0.7, size=2)  # [k, V]

  @jax.jit
  def run():
    keys = jax.random.split(jax.random.key(1), rows * 3).reshape(rows, 3)
    q_rows = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (rows, 2, vocab))
    proposals = jax.random.categorical(jax.random.key(2), jnp.log(q_rows)).astype(jnp.int32)  # [rows, 2]
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (rows, 3, vocab))
    return sp.verify(logits, proposals, q_rows, Sampler(1.0), keys) + (proposals,)
  accepted, nxt, proposals = run()
  accepted, nxt, proposals = map(np.asarray, (accepted, nxt, proposals))
  first = np.where(accepted > 0, proposals[:, 0], nxt)
  assert _chi2_pvalue(first, p[0]) > 1e-4
  second = np.where(accepted > 1, proposals[:, 1], nxt)[accepted >= 1]  # given the first was a draft
  assert _chi2_pvalue(second, p[1]) > 1e-4
  assert 0.2 < accepted.mean() < 1.8  # both accepts and rejections happen
  # Planted bugs, at the same sample size: accepting always gives q; resampling from p instead of the
  # residual gives sum(min(p, q)) * (min(p,q)/sum) + (1 - sum(min(p, q))) * p.
  overlap = np.minimum(p[0], q[0])
  for wrong in (q[0], overlap + (1 - overlap.sum()) * p[0]):
    assert _chi2_pvalue(rng.choice(vocab, size=rows, p=wrong / wrong.sum()), p[0]) < 1e-4


@pytest.mark.slow
def test_sampled_speculative_matches_target_distribution_end_to_end():
  """Full speculative generate at T=1 (k=2, vocab 8): the joint of tokens 1-2 ~ the target's exact one."""
  vocab, rows = 8, 6000
  target = Transformer(_mc(1, 32, vocab=vocab, std=0.4, max_len=16), rngs=nnx.Rngs(3))
  draft = Transformer(_mc(1, 16, vocab=vocab, std=0.4, max_len=16), rngs=nnx.Rngs(4))
  spec = RolloutSpec(group_size=rows, max_new_tokens=3, sampler=Sampler(1.0), stop_tokens=(), pad_id=0)
  prompt = jnp.array([[1, 2, 3]], jnp.int32)
  out, metrics = jax.jit(lambda: sp.speculative_generate(
      target, draft, spec, sp.SpecConfig("draft", k=2), prompt, prompt > 0, jax.random.key(5)))()
  assert 0.05 < float(metrics.acceptance_rate) < 0.95
  tokens = np.asarray(out.tokens[:, 3:6])
  # Exact P(t0, t1, t2) from full forwards over all 64 (t0, t1) prefixes.
  prefixes = np.array([[a, b] for a in range(vocab) for b in range(vocab)])
  seqs = jnp.concatenate([jnp.broadcast_to(prompt, (64, 3)), jnp.asarray(prefixes)], axis=1)
  probs = np.asarray(jax.nn.softmax(target(seqs).logits, axis=-1))  # [64, 5, V]
  joint = (probs[:, 2, :][np.arange(64), prefixes[:, 0]] * probs[:, 3, :][np.arange(64), prefixes[:, 1]])
  pair = joint.reshape(vocab, vocab)  # P(t0, t1)
  observed = tokens[:, 0] * vocab + tokens[:, 1]
  assert _chi2_pvalue(observed, pair.reshape(-1)) > 1e-4
  t2 = (pair.reshape(-1, 1) * probs[:, 4, :]).sum(0)
  assert _chi2_pvalue(tokens[:, 2], t2) > 1e-4


def test_bad_options_are_refused():
  target, _ = _models()
  wide = Transformer(_mc(1, 32, vocab=VOCAB + 8), rngs=nnx.Rngs(2))
  with pytest.raises(ValueError, match=f"vocab_size={VOCAB + 8}.*vocab_size={VOCAB}"):
    sp.speculative_generate(target, wide, GREEDY, sp.SpecConfig("draft", k=2), PROMPTS, MASK,
                            jax.random.key(0))
  with pytest.raises(ValueError, match="rl.speculative_k=0"):
    sp.SpecConfig("draft", k=0)
  with pytest.raises(ValueError, match="rl.speculative='beam'"):
    sp.SpecConfig("beam")
  with pytest.raises(ValueError, match="top_k"):
    sp.check_sampler(Sampler(1.0, top_k=5))
  cfg = configs.load("configs/tiny.py", ["rl.speculative=ngram", "rl.engine=continuous"])
  assert sp.SpecConfig.from_config(cfg).method == "ngram"  # the continuous engine speculates too
  cfg = configs.load("configs/tiny.py", ["rl.speculative=ngram", "rl.engine=continuous", "attention.impl=ring"])
  with pytest.raises(ValueError, match="attention.impl='ring'"):
    sp.SpecConfig.from_config(cfg)
  cfg = configs.load("configs/tiny.py", ["rl.speculative=draft"])
  with pytest.raises(ValueError, match="rl.draft_checkpoint"):
    sp.SpecConfig.from_config(cfg)
  from meshrl.rl.engine import make_engine  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", ["rl.speculative=ngram", "rl.engine=continuous", "rl.speculative_k=8",
                                         "rl.max_prompt_len=24", "rl.max_new_tokens=32"])
  with pytest.raises(ValueError, match=r"rl.speculative_k\+1=9 exceeds model.max_seq_len=64"):
    make_engine(cfg, None, stop_ids=(1,), pad_id=0)  # the verified slots need room past the budget
  cfg = configs.load("configs/tiny.py", ["rl.speculative=draft", "rl.engine=continuous", "rl.speculative_k=2"])
  with pytest.raises(ValueError, match=f"vocab_size={VOCAB}.*vocab_size=259"):
    make_engine(cfg, None, stop_ids=(1,), pad_id=0, draft=(_mc(1, 32), None))


def test_distillation_raises_acceptance_and_output_stays_identical():
  target, _ = _models()
  draft = Transformer(_mc(1, 32), rngs=nnx.Rngs(7))
  run = _spec_fn("draft")
  _, before, _ = run(_draft_params(draft), jax.random.key(0))
  history = distill(target, draft, _plain(), jax.random.key(1), DistillConfig(steps=40, learning_rate=1e-2))
  assert history[-1]["loss"] < history[0]["loss"]
  out, after, _ = run(_draft_params(draft), jax.random.key(0))
  _check_identical(out, _plain())
  assert float(after.acceptance_rate) > float(before.acceptance_rate) + 0.2
  assert len(set(np.asarray(after.row_accepted).tolist())) > 1  # rows accept different counts


# --- the continuous-batching engine (rl/engine.py) speculating ---------------------------------------


@functools.cache
def _engine_fn(method, spec=GREEDY, slots=3, k=3, max_steps=0, small=False):
  """One compiled engine call per (method, spec, slots, max_steps): "none" is the plain run_pool.
  Returns run(draft_params, key, max_lengths) -> (RolloutBatch, SpecMetrics, calls), calling the
  jitted pool decode until every sample has ended (max_steps > 0: carried samples resume)."""
  from meshrl.rl import engine as eng  # pylint: disable=import-outside-toplevel
  target, draft = _models(small)
  graphdef, _, rest = nnx.split(draft, nnx.Param, ...)
  sc = None if method == "none" else sp.SpecConfig(method=method, k=k, ngram_n=2)

  @jax.jit
  def decode(draft_params, pool):
    if sc is None:
      return eng.run_pool(target, spec, pool, slots=slots, max_steps=max_steps)[0], None
    d = nnx.merge(graphdef, draft_params, rest) if method == "draft" else None
    pool, _, metrics = eng.run_pool_speculative(target, d, spec, sc, pool, slots=slots, max_steps=max_steps)
    return pool, metrics

  def run(draft_params, key, max_lengths):
    num = PROMPTS.shape[0] * spec.group_size
    pool = eng.new_pool(PROMPTS, MASK, eng.sample_keys(key, jnp.arange(num)), group_size=spec.group_size,
                        max_new_tokens=spec.max_new_tokens, pad_id=0, max_lengths=max_lengths)
    calls = []
    while not bool(jnp.all(pool.done)):
      pool, metrics = decode(draft_params, pool)
      calls.append(metrics)
      assert len(calls) <= spec.max_new_tokens * num
    return eng.to_rollout_batch(pool, None, 0), calls
  return run


def _expected(plain, stop, limits):
  """The static rollout's greedy samples (no stop token, N tokens) cut as a stop token and per-sample
  limits cut them -> (response tokens [B, N] (0 after the end), log-probs, lengths, truncated)."""
  response, logprobs = np.asarray(plain.tokens)[:, 8:], np.asarray(plain.logprobs)[:, 8:]
  is_stop = response == stop
  first = np.where(is_stop.any(1), is_stop.argmax(1) + 1, response.shape[1] + 1)
  lengths = np.minimum(first, np.asarray(limits))
  valid = np.arange(response.shape[1])[None, :] < lengths[:, None]
  return np.where(valid, response, 0), np.where(valid, logprobs, 0.0), lengths, ~(first <= lengths)


@pytest.mark.parametrize("method,max_steps", [("ngram", 2), pytest.param("draft", 0, marks=pytest.mark.slow)])
def test_engine_greedy_speculation_equals_plain_decoding(method, max_steps):
  """3 slots for 8 samples (refills mid-loop), a stop token and per-sample length limits: the engine
  speculating gives plain greedy decoding's tokens (the static rollout's, cut where the stop token and
  the limits end each sample, as the plain engine cuts them: tests/rl/test_engine.py). ngram runs as
  partial rollouts: 2 iterations per call, carried samples re-prefilled and resumed."""
  _, draft = _models()
  plain = _plain()
  # The stop token: the most common generated token, so that several samples stop early.
  stop = int(np.bincount(np.asarray(plain.tokens)[:, 8:].reshape(-1), minlength=VOCAB)[1:].argmax() + 1)
  limits = jnp.array([12, 5, 9, 12, 1, 12, 7, 3], jnp.int32)
  tokens, logprobs, lengths, truncated = _expected(plain, stop, limits)
  assert (~truncated).any() and (lengths < np.asarray(limits)).any()  # someone stopped early
  out, calls = _engine_fn(method, dataclasses.replace(GREEDY, stop_tokens=(stop,)), max_steps=max_steps)(
      _draft_params(draft), jax.random.key(0), limits)
  assert (len(calls) > 2) == (max_steps > 0)
  metrics = jax.tree.map(lambda *x: sum(x), *calls)  # counts summed over the calls
  np.testing.assert_array_equal(np.asarray(out.tokens)[:, 8:], tokens)
  np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
  np.testing.assert_array_equal(np.asarray(out.truncated), truncated)
  np.testing.assert_allclose(np.asarray(out.logprobs)[:, 8:], logprobs, atol=1e-4)
  valid = np.arange(12)[None, :] < lengths[:, None]
  np.testing.assert_array_equal(np.asarray(out.response_mask)[:, 8:], valid)
  np.testing.assert_array_equal(np.asarray(out.policy_version)[:, 8:], np.where(valid, 0, -1))
  assert int(metrics.accepted) > 0 and int(metrics.row_accepted.sum()) == int(metrics.accepted)
  # Each verification forward of a slot commits 1 .. k+1 tokens; a sample's first token (and the first
  # after a resume) is drawn from the prefill's logits, not verified.
  assert 1.0 <= float(calls[0].tokens_per_forward) <= 4.0
  forwards = int(metrics.proposed) // 3
  assert forwards + int(metrics.accepted) <= int(np.sum(lengths))


@pytest.mark.slow  # ~25 s; the greedy engine test above stays in the default run
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_sampled_speculation_draws_the_static_speculative_samples(method):
  """T = 1: a sample's tokens depend only on (its id, t), so the engine on 3 slots draws exactly the
  static speculative rollout's samples, whose distribution is the target's (the slow end-to-end test
  and the rejection-sampling test above)."""
  _, draft = _models(small=True)
  spec = dataclasses.replace(GREEDY, sampler=Sampler(1.0))
  key = jax.random.key(4)
  static, _, _ = _spec_fn(method, spec, small=True)(_draft_params(draft), key)
  out, (metrics,) = _engine_fn(method, spec, small=True)(_draft_params(draft), key,
                                                         jnp.full((8,), 12, jnp.int32))
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(static.tokens))
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(static.logprobs), atol=1e-4)
  assert 0.0 < float(metrics.acceptance_rate) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 16])
def test_rl_step_reports_the_engines_acceptance(budget):
  """The run's own step on the continuous engine speculating (n-gram), with and without partial
  rollouts: finite loss, and the step's metrics carry the engine's acceptance figures."""
  from meshrl.rl import loop  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step import rl_step  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", [
      "rl.sft_steps=0", "rl.prompts_per_step=4", "rl.group_size=4", "rl.num_minibatches=1",
      "rl.max_new_tokens=8", "rl.engine=continuous", "rl.decode_slots=8", "rl.speculative=ngram",
      "rl.speculative_k=2", "rl.ngram_n=1", f"rl.rollout_token_budget={budget}", "rl.max_resample_rounds=0"])
  run, prompts = loop.setup(cfg)
  for step in range(2):
    metrics = rl_step(run, prompts, jax.random.key(step))
    assert np.isfinite(metrics["loss"]), metrics
    assert 0.0 <= metrics["spec_acceptance_rate"] <= 1.0 and metrics["spec_tokens_per_forward"] >= 1.0
  run.close()
