"""Multi-turn rollout (rl/step/episodes.py): stop strings, observation masking, cache extension = full
re-prefill, budgets, malformed calls, and an update loss blind to observation tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl import configs
from meshrl.model import kv_cache as kvc
from meshrl.model.init import build_model
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.model.transformer import ModelConfig
from meshrl.rl.algo import losses
from meshrl.rl.step import episodes as mt
from meshrl.rl.step import episode_collect as mts
from meshrl.rl.batches.handover import UpdateBatch, align_for_update
from meshrl.rl.envs.base import StepResult
from meshrl.rl.envs.file_tasks import FileTaskEnv, copy_task, oracle_turns
from meshrl.rl.generation.sampling import Sampler
from meshrl.rl.step.spec import episode_runner
from meshrl.rl.batches.rows import DeviceRows
from meshrl.rl.algo.update import rl_loss
from meshrl.sharding import make_mesh
from meshrl.train.optim import make_optimizer
from meshrl.train.state import create_train_state

TOK = ByteTokenizer()
SMALL = ["model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.head_dim=16", "model.mlp_dim=64", "moe.num_experts=0", "rl.max_prompt_len=24",
         "rl.max_new_tokens=72", "model.max_seq_len=112", "rl.max_obs_tokens=16", "model.init_std=0.3",
         "rl.multi_turn=true", "rl.max_turn_tokens=12", "rl.max_turns=3", "rl.group_size=2",
         "rl.prompts_per_step=2", "rl.env_workers=2"]


class ScriptedEnv:
  """Fixed observations, one per turn; reward 1 when the policy says <done>."""

  def __init__(self, observations=("obs-one", "second observation", "x")):
    self.observations, self.turn = list(observations), 0

  def reset(self, task):
    self.turn = 0
    return task["prompt"]

  def step(self, action):
    if "<done>" in action:
      return StepResult("", 1.0, True, {})
    self.turn += 1
    return StepResult(self.observations[(self.turn - 1) % len(self.observations)], 0.0, False, {})


def _host(arrays: dict) -> dict:
  """A rollout's fields as numpy (the per-token ones stay on the devices as DeviceRows)."""
  return {k: v.to_host() if isinstance(v, DeviceRows) else v for k, v in arrays.items()}


def _setup(*extra):
  cfg = configs.load("configs/tiny.py", SMALL + list(extra))
  model = build_model(ModelConfig.from_config(cfg, None), None)
  graphdef, state = create_train_state(model, make_optimizer(cfg.optim), None)
  return cfg, graphdef, state


@pytest.fixture(scope="module")
def scripted():
  """One rollout of 2 prompts x 2 samples against ScriptedEnv with a random tiny model (shared)."""
  cfg, graphdef, state = _setup()
  programs = episode_runner(cfg, None, TOK, make_env=lambda e: ScriptedEnv())
  examples = [{"prompt": "do the thing:", "domain": "a"}, {"prompt": "another task!", "domain": "b"}]
  out = programs.rollout(state.params, state.extra, examples, jax.random.key(1), version=3)
  yield cfg, graphdef, state, programs, out
  programs.close()


def test_response_mask_covers_policy_tokens_only(scripted):
  cfg, _, _, _, out = scripted
  _check_episodes(cfg, out)


def test_episodes_are_written_on_the_devices_split_by_rows():
  """On a mesh the episodes are built on the devices: the per-token fields come back as device rows
  split over the batch axes (data=4: each device holds one of the 4 episodes, no device all of them),
  and they hold the same episodes as the host records."""
  cfg, _, state = _setup("mesh.data=4", "mesh.fsdp=2")
  mesh = make_mesh(cfg.mesh)
  programs = episode_runner(cfg, mesh, TOK, make_env=lambda e: ScriptedEnv())
  examples = [{"prompt": "do the thing:"}, {"prompt": "another task!"}]
  out = programs.rollout(state.params, state.extra, examples, jax.random.key(1), version=3)
  programs.close()
  for name in ("tokens", "positions", "segment_ids", "prompt_mask", "response_mask", "logprobs",
               "policy_version"):
    field = out.arrays[name]
    assert isinstance(field, DeviceRows), name
    (source,) = field.sources
    assert {shard.data.shape[0] for shard in source.addressable_shards} == {1}, name
  _check_episodes(cfg, out)
  a = _host(out.arrays)
  assert out.texts == [TOK.decode(t[cfg.rl.max_prompt_len:][s[cfg.rl.max_prompt_len:] > 0], stop_at_eos=False)
                       for t, s in zip(a["tokens"], a["segment_ids"])]


