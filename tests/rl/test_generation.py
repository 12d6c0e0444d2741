"""The one generation engine (rl/generation/): the golden test (every scheduler x proposer gives the
same samples, token for token, greedy and sampled), prefix sharing, the train state read in place,
the generation layouts, slot refills, partial rollouts carried across calls, the proposers' pieces,
and bad settings named."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import kv_cache as kvc
from meshrl.model.init import build_model
from meshrl.model.layers import RopeConfig
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig, Transformer
from meshrl.rl.step import driver as loop
from meshrl.rl.algo.distill import DistillConfig, distill
from meshrl.rl.generation import core
from meshrl.rl.generation.core import StepConfig
from meshrl.rl.generation.generator import Generator
from meshrl.rl.generation.proposers import ProposerSpec, ngram_propose
from meshrl.rl.generation.sampling import RowSampling, Sampler, first_max_index
from meshrl.rl.generation.spec import GenerationSpec
from meshrl.rl.step.partial import PartialRollouts
from meshrl.rl.step.spec import check_generation, make_generator, rollout_model_config
from meshrl.rl.step.program import rl_step
from meshrl.sharding import make_mesh
from meshrl.train.metrics import CompileCounter
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
PROMPT_LEN, NEW = 8, 6
SMALL = ["model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
         "moe.expert_mlp_dim=32", f"rl.max_prompt_len={PROMPT_LEN}", f"rl.max_new_tokens={NEW}",
         "model.max_seq_len=24", "model.init_std=0.5"]
# Prompts of different lengths, so a slot's previous occupant would be visible if its row survived.
TEXTS = ["1+2=", "rev abcd=", "x", "sort 9 1 5="]
FIELDS = ("tokens", "positions", "segment_ids", "prompt_mask", "response_mask", "lengths", "truncated",
          "policy_version", "routing")
STOPS = "rl.stop_tokens=173,247"  # ids this model (seeded init) samples often: samples end at many steps
LIMITS = np.array([6, 1, 3, 6, 2, 5, 4, 6, 6, 2, 1, 5], np.int32)  # per-sample length limits


@functools.cache
def _setup(*extra, on_mesh=False):
  cfg = configs.load("configs/tiny.py", SMALL + list(extra))
  mesh = make_mesh(cfg.mesh) if on_mesh else None
  model = build_model(ModelConfig.from_config(cfg, mesh), mesh)
  graphdef, state = create_train_state(model, make_optimizer(cfg.optim), mesh)
  return cfg, mesh, graphdef, state


def _generator(cfg, mesh=None, **kw):
  return make_generator(cfg, mesh, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, **kw)


def _prompts(texts=TEXTS, length=PROMPT_LEN):
  return TOK.encode_batch(texts, length=length, padding="left")


def _assert_same_samples(a, b):
  for field in FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), err_msg=field)
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-4)


def _draft():
  """A draft for the tiny config's vocabulary: a 1-layer dense model, and its params."""
  draft_cfg = configs.load("configs/tiny.py", SMALL + ["moe.num_experts=0", "model.num_layers=1",
                                                       "model.embed_dim=32"])
  draft = build_model(ModelConfig.from_config(draft_cfg, None), None, seed=5)
  return draft.config, nnx.split(draft, nnx.Param, ...)[1]


# --- the golden test --------------------------------------------------------------------------------

CASES = {  # scheduler x proposer, as a run configures them
    "static": [],
    "continuous": ["rl.engine=continuous", "rl.decode_slots=5"],
    "static+ngram": ["rl.speculative=ngram", "rl.speculative_k=3", "rl.ngram_n=1"],
    "continuous+ngram": ["rl.engine=continuous", "rl.decode_slots=5", "rl.speculative=ngram", "rl.ngram_n=1"],
    "static+draft": ["rl.speculative=draft", "rl.speculative_k=2"],
    "continuous+draft": ["rl.engine=continuous", "rl.decode_slots=4", "rl.speculative=draft", "rl.speculative_k=3"],
    "continuous+scan": ["rl.engine=continuous", "rl.decode_slots=5", "model.decode_layers=scan"],
}


# T > 0 (the proposers' rejection sampling kept to the target distribution) runs with the slow tests: the
# greedy case drives every scheduler x proposer through the same code, and the T > 0 draws are checked by
# test_partial_rollouts_with_unchanged_params_give_the_static_samples and the server's speculative tests.
# The default run drives both schedulers and both proposers (continuous, static+draft, continuous+ngram);
# the slow run every pair.
FAST_CASES = ("continuous", "static+draft", "continuous+ngram")


