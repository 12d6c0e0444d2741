"""Multi-turn episodes in the RL step and around it: `collect_multiturn` (rl/step/program.py's collect for a
multi-turn run: rollout rounds of rl/step/episodes.py, dynamic sampling, the step's metrics), the
held-out evaluation (`MultiTurnEvaluator`), the warm start's oracle episodes (`Demonstrations`) and
the held-out examples of a multi-turn run (`held_out`).

The rollout itself (jitted prefill / decode_turn / extend and the host loop that steps the
environments) is rl/step/episodes.py.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.step.groups import (batch_metrics, enough_groups, gather_scoring_info, per_domain, shared_prompts,
                                   staleness, step_groups)
from meshrl.rl.batches.handover import ScoredBatch
from meshrl.rl.envs import file_tasks
from meshrl.rl.envs.base import DONE
from meshrl.rl.rewards.sources import SourcedRewards, normalize_per_domain
from meshrl.rl.step.episodes import (ENDS, EpisodeStats, MultiTurnRollout, default_env, observation_ids,
                                 render_observation)
from meshrl.rl.step.replay import with_replay
from meshrl.sharding import hosts


def episode_metrics(episodes: Sequence[EpisodeStats], prefix: str = "") -> dict[str, float]:
  """Means over episodes: turns, malformed calls, policy / observation tokens, share of each end."""
  if not episodes:
    return {}
  mean = lambda get: float(np.mean([get(e) for e in episodes]))  # noqa: E731
  out = {f"{prefix}turns_mean": mean(lambda e: e.turns),
         f"{prefix}malformed_calls_mean": mean(lambda e: e.malformed_calls),
         f"{prefix}policy_tokens_mean": mean(lambda e: e.policy_tokens),
         f"{prefix}obs_tokens_mean": mean(lambda e: e.obs_tokens),
         f"{prefix}env_failures": float(sum(e.env_failure is not None for e in episodes))}
  out.update({f"{prefix}end_{end}": mean(lambda e, end=end: e.end == end) for end in ENDS})
  return out


def scored_batch(out: MultiTurnRollout, examples: Sequence[dict], group_size: int, pool=None) -> ScoredBatch:
  """The rollout as a ScoredBatch: rewards from the episodes' ends; env failures are not valid.

  With per-domain reward sources (rl.reward_sources: `pool` a SourcedRewards) an episode's reward is
  its domain's weighted sources, the environment's reward standing for the `verifier` and a reward
  model or judge scoring the episode's text after the prompt (every turn and observation); each host
  scores its `share` of the episodes, and the rewards are gathered (then whitened per domain with
  rl.reward_norm="domain"). `correct` stays the environment's verdict."""
  env_rewards = np.asarray([e.reward for e in out.episodes], np.float32)
  valid = np.asarray([e.env_failure is None for e in out.episodes], bool)
  domains = [str(e.get("domain", "")) for e in examples for _ in range(group_size)]
  failures = [e.env_failure for e in out.episodes if e.env_failure]
  rewards, info = env_rewards, {"reward_errors": 0, "reward_timeouts": 0, "first_errors": []}
  if isinstance(pool, SourcedRewards):
    per_sample = [e for e in examples for _ in range(group_size)]
    mine = hosts.share(len(per_sample))
    own, own_info = pool.collect(pool.submit(out.texts[mine], per_sample[mine], verified=env_rewards[mine]),
                                 normalize=False)
    rewards = hosts.gather_rows(own)
    if pool.normalize_domains:
      rewards = normalize_per_domain(rewards, domains)
    info = gather_scoring_info(own_info, mine.start, mine.stop - mine.start)
  info["reward_errors"] += len(failures)
  info["first_errors"] = (failures[:1] + info["first_errors"])[:3]
  return ScoredBatch(arrays=out.arrays, rewards=rewards, correct=env_rewards.copy(), sample_valid=valid,
                     domains=domains, texts=out.texts, info=info)


