"""Chunked prefill (rl.prefill_chunk, issue 34 part 4): prompts fed through the engine's "extend rows
at their own index" a chunk at a time equal the one-pass prefill (next-token logits, MoE routes, the
greedy continuation under the static and continuous schedulers; int8 KV; a sharded mesh), other slots
decode between a long prompt's chunks, and a bad chunk names the field."""

import dataclasses
import functools

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl import configs
from meshrl.configs import checks
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.generation import core
from meshrl.rl.generation.generator import Generator
from meshrl.rl.generation.sampling import sample_keys
from meshrl.rl.step.spec import make_generator
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
    return core.prefill_prompts(model, tokens, mask, gen.spec.cache_len, chunk)
  return functools.partial(prefill, gen.prepare(state.params))


@pytest.mark.parametrize("kv", ["model", "int8"])
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


@pytest.mark.parametrize("kv, runs", [("model", (("continuous", 3, 3),)), ("model", (("static", 0, 4),)),
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
