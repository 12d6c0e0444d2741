"""Rollout: greedy equals argmax decoding with the full forward; group prefix sharing; no param copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.rollout import make_rollout
from meshrl.rl.sampling import Sampler
from meshrl.sharding import make_mesh
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
         "model.init_std=0.5"]


def _setup(*extra, mesh_overrides=()):
  cfg = configs.load("configs/tiny.py", SMALL + list(extra) + list(mesh_overrides))
  mesh = make_mesh(cfg.mesh)
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, state = create_train_state(model, make_optimizer(cfg.optim), mesh)
  return cfg, mesh, graphdef, state


def _prompts(texts, length=8):
  return TOK.encode_batch(texts, length=length, padding="left")


def test_greedy_rollout_equals_argmax_with_full_forward():
  cfg, mesh, graphdef, state = _setup("rl.temperature=0.0", "rl.group_size=2")
  rollout = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  tokens, mask = _prompts(["1+2=", "33+4="])
  out = rollout(state.params, state.extra, tokens, mask, jax.random.key(0))
  model = nnx.merge(graphdef, state.params, state.extra)
  width = 8 + cfg.rl.max_new_tokens
  # One compiled full forward over a right-padded buffer: causal attention makes the padding
  # invisible to the real positions.
  last_logits = jax.jit(lambda buf, n: model(buf).logits[0, n - 1])
  for row in range(2):
    seq = [int(t) for t, m in zip(tokens[row], mask[row]) if m]
    for _ in range(cfg.rl.max_new_tokens):
      buffer = jnp.asarray([seq + [TOK.pad_id] * (width - len(seq))])
      seq.append(int(jnp.argmax(last_logits(buffer, len(seq)))))
      if seq[-1] == TOK.eos_id:
        break
    generated = seq[int(mask[row].sum()):]
    for sample in (2 * row, 2 * row + 1):
      got = np.asarray(out.tokens[sample, 8:8 + len(generated)]).tolist()
      assert got == generated
      assert int(out.lengths[sample]) == len(generated)


def test_group_prefix_sharing_matches_no_sharing():
  cfg, mesh, _, state = _setup("rl.group_size=4")
  shared = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  cfg1 = configs.load("configs/tiny.py", SMALL + ["rl.group_size=1"])
  unshared = make_rollout(cfg1, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  tokens, mask = _prompts(["12+7=", "sort 31="])
  key = jax.random.key(3)
  a = shared(state.params, state.extra, tokens, mask, key)
  b = unshared(state.params, state.extra, np.repeat(tokens, 4, 0), np.repeat(mask, 4, 0), key)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-4)
  assert len(set(map(tuple, np.asarray(a.tokens[:4, 8:]).tolist()))) > 1  # samples differ in a group


def test_rollout_outputs_are_consistent():
  cfg, mesh, _, state = _setup("rl.group_size=3", "rl.top_k=20", "rl.top_p=0.9")
  out = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)(
      state.params, state.extra, *_prompts(["1+1=", "22-3=", "copy ab="]), jax.random.key(1))
  response = np.asarray(out.response_mask)
  assert response.shape == (9, 14) and not response[:, :8].any()
  np.testing.assert_array_equal(response.sum(1), np.asarray(out.lengths))
  assert (np.asarray(out.logprobs)[response] < 0).all() and (np.asarray(out.logprobs)[~response] == 0).all()
  ended = np.asarray(out.tokens)[np.arange(9), 7 + np.asarray(out.lengths)] == TOK.eos_id
  np.testing.assert_array_equal(~ended, np.asarray(out.truncated))
  assert out.routing.shape[:3] == (1, 9, 14)


def test_top_k_and_top_p_filter():
  logits = jnp.tile(jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]])), (400, 1))  # 400 draws at once
  key = jax.random.key(0)
  assert set(np.asarray(Sampler(1.0, top_k=1)(logits, key)).tolist()) == {0}
  assert set(np.asarray(Sampler(1.0, top_p=0.7)(logits, key)).tolist()) == {0, 1}
  assert set(np.asarray(Sampler(1.0)(logits, key)).tolist()) == {0, 1, 2, 3}
  with pytest.raises(ValueError, match="top_p"):
    Sampler(1.0, top_p=0.0)


def test_rollout_reads_the_train_state_arrays_without_copy(devices):
  cfg, mesh, _, state = _setup("rl.group_size=2", "rl.prompts_per_step=4",
                               mesh_overrides=["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"])
  rollout = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  tokens, mask = _prompts(["1+2=", "3+4=", "5+6=", "7+8="])
  def pointers_of(params):
    return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(params) for s in x.addressable_shards]
  pointers = pointers_of(state.params)
  compiled = rollout.lower(state.params, state.extra, tokens, mask, jax.random.key(0)).compile()
  param_shardings = compiled.input_shardings[0][0]
  for want, got in zip(jax.tree.leaves(state.params), jax.tree.leaves(param_shardings)):
    assert got.is_equivalent_to(want.sharding, want.ndim)  # taken in place: no reshard on entry
  rollout(state.params, state.extra, tokens, mask, jax.random.key(0))
  assert pointers_of(state.params) == pointers
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state.params))


def test_gathered_generation_layout_splits_weights_over_tensor_and_expert_only(devices):
  """rl.generation_layout=gathered: the rollout's program takes a copy of the weights split over
  tensor/expert only (none over fsdp), made once per call; the train state's arrays are untouched and
  the greedy rollout is the train-layout one."""
  over = ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"]
  cfg, mesh, _, state = _setup("rl.group_size=1", "rl.prompts_per_step=4", "rl.temperature=0.0",
                               mesh_overrides=over)
  tokens, mask = _prompts(["1+2=", "3+4=", "5+6=", "7+8="])
  plain = make_rollout(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  gathered_cfg = configs.load("configs/tiny.py", SMALL + ["rl.group_size=1", "rl.prompts_per_step=4",
                                                          "rl.temperature=0.0", "rl.generation_layout=gathered"]
                              + over)
  gathered = make_rollout(gathered_cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
  weights = gathered.prepare(state.params)
  axes = lambda s: {a for e in s.spec if e for a in (e if isinstance(e, tuple) else (e,))}  # noqa: E731
  train_axes = set().union(*(axes(x.sharding) for x in jax.tree.leaves(state.params)))
  gen_axes = set().union(*(axes(x.sharding) for x in jax.tree.leaves(weights)))
  assert "fsdp" in train_axes and "fsdp" not in gen_axes and gen_axes <= {"tensor", "expert"}
  assert gen_axes  # still split over tensor/expert, not replicated everywhere
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(weights), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # a relayout, not a change
  want = plain(state.params, state.extra, tokens, mask, jax.random.key(0))
  got = gathered(state.params, state.extra, tokens, mask, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  with pytest.raises(ValueError, match="rl.generation_layout='spread'; choose one of train, gathered"):
    make_rollout(configs.load("configs/tiny.py", SMALL + ["rl.generation_layout=spread"]), mesh,
                 stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