@pytest.mark.parametrize("temperature, cases", [(0.0, FAST_CASES), pytest.param(0.0, tuple(CASES), marks=pytest.mark.slow),
                                                pytest.param(0.7, tuple(CASES), marks=pytest.mark.slow)])
def test_every_scheduler_and_proposer_gives_the_same_samples(temperature, cases):
  """4 prompts x G=3 with stop tokens and per-sample length limits, a MoE policy: every scheduler
  (static, continuous on 5 slots: 7 refills) x proposer (none, n-gram, a random draft) gives the
  static rollout's samples field by field (tokens, masks, positions, log-probs, MoE routes, versions),
  greedy and sampled: a proposal is accepted only where it is the target's own draw with its key."""
  base = (f"rl.temperature={temperature}", "rl.group_size=3", STOPS)
  cfg, _, _, state = _setup(*base)
  tokens, mask = _prompts()
  key = jax.random.key(7)
  want = _generator(cfg)(state.params, state.extra, tokens, mask, key, LIMITS, 3)
  lengths, stopped = np.asarray(want.lengths), ~np.asarray(want.truncated)
  assert len(set(lengths.tolist())) >= 3 and stopped.sum() >= 2 and (lengths == LIMITS).sum() >= 2
  assert (np.asarray(want.policy_version)[np.asarray(want.response_mask)] == 3).all()
  draft = _draft()
  accepted = {}
  for name in cases:
    extra = CASES[name]
    case_cfg = configs.load("configs/tiny.py", SMALL + list(base) + extra)
    gen = _generator(case_cfg, draft=draft if "draft" in name else None)
    got = gen(state.params, state.extra, tokens, mask, key, LIMITS, 3)
    _assert_same_samples(want, got)
    accepted[name] = float(gen.metrics["tokens_per_forward"])
  assert accepted["static+draft"] >= 1.0 and accepted["continuous"] == 1.0


def test_a_draft_equal_to_the_target_accepts_every_proposal_when_sampling():
  """Coupled draws: a draft that IS the target proposes exactly what the target draws at T=0.7, so
  every proposal inside a sample's budget is accepted (k+1 tokens per forward until the end)."""
  cfg, _, _, state = _setup("rl.temperature=0.7", "rl.group_size=2", "rl.speculative=draft", "rl.speculative_k=3",
                            "rl.stop_tokens=")
  tokens, mask = _prompts(TEXTS[:2])
  gen = _generator(cfg, draft=(rollout_model_config(cfg, None), state.params))
  gen(state.params, state.extra, tokens, mask, jax.random.key(1))
  assert float(gen.metrics["acceptance_rate"]) > 0.6  # the misses are proposals past the 6-token budget
  assert float(gen.metrics["tokens_per_forward"]) > 2.5


def test_greedy_rollout_equals_argmax_with_full_forward():
  cfg, mesh, graphdef, state = _setup("rl.temperature=0.0", "rl.group_size=2")
  tokens, mask = _prompts(["1+2=", "33+4="])
  out = _generator(cfg)(state.params, state.extra, tokens, mask, jax.random.key(0))
  model = nnx.merge(graphdef, state.params, state.extra)
  width = PROMPT_LEN + NEW
  last_logits = jax.jit(lambda buf, n: model(buf).logits[0, n - 1])
  for row in range(2):
    seq = [int(t) for t, m in zip(tokens[row], mask[row]) if m]
    for _ in range(NEW):
      buffer = jnp.asarray([seq + [TOK.pad_id] * (width - len(seq))])
      seq.append(int(jnp.argmax(last_logits(buffer, len(seq)))))
      if seq[-1] == TOK.eos_id:
        break
    generated = seq[int(mask[row].sum()):]
    for sample in (2 * row, 2 * row + 1):
      assert np.asarray(out.tokens[sample, PROMPT_LEN:PROMPT_LEN + len(generated)]).tolist() == generated
      assert int(out.lengths[sample]) == len(generated)
  del mesh


