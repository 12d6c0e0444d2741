"""The OpenAI-compatible HTTP server: a Starlette ASGI app over one `Engine` (serve/engine.py).

  app = make_app(engine, tokenizer, model_name="tiny")
  uvicorn.run(app, port=8000)                          # scripts/serve.py
  server = ServerThread(app).start(); server.url       # tests and benchmarks: uvicorn in a thread

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events, ending in `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
(the engine's counters, prefix-cache hit rate included).

The jitted engine runs in its own thread; a handler submits a request whose `emit` callback hands
the engine's events to the handler's asyncio queue (`loop.call_soon_threadsafe`). A client that
disconnects, or a stream cut short by a stop string, cancels its request, which frees its decode slot.
Every failure is an OpenAI-style error body: 400 for bad input (naming the parameter), 404 for an
unknown model or route, 500 if generation itself fails; the server keeps running.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from meshrl.model.tokenizer import Tokenizer
from meshrl.serve import openai_api as api
from meshrl.serve.engine import Engine, Event, Request
from meshrl.serve.textstream import TextStream

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


def _error(e: api.APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status)


async def _body(request: HTTPRequest) -> dict:
  raw = await request.body()
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise api.APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


class _Call:
  """One sample's link to the engine: submit, receive events on this event loop, cancel. Sample i of
  a request with a seed draws with seed + i (n samples of one seeded request differ, and repeat)."""

  def __init__(self, engine: Engine, gen: api.Generation, index: int = 0):
    if not engine.is_alive():
      raise api.APIError(503, "the generation engine is not running.", kind="server_error")
    loop = asyncio.get_running_loop()
    self.engine, self.events, self.index = engine, asyncio.Queue(), index
    seed = None if gen.seed is None else (gen.seed + index) % 2**31
    self.request = Request(prompt=list(gen.prompt_ids), max_tokens=gen.max_tokens,
                           temperature=gen.temperature, top_p=gen.top_p, seed=seed,
                           emit=lambda event: loop.call_soon_threadsafe(self.events.put_nowait, event))
    try:
      engine.submit(self.request)
    except ValueError as e:
      raise api.APIError(400, str(e)) from None
    self.tokens: list[int] = []  # generated so far
    self.logprobs: list[float] = []
    self.ended = False

  async def next(self, timeout: float | None = None) -> Event:
    event = await asyncio.wait_for(self.events.get(), timeout)
    self.tokens += list(event.tokens)
    self.logprobs += list(event.logprobs)
    self.ended = event.finish_reason is not None
    return event

  def cancel(self, finish_reason: str = "cancelled") -> None:
    """Frees the request's slot unless it has ended ("stop": a stop string ended it)."""
    if not self.ended:
      self.engine.cancel(self.request.id, finish_reason)
      self.ended = True


def _calls(engine: Engine, gen: api.Generation) -> list[_Call]:
  """The request's n samples, submitted (all cancelled if one is refused)."""
  calls = []
  try:
    for index in range(gen.n):
      calls.append(_Call(engine, gen, index))
  except api.APIError:
    for call in calls:
      call.cancel()
    raise
  return calls