def _check_episodes(cfg, out):
  """Each row's fields against its host record: policy tokens under the response mask only, with the
  rollout's version and their log-probs; the rendered observations between them; the counts."""
  a, lp = _host(out.arrays), cfg.rl.max_prompt_len
  keep = cfg.rl.max_obs_tokens - len("<out></out>")  # long observations keep their head and the tags
  rendered = [mt.render_observation(o[:keep]) for o in ScriptedEnv().observations]
  for b, episode in enumerate(out.episodes):
    real = a["segment_ids"][b, lp:] > 0
    policy = a["response_mask"][b, lp:]
    assert not (policy & ~real).any()
    assert policy.sum() == episode.policy_tokens > 0
    observed = TOK.decode(a["tokens"][b, lp:][real & ~policy], stop_at_eos=False)
    assert episode.end in ("max_turns", "done")  # (72 tokens hold 3 turns and 2 observations)
    assert observed == "".join(rendered[i % 3] for i in range(episode.turns - 1))
    assert episode.obs_tokens == int((real & ~policy).sum())
    assert (a["policy_version"][b][a["response_mask"][b]] == 3).all()
    assert (a["logprobs"][b][~a["response_mask"][b]] == 0).all()
  # The cache was extended by the observations only: the prompts were prefilled once.
  assert out.counts["prefill_tokens"] == int(a["prompt_mask"][::2].sum())
  assert out.counts["extend_tokens"] == sum(e.obs_tokens for e in out.episodes)


def test_cache_extension_equals_full_reprefill(scripted):
  """The behaviour log-probs of every policy token (turns after observations included) equal those of
  one forward pass over the whole conversation, so the extended cache is the conversation's."""
  cfg, graphdef, state, _, out = scripted
  model = nnx.merge(graphdef, state.params, state.extra)
  a = _host(out.arrays)
  logits = jax.jit(lambda t, p, s: model(t, positions=p, segment_ids=s).logits)(
      jnp.asarray(a["tokens"]), jnp.asarray(a["positions"]), jnp.asarray(a["segment_ids"]))
  full = jax.nn.log_softmax(np.asarray(logits)[:, :-1] / cfg.rl.temperature, axis=-1)
  full = np.take_along_axis(full, a["tokens"][:, 1:, None], axis=-1)[..., 0]
  mask = a["response_mask"][:, 1:]
  np.testing.assert_allclose(a["logprobs"][:, 1:][mask], full[mask], atol=2e-4)
  second_turns = sum(e.turns >= 2 for e in out.episodes)
  assert second_turns > 0  # the comparison covered tokens generated after an extension


def test_turn_budget_ends_episodes(scripted):
  cfg, _, _, _, out = scripted
  for episode in out.episodes:
    assert episode.turns <= cfg.rl.max_turns
    assert episode.end in mt.ENDS
    assert episode.end != "max_turns" or episode.turns == cfg.rl.max_turns


@dataclasses.dataclass
class _FakeOut:
  logits: jax.Array
  cache: kvc.KVCache
  aux: dict = dataclasses.field(default_factory=dict)