def test_group_prefix_sharing_matches_no_sharing():
  cfg, _, _, state = _setup("rl.group_size=4")
  cfg1 = configs.load("configs/tiny.py", SMALL + ["rl.group_size=1"])
  tokens, mask = _prompts(["12+7=", "sort 31="])
  key = jax.random.key(3)
  a = _generator(cfg)(state.params, state.extra, tokens, mask, key)
  b = _generator(cfg1)(state.params, state.extra, np.repeat(tokens, 4, 0), np.repeat(mask, 4, 0), key)
  _assert_same_samples(a, b)
  assert len(set(map(tuple, np.asarray(a.tokens[:4, PROMPT_LEN:]).tolist()))) > 1  # samples differ


def test_rollout_outputs_are_consistent():
  cfg, _, _, state = _setup("rl.group_size=3", "rl.top_k=20", "rl.top_p=0.9")
  out = _generator(cfg)(state.params, state.extra, *_prompts(["1+1=", "22-3=", "copy ab="]), jax.random.key(1))
  response = np.asarray(out.response_mask)
  assert response.shape == (9, 14) and not response[:, :PROMPT_LEN].any()
  np.testing.assert_array_equal(response.sum(1), np.asarray(out.lengths))
  assert (np.asarray(out.logprobs)[response] < 0).all() and (np.asarray(out.logprobs)[~response] == 0).all()
  ended = np.asarray(out.tokens)[np.arange(9), PROMPT_LEN - 1 + np.asarray(out.lengths)] == TOK.eos_id
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


