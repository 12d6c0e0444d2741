"""A concurrent load test of an OpenAI-compatible server: latency percentiles, throughput, errors.

  figures = load_test("http://127.0.0.1:8000", clients=32, requests_per_client=4, model="tiny")

Each client is an asyncio task sending its requests one after another (a closed loop, as an agent
harness does), all clients at once over one httpx connection pool.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np


async def _client(http: httpx.AsyncClient, url: str, body: dict, count: int, latencies: list,
                  tokens: list, errors: list) -> None:
  for _ in range(count):
    start = time.perf_counter()
    try:
      reply = await http.post(url, json=body)
      if reply.status_code != 200:
        errors.append(f"HTTP {reply.status_code}: {reply.text[:200]}")
        continue
      tokens.append(reply.json()["usage"]["completion_tokens"])
      latencies.append(time.perf_counter() - start)
    except (httpx.HTTPError, KeyError, ValueError) as e:
      errors.append(f"{type(e).__name__}: {e}")


async def _run(base_url, clients, requests_per_client, body, timeout):
  latencies, tokens, errors = [], [], []
  limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
  async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
    start = time.perf_counter()
    await asyncio.gather(*[_client(http, base_url.rstrip("/") + "/v1/completions", body,
                                   requests_per_client, latencies, tokens, errors) for _ in range(clients)])
    wall = time.perf_counter() - start
  return latencies, tokens, errors, wall


def load_test(base_url: str, clients: int, requests_per_client: int, *, model: str,
              prompt: str = "rev abc=", max_tokens: int = 16, temperature: float = 0.0,
              timeout: float = 300.0) -> dict:
  """Runs `clients` concurrent clients of `requests_per_client` /v1/completions requests each.

  Returns {clients, requests, errors, error_examples, p50_s, p99_s (request latency, successful
  requests), tokens_per_s (completion tokens / wall time), requests_per_s, wall_s}.
  """
  if clients < 1 or requests_per_client < 1:
    raise ValueError(f"clients={clients} and requests_per_client={requests_per_client} must be >= 1.")
  body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
  latencies, tokens, errors, wall = asyncio.run(_run(base_url, clients, requests_per_client, body, timeout))
  lat = np.asarray(latencies) if latencies else np.asarray([np.nan])
  return {"clients": clients, "requests": clients * requests_per_client, "errors": len(errors),
          "error_examples": errors[:3], "p50_s": float(np.percentile(lat, 50)),
          "p99_s": float(np.percentile(lat, 99)), "tokens_per_s": float(sum(tokens) / wall),
          "requests_per_s": float(len(latencies) / wall), "wall_s": float(wall)}
