"""Rollout-side benchmark of issue 12: one function per section, all numbers into one JSON file.

Run:  JAX_PLATFORMS=cpu python scripts/bench_rollout.py --json runs/bench_rollout.json
      (--sections rollout,update,step; --config=... and --config.a.b=... as in rl.py; the config is
      configs/tiny.py, a 2-layer MoE, unless told otherwise)

Sections (each a function `section_NAME(args, cfg) -> dict` of JSON keys, registered in SECTIONS):
  rollout   generated tokens per second of the same samples produced three ways, side by side in one
            process (keys `static`, `continuous`, `continuous_prefix`, plus details under
            `rollout_detail`):
              static             the static scheduler (rl/generation/loop.py): one while_loop over the
                                 whole batch until its longest sample ends
              continuous         the continuous scheduler with --slots decode slots, every sample
                                 prefilled on its own (prompts repeated G times, group size 1)
              continuous_prefix  the continuous scheduler with --slots decode slots, a group's prompt
                                 prefilled once and its cache rows copied to the group's slots
            Response lengths are long-tailed: each sample's length is drawn up front from a
            log-normal (median --median_len, sigma --sigma, clipped to [1, rl.max_new_tokens]) and
            imposed through the rollouts' per-sample `max_lengths` (a sample ends, truncated, at its
            length; stop tokens are switched off so the drawn lengths are exact). All three produce
            the same tokens (per-sample PRNG keys); the script checks that and exits 1 otherwise.
            Each variant is compiled by a warm-up call, then timed over --repeats calls (best; the episodic section reports the median).
  update    (helper B) update_padded_s, update_packed_s
  step      RL step time (rl_step) synchronous vs asynchronous (rl.max_staleness=1) when scoring
            takes about as long as generation (keys `step_sync_s`, `step_async_s`; `step_detail`)
  floor     the static rollout at the config's own batch as configured, with the experts' matmuls
            at the mean load and no dispatch (the floor of any exact dispatch), and with no experts
            (`floor_detail`); e.g. --cpu_devices=2 --config=configs/tiny.py:peer --sections floor
  ladder    the static rollout at the config's own batch with `ladder`'s capacities 1.3x apart
            against doubling ones, alternating, best of --repeats (`ladder_detail`); e.g.
            --cpu_devices=2 --config=configs/tiny.py:peer --sections ladder --repeats 8
  cache_layout  the same with the decode loop's per-layer KV cache in the layouts its attention
            reads (model/kv_cache.py PER_LAYER_ORDER) against token-major (`cache_layout_detail`)
  episodic  multi-turn episodes whose environment steps take long-tailed times (a log-normal of
            median --env_median_ms and sigma --env_sigma: p99/p50 about 10 at sigma 1): generated
            policy tokens per second of the turn-synchronous rollout (rl.engine=static: every turn
            waits for every episode's environment) and of the episodic scheduler (rl.engine=continuous:
            an episode's next turn starts when its own environment answers), the same episodes, the
            same slots (keys `episodic_tps`, `static_multiturn_tps`; `episodic_detail`). Defaults:
            32 episodes x 8 turns of up to 16 tokens, environment median 100 ms: here a 16-token turn
            of 32 slots decodes in about 40 ms, so an environment step is a few turns' decode, as a
            terminal command (0.1-10 s) is next to a large MoE's turn on a pod (about 0.5 s)
"""

import argparse
import contextlib
import copy
import sys
import time

from meshrl.configs import cli


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--sections", default="rollout", help="comma-separated: " + ",".join(
      ["rollout", "update", "step", "ladder", "floor", "cache_layout", "episodic"]))
  parser.add_argument("--prompts", type=int, default=32, help="rollout: distinct prompts")
  parser.add_argument("--group_size", type=int, default=8, help="rollout: samples per prompt")
  parser.add_argument("--slots", type=int, default=64, help="rollout: decode slots of the engine")
  parser.add_argument("--max_new_tokens", type=int, default=128, help="rollout: response budget")
  parser.add_argument("--median_len", type=float, default=8.0, help="rollout: median response length")
  parser.add_argument("--sigma", type=float, default=1.1, help="rollout: log-normal sigma of lengths")
  parser.add_argument("--step_steps", type=int, default=4, help="step: timed RL steps per mode")
  parser.add_argument("--reward_workers", type=int, default=8, help="step: scoring threads")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant (the median is reported)")
  parser.add_argument("--episodes", type=int, default=32, help="episodic: episodes (prompts x 1)")
  parser.add_argument("--turns", type=int, default=8, help="episodic: turns per episode")
  parser.add_argument("--env_median_ms", type=float, default=100.0, help="episodic: median environment step")
  parser.add_argument("--env_sigma", type=float, default=1.0, help="episodic: log-normal sigma of env steps")


