"""Model benchmark: forward+backward tokens/s and MFU of a few MoE sizes per expert dispatch, against
this machine's peak.

Run:  JAX_PLATFORMS=cpu python scripts/bench_model.py --json runs/bench_model.json
      (--steps 5 timed steps per size; --dispatches auto,dropless,buffered,capacity: one row per size and
      dispatch, `all` for every one in model/moe_dispatch.py; --config.model.dtype=bfloat16 etc. apply
      to every size)

Each size is configs/tiny.py (or --config) with the overrides in SIZES. The step is
jit(value_and_grad(sft_loss)): mean next-token cross-entropy over every position plus the MoE aux and
z losses (train/sft.py), on random tokens; no optimizer update. step_s is the best of --steps
calls after one warm-up (compile) call: the machine is often shared, and the best is the least
disturbed, as for the peak.

Peak: the best of REPEATS runs of a jitted fp32 2048 x 2048 matmul (2 n^3 FLOPs), measured before
and after the models, taking the higher. MFU = tokens_per_s * flops_per_token / peak, with
flops_per_token from train/metrics.py `model_flops_per_token(training=True)` (6 N_active + 3 A).

JSON: {"peak_flops", "rows": [{name, dispatch, implementation, params_total, params_active, batch,
seq_len, step_s, tokens_per_s, mfu, flops_per_token, compile_s}, or {name, dispatch, error} for a
dispatch that ran out of memory at that size]}; `implementation` is what the
dispatch runs at that size (what "auto" picked). MFU counts the routed experts' useful FLOPs only, so
"capacity" (which also drops overflow) and "dense" (E / K times the work) show what they cost.
"""

import argparse
import sys
import time

from meshrl.configs import cli, load

# name -> (config overrides, batch, seq_len). Heads x head_dim = embed_dim throughout.
SIZES = {
    "tiny": ([], 16, 64),
    "d256_l4_e4": (["model.embed_dim=256", "model.num_layers=4", "model.head_dim=64",
                    "model.mlp_dim=512", "moe.expert_mlp_dim=256", "model.max_seq_len=128"], 16, 128),
    "d512_l4_e8": (["model.embed_dim=512", "model.num_layers=4", "model.num_heads=8",
                    "model.num_kv_heads=4", "model.head_dim=64", "model.mlp_dim=1024",
                    "moe.num_experts=8", "moe.expert_mlp_dim=512", "model.max_seq_len=128"], 8, 128),
}
DEFAULT_DISPATCHES = "auto,dropless,buffered,capacity"
MATMUL_N = 2048
REPEATS = 10


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per size (best one kept)")
  parser.add_argument("--dispatches", default=DEFAULT_DISPATCHES,
                      help="comma-separated moe.dispatch values, one row each per size; 'all' for every one")


def matmul_peak(n: int = MATMUL_N, repeats: int = REPEATS) -> float:
  """FLOP/s of the best of `repeats` jitted fp32 [n, n] @ [n, n] matmuls (after a warm-up)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  a, b = (jax.random.normal(k, (n, n), jnp.float32) for k in jax.random.split(jax.random.key(0)))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, b))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def bench_size(cfg, *, batch: int, seq_len: int, steps: int) -> dict:
  """Times jit(value_and_grad(loss)) on random [batch, seq_len] tokens -> one row (no mfu yet)."""
  # pylint: disable=import-outside-toplevel
  import functools

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from meshrl.model import moe_dispatch
  from meshrl.model.init import build_model, parameter_counts
  from meshrl.train.init_from import model_config
  from meshrl.sharding import make_mesh
  from meshrl.train.metrics import model_flops_per_token
  from meshrl.train.sft import model_rows, sft_loss
  # pylint: enable=import-outside-toplevel
  mesh = make_mesh(cfg.mesh)
  mc = model_config(cfg, mesh)
  graphdef, params, extra = nnx.split(build_model(mc, mesh, seed=cfg.seed), nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq_len), 0, mc.vocab_size, jnp.int32)
  ones = jnp.ones((batch, seq_len), jnp.int32)
  rows = {"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len)),
          "segment_ids": ones, "loss_mask": ones}
  data = {k: jnp.asarray(v) for k, v in model_rows(rows).items()}
  loss_fn = functools.partial(sft_loss, graphdef=graphdef, moe_cfg=cfg.moe)
  step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))

  start = time.perf_counter()
  jax.block_until_ready(step(params, extra, batch=data))  # compile + first run
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(step(params, extra, batch=data))
    times.append(time.perf_counter() - start)
  step_s = min(times)
  counts = parameter_counts(mc)
  implementation = moe_dispatch.choose(mc.dispatch, backend=jax.default_backend(), phase="train",
                                       num_tokens=batch * seq_len, k=mc.num_experts_per_tok,
                                       num_experts=mc.num_experts)
  return dict(implementation=implementation, params_total=counts["total"],
              params_active=counts["active_per_token"], batch=batch,
              seq_len=seq_len, step_s=step_s, tokens_per_s=batch * seq_len / step_s,
              flops_per_token=model_flops_per_token(mc, seq_len=seq_len, training=True),
              compile_s=compile_s)


def dispatches(text: str) -> list[str]:
  """The --dispatches list, checked against model/moe_dispatch.py's names."""
  from meshrl.model.moe_dispatch import DISPATCHES  # pylint: disable=import-outside-toplevel
  names = list(DISPATCHES) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in DISPATCHES]
  if unknown or not names:
    raise ValueError(f"--dispatches={text!r}: unknown {unknown}; choose from {DISPATCHES} or 'all'.")
  return names


