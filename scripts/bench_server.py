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
"""

import argparse
import json
import os
import sys

from meshrl.configs import cli

LEVELS = (1, 8, 32)
PROMPTS = ("rev abc=", "You are a terse assistant. Answer: rev xyz=")


def _flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--json", required=True, help="where to write the results")
  parser.add_argument("--requests", type=int, default=4, help="requests per client")
  parser.add_argument("--max_tokens", type=int, default=16, help="completion tokens per request")


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


def print_table(report: dict) -> None:
  print(f"{'clients':>8} {'p50 s':>8} {'p99 s':>8} {'tokens/s':>10} {'req/s':>8} {'errors':>7}")
  for clients, d in report["server_detail"].items():
    print(f"{clients:>8} {d['p50_s']:>8.3f} {d['p99_s']:>8.3f} {d['tokens_per_s']:>10.1f} "
          f"{d['requests_per_s']:>8.2f} {d['errors']:>7}")
  print(f"batching gain (tokens/s at 32 clients / at 1): {report['server_batching_gain']:.2f}x; "
        f"prefix-cache hit rate {report['server_prefix_hit_rate']:.2f}; {report['server_slots']} slots")


def main(argv):
  if not any(a.startswith("--config.serve.slots") for a in argv):
    argv = list(argv) + ["--config.serve.slots=32"]
  args, cfg = cli.parse(argv, add_flags=_flags, description=__doc__)
  report = section_server(args, cfg)
  print_table(report)
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  return 0 if report["server_errors_32"] == 0 else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