def long_tailed_lengths(count: int, *, median: float, sigma: float, max_len: int, seed: int = 0):
  """[count] int32 response lengths: median * exp(sigma * z), z ~ N(0, 1), clipped to [1, max_len]."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  z = np.random.default_rng(seed).standard_normal(count)
  return np.clip(np.round(median * np.exp(sigma * z)), 1, max_len).astype(np.int32)


def _best_time(fn, repeats: int):
  """(best seconds over `repeats` calls after one warm-up call, last result); results waited on."""
  import jax  # pylint: disable=import-outside-toplevel
  out = jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best, out


def _alternating_best(programs: dict, repeats: int) -> dict:
  """{name: best seconds} of compiled zero-argument programs called in turn, A B A B, `repeats` rounds."""
  import jax  # pylint: disable=import-outside-toplevel
  best = {name: float("inf") for name in programs}
  for _ in range(repeats):
    for name, fn in programs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      best[name] = min(best[name], time.perf_counter() - t0)
  return best


def _rev_prompts(tok, count: int, length: int):
  """(tokens, mask) [count, length] of "rev xyz=" prompts, distinct per row, left-padded."""
  texts = [f"rev {chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676 % 26)}=" for i in range(count)]
  return tok.encode_batch(texts, length=length, padding="left")


def _fresh_state(cfg):
  """(mesh, train state) of a randomly initialised model of `cfg`, laid out on its mesh."""
  # pylint: disable=import-outside-toplevel
  from meshrl.model.init import build_model
  from meshrl.rl.step.run_spec import model_numbers
  from meshrl.sharding import make_mesh
  from meshrl.train.optim import make_optimizer
  from meshrl.train.state import create_train_state
  # pylint: enable=import-outside-toplevel
  mesh = make_mesh(cfg.mesh)
  _, state = create_train_state(build_model(model_numbers(cfg, mesh).model, mesh),
                                make_optimizer(cfg.optim), mesh)
  return mesh, state


def section_rollout(args, cfg) -> dict:
  """Tokens/s of static, continuous (no prefix sharing) and continuous_prefix on long-tailed lengths."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np

  from meshrl.model.tokenizer import ByteTokenizer
  from meshrl.rl.step.spec import make_generator
  # pylint: enable=import-outside-toplevel
  cfg = copy.deepcopy(cfg)  # the settings below are this section's own; other sections see the given cfg
  tok = ByteTokenizer()
  prompts, group = args.prompts, args.group_size
  batch = prompts * group
  cfg.rl.max_new_tokens = args.max_new_tokens
  cfg.rl.group_size = group
  cfg.rl.stop_tokens = ""
  cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.rl.max_prompt_len + args.max_new_tokens)
  mesh, state = _fresh_state(cfg)
  tokens, mask = _rev_prompts(tok, prompts, cfg.rl.max_prompt_len)
  lengths = long_tailed_lengths(batch, median=args.median_len, sigma=args.sigma, max_len=args.max_new_tokens,
                                seed=cfg.seed)
  key = jax.random.key(cfg.seed)
  no_stop = ()  # stop tokens off: the drawn lengths are exact

  static = make_generator(cfg, mesh, stop_ids=no_stop, pad_id=tok.pad_id)
  continuous = copy.deepcopy(cfg)
  continuous.rl.engine, continuous.rl.decode_slots = "continuous", args.slots
  shared = make_generator(continuous, mesh, stop_ids=no_stop, pad_id=tok.pad_id)
  unshared = make_generator(continuous, mesh, stop_ids=no_stop, pad_id=tok.pad_id, group_size=1)
  rep_tokens, rep_mask = np.repeat(tokens, group, 0), np.repeat(mask, group, 0)
  variants = {
      "static": lambda: static(state.params, state.extra, tokens, mask, key, max_lengths=lengths),
      "continuous": lambda: unshared(state.params, state.extra, rep_tokens, rep_mask, key, max_lengths=lengths),
      "continuous_prefix": lambda: shared(state.params, state.extra, tokens, mask, key, max_lengths=lengths),
  }
  report, outputs, detail = {}, {}, {}
  for name, fn in variants.items():
    seconds, out = _best_time(fn, args.repeats)
    outputs[name] = out
    generated = int(np.asarray(out.lengths).sum())
    report[name] = generated / seconds
    detail[name] = {"seconds": seconds, "generated_tokens": generated}
    print(f"  {name:<18} {seconds:8.3f} s  {report[name]:10.0f} tokens/s", flush=True)
  same = all(np.array_equal(np.asarray(outputs["static"].tokens), np.asarray(o.tokens))
             for o in outputs.values())
  detail.update(samples=batch, prompts=prompts, group_size=group, slots=args.slots,
                max_new_tokens=args.max_new_tokens, p50_len=float(np.percentile(lengths, 50)),
                p99_len=float(np.percentile(lengths, 99)), mean_len=float(lengths.mean()),
                same_tokens=bool(same),
                continuous_over_static=report["continuous"] / report["static"],
                continuous_prefix_over_static=report["continuous_prefix"] / report["static"])
  report["rollout_detail"] = detail
  return report