class _ScriptModel:
  """Emits script[b, i] as row b's i-th token (one-hot logits), i counted by the cache's row index."""

  def __init__(self, script):
    self.script = jnp.asarray(script)

  def __call__(self, tokens, *, positions, segment_ids, cache, layer_weights=None):
    nxt = jnp.take_along_axis(self.script, jnp.minimum(cache.index + 1, self.script.shape[1] - 1)[:, None],
                              1)[:, 0]
    return _FakeOut(jax.nn.one_hot(nxt, TOK.vocab_size)[:, None] * 50.0, cache.replace(index=cache.index + 1))


def test_stop_strings_and_limits_end_a_turn():
  """The decode core's turn rules: a stop sequence (`</cmd>`, `<done>`) or a stop id ends a turn,
  `</cm>` does not, the turn limit and the episode's limit end it too; every end pauses the sample
  for the host (rl/generation/core.py, pause_on_stop), a stop marked as such."""
  from meshrl.rl.generation import core  # pylint: disable=import-outside-toplevel
  from meshrl.rl.generation.state import Counters, Slots, new_pool  # pylint: disable=import-outside-toplevel
  rows = ["ab</cmd>zzz", "<done>xxxxx", "abc", "</cm>zz</cmd", "abcdefghijkl"]
  script = np.full((len(rows), 16), ord("q"), np.int32)
  for b, text in enumerate(rows):
    ids = TOK.encode(text, add_bos=False)
    script[b, :len(ids)] = ids
  script[2, 3] = TOK.eos_id
  config = core.StepConfig(sampler=Sampler(0.0), stop_tokens=tuple(TOK.stop_ids), pad_id=TOK.pad_id,
                           stop_sequences=tuple(tuple(TOK.encode(s, add_bos=False)) for s in ("</cmd>", "<done>")),
                           pause_on_stop=True, turn_tokens=12)
  batch = len(rows)
  prompts = jnp.full((batch, 1), 7, jnp.int32)
  pool = new_pool(prompts, prompts > 0, jax.random.split(jax.random.key(0), batch), group_size=1, width=17,
                  pad_id=TOK.pad_id, max_lengths=jnp.asarray([16, 16, 16, 16, 5]), max_new_tokens=16)
  cache = kvc.KVCache(layers={}, positions=jnp.zeros((batch, 24), jnp.int32),
                      segment_ids=jnp.zeros((batch, 24), jnp.int32), index=jnp.zeros((batch,), jnp.int32))
  slots = Slots(sid=jnp.arange(batch, dtype=jnp.int32), cache=cache, draft_cache=None,
                logits=jax.nn.one_hot(jnp.asarray(script[:, 0]), TOK.vocab_size) * 50.0,
                position=jnp.ones((batch,), jnp.int32), window=jnp.full((batch, config.window), -1, jnp.int32),
                sampling=None)
  models = core.Models(_ScriptModel(script))

  @jax.jit
  def turn(slots, pool):
    def body(carry):
      s, p = carry
      s, p, _ = core.decode_step(models, config, s, p, jnp.int32(0), Counters.zeros(batch))
      return s, p
    return jax.lax.while_loop(lambda c: jnp.any(core.live_slots(*c)), body, (slots, pool))
  slots, pool = turn(slots, pool)
  assert np.asarray(pool.generated).tolist() == [8, 6, 4, 12, 5]
  assert np.asarray(pool.paused).all() and not np.asarray(pool.done).any()
  assert np.asarray(pool.stopped).tolist() == [True, True, True, False, False]
  assert TOK.decode(np.asarray(pool.tokens[0, 1:9])) == "ab</cmd>"
  assert np.asarray(slots.position).tolist() == [9, 7, 5, 13, 6]
  # A paused row decodes no more (an empty column at its index, which stays) while the others go on.
  assert np.asarray(slots.cache.index).tolist() == [8, 6, 4, 12, 5]


