"""Multi-turn tool episodes on the generation engine: generate a turn, step the environment, feed the
observation into the KV cache.

  runner = EpisodeRunner(cfg, mesh, tokenizer)                # the generator and its slot engine
  out = runner.rollout(params, extra, examples, key, version)  # B = P * G episodes -> MultiTurnRollout
  scored, metrics = collect_multiturn(run, examples, key)      # rl/step/episode_collect.py: the step's collect

An episode is one sample of the generation pool (rl/generation/state.py) and has its own environment
(rl/envs: FileTaskEnv, TerminalEnv with its own sandbox session, SingleTurnEnv, ...). The episodic
scheduler (rl/generation/episodic.py) decodes every episode in a slot until its turn ends (a stop id,
a stop string of rl/envs/base.py such as `</cmd>` or `<done>`, the turn's token limit or the
episode's), pauses it and hands the turn to `_respond`, which steps the environment in a worker thread
(under rl.env_timeout_s) and answers with the rendered observation's tokens (`<out>...</out>`), or ends
the episode. The other slots keep decoding meanwhile (rl.engine = "continuous"); with rl.engine =
"static" every turn waits for every episode's (turn-synchronous). Both give the same episodes: a token
draws with the key (episode, its index among the episode's policy tokens).

The cache of earlier turns is kept and extended, never rebuilt (rl/generation/core.observe). Every
option of the generation core reaches episodes: speculative decoding (rl.speculative), int8 KV cache
and weights, the gathered generation layout, and the MoE routes of every token fed (policy tokens,
observations and prompt), so routing replay replays an episode exactly.

Budgets: at most `max_turns` policy turns, `max_turn_tokens` per turn, `max_new_tokens` (the episode's
columns after the prompt, policy tokens and observations together); when one runs out the environment
gets `<done>`, so the episode is still graded. A malformed tool call is the environment's error
observation, never an exception; an environment that raises or times out ends its episode as an
environment failure (sample_valid False: no gradient, counted apart from wrong answers). Environments
start through the runner's rl/envs/env_work.EnvWork (the scheduler: a start that fails is retried with
backoff); failures given up on, and those mid-episode, count against the task in the run's quarantine.

Output: a RolloutBatch layout [B, S], S = Lp + N, built on the devices from the pool and kept there as
rl/batches/rows.py DeviceRows; `response_mask` is True ONLY on the policy's own tokens.

The stop strings are matched as token sequences: exact for the byte-level tokenizer; a BPE tokenizer
that merges `</cmd>` with neighbouring text may miss one (the turn then ends at its token limit).

Axis legend: P prompts, G group size, B = P * G episodes, Lp prompt length, N episode tokens after the
prompt, S = Lp + N.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.model.tokenizer import Tokenizer
from meshrl.rl.envs import file_tasks
from meshrl.rl.envs.base import DONE, as_text
from meshrl.rl.generation.episodic import EpisodicScheduler, Turn
from meshrl.rl.generation.output import rollout_batch
from meshrl.rl.generation.sampling import sample_keys
from meshrl.rl.step.partial import GroupSlots, batch_rows, group_rows
from meshrl.sharding import hosts
from meshrl.sharding.rules import logical_to_spec

OBS_OPEN, OBS_CLOSE = "<out>", "</out>"
ENDS = ("done", "max_turns", "token_budget", "context", "env_failure")


def render_observation(text: str) -> str:
  """How an observation is shown to the policy, between its turns."""
  return f"{OBS_OPEN}{text}{OBS_CLOSE}"


def observation_ids(tokenizer, text: str, limit: int) -> list[int] | None:
  """The rendered observation in at most `limit` tokens (rl.max_obs_tokens, or the room left): its
  head, then always the closing tag (None when not even the tags and one token fit). Rollouts feed
  these; the warm start's demonstrations show the same cut (episode_collect.Demonstrations)."""
  close = tokenizer.encode(OBS_CLOSE, add_bos=False)
  head = tokenizer.encode(OBS_OPEN + text, add_bos=False)
  if limit - len(close) <= len(tokenizer.encode(OBS_OPEN, add_bos=False)):
    return None
  return head[:limit - len(close)] + close


EPISODE_FAMILIES = {file_tasks.FAMILY: file_tasks.TaskPool}  # data.tasks names served as pools


