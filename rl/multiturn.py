"""Multi-turn tool episodes in the rollout: generate a turn, step the environment, extend the KV cache.

  programs = make_multiturn(cfg, mesh, tokenizer)               # jitted prefill / decode_turn / extend
  out = programs.rollout(params, extra, examples, key)          # B = P * G episodes -> MultiTurnRollout
  scored, metrics = collect_multiturn(run, examples, key)       # rl/multiturn_step.py: the RL step's collect

An episode is one row of a batch. Each row has its own environment (rl/envs: SingleTurnEnv, TerminalEnv
with its own sandbox work directory, FileTaskEnv, ...). Per turn:
  1. `decode_turn` (jit): every active row samples tokens until its turn ends: the EOS / stop ids, a stop
     STRING of rl/envs/base.py (`</cmd>`, `<done>`; several tokens each, matched against the row's last
     tokens inside the loop), or the row's token limit for this turn (turn, episode and context budgets);
  2. the host decodes each turn, steps the environments in threads under a per-call timeout, and
     tokenises the observations (wrapped as `<out>...</out>`);
  3. `extend` (jit): prefills ONLY the observation tokens into each row's KV cache at that row's own write
     index (kv_cache `with_row_index`), padded to a few bucket lengths (powers of two up to
     rl.max_obs_tokens) so at most a handful of shapes compile.
The cache of earlier turns is kept and extended, never rebuilt: `MultiTurnRollout.counts` reports the
prompt tokens prefilled once and the observation tokens extended, and tests/rl/test_multiturn.py checks
that the logits after an extension equal a full re-prefill of the conversation.

Budgets follow rl/envs/episode.py: at most `max_turns` policy turns, `max_turn_tokens` per turn,
`max_episode_tokens` policy tokens, `env_timeout_s` per environment call; when one runs out the
environment gets `<done>`, so the episode is still graded. A malformed tool call is the environment's
error observation, never an exception; an environment that raises or times out ends its episode as an
environment failure (sample_valid False: no gradient, counted apart from wrong answers).

Output: a RolloutBatch layout [B, S], S = Lp + N (rl.max_prompt_len + rl.max_new_tokens), built on the
devices (rl/episodes.py: written after every turn and extension, then `assemble`d) and kept there as rl/rows.py
DeviceRows split by rows, like the single-turn rollout's: the host keeps each row's length and, for
the rows whose environments it runs, their tokens (their texts); only those rows' turn tokens come to it.
The prompt left-padded, then the whole episode (policy turns and observations) right-padded;
`response_mask` is True ONLY on the policy's own tokens (so rl/batches.py's loss_mask and the update's
log-probs and loss cover only them), `logprobs` the behaviour log-probs there; the reward is the
episode's. The cache has `max_obs_tokens` slots of slack past S so a padded extension never wraps.

The stop strings are matched as token sequences: exact for the byte-level tokenizer; a BPE tokenizer
that merges `</cmd>` with neighbouring text may miss one (the turn then ends at its token limit).

Axis legend: P prompts, G group size, B = P * G episodes, Lp prompt length, N episode tokens after the
prompt, S = Lp + N, C = S + max_obs_tokens cache slots, Nt tokens per turn, T observation bucket, V vocab.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding

from meshrl.model import kv_cache as kvc
from meshrl.model.tokenizer import Tokenizer
from meshrl.model.transformer import Transformer
from meshrl.rl.envs import file_tasks
from meshrl.rl.envs.base import DONE, STOP_STRINGS, StepResult, as_text
from meshrl.rl.episodes import append, assemble, empty_episodes
from meshrl.rl.rollout import prompt_layout, rollout_model_config, rollout_rows
from meshrl.rl.sampling import Sampler, sample_keys, token_keys
from meshrl.sharding import hosts
from meshrl.sharding.rules import logical_to_spec, rules_from_config

OBS_OPEN, OBS_CLOSE = "<out>", "</out>"
ENDS = ("done", "max_turns", "token_budget", "context", "env_failure")


def render_observation(text: str) -> str:
  """How an observation is shown to the policy, between its turns."""
  return f"{OBS_OPEN}{text}{OBS_CLOSE}"


def buckets(max_obs_tokens: int) -> tuple[int, ...]:
  """Observation chunk lengths: powers of two from 8, and max_obs_tokens itself."""
  sizes, size = [], 8
  while size < max_obs_tokens:
    sizes.append(size)
    size *= 2
  return tuple(sizes) + (max_obs_tokens,)


EPISODE_FAMILIES = {file_tasks.FAMILY: file_tasks.TaskPool}  # data.tasks names served as pools


def episode_pools(cfg) -> dict:
  """{name: pool} of the multi-turn families data.tasks names (for TaskMixture's `pools`)."""
  names = [part.split(":")[0].strip() for part in str(cfg.data.tasks).split(",")]
  return {name: EPISODE_FAMILIES[name](cfg.data.difficulty, cfg.seed) for name in names
          if name in EPISODE_FAMILIES}


def default_env(example: dict):
  """The environment an example names: FileTaskEnv ("files"), TerminalEnv ("terminal"), else a
  SingleTurnEnv scored by rl.rewards.answer_reward."""
  from meshrl.rl.envs.driver import env_for  # pylint: disable=import-outside-toplevel
  if example.get("verifier") == file_tasks.VERIFIER:
    return file_tasks.FileTaskEnv()
  return env_for(example)


# --- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec:
  group_size: int
  prompt_len: int  # Lp
  episode_len: int  # N: tokens after the prompt (policy turns and observations)
  max_turns: int
  max_turn_tokens: int  # Nt
  max_episode_tokens: int  # policy tokens of one episode
  max_obs_tokens: int  # observation tokens per turn (longer ones keep their head)
  sampler: Sampler
  stop_ids: tuple[int, ...]
  stop_sequences: tuple[tuple[int, ...], ...]
  pad_id: int
  env_workers: int
  env_timeout_s: float

  @property
  def cache_len(self) -> int:
    return self.prompt_len + self.episode_len + self.max_obs_tokens

  @classmethod
  def from_config(cls, cfg, tokenizer: Tokenizer, *, group_size: int | None = None,
                  temperature: float | None = None) -> "MultiTurnSpec":
    """The multi-turn rollout of cfg.rl (validated, `check_multiturn_config`); `group_size` /
    `temperature` override it (evaluation: 1 and 0)."""
    check_multiturn_config(cfg)
    rl = cfg.rl
    sequences = tuple(tuple(tokenizer.encode(s, add_bos=False)) for s in STOP_STRINGS)
    return cls(group_size=rl.group_size if group_size is None else group_size,
               prompt_len=rl.max_prompt_len, episode_len=rl.max_new_tokens, max_turns=rl.max_turns,
               max_turn_tokens=min(rl.max_turn_tokens, rl.max_new_tokens),
               max_episode_tokens=rl.max_new_tokens, max_obs_tokens=rl.max_obs_tokens,
               sampler=Sampler(rl.temperature if temperature is None else temperature, rl.top_k, rl.top_p),
               stop_ids=tuple(tokenizer.stop_ids), stop_sequences=sequences, pad_id=tokenizer.pad_id,
               env_workers=rl.env_workers, env_timeout_s=float(rl.env_timeout_s))


def check_multiturn_config(cfg) -> None:
  """Raises ValueError naming the field for a multi-turn setting it cannot serve."""
  rl = cfg.rl
  for field in ("max_turns", "max_turn_tokens", "max_obs_tokens", "env_workers"):
    if isinstance(rl[field], bool) or not isinstance(rl[field], int) or rl[field] < 1:
      raise ValueError(f"rl.{field}={rl[field]!r} must be an integer >= 1.")
  if not rl.env_timeout_s > 0:
    raise ValueError(f"rl.env_timeout_s={rl.env_timeout_s!r} must be positive.")
  if not wants_multi_turn(cfg):
    if episode_pools(cfg):
      raise ValueError(f"data.tasks={cfg.data.tasks!r} names multi-turn families "
                       f"{sorted(episode_pools(cfg))}: set rl.multi_turn=true.")
    return
  unsupported = [(rl.engine != "static", f"rl.engine={rl.engine!r} (use 'static')"),
                 (rl.rollout_token_budget > 0, f"rl.rollout_token_budget={rl.rollout_token_budget}"),
                 (rl.max_staleness > 0, f"rl.max_staleness={rl.max_staleness} (asynchronous RL)"),
                 (rl.pack_updates, "rl.pack_updates=True"),
                 (cfg.moe.num_experts > 0 and rl.replay_routing,
                  "rl.replay_routing=True with MoE layers (the episode's routing is not recorded)")]
  for field, plain in (("speculative", "none"), ("kv_cache_dtype", "model"), ("generation_weights", "full"),
                       ("generation_layout", "train")):  # generation options of the static rollout
    unsupported.append((rl.get(field, plain) != plain, f"rl.{field}={rl.get(field, plain)!r}"))
  bad = [text for flag, text in unsupported if flag]
  if bad:
    raise ValueError(f"rl.multi_turn=True cannot be combined with {'; '.join(bad)}: the multi-turn "
                     "rollout (rl/multiturn.py) runs synchronously on the static engine.")
  cache = rl.max_prompt_len + rl.max_new_tokens + rl.max_obs_tokens
  if cache > cfg.model.max_seq_len:
    raise ValueError(f"rl.multi_turn: rl.max_prompt_len={rl.max_prompt_len} + rl.max_new_tokens="
                     f"{rl.max_new_tokens} + rl.max_obs_tokens={rl.max_obs_tokens} (the KV cache's slack "
                     f"for a padded observation) = {cache} exceeds model.max_seq_len="
                     f"{cfg.model.max_seq_len}.")


def wants_multi_turn(cfg) -> bool:
  """Whether the run's episodes are multi-turn: rl.multi_turn. (A data.domains registry with terminal
  task domains, or data.tasks naming a multi-turn family, is refused without it, naming the flag.)"""
  return bool(cfg.rl.multi_turn)


# --- the jitted programs ------------------------------------------------------------------------


@struct.dataclass
class _TurnState:
  step: jax.Array  # [] int32
  cache: kvc.KVCache  # per-row index [B]
  logits: jax.Array  # [B, V] logits of each row's next token
  positions: jax.Array  # [B] int32 position of each row's next token
  tokens: jax.Array  # [B, Nt] int32
  logprobs: jax.Array  # [B, Nt] float32
  done: jax.Array  # [B] bool
  stopped: jax.Array  # [B] bool: ended by a stop id or stop string (not by its limit)
  window: jax.Array  # [B, W] int32: the row's last W tokens of this turn (-1 before the first)


def _stop_table(sequences: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  """(ids [M, W] right-aligned, -1 padded; mask [M, W]) of M stop sequences, W the longest."""
  width = max(len(s) for s in sequences)
  ids = np.full((len(sequences), width), -1, np.int32)
  for i, s in enumerate(sequences):
    ids[i, width - len(s):] = s
  return ids, ids >= 0


def prefill(model: Transformer, spec: MultiTurnSpec, prompts, prompt_mask):
  """prompts [P, Lp] left-padded -> (cache with per-row index [B], logits [B, V], positions [B]):
  each prompt prefilled once and shared by its G rows."""
  positions, segment_ids = prompt_layout(prompt_mask)
  out = model(prompts, positions=positions, segment_ids=segment_ids,
              cache=model.init_cache(prompts.shape[0], spec.cache_len))
  group = spec.group_size
  cache = kvc.with_row_index(kvc.repeat_rows(out.cache, group))
  lengths = jnp.repeat(jnp.sum(prompt_mask, axis=1), group).astype(jnp.int32)
  return cache, jnp.repeat(out.logits[:, -1], group, axis=0), lengths


def decode_turn(model: Transformer, spec: MultiTurnSpec, cache, logits, positions, limits, key):
  """One turn of every row with limits[b] > 0 (others are left as they are).

  cache: per-row index; logits [B, V]; positions [B] of each row's next token; limits [B] int32 the
  row's token limit this turn (<= Nt). Row b's t-th token of the turn uses key (key, b, t).
  Returns (cache, logits, positions, tokens [B, Nt], logprobs [B, Nt], lengths [B], stopped [B])."""
  batch, width = logits.shape[0], spec.max_turn_tokens
  stop_ids = jnp.asarray(spec.stop_ids, jnp.int32)
  table, table_mask = (jnp.asarray(a) for a in _stop_table(spec.stop_sequences))
  keys = sample_keys(key, jnp.arange(batch))

  def keep_going(s: _TurnState):
    return (s.step < width) & ~jnp.all(s.done)

  def one(s: _TurnState) -> _TurnState:
    token = spec.sampler.sample_rows(s.logits, token_keys(keys, s.step))
    logprob = spec.sampler.log_probs(s.logits, token)
    live = ~s.done
    token = jnp.where(live, token, spec.pad_id)
    column = (0, s.step)
    tokens = jax.lax.dynamic_update_slice(s.tokens, token[:, None], column)
    logprobs = jax.lax.dynamic_update_slice(s.logprobs, jnp.where(live, logprob, 0.0)[:, None], column)
    window = jnp.where(live[:, None], jnp.concatenate([s.window[:, 1:], token[:, None]], axis=1), s.window)
    matched = jnp.any(jnp.all((window[:, None, :] == table[None]) | ~table_mask[None], axis=2), axis=1)
    stopped = s.stopped | (live & (jnp.isin(token, stop_ids) | matched))
    done = s.done | stopped | (s.step + 1 >= limits)
    # Every row runs the model; a row that is not live writes an empty slot (EMPTY position, segment
    # 0: masked for everyone) at its index and does not advance, so its next real token overwrites it.
    index = s.cache.index
    out = model(token[:, None], positions=jnp.where(live, s.positions, kvc.EMPTY_POSITION)[:, None],
                segment_ids=live.astype(jnp.int32)[:, None], cache=s.cache)
    step_live = live.astype(jnp.int32)
    return _TurnState(step=s.step + 1, cache=out.cache.replace(index=index + step_live),
                      logits=jnp.where(live[:, None], out.logits[:, 0], s.logits),
                      positions=s.positions + step_live, tokens=tokens, logprobs=logprobs, done=done,
                      stopped=stopped, window=window)

  state = _TurnState(step=jnp.zeros((), jnp.int32), cache=cache, logits=logits, positions=positions,
                     tokens=jnp.full((batch, width), spec.pad_id, jnp.int32),
                     logprobs=jnp.zeros((batch, width), jnp.float32), done=limits < 1,
                     stopped=jnp.zeros((batch,), bool),
                     window=jnp.full((batch, table.shape[1]), -1, jnp.int32))
  final = jax.lax.while_loop(keep_going, one, state)
  lengths = (final.positions - positions).astype(jnp.int32)
  return (final.cache, final.logits, final.positions, final.tokens, final.logprobs, lengths,
          final.stopped)


def extend(model: Transformer, cache, logits, positions, observations, lengths):
  """Prefills observations [B, T] (right-padded; row b's first lengths[b] are real) at each row's own
  write index; rows with length 0 keep their cache contents, logits and position.
  Returns (cache, logits [B, V] after each row's last observation token, positions [B])."""
  span = observations.shape[1]
  real = jnp.arange(span)[None, :] < lengths[:, None]  # [B, T]
  index = cache.index
  obs_positions = jnp.where(real, positions[:, None] + jnp.arange(span), kvc.EMPTY_POSITION)  # [B, T]
  out = model(observations, positions=obs_positions, segment_ids=real.astype(jnp.int32), cache=cache)
  last = jnp.take_along_axis(out.logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  return (out.cache.replace(index=index + lengths), jnp.where((lengths > 0)[:, None], last, logits),
          positions + lengths)


# --- the host loop ------------------------------------------------------------------------------


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
  arrays: dict  # the RolloutBatch fields, routing absent: per-token [B, S] as rl/rows.DeviceRows (on
  #               the devices), lengths and truncated [B] numpy on every host
  episodes: list[EpisodeStats]  # [B]
  texts: list[str]  # [B] the episode after the prompt, as text
  counts: dict[str, int]  # prefill_tokens (prompts, once), extend_tokens (observations), extend_calls, ...


class _Row:
  """Host record of one episode: its environment, its length and, on the host that runs it, its tokens."""

  def __init__(self, env):
    self.env = env
    self.length = 0  # episode tokens so far (policy turns and observations)
    self.tokens: list[int] = []  # the same tokens, kept by the host that runs the row (for its text)
    self.stats = EpisodeStats()
    self.active = True
    self.max_turns = 1  # the budget's, or the example's own when lower

  def add(self, tokens, *, keep: bool):
    self.length += len(tokens)
    if keep:
      self.tokens += [int(t) for t in tokens]

  def finish(self, result, end: str):
    self.active = False
    self.stats.reward, self.stats.end = float(result.reward), end
    if result.info.get("env_failure"):
      self.stats.env_failure, self.stats.end = str(result.info["env_failure"]), "env_failure"

  def fail(self, reason: str):
    self.active = False
    self.stats.env_failure, self.stats.end, self.stats.reward = reason, "env_failure", 0.0


class _Failed:
  """An environment call that raised or timed out, shaped like a StepResult."""

  def __init__(self, reason: str):
    self.observation, self.reward, self.done, self.info = "", 0.0, True, {"env_failure": reason}


class MultiTurnPrograms:
  """The jitted programs of the multi-turn rollout and the host loop around them (see the module
  docstring). Built once per run (`make_multiturn`); `rollout` compiles on first use."""

  def __init__(self, cfg, mesh, tokenizer: Tokenizer, *, group_size: int | None = None,
               temperature: float | None = None, make_env: Callable[[dict], Any] = default_env):
    self.spec = spec = MultiTurnSpec.from_config(cfg, tokenizer, group_size=group_size,
                                                 temperature=temperature)
    self.tokenizer, self.make_env = tokenizer, make_env
    mc = rollout_model_config(cfg, mesh)
    graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))), nnx.Param, ...)
    merge = lambda params, extra: nnx.merge(graphdef, params, extra)  # noqa: E731
    self.buckets = buckets(spec.max_obs_tokens)
    self.prefill = jax.jit(lambda params, extra, prompts, mask: prefill(merge(params, extra), spec,
                                                                         prompts, mask))
    self.decode_turn = jax.jit(lambda params, extra, *args: decode_turn(merge(params, extra), spec, *args))
    self.extend = jax.jit(lambda params, extra, *args: extend(merge(params, extra), *args))
    self.mesh, self.rules = mesh, rules_from_config(cfg.mesh)
    self._episode_programs: dict[int, tuple] = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(spec.env_workers, thread_name_prefix="env")

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  # host helpers

  def _encode_prompts(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """Left-padded prompt tokens [P, Lp] and mask; over-long prompts keep their last Lp tokens."""
    tok = self.tokenizer
    truncated = sum(len(tok.encode(tok.render_prompt(t))) > self.spec.prompt_len for t in texts)
    ids, mask = tok.encode_batch([tok.render_prompt(t) for t in texts], length=self.spec.prompt_len,
                                 padding="left", overflow="truncate")
    return np.asarray(ids, np.int32), np.asarray(mask, bool), int(truncated)

  def _call_envs(self, calls: list[tuple[int, Callable[[], Any]]]) -> dict[int, Any]:
    """Runs the environment calls in threads; one that raises or passes env_timeout_s is _Failed."""
    started: dict[int, float] = {}  # a call's clock starts when a worker picks it up, not when queued

    def timed(row, fn):
      started[row] = time.monotonic()
      return fn()
    pending = {row: self._pool.submit(timed, row, fn) for row, fn in calls}
    results = {}
    while pending:
      concurrent.futures.wait(list(pending.values()), timeout=0.05,
                              return_when=concurrent.futures.FIRST_COMPLETED)
      now = time.monotonic()
      for row, future in list(pending.items()):
        if future.done():
          error = future.exception()
          results[row] = future.result() if error is None else _Failed(f"{type(error).__name__}: {error}")
        elif row in started and now - started[row] > self.spec.env_timeout_s:
          # The thread cannot be killed; it finishes on its own (sandboxed commands have their own
          # limits) and its episode is over.
          results[row] = _Failed(f"environment call timed out after {self.spec.env_timeout_s:g} s")
        else:
          continue
        del pending[row]
    return results

  def _own_rows(self, batch: int) -> range:
    """The rows whose environments this host runs: all of them with one process, else its share
    (hosts.share: the rows of its own examples, since examples are gathered in process order and
    split evenly; with rl/step.shared_prompts every host holds every example and a share may be
    empty)."""
    own = hosts.share(batch)
    return range(own.start, own.stop)

  def _step_envs(self, calls: list[tuple[int, Callable[[], Any]]], batch: int) -> dict[int, StepResult]:
    """Environment steps of every row, each run by the host that owns the row (`_own_rows`, in
    threads by `_call_envs`), then shared: every host gets every row's StepResult (a failed call
    as one with info["env_failure"]), so all hosts build the same next inputs for the jitted programs."""
    own = self._own_rows(batch)
    local = self._call_envs([(b, fn) for b, fn in calls if b in own])
    shared = hosts.gather_objects([[b, [r.observation, float(r.reward), bool(r.done), dict(r.info)]]
                                   for b, r in sorted(local.items())])
    return {int(b): StepResult(*fields) for b, fields in shared}

  def _observation_ids(self, text: str, limit: int) -> list[int] | None:
    """The rendered observation in at most `limit` tokens: its head, then always the closing tag
    (None when not even the tags and one token fit)."""
    tok = self.tokenizer
    close = tok.encode(OBS_CLOSE, add_bos=False)
    head = tok.encode(OBS_OPEN + text, add_bos=False)
    if limit - len(close) <= len(tok.encode(OBS_OPEN, add_bos=False)):
      return None
    return head[:limit - len(close)] + close

  def _bucket(self, length: int) -> int:
    return next(b for b in self.buckets if b >= length)

  def _rows_sharding(self, rows: int) -> NamedSharding | None:
    """[rows, ...] split over the mesh axes of the `batch` rule that divide `rows` (None: no mesh)."""
    if self.mesh is None:
      return None
    return NamedSharding(self.mesh, logical_to_spec(("batch",), self.rules, self.mesh, shape=(rows,)))

  def _episodes_programs(self, batch: int) -> tuple:
    """(empty, append_policy, append_observations, assemble) for `batch` rows: jitted, their outputs
    split by rows over the mesh axes of the `batch` rule that divide B (whole without a mesh)."""
    if batch not in self._episode_programs:
      split, spec = self._rows_sharding(batch), self.spec
      self._episode_programs[batch] = (
          jax.jit(lambda: empty_episodes(batch, spec.episode_len, spec.pad_id), out_shardings=split),
          jax.jit(functools.partial(append, policy=True), out_shardings=split),
          jax.jit(functools.partial(append, policy=False), out_shardings=split),
          jax.jit(functools.partial(assemble, group=spec.group_size), out_shardings=split))
    return self._episode_programs[batch]

  def rollout(self, params, extra, examples: Sequence[dict], key: jax.Array,
              version: int = 0) -> MultiTurnRollout:
    """B = len(examples) * G episodes, example p's on rows p*G .. p*G+G-1."""
    spec, tok = self.spec, self.tokenizer
    group, batch = spec.group_size, len(examples) * spec.group_size
    per_row = [e for e in examples for _ in range(group)]
    rows: list[_Row] = []
    # This host resets (and later steps) the environments of its own rows. When every host's rows
    # are an equal block of whole groups, each encodes its own groups' prompts (their first
    # observations) and the prefill gets one global array of them; otherwise (rl/batch.shared_prompts)
    # the first observations are shared and every host encodes every prompt. Failures are shared.
    own = self._own_rows(batch)
    local_prompts = hosts.is_multihost() and len(examples) % jax.process_count() == 0
    resets = self._call_envs([(b, (lambda e=e: self._reset(e))) for b, e in enumerate(per_row) if b in own])
    shared = dict(hosts.gather_objects([
        [b, ["" if local_prompts else None, r.info["env_failure"]] if isinstance(r, _Failed)
         else [None if local_prompts else r[1], None]]
        for b, r in sorted(resets.items())]))
    prompts_text = []
    for b, example in enumerate(per_row):
      first, failure = shared[b]
      if local_prompts and b in resets and failure is None:
        first = resets[b][1]
      rows.append(_Row(resets[b][0] if b in resets and failure is None else None))
      rows[b].max_turns = max(1, min(spec.max_turns, int(example.get("max_turns", spec.max_turns))))
      if failure is not None:
        rows[b].fail(failure)
      if b % group == 0 and (not local_prompts or b in own):
        prompts_text.append(first if first is not None and failure is None
                            else str(example.get("prompt", "")))
    prompts, mask, truncated = self._encode_prompts(prompts_text)
    prefill_tokens = int(mask.sum())
    if local_prompts:
      split = self._rows_sharding(len(examples))
      prompts, mask = hosts.global_rows(prompts, split), hosts.global_rows(mask, split)
      sums = hosts.gather_rows(np.asarray([[truncated, prefill_tokens]])).sum(axis=0)
      truncated, prefill_tokens = int(sums[0]), int(sums[1])
    counts = {"prefill_tokens": prefill_tokens, "extend_tokens": 0, "extend_slots": 0, "extend_calls": 0,
              "decode_calls": 0, "prompts_truncated": truncated}

    empty, append_policy, append_observations, assemble_fields = self._episodes_programs(batch)
    episodes = empty()
    cache, logits, positions = self.prefill(params, extra, prompts, mask)
    for turn in range(spec.max_turns):
      limits = np.zeros(batch, np.int32)
      for b, row in enumerate(rows):
        if row.active:
          room = spec.episode_len - row.length
          limits[b] = max(0, min(spec.max_turn_tokens, spec.max_episode_tokens - row.stats.policy_tokens,
                                 room))
      self._end(rows, {b: "context" for b, r in enumerate(rows) if r.active and limits[b] < 1})
      if not limits.any():
        break
      counts["decode_calls"] += 1
      cache, logits, positions, tokens, logprobs, lengths, _ = self.decode_turn(
          params, extra, cache, logits, positions, jnp.asarray(limits), jax.random.fold_in(key, turn))
      episodes = append_policy(episodes, tokens, lengths, logprobs)
      # Every host learns every row's turn length; only its own rows' tokens come to it.
      lengths, own_tokens = hosts.to_host(lengths), hosts.share_to_host(tokens)
      calls = []
      for b in np.flatnonzero(limits > 0):
        row, n = rows[b], int(lengths[b])
        row.stats.turns += 1
        row.stats.policy_tokens += n
        if b in own:
          turn_tokens = own_tokens[b - own.start, :n]
          row.add(turn_tokens, keep=True)
          text, _ = as_text(tok.decode(turn_tokens))
          calls.append((int(b), (lambda env=row.env, text=text: env.step(text))))
        else:
          row.add(range(n), keep=False)
      results = self._step_envs(calls, batch)
      observations, ending = {}, {}
      for b, result in results.items():
        row = rows[b]
        row.stats.malformed_calls += "error" in result.info
        if result.done or result.info.get("env_failure"):
          row.finish(result, "done")
          continue
        if row.stats.turns >= row.max_turns:
          ending[b] = "max_turns"
        elif row.stats.policy_tokens >= spec.max_episode_tokens:
          ending[b] = "token_budget"
        else:
          room = spec.episode_len - row.length - 1  # leave room for one more policy token
          ids = self._observation_ids(result.observation, min(room, spec.max_obs_tokens))
          if ids is None:
            ending[b] = "context"
          else:
            observations[b] = ids
      self._end(rows, ending)
      if observations:
        span = self._bucket(max(len(ids) for ids in observations.values()))
        obs = np.full((batch, span), spec.pad_id, np.int32)
        obs_len = np.zeros(batch, np.int32)
        for b, ids in observations.items():
          obs[b, :len(ids)], obs_len[b] = ids, len(ids)
          rows[b].add(ids, keep=b in own)
          rows[b].stats.obs_tokens += len(ids)
        obs, obs_len = jnp.asarray(obs), jnp.asarray(obs_len)
        cache, logits, positions = self.extend(params, extra, cache, logits, positions, obs, obs_len)
        episodes = append_observations(episodes, obs, obs_len)
        counts["extend_tokens"] += int(obs_len.sum())
        counts["extend_slots"] += batch * span
        counts["extend_calls"] += 1
    self._end(rows, {b: "max_turns" for b, r in enumerate(rows) if r.active})
    arrays = rollout_rows(assemble_fields(prompts, mask, episodes, np.int32(version)))
    arrays["truncated"] = np.asarray([r.stats.end != "done" for r in rows])
    texts = hosts.gather_objects([tok.decode(rows[b].tokens, stop_at_eos=False) for b in own])
    return MultiTurnRollout(arrays=arrays, episodes=[r.stats for r in rows], texts=texts, counts=counts)

  def _reset(self, example: dict):
    env = self.make_env(example)
    return env, env.reset(example)

  def _end(self, rows: list[_Row], ending: dict[int, str]) -> None:
    """Sends `<done>` to the environments of `ending` {row: end reason} so their episodes are graded."""
    if not ending:
      return
    results = self._step_envs([(b, (lambda env=rows[b].env: env.step(DONE))) for b in ending], len(rows))
    for b, end in ending.items():
      rows[b].finish(results[b], end)


def make_multiturn(cfg, mesh, tokenizer: Tokenizer, **kwargs) -> MultiTurnPrograms:
  return MultiTurnPrograms(cfg, mesh, tokenizer, **kwargs)