def test_the_draw_is_jax_categoricals_and_its_first_maximum_is_argmax():
  """Sampler.draw takes the maximum of the perturbed logits by `first_max_index` (two plain
  reductions, where XLA's CPU argmax runs element by element): the token is jax.random.categorical's
  with the same key at every setting, and `first_max_index` is jnp.argmax on ties, -inf and NaN."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((12, 37)).astype(np.float32)
  x[0] = 1.0  # all tied: the first
  x[1, [4, 30]] = 50.0  # two maxima: the first
  x[2] = -np.inf
  x[3, [9, 21]] = np.nan  # argmax takes the first NaN
  x[4] = np.nan
  x[5, :3] = -np.inf
  x[5, 36] = 9.0
  for rows in (x, x.reshape(3, 4, 37)):  # [R, V] and [R, W, V]
    np.testing.assert_array_equal(first_max_index(jnp.asarray(rows)), jnp.argmax(jnp.asarray(rows), axis=-1))
  logits = jnp.asarray(rng.standard_normal((64, 259)).astype(np.float32) * 3)
  keys = jax.random.split(jax.random.key(3), 64)
  row_sampling = RowSampling(temperature=jnp.asarray(rng.uniform(0.2, 1.5, 64), jnp.float32),
                             top_p=jnp.asarray(rng.uniform(0.3, 1.0, 64), jnp.float32))
  for sampler, rows in ((Sampler(0.7), None), (Sampler(1.0, top_k=5), None), (Sampler(1.3, top_p=0.8), None),
                        (Sampler(per_row=True), row_sampling)):
    perturbed = sampler._filtered(sampler.scaled(logits, rows), rows)  # pylint: disable=protected-access
    expected = jax.vmap(jax.random.categorical)(keys, perturbed)
    drawn = sampler.draw(logits, keys, rows)
    np.testing.assert_array_equal(drawn, expected)
    assert len(set(np.asarray(drawn).tolist())) > 8  # drawn, not the argmax of every row


def test_unrolled_decode_gives_the_scanned_samples_and_scans_less():
  """model.decode_layers=unrolled (per-layer weights and caches taken once per decode loop; `auto`'s
  choice on CPU) gives every field of the scanned blocks' samples, and its program scans the blocks
  in the prefill only."""
  key = jax.random.key(7)
  outs, scans = {}, {}
  tokens, mask = _prompts()
  for mode in ("scan", "unrolled"):
    cfg, _, _, state = _setup("rl.group_size=3", STOPS, f"model.decode_layers={mode}")
    gen = _generator(cfg)
    outs[mode] = gen(state.params, state.extra, tokens, mask, key, LIMITS, 3)
    scans[mode] = gen.lower(state.params, state.extra, tokens, mask, key, LIMITS, 3).as_text().count("while")
  _assert_same_samples(outs["scan"], outs["unrolled"])
  assert scans["scan"] > scans["unrolled"], scans  # the decode step's stacks are scanned
  assert ModelConfig.from_config(cfg, None).unrolled_decode == (jax.default_backend() == "cpu")


def test_rollout_reads_the_train_state_arrays_without_copy(devices):
  cfg, mesh, _, state = _setup("rl.group_size=2", "rl.prompts_per_step=4", "mesh.fsdp=2", "mesh.expert=2",
                               "mesh.tensor=2", on_mesh=True)
  gen = _generator(cfg, mesh)
  tokens, mask = _prompts(["1+2=", "3+4=", "5+6=", "7+8="])

  def pointers_of(params):
    return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(params) for s in x.addressable_shards]
  pointers = pointers_of(state.params)
  compiled = gen.lower(state.params, state.extra, tokens, mask, jax.random.key(0)).compile()
  for want, got in zip(jax.tree.leaves(state.params), jax.tree.leaves(compiled.input_shardings[0][0])):
    assert got.is_equivalent_to(want.sharding, want.ndim)  # taken in place: no reshard on entry
  gen(state.params, state.extra, tokens, mask, jax.random.key(0))
  assert pointers_of(state.params) == pointers
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state.params))


def test_gathered_layout_and_int8_weights_reach_every_scheduler(devices):
  """rl.generation_layout=gathered: a copy of the weights split over tensor/expert only (none over
  fsdp), the greedy rollout the train-layout one, in the static and the continuous scheduler; int8
  weights on top of it are int8 in that layout."""
  over = ("rl.group_size=1", "rl.prompts_per_step=4", "rl.temperature=0.0", "rl.tis_level=token",
          "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
  cfg, mesh, _, state = _setup(*over, on_mesh=True)
  tokens, mask = _prompts(["1+2=", "3+4=", "5+6=", "7+8="])
  want = _generator(cfg, mesh)(state.params, state.extra, tokens, mask, jax.random.key(0))
  axes = lambda s: {a for e in s.spec if e for a in (e if isinstance(e, tuple) else (e,))}  # noqa: E731
  for extra in ([], ["rl.engine=continuous", "rl.decode_slots=4"]):
    gathered = _generator(configs.load("configs/tiny.py", SMALL + list(over) + extra
                                       + ["rl.generation_layout=gathered"]), mesh)
    weights = gathered.prepare(state.params)
    gen_axes = set().union(*(axes(x.sharding) for x in jax.tree.leaves(weights)))
    assert gen_axes and "fsdp" not in gen_axes and gen_axes <= {"tensor", "expert"}
    _assert_same_samples(want, gathered(state.params, state.extra, tokens, mask, jax.random.key(0)))
  both = _generator(configs.load("configs/tiny.py", SMALL + list(over) + ["rl.generation_layout=gathered",
                                                                          "rl.generation_weights=int8"]), mesh)
  int8 = [x for x in jax.tree.leaves(both.prepare(state.params)) if x.dtype == jnp.int8]
  assert int8 and all("fsdp" not in axes(x.sharding) for x in int8)


def test_slot_refill_replaces_the_whole_cache_row():
  """copy_rows puts the source row in whole (entries, positions, segments, index): nothing of the
  slot's previous occupant (written past the new prompt) survives, and untouched slots stay."""
  shapes = {"dense": {"k": (2, 2, 4), "v": (2, 2, 4)}}
  src = kvc.with_row_index(kvc.init_cache(shapes, 2, 10))
  src = src.replace(layers=jax.tree.map(lambda a: a.at[:, :, :3].set(1.0), src.layers),
                    positions=src.positions.at[:, :3].set(jnp.arange(3)),
                    segment_ids=src.segment_ids.at[:, :3].set(1), index=jnp.full((2,), 3, jnp.int32))
  old = kvc.with_row_index(kvc.init_cache(shapes, 3, 10))
  old = old.replace(layers=jax.tree.map(lambda a: a + 7.0, old.layers), positions=old.positions * 0 + 5,
                    segment_ids=old.segment_ids * 0 + 1, index=jnp.full((3,), 9, jnp.int32))
  new = kvc.copy_rows(old, src, jnp.asarray([1, 0, 0]), jnp.asarray([True, False, True]))
  for row, source in ((0, 1), (2, 0)):
    np.testing.assert_array_equal(np.asarray(new.positions[row]), np.asarray(src.positions[source]))
    np.testing.assert_array_equal(np.asarray(new.layers["dense"]["k"][:, row]),
                                  np.asarray(src.layers["dense"]["k"][:, source]))
    assert int(new.index[row]) == 3 and (np.asarray(new.positions[row, 3:]) == kvc.EMPTY_POSITION).all()
  np.testing.assert_array_equal(np.asarray(new.layers["dense"]["v"][:, 1]), np.asarray(old.layers["dense"]["v"][:, 1]))
  assert int(new.index[1]) == 9


