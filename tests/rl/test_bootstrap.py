"""Bootstrapping hard tasks (issue 33): the pass-rate curriculum (rl/envs/levels.py), the retries of
unsolved prompts (rl/step/retry.py), both through rl/step/bootstrap.py, and the step's success
figures (rl/step/groups.success_metrics)."""

import collections
import json
import types

import numpy as np

from meshrl import configs
from meshrl.model.tokenizer import ByteTokenizer
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.envs.levels import LevelCurriculum
from meshrl.rl.envs.mixture import TaskMixture, in_eval_split
from meshrl.rl.step import driver as loop
from meshrl.rl.step.bootstrap import Bootstrap
from meshrl.rl.step.groups import batch_metrics, next_prompts, select_groups
from meshrl.rl.step.retry import UnsolvedRetry

G = 4


def _scored(correct) -> ScoredBatch:
  """A scored round of len(correct) samples with the planted outcomes (rewards = correct)."""
  correct = np.asarray(correct, np.float32)
  size = len(correct)
  return ScoredBatch(arrays={"tokens": np.zeros((size, 3), np.int32), "truncated": np.zeros(size, bool),
                             "lengths": np.full(size, 2, np.int32)},
                     rewards=correct, correct=correct, sample_valid=np.ones(size, bool),
                     domains=["reverse"] * size, texts=["x"] * size)


# --- the curriculum ---------------------------------------------------------------------------


def _observe(curriculum, name, level, wins, samples):
  return curriculum.observe([name] * samples, [level] * samples, np.array([1.0] * wins + [0.0] * (samples - wins)))


def test_curriculum_promotes_when_solved_and_demotes_when_hopeless_keeping_its_floor_and_top():
  c = LevelCurriculum({"reverse": "reverse", "sort": "sort"}, start={"reverse": 2, "sort": 2}, floor=2, top=3,
                      promote_at=0.7, demote_at=0.1, window=10)
  assert _observe(c, "reverse", 2, 6, 9) == [] and c.levels["reverse"] == 2  # window not full yet
  assert _observe(c, "reverse", 2, 2, 1) == ["reverse 2->3"] and c.levels["reverse"] == 3  # 8/10 >= 0.7
  _observe(c, "reverse", 3, 10, 10)
  assert c.levels["reverse"] == 3  # the top (data.level_curriculum_max) is not passed
  _observe(c, "reverse", 3, 0, 10)
  assert c.levels["reverse"] == 2  # hopeless: one level down
  _observe(c, "reverse", 2, 0, 10)
  assert c.levels["reverse"] == 2  # ... never below the floor
  _observe(c, "sort", 2, 5, 10)  # between the thresholds: stays, and a new window starts
  assert c.levels["sort"] == 2 and c.window_counts["sort"] == [0, 0]
  metrics = c.metrics()
  assert metrics["curriculum/level/reverse"] == 2.0 and metrics["curriculum/moves"] == 2.0
  assert metrics["curriculum/pass_rate/reverse@3"] == 0.5  # 10 of 20 at level 3 over the run


def test_a_floor_as_hopeless_as_the_configured_level_sends_the_domain_back_there_for_good():
  """Issue 33's copy: warmed up at five symbols, it passes no better at three. The curriculum must not
  hold it at the easier-on-paper level: back to its configured level, and no lower again."""
  c = LevelCurriculum({"copy": "copy", "sort": "sort"}, start={"copy": 2, "sort": 2}, floor=1, top=2,
                      promote_at=0.6, demote_at=0.05, window=10)
  assert _observe(c, "copy", 2, 0, 10) == ["copy 2->1"]  # hopeless: one level down, as before
  assert _observe(c, "copy", 1, 0, 10) == ["copy 1->2"]  # no better there: back to level 2
  assert _observe(c, "copy", 2, 0, 10) == [] and c.levels["copy"] == 2  # ... and it stays
  _observe(c, "sort", 2, 0, 10)
  _observe(c, "sort", 1, 3, 10)  # level 1 gives signal (between the thresholds): sort stays there
  assert c.levels["sort"] == 1
  resumed = LevelCurriculum({"copy": "copy", "sort": "sort"}, start={"copy": 2, "sort": 2}, floor=1, top=2,
                            promote_at=0.6, demote_at=0.05, window=10)
  resumed.set_state(json.loads(json.dumps(c.get_state())))
  assert resumed.floors == {"copy": 2, "sort": 1}
  assert _observe(resumed, "copy", 2, 0, 10) == [] and resumed.levels["copy"] == 2


