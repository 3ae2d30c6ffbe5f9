"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions over the batched scheduler.

Handlers validate, tokenize, enqueue a `Request` and turn its events into a JSON body or an SSE stream
(`data: {json}\\n\\n` chunks, an optional usage chunk with empty `choices`, then `data: [DONE]`). They never
touch a model. A client that goes away cancels its row (freed at the next round boundary).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specdec.engine.options import DecodeOptions
from specdec.engine.policies import FixedGamma
from specdec.errors import SpecdecError
from specdec.runtime.causal_lm import context_length, vocab_size
from specdec.runtime.threads import decode_threads
from specdec.server.metrics import Metrics
from specdec.server.protocol import APIError, Sampling, parse_sampling
from specdec.server.scheduler import Failed, Finished, Request, Scheduler, Tokens

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512
MAX_PROMPTS = 256  # prompts in one /v1/completions request (each decodes as n rows of the batch)


class TextAssembler:
    """Tokens in, text deltas out; holds back what could still turn into a stop string or a split character."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.emitted = 0  # characters of the decoded text already sent
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""

    def add(self, tokens: list[int]) -> tuple[str, bool]:
        """(new text safe to send, whether a stop string ended the completion)."""
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, self.emitted - self.hold)) for s in self.stops) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
            delta = self.text[self.emitted :]
            self.emitted = len(self.text)
            return delta, True
        self.text = text
        safe = len(text) - (1 if text.endswith("\ufffd") else 0) - self.hold
        if safe <= self.emitted:
            return "", False
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta, False

    def finish(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


class LogprobsFormatter:
    """A round's token log-probabilities in OpenAI's shapes: completions' parallel lists, chat's `content`
    list. Values are the target's raw log-probabilities from the verification pass (see docs/batching.md)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def entry(self, token: int, logprob: float) -> dict:
        text = self.piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def format(self, tokens: Tokens) -> dict:
        if self.chat:
            return {"content": [{**self.entry(t, lp), "top_logprobs": [self.entry(a, alp) for a, alp in top]}
                                for t, lp, top in zip(tokens.ids, tokens.logprobs, tokens.top_logprobs)],
                    "refusal": None}
        pieces = [self.piece(t) for t in tokens.ids]
        offsets = []
        for text in pieces:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": pieces, "token_logprobs": tokens.logprobs,
                "top_logprobs": [self.by_text(top) for top in tokens.top_logprobs],
                "text_offset": offsets}

    def by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """{text: log-probability}, best first; ids that decode to the same text keep the best one's value."""
        out: dict[str, float] = {}
        for token, logprob in top:
            out.setdefault(self.piece(token), logprob)
        return out

    @staticmethod
    def merge(parts: list[dict]) -> dict | None:
        if not parts:
            return None
        return {key: (None if key == "refusal" else [x for part in parts for x in part[key]]) for key in parts[0]}


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _usage(prompt_tokens: int, request: Request) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": request.completion_tokens,
        "total_tokens": prompt_tokens + request.completion_tokens,
        "completion_tokens_details": {
            "accepted_prediction_tokens": request.accepted,
            "rejected_prediction_tokens": request.drafted - request.accepted,
        },
    }


def served_methods(drafter) -> tuple[str, ...]:
    """The `speculative.method` names (the CLI's --drafter kinds) that name this server's drafter, canonical
    first: a request may ask for its server's method or "none", never switch to another one."""
    if drafter is None:
        return ("none",)
    kind = type(drafter).__name__
    if kind == "Eagle":
        return ("eagle", "eagle-chain") if drafter.top_k == 1 else ("eagle",)
    if kind == "Medusa":
        return ("medusa", "medusa-chain") if drafter.tree is None else ("medusa",)
    if kind == "Mtp":
        return ("mtp",) if drafter.top_k == 1 else ("mtp-tree",)
    names = {"DraftModel": "draft", "LayerSkip": "layer-skip", "PromptLookup": "prompt-lookup",
             "Bigram": "bigram", "DraftTree": "draft-tree", "MultiDraft": "multi-draft", "SuffixDecoding": "suffix"}
    return (names.get(kind, kind),)