# --- partial rollouts (the budgeted scheduler) -------------------------------------------------------


def _draw_from(texts):
  counter = iter(range(1000))

  def draw(count):
    ids = [next(counter) for _ in range(count)]
    tokens, mask = TOK.encode_batch([texts[i % len(texts)] for i in ids], length=PROMPT_LEN, padding="left")
    return ids, tokens, mask
  return draw


def _perturbed(params, version):
  return jax.tree.map(lambda p: p * (1.0 + 0.05 * version), params)


PARTIAL = ("rl.group_size=2", "rl.prompts_per_step=3", "rl.engine=continuous", "rl.max_resample_rounds=0")


def test_partial_rollouts_carry_masks_positions_logprobs_and_versions():
  """3 groups of 2 on 4 slots, 2 decode steps per RL step, params changed after every step: each
  ended sample's masks and positions are those of one rollout, each token's log-prob equals a fresh
  forward of the finished sequence under the params of the version recorded for it, and samples
  that ran across steps carry several versions. New groups are placed by one program whatever their
  count (a compile per count of free group slots in mid-run otherwise)."""
  cfg, _, graphdef, state = _setup(*PARTIAL, "rl.decode_slots=4", "rl.rollout_token_budget=8")
  partial = PartialRollouts(_generator(cfg), cfg.rl.prompts_per_step)
  draw, key = _draw_from(TEXTS), jax.random.key(3)
  ended, admitted = [], set()
  with CompileCounter() as compiles:
    for version in range(5):
      arrays, examples, info = partial.step(_perturbed(state.params, version), state.extra, draw,
                                            jax.random.fold_in(key, version), version)
      assert info["groups_ended"] == len(examples) and arrays["tokens"].shape[0] == 2 * len(examples)
      assert info["groups_ended"] + info["groups_carried"] == 3
      admitted.add(info["groups_admitted"])
      host = {k: v.to_host() if hasattr(v, "to_host") else v for k, v in arrays.items()}
      ended += [{k: v[i] for k, v in host.items()} for i in range(arrays["tokens"].shape[0])]
  assert len(ended) >= 4
  assert len(admitted - {0}) >= 2 and compiles.count("_placed") == 1, (admitted, dict(compiles.by_function))
  sampler = Sampler(cfg.rl.temperature)
  forward = jax.jit(lambda params, t, p, s: nnx.merge(graphdef, params, state.extra)(
      t[None], positions=p[None], segment_ids=s[None]).logits[0])
  multi = 0
  for sample in ended:
    response, length = sample["response_mask"], int(sample["lengths"])
    assert response[PROMPT_LEN:PROMPT_LEN + length].all() and response.sum() == length
    assert not sample["prompt_mask"][PROMPT_LEN:].any() and not response[:PROMPT_LEN].any()
    np.testing.assert_array_equal(sample["positions"][PROMPT_LEN:PROMPT_LEN + length],
                                  int(sample["prompt_mask"].sum()) + np.arange(length))
    versions = sample["policy_version"][PROMPT_LEN:PROMPT_LEN + length]
    assert (np.diff(versions) >= 0).all() and (sample["policy_version"][~response] == -1).all()
    multi += len(set(versions.tolist())) > 1
    for version in sorted(set(versions.tolist())):
      logits = forward(_perturbed(state.params, version), sample["tokens"], sample["positions"],
                       sample["segment_ids"])
      columns = PROMPT_LEN + np.flatnonzero(versions == version)
      want = sampler.log_probs(logits[columns - 1], jnp.asarray(sample["tokens"][columns]))
      np.testing.assert_allclose(sample["logprobs"][columns], np.asarray(want), atol=2e-4)
  assert multi >= 2  # segments under different params really happened