def _synthetic_scored(cfg, lengths, seed: int):
  """A ScoredBatch of len(lengths) trajectories: "rev xyz=" prompts left-padded to rl.max_prompt_len,
  random response tokens of the given lengths, random behaviour log-probs, rewards and MoE routes."""
  # pylint: disable=import-outside-toplevel
  import numpy as np

  from meshrl.model.tokenizer import ByteTokenizer
  from meshrl.rl.batches.handover import ScoredBatch
  # pylint: enable=import-outside-toplevel
  tok, rng = ByteTokenizer(), np.random.default_rng(seed)
  batch, lp, n = len(lengths), cfg.rl.max_prompt_len, cfg.rl.max_new_tokens
  prompt, prompt_mask = _rev_prompts(tok, batch, lp)
  response_mask = np.arange(n)[None, :] < lengths[:, None]
  tokens = np.concatenate([prompt, np.where(response_mask, rng.integers(97, 123, (batch, n)), tok.pad_id)], 1)
  real = np.concatenate([prompt_mask, response_mask], 1)
  positions = np.where(real, np.cumsum(real, 1) - 1, 0)
  moe_layers = cfg.model.num_layers - cfg.moe.first_k_dense if cfg.moe.num_experts else 0
  arrays = {
      "tokens": tokens.astype(np.int32), "positions": positions.astype(np.int32),
      "segment_ids": real.astype(np.int32), "prompt_mask": np.concatenate([prompt_mask, np.zeros_like(response_mask)], 1),
      "response_mask": np.concatenate([np.zeros_like(prompt_mask), response_mask], 1),
      "logprobs": np.where(np.concatenate([np.zeros_like(prompt_mask), response_mask], 1),
                           -rng.exponential(1.0, tokens.shape), 0.0).astype(np.float32),
      "lengths": lengths.astype(np.int32), "truncated": lengths >= n,
      "routing": (rng.integers(0, cfg.moe.num_experts, (batch, moe_layers, lp + n, cfg.moe.num_experts_per_tok))
                  .astype(np.int32) if moe_layers else None)}
  rewards = rng.random(batch).astype(np.float32)
  return ScoredBatch(arrays=arrays, rewards=rewards, correct=rewards, sample_valid=np.ones(batch, bool),
                     domains=[""] * batch, texts=[""] * batch)