def test_file_task_episodes_malformed_calls_budgets_and_env_failures():
  """A random policy's turns are malformed: each becomes an error observation, the episodes run to
  the turn budget; a smaller episode budget ends them by tokens or context instead; an environment
  that hangs past rl.env_timeout_s or raises ends its episode as an env failure (no gradient)."""
  cfg, _, state = _setup()
  examples = [copy_task(np.random.default_rng(i), 1) for i in range(2)]
  for e in examples:
    e["verifier"] = "files"
  programs = episode_runner(cfg, None, TOK)
  out = programs.rollout(state.params, state.extra, examples, jax.random.key(2))
  programs.close()
  lp, a = cfg.rl.max_prompt_len, _host(out.arrays)
  for b, episode in enumerate(out.episodes):
    assert episode.malformed_calls >= episode.turns - 1 >= 1
    observed = TOK.decode(a["tokens"][b, lp:][(a["segment_ids"][b, lp:] > 0) & ~a["response_mask"][b, lp:]])
    assert observed.startswith("<out>error")
    assert episode.reward == 0.0 and episode.env_failure is None
  cfg2, _, state2 = _setup("rl.max_new_tokens=20", "rl.max_turns=8", "rl.env_timeout_s=0.5")
  programs = episode_runner(cfg2, None, TOK, make_env=lambda e: _BrokenEnv(e["prompt"]))
  examples = [{"prompt": "go:"}, {"prompt": "slow"}, {"prompt": "boom"}]
  out = programs.rollout(state2.params, state2.extra, examples, jax.random.key(3))
  programs.close()
  for episode in out.episodes[:2]:
    assert episode.end in ("token_budget", "context", "done")
    assert episode.policy_tokens + episode.obs_tokens <= 20
  for episode, reason in zip(out.episodes[2:], ["timed out", "timed out", "RuntimeError", "RuntimeError"]):
    assert episode.end == "env_failure" and reason in episode.env_failure
  scored = mts.scored_batch(out, examples, 2)
  assert scored.sample_valid.tolist() == [True, True, False, False, False, False]


class _BrokenEnv(ScriptedEnv):
  """ScriptedEnv whose steps hang ("slow") or raise ("boom")."""

  def __init__(self, kind):
    super().__init__()
    self.kind = kind

  def step(self, action):
    if self.kind == "slow":
      import time  # pylint: disable=import-outside-toplevel
      time.sleep(1.0)
    if self.kind == "boom":
      raise RuntimeError("checker crashed")
    return super().step(action)


def test_oracle_demonstration_solves_file_task():
  example = {**copy_task(np.random.default_rng(0), 1), "verifier": "files"}
  env = FileTaskEnv()
  env.reset(example)
  results = [env.step(turn) for turn in oracle_turns(example)]
  assert results[0].observation == example["answer"] + "\n"
  assert results[-1].done and results[-1].reward == 1.0
  row = mts.Demonstrations([example] * 3)[1]
  assert row["prompt"].endswith(mt.render_observation(example["answer"] + "\n"))
  assert row["answer"] == oracle_turns(example)[1]


def test_demonstrations_hand_their_environments_back():
  """Every environment a demonstration row opens is closed when the row is built, also when a step
  raises: a sandboxed env then hands its session back to the pool to be recycled. Bug: the env left
  to the garbage collector, so each of the warm start's rows started a new sandbox."""
  example = {**copy_task(np.random.default_rng(0), 1), "verifier": "files"}
  opened = []

  class Recorded(FileTaskEnv):
    def __init__(self, fail=False):
      super().__init__()
      self.fail, self.closed = fail, 0
      opened.append(self)

    def step(self, action):
      if self.fail:
        raise RuntimeError("the sandbox went away")
      return super().step(action)

    def close(self):
      self.closed += 1

  rows = mts.Demonstrations([example] * 3, make_env=lambda e: Recorded())
  assert [rows[i]["answer"] for i in range(3)] == oracle_turns(example)
  with pytest.raises(RuntimeError, match="went away"):
    mts.Demonstrations([example] * 3, make_env=lambda e: Recorded(fail=True))[1]
  assert [env.closed for env in opened] == [1, 1, 1, 1]


