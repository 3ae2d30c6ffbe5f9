"""OpenAI request fields → decoding options, with OpenAI's error body for everything we refuse.

Errors: HTTP 400 with {"error": {"message", "type": "invalid_request_error", "param", "code"}} — `param`
names the offending field and the message says what to send instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    gamma: int | None  # from the `speculative` extension; None = the server's default
    plain: bool = False  # speculative.method == "none"
    logprobs: int | None = None  # None: off; k: each token's log-probability and its k most likely alternatives
    n: int = 1  # choices: n rows of the same prompt in the batch
    extra: dict = field(default_factory=dict)


UNSUPPORTED_IF_SET = {
    # field: (value that means "off", why / what to do)
    "echo": (False, "echo is not supported; prepend the prompt yourself"),
    "best_of": (1, "best_of is not supported; send best_of=1 or omit it"),
    "suffix": (None, "suffix (insertion) is not supported; omit it"),
    "presence_penalty": (0, "presence_penalty would change the target distribution; send 0 or omit it"),
    "frequency_penalty": (0, "frequency_penalty would change the target distribution; send 0 or omit it"),
    "logit_bias": (None, "logit_bias is not supported; omit it"),
    "tools": (None, "tool calling is not supported; omit tools"),
    "response_format": (None, "response_format is not supported; omit it"),
}
MAX_TOP_LOGPROBS = 20
MAX_N = 16


def _number(body: dict, name: str, default, *, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        kind = "an integer" if integer else "a number"
        raise APIError(f"'{name}' must be {kind}, got {value!r}", param=name)
    return value


def parse_sampling(body: dict, *, chat: bool) -> Sampling:
    n = _number(body, "n", 1, integer=True)
    if not 1 <= n <= MAX_N:
        raise APIError(f"'n' must be an integer in [1, {MAX_N}], got {n}; send several requests for more choices",
                       param="n")
    logprobs = _logprobs(body, chat)
    for name, (off, why) in UNSUPPORTED_IF_SET.items():
        value = body.get(name)
        if value is not None and value != off and value not in ({}, []):
            raise APIError(why, param=name)

    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, max_name, None, integer=True)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"'{max_name}' must be >= 1, got {max_tokens}", param=max_name)
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise APIError(f"'temperature' must be >= 0 (0 = greedy), got {temperature}", param="temperature")
    top_p = _number(body, "top_p", None)
    if top_p is not None and not (0 < top_p <= 1):
        raise APIError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _number(body, "top_k", None, integer=True)
    if top_k is not None and top_k == -1:
        top_k = None  # vLLM's spelling of "off"
    if top_k is not None and top_k < 1:
        raise APIError(f"'top_k' must be an integer >= 1 (or -1 for off), got {top_k}", param="top_k")
    seed = _number(body, "seed", None, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise APIError("'stop' must be a non-empty string or a list of at most 4 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("'stream_options' must be an object such as {\"include_usage\": true}", param="stream_options")
    include_usage = bool(options.get("include_usage", False))

    spec = body.get("speculative") or {}
    if not isinstance(spec, dict):
        raise APIError("'speculative' must be an object such as {\"gamma\": 4} or {\"method\": \"none\"}",
                       param="speculative")
    unknown = set(spec) - {"method", "gamma"}
    if unknown:
        raise APIError(f"unknown 'speculative' fields {sorted(unknown)}; supported: method, gamma", param="speculative")
    gamma = spec.get("gamma")
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int) or not 0 <= gamma <= 16):
        raise APIError(f"'speculative.gamma' must be an integer in [0, 16], got {gamma!r}", param="speculative.gamma")
    method = spec.get("method")
    if method is not None and not isinstance(method, str):
        raise APIError("'speculative.method' must be a string", param="speculative.method")
    return Sampling(max_tokens, float(temperature), top_p, top_k, seed, stop, stream, include_usage, gamma,
                    plain=(method == "none" or gamma == 0), extra={"method": method}, logprobs=logprobs, n=n)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: `logprobs` = k (0..20) alternatives. Chat: `logprobs: true` and `top_logprobs` = k."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise APIError(f"'logprobs' must be true or false in chat completions, got {wanted!r}", param="logprobs")
        top = _number(body, "top_logprobs", None, integer=True)
        if top is not None and not wanted:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}",
                           param="top_logprobs")
        return (top or 0) if wanted else None
    if "top_logprobs" in body and body["top_logprobs"] is not None:
        raise APIError("'top_logprobs' is a chat completions field; in /v1/completions send 'logprobs': k",
                       param="top_logprobs")
    top = body.get("logprobs")
    if top is None or top is False:
        return None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] (how many top alternatives per "
                       f"token), got {top!r}", param="logprobs")
    return top