def section_update(args, cfg) -> dict:
  """Update seconds of the same long-tailed trajectories, padded [B, S] vs packed [R, W] (rl/batches/packing.py).

  Trajectories: --prompts x --group_size samples, responses of log-normal lengths (--median_len,
  --sigma, budget --max_new_tokens, as the rollout section). Both runs start from the same params
  and take one jitted update (rl.epochs x rl.num_minibatches) per call: a warm-up call compiles,
  then the best of --repeats calls counts. The packed run's rl.packed_rows is the fewest rows (a
  multiple of minibatches x data-parallel shards) holding the step's tokens with 10% slack, rows of
  S = prompt + response budget tokens. Host prepare time (packing included) is reported apart."""
  # pylint: disable=import-outside-toplevel
  import copy

  import jax
  import numpy as np

  from meshrl.model.init import build_model
  from meshrl.rl.step.program import build_run, fetch_metrics, prepare
  from meshrl.rl.step.run_spec import check_config
  from meshrl.sharding import make_mesh
  from meshrl.sharding.rules import data_parallel_size
  # pylint: enable=import-outside-toplevel
  cfg = copy.deepcopy(cfg)  # the settings below are this section's own; other sections see the given cfg
  cfg.rl.max_new_tokens = args.max_new_tokens
  cfg.rl.group_size = args.group_size
  cfg.rl.prompts_per_step = args.prompts
  total = cfg.rl.max_prompt_len + args.max_new_tokens
  cfg.model.max_seq_len = max(cfg.model.max_seq_len, total)
  batch = args.prompts * args.group_size
  lengths = long_tailed_lengths(batch, median=args.median_len, sigma=args.sigma, max_len=args.max_new_tokens,
                                seed=cfg.seed)
  mesh = make_mesh(cfg.mesh)
  scored = _synthetic_scored(cfg, lengths, cfg.seed)
  real_tokens = int((scored.arrays["segment_ids"] != 0).sum())
  unit = cfg.rl.num_minibatches * data_parallel_size(dict(mesh.shape))
  rows = min(batch, -(-int(np.ceil(1.1 * real_tokens / total)) // unit) * unit)
  report, detail = {}, {"samples": batch, "row_len": total, "packed_rows": rows, "real_tokens": real_tokens,
                        "p50_len": float(np.percentile(lengths, 50)), "p99_len": float(np.percentile(lengths, 99))}
  for name, packed in (("padded", False), ("packed", True)):
    run_cfg = copy.deepcopy(cfg)
    run_cfg.rl.pack_updates = packed
    run_cfg.rl.packed_rows = rows if packed else 0
    spec = check_config(run_cfg, mesh=mesh)
    run = build_run(run_cfg, mesh, build_model(spec.model, mesh, seed=cfg.seed), spec.tokenizer, spec=spec)
    t0 = time.perf_counter()
    update_batch, prepare_metrics = prepare(run, scored)
    prepare_metrics = fetch_metrics(prepare_metrics)
    jax.block_until_ready(update_batch)
    prepare_s = time.perf_counter() - t0
    first = {}
    def call(run=run, update_batch=update_batch, first=first):
      run.state, metrics = run.update(run.state, update_batch, jax.random.key(0))
      first.setdefault("loss", metrics["loss"])
      return metrics
    seconds, _ = _best_time(call, args.repeats)
    run.close()
    report[f"update_{name}_s"] = seconds
    detail[name] = {"update_s": seconds, "prepare_s": prepare_s, "shape": list(update_batch.tokens.shape),
                    "first_loss": float(first["loss"]), **prepare_metrics}
    print(f"  {name:<8} {seconds:8.3f} s update  {prepare_s:6.3f} s prepare  shape "
          f"{list(update_batch.tokens.shape)}", flush=True)
  detail["packed_speedup"] = report["update_padded_s"] / report["update_packed_s"]
  report["update_detail"] = detail
  return report


# Sections by name; the lead adds "step" (step_sync_s, step_async_s).
def section_step(args, cfg) -> dict:
  """RL step time, synchronous (rl.max_staleness=0) vs asynchronous (rl.max_staleness=1), when scoring
  takes about as long as generation: each sample's reward sleeps so that the batch's scoring on
  --reward_workers threads lasts the synchronous run's measured generation time (a stand-in for
  sandboxed tests or a remote judge). Both runs use token-level TIS (the async run needs it), so they
  compute the same programs; each is compiled and warmed up by 2 steps, then --step_steps steps are
  timed (median). Keys `step_sync_s`, `step_async_s`, details under `step_detail`."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np

  from meshrl import configs
  from meshrl.rl.step import driver as loop
  from meshrl.rl.rewards import compose
  from meshrl.rl.rewards.pool import RewardPool
  from meshrl.rl.step.program import rl_step

  base = list(args.overrides) + ["rl.sft_steps=0", "rl.dynamic_sampling=false", "rl.tis_level=token"]
  workers = args.reward_workers
  detail, delay = {}, None
  for name, staleness in (("sync", 0), ("async", 1)):
    run, prompts = loop.setup(configs.load(args.config, base + [f"rl.max_staleness={staleness}"]))
    answer = compose(run.cfg.rl.rewards)
    warm = [rl_step(run, prompts, jax.random.key(i)) for i in range(2)]
    if delay is None:  # calibrated once, on the synchronous run's generation time
      samples = run.cfg.rl.prompts_per_step * run.cfg.rl.group_size
      generation_s = warm[-1]["rollout_s"]
      delay = generation_s * workers / samples

    def slow_reward(completion, example, answer=answer):
      time.sleep(delay)
      return answer(completion, example)
    run.pool.close()
    run.pool = RewardPool(slow_reward, num_workers=workers, timeout_s=max(30.0, 100 * delay))
    times, rewards_s, rollouts_s = [], [], []
    for i in range(args.step_steps):
      metrics = rl_step(run, prompts, jax.random.key(100 + i))
      times.append(metrics["time_s"])
      rewards_s.append(metrics["reward_s"])
      rollouts_s.append(metrics["rollout_s"])
    run.close()
    detail[name] = {"step_s": float(np.median(times)), "reward_s": float(np.median(rewards_s)),
                    "rollout_wait_s": float(np.median(rollouts_s)), "times": times}
  detail.update(generation_s=generation_s, reward_delay_s=delay, reward_workers=workers,
                steps=args.step_steps, async_over_sync=detail["async"]["step_s"] / detail["sync"]["step_s"])
  return {"step_sync_s": detail["sync"]["step_s"], "step_async_s": detail["async"]["step_s"],
          "step_detail": detail}


def _rollout_variants(args, cfg, patches: dict) -> tuple[dict, dict]:
  """The static rollout at the config's own batch (rl.prompts_per_step x rl.group_size, stop tokens
  off, so every sample runs rl.max_new_tokens), once per variant {name: a context manager factory
  whose patch is in place while that variant traces and compiles (benchmark only), or None}; the
  compiled programs alternate, A B A B, best of --repeats. Returns ({name: best seconds}, detail):
  the detail has each variant's seconds and tokens/s, and whether all produced the same tokens."""
  # pylint: disable=import-outside-toplevel
  import functools

  import jax
  import numpy as np

  from meshrl.model.tokenizer import ByteTokenizer
  from meshrl.rl.step.spec import make_generator
  # pylint: enable=import-outside-toplevel
  tok = ByteTokenizer()
  mesh, state = _fresh_state(cfg)
  prompts = cfg.rl.prompts_per_step
  tokens, mask = _rev_prompts(tok, prompts, cfg.rl.max_prompt_len)
  key = jax.random.key(cfg.seed)
  programs, outputs = {}, {}
  for name, patch in patches.items():
    rollout = make_generator(cfg, mesh, stop_ids=(), pad_id=tok.pad_id)
    programs[name] = functools.partial(rollout, state.params, state.extra, tokens, mask, key)
    with patch() if patch is not None else contextlib.nullcontext():
      outputs[name] = jax.block_until_ready(programs[name]())  # traces and compiles under the patch
  best = _alternating_best(programs, args.repeats)
  first = next(iter(outputs.values()))
  generated = int(np.asarray(first.lengths).sum())
  detail = {name: {"seconds": best[name], "tokens_per_s": generated / best[name]} for name in programs}
  detail.update(samples=prompts * cfg.rl.group_size, max_new_tokens=cfg.rl.max_new_tokens,
                generated_tokens=generated,
                same_tokens=all(np.array_equal(np.asarray(first.tokens), np.asarray(out.tokens))
                                for out in outputs.values()))
  for name in programs:
    print(f"  {name:<17} {best[name]:8.3f} s  {generated / best[name]:10.0f} tokens/s", flush=True)
  return best, detail


@contextlib.contextmanager
def _patched(module, name: str, value):
  """`module.name` set to `value` for the block (benchmark baselines only)."""
  original = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, original)


