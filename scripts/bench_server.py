"""Server benchmark (issue 13): latency and throughput of scripts/serve.py's server under 1, 8 and 32
concurrent clients, in one process.

Run:  JAX_PLATFORMS=cpu python scripts/bench_server.py --json runs/bench_server.json
      (--config=... and --config.a.b=... as in serve.py; configs/tiny.py, random weights, unless told
      otherwise; --requests per client, --max_tokens per request)

The server (serve/app.py over serve/engine.py, cfg.serve.slots decode slots, 32 unless set) runs in
a thread on a free port; each level of concurrency is a closed-loop load test (serve/loadtest.py:
every client sends its requests one after another) of /v1/completions. Every prefill bucket and
the decode chunk are compiled by warm-up requests first. Keys: server_p50_s, server_p99_s (request
latency at 32 clients), server_tps_1 / _8 / _32 (completion tokens per second), server_errors_32,
server_batching_gain (tps_32 / tps_1), server_prefix_hit_rate, and per level under server_detail.
`section_server(args, cfg)` is also what scripts/bench_speed.py's `server` section calls.

Chunked prefill (issue 34, rl.prefill_chunk): with --long_prompt=N, short requests queued right
behind one N-token prompt, on an engine that feeds that prompt whole and on one that feeds it in
chunks of rl.prefill_chunk (128 when unset), in the same run: their median time to first token
(server_ttft_short_whole_s, server_ttft_short_chunked_s) and the ratio whole / chunked
(server_ttft_ratio; > 1: chunking lets the short requests start sooner). N + --max_tokens must fit
serve.max_len, e.g. --config.model.max_seq_len=2048 --long_prompt=1536 on configs/tiny.py.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time

from meshrl.configs import cli

LEVELS = (1, 8, 32)
PROMPTS = ("rev abc=", "You are a terse assistant. Answer: rev xyz=")


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--requests", type=int, default=4, help="requests per client")
  parser.add_argument("--max_tokens", type=int, default=16, help="completion tokens per request")
  parser.add_argument("--long_prompt", type=int, default=0,
                      help="tokens of the long prompt of the chunked-prefill figure (0: no such figure)")


def section_server(args, cfg) -> dict:
  """Starts the server on cfg in a thread, runs the load tests, stops it; returns the JSON keys."""
  # pylint: disable=import-outside-toplevel
  import httpx

  from meshrl.serve.app import ServerThread, make_app
  from meshrl.serve.loadtest import load_test
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from serve import build  # scripts/serve.py
  # pylint: enable=import-outside-toplevel
  requests = getattr(args, "requests", 4)
  max_tokens = getattr(args, "max_tokens", 16)
  engine, tokenizer, name = build(cfg)
  engine.start()
  server = ServerThread(make_app(engine, tokenizer, model_name=name)).start()
  try:
    for prompt in PROMPTS + PROMPTS[1:]:  # compile the prefill buckets, decode chunk, prefix reuse
      reply = httpx.post(server.url + "/v1/completions", timeout=600,
                         json={"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
      reply.raise_for_status()
    detail = {}
    for clients in LEVELS:
      detail[clients] = load_test(server.url, clients, requests, model=name, prompt=PROMPTS[clients % 2],
                                  max_tokens=max_tokens)
    metrics = engine.metrics()
  finally:
    server.stop()
    engine.close()
  top = detail[LEVELS[-1]]
  return {"server_p50_s": top["p50_s"], "server_p99_s": top["p99_s"],
          **{f"server_tps_{c}": detail[c]["tokens_per_s"] for c in LEVELS},
          "server_errors_32": top["errors"],
          "server_batching_gain": detail[32]["tokens_per_s"] / max(detail[1]["tokens_per_s"], 1e-9),
          "server_prefix_hit_rate": metrics["prefix_hit_rate"], "server_slots": engine.spec.slots,
          "server_detail": {str(c): d for c, d in detail.items()}}


SHORT_REQUESTS = 4  # short requests queued behind the long prompt


def _time_to_first_tokens(engine, long_prompt, shorts, max_tokens) -> list[float]:
  """Submits the long prompt, then the short prompts at once; waits for all -> each short's seconds
  from its submission to its first token."""
  from meshrl.serve.engine import Request  # pylint: disable=import-outside-toplevel
  done, first, errors = [threading.Event() for _ in range(len(shorts) + 1)], [None] * len(shorts), []

  def emit(i):
    def on(event):
      if i < len(shorts) and event.tokens and first[i] is None:
        first[i] = time.perf_counter()
      if event.finish_reason is not None:
        if event.error:
          errors.append(event.error)
        done[i].set()
    return on
  engine.submit(Request(prompt=long_prompt, max_tokens=max_tokens, emit=emit(len(shorts))))
  sent = time.perf_counter()
  for i, prompt in enumerate(shorts):
    engine.submit(Request(prompt=prompt, max_tokens=max_tokens, emit=emit(i)))
  for event in done:
    if not event.wait(600):
      raise RuntimeError("a request of the chunked-prefill figure did not end within 600 s")
  if errors:
    raise RuntimeError(f"a request of the chunked-prefill figure failed: {errors[0]}")
  return [t - sent for t in first]


def section_prefill_chunks(args, cfg) -> dict:
  """The chunked-prefill figure (see the module docstring): two engines of cfg (prefix cache off, so
  every round prefills the whole prompt), each warmed up by one round and timed on the next."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from serve import build  # pylint: disable=import-outside-toplevel  (scripts/serve.py)
  chunk = cfg.rl.prefill_chunk or 128
  rng = np.random.default_rng(0)
  ttft = {}
  for name, value in (("whole", 0), ("chunked", chunk)):
    run_cfg = copy.deepcopy(cfg)
    run_cfg.rl.prefill_chunk, run_cfg.serve.prefix_cache_mb = value, 0.0
    engine, tokenizer, _ = build(run_cfg)
    engine.start()
    try:
      vocab = engine.vocab_size
      long_prompt = rng.integers(3, vocab, args.long_prompt).tolist()
      shorts = [tokenizer.encode(p) for p in ("rev abc=", "1+2=", "x", "sort 3 1=")][:SHORT_REQUESTS]
      _time_to_first_tokens(engine, long_prompt, shorts, args.max_tokens)  # compiles every program
      ttft[name] = statistics.median(_time_to_first_tokens(engine, long_prompt, shorts, args.max_tokens))
    finally:
      engine.close()
  return {"server_ttft_short_whole_s": ttft["whole"], "server_ttft_short_chunked_s": ttft["chunked"],
          "server_ttft_ratio": ttft["whole"] / max(ttft["chunked"], 1e-9), "server_prefill_chunk": chunk,
          "server_long_prompt": args.long_prompt}


