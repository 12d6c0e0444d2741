"""Chunked prefill (rl.prefill_chunk, issue 34 part 4): prompts fed through the engine's "extend rows
at their own index" a chunk at a time equal the one-pass prefill (next-token logits, MoE routes, the
greedy continuation under the static and continuous schedulers; int8 KV; a sharded mesh), other slots
decode between a long prompt's chunks, and a bad chunk names the field."""

import dataclasses
import functools
from unittest import mock

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.configs import checks
from meshrl.model import kv_cache as kvc
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.generation.generator import Generator
from meshrl.rl.generation.prefill import prefill_prompts
from meshrl.rl.generation.sampling import sample_keys
from meshrl.rl.step.spec import make_generator, rollout_model_config
from meshrl.sharding import make_mesh
from meshrl.sharding.rules import rules_from_config
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
PROMPT_LEN, NEW = 10, 5
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW}",
         "model.max_seq_len=24", "model.init_std=0.5", "rl.temperature=0.0", "rl.group_size=2"]
TEXTS = ["a long prompt", "x", "sort 9 1 5", "rev ab"]  # 10 (cut to Lp), 1, 10 and 6 real tokens


@functools.cache
def _setup(*extra):
  cfg = configs.load("configs/tiny.py", SMALL + list(extra))
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, state = create_train_state(model, make_optimizer(cfg.optim), mesh)
  return cfg, mesh, graphdef, state


def _generator(cfg, mesh, chunk: int, **spec):
  base = make_generator(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  return Generator(dataclasses.replace(base.spec, prefill_chunk=chunk, **spec), base.mc, mesh=mesh,
                   rules=rules_from_config(cfg.mesh))


def _prompts(texts=TEXTS):
  tokens, mask = TOK.encode_batch(texts, length=PROMPT_LEN, padding="left")
  return jnp.asarray(tokens), jnp.asarray(mask)


def _prefill_program(cfg, mesh, state):
  gen = _generator(cfg, mesh, 0)

  @functools.partial(jax.jit, static_argnums=(1,))
  def prefill(weights, chunk):
    model = gen._models(weights, state.extra, None).target  # pylint: disable=protected-access
    tokens, mask = _prompts()
    return prefill_prompts(model, tokens, mask, gen.spec.cache_len, chunk)
  return functools.partial(prefill, gen.prepare(state.params))


@pytest.mark.parametrize("kv", ["model", pytest.param("int8", marks=pytest.mark.slow)])  # int8: suite budget
def test_chunked_prefill_equals_one_pass_prefill(kv, devices):
  """On a sharded 8-device mesh (fsdp), with the model's and the int8 KV cache: chunks of 1, 3
  (divides neither the prompt columns nor most prompts), 4 and 9 tokens (longer than two prompts)
  give the one-pass prefill's last-token logits, the routes of every real prompt column, and cache
  entries and positions at the same columns. Catches: a chunk written at the wrong column (a row's
  re-fed last chunk, a row shorter than a chunk), a dropped chunk, positions restarted per chunk,
  routes recorded at the wrong columns."""
  del devices
  cfg, mesh, _, state = _setup(f"rl.kv_cache_dtype={kv}")
  prefill = _prefill_program(cfg, mesh, state)
  cache0, logits0, routes0 = prefill(0)
  real = np.asarray(_prompts()[1], bool)
  for chunk in (1, 3, 4, 9):
    cache, logits, routes = prefill(chunk)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), atol=2e-4, rtol=1e-4, err_msg=f"chunk {chunk}")
    np.testing.assert_array_equal(np.asarray(routes)[:, real], np.asarray(routes0)[:, real], err_msg=f"chunk {chunk}")
    np.testing.assert_array_equal(np.asarray(cache.positions)[:, :PROMPT_LEN][real],
                                  np.asarray(cache0.positions)[:, :PROMPT_LEN][real], err_msg=f"chunk {chunk}")
    assert (np.asarray(cache.positions)[:, PROMPT_LEN:] == np.asarray(cache0.positions)[:, PROMPT_LEN:]).all()
    for stack, entries in cache.layers.items():
      for name, entry in entries.items():  # [L, P, S, ...]: the real prompt columns
        got, want = np.asarray(entry, np.float32), np.asarray(cache0.layers[stack][name], np.float32)
        np.testing.assert_allclose(got[:, :, :PROMPT_LEN][:, real], want[:, :, :PROMPT_LEN][:, real],
                                   atol=1.5 if kv == "int8" and not name.endswith("scale") else 1e-3,
                                   err_msg=f"{name} chunk {chunk}")