def section_ladder(args, cfg) -> dict:
  """The static rollout with `ladder`'s rungs 1.3x apart (model/moe_dispatch.py) against doubling
  rungs, the spacing before (moe_dispatch.ladder_rungs patched to step=2.0 while it traces)."""
  import functools  # pylint: disable=import-outside-toplevel

  from meshrl.model import moe_dispatch  # pylint: disable=import-outside-toplevel
  doubling = functools.partial(moe_dispatch.ladder_rungs, step=2.0)
  best, detail = _rollout_variants(args, cfg, {
      "rungs_1.3x": None, "rungs_2x": lambda: _patched(moe_dispatch, "ladder_rungs", doubling)})
  detail["speedup"] = best["rungs_2x"] / best["rungs_1.3x"]
  return {"ladder_detail": detail}


def section_cache_layout(args, cfg) -> dict:
  """The static rollout with the decode loop's per-layer KV cache in the layouts its attention dots
  read (model/kv_cache.py PER_LAYER_ORDER: keys [B, K, H, S], values [B, K, S, H]) against the
  token-major layout [B, S, K, H] (PER_LAYER_ORDER emptied while it traces), the layout before."""
  from meshrl.model import kv_cache  # pylint: disable=import-outside-toplevel
  best, detail = _rollout_variants(args, cfg, {
      "per_layer": None, "token_major": lambda: _patched(kv_cache, "PER_LAYER_ORDER", {})})
  detail["speedup"] = best["token_major"] / best["per_layer"]
  return {"cache_layout_detail": detail}