def _draw(run, examples) -> list[dict]:
  """This host's block of a step's examples, gathered in process order (rl/step/driver.prompt_stream); with
  shared_prompts every host's stream is the whole stream and draws them all."""
  count = run.cfg.rl.prompts_per_step
  if shared_prompts(run.cfg):
    return [next(examples) for _ in range(count)]
  return hosts.gather_objects([next(examples) for _ in range(count // jax.process_count())])


def _restored(item) -> MultiTurnRollout:
  """A rollout in flight restored from a checkpoint (host arrays, the episodes' stats and texts)."""
  return MultiTurnRollout(arrays=item.batch, episodes=[EpisodeStats(**e) for e in item.episodes["stats"]],
                          texts=list(item.episodes["texts"]), counts={"prompts_truncated": 0, "extend_tokens": 0})


def _executor(run) -> concurrent.futures.ThreadPoolExecutor:
  """The one thread asynchronous episodes run in (so a run's rollouts, and its partial pool, advance in
  order)."""
  if run.episode_thread is None:
    run.episode_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="episodes")
  return run.episode_thread


def next_episodes_in_flight(run, examples, key: jax.Array):
  """Asynchronous multi-turn RL: tops the queue of episode rollouts up to rl.max_staleness + 1 and
  pops the oldest -> (its examples, MultiTurnRollout, info, the wait in seconds). New rollouts run in a
  thread beside the step (their environments step and their turns decode while the host scores and the
  devices update), on a snapshot of the current generation weights (the update donates the train
  state's), stamped with the current version. With partial episodes (run.partial) each is a step of
  the carried pool (PartialEpisodes.step, drawing its new groups in the thread); info is its groups
  admitted / ended / carried."""
  from meshrl.rl.step.program import InFlight  # pylint: disable=import-outside-toplevel
  cfg = run.cfg.rl
  while len(run.in_flight) < cfg.max_staleness + 1:
    weights = run.multiturn.weights(run.state.params, run.state.extra)
    dispatch_key = jax.random.fold_in(key, 1000 + len(run.in_flight))
    if run.partial is not None:
      future = _executor(run).submit(run.partial.step, None, None, lambda count: [next(examples) for _ in range(count)],
                                     dispatch_key, run.version, weights=weights)
      run.in_flight.append(InFlight(None, future, run.version))
      continue
    drawn = _draw(run, examples)
    future = _executor(run).submit(run.multiturn.rollout, None, None, drawn, dispatch_key, run.version, weights=weights)
    run.in_flight.append(InFlight(drawn, future, run.version))
  item = run.in_flight.popleft()
  t0 = time.perf_counter()
  if item.episodes is not None:
    out = _restored(item)
  else:
    item.settle()
    out = item.batch.result() if isinstance(item.batch, concurrent.futures.Future) else item.batch
  return item.examples, out, dict(item.info or {}), time.perf_counter() - t0


def _partial_step(run, examples, key: jax.Array):
  """One step of the carried episodes now, under the current parameters -> (out, examples, info); in
  the episodes' thread when asynchronous RL has one (its queued steps advance the same pool first)."""
  draw = lambda count: [next(examples) for _ in range(count)]  # noqa: E731
  if run.episode_thread is None:
    return run.partial.step(run.state.params, run.state.extra, draw, key, run.version)
  weights = run.multiturn.weights(run.state.params, run.state.extra)
  return run.episode_thread.submit(run.partial.step, None, None, draw, key, run.version, weights=weights).result()


def collect_multiturn(run, examples, key: jax.Array) -> tuple[ScoredBatch, dict]:
  """rl/step/program.py's `collect` for multi-turn episodes (run.multiturn): one rollout round, plus up to
  rl.max_resample_rounds more with dynamic sampling (DAPO) until prompts_per_step groups differ.
  With rl.max_staleness > 0 the first round is the oldest episode rollout in flight
  (`next_episodes_in_flight`); with rl.rollout_token_budget the batch is the groups whose episodes
  finished in this step's budget (rl/step/episodes.PartialEpisodes), padded with blank groups."""
  cfg = run.cfg.rl
  if run.bootstrap is not None:  # prompts at their curriculum levels, unsolved ones again (issue 33)
    examples = run.bootstrap.stream(examples)
  rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
  scored_rounds, outs, rollout_s, partial_info = [], [], 0.0, {}
  for round_index in range(rounds):
    t0 = time.perf_counter()
    round_key = jax.random.fold_in(key, round_index)
    if round_index == 0 and cfg.max_staleness > 0:
      drawn, out, partial_info, waited = next_episodes_in_flight(run, examples, key)
      t0 = time.perf_counter() - waited
    elif run.partial is not None:
      out, drawn, partial_info = _partial_step(run, examples, round_key)
    else:
      drawn = _draw(run, examples)
      out = run.multiturn.rollout(run.state.params, run.state.extra, drawn, round_key, run.version)
    rollout_s += time.perf_counter() - t0
    outs.append(out)
    scored = scored_batch(out, drawn, cfg.group_size, run.pool)
    scored.arrays = {**scored.arrays, "env_ok": scored.sample_valid}
    scored_rounds.append(scored)
    if run.bootstrap is not None:  # `drawn` is every host's examples; this host's retries: its own block
      run.bootstrap.observe(drawn or [], scored, mine=None if shared_prompts(run.cfg) or not drawn
                            else hosts.own_block(len(drawn)))
    if enough_groups(scored_rounds, cfg):
      break
  replay_metrics = {}
  if run.replay is not None:  # stored successes fill the places dynamic sampling left empty (issue 33)
    scored_rounds = with_replay(scored_rounds, run.replay, num_groups=cfg.prompts_per_step,
                                dynamic=cfg.dynamic_sampling)
    replay_metrics = run.replay.metrics()
  batch = step_groups(scored_rounds, cfg)
  batch.sample_valid &= batch.arrays.pop("env_ok")  # select_groups keeps groups, not samples' validity
  first, first_out = scored_rounds[0], outs[0]
  if not first.texts:  # partial episodes: no group finished in this step
    first = batch
  policy_tokens = np.asarray([e.policy_tokens for e in first_out.episodes], np.float32)
  metrics = {
      **batch_metrics(first, batch, policy_tokens if len(policy_tokens) else batch.arrays["lengths"], cfg.group_size),
      "reward_errors": sum(r.info["reward_errors"] for r in scored_rounds), "reward_timeouts": 0,
      "rollout_rounds": len(scored_rounds),
      "prompts_rejected": 0, "prompts_truncated": sum(o.counts.get("prompts_truncated", 0) for o in outs),
      "rollout_s": rollout_s, "reward_s": 0.0,
      "generated_tokens": int(sum(sum(e.policy_tokens for e in o.episodes) for o in outs)),
      "extend_tokens": sum(o.counts.get("extend_tokens", 0) for o in outs),
      **staleness(batch.arrays, run.version, run.samples_sharding), **partial_info,
      **episode_metrics(first_out.episodes), **run.multiturn.env_work.metrics(),
  }
  if cfg.speculative != "none" and "tokens_per_forward" in first_out.counts:
    metrics.update(spec_acceptance_rate=first_out.counts["acceptance_rate"],
                   spec_tokens_per_forward=first_out.counts["tokens_per_forward"])
  if run.bootstrap is not None:
    metrics.update(run.bootstrap.metrics())
  metrics.update(replay_metrics)
  failures = [f for r in scored_rounds for f in r.info["first_errors"]]
  if failures:
    metrics["first_reward_error"] = failures[0][:200]
  return batch, metrics


class MultiTurnEvaluator:
  """Greedy multi-turn evaluation of held-out examples: eval/accuracy is the share of episodes solved
  (reward > 0), also per domain, plus eval/turns_mean and the end reasons. Same interface as
  rl/step/evaluation.Evaluator."""

  def __init__(self, cfg, mesh, tokenizer: Tokenizer, examples: list[dict], *,
               make_env: Callable[[dict], Any] = default_env):
    if not examples:
      raise ValueError("no held-out examples to evaluate (eval.num_prompts, data.eval_fraction).")
    self.examples = list(examples)
    processes = jax.process_count()  # each host runs the environments of an equal block of rows
    self.batch_size = -(-min(cfg.eval.batch_size, len(examples)) // processes) * processes
    from meshrl.rl.step.spec import episode_runner  # pylint: disable=import-outside-toplevel
    self.programs = episode_runner(cfg, mesh, tokenizer, group_size=1, temperature=0.0, make_env=make_env,
                                   complete=True)

  def __call__(self, params, extra, key: jax.Array | None = None) -> dict[str, float]:
    key = jax.random.key(0) if key is None else key
    rewards, episodes = [], []
    for start in range(0, len(self.examples), self.batch_size):
      chunk = self.examples[start:start + self.batch_size]
      padded = chunk + [chunk[-1]] * (self.batch_size - len(chunk))  # one compiled batch shape
      out = self.programs.rollout(params, extra, padded, key)
      episodes += out.episodes[:len(chunk)]
      rewards += [e.reward > 0 for e in out.episodes[:len(chunk)]]
    solved = np.asarray(rewards, np.float32)
    domains = [str(e.get("domain", "")) for e in self.examples]
    return {"eval/accuracy": float(solved.mean()), "eval/num_prompts": len(self.examples),
            **per_domain(solved, domains, "eval/accuracy"), **episode_metrics(episodes, "eval/")}

  def close(self) -> None:
    self.programs.close()


# --- warm start and held-out examples ------------------------------------------------------------


def oracle_turns(example: dict) -> list[str] | None:
  """The reference policy turns of an example, when its family has them (else None): the files family's
  oracle; a terminal task's oracle.sh as one command, then `<done>`."""
  if example.get("verifier") == "terminal" and example.get("task_dir"):
    from meshrl.rl.envs.terminal import load_task  # pylint: disable=import-outside-toplevel
    lines = load_task(example["task_dir"]).oracle.strip().splitlines()
    body = "\n".join(line for line in lines if not line.startswith("#!"))
    return [f"<cmd>{body}</cmd>", DONE]
  if example.get("verifier") == file_tasks.VERIFIER:
    return file_tasks.oracle_turns(example)
  return None


class Demonstrations:
  """SFT rows from oracle episodes (the warm start of a multi-turn run), random access like the task
  source it wraps: row i is example i's oracle episode, run in its environment, cut at one policy
  turn (turn i mod turns): {"prompt": the task, earlier turns and observations as the rollout renders
  them, "answer": that turn}. So the warm start trains only on policy turns, in the rollout's own
  layout. Examples without oracle turns are single-turn rows as they are (prompt -> answer).

  With a `tokenizer` and `max_obs_tokens` (rl.max_obs_tokens) each observation is cut as the rollout
  cuts it (episodes.observation_ids), so the policy is trained on the observations it will see: a
  real shell's "owl\n[exit 0]" is longer than the in-memory shell's "owl", and shown whole it taught
  a layout rollouts never give (0% held-out after the sandbox demo's warm start)."""

  read_threads = 8  # rows wait on their environments (a sandbox answers in milliseconds): read 8 at once

  def __init__(self, source, make_env: Callable[[dict], Any] = default_env, *, tokenizer=None,
               max_obs_tokens: int = 0):
    self.source, self.make_env = source, make_env
    self.tokenizer, self.max_obs_tokens = tokenizer, max_obs_tokens

  def _observation(self, text: str) -> str:
    if self.tokenizer is None or not self.max_obs_tokens:
      return render_observation(text)
    ids = observation_ids(self.tokenizer, text, self.max_obs_tokens)
    return "" if ids is None else self.tokenizer.decode(ids)

  def __getitem__(self, index: int) -> dict:
    example = self.source[index]
    turns = oracle_turns(example)
    if turns is None:
      return example
    env = self.make_env(example)
    try:
      text = env.reset(example)
      cut = index % len(turns)
      for turn in turns[:cut]:
        result = env.step(turn)
        text += turn + ("" if result.done else self._observation(result.observation))
    finally:
      if hasattr(env, "close"):  # a sandbox session goes back to its pool (recycled), not to the GC
        env.close()
    return {**example, "prompt": text, "answer": turns[cut]}


def held_out(cfg, *, train_prompts: Sequence[str] = (), pools: dict | None = None) -> list[dict]:
  """Held-out examples for a multi-turn run: a data.domains registry's held-out side (terminal
  domains included, quarantine honoured), else rl/step/evaluation.held_out_examples (eval.jsonl, or
  the eval side of the training mixture with its multi-turn families)."""
  from meshrl.rl.step.evaluation import held_out_examples  # pylint: disable=import-outside-toplevel
  if cfg.data.domains and not cfg.eval.jsonl:
    from meshrl.rl.envs.quality import Quarantine  # pylint: disable=import-outside-toplevel
    from meshrl.rl.envs.registry import DomainMixture, load_domains  # pylint: disable=import-outside-toplevel
    mixture = DomainMixture(load_domains(cfg.data.domains), seed=cfg.seed + 7919, split="eval",
                            eval_fraction=cfg.data.eval_fraction, quarantine=Quarantine(cfg.data.quarantine))
    return mixture.held_out(max(1, cfg.eval.num_prompts // len(mixture.names)))
  return held_out_examples(cfg, train_prompts=train_prompts, pools=pools)
