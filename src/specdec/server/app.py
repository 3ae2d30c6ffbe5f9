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

from specdec.decoding import FixedGamma
from specdec.models.causal_lm import context_length, vocab_size
from specdec.server.metrics import Metrics
from specdec.server.protocol import APIError, Sampling, parse_sampling
from specdec.server.scheduler import Failed, Finished, Request, Scheduler, Tokens
from specdec.threads import decode_threads

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512


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
    names = {"DraftModel": "draft", "LayerSkip": "layer-skip", "PromptLookup": "prompt-lookup",
             "Bigram": "bigram", "DraftTree": "draft-tree", "MultiDraft": "multi-draft"}
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
    limit = context_length(target)
    served = served_methods(drafter)  # the names a request's `speculative.method` may give
    served_method = served[0]
    vocab = vocab_size(target)
    created = int(time.time())
    chat_template = chat_template or getattr(tokenizer, "chat_template", None)  # the caller's tokenizer is not changed

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

    async def read_body(http: HTTPRequest) -> dict:
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

    def check_ids(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(f"'{param}' is empty; send at least one token of text", param=param)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]!r} in '{param}' is outside the vocabulary [0, {vocab}); "
                           "tokenize with this model's tokenizer", param=param, code="invalid_token_id")
        return ids

    def budget(n: int, sampling: Sampling, default: int) -> int:
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

    def submit(ids: list[int], sampling: Sampling, max_new: int, index: int = 0) -> Request:
        if not scheduler.accepting:
            raise APIError("the server is shutting down; retry against another instance", status=503,
                           type_="server_error", code="shutting_down")
        method = sampling.extra.get("method")
        if method not in (None, "none", *served):
            raise APIError(f"'speculative.method' {method!r} is not served here; this server drafts with "
                           f"{served_method!r} (or send \"none\" for plain decoding)", param="speculative.method")
        gamma = FixedGamma(0) if sampling.plain else (sampling.gamma or max_gamma)
        # Choice i of a seeded request with n > 1 uses seed + i (the choices differ, and each reproduces).
        seed = None if sampling.seed is None else sampling.seed + index
        options = dict(gamma=gamma, max_new_tokens=max_new, temperature=sampling.temperature,
                       top_k=sampling.top_k, top_p=sampling.top_p, seed=seed, logprobs=sampling.logprobs)
        # A seeded sampled request keeps a fixed γ (its draws then reproduce); so does an explicit gamma.
        adaptive = sampling.gamma is None and not (sampling.seed is not None and sampling.temperature > 0)
        request = Request(ids, options, asyncio.get_running_loop(), adaptive=adaptive)
        scheduler.submit(request)
        return request

    def summed_usage(prompt_tokens: int, requests: list[Request]) -> dict:
        """The prompt counted once (as OpenAI does for n > 1), completions and draft accounting summed."""
        parts = [_usage(prompt_tokens, r) for r in requests]
        completion = sum(p["completion_tokens"] for p in parts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "completion_tokens_details": {
                    key: sum(p["completion_tokens_details"][key] for p in parts)
                    for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")}}

    async def respond(http: HTTPRequest, ids: list[int], sampling: Sampling, max_new: int, chat: bool):
        """n rows of the same prompt decode in the batch like independent requests; choice i is row i."""
        requests = [submit(ids, sampling, max_new, i) for i in range(sampling.n)]

        def cancel_all() -> None:
            for r in requests:
                scheduler.cancel(r)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        assemblers = [TextAssembler(tokenizer, sampling.stop) for _ in requests]
        formats = [LogprobsFormatter(tokenizer, chat) if sampling.logprobs is not None else None for _ in requests]
        try:  # wait for every row's first tokens, so a request failing in its first round is a real HTTP error
            firsts = [await r.events.get() for r in requests]
        except asyncio.CancelledError:
            cancel_all()
            raise
        for first in firsts:
            if isinstance(first, Failed):
                cancel_all()
                raise APIError(first.message, status=first.status,
                               type_="server_error" if first.status >= 500 else "invalid_request_error")

        def choice(index: int, text: str | None, finish: str | None, stream: bool,
                   logprobs: dict | None = None) -> dict:
            if chat:
                key = "delta" if stream else "message"
                content = {"content": text} if stream else {"role": "assistant", "content": text}
                if stream and text is None:
                    content = {}
                return {"index": index, key: content, "logprobs": logprobs, "finish_reason": finish}
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

        if not sampling.stream:
            async def collect(index: int) -> dict:
                request, assembler, fmt = requests[index], assemblers[index], formats[index]
                item, finish, logprob_parts = firsts[index], None, []
                while True:
                    if isinstance(item, Tokens):
                        if fmt is not None:
                            logprob_parts.append(fmt.format(item))
                        _, stopped = assembler.add(item.ids)
                        if stopped:
                            scheduler.cancel(request)
                            finish = "stop"
                            break
                    elif isinstance(item, Finished):
                        assembler.finish()
                        finish = item.reason
                        break
                    else:
                        raise APIError(item.message, status=item.status, type_="server_error")
                    item = await request.events.get()
                return choice(index, assembler.text, finish, False, LogprobsFormatter.merge(logprob_parts))

            try:
                choices = await asyncio.gather(*(collect(i) for i in range(len(requests))))
            except (asyncio.CancelledError, APIError):
                cancel_all()
                raise
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                    "choices": list(choices), "usage": summed_usage(len(ids), requests)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage=None) -> str:
            data = {"id": rid, "object": chunk_obj, "created": int(time.time()), "model": model_name,
                    "choices": choices}
            if sampling.include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n"

        async def events():
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
                if chat:
                    for index in range(len(requests)):
                        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                while open_rows:
                    index, item = await merged.get()
                    if index not in open_rows:
                        continue  # a row already ended by a stop string
                    assembler, fmt = assemblers[index], formats[index]
                    if isinstance(item, Tokens):
                        delta, stopped = assembler.add(item.ids)
                        logprobs = fmt.format(item) if fmt is not None else None
                        if delta or logprobs:
                            yield chunk([choice(index, delta, None, True, logprobs)])
                        if not stopped:
                            continue
                        scheduler.cancel(requests[index])
                        finish = "stop"
                    elif isinstance(item, Finished):
                        delta = assembler.finish()
                        if delta:
                            yield chunk([choice(index, delta, None, True)])
                        finish = item.reason
                    else:
                        metrics.request_errors.labels(status=str(item.status)).inc()
                        error = APIError(item.message, status=item.status, type_="server_error")
                        yield f"data: {json.dumps(error.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        done = True
                        return
                    open_rows.discard(index)
                    yield chunk([choice(index, None, finish, True)])
                done = True
                if sampling.include_usage:
                    yield chunk([], summed_usage(len(ids), requests))
                yield "data: [DONE]\n\n"
            finally:
                for task in forwarders:
                    task.cancel()
                if not done or open_rows:  # the client went away (or a row failed): free the rows
                    cancel_all()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await read_body(http)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if prompt is None or prompt == "" or prompt == []:
            raise APIError("'prompt' is required: a string or a list of token ids", param="prompt")
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if not ids and tokenizer.bos_token_id is not None:
                ids = [tokenizer.bos_token_id]
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list):
            raise APIError("only one prompt per request is supported; send a string or one list of token ids",
                           param="prompt")
        else:
            raise APIError("'prompt' must be a string or a list of token ids", param="prompt")
        ids = check_ids(ids, "prompt")
        sampling = parse_sampling(body, chat=False)
        return await respond(http, ids, sampling, budget(len(ids), sampling, DEFAULT_MAX_TOKENS), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await read_body(http)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError("'messages' is required: a non-empty list of {role, content} objects", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise APIError("each message must be an object with string 'role' and 'content'", param="messages")
        if not chat_template:
            raise APIError("this model's tokenizer has no chat template; use /v1/completions with a plain prompt, "
                           "or start the server with --chat-template FILE", param="messages",
                           code="no_chat_template")
        encoded = tokenizer.apply_chat_template(messages, chat_template=chat_template, add_generation_prompt=True,
                                                tokenize=True)
        ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        ids = check_ids(ids, "messages")
        sampling = parse_sampling(body, chat=True)
        return await respond(http, ids, sampling, budget(len(ids), sampling, DEFAULT_CHAT_MAX_TOKENS), chat=True)

    return app