@pytest.mark.parametrize("kv, runs", [("model", (("continuous", 3, 3),)), pytest.param("model", (("static", 0, 4),), marks=pytest.mark.slow),
                                      pytest.param("int8", (("continuous", 3, 3),), marks=pytest.mark.slow)])
def test_chunked_prefill_gives_the_one_pass_samples(kv, runs, devices):
  """Greedy rollouts of 4 prompts x 2 samples with chunked prefill equal the one-pass static rollout
  token for token (and its log-probs and prompt routes): static (chunks back to back, 4 tokens) and
  continuous on 3 slots (chunks of 3 between decode steps, samples admitted as their prompts are
  in). Catches a slot admitted before its prompt is in, logits taken before the last chunk, a refill
  from the wrong prompt row."""
  del devices
  cfg, mesh, _, state = _setup(f"rl.kv_cache_dtype={kv}")
  tokens, mask = _prompts()
  real = np.repeat(np.asarray(mask, bool), 2, axis=0)
  key = jax.random.key(3)
  want = _generator(cfg, mesh, 0)(state.params, state.extra, tokens, mask, key)
  for scheduler, slots, chunk in runs:
    got = _generator(cfg, mesh, chunk, scheduler=scheduler, slots=slots)(state.params, state.extra, tokens, mask, key)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens), err_msg=scheduler)
    np.testing.assert_array_equal(np.asarray(got.routing)[:, :, :PROMPT_LEN][:, real],
                                  np.asarray(want.routing)[:, :, :PROMPT_LEN][:, real], err_msg=scheduler)
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-3, err_msg=scheduler)


def test_other_slots_decode_between_a_long_prompts_chunks(devices):
  """A long prompt (10 tokens with BOS, chunks of 2: 5 chunks) beside short ones (2 and 3 tokens), on
  one slot per sample: after 3 loop iterations of the continuous scheduler (a budgeted call: 3 decode
  steps), the short prompts' samples have tokens while the long prompt's have none, its prefill
  still running. Catches a scheduler that waits for every prompt before decoding (chunks that stall
  the other slots), and one that admits a sample before its prompt is in."""
  del devices
  cfg, mesh, _, state = _setup()
  tokens, mask = _prompts(["a long prompt", "x", "ab"])
  num, slots = 3 * 2, 6
  gen = _generator(cfg, mesh, 2, scheduler="budgeted", slots=slots, token_budget=3 * slots)
  pool = gen.new_pool(tokens, mask, sample_keys(jax.random.key(0), jnp.arange(num)))
  pool, _ = gen.run_pool(state.params, state.extra, pool, tokens, mask, 0)
  generated = np.asarray(pool.generated)
  assert (generated[:2] == 0).all() and (generated[2:] >= 1).all(), generated


@pytest.mark.parametrize("chunk", [-1, 2.5, "4", True])
def test_a_bad_chunk_names_the_field(chunk):
  """A negative, fractional, string or boolean rl.prefill_chunk is refused by the config check and by
  the generation spec, naming rl.prefill_chunk; 0 and 7 pass both."""
  with pytest.raises(ValueError, match="rl.prefill_chunk"):
    checks.check_kv_memory(ml_collections.ConfigDict({"rl": {"prefill_chunk": chunk, "kv_host_bytes": 0}}))
  spec = make_generator(configs.load("configs/tiny.py", SMALL), None, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id).spec
  with pytest.raises(ValueError, match="rl.prefill_chunk"):
    dataclasses.replace(spec, prefill_chunk=chunk)
  for good in (0, 7):
    checks.check_kv_memory(ml_collections.ConfigDict({"rl": {"prefill_chunk": good, "kv_host_bytes": 0}}))
    assert dataclasses.replace(spec, prefill_chunk=good).prefill_chunk == good


DRAFT_MARK = 0.125  # the draft's init_std: tells its forwards from the target's (init only; same numbers)


def _draft_setup():
  """The SMALL MoE target with rl.speculative=draft (k=2), and as its draft the target itself under a
  config marked DRAFT_MARK (its config, params): every proposal is the target's own draw, so a draft
  cache that differs from the one-pass one shows in the accepted count."""
  cfg, mesh, _, state = _setup("rl.speculative=draft", "rl.speculative_k=2")
  draft_mc = dataclasses.replace(rollout_model_config(cfg, mesh), init_std=DRAFT_MARK)
  return cfg, mesh, state, (draft_mc, state.params)


