"""Chunked prefill (rl.prefill_chunk, issue 34 part 4) against the one-pass prefill, in one run.

Run:  JAX_PLATFORMS=cpu python scripts/bench_prefill_chunks.py --cpu_devices=2 --config=configs/tiny.py \
          --prompt_len=1024 --chunk=128 --json runs/bench_prefill_chunks.json
      (--config.a.b=... as in rl.py; --repeats timed calls per row after one warm-up call)

One batch of `--prompts` prompts: the first `--prompt_len` tokens long, the others `--short` tokens,
on one decode slot per prompt (rl.engine=continuous), greedy. Rows, each one-pass vs chunked:
  prefill_temp_bytes   the compiled prefill's temporary (activation) bytes, from XLA's memory
                       analysis of the program (prefill.prefill_prompts; deterministic)
  first_token_s        a budgeted call of one decode iteration: the time until the short prompts'
                       samples have their first token (one pass: after the whole batch's prefill;
                       chunked: after one chunk), and how many of them have it
  rollout_s            the whole continuous rollout (every sample to max_new_tokens)
Timings are wall-clock medians; only same-run ratios carry from one machine to another.
"""

import argparse
import dataclasses
import statistics
import sys
import time

from meshrl.configs import cli


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--prompt_len", type=int, default=1024, help="the long prompt's tokens (Lp)")
  parser.add_argument("--short", type=int, default=16, help="the other prompts' tokens")
  parser.add_argument("--prompts", type=int, default=4, help="prompts in the batch (one long)")
  parser.add_argument("--chunk", type=int, default=128, help="rl.prefill_chunk of the chunked side")
  parser.add_argument("--new_tokens", type=int, default=32, help="rl.max_new_tokens")
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (after a warm-up)")


def _timed(call, repeats: int) -> float:
  """Median seconds of `call` (which blocks) after one warm-up call."""
  call()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    call()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv) -> int:
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import numpy as np

  from meshrl.model.init import build_model
  from meshrl.model.tokenizer import ByteTokenizer
  from meshrl.rl.generation.generator import Generator
  from meshrl.rl.generation.prefill import prefill_prompts
  from meshrl.rl.generation.sampling import sample_keys
  from meshrl.rl.step.run_spec import model_numbers
  from meshrl.rl.step.spec import make_generator
  from meshrl.sharding import make_mesh
  from meshrl.sharding.rules import rules_from_config
  # pylint: enable=import-outside-toplevel
  if not 0 < args.chunk < args.prompt_len:
    raise SystemExit(f"--chunk={args.chunk} must be between 1 and --prompt_len={args.prompt_len} - 1.")
  with cfg.unlocked():
    cfg.rl.max_prompt_len, cfg.rl.max_new_tokens = args.prompt_len, args.new_tokens
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, args.prompt_len + args.new_tokens)
    cfg.rl.group_size, cfg.rl.temperature, cfg.rl.engine = 1, 0.0, "continuous"
    cfg.rl.decode_slots = args.prompts
  mesh = make_mesh(cfg.mesh)
  numbers = model_numbers(cfg, mesh)  # the run's, both rule sets
  model = build_model(numbers.model, mesh)
  from flax import nnx  # pylint: disable=import-outside-toplevel
  _, params, extra = nnx.split(model, nnx.Param, ...)
  tok = ByteTokenizer()
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 250, size=(args.prompts, args.prompt_len)).astype(np.int32)
  mask = np.zeros_like(tokens, bool)
  mask[0] = True
  mask[1:, -args.short:] = True
  tokens, mask = jnp.asarray(np.where(mask, tokens, tok.pad_id)), jnp.asarray(mask)
  base = make_generator(cfg, mesh, stop_ids=(), pad_id=tok.pad_id, model_numbers=numbers.rollout_model)
  rules = rules_from_config(cfg.mesh)
  num = args.prompts
  rows = {}
  for name, chunk in (("one_pass", 0), ("chunked", args.chunk)):
    gen = Generator(dataclasses.replace(base.spec, prefill_chunk=chunk), base.mc, mesh=mesh, rules=rules)
    weights = gen.prepare(params)
    prefill = jax.jit(lambda w, t, m, chunk=chunk, gen=gen: prefill_prompts(
        gen._models(w, extra, None).target, t, m, gen.spec.cache_len, chunk))  # pylint: disable=protected-access
    memory = prefill.lower(weights, tokens, mask).compile().memory_analysis()
    first = Generator(dataclasses.replace(base.spec, prefill_chunk=chunk, scheduler="budgeted", token_budget=num),
                      base.mc, mesh=mesh, rules=rules)
    keys = sample_keys(jax.random.key(0), jnp.arange(num))
    state = {}

    def first_token(first=first, state=state):
      pool, _ = first.run_pool(params, extra, first.new_pool(tokens, mask, keys), tokens, mask, 0)
      state["generated"] = np.asarray(jax.device_get(pool.generated))

    def rollout(gen=gen, state=state):
      batch = gen(params, extra, tokens, mask, jax.random.key(0))
      state["tokens"] = np.asarray(jax.device_get(batch.tokens))
    rows[name] = {"prefill_temp_bytes": int(memory.temp_size_in_bytes),
                  "first_token_s": _timed(first_token, args.repeats),
                  "short_samples_with_a_token": int((state["generated"][1:] > 0).sum()),
                  "rollout_s": _timed(rollout, args.repeats)}
    rows[name]["tokens"] = state["tokens"]
  same = bool(np.array_equal(rows["one_pass"].pop("tokens"), rows["chunked"].pop("tokens")))
  one, chunked = rows["one_pass"], rows["chunked"]
  ratios = {"prefill_temp_bytes": one["prefill_temp_bytes"] / max(chunked["prefill_temp_bytes"], 1),
            "first_token_s": one["first_token_s"] / chunked["first_token_s"],
            "rollout_s": one["rollout_s"] / chunked["rollout_s"]}
  print(f"prompts: 1 x {args.prompt_len} + {num - 1} x {args.short} tokens, chunk {args.chunk}, "
        f"{args.new_tokens} new tokens, {len(jax.devices())} devices; same greedy tokens: {same}")
  print(f"{'row':<30}{'one pass':>14}{'chunked':>14}{'one/chunked':>14}")
  for key in ("prefill_temp_bytes", "first_token_s", "rollout_s"):
    print(f"{key:<30}{one[key]:>14.4g}{chunked[key]:>14.4g}{ratios[key]:>13.2f}x")
  print(f"{'short samples with a token':<30}{one['short_samples_with_a_token']:>14}"
        f"{chunked['short_samples_with_a_token']:>14}")
  cli.write_json(args.json, {"args": vars(args), "one_pass": one, "chunked": chunked, "ratios": ratios,
                             "same_tokens": same, "devices": len(jax.devices())})
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:]))