def _balanced_experts(xs, expert_choices, combine_weights, w, **_):
  """Benchmark stand-in for an exact dispatcher (outputs meaningless): every expert computes
  ceil(N * K / E) rows, the mean load, with no sort, gather or scatter; the routing stays in the
  program. The time no dispatch of this routing's slots can beat at this batch."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  num_tokens, k = expert_choices.shape
  num_experts = w.gate.shape[0]
  rows = -(-num_tokens * k // num_experts)
  expert_in = jnp.resize(xs, (num_experts * rows, xs.shape[1])).reshape(num_experts, rows, -1)  # [E, r, D]
  hidden = jax.nn.silu(jnp.einsum("erd,edf->erf", expert_in, w.gate)) * jnp.einsum("erd,edf->erf", expert_in, w.up)
  ys = jnp.einsum("erf,efd->erd", hidden, w.down).reshape(num_experts * rows, -1)[:num_tokens]
  return ys + _keep_routing(expert_choices, combine_weights, xs.dtype), jnp.zeros((), jnp.int32)


def _routing_only(xs, expert_choices, combine_weights, w, **_):  # pylint: disable=unused-argument
  """Benchmark stand-in: no expert computes anything (ys = 0); the routing stays in the program."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return jnp.zeros_like(xs) + _keep_routing(expert_choices, combine_weights, xs.dtype), jnp.zeros((), jnp.int32)