def run(args) -> dict:
  """Peak, every size in SIZES, peak again -> the JSON report. A dispatch that runs out of memory at a
  size ("gather" copies every token's experts) gets a row with its one-line "error" and no timing."""
  import jax  # pylint: disable=import-outside-toplevel
  peak_before = matmul_peak()
  print(f"matmul peak (fp32 {MATMUL_N}^2): {peak_before / 1e9:.1f} GFLOP/s", flush=True)
  rows = []
  for name, (overrides, batch, seq_len) in SIZES.items():
    for dispatch in dispatches(args.dispatches):
      # The size's overrides first, so the command line's --config.* win.
      cfg = load(args.config, overrides + [f"moe.dispatch={dispatch}"] + list(args.overrides))
      try:
        row = bench_size(cfg, batch=batch, seq_len=seq_len, steps=args.steps)
      except jax.errors.JaxRuntimeError as e:  # "gather" at a training size: every token's experts copied
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        reason = str(e).splitlines()[0]
        rows.append({"name": name, "dispatch": cfg.moe.dispatch, "error": reason})
        print(f"  {name} {cfg.moe.dispatch}: not measured ({reason})", flush=True)
        continue
      rows.append({"name": name, "dispatch": cfg.moe.dispatch, **row})
      print(f"  {name} {cfg.moe.dispatch} ({row['implementation']}): {row['step_s']:.3f} s/step, "
            f"{row['tokens_per_s']:.0f} tokens/s (compile+first {row['compile_s']:.1f} s)", flush=True)
  peak_after = matmul_peak()
  print(f"matmul peak again: {peak_after / 1e9:.1f} GFLOP/s", flush=True)
  peak = max(peak_before, peak_after)
  for row in rows:
    if "error" in row:
      continue
    row["mfu"] = row["tokens_per_s"] * row["flops_per_token"] / peak
  return {"peak_flops": peak, "peak_flops_runs": [peak_before, peak_after], "rows": rows}


def print_table(report: dict) -> None:
  print(f"\nforward+backward, fp32, peak {report['peak_flops'] / 1e9:.1f} GFLOP/s "
        f"(jnp {MATMUL_N}^2 matmul)")
  print(f"{'name':<12} {'dispatch':<20} {'params':>9} {'active':>9} {'batch':>5} {'seq':>5} "
        f"{'step s':>8} {'tokens/s':>9} {'GFLOP/tok':>9} {'MFU':>6}")
  for r in report["rows"]:
    if "error" in r:
      print(f"{r['name']:<12} {r['dispatch']:<20} not measured: {r['error']}")
      continue
    dispatch = r["dispatch"] if r["dispatch"] == r["implementation"] else (
        f"{r['dispatch']}={r['implementation']}")
    print(f"{r['name']:<12} {dispatch:<20} {r['params_total'] / 1e6:8.2f}M "
          f"{r['params_active'] / 1e6:8.2f}M "
          f"{r['batch']:5d} {r['seq_len']:5d} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f} "
          f"{r['flops_per_token'] / 1e9:9.4f} {100 * r['mfu']:5.1f}%")


def main(argv):
  args, _ = cli.parse(argv, add_flags=_flags, description=__doc__)
  try:
    dispatches(args.dispatches)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  report = run(args)
  print_table(report)
  cli.write_json(args.json, report)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