def test_partial_groups_from_device_prompts_are_placed_as_host_ones():
  """Prompts already on the devices (several hosts' global array, placed at their own count) give the
  pool of host prompts (padded to every group slot): same rows, keys and prompts; the failed sample
  of the first new group starts ended, and the untouched group slot stays blank."""
  cfg, _, _, _ = _setup(*PARTIAL, "rl.decode_slots=4", "rl.rollout_token_budget=8")
  tokens, mask = _prompts(TEXTS[:2])
  placed = []
  for as_array in (np.asarray, jnp.asarray):
    partial = PartialRollouts(_generator(cfg), cfg.rl.prompts_per_step)
    place = partial._place  # pylint: disable=protected-access
    place(np.array([2, 0]), ["a", "b"], as_array(tokens), as_array(mask), jax.random.key(5), failed=[1])
    placed.append(jax.device_get((partial.pool, partial.prompts, partial.prompt_mask)))
  jax.tree.map(np.testing.assert_array_equal, *placed)
  pool, prompts, _ = placed[0]
  np.testing.assert_array_equal(pool.done, [False, False, True, True, False, True])  # slot 2: rows 4, 5
  np.testing.assert_array_equal(prompts[[2, 0]], tokens)


def test_carried_pool_meets_the_layout_the_budgeted_program_was_compiled_for(devices):
  """On a split mesh, partial rollouts' blank pool and prompts, and the pool restored from a
  checkpoint, are replicated as the budgeted program returns them, so it compiles once over the
  steps (three times before: uncommitted arrays on the first call, replicated pool next, replicated
  prompts after). The slot engine's fresh slots and counters: tests/rl/test_multiturn_compose.py."""
  cfg, mesh, _, state = _setup(*PARTIAL, "rl.decode_slots=4", "rl.rollout_token_budget=8", "mesh.fsdp=4",
                               "mesh.tensor=2", on_mesh=True)
  draw, key = _draw_from(TEXTS), jax.random.key(3)
  partial = PartialRollouts(_generator(cfg, mesh), cfg.rl.prompts_per_step)
  with CompileCounter() as compiles:
    for version in range(3):
      partial.step(state.params, state.extra, draw, jax.random.fold_in(key, version), version)
  assert compiles.count("_run_pool") == 1 and compiles.count("_placed") == 1, dict(compiles.by_function)
  saved = json.loads(json.dumps(partial.get_state()))  # through the checkpoint's JSON into a new instance
  partial = PartialRollouts(partial.generator, cfg.rl.prompts_per_step)
  partial.set_state(saved)
  with CompileCounter() as compiles:
    partial.step(state.params, state.extra, draw, jax.random.fold_in(key, 3), 3)
  assert compiles.count("_run_pool") == 0, dict(compiles.by_function)  # the generator's program, as it was


# The n-gram proposer under the budgeted scheduler: the golden test drives it greedy; here at T > 0 in the slow run.
@pytest.mark.parametrize("proposer", [[], pytest.param(["rl.speculative=ngram", "rl.ngram_n=1"], marks=pytest.mark.slow)])
def test_partial_rollouts_with_unchanged_params_give_the_static_samples(proposer):
  """Carrying (re-prefilling prompt + generated-so-far) loses nothing: with the params unchanged
  across steps, the groups end as the static rollout drew them, speculating or not, even when the
  carried state goes through the checkpoint's JSON (get_state -> set_state on a new instance)."""
  cfg, _, _, state = _setup(*PARTIAL, "rl.decode_slots=2", "rl.rollout_token_budget=4", *proposer)
  partial = PartialRollouts(_generator(cfg), 3)
  draw, key = _draw_from(TEXTS[:3]), jax.random.key(5)
  rows = {}
  for step in range(14):
    if step == 2:  # a new instance (on the same generator: its compiled program kept)
      saved = json.loads(json.dumps(partial.get_state()))
      partial = PartialRollouts(partial.generator, 3)
      partial.set_state(saved)
    arrays, examples, _ = partial.step(state.params, state.extra, draw, jax.random.fold_in(key, step), step)
    host = {k: v.to_host() if hasattr(v, "to_host") else v for k, v in arrays.items() if k != "routing"}
    for i, example in enumerate(examples):
      rows[example] = {k: v[2 * i:2 * i + 2] for k, v in host.items()}
    if all(e in rows for e in range(3)):
      break
  static_cfg = configs.load("configs/tiny.py", SMALL + ["rl.group_size=2"])
  tokens, mask = _prompts(TEXTS[:3])
  static = _generator(static_cfg)(state.params, state.extra, tokens, mask, jax.random.fold_in(key, 0))
  for example in range(3):
    group = slice(2 * example, 2 * example + 2)
    for field in FIELDS[:-2]:
      np.testing.assert_array_equal(rows[example][field], np.asarray(getattr(static, field))[group], err_msg=field)
    np.testing.assert_allclose(rows[example]["logprobs"], np.asarray(static.logprobs)[group], atol=1e-4)
  assert any(len(set(r["policy_version"][r["response_mask"]].tolist())) > 1 for r in rows.values())