def test_samples_of_an_earlier_level_count_there_not_toward_the_current_window():
  """A rollout drawn before a promotion (asynchronous RL, a retry) is scored after it: its failures
  at level 1 must not demote level 2."""
  c = LevelCurriculum({"reverse": "reverse"}, start={"reverse": 1}, window=4, promote_at=0.75, demote_at=0.25)
  _observe(c, "reverse", 1, 4, 4)
  assert c.levels["reverse"] == 2
  _observe(c, "reverse", 1, 0, 8)
  assert c.levels["reverse"] == 2 and c.counts["reverse@1"] == [4, 12]


def test_relevel_draws_the_current_level_on_the_train_side_reproducibly_and_resumes_exactly():
  kw = dict(start={"reverse": 1}, window=2, seed=3, eval_fraction=0.3)
  c = LevelCurriculum({"reverse": "reverse"}, **kw)
  source = TaskMixture("reverse:1.0,copy:1.0", difficulty=1, seed=3, split="train", eval_fraction=0.3)
  fresh = source.take(40)
  first = [c.relevel(e) for e in fresh[:20]]
  assert all(e["difficulty"] == 1 for e in first if e["domain"] == "reverse")
  assert [e for e, f in zip(first, fresh) if e["domain"] == "copy"] == [f for f in fresh[:20] if f["domain"] == "copy"]
  _observe(c, "reverse", 1, 2, 2)
  state = c.get_state()
  later = [c.relevel(e) for e in fresh[20:]]
  relevelled = [e for e in later if e["domain"] == "reverse"]
  assert relevelled and all(e["difficulty"] == 2 for e in relevelled)
  assert all(len(e["answer"]) > 3 for e in relevelled)  # level 2's longer strings (level 1: 3 letters)
  assert not any(in_eval_split(e["prompt"], 0.3) for e in first + later)  # never a held-out prompt
  resumed = LevelCurriculum({"reverse": "reverse"}, **kw)
  resumed.set_state(state)
  assert [resumed.relevel(e) for e in fresh[20:]] == later


# --- retries of unsolved prompts ----------------------------------------------------------------


def test_prompts_without_success_get_more_groups_and_every_round_keeps_its_shape():
  """Round 1: prompts A and B of 4 unsolved. Round 2 (dynamic sampling's refill, or the next step)
  samples both again in place of fresh prompts, still 4 prompts; B is solved there, A is not and
  comes back once more, until its 2 retries are spent. The step's batch is 4 groups of G."""
  tok = ByteTokenizer()
  retry = UnsolvedRetry(max_retries=2, per_round=2)
  stream = retry.stream(iter(TaskMixture("reverse:1.0", seed=0)))
  rounds, never, unsolved = [], set(), []
  for round_index in range(4):
    prompts = next_prompts(stream, tok, count=4, max_len=32, overflow="truncate")
    assert prompts.tokens.shape == (4, 32) and len(prompts.examples) == 4
    if round_index == 0:
      unsolved = [prompts.examples[0]["prompt"], prompts.examples[2]["prompt"]]  # A, B
      never = {unsolved[0]}
      solved = [False, True, False, True]
    else:  # A never; B and every fresh prompt at their first try since
      solved = [e["prompt"] not in never for e in prompts.examples]
    correct = np.repeat(np.array(solved, np.float32), G) * np.tile([1, 0, 0, 0], 4)
    rounds.append((prompts.examples, _scored(correct)))
    retry.observe(prompts.examples, np.array(solved))
  drawn = [[e["prompt"] for e in examples] for examples, _ in rounds]
  assert drawn[1][:2] == unsolved and len(set(drawn[1])) == 4  # retried first, in place of 2 fresh
  assert [e.get("retry", 0) for e in rounds[1][0]] == [1, 1, 0, 0]
  assert drawn[2][0] == unsolved[0] and rounds[2][0][0]["retry"] == 2 and unsolved[1] not in drawn[2]
  assert unsolved[0] not in drawn[3]  # its 2 retries spent
  assert retry.metrics() == {"retried_prompts": 3.0, "retried_solved": 1.0, "retries_given_up": 1.0,
                             "retry_queue": 0.0}
  batch = select_groups([s for _, s in rounds], num_groups=4, group_size=G, dynamic=True)
  assert batch.rewards.shape == (4 * G,) and batch.arrays["tokens"].shape == (4 * G, 3)


