"""The OpenAI API's error response, shared by the request parsers (serve/openai_api.py,
serve/tools.py) and the HTTP app: an HTTP status and OpenAI's error body
{"error": {"message", "type", "param", "code"}}, the message naming the parameter."""

from __future__ import annotations


class APIError(Exception):
  """An error response: HTTP `status` and OpenAI's error body."""

  def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