def test_update_loss_ignores_observation_tokens(scripted):
  cfg, graphdef, state, _, out = scripted
  scored = mts.scored_batch(out, [{"domain": "a"}, {"domain": "b"}], cfg.rl.group_size)
  scored.arrays = _host(scored.arrays)
  aligned = align_for_update(scored)
  observation_targets = np.roll((scored.arrays["segment_ids"] > 0) & ~scored.arrays["response_mask"]
                                & ~scored.arrays["prompt_mask"], -1, axis=1)
  observation_targets[:, -1] = False
  assert observation_targets.any() and not (aligned["loss_mask"] & observation_targets).any()
  spec = losses.LossSpec.from_config(cfg, needs_critic=False)
  advantages = np.where(aligned["loss_mask"], np.linspace(-1, 1, 4)[:, None], 0).astype(np.float32)
  loss = jax.jit(lambda b: rl_loss(state.params, state.extra, graphdef, b, spec)[0])

  def value(old):
    return float(loss(UpdateBatch(**{**aligned, "old_logprobs": old}, advantages=advantages)))
  base = aligned["old_logprobs"]
  assert value(np.where(observation_targets, base - 3.0, base)) == pytest.approx(value(base), abs=1e-6)
  assert value(np.where(aligned["loss_mask"], base - 0.5, base)) != pytest.approx(value(base), abs=1e-4)


def test_episodes_take_their_domains_reward_sources(scripted):
  """rl.reward_sources in a multi-turn run: an episode's reward is its domain's weighted sources, the
  environment's reward standing for the verifier (the pool's verifier is not called) and the reward
  model scoring the episode's text, through the step's collect (run.pool); `correct` stays the
  environment's and the RM's score is reported per domain. Catches the sources ignored (the env
  reward alone, as before), the pool's verifier scoring episodes, and a weight dropped."""
  import types  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rewards.pool import Dispatched, RewardPool  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rewards.sources import SourcedRewards, parse_sources  # pylint: disable=import-outside-toplevel

  class PlantedRM:  # a BatchScorer: each episode text's length / 10
    seen = []

    def dispatch(self, completions, examples):
      self.seen += list(completions)
      return Dispatched([], list(completions), {})

    def finish(self, dispatched):
      return np.asarray([len(t) / 10 for t in dispatched.completions], np.float32), {"errors": 0, "first_errors": []}

  _, _, state, _, out = scripted
  env = [1.0, 0.0, 0.5, 0.25]
  out = dataclasses.replace(out, episodes=[dataclasses.replace(e, reward=r) for e, r in zip(out.episodes, env)])
  verifier = RewardPool(lambda completion, example: 99.0, num_workers=1)
  pool = SourcedRewards(verifier, parse_sources("a=reward_model:0.5,verifier:0.5;*=verifier"),
                        {"reward_model": PlantedRM()})
  cfg = configs.load("configs/tiny.py", SMALL + ["rl.dynamic_sampling=false"])
  run = types.SimpleNamespace(
      cfg=cfg, bootstrap=None, partial=None, replay=None, state=state, version=3, pool=pool, samples_sharding=None,
      multiturn=types.SimpleNamespace(rollout=lambda *args: out, env_work=types.SimpleNamespace(metrics=dict)))
  examples = iter([{"prompt": "do the thing:", "domain": "a"}, {"prompt": "another task!", "domain": "b"}])
  batch, metrics = mts.collect_multiturn(run, examples, jax.random.key(0))
  rm = [len(t) / 10 for t in out.texts[:2]]
  assert PlantedRM.seen == out.texts[:2] and len(set(rm)) == 2  # domain a's episodes, their whole text
  np.testing.assert_allclose(batch.rewards, [0.5 * rm[0] + 0.5, 0.5 * rm[1], 0.5, 0.25], rtol=1e-6)
  np.testing.assert_array_equal(batch.correct, env)
  assert metrics["score/reward_model/a"] == pytest.approx(np.mean(rm))
  pool.close()