# --- the proposers' pieces ----------------------------------------------------------------------------

VOCAB = 32


def _mc(layers, width, vocab=VOCAB, std=0.5, max_len=40):
  return ModelConfig(vocab_size=vocab, num_layers=layers, embed_dim=width, num_heads=2, num_kv_heads=1,
                     head_dim=width // 2, mlp_dim=2 * width, max_seq_len=max_len,
                     rope=RopeConfig(head_dim=width // 2), init_std=std)


def test_rollback_forgets_rejected_columns():
  target = Transformer(_mc(1, 32), rngs=nnx.Rngs(0))
  prompt = jnp.array([[5, 6, 7, 8]], jnp.int32)

  @jax.jit
  def far_logits(extra_tokens, keep):
    cache = kvc.with_row_index(target(prompt, cache=target.init_cache(1, 16)).cache)
    cache = target(extra_tokens, positions=4 + jnp.arange(extra_tokens.shape[1])[None], cache=cache).cache
    cache = core.rollback(cache, jnp.array([keep], jnp.int32))
    return target(jnp.array([[3]]), positions=jnp.array([[12]]), cache=cache).logits[0, 0]

  rolled = far_logits(jnp.array([[9, 10, 11, 12]], jnp.int32), 5)  # kept: prompt + token 9
  clean = far_logits(jnp.array([[9]], jnp.int32), 5)
  np.testing.assert_allclose(np.asarray(rolled), np.asarray(clean), atol=1e-5)
  stale = far_logits(jnp.array([[9, 10, 11, 12]], jnp.int32), 8)  # nothing forgotten
  assert float(jnp.max(jnp.abs(stale - clean))) > 1e-3


def test_ngram_propose_finds_the_latest_occurrence():
  history = jnp.array([[-1, 1, 2, 3, 1, 2, 4, 5, 1, 2, 0, 0], [7, 8, 9, 7, 8, 9, 7, 8, 0, 0, 0, 0]], jnp.int32)
  propose = jax.jit(ngram_propose, static_argnums=(2, 3))
  got = propose(history, jnp.array([10, 8]), 2, 3)
  np.testing.assert_array_equal(np.asarray(got), [[4, 5, 1], [9, 7, 8]])
  none = propose(history, jnp.array([3, 2]), 2, 3)[:, :2]  # no earlier occurrence
  np.testing.assert_array_equal(np.asarray(none), [[0, 0], [0, 0]])


PROMPTS = jnp.array([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 3, 4, 5, 3, 4], [0, 9, 9, 1, 2, 9, 1, 2],
                     [0, 0, 0, 0, 11, 12, 13, 11]], jnp.int32)


def _plain_generator(mc, proposer=ProposerSpec(), draft=None, scheduler="static", slots=0):
  step = StepConfig(sampler=Sampler(0.0), stop_tokens=(), pad_id=0, proposer=proposer)
  spec = GenerationSpec(step=step, group_size=2, prompt_len=8, max_new_tokens=12, scheduler=scheduler, slots=slots)
  return Generator(spec, mc, draft=draft)


def test_distillation_raises_acceptance_and_output_stays_identical():
  """A random draft is mostly rejected, yet the output equals plain decoding; distilled on the
  target's own completions, it is accepted far more often, the output still identical."""
  target = Transformer(_mc(2, 64), rngs=nnx.Rngs(0))
  draft = Transformer(_mc(1, 32), rngs=nnx.Rngs(7))
  _, params, extra = nnx.split(target, nnx.Param, ...)
  mask = PROMPTS != 0
  plain = _plain_generator(target.config)(params, extra, PROMPTS, mask, jax.random.key(0))
  draft_params = lambda: nnx.split(draft, nnx.Param, ...)[1]  # noqa: E731
  proposer = ProposerSpec("draft", k=3)
  before = _plain_generator(target.config, proposer, (draft.config, draft_params()), "continuous", 3)
  out = before(params, extra, PROMPTS, mask, jax.random.key(0))
  _assert_same_samples(plain, out)
  assert float(before.metrics["acceptance_rate"]) < 0.5
  history = distill(target, draft, plain, jax.random.key(1), DistillConfig(steps=40, learning_rate=1e-2))
  assert history[-1]["loss"] < history[0]["loss"]
  after = _plain_generator(target.config, proposer, (draft.config, draft_params()), "continuous", 3)
  _assert_same_samples(plain, after(params, extra, PROMPTS, mask, jax.random.key(0)))
  assert float(after.metrics["acceptance_rate"]) > float(before.metrics["acceptance_rate"]) + 0.2


# --- bad settings ---------------------------------------------------------------------------------------


def test_bad_generation_settings_name_their_fields():
  def cfg(*extra):
    return configs.load("configs/tiny.py", ["rl.prompts_per_step=4", "rl.group_size=4", "rl.max_resample_rounds=0",
                                            "rl.sft_steps=0", *extra])
  for extra, message in [
      (["rl.engine=paged"], "rl.engine='paged'"),
      (["rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=7"],
       "rl.rollout_token_budget=7 is less than one token per decode slot"),
      (["rl.engine=continuous", "rl.rollout_token_budget=15"], "rl.rollout_token_budget=15 is less"),  # 16 slots
      (["rl.decode_slots=4"], "need rl.engine='continuous'"),
      (["rl.engine=continuous", "rl.rollout_token_budget=64", "rl.max_resample_rounds=2"], "rl.max_resample_rounds=0"),
      (["rl.engine=continuous", "rl.decode_slots=-1"], "rl.decode_slots=-1"),
      (["rl.speculative=beam"], "rl.speculative='beam'"),
      (["rl.speculative=ngram", "rl.speculative_k=0"], "rl.speculative_k=0"),
      (["rl.speculative=draft"], "rl.draft_checkpoint"),
      (["rl.speculative=ngram", "rl.speculative_k=41", "rl.max_prompt_len=16", "rl.max_new_tokens=8"],
       r"rl.speculative_k=41 \(the cache's slack past a sample's end\) = 65 exceeds model.max_seq_len=64"),
      (["rl.generation_layout=spread"], "rl.generation_layout='spread'; choose one of train, gathered"),
      (["rl.generation_weights=int4"], "rl.generation_weights='int4'"),
  ]:
    with pytest.raises(ValueError, match=message):
      check_generation(cfg(*extra))
  check_generation(cfg("rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=8"), 8)
  check_generation(cfg("rl.speculative=ngram", "rl.top_k=5", "rl.temperature=0.8"))  # composes now
  with pytest.raises(ValueError, match=r"rl.decode_slots=6 \(6 slots\) is not divisible by the data-parallel "
                                       r"axes data\*fsdp\*expert = 8"):
    loop.check_config(cfg("rl.engine=continuous", "rl.decode_slots=6"), num_devices=8)
  with pytest.raises(ValueError, match=f"vocab_size={VOCAB}.*vocab_size=259"):
    _generator(cfg("rl.speculative=draft", "rl.speculative_k=2"), draft=(_mc(1, 32), None))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["rl.engine=continuous", "rl.decode_slots=8"],
    ["rl.engine=continuous", "rl.decode_slots=8", "rl.rollout_token_budget=16", "rl.speculative=ngram"],
])
def test_rl_step_runs_on_the_engine(extra, devices):
  """The run's own step program with the continuous engine, and with speculating partial rollouts:
  a batch of the fixed shape, finite metrics from every step that updated (at least one must), carried
  groups and the acceptance reported. A step with nothing to update (partial rollouts: no group has
  ended yet) reports its loss as NaN, nothing measured (issue 31), not as a made-up number. Dynamic
  sampling is off: the untrained model's rewards are all 0, and it would drop every group."""
  cfg = configs.load("configs/tiny.py", ["rl.sft_steps=0", "rl.prompts_per_step=4", "rl.group_size=4",
                                         "rl.num_minibatches=1", "rl.max_new_tokens=8", "rl.dynamic_sampling=false",
                                         *extra])
  run, prompts = loop.setup(cfg)
  updated = 0
  for step in range(5):  # 16 slot-steps a call over 8 slots: every sample has ended by the 4th call
    metrics = rl_step(run, prompts, jax.random.key(step))
    if metrics["all_groups_dropped"]:
      assert np.isnan(metrics["loss"]), metrics
    else:
      updated += 1
      assert np.isfinite(metrics["loss"]), metrics
  assert updated >= (1 if cfg.rl.rollout_token_budget else 5), updated
  if cfg.rl.rollout_token_budget:
    assert metrics["groups_ended"] + metrics["groups_carried"] == 4
    assert 1.0 <= metrics["spec_tokens_per_forward"]
  run.close()