def test_retries_are_capped_per_round_so_fresh_prompts_keep_flowing():
  retry = UnsolvedRetry(max_retries=5, per_round=1)
  examples = TaskMixture("reverse:1.0", seed=1).take(4)
  retry.observe(examples, np.zeros(4, bool))
  stream = retry.stream(iter(TaskMixture("reverse:1.0", seed=2)))
  round_two = [next(stream) for _ in range(4)]
  assert sum("retry" in e for e in round_two) == 1 and len(retry.queue) == 3


def test_bootstrap_state_through_the_checkpoints_carried_state_continues_identically():
  cfg = configs.load("configs/tiny.py", ["data.level_curriculum=reverse", "data.level_curriculum_window=8",
                                         "rl.retry_unsolved=2", "rl.group_size=4", "rl.prompts_per_step=4"])
  def run_of(bootstrap):
    return types.SimpleNamespace(in_flight=[], partial=None, multiturn=None, env_work=None, bootstrap=bootstrap,
                                 replay=None)
  a = Bootstrap.from_config(cfg, processes=1)
  fresh = iter(TaskMixture("reverse:1.0", seed=0))
  examples = [next(a.stream(fresh)) for _ in range(4)]
  a.observe(examples, _scored([1, 1, 1, 1] * 2 + [0] * 8))  # a full window (8), 8/16 at level 1: stays
  a.observe(examples, _scored([1] * 16))  # a new window, 16/16 >= 0.7: promoted to 2
  state = loop.carried_state(run_of(a))
  assert "bootstrap" in state
  b = Bootstrap.from_config(cfg, processes=1)
  loop.restore_carried_state(run_of(b), state)
  ahead = [a.curriculum.levels, [e["prompt"] for e in (next(a.stream(iter(TaskMixture("reverse:1.0", seed=5))))
                                                       for _ in range(4))]]
  resumed = [b.curriculum.levels, [e["prompt"] for e in (next(b.stream(iter(TaskMixture("reverse:1.0", seed=5))))
                                                         for _ in range(4))]]
  assert ahead == resumed and ahead[0]["reverse"] == 2


def test_bootstrap_is_off_by_default():
  assert Bootstrap.from_config(configs.load("configs/tiny.py"), processes=1) is None


# --- the step's success figures -----------------------------------------------------------------


def test_a_step_whose_groups_were_all_dropped_is_reported_as_such():
  """Every group all-wrong: dynamic sampling keeps none, the update gets no sample. The record says
  so (all_groups_dropped 1, solved_frac 0), beside a step with one informative group."""
  dead = _scored(np.zeros(4 * G))
  batch = select_groups([dead], num_groups=4, group_size=G, dynamic=True)
  metrics = batch_metrics(dead, batch, dead.arrays["lengths"], G)
  assert metrics["all_groups_dropped"] == 1.0 and metrics["solved_frac"] == 0.0 and metrics["groups_kept"] == 0
  live = _scored(np.concatenate([[1, 0, 0, 0], np.zeros(3 * G)]))
  batch = select_groups([live], num_groups=4, group_size=G, dynamic=True)
  metrics = batch_metrics(live, batch, live.arrays["lengths"], G)
  assert metrics["all_groups_dropped"] == 0.0 and metrics["solved_frac"] == 0.25 and metrics["groups_kept"] == 1


def test_solved_frac_counts_prompts_with_at_least_one_success():
  first = _scored([0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0])
  batch = select_groups([first], num_groups=4, group_size=G, dynamic=False)
  assert batch_metrics(first, batch, first.arrays["lengths"], G)["solved_frac"] == 0.75


# --- through the RL step --------------------------------------------------------------------------