def _keep_routing(expert_choices, combine_weights, dtype):
  """A zero that depends on the routing, so the compiler keeps the router and top-k."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return ((jnp.sum(combine_weights) + jnp.sum(expert_choices)) * 0).astype(dtype)


def section_floor(args, cfg) -> dict:
  """Where the sampler's time goes: the static rollout at the config's own batch (as `ladder`: stop
  tokens off, every sample runs rl.max_new_tokens) three ways, alternating, best of --repeats:
    configured        the config's dispatch
    balanced_experts  every dispatcher replaced by `_balanced_experts` (the experts' matmuls at the
                      mean load, nothing else): the floor for any exact dispatch of these slots
    routing_only      the experts replaced by zeros (router and top-k kept): the rest of the model
  The stand-ins are patched into moe_dispatch.IMPLEMENTATIONS while the program traces (benchmark only).
  `dispatch_overhead_s` = configured - balanced_experts, `experts_floor_s` = balanced - routing_only."""
  from meshrl.model import moe_dispatch  # pylint: disable=import-outside-toplevel

  @contextlib.contextmanager
  def every_dispatcher(stand_in):
    original = dict(moe_dispatch.IMPLEMENTATIONS)
    moe_dispatch.IMPLEMENTATIONS.update({impl: stand_in for impl in original})
    try:
      yield
    finally:
      moe_dispatch.IMPLEMENTATIONS.update(original)

  best, detail = _rollout_variants(args, cfg, {
      "configured": None, "balanced_experts": lambda: every_dispatcher(_balanced_experts),
      "routing_only": lambda: every_dispatcher(_routing_only)})
  del detail["same_tokens"]  # the stand-ins' outputs are meaningless
  detail.update(dispatch_overhead_s=best["configured"] - best["balanced_experts"],
                experts_floor_s=best["balanced_experts"] - best["routing_only"])
  return {"floor_detail": detail}


class _SlowEnv:
  """An environment whose step i of episode e sleeps delays[e][i] seconds, answers a short observation
  and ends the episode after its last delay (the section's long-tailed environment)."""

  def __init__(self, delays):
    self.delays, self.turn = delays, 0

  def reset(self, task):
    self.turn = 0
    return task["prompt"]

  def step(self, action):
    from meshrl.rl.envs.base import StepResult  # pylint: disable=import-outside-toplevel
    time.sleep(self.delays[self.turn])
    self.turn += 1
    return StepResult(f"ok {self.turn}", 0.0, self.turn >= len(self.delays), {})


def section_episodic(args, cfg) -> dict:
  """Policy tokens/s of multi-turn episodes with long-tailed environment steps: turn-synchronous
  (rl.engine=static) against the episodic scheduler (rl.engine=continuous), the same slots."""
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np

  from meshrl.model.tokenizer import ByteTokenizer
  from meshrl.rl.step.spec import episode_runner
  # pylint: enable=import-outside-toplevel
  tok = ByteTokenizer()
  rng = np.random.default_rng(cfg.seed)
  delays = np.exp(np.log(args.env_median_ms / 1e3) + args.env_sigma * rng.standard_normal((args.episodes, args.turns)))
  examples = [{"prompt": f"task {e}: run it", "episode": e} for e in range(args.episodes)]
  figures, detail, outputs = {}, {}, {}
  for name, engine in (("static_multiturn", "static"), ("episodic", "continuous")):
    run_cfg = copy.deepcopy(cfg)
    run_cfg.rl.multi_turn, run_cfg.rl.engine, run_cfg.rl.group_size = True, engine, 1
    run_cfg.rl.prompts_per_step = args.episodes
    run_cfg.rl.max_turns, run_cfg.rl.max_turn_tokens, run_cfg.rl.max_obs_tokens = args.turns, 16, 16
    run_cfg.rl.max_new_tokens = args.turns * (16 + 16)
    run_cfg.rl.env_workers, run_cfg.rl.env_timeout_s = args.episodes, 60.0
    run_cfg.rl.temperature = 1.0
    run_cfg.model.max_seq_len = max(run_cfg.model.max_seq_len,
                                    run_cfg.rl.max_prompt_len + run_cfg.rl.max_new_tokens + 16)
    if engine == "continuous":
      run_cfg.rl.decode_slots = args.episodes
    _, state = _fresh_state(run_cfg)
    runner = episode_runner(run_cfg, None, tok, make_env=lambda example: _SlowEnv(delays[example["episode"]]))
    runner.rollout(state.params, state.extra, examples, jax.random.key(0))  # compile
    times, out = [], None
    for _ in range(args.repeats):  # the typical run, not the best: the median of the repeats
      start = time.perf_counter()
      out = runner.rollout(state.params, state.extra, examples, jax.random.key(1))
      times.append(time.perf_counter() - start)
    best = float(np.median(times))
    runner.close()
    tokens = sum(e.policy_tokens for e in out.episodes)
    figures[f"{name}_tps"] = tokens / best
    outputs[name] = out
    detail[name] = {"seconds": best, "policy_tokens": tokens, "turns": sum(e.turns for e in out.episodes),
                    "host_wait_s": out.counts["host_wait_s"], "decode_calls": out.counts["decode_calls"]}
    print(f"  {name:<17} {best:8.3f} s  {tokens / best:10.0f} tokens/s", flush=True)
  same = np.array_equal(outputs["episodic"].arrays["tokens"].to_host(), outputs["static_multiturn"].arrays["tokens"].to_host())
  detail.update(episodes=args.episodes, turns=args.turns, env_median_s=float(np.median(delays)),
                env_p99_s=float(np.percentile(delays, 99)),
                env_p99_over_p50=float(np.percentile(delays, 99) / np.median(delays)),
                same_episodes=bool(same), episodic_over_static=figures["episodic_tps"] / figures["static_multiturn_tps"])
  return {**figures, "episodic_detail": detail}


SECTIONS = {"rollout": section_rollout, "update": section_update, "step": section_step,
            "ladder": section_ladder, "floor": section_floor, "cache_layout": section_cache_layout,
            "episodic": section_episodic}


def _print_variants(detail: dict | None, title: str, column: str, names: tuple[str, str], ratio: str) -> None:
  """The table of a `_rollout_variants` section: seconds and tokens/s per variant, the speedup."""
  if not detail:
    return
  print(f"\n{title}: static rollout of {detail['samples']} samples x {detail['max_new_tokens']} tokens "
        f"({detail['generated_tokens']} generated), best of the alternating calls")
  print(f"{column:<11} {'seconds':>8} {'tokens/s':>10}")
  for name in names:
    print(f"{name:<11} {detail[name]['seconds']:8.3f} {detail[name]['tokens_per_s']:10.0f}")
  print(f"{ratio}: {detail['speedup']:.2f}x faster; same tokens: {detail['same_tokens']}")


def print_table(report: dict) -> None:
  detail = report.get("rollout_detail")
  if detail:
    print(f"\nrollout: {detail['samples']} samples ({detail['prompts']} prompts x {detail['group_size']}), "
          f"{detail['slots']} slots, lengths p50 {detail['p50_len']:.0f} p99 {detail['p99_len']:.0f} "
          f"(p99/p50 {detail['p99_len'] / detail['p50_len']:.1f}), budget {detail['max_new_tokens']}")
    print(f"{'variant':<18} {'seconds':>8} {'tokens/s':>10} {'x static':>9}")
    for name in ("static", "continuous", "continuous_prefix"):
      print(f"{name:<18} {detail[name]['seconds']:8.3f} {report[name]:10.0f} "
            f"{report[name] / report['static']:9.2f}")
    print(f"same tokens in all three: {detail['same_tokens']}")
  detail = report.get("update_detail")
  if detail:
    print(f"\nupdate: {detail['samples']} trajectories, {detail['real_tokens']} real tokens, lengths p50 "
          f"{detail['p50_len']:.0f} p99 {detail['p99_len']:.0f}; packed into {detail['packed_rows']} rows of "
          f"{detail['row_len']}")
    print(f"{'layout':<8} {'shape':>12} {'update s':>9} {'prepare s':>10} {'first loss':>11}")
    for name in ("padded", "packed"):
      d = detail[name]
      print(f"{name:<8} {str(d['shape']):>12} {d['update_s']:9.3f} {d['prepare_s']:10.3f} {d['first_loss']:11.5f}")
    print(f"packed speedup: {detail['packed_speedup']:.2f}x")
  detail = report.get("step_detail")
  if detail:
    print(f"\nRL step: scoring sleeps {detail['reward_delay_s'] * 1e3:.1f} ms per sample on "
          f"{detail['reward_workers']} workers (about the measured generation time, "
          f"{detail['generation_s']:.2f} s); median of {detail['steps']} steps")
    print(f"{'mode':<6} {'step s':>8} {'scoring s':>10} {'rollout wait s':>15}")
    for name in ("sync", "async"):
      d = detail[name]
      print(f"{name:<6} {d['step_s']:8.3f} {d['reward_s']:10.3f} {d['rollout_wait_s']:15.3f}")
    print(f"async / sync: {detail['async_over_sync']:.2f}")
  _print_variants(report.get("ladder_detail"), "ladder rungs", "rungs", ("rungs_1.3x", "rungs_2x"),
                  "1.3x over 2x")
  _print_variants(report.get("cache_layout_detail"), "per-layer KV cache layout", "layout",
                  ("per_layer", "token_major"), "per-layer layouts over token-major")
  detail = report.get("episodic_detail")
  if detail:
    print(f"\nepisodes: {detail['episodes']} x {detail['turns']} turns, environment steps median "
          f"{detail['env_median_s'] * 1e3:.0f} ms, p99 {detail['env_p99_s'] * 1e3:.0f} ms (p99/p50 "
          f"{detail['env_p99_over_p50']:.1f})")
    print(f"{'scheduler':<17} {'seconds':>8} {'tokens/s':>10} {'host wait s':>12}")
    for name in ("static_multiturn", "episodic"):
      d = detail[name]
      print(f"{name:<17} {d['seconds']:8.3f} {report[name + '_tps']:10.0f} {d['host_wait_s']:12.3f}")
    print(f"episodic / static: {detail['episodic_over_static']:.2f}x; same episodes: {detail['same_episodes']}")
  detail = report.get("floor_detail")
  if detail:
    print(f"\nsampler floor: static rollout of {detail['samples']} samples x {detail['max_new_tokens']} "
          f"tokens ({detail['generated_tokens']} generated), best of the alternating calls")
    print(f"{'experts':<17} {'seconds':>8} {'tokens/s':>10}")
    for name in ("configured", "balanced_experts", "routing_only"):
      print(f"{name:<17} {detail[name]['seconds']:8.3f} {detail[name]['tokens_per_s']:10.0f}")
    print(f"dispatch overhead over the balanced floor {detail['dispatch_overhead_s']:.3f} s; experts at the "
          f"floor {detail['experts_floor_s']:.3f} s; the rest {detail['routing_only']['seconds']:.3f} s")


def main(argv):
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  names = [s.strip() for s in args.sections.split(",") if s.strip()]
  unknown = [n for n in names if n not in SECTIONS]
  if unknown or not names:
    print(f"error: --sections={args.sections!r}: unknown or not yet implemented {unknown}; "
          f"available: {','.join(SECTIONS)}", file=sys.stderr)
    return 2
  report = {"config": args.config, "overrides": list(args.overrides), "sections": names}
  for name in names:
    print(f"section {name}:", flush=True)
    report.update(SECTIONS[name](args, cfg))
  print_table(report)
  cli.write_json(args.json, report)
  if "rollout_detail" in report and not report["rollout_detail"]["same_tokens"]:
    print("error: the rollout variants produced different tokens", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