def episode_pools(cfg) -> dict:
  """{name: pool} of the multi-turn families data.tasks names (for TaskMixture's `pools`)."""
  names = [part.split(":")[0].strip() for part in str(cfg.data.tasks).split(",")]
  return {name: EPISODE_FAMILIES[name](cfg.data.difficulty, cfg.seed, cfg.rl.env_backend) for name in names
          if name in EPISODE_FAMILIES}


def default_env(example: dict):
  """The environment an example names: "files" in its backend (FileTaskEnv in memory, or
  rl/envs/file_sandbox.FileSandboxEnv in a sandbox session), TerminalEnv ("terminal"), else a
  SingleTurnEnv scored by rl.rewards.answer_reward."""
  from meshrl.rl.envs.driver import env_for  # pylint: disable=import-outside-toplevel
  if example.get("verifier") == file_tasks.VERIFIER:
    from meshrl.rl.envs.file_sandbox import file_env  # pylint: disable=import-outside-toplevel
    return file_env(example)
  return env_for(example)


@dataclasses.dataclass(frozen=True)
class EpisodeBudget:
  """The host's budgets of one episode (the generation core enforces the token limits)."""
  max_turns: int
  max_obs_tokens: int
  prompt_len: int  # Lp
  episode_len: int  # N: columns after the prompt (policy tokens and observations)
  env_workers: int
  env_timeout_s: float


# --- the host side of an episode --------------------------------------------------------------------


@dataclasses.dataclass
class EpisodeStats:
  reward: float = 0.0
  end: str = ""  # one of ENDS
  turns: int = 0
  policy_tokens: int = 0
  obs_tokens: int = 0
  malformed_calls: int = 0
  env_failure: str | None = None


@dataclasses.dataclass
class MultiTurnRollout:
  arrays: dict  # the RolloutBatch fields: per-token [B, S] as rl/batches/rows.DeviceRows (on the devices),
  #               lengths and truncated [B] numpy on every host, routing as rl/batches/routes.RoutingRows
  episodes: list[EpisodeStats]  # [B]
  texts: list[str]  # [B] the episode after the prompt, as text
  counts: dict[str, Any]  # prefill_tokens (prompts, once), extend_tokens (observations), extend_calls, ...


class _Failed:
  """An environment call that raised or timed out, shaped like a StepResult."""

  def __init__(self, reason: str):
    self.observation, self.reward, self.done, self.info = "", 0.0, True, {"env_failure": reason}