def test_rl_steps_run_the_curriculum_and_the_retries_and_report_a_step_with_nothing_to_learn(devices):
  """Two real RL steps on the tiny model with a reward that never pays: every group is dropped, so
  the record says all_groups_dropped (no entropy measured); the refill round samples 2 of the 4
  unsolved prompts again (rl.retry_share 0.5); the curriculum, hopeless at level 2 after a window
  of 16 samples, demotes reverse to level 1 (its floor), and the next step draws level 1; hopeless
  there too, reverse goes back to level 2, its configured level, for good."""
  from meshrl.rl.rewards.pool import RewardPool  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", [
      "model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
      "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
      "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_steps=0", "log.progress_bar=false",
      "log.tensorboard=false", "log.plot=false", "rl.max_resample_rounds=1", "rl.dynamic_sampling=true",
      "data.difficulty=2", "data.level_curriculum=reverse", "data.level_curriculum_window=16",
      "data.level_curriculum_demote=0.5", "data.level_curriculum_promote=1.0", "rl.retry_unsolved=1"])
  run, prompts = loop.setup(cfg)
  run.pool.close()
  seen = []
  run.pool = RewardPool(lambda completion, example: seen.append(example) or 0.0)
  records = loop.train_steps(run, prompts, num_steps=2)
  run.close()
  first, second = records
  assert first["all_groups_dropped"] == 1.0 and first["solved_frac"] == 0.0 and "entropy" not in first
  assert first["rollout_rounds"] == 2 and first["retried_prompts"] == 2.0
  # Every sample's example, as (level, retry) (the reward pool's threads score in any order). Step 1:
  # 4 fresh prompts at level 2, all unsolved; the curriculum demotes at once (16 samples at <= 0.5),
  # so the refill round has 2 retries (level 2) and 2 fresh prompts at level 1. Step 2 takes the 2
  # level-2 prompts left in the queue and 2 fresh ones at level 1: with step 1's, 16 samples at level
  # 1, as hopeless, so reverse goes back to level 2; the refill round has 2 level-1 retries and 2 fresh
  # prompts at level 2. 4 rounds of 4 groups of 4.
  drawn = collections.Counter((e["difficulty"], e.get("retry", 0)) for e in seen)
  assert drawn == {(2, 0): 24, (2, 1): 16, (1, 0): 16, (1, 1): 8}, drawn
  assert first["curriculum/moved"] == "reverse 2->1" and first["curriculum/level/reverse"] == 1.0
  assert second["curriculum/moved"] == "reverse 1->2" and second["curriculum/level/reverse"] == 2.0


def test_hosts_drawing_their_own_prompts_relevel_to_different_prompts():
  """Each host relevels its own block: with the same seed and counter, hosts 0 and 1 must not train
  on the same prompts (a curriculum seeded without the host would duplicate them)."""
  example = {"prompt": "rev abc=", "answer": "cba", "domain": "reverse", "difficulty": 1}
  curricula = [LevelCurriculum({"reverse": "reverse"}, start={"reverse": 3}, seed=0, shard=shard)
               for shard in (0, 1)]
  drawn = [[c.relevel(example)["prompt"] for _ in range(8)] for c in curricula]
  assert not set(drawn[0]) & set(drawn[1])


# --- the replay of verified successes -----------------------------------------------------------


def _rollout_round(rewards, seed=0) -> ScoredBatch:
  """A scored round whose per-token fields are rl/batches/rows.DeviceRows (as collect keeps them)."""
  from meshrl.rl.batches.rows import DeviceRows  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  size = len(rewards)
  scored = _scored(rewards)
  scored.arrays = {"tokens": DeviceRows.of(rng.integers(0, 50, (size, 6)).astype(np.int32)),
                   "logprobs": DeviceRows.of(-rng.random((size, 6)).astype(np.float32)),
                   "policy_version": DeviceRows.of(np.full((size, 6), seed, np.int32), fill=-1),
                   "lengths": np.full(size, 2, np.int32), "truncated": np.zeros(size, bool)}
  return scored