def _slot_engine_run(cfg, mesh, state, draft, chunk, widths=None):
  """The host-driven slot engine (episodes, rl/generation/host.py) with rl.prefill_chunk=chunk: its
  prompt prefill rows, and the pool after 4 prompts x 2 samples decode greedily (speculating with the
  draft) to the end. widths: a list the draft's forwards append their token width to while tracing."""
  base = make_generator(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, draft=draft)
  gen = Generator(dataclasses.replace(base.spec, prefill_chunk=chunk), base.mc, mesh=mesh,
                  rules=rules_from_config(cfg.mesh), draft=draft)
  engine = gen.slot_engine(num_slots=8)
  params, draft_params = gen.weights(state.params)
  weights = (params, state.extra, draft_params)
  tokens, mask = _prompts()
  if widths is not None:  # trace the prefill alone, recording what the draft is fed
    draft_call = Transformer.__call__

    def recording(self, tokens, *args, **kw):
      if self.config.init_std == DRAFT_MARK:
        widths.append(tokens.shape[1])
      return draft_call(self, tokens, *args, **kw)
    with mock.patch.object(Transformer, "__call__", recording):
      jax.eval_shape(engine._prefill, weights, tokens, mask)  # pylint: disable=protected-access
  rows = engine.prefill(weights, tokens, mask)
  num = 8
  pool = gen.new_pool(tokens, mask, sample_keys(jax.random.key(1), jnp.arange(num)))
  slots = engine.empty(weights, num, rows[2].shape[-1])
  ids = jnp.arange(num, dtype=jnp.int32)
  slots, pool = engine.admit(weights, slots, pool, rows, ids, ids)
  slots, pool, counters = engine.decode(weights, slots, pool, jnp.int32(0), steps=4 * NEW)
  return rows, pool, counters


def test_the_draft_is_prefilled_in_the_targets_chunks(devices):
  """The slot engine (episodes) with a draft model: with rl.prefill_chunk 3 (three whole chunks and
  a ragged one over the 10 prompt columns; the draft goes through the target's chunk loop) the
  draft's prompt cache (entries at the real prompt columns, positions, write index) and the target's
  logits equal the one-pass prefill's; the greedy speculative samples (tokens, log-probs) and each
  sample's accepted proposals (the draft is the target: most accepted) are the same; and while the
  prefill is traced the draft is fed chunk-wide token blocks only (one pass: the prompt width).
  Catches a draft still prefilled in one pass beside a chunked target (its activations stay P x Lp:
  the widths differ), a draft chunk written at other columns, and a draft cache left at another
  write index."""
  del devices
  cfg, mesh, state, draft = _draft_setup()
  widths0: list[int] = []
  (_, draft0, logits0, _), pool0, counters0 = _slot_engine_run(cfg, mesh, state, draft, 0, widths0)
  assert widths0 == [PROMPT_LEN]
  accepted0 = np.asarray(counters0.row_accepted)
  assert accepted0.sum() >= 8, accepted0  # the target as its own draft: proposals accepted
  real = np.asarray(_prompts()[1], bool)
  for chunk in (3,):  # the target's chunks of 1, 3, 4 and 9: test_chunked_prefill_equals_one_pass_prefill
    widths: list[int] = []
    (_, got, logits, _), pool, counters = _slot_engine_run(cfg, mesh, state, draft, chunk, widths)
    assert widths and set(widths) == {chunk}, (chunk, widths)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), atol=2e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(got.index), np.asarray(draft0.index), err_msg=f"chunk {chunk}")
    np.testing.assert_array_equal(np.asarray(got.positions)[:, :PROMPT_LEN][real],
                                  np.asarray(draft0.positions)[:, :PROMPT_LEN][real], err_msg=f"chunk {chunk}")
    stacked = lambda c: kvc.stack(c) if kvc.is_unstacked(c) else c  # noqa: E731  (entries [L, P, S, ...])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(stacked(got).layers),
                            jax.tree.leaves(stacked(draft0).layers)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      np.testing.assert_allclose(a[:, :, :PROMPT_LEN][:, real], b[:, :, :PROMPT_LEN][:, real], atol=1e-3,
                                 err_msg=f"{jax.tree_util.keystr(path)} chunk {chunk}")
    np.testing.assert_array_equal(np.asarray(pool.tokens), np.asarray(pool0.tokens), err_msg=f"chunk {chunk}")
    np.testing.assert_allclose(np.asarray(pool.logprobs), np.asarray(pool0.logprobs), atol=1e-3)
    np.testing.assert_array_equal(np.asarray(counters.row_accepted), accepted0, err_msg=f"chunk {chunk}")