def create_app(target, tokenizer, drafter=None, *, model_name: str = "specdec", max_batch: int = 64,
               max_gamma: int = 4, adaptive_gamma: bool = True, max_body_bytes: int = 1 << 20,
               drain_s: float = 10.0, chat_template: str | None = None, compile: bool | str = False,
               max_len: int | None = None, precompile: bool = True) -> FastAPI:
    """compile=True: the target's batched passes run compiled over a preallocated cache of `max_len` slot
    columns (a request that does not fit gets a 400); with `precompile` every pass shape the scheduler may
    use is compiled here, before the app is returned, so no request waits for a compile."""
    decode_threads(target)  # the thread count is measured now, not during the first request (README "Threads")
    metrics = Metrics()
    scheduler = Scheduler(target, drafter, max_batch=max_batch, max_gamma=max_gamma, metrics=metrics,
                          adaptive_gamma=adaptive_gamma, compile=compile, max_len=max_len)
    if precompile:
        scheduler.precompile()
    chat_template = chat_template or getattr(tokenizer, "chat_template", None)  # the caller's tokenizer is not changed
    service = _Service(scheduler, metrics, tokenizer, model_name=model_name, limit=context_length(target),
                       vocab=vocab_size(target), served=served_methods(drafter), max_gamma=max_gamma,
                       max_body_bytes=max_body_bytes, chat_template=chat_template)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop, drain_s)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        metrics.request_errors.labels(status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok" if scheduler.accepting and scheduler.thread.is_alive() else "stopping",
                **scheduler.load}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specdec"}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await service.read_body(http)
        prompts = [service.check_ids(ids, "prompt") for ids in service.prompts_ids(body)]
        sampling = parse_sampling(body, chat=False)
        return await service.respond([(ids, service.budget(len(ids), sampling, DEFAULT_MAX_TOKENS))
                                      for ids in prompts], sampling, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await service.read_body(http)
        ids = service.check_ids(service.chat_ids(body), "messages")
        sampling = parse_sampling(body, chat=True)
        return await service.respond([(ids, service.budget(len(ids), sampling, DEFAULT_CHAT_MAX_TOKENS))], sampling,
                                     chat=True)

    return app


class _Service:
    """What the routes share: request bodies checked and tokenized, rows submitted to the scheduler, and their
    events turned into an OpenAI response (`_Reply`)."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, tokenizer, *, model_name: str, limit: int | None,
                 vocab: int, served: tuple[str, ...], max_gamma: int, max_body_bytes: int, chat_template: str | None):
        self.scheduler, self.metrics, self.tokenizer = scheduler, metrics, tokenizer
        self.model_name, self.limit, self.vocab = model_name, limit, vocab
        self.served = served  # the names a request's `speculative.method` may give, canonical first
        self.max_gamma, self.max_body_bytes, self.chat_template = max_gamma, max_body_bytes, chat_template

    async def read_body(self, http: HTTPRequest) -> dict:
        max_body_bytes, model_name = self.max_body_bytes, self.model_name
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(f"request body of {declared} bytes exceeds the limit of {max_body_bytes}; send a "
                           "shorter prompt", code="request_too_large")
        raw = await http.body()
        if len(raw) > max_body_bytes:
            raise APIError(f"request body exceeds the limit of {max_body_bytes} bytes; send a shorter prompt",
                           code="request_too_large")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(f"the request body is not valid JSON ({exc}); send a JSON object",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(f"unknown model {model!r}; this server serves {model_name!r} (see GET /v1/models)",
                           param="model", code="model_not_found")
        return body

    def prompts_ids(self, body: dict) -> list[list[int]]:
        """/v1/completions: the token ids of each prompt of the request, in order: one prompt (a string or a list of
        token ids) or a list of them (OpenAI's batched prompts; choices p·n .. p·n + n − 1 are prompt p's)."""
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise APIError("'prompt' is required: a string or a list of token ids (or a list of those)", param="prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(map(_is_token_id, prompt))):
            prompts = [prompt]
        elif isinstance(prompt, list) and all(isinstance(p, str) or (isinstance(p, list) and all(map(_is_token_id, p)))
                                              for p in prompt):
            prompts = prompt
        else:
            raise APIError("'prompt' must be a string, a list of token ids, or a list of strings or of token-id lists",
                           param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise APIError(f"{len(prompts)} prompts in one request; send at most {MAX_PROMPTS}, or split the request",
                           param="prompt")
        out = []
        for i, one in enumerate(prompts):
            if one == "" or one == []:
                raise APIError(f"prompt {i} of the request is empty; send at least one token of text", param="prompt")
            if isinstance(one, str):
                ids = self.tokenizer(one, add_special_tokens=True)["input_ids"]
                if not ids and self.tokenizer.bos_token_id is not None:
                    ids = [self.tokenizer.bos_token_id]
                out.append(ids)
            else:
                out.append(list(one))
        return out

    def chat_ids(self, body: dict) -> list[int]:
        """/v1/chat/completions: the token ids of the messages through the chat template."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError("'messages' is required: a non-empty list of {role, content} objects", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise APIError("each message must be an object with string 'role' and 'content'", param="messages")
        if not self.chat_template:
            raise APIError("this model's tokenizer has no chat template; use /v1/completions with a plain prompt, "
                           "or start the server with --chat-template FILE", param="messages",
                           code="no_chat_template")
        encoded = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                     add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.vocab
        if not ids:
            raise APIError(f"'{param}' is empty; send at least one token of text", param=param)
        bad = [t for t in ids if not _is_token_id(t) or not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]!r} in '{param}' is outside the vocabulary [0, {vocab}); "
                           "tokenize with this model's tokenizer", param=param, code="invalid_token_id")
        return ids

    def budget(self, n: int, sampling: Sampling, default: int) -> int:
        limit = self.limit
        if limit is not None and n >= limit:
            raise APIError(f"the prompt has {n} tokens, the model's context is {limit}; shorten the prompt",
                           param="prompt", code="context_length_exceeded")
        if sampling.max_tokens is None:
            return default if limit is None else min(default, limit - n)
        if limit is not None and n + sampling.max_tokens > limit:
            raise APIError(f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceeds the model's context "
                           f"of {limit} tokens; lower max_tokens or shorten the prompt", param="max_tokens",
                           code="context_length_exceeded")
        return sampling.max_tokens

    def submit(self, ids: list[int], sampling: Sampling, max_new: int, index: int = 0) -> Request:
        if not self.scheduler.accepting:
            raise APIError("the server is shutting down; retry against another instance", status=503,
                           type_="server_error", code="shutting_down")
        method = sampling.extra.get("method")
        if method not in (None, "none", *self.served):
            raise APIError(f"'speculative.method' {method!r} is not served here; this server drafts with "
                           f"{self.served[0]!r} (or send \"none\" for plain decoding)", param="speculative.method")
        gamma = FixedGamma(0) if sampling.plain else (sampling.gamma or self.max_gamma)
        # Choice i of a seeded request with n > 1 uses seed + i (the choices differ, and each reproduces).
        seed = None if sampling.seed is None else sampling.seed + index
        try:
            options = DecodeOptions(gamma=gamma, max_new_tokens=max_new, temperature=sampling.temperature,
                                    top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, logprobs=sampling.logprobs)
        except SpecdecError as exc:  # the protocol checks come first; this names anything they let through
            raise APIError(str(exc)) from None
        # A seeded sampled request keeps a fixed γ (its draws then reproduce); so does an explicit gamma.
        adaptive = sampling.gamma is None and not (sampling.seed is not None and sampling.temperature > 0)
        request = Request(ids, options, asyncio.get_running_loop(), adaptive=adaptive)
        self.scheduler.submit(request)
        return request

    async def respond(self, prompts: list[tuple[list[int], int]], sampling: Sampling, chat: bool):
        """Each prompt (token ids, max new tokens) decodes as n rows of the batch, like independent requests; choice
        p·n + i is prompt p's row i (which equals the lone request of that prompt with seed + i)."""
        # Every prompt was checked and budgeted before this, and what `submit` checks is the same for every row: a
        # request is refused before its first row is queued, or not at all.
        requests = [self.submit(ids, sampling, max_new, i) for ids, max_new in prompts for i in range(sampling.n)]
        reply = _Reply(self, sum(len(ids) for ids, _ in prompts), sampling, requests, chat)
        try:  # wait for every row's first tokens, so a request failing in its first round is a real HTTP error
            firsts = [await r.events.get() for r in requests]
        except asyncio.CancelledError:
            reply.cancel_all()
            raise
        for first in firsts:
            if isinstance(first, Failed):
                reply.cancel_all()
                raise APIError(first.message, status=first.status,
                               type_="server_error" if first.status >= 500 else "invalid_request_error")
        if not sampling.stream:
            return await reply.body(firsts)
        return StreamingResponse(reply.events(firsts), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class _Reply:
    """One response: the rows of one request (choice i is row i) and their events as a JSON body or SSE chunks."""

    def __init__(self, service: _Service, prompt_tokens: int, sampling: Sampling, requests: list[Request],
                 chat: bool):
        self.service, self.sampling, self.requests, self.chat = service, sampling, requests, chat
        self.prompt_tokens = prompt_tokens  # each prompt's tokens, counted once
        tokenizer = service.tokenizer
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.assemblers = [TextAssembler(tokenizer, sampling.stop) for _ in requests]
        self.formats = [LogprobsFormatter(tokenizer, chat) if sampling.logprobs is not None else None
                        for _ in requests]

    def cancel_all(self) -> None:
        for r in self.requests:
            self.service.scheduler.cancel(r)

    def choice(self, index: int, text: str | None, finish: str | None, stream: bool,
               logprobs: dict | None = None) -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            content = {"content": text} if stream else {"role": "assistant", "content": text}
            if stream and text is None:
                content = {}
            return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def usage(self) -> dict:
        """Each prompt counted once (as OpenAI does for n > 1), completions and draft accounting summed."""
        prompt_tokens = self.prompt_tokens
        parts = [_usage(prompt_tokens, r) for r in self.requests]
        completion = sum(p["completion_tokens"] for p in parts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "completion_tokens_details": {
                    key: sum(p["completion_tokens_details"][key] for p in parts)
                    for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")}}

    async def body(self, firsts: list) -> dict:
        """The whole response at once (`stream` false)."""
        async def collect(index: int) -> dict:
            request, assembler, fmt = self.requests[index], self.assemblers[index], self.formats[index]
            item, finish, logprob_parts = firsts[index], None, []
            while True:
                if isinstance(item, Tokens):
                    if fmt is not None:
                        logprob_parts.append(fmt.format(item))
                    _, stopped = assembler.add(item.ids)
                    if stopped:
                        self.service.scheduler.cancel(request)
                        finish = "stop"
                        break
                elif isinstance(item, Finished):
                    assembler.finish()
                    finish = item.reason
                    break
                else:
                    raise APIError(item.message, status=item.status, type_="server_error")
                item = await request.events.get()
            return self.choice(index, assembler.text, finish, False, LogprobsFormatter.merge(logprob_parts))

        try:
            choices = await asyncio.gather(*(collect(i) for i in range(len(self.requests))))
        except (asyncio.CancelledError, APIError):
            self.cancel_all()
            raise
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.service.model_name, "choices": list(choices),
                "usage": self.usage()}

    def chunk(self, choices: list, usage=None) -> str:
        data = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.service.model_name, "choices": choices}
        if self.sampling.include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n"

    async def events(self, firsts: list):
        """The SSE stream (`stream` true): every row's events in order, a finish chunk per row, the usage chunk
        when asked, then [DONE]; a client that goes away (or a failed row) frees every row."""
        requests, chunk, choice = self.requests, self.chunk, self.choice
        # Every row's events onto one queue, tagged with the choice index (a row's own order is kept).
        merged: asyncio.Queue = asyncio.Queue()
        for index, first in enumerate(firsts):
            merged.put_nowait((index, first))

        async def forward(index: int) -> None:
            while True:
                item = await requests[index].events.get()
                merged.put_nowait((index, item))
                if not isinstance(item, Tokens):
                    return

        forwarders = [asyncio.ensure_future(forward(i)) for i, f in enumerate(firsts) if isinstance(f, Tokens)]
        open_rows, done = set(range(len(requests))), False
        try:
            if self.chat:
                for index in range(len(requests)):
                    yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            while open_rows:
                index, item = await merged.get()
                if index not in open_rows:
                    continue  # a row already ended by a stop string
                assembler, fmt = self.assemblers[index], self.formats[index]
                if isinstance(item, Tokens):
                    delta, stopped = assembler.add(item.ids)
                    logprobs = fmt.format(item) if fmt is not None else None
                    if delta or logprobs:
                        yield chunk([choice(index, delta, None, True, logprobs)])
                    if not stopped:
                        continue
                    self.service.scheduler.cancel(requests[index])
                    finish = "stop"
                elif isinstance(item, Finished):
                    delta = assembler.finish()
                    if delta:
                        yield chunk([choice(index, delta, None, True)])
                    finish = item.reason
                else:
                    self.service.metrics.request_errors.labels(status=str(item.status)).inc()
                    error = APIError(item.message, status=item.status, type_="server_error")
                    yield f"data: {json.dumps(error.body())}\n\n"
                    yield "data: [DONE]\n\n"
                    done = True
                    return
                open_rows.discard(index)
                yield chunk([choice(index, None, finish, True)])
            done = True
            if self.sampling.include_usage:
                yield chunk([], self.usage())
            yield "data: [DONE]\n\n"
        finally:
            for task in forwarders:
                task.cancel()
            if not done or open_rows:  # the client went away (or a row failed): free the rows
                self.cancel_all()