def test_config_refuses_only_what_no_engine_could_serve():
  """Every generation option composes with multi-turn episodes (the core serves them all); what is
  refused is a cache too short for an observation's slack and a budget below one turn, by name."""
  from meshrl.rl.step.spec import check_generation  # pylint: disable=import-outside-toplevel
  for extra in (["rl.engine=continuous", "rl.decode_slots=2"], ["rl.kv_cache_dtype=int8"],
                ["rl.generation_weights=int8", "rl.tis_level=token"], ["rl.generation_layout=gathered"],
                ["rl.speculative=ngram", "rl.speculative_k=4"], ["rl.pack_updates=true"],
                ["rl.max_staleness=1", "rl.tis_level=token"],
                ["rl.engine=continuous", "rl.rollout_token_budget=64", "rl.max_resample_rounds=0"]):
    check_generation(configs.load("configs/tiny.py", SMALL + extra))
  for extra, message in ((["rl.max_obs_tokens=64"], "rl.max_obs_tokens=64 .* exceeds model.max_seq_len"),
                         (["rl.max_turns=0"], "rl.max_turns=0")):
    with pytest.raises(ValueError, match=message):
      check_generation(configs.load("configs/tiny.py", SMALL + extra))


@pytest.mark.slow
def test_agent_demo_runs_rl_steps_end_to_end(tmp_path):
  """configs/tiny_agent.py shrunk: warm start on demonstrations, two GRPO steps on multi-turn episodes
  through rl/step/program.py (collect -> prepare -> update), multi-turn evaluation (about a minute).
  Dynamic sampling is off: after 4 warm-start steps every episode may fail, and it would then drop
  every group, so no step would update (the record then has no loss: nothing was measured)."""
  from meshrl.rl.step import driver as loop  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny_agent.py", [
      "rl.sft_steps=4", "rl.num_steps=2", "rl.dynamic_sampling=false", "eval.every=1", "eval.num_prompts=8",
      "eval.batch_size=8", "rl.prompts_per_step=2", "rl.group_size=4", "log.progress_bar=false",
      "log.tensorboard=false", "log.plot=false", "checkpoint.enabled=false"])
  records = loop.run(cfg, str(tmp_path))
  assert [r["step"] for r in records] == [1, 2]
  for record in records:
    assert np.isfinite(record["loss"]) and record["turns_mean"] >= 1
    assert "reward_mean/files_copy" in record and "eval/accuracy/files_copy" in record
    assert record["generated_tokens"] > 0 and record["extend_tokens"] > 0


@pytest.mark.needs_sandbox
def test_terminal_task_episodes_run_in_the_sandbox_and_are_graded_by_check_sh(tmp_path):
  """Terminal task directories in the multi-turn rollout: each episode gets a TerminalEnv with its own
  sandbox work directory, and at its end check.sh runs there: a sound task is not solved by a random
  policy (reward 0), the planted check that passes on anything gives reward 1, and neither is an
  environment failure."""
  from meshrl.rl.envs import terminal_tasks  # pylint: disable=import-outside-toplevel
  sound = terminal_tasks.write_tasks(str(tmp_path), per_family=1, families=("create",))[0]
  faults = terminal_tasks.write_planted_faults(str(tmp_path / "faults"))
  empty = next(folder for folder, kind in faults.items() if kind == "empty_passes")
  examples = [{"prompt": "create the file:", "verifier": "terminal", "task_dir": str(tmp_path / sound),
               "domain": "terminal", "max_turns": 2, "timeout_s": 10.0},
              {"prompt": "create the file:", "verifier": "terminal", "domain": "terminal", "max_turns": 2,
               "task_dir": str(tmp_path / "faults" / empty), "timeout_s": 10.0}]
  cfg, _, state = _setup("rl.group_size=1", "rl.max_turns=2")
  programs = episode_runner(cfg, None, TOK)
  out = programs.rollout(state.params, state.extra, examples, jax.random.key(4))
  programs.close()
  assert [e.env_failure for e in out.episodes] == [None, None]
  assert [e.reward for e in out.episodes] == [0.0, 1.0]
  assert all(1 <= e.turns <= 2 for e in out.episodes)