def test_replay_stores_only_groups_with_a_success_and_replays_them_with_their_own_log_probs():
  from meshrl.rl.step.replay import SuccessReplay, with_replay  # pylint: disable=import-outside-toplevel
  replay = SuccessReplay(capacity=2, group_size=G)
  # groups: all wrong, mixed (stored), all right (no contrast), mixed (stored)
  old = _rollout_round([0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 0], seed=3)
  assert with_replay([old], replay, num_groups=4, dynamic=True) == [old]  # nothing stored yet
  assert len(replay.groups) == 2
  state = replay.get_state()
  dead = _rollout_round(np.zeros(16), seed=4)
  rounds = with_replay([dead], replay, num_groups=4, dynamic=True)
  replayed = rounds[-1]
  assert len(rounds) == 2 and len(replay.groups) == 0  # each replayed once
  # the newest first: group 3, then group 1, with the log-probs and versions their rollout recorded
  for place, group in enumerate((3, 1)):
    rows, mine = slice(group * G, (group + 1) * G), slice(place * G, (place + 1) * G)
    np.testing.assert_array_equal(replayed.arrays["logprobs"][mine], old.arrays["logprobs"][rows].to_host())
    np.testing.assert_array_equal(replayed.arrays["tokens"][mine], old.arrays["tokens"][rows].to_host())
    np.testing.assert_array_equal(replayed.rewards[mine], old.rewards[rows])
  assert (replayed.arrays["policy_version"] == 3).all()
  batch = select_groups(rounds, num_groups=4, group_size=G, dynamic=True)
  assert batch.sample_valid.sum() == 2 * G and batch.rewards.shape == (4 * G,)
  assert replay.metrics() == {"replayed_groups": 2.0, "replay_added": 2.0, "replay_stored": 0.0}
  restored = SuccessReplay(capacity=2, group_size=G)
  restored.set_state(state)
  np.testing.assert_array_equal(restored.take(1).arrays["logprobs"], old.arrays["logprobs"][12:16].to_host())


def test_replayed_samples_have_ratio_one_on_an_unchanged_policy(devices):
  """Collect a step whose groups differ (their successes are stored), then, with the same parameters,
  one whose every group is all wrong: the batch is the replayed groups, and the policy's log-probs of
  their tokens equal the behaviour log-probs they carry (ratio 1), which the update compares against."""
  import jax  # pylint: disable=import-outside-toplevel
  from meshrl.rl.rewards.pool import RewardPool  # pylint: disable=import-outside-toplevel
  from meshrl.rl.step.program import collect, prepare  # pylint: disable=import-outside-toplevel
  cfg = configs.load("configs/tiny.py", [
      "model.num_layers=2", "model.embed_dim=64", "model.head_dim=16", "model.mlp_dim=64",
      "moe.expert_mlp_dim=32", "rl.max_prompt_len=8", "rl.max_new_tokens=6", "model.max_seq_len=16",
      "rl.prompts_per_step=4", "rl.group_size=4", "rl.sft_steps=0", "rl.max_resample_rounds=0",
      "rl.dynamic_sampling=true", "rl.replay_groups=8", "rl.temperature=1.0", "model.init_std=0.3"])
  run, prompts = loop.setup(cfg)
  run.pool.close()
  run.pool = RewardPool(lambda completion, example: float(len(completion) % 2))
  first, _ = collect(run, prompts, jax.random.key(1))
  stored = len(run.replay.groups)
  assert stored >= 1
  run.pool.close()
  run.pool = RewardPool(lambda completion, example: 0.0)
  scored, metrics = collect(run, prompts, jax.random.key(2))
  run.close()
  assert metrics["replayed_groups"] == min(stored, 4) and metrics["groups_kept"] == min(stored, 4)
  assert metrics["all_groups_dropped"] == 0.0 and metrics["staleness_max"] == 0.0
  batch, _ = prepare(run, scored)
  logp, _ = run.logprob_fn(run.state.params, run.state.extra, batch)
  replayed = slice(0, int(metrics["replayed_groups"]) * 4)  # dynamic sampling put them first
  assert scored.sample_valid[replayed].all() and not scored.sample_valid[replayed.stop:].any()
  mask = np.asarray(batch.loss_mask)[replayed]
  assert mask.sum() > 0
  np.testing.assert_allclose(np.asarray(logp)[replayed][mask], np.asarray(batch.old_logprobs)[replayed][mask],
                             atol=2e-5)