class TimedWorkers:
  """A thread pool whose futures also resolve (to `_Failed`) when a call runs past `timeout_s` after
  a worker picked it up; the thread cannot be killed and finishes on its own (sandboxed commands have
  their own limits), its result dropped."""

  def __init__(self, workers: int, timeout_s: float):
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="env")
    self.timeout_s = timeout_s
    self._watch: dict[concurrent.futures.Future, list] = {}
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._watchdog = threading.Thread(target=self._run_watchdog, name="env-watchdog", daemon=True)
    self._watchdog.start()

  def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
    """A Future of fn()'s result, of _Failed(reason) if it raises or times out."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    started = [None]

    def call():
      started[0] = time.monotonic()
      try:
        result = fn()
      except Exception as error:  # pylint: disable=broad-except  (an environment failure, not ours)
        result = _Failed(f"{type(error).__name__}: {error}")
      with self._lock:
        self._watch.pop(out, None)
      _resolve(out, result)
    with self._lock:
      self._watch[out] = started
    self._pool.submit(call)
    return out

  def chain(self, first: concurrent.futures.Future, then: Callable[[Any], Any]) -> concurrent.futures.Future:
    """A Future of then(first's result), run in a worker once `first` resolves."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(future):
      inner = self.submit(lambda: then(future.result()))
      inner.add_done_callback(lambda f: out.set_result(f.result()))
    first.add_done_callback(done)
    return out

  def _run_watchdog(self) -> None:
    while not self._stop.wait(0.05):
      now = time.monotonic()
      with self._lock:
        late = [f for f, started in self._watch.items() if started[0] is not None and now - started[0] > self.timeout_s]
        for future in late:
          self._watch.pop(future)
      for future in late:  # resolved outside the lock: a callback may submit more work
        _resolve(future, _Failed(f"environment call timed out after {self.timeout_s:g} s"))

  def close(self) -> None:
    self._stop.set()
    self._pool.shutdown(wait=False, cancel_futures=True)


def _resolve(future: concurrent.futures.Future, result) -> None:
  """Sets `result` unless the future is resolved already (a call that finishes after its timeout)."""
  try:
    future.set_result(result)
  except concurrent.futures.InvalidStateError:
    pass


class _Episode:
  """Host record of one episode: its environment and stats (on the host that runs it)."""

  def __init__(self, env, max_turns: int):
    self.env, self.max_turns = env, max_turns
    self.stats = EpisodeStats()
    self.counted = False  # its environment failure is already counted against its task (at reset)

  def finish(self, result, end: str) -> None:
    self.stats.reward, self.stats.end = float(result.reward), end
    if result.info.get("env_failure"):
      self.stats.env_failure, self.stats.end = str(result.info["env_failure"]), "env_failure"

  def fail(self, reason: str) -> None:
    self.stats.env_failure, self.stats.end, self.stats.reward = reason, "env_failure", 0.0

  def close(self) -> None:
    close = getattr(self.env, "close", None)
    if close is not None:
      try:
        close()
      except Exception:  # pylint: disable=broad-except  (a failing cleanup must not end the run)
        pass


class EpisodeRunner:
  """The generator of a multi-turn run and the host loop around it (see the module docstring). Built
  once per run; compiles on first use.

  generator: rl/generation/generator.Generator whose spec has pause_on_stop and the turn limit
  (rl/step/spec.py builds it); budget: the host's budgets; tokenizer; make_env(example) -> environment;
  env_work: rl/envs/env_work.EnvWork that starts the environments (the scheduler: priorities, quotas,
  retries with backoff) and counts their failures in the run's quarantine (default: its own, in
  memory, with default retries)."""

  def __init__(self, generator, budget: EpisodeBudget, tokenizer: Tokenizer, *, mesh=None, rules=None,
               make_env: Callable[[dict], Any] = default_env, env_work=None):
    from meshrl.rl.envs.env_work import EnvWork  # pylint: disable=import-outside-toplevel
    self.generator, self.budget, self.tokenizer, self.make_env = generator, budget, tokenizer, make_env
    self.env_work = EnvWork(workers=budget.env_workers) if env_work is None else env_work
    self.spec = generator.spec
    self.mesh, self.rules = mesh, rules
    self.workers = TimedWorkers(budget.env_workers, budget.env_timeout_s)
    self._engines: dict[int, Any] = {}

  def close(self) -> None:
    self.workers.close()

  def scheduler(self, num: int) -> EpisodicScheduler:
    """A scheduler of `num` episodes (its own answers in flight) over the slot engine of that size
    (its compiled programs shared by every scheduler of the size)."""
    if num not in self._engines:
      self._engines[num] = self.generator.slot_engine(num_slots=self.spec.num_slots(num))
    own = hosts.share(num)
    return EpisodicScheduler(self._engines[num], chunk_steps=self.spec.chunk_steps, barrier=self.spec.barrier,
                             max_obs_tokens=self.budget.max_obs_tokens,
                             turn_width=self.spec.step.turn_tokens or self.spec.columns,
                             owns=lambda b: own.start <= b < own.stop, host_bytes=self.spec.kv_host_bytes)

  def weights(self, params, extra) -> tuple:
    """The slot engine's weights argument (generation params, extra, draft params), made now. The
    generator's own_weights (asynchronous RL) makes them copies the next update cannot donate away;
    `extra` is copied then too."""
    gen_params, draft_params = self.generator.weights(params)
    if self.generator.own_weights:
      extra = jax.tree.map(jnp.copy, extra)
    return gen_params, extra, draft_params

  # --- environments -------------------------------------------------------------------------------

  def _answer(self, episode: _Episode, turn: Turn, result) -> list[int] | None:
    """After the environment's step: the observation's tokens, or None when the episode ends (with
    `<done>` sent for a budget's end, so it is graded). Runs in a worker thread."""
    budget, stats = self.budget, episode.stats
    if isinstance(result, _Failed):
      episode.fail(result.info["env_failure"])
      return None
    stats.malformed_calls += "error" in result.info
    if result.done or result.info.get("env_failure"):
      episode.finish(result, "done")
      return None
    if stats.turns >= episode.max_turns:
      return self._end(episode, "max_turns")
    if turn.generated >= self.spec.max_new_tokens:
      return self._end(episode, "token_budget")
    room = budget.episode_len - (turn.count - budget.prompt_len) - 1  # and one more policy token
    ids = observation_ids(self.tokenizer, result.observation, min(room, budget.max_obs_tokens))
    if ids is None:
      return self._end(episode, "context")
    stats.obs_tokens += len(ids)
    return ids

  def _end(self, episode: _Episode, end: str) -> None:
    """Sends `<done>` so the episode is graded, and records how it ended."""
    try:
      result = episode.env.step(DONE)
    except Exception as error:  # pylint: disable=broad-except
      episode.fail(f"{type(error).__name__}: {error}")
      return
    episode.finish(result, end)

  def _respond(self, episodes: dict[int, _Episode], turn: Turn) -> concurrent.futures.Future:
    """The answer to a finished turn (a Future), stepping its environment in a worker."""
    episode = episodes[turn.sample]
    episode.stats.policy_tokens = turn.generated
    if not len(turn.tokens):  # no room was left for a policy token
      return self.workers.submit(lambda: self._end(episode, "context"))
    episode.stats.turns += 1
    text, _ = as_text(self.tokenizer.decode(turn.tokens))
    stepped = self.workers.submit(lambda: episode.env.step(text))
    return self.workers.chain(stepped, lambda result: self._answer(episode, turn, result))

  def _reset(self, example: dict):
    env = self.make_env(example)
    return env, env.reset(example)

  def _start_envs(self, rows: dict[int, dict]) -> dict[int, Any]:
    """{b: (env, first observation) or _Failed} for the episodes `rows` {b: example}: each reset is a
    job of the EnvWork's scheduler (by the example's domain) running in a worker under
    rl.env_timeout_s; a reset that raises or times out is an environment failure (no policy action
    yet), retried with backoff; one given up on is counted against its task."""
    from meshrl.rl.envs.scheduler import EnvFailure  # pylint: disable=import-outside-toplevel

    def start(example):
      result = self.workers.submit(lambda: self._reset(example)).result()
      if isinstance(result, _Failed):
        raise EnvFailure(result.info["env_failure"])
      return result
    order = sorted(rows)
    done = self.env_work.run([(str(rows[b].get("domain", "")), rows[b]) for b in order], start)
    return {b: r.value if r.failure is None else _Failed(r.failure) for b, r in zip(order, done)}

  def count_failures(self, episodes: dict[int, _Episode], example_of: Callable[[int], dict]) -> None:
    """Counts the environment failures of ended episodes not counted yet (mid-episode: a step that
    raised or timed out) against their tasks in the quarantine."""
    for b, episode in episodes.items():
      if episode.stats.env_failure and not episode.counted:
        episode.counted = True
        self.env_work.record(example_of(b), episode.stats.env_failure)

  # --- the rollout ----------------------------------------------------------------------------------

  def _rows_sharding(self, rows: int) -> NamedSharding | None:
    """[rows, ...] split over the mesh axes of the `batch` rule that divide `rows` (None: no mesh)."""
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, logical_to_spec(("batch",), self.rules, self.mesh, shape=(rows,)))

  def split_rows(self, pool):
    """The pool with every [B, ...] field split by rows over the mesh axes of the `batch` rule that
    divide B (routes [L, B, S, K] on their B axis), so no device holds every episode's tokens; the
    slot engine's programs keep that layout. As it is without a mesh."""
    if self.mesh is None:
      return pool
    rows = self._rows_sharding(pool.num_samples)
    spec = rows.spec[0] if len(rows.spec) else None

    def put(name, value):
      if value is None:
        return None
      axes = (None, spec) if name == "routing" else (spec,)
      return jax.device_put(value, NamedSharding(self.mesh, PartitionSpec(*axes)))
    return pool.replace(**{f.name: put(f.name, getattr(pool, f.name)) for f in dataclasses.fields(pool)})

  def _encode_prompts(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Left-padded prompt tokens [P, Lp] and mask; over-long prompts keep their last Lp tokens."""
    tok, length = self.tokenizer, self.spec.prompt_len
    rendered = [tok.render_prompt(t) for t in texts]
    truncated = sum(len(tok.encode(r)) > length for r in rendered)
    ids, mask = tok.encode_batch(rendered, length=length, padding="left", overflow="truncate")
    return np.asarray(ids, np.int32), np.asarray(mask, bool), int(truncated)

  def _start(self, examples: Sequence[dict]):
    """Each host resets the environments of its own episodes (in workers); returns (episodes {b:
    _Episode} of this host, prompts [P, Lp], mask, counts). When every host's episodes are an equal
    block of whole groups, each encodes its own groups' prompts (their first observations) into one
    global array; otherwise (rl/step/groups.shared_prompts) the first observations are shared and every host
    encodes every prompt."""
    group = self.spec.group_size
    per_row = [e for e in examples for _ in range(group)]
    num = len(per_row)
    own = hosts.share(num)
    results = self._start_envs({b: e for b, e in enumerate(per_row) if own.start <= b < own.stop})
    local_prompts = hosts.is_multihost() and len(examples) % jax.process_count() == 0
    shared = dict(hosts.gather_objects([
        [b, ["" if local_prompts else None, r.info["env_failure"]] if isinstance(r, _Failed)
         else [None if local_prompts else r[1], None]] for b, r in sorted(results.items())]))
    episodes, prompts_text, failed = {}, [], []
    for b, example in enumerate(per_row):
      first, failure = shared[b]
      if b in results:
        max_turns = max(1, min(self.budget.max_turns, int(example.get("max_turns", self.budget.max_turns))))
        episodes[b] = _Episode(None if failure is not None else results[b][0], max_turns)
        if failure is not None:
          episodes[b].fail(failure)
          episodes[b].counted = True  # by the scheduler, once out of retries
        elif local_prompts:
          first = results[b][1]
      if failure is not None:
        failed.append(b)
      if b % group == 0 and (not local_prompts or own.start <= b < own.stop):
        prompts_text.append(first if first is not None and failure is None else str(example.get("prompt", "")))
    prompts, mask, truncated = self._encode_prompts(prompts_text)
    prefill_tokens = int(mask.sum())
    if local_prompts:
      split = self._rows_sharding(len(examples))
      prompts, mask = hosts.global_rows(prompts, split), hosts.global_rows(mask, split)
      sums = hosts.gather_rows(np.asarray([[truncated, prefill_tokens]])).sum(axis=0)
      truncated, prefill_tokens = int(sums[0]), int(sums[1])
    return episodes, prompts, mask, failed, {"prefill_tokens": prefill_tokens, "prompts_truncated": truncated}

  def rollout(self, params, extra, examples: Sequence[dict], key: jax.Array, version: int = 0, *,
              weights: tuple | None = None) -> MultiTurnRollout:
    """B = len(examples) * G episodes, example p's on rows p*G .. p*G+G-1. weights: `self.weights`
    made earlier (an asynchronous rollout's snapshot); default made now from params / extra."""
    num = len(examples) * self.spec.group_size
    episodes, prompts, mask, failed, counts = self._start(examples)
    pool = self.generator.new_pool(jnp.asarray(prompts), jnp.asarray(mask), sample_keys(key, jnp.arange(num)))
    if failed:  # an environment that failed at reset: its episode never decodes
      pool = pool.replace(done=pool.done.at[jnp.asarray(failed)].set(True))
    pool = self.split_rows(pool)
    weights = self.weights(params, extra) if weights is None else weights
    pool, stats = self.scheduler(num).run(weights, pool, prompts, mask, lambda turn: self._respond(episodes, turn),
                                          version=version)
    for episode in episodes.values():
      episode.close()
    self.count_failures(episodes, lambda b: examples[b // self.spec.group_size])
    return self.output(pool, episodes, np.arange(num), counts, stats)

  def output(self, pool, episodes: dict[int, _Episode], rows: np.ndarray, counts: dict, stats, *,
             carried: bool = False) -> MultiTurnRollout:
    """The episodes of pool rows `rows` (all of them, or a partial step's ended groups) as the step
    takes them: per-token fields kept on the devices, stats and texts gathered from their hosts.

    carried: the pool lives on (partial episodes), and its next step's programs donate its buffers,
    possibly in another thread while this step still reads its batch (asynchronous RL): the routes,
    the one field the batch would otherwise share with the pool, are then taken as a copy of the
    ended rows (a shared buffer donated under a running read crashed XLA:CPU with a segfault)."""
    arrays = batch_rows(rollout_batch(pool, self.spec.prompt_len, self.spec.step.pad_id), rows, copy_routes=carried)
    own = hosts.share(pool.num_samples)
    wanted = set(int(b) for b in rows)
    tokens, count, lp = hosts.share_to_host(pool.tokens), hosts.to_host(pool.count), self.spec.prompt_len
    mine = [[b, dataclasses.asdict(episodes[b].stats),
             self.tokenizer.decode(tokens[b - own.start, lp:count[b]], stop_at_eos=False)]
            for b in range(own.start, own.stop) if b in wanted]  # gathered from the hosts that ran them
    gathered = {int(b): (EpisodeStats(**s), text) for b, s, text in hosts.gather_objects(mine)}
    chosen = [gathered[int(b)][0] for b in rows]
    arrays["truncated"] = np.asarray([s.end != "done" for s in chosen], bool)
    counts = dict(counts, extend_tokens=stats.extend_tokens, extend_slots=stats.extend_slots,
                  extend_calls=stats.extend_calls, decode_calls=stats.decode_calls, host_wait_s=stats.host_wait_s,
                  **{k: float(v) for k, v in jax.device_get(stats.counters.metrics()).items()})
    return MultiTurnRollout(arrays=arrays, episodes=chosen, texts=[gathered[int(b)][1] for b in rows], counts=counts)


class PartialEpisodes(GroupSlots):
  """Multi-turn episodes carried across RL steps (rl.rollout_token_budget with rl.multi_turn): a pool
  of `num_groups` groups of episodes; each step tops it up with new groups, decodes at most
  budget // slots steps of the episodic scheduler and returns the groups whose episodes have all
  finished. An unfinished episode keeps everything: its tokens, log-probs, versions and routes in the
  pool, its environment (with whatever its sandbox session holds), and an environment step still
  running when the step's budget ran out, whose answer is fed at the next step. Its tokens resume
  under the next step's parameters, re-prefilled from the pool (rl/generation/core.resume), as
  single-turn partial rollouts do (rl/step/partial.py)."""

  def __init__(self, runner: EpisodeRunner, num_groups: int):
    if not runner.spec.token_budget:
      raise ValueError("partial episodes need rl.rollout_token_budget > 0.")
    super().__init__(runner.generator, num_groups)
    self.runner = runner
    self.scheduler = runner.scheduler(num_groups * self.group_size)  # its answers in flight are carried with it
    self.episodes: dict[int, _Episode] = {}
    self.restart: list = []  # examples of groups a checkpoint held unfinished: admitted first

  def _admit(self, draw, key) -> int:
    """Fresh groups into the free group slots, their environments reset: the groups to restart
    (`set_state`) first, then draw(count) -> examples."""
    free = np.flatnonzero(~self.live)
    if not free.size:
      return 0
    examples, self.restart = self.restart[:free.size], self.restart[free.size:]
    if len(examples) < free.size:
      examples = examples + draw(int(free.size) - len(examples))
    episodes, prompts, mask, failed, _ = self.runner._start(examples)  # pylint: disable=protected-access
    self._place(free, examples, prompts, mask, key, failed)
    self.pool = self.runner.split_rows(self.pool)
    rows = group_rows(free, self.group_size)
    self.episodes.update({int(rows[b]): episode for b, episode in episodes.items()})
    return int(free.size)

  def step(self, params, extra, draw, key, version, *, weights=None):
    """One step's episodes -> (MultiTurnRollout of the groups that finished, their examples, info).
    weights: the runner's weights made beforehand (asynchronous RL runs this in a thread on a
    snapshot; then params and extra are not read)."""
    admitted = self._admit(draw, key)
    weights = self.runner.weights(params, extra) if weights is None else weights
    self.pool, stats = self.scheduler.run(weights, self.pool, self.prompts, self.prompt_mask,
                                          lambda turn: self.runner._respond(self.episodes, turn),  # pylint: disable=protected-access
                                          version=version, max_steps=self.spec.max_steps(self.pool.num_samples))
    ended, rows = self._harvest(self.pool.done)
    out = self.runner.output(self.pool, self.episodes, rows, {"prefill_tokens": 0, "prompts_truncated": 0}, stats,
                             carried=True)
    self.runner.count_failures({int(b): self.episodes[int(b)] for b in rows if int(b) in self.episodes},
                               lambda b: self.examples[b // self.group_size])
    for b in rows:
      episode = self.episodes.pop(int(b), None)
      if episode is not None:
        episode.close()
    self.metrics = out.counts
    return out, [self.examples[g] for g in ended], self._info(admitted, ended)

  def get_state(self) -> dict:
    """The examples of the groups still running (JSON, for the checkpoint's extra state); {} when
    none is. Their episodes are not saved: an environment (a sandbox session, a command still
    running) cannot be, so a resumed run starts these groups again from their prompts, ahead of new
    ones, and no task the stream handed out is lost."""
    running = [self.examples[g] for g in np.flatnonzero(self.live)] + self.restart
    return {"restart": running} if running else {}

  def set_state(self, state: dict) -> None:
    """Continues from `get_state()`'s output: its groups are the next ones admitted."""
    self.restart = list(state.get("restart", []))