def _sse(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


async def _sample_events(call: _Call, gen: api.Generation, tokenizer: Tokenizer):
  """(delta text, its tokens' log-probs, finish reason or None, error or None) of one sample, as
  events arrive; the last has a finish reason or an error."""
  text = TextStream(tokenizer, gen.stop)
  while True:
    event = await call.next()
    if event.error:
      yield None, None, None, event.error
      return
    delta = text.push(event.tokens)
    finish = None
    if text.stopped:
      call.cancel("stop")
      finish = "stop"
    elif event.finish_reason is not None:
      delta += text.flush()
      finish = event.finish_reason
    yield delta, api.token_logprobs(gen, tokenizer, event.tokens, event.logprobs), finish, None
    if finish is not None:
      return


async def _stream(calls: list[_Call], gen: api.Generation, tokenizer: Tokenizer, model: str) -> AsyncIterator[str]:
  """Server-sent events of every sample, interleaved as they arrive (each chunk names its index)."""
  rid = api.new_id(gen.chat)
  streams = {call.index: _sample_events(call, gen, tokenizer).__aiter__() for call in calls}
  pending = {asyncio.ensure_future(stream.__anext__()): index for index, stream in streams.items()}
  try:
    if gen.chat:
      for call in calls:
        yield _sse(api.chunk(rid, model, gen, None, role=True, index=call.index))
    failed = False
    while pending and not failed:
      done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
      for task in done:
        index = pending.pop(task)
        delta, logprobs, finish, error = task.result()
        if error:
          yield _sse(api.APIError(500, error, kind="server_error").body())
          failed = True
          break
        if delta or logprobs:
          yield _sse(api.chunk(rid, model, gen, delta, index=index, logprobs=logprobs))
        if finish is not None:
          yield _sse(api.chunk(rid, model, gen, None if gen.chat else "", finish, index=index))
        else:
          pending[asyncio.ensure_future(streams[index].__anext__())] = index
    if not failed and gen.include_usage:
      yield _sse(api.usage_chunk(rid, model, gen, sum(len(c.tokens) for c in calls)))
    yield "data: [DONE]\n\n"
  finally:
    for task in pending:
      task.cancel()
    for call in calls:
      call.cancel()  # the client went away mid-stream (or we are done): free the slots


async def _whole(calls: list[_Call], gen: api.Generation, tokenizer: Tokenizer, model: str,
                 request: HTTPRequest) -> JSONResponse:
  choices = []
  try:
    for call in calls:
      text = TextStream(tokenizer, gen.stop)
      while True:
        try:
          event = await call.next(DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            return JSONResponse({}, status_code=499)
          continue
        if event.error:
          raise api.APIError(500, event.error, kind="server_error")
        text.push(event.tokens)
        if text.stopped:
          call.cancel("stop")
          finish = "stop"
          break
        if event.finish_reason is not None:
          text.flush()
          finish = event.finish_reason
          break
      choices.append({"text": text.text, "finish": finish,
                      "logprobs": api.token_logprobs(gen, tokenizer, call.tokens, call.logprobs)})
  finally:
    for call in calls:
      call.cancel()
  return JSONResponse(api.response(api.new_id(gen.chat), model, gen, choices, sum(len(c.tokens) for c in calls)))


def make_app(engine: Engine, tokenizer: Tokenizer, *, model_name: str) -> Starlette:
  """The ASGI app serving `engine` (started by the caller) under the model id `model_name`."""
  created = int(time.time())
  context = engine.spec.max_len
  model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "meshrl"}

  async def generate(request: HTTPRequest, parse):
    try:
      gen = parse(await _body(request), tokenizer, context=context, model_name=model_name)
      calls = _calls(engine, gen)
    except api.APIError as e:
      return _error(e)
    if gen.stream:
      return StreamingResponse(_stream(calls, gen, tokenizer, model_name), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    try:
      return await _whole(calls, gen, tokenizer, model_name, request)
    except api.APIError as e:
      return _error(e)

  async def completions(request):
    return await generate(request, api.parse_completion)

  async def chat(request):
    return await generate(request, api.parse_chat)

  async def models(_):
    return JSONResponse({"object": "list", "data": [model_card]})

  async def model(request):
    if request.path_params["name"] != model_name:
      return _error(api.APIError(404, f"the model `{request.path_params['name']}` does not exist.",
                                 param="model", code="model_not_found"))
    return JSONResponse(model_card)

  async def health(_):
    alive = engine.is_alive()
    return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

  async def metrics(_):
    return JSONResponse(engine.metrics())

  async def http_error(_, exc: HTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(api.APIError(exc.status_code, str(exc.detail), kind=kind))

  async def server_error(_, exc: Exception):
    return _error(api.APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

  routes = [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"])]
  return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


class ServerThread:
  """uvicorn serving `app` from a background thread on `host`:`port` (0: a free port)."""

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
    self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.sock.bind((host, port))
    self.host, self.port = host, self.sock.getsockname()[1]
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                timeout_graceful_shutdown=1))
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                   name="meshrl-serve-http")

  @property
  def url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout: float = 30.0) -> "ServerThread":
    self.thread.start()
    deadline = time.time() + timeout
    while not self.server.started:
      if time.time() > deadline or not self.thread.is_alive():
        raise RuntimeError(f"the server did not start on {self.url} within {timeout} s.")
      time.sleep(0.02)
    return self

  def stop(self) -> None:
    self.server.should_exit = True
    self.thread.join(timeout=10)
    self.sock.close()