def print_table(report: dict) -> None:
  print(f"{'clients':>8} {'p50 s':>8} {'p99 s':>8} {'tokens/s':>10} {'req/s':>8} {'errors':>7}")
  for clients, d in report["server_detail"].items():
    print(f"{clients:>8} {d['p50_s']:>8.3f} {d['p99_s']:>8.3f} {d['tokens_per_s']:>10.1f} "
          f"{d['requests_per_s']:>8.2f} {d['errors']:>7}")
  print(f"batching gain (tokens/s at 32 clients / at 1): {report['server_batching_gain']:.2f}x; "
        f"prefix-cache hit rate {report['server_prefix_hit_rate']:.2f}; {report['server_slots']} slots")
  if "server_ttft_ratio" in report:
    print(f"short requests behind a {report['server_long_prompt']}-token prompt, median time to first token: "
          f"whole prefill {report['server_ttft_short_whole_s']:.3f} s, chunks of {report['server_prefill_chunk']} "
          f"{report['server_ttft_short_chunked_s']:.3f} s: {report['server_ttft_ratio']:.2f}x sooner")


def main(argv):
  if not any(a.startswith("--config.serve.slots") for a in argv):
    argv = list(argv) + ["--config.serve.slots=32"]
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  if args.long_prompt:
    from meshrl.serve.engine import EngineSpec  # pylint: disable=import-outside-toplevel
    max_len = EngineSpec.from_config(cfg).max_len
    if not 0 < args.long_prompt <= max_len - args.max_tokens:
      raise SystemExit(f"--long_prompt={args.long_prompt} must lie in 1..{max_len - args.max_tokens} (serve.max_len="
                       f"{max_len} minus --max_tokens={args.max_tokens}); raise --config.model.max_seq_len.")
  report = section_server(args, cfg)
  if args.long_prompt:
    report.update(section_prefill_chunks(args, cfg))
  print_table(report)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  return 0 if report["server_errors_32"] == 0 else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
