"""`specdec serve` on 127.0.0.1, driven by the official openai client (tiny float64 models, bounded time)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from models import perturbed, tiny, tiny_tokenizer

import specdec

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package ships with
uvicorn = pytest.importorskip("uvicorn")
from specdec.server import create_app  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
POISON_FROM = 300  # the bare server's model has NaN position embeddings from here on


class LiveServer:
    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=30)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def pair(tokenizer):
    target = tiny("llama", hidden=32, layers=2, vocab=len(tokenizer))
    return target, perturbed(target, 0.1)


@pytest.fixture(scope="module")
def live(pair, tokenizer):
    target, draft = pair
    server = LiveServer(create_app(target, tokenizer, specdec.DraftModel(draft), model_name="tiny",
                                   max_gamma=4, chat_template=TEMPLATE, max_body_bytes=64_000))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bare(tokenizer):
    """GPT-2 with NaN position embeddings past POISON_FROM (a request reaching them fails), no chat template."""
    model = tiny("gpt2", hidden=32, layers=2, vocab=len(tokenizer))
    with torch.no_grad():
        model.transformer.wpe.weight[POISON_FROM:] = float("nan")
    server = LiveServer(create_app(model, tokenizer, specdec.PromptLookup(), model_name="bare"))
    yield server, model
    server.stop()


def lone_text(tokenizer, target, ids, drafter=None, **kw):
    tokens = specdec.generate(target, ids, drafter=drafter, **kw).tokens
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


def prompt_ids(i: int, n: int = 12) -> list[int]:
    return [(i * 31 + j * 7 + 3) % 250 for j in range(n + i % 5)]


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_models_and_health(live):
    assert [m.id for m in live.client.models.list().data] == ["tiny"]
    assert httpx.get(live.url + "/health").json()["status"] == "ok"


def test_completion_matches_lone_greedy_and_reports_drafts(live, pair, tokenizer):
    target, draft = pair
    # γ pinned, so the draft accounting does not depend on the load-based policy's choices.
    out = live.client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=0,
                                         extra_body={"speculative": {"gamma": 4}})
    ids = tokenizer("def add(a, b):")["input_ids"]
    lone = specdec.generate(target, ids, drafter=specdec.DraftModel(draft), gamma=4, max_new_tokens=20)
    text = tokenizer.decode(lone.tokens, skip_special_tokens=True)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == "length"
    usage = out.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 20)
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == lone.stats.accepted > 0
    assert details.rejected_prediction_tokens == lone.stats.drafted - lone.stats.accepted


def test_chat_uses_the_template(live, pair, tokenizer):
    target, draft = pair
    messages = [{"role": "user", "content": "print(i)"}]
    out = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    ids = tokenizer(TEMPLATE.replace("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                                     "user: print(i)\n"))["input_ids"]
    text, _ = lone_text(tokenizer, target, ids, specdec.DraftModel(draft), max_new_tokens=12)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text


def test_streaming_with_usage(live, pair, tokenizer):
    target, draft = pair
    stream = live.client.completions.create(model="tiny", prompt=prompt_ids(3), max_tokens=25, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == lone_text(tokenizer, target, prompt_ids(3), specdec.DraftModel(draft), max_new_tokens=25)[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 25
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_logprobs_completions_chat_and_streaming(live, pair, tokenizer):
    target, draft = pair
    ids = prompt_ids(4)
    _, lone = lone_text(tokenizer, target, ids, specdec.DraftModel(draft), max_new_tokens=10)
    with torch.no_grad():
        want = torch.log_softmax(target(torch.tensor([ids + lone])).logits[0], dim=-1)[len(ids) - 1 : -1]  # [10, V]
    want_chosen = want.gather(1, torch.tensor(lone)[:, None])[:, 0].tolist()
    out = live.client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs == pytest.approx(want_chosen, abs=1e-9)
    # (a dict keyed by text: two ids that decode to the same text share an entry, as in OpenAI's format)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert all(top[t] == pytest.approx(v) for top, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Chat: logprobs + top_logprobs; streamed chunks carry their own tokens' entries.
    messages = [{"role": "user", "content": "print(i)"}]
    chat = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)  # greedy: the best one
    stream = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-9)
    plain = live.client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_streaming_and_stop_string(live):
    stream = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=30, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    full = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(full) > 2
    stop = full[2:4]
    out = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=30, temperature=0, stop=[stop])
    assert out.choices[0].message.content == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seed_reproduces_and_equals_the_lone_request(live, pair, tokenizer):
    target, draft = pair
    kw = dict(model="tiny", prompt=prompt_ids(1), max_tokens=16, temperature=1.0, top_p=0.9)
    a = live.client.completions.create(seed=7, **kw).choices[0].text
    b = live.client.completions.create(seed=7, **kw).choices[0].text
    c = live.client.completions.create(seed=8, **kw).choices[0].text
    lone, _ = lone_text(tokenizer, target, prompt_ids(1), specdec.DraftModel(draft), gamma=4, max_new_tokens=16,
                        temperature=1.0, top_p=0.9, seed=7)
    assert a == b == lone
    assert c != a


def test_n_choices_are_rows_of_the_batch(live, pair, tokenizer):
    """n > 1: choice i is the lone request seeded with seed + i; streamed, choices interleave by index."""
    target, draft = pair
    kw = dict(model="tiny", prompt=prompt_ids(2), max_tokens=12, temperature=1.0, top_p=0.9)
    out = live.client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        lone, _ = lone_text(tokenizer, target, prompt_ids(2), specdec.DraftModel(draft), gamma=4, max_new_tokens=12,
                            temperature=1.0, top_p=0.9, seed=7 + c.index)
        assert c.text == lone
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.completion_tokens == 36 and out.usage.prompt_tokens == len(prompt_ids(2))
    stream = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                                 max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
    texts, finishes = {0: "", 1: ""}, {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
        if not c.choices:
            assert c.usage.completion_tokens == 20
    assert texts[0] == texts[1] and texts[0] and finishes == {0: "length", 1: "length"}


def test_a_list_of_prompts_gets_each_prompt_s_choices_in_order(live, pair, tokenizer):
    """OpenAI's batched prompts (strings and token-id lists alike): choice p·n + i is prompt p's row i, the lone
    request of prompt p seeded with seed + i; usage counts each prompt once; streamed, the same texts."""
    target, draft = pair
    prompts = [prompt_ids(3), "def add(a, b):", prompt_ids(4)]
    ids = [prompts[0], tokenizer("def add(a, b):", add_special_tokens=True)["input_ids"], prompts[2]]
    kw = dict(model="tiny", prompt=prompts, max_tokens=10, temperature=1.0, top_p=0.9, seed=11, n=2)
    out = live.client.completions.create(**kw)
    assert [c.index for c in out.choices] == list(range(6))
    lone = [lone_text(tokenizer, target, ids[p], specdec.DraftModel(draft), gamma=4, max_new_tokens=10,
                      temperature=1.0, top_p=0.9, seed=11 + i) for p in range(3) for i in range(2)]
    assert [c.text for c in out.choices] == [text for text, _ in lone]
    assert out.usage.prompt_tokens == sum(map(len, ids))
    assert out.usage.completion_tokens == sum(len(tokens) for _, tokens in lone)
    texts: dict[int, str] = {}
    for chunk in live.client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {c.index: c.text for c in out.choices}


def test_32_concurrent_streams_each_get_the_lone_greedy_tokens(live, pair, tokenizer):
    target, draft = pair
    n = 32

    def one(i):
        stream = live.client.completions.create(model="tiny", prompt=prompt_ids(i), max_tokens=20 + i % 7,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    rounds_before = metric(live.url, "specdec:batch_size_count")
    single_before = metric(live.url, "specdec:batch_size_bucket", '{le="1.0"}')
    with ThreadPoolExecutor(n) as pool:
        texts = list(pool.map(one, range(n)))
    for i, text in enumerate(texts):
        want, _ = lone_text(tokenizer, target, prompt_ids(i), specdec.DraftModel(draft), max_new_tokens=20 + i % 7)
        assert text == want, i
    rounds = metric(live.url, "specdec:batch_size_count") - rounds_before
    single = metric(live.url, "specdec:batch_size_bucket", '{le="1.0"}') - single_before
    assert rounds - single > 0  # some rounds decoded several requests together


def test_a_tree_drafter_is_served_batched(pair, tokenizer):
    target, draft = pair
    server = LiveServer(create_app(target, tokenizer, specdec.DraftTree(draft, top_k=2, depth=3, max_nodes=6),
                                   model_name="tree"))
    try:
        def one(i):
            out = server.client.completions.create(model="tree", prompt=prompt_ids(i), max_tokens=12, temperature=0,
                                                   extra_body={"speculative": {"method": "draft-tree"}})
            return out.choices[0].text, out.usage.completion_tokens_details.accepted_prediction_tokens

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
    finally:
        server.stop()
    for i, (text, _) in enumerate(results):
        assert text == lone_text(tokenizer, target, prompt_ids(i), max_new_tokens=12)[0], i
    assert sum(accepted for _, accepted in results) > 0


def test_disconnect_frees_the_row(live):
    before = metric(live.url, "specdec:generation_tokens_total")
    with httpx.stream("POST", live.url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt_ids(5), "max_tokens": 400, "temperature": 0, "stream": True,
        "speculative": {"method": "none"},
    }, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk read, then the client goes away
    deadline = time.monotonic() + 5
    while httpx.get(live.url + "/health").json()["running"]:
        assert time.monotonic() < deadline, "the disconnected row was not freed"
        time.sleep(0.01)
    assert metric(live.url, "specdec:generation_tokens_total") - before < 400


def test_failing_request_gets_500_and_others_continue(bare, tokenizer):
    server, model = bare
    good_ids = prompt_ids(2)
    want, _ = lone_text(tokenizer, model, good_ids, specdec.PromptLookup(), max_new_tokens=30)

    def good():
        return server.client.completions.create(model="bare", prompt=good_ids, max_tokens=30, temperature=0)

    def poisoned():
        return server.client.completions.create(model="bare", prompt=prompt_ids(0, POISON_FROM + 10), max_tokens=5)

    with ThreadPoolExecutor(2) as pool:
        ok, bad = pool.submit(good), pool.submit(poisoned)
        with pytest.raises(openai.InternalServerError) as info:
            bad.result()
        assert ok.result().choices[0].text == want
    assert "NaN" in info.value.body["message"] or "NaN" in str(info.value)
    assert server.client.completions.create(model="bare", prompt=good_ids, max_tokens=30, temperature=0
                                            ).choices[0].text == want


def test_no_chat_template_is_a_clear_400(bare):
    server, _ = bare
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(model="bare", messages=[{"role": "user", "content": "hi"}])
    assert "chat template" in info.value.body["message"]


BAD = {
    "unknown model": ({"model": "gpt-9", "prompt": "x"}, "model"),
    "missing prompt": ({"model": "tiny"}, "prompt"),
    "negative temperature": ({"model": "tiny", "prompt": "x", "temperature": -0.5}, "temperature"),
    "top_p zero": ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    "top_p above one": ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
    "max_tokens zero": ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    "past the context": ({"model": "tiny", "prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    "token id outside the vocabulary": ({"model": "tiny", "prompt": [1, 2, 10_000]}, "prompt"),
    "token id outside the vocabulary, second prompt": ({"model": "tiny", "prompt": [[1, 2], [10_000]]}, "prompt"),
    "strings and ids mixed in one prompt": ({"model": "tiny", "prompt": ["x", 5]}, "prompt"),
    "an empty prompt in a list": ({"model": "tiny", "prompt": ["x", ""]}, "prompt"),
    "too many prompts": ({"model": "tiny", "prompt": ["x"] * 257}, "prompt"),
    "n out of range": ({"model": "tiny", "prompt": "x", "n": 17}, "n"),
    "logprobs out of range": ({"model": "tiny", "prompt": "x", "logprobs": 50}, "logprobs"),
    "chat field in completions": ({"model": "tiny", "prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    "bad speculative": ({"model": "tiny", "prompt": "x", "speculative": {"gamma": -1}}, "speculative.gamma"),
    "method not served": ({"model": "tiny", "prompt": "x", "speculative": {"method": "eagle"}}, "speculative.method"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_openai_error_body(live, case):
    body, param = BAD[case]
    response = httpx.post(live.url + "/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"x" * 70_000], ids=["malformed", "not-object", "oversized"])
def test_malformed_or_oversized_body_is_400(live, raw):
    response = httpx.post(live.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"]


def test_bad_request_through_the_openai_client(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_metrics_counters_move(live):
    names = ["specdec:request_success_total", "specdec:generation_tokens_total",
             "specdec:spec_decode_num_drafts_total", "specdec:spec_decode_num_draft_tokens_total",
             "specdec:spec_decode_num_accepted_tokens_total", "specdec:time_to_first_token_seconds_count",
             "specdec:prompt_tokens_total"]
    labels = {"specdec:request_success_total": '{finished_reason="length"}'}
    before = {n: metric(live.url, n, labels.get(n, "")) for n in names}
    out = live.client.completions.create(model="tiny", prompt=prompt_ids(9), max_tokens=10, temperature=0,
                                         extra_body={"speculative": {"gamma": 3}})  # fixed γ, not load-adapted
    after = {n: metric(live.url, n, labels.get(n, "")) for n in names}
    assert after["specdec:request_success_total"] - before["specdec:request_success_total"] == 1
    assert after["specdec:generation_tokens_total"] - before["specdec:generation_tokens_total"] == 10
    assert after["specdec:prompt_tokens_total"] - before["specdec:prompt_tokens_total"] == len(prompt_ids(9))
    drafted = after["specdec:spec_decode_num_draft_tokens_total"] - before["specdec:spec_decode_num_draft_tokens_total"]
    accepted = after["specdec:spec_decode_num_accepted_tokens_total"] - before["specdec:spec_decode_num_accepted_tokens_total"]
    details = out.usage.completion_tokens_details
    assert (accepted, drafted - accepted) == (details.accepted_prediction_tokens, details.rejected_prediction_tokens)
    assert after["specdec:spec_decode_num_drafts_total"] > before["specdec:spec_decode_num_drafts_total"]
    assert after["specdec:time_to_first_token_seconds_count"] == before["specdec:time_to_first_token_seconds_count"] + 1
    text = httpx.get(live.url + "/metrics").text
    for name in ["specdec:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}", "specdec:num_requests_running",
                 "specdec:num_requests_waiting", "specdec:inter_token_latency_seconds_bucket", "specdec:gamma "]:
        assert name in text


def test_graceful_shutdown_finishes_in_flight_requests(pair, tokenizer):
    target, draft = pair
    server = LiveServer(create_app(target, tokenizer, specdec.DraftModel(draft), model_name="tiny"))
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(server.client.completions.create, model="tiny", prompt=prompt_ids(4),
                             max_tokens=60, temperature=0)
        time.sleep(0.05)
        server.stop()
        assert future.result().usage.completion_tokens == 60
    assert not server.app.state.scheduler.thread.is_alive()


def test_cli_serve_builds_the_default_pair_app(capsys):
    from specdec.cli import build_parser
    from specdec.cli.serve import build_app
    from specdec.hub.default_pair import assets_present
    from specdec.runtime.precision import serving_dtype

    if not assets_present():
        pytest.skip("default pair assets not present")
    args = build_parser().parse_args(["serve", "--port", "0", "--compile"])
    assert args.compile and args.max_len == 512  # opt-in (compiling is not tested here)
    args = build_parser().parse_args(["serve", "--port", "0", "--gamma", "3"])
    assert not args.compile
    app = build_app(args)
    scheduler = app.state.scheduler
    assert scheduler.speculative and scheduler.max_gamma == 3 and not scheduler.thread.is_alive()
    assert "serving eagerly: --compile serves faster" in capsys.readouterr().err  # the faster option, said
    # --dtype auto: the batched passes' kernel decides too (float32 where eager bfloat16 rows would run slower)
    assert scheduler.decoder.target.model.dtype == serving_dtype("cpu", compiled=False)
    args = build_parser().parse_args(["serve", "--drafter", "none"])
    assert not build_app(args).state.scheduler.speculative


def test_cli_serve_serves_the_default_pair_on_packed_weights():
    """`specdec serve --weights int8`: target and draft on int8 packed weights, as `specdec generate --weights`
    loads them, each request's tokens that model's own greedy decoding."""
    from specdec.cli import build_parser
    from specdec.cli.serve import build_app
    from specdec.hub.default_pair import assets_present
    from specdec.runtime.weights import packed_formats

    if not assets_present():
        pytest.skip("default pair assets not present")
    args = build_parser().parse_args(["serve", "--port", "0", "--weights", "int8", "--dtype", "float32"])
    server = LiveServer(build_app(args))
    try:
        decoder = server.app.state.scheduler.decoder
        target = decoder.target.model
        assert packed_formats(target) == {"int8"} and packed_formats(decoder.drafter.model) == {"int8"}
        tokenizer = specdec.load_default()[2]
        ids = tokenizer("def parse(self, text):", return_tensors="pt").input_ids[0]
        out = server.client.completions.create(model="specdec-default", prompt="def parse(self, text):",
                                               max_tokens=24, temperature=0)
        plain = specdec.generate(target, ids, max_new_tokens=24)
        assert out.choices[0].text == tokenizer.decode(plain.tokens)
    finally:
        server.stop()


def test_a_round_that_fails_as_a_whole_fails_its_rows_and_serving_goes_on(live):
    scheduler = live.app.state.scheduler

    def broken_step(*args, **kwargs):
        raise RuntimeError("injected failure")

    scheduler.decoder.step = broken_step  # the scheduler replaces the decoder after a failed round
    with pytest.raises(openai.InternalServerError) as info:
        live.client.completions.create(model="tiny", prompt=prompt_ids(6), max_tokens=5, temperature=0)
    assert "injected failure" in str(info.value)
    out = live.client.completions.create(model="tiny", prompt=prompt_ids(6), max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5


# -- the goodput policy under a scripted cost model (no server) ---------------------------------------------
def _expected_tokens(alpha: float, gamma: int) -> float:
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _simulate(policy, batch: int, rounds: int, rng, per_row_ms: float, alpha: float = 0.6) -> list[int]:
    """Round time = a fixed weight-reading cost + per-scored-token compute + γ batched draft steps, times the
    noise of a shared machine (a round may take 0.6x to 1.8x its cost)."""
    chosen = []
    for _ in range(rounds):
        gamma = policy.choose(batch)
        cost_ms = 10 + per_row_ms * batch * (gamma + 1) + (1.0 + 0.15 * batch) * gamma
        seconds = cost_ms / 1000 * rng.uniform(0.6, 1.8)
        policy.update(batch, gamma, seconds, round(batch * _expected_tokens(alpha, gamma)))
        chosen.append(gamma)
    return chosen


def test_goodput_policy_backs_off_to_plain_at_large_batches_on_noisy_timings():
    import random

    from specdec.server.goodput import GoodputGamma

    rng = random.Random(0)
    policy = GoodputGamma(4)
    # One row: the pass is memory-bound, speculation pays (~1.5x) and is chosen.
    one = _simulate(policy, 1, 400, rng, per_row_ms=0.5)[40:]
    assert sum(g > 0 for g in one) / len(one) > 0.9
    # 32 rows: compute-bound, plain is ~1.2x ahead of the best γ (γ = 1); the noisy policy must settle on
    # γ = 0 and leave it only for sparse probes.
    many = _simulate(policy, 32, 400, rng, per_row_ms=1.0)[40:]
    assert sum(g == 0 for g in many) / len(many) > 0.9
    assert policy.current[32] == 0


def test_goodput_policy_hysteresis_and_following_the_load():
    import random

    from specdec.server.goodput import GoodputGamma

    rng = random.Random(1)
    policy = GoodputGamma(2, candidates=[0, 2])
    # γ = 2 and plain cost the same per token here (within noise): the choice must not flip-flop.
    alpha = 0.5  # E[tokens | γ=2] = 1.75
    chosen = []
    for _ in range(300):
        gamma = policy.choose(8)
        seconds = (1.75 if gamma == 0 else 1.75 * _expected_tokens(alpha, 2)) / 100 * rng.uniform(0.8, 1.25)
        policy.update(8, gamma, seconds, round(8 * _expected_tokens(alpha, gamma)))
        chosen.append(gamma)
    switches = sum(a != b for a, b in zip(chosen[20:], chosen[21:]))
    probes = len(chosen[20:]) // policy.probe_every
    assert switches <= 2 * probes + 4
    # The machine changes: plain rounds get ~5x slower; the policy moves to γ = 2 within a window.
    policy = GoodputGamma(2, candidates=[0, 2])
    _simulate(policy, 8, 100, rng, per_row_ms=2.0)
    assert policy.current[8] == 0
    chosen = []
    for _ in range(40):
        gamma = policy.choose(8)
        seconds = (150 if gamma == 0 else 40) / 1000
        policy.update(8, gamma, seconds, round(8 * _expected_tokens(0.6, gamma)))
        chosen.append(gamma)
    assert policy.current[8] == 2
    assert chosen[-20:].count(2) >= 19  # (one probe of plain may fall here)


def test_goodput_is_expected_tokens_over_expected_time_at_one_row():
    """At one row a round's tokens are as random as its drafts' acceptance (1 to γ + 1): with α = 0.5 and γ = 4
    half the rounds commit 1 token, so the median of per-round rates sees speculation at 1/1.5 of plain, while it
    commits 1.94 tokens a round in expectation for 1.5x plain's time (1.29x plain's goodput). The policy must
    speculate, from measurements alone (no pass times: no cost model here)."""
    import random

    from specdec.server.goodput import GoodputGamma

    rng = random.Random(5)
    policy = GoodputGamma(4, candidates=[0, 4])
    chosen = []
    for _ in range(400):
        gamma = policy.choose(1)
        k = 0
        while k < gamma and rng.random() < 0.5:
            k += 1
        policy.update(1, gamma, (15 if gamma else 10) / 1000 * rng.uniform(0.95, 1.05), k + 1, accepted=k,
                      rejections=int(k < gamma))
        chosen.append(gamma)
    assert sum(g == 4 for g in chosen[200:]) / len(chosen[200:]) > 0.9  # (an unlucky start: plain, then probes)
    assert 1.15 < policy.measured(1, 4) / policy.measured(1, 0) < 1.45


def test_goodput_does_not_charge_a_draft_s_catch_up_to_speculation():
    """After plain rounds a draft model first catches up on the tokens they committed (here 3 ms a pass of 8):
    a cost of having decoded plainly. Charged to the speculative round that pays it, speculation looks worse
    the longer plain decoding runs, so after an unlucky start (the first 6 speculative rounds rejected) plain
    decoding is kept for good. The first speculative round after plain ones is not measured but run again:
    the policy comes back to speculating (here ~1.8x plain's goodput at γ = 4) in every seeded run."""
    import random

    from specdec.server.goodput import GoodputGamma

    def speculating(seed: int) -> float:
        rng = random.Random(seed)
        policy = GoodputGamma(4, candidates=[0, 2, 4])
        behind, chosen = 0, []
        for _ in range(600):
            gamma = policy.choose(1)
            k = 0
            while k < gamma and rng.random() < 0.85 and sum(g > 0 for g in chosen) >= 6:
                k += 1
            catch_up = 0.003 * -(-behind // 8) if gamma else 0.0
            seconds = (0.005 if gamma == 0 else 0.0066 + 0.001 * gamma + catch_up) * rng.uniform(0.9, 1.1)
            behind = behind + 1 if gamma == 0 else 0
            policy.update(1, gamma, seconds, k + 1, accepted=k, rejections=int(k < gamma))
            chosen.append(gamma)
        return sum(g > 0 for g in chosen[-300:]) / 300

    assert min(speculating(seed) for seed in range(8)) > 0.9


def _simulate_with_costs(policy, batch: int, rounds: int, rng, per_row_ms: float, alpha: float = 0.6) -> list[int]:
    """As _simulate, but each round also reports what the scheduler measures for the cost model: the target
    pass (its scored tokens and time), the drafting time, and the rows' accepted drafts and rejections."""
    chosen = []
    for _ in range(rounds):
        gamma = policy.choose(batch)
        noise = rng.uniform(0.6, 1.8)
        pass_s = (10 + per_row_ms * batch * (gamma + 1)) / 1000 * noise
        draft_s = (1.0 + 0.15 * batch) * gamma / 1000 * noise
        accepted = rejections = tokens = 0
        for _ in range(batch):
            k = 0
            while k < gamma and rng.random() < alpha:
                k += 1
            accepted, rejections, tokens = accepted + k, rejections + (k < gamma), tokens + k + 1
        policy.update(batch, gamma, pass_s + draft_s, tokens, pass_tokens=batch * (gamma + 1), pass_seconds=pass_s,
                      accepted=accepted, rejections=rejections)
        chosen.append(gamma)
    return chosen


def test_goodput_cost_model_prior_skips_exploring_a_new_large_batch():
    """With pass times pooled into a cost model (t_pass = a + c * scored tokens), a batch size seen for the first
    time needs no exploration: on one machine (one cost line), after one row's rounds the policy runs γ = 0 at
    32 rows from its first rounds (speculation only in sparse probes), and still speculates at one row.

    Round times here are noisy (x0.6 to x1.8 a round), so one run can fit a wrong cost line by chance: each
    behaviour must hold in at least 54 of 60 seeded runs, the prior's own pick at 32 rows in 45."""
    import random

    from specdec.server.goodput import GoodputGamma, expected_tokens

    held = {"one row speculates": 0, "α": 0, "prior picks plain at 32": 0, "32 rows run plain": 0,
            "one row again": 0}
    for seed in range(60):
        rng = random.Random(seed)
        policy = GoodputGamma(4)
        one = _simulate_with_costs(policy, 1, 80, rng, per_row_ms=1.0)
        held["one row speculates"] += sum(g > 0 for g in one[20:]) / len(one[20:]) > 0.9
        held["α"] += abs(policy.cost.alpha - 0.6) < 0.1
        predicted = {g: policy.predicted(32, g) for g in policy.candidates}
        held["prior picks plain at 32"] += max(predicted, key=predicted.get) == 0  # plain ~1.2x ahead of the best γ
        many = _simulate_with_costs(policy, 32, 60, rng, per_row_ms=1.0)
        # no warm-up rounds of γ = 4, 2, 1 first
        held["32 rows run plain"] += sum(g == 0 for g in many) / len(many) > 0.9 and policy.current[32] == 0
        again = _simulate_with_costs(policy, 1, 40, rng, per_row_ms=1.0)
        held["one row again"] += sum(g > 0 for g in again) / len(again) > 0.9
    prior = held.pop("prior picks plain at 32")  # a line fitted to one row's noisy passes, extrapolated 30x
    assert min(held.values()) >= 54 and prior >= 45, (held, prior)
    assert expected_tokens(0.6, 0) == 1.0 and abs(expected_tokens(0.6, 2) - 1.96) < 1e-9


def test_goodput_cost_model_charges_a_pass_per_row_as_well_as_per_token():
    """A pass's cost has a per-token part (the linears) and a per-row part (each row's attention over its own
    cache): on the default pair in float32 at 32 rows, one pass of 32 x 1 inputs takes longer than one of 8 x 5
    (docs/bench/goodput-pass-plane-zen4). Priced by its scored tokens alone, the 32-row plain pass looked 1.25x
    cheaper than it was, and a server started every 32-row batch plain where γ 2 was ahead. Here the machine is
    that shape (2 ms + 0.26 ms a token + 0.2 ms a row, α 0.8): after rounds at 1 and 8 rows only, the prior prices
    32 rows within 6% and picks γ 2, the best; the line through the same passes mispriced plain by >25%."""
    import random

    from specdec.server.goodput import CostModel, GoodputGamma, expected_tokens

    def pass_ms(rows: int, width: int) -> float:
        return 2.0 + 0.26 * rows * width + 0.2 * rows

    def round_ms(rows: int, gamma: int) -> float:  # + the rest of a round, + the draft's steps
        return pass_ms(rows, gamma + 1) + 0.5 + 0.02 * rows + gamma * (0.3 + 0.05 * rows)

    rng = random.Random(3)
    policy = GoodputGamma(4, candidates=[0, 2, 4])

    def run(rows: int, gamma: int) -> None:  # one round, reported as the scheduler reports it
        noise = rng.uniform(0.9, 1.1)
        accepted = rejections = 0
        for _ in range(rows):
            k = 0
            while k < gamma and rng.random() < 0.8:
                k += 1
            accepted, rejections = accepted + k, rejections + (k < gamma)
        policy.update(rows, gamma, round_ms(rows, gamma) / 1000 * noise, rows + accepted,
                      pass_tokens=rows * (gamma + 1), pass_seconds=pass_ms(rows, gamma + 1) / 1000 * noise,
                      accepted=accepted, rejections=rejections)

    for rows in (1, 8):
        for _ in range(20):
            for gamma in (0, 2, 4):
                run(rows, gamma)
    run(8, policy.choose(8))  # the re-run of the γ that followed plain rounds (not measured the first time)
    truth = {g: 32 * expected_tokens(0.8, g) / round_ms(32, g) for g in (0, 2, 4)}  # tokens per ms
    assert max(truth, key=truth.get) == 2 and truth[2] > 1.1 * max(truth[0], truth[4])
    cost = policy.cost
    for width in (1, 3, 5):
        assert cost.pass_seconds(32 * width, 32) * 1000 == pytest.approx(pass_ms(32, width), rel=0.06)
    assert cost.pass_seconds(32) * 1000 < 0.75 * pass_ms(32, 1)  # the line through tokens alone
    predicted = {g: policy.predicted(32, g) for g in (0, 2, 4)}
    assert max(predicted, key=predicted.get) == 2, predicted
    assert policy.choose(32) == 2
    # one row count seen (at three widths): no plane, the line in tokens as before
    alone = CostModel()
    for width in (1, 3, 5):
        for _ in range(3):
            alone.observe_pass(8 * width, 8, pass_ms(8, width) / 1000)
    assert alone.pass_seconds(32, 32) == alone.pass_seconds(32)


def test_goodput_fits_each_line_once_per_refit(monkeypatch):
    """The per-position cost of speculating subtracts the plain rounds' line from every kept speculative round:
    that line is fitted once, not once per kept round (which cost a full history of fits a round, and slowed a
    one-stream server's rounds ~3x once plain rounds of two batch sizes were kept). And a round's choice asks
    for every line once per candidate γ: each is fitted once until it is refitted; same values. In a full window
    that is every 8 rounds of shapes already seen, and at once for a round of a new batch size."""
    from specdec.server import goodput

    cost = goodput.CostModel()
    for i in range(256):
        rows = (1, 32)[i % 2]
        cost.observe(rows, 0, 0.001 * rows + 0.002 + 1e-5 * (i % 7), pass_tokens=rows, pass_seconds=0.001 * rows)
        cost.observe(rows, 4, 0.004 * rows + 0.006 + 1e-5 * (i % 5), pass_tokens=5 * rows,
                     pass_seconds=0.002 * rows)
    plain = goodput._line(list(cost.plain_rest))
    points = [(r, max(0.0, rest - (plain[0] + plain[1] * r)) / g) for r, g, rest in cost.spec_rest]
    intercept, slope = goodput._line(points)
    fits = []
    line = goodput._line
    monkeypatch.setattr(goodput, "_line", lambda pts: fits.append(len(pts)) or line(pts))
    assert cost.step_seconds(8) == intercept + slope * 8
    assert fits == [256, 256], fits  # the plain rounds' line, then the points' line
    assert cost.step_seconds(16) == intercept + slope * 16
    assert cost.plain_rest_seconds(4) == plain[0] + plain[1] * 4
    assert fits == [256, 256], fits  # nothing observed since: no fit again
    policy = goodput.GoodputGamma(4, candidates=[0, 2, 4])
    policy.cost, policy.rounds_in = cost, {1: 1}
    cost.observe_outcome(30, 10)
    policy.choose(1)
    assert fits == [256, 256, 256], fits  # the passes' line, fitted once for the three candidates
    cost.observe(8, 4, 0.5, pass_tokens=40, pass_seconds=0.1)  # a slow round at a new size: the lines move
    assert cost.step_seconds(8) > intercept + slope * 8
    assert fits == [256, 256, 256, 256, 256], fits
    moved = cost.step_seconds(8)
    for i in range(8):  # rounds of sizes seen: the lines are kept for 7, refitted at the 8th
        cost.observe(8, 4, 1.5, pass_tokens=40, pass_seconds=0.1)
        assert (cost.step_seconds(8) == moved) == (i < 7), i
    assert fits == [256] * 7, fits


def test_server_on_the_preallocated_batched_cache(pair, tokenizer):
    """The fast path's server wiring (its cache run eagerly: compiling is the slow test in test_batch.py):
    concurrent rows get the lone greedy tokens; a request that does not fit --max-len gets a 400 naming it."""
    target, draft = pair
    server = LiveServer(create_app(target, tokenizer, specdec.DraftModel(draft), model_name="tiny", max_gamma=3,
                                   compile="static", max_len=64))
    try:
        assert type(server.app.state.scheduler.decoder.target).__name__ == "StaticBatchedCausalLM"
        prompts = [prompt_ids(i) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: server.client.completions.create(
                model="tiny", prompt=p, max_tokens=16, temperature=0), prompts))
        for out, p in zip(outs, prompts):
            assert out.choices[0].text == lone_text(tokenizer, target, p, max_new_tokens=16)[0]
        with pytest.raises(openai.BadRequestError) as info:
            server.client.completions.create(model="tiny", prompt=prompt_ids(0, 40), max_tokens=30, temperature=0)
        assert "--max-len" in str(info.value)
    finally:
        server.stop()


def test_chat_on_the_shipped_default_pair_works_out_of_the_box():
    """No --chat-template: the default pair's tokenizer ships a plain role-prefixed template."""
    from specdec.hub.default_pair import assets_present

    if not assets_present():
        pytest.skip("default pair assets not present")
    target, draft, tokenizer = specdec.load_default()
    server = LiveServer(create_app(target, tokenizer, specdec.DraftModel(draft), model_name="specdec-default"))
    try:
        messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse("}]
        out = server.client.chat.completions.create(model="specdec-default", messages=messages, max_tokens=8,
                                                    temperature=0)
    finally:
        server.stop()
    ids = tokenizer("system: You write Python.\nuser: def parse(\nassistant:")["input_ids"]
    want = specdec.generate(target, ids, drafter=specdec.DraftModel(draft), max_new_tokens=8).tokens
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
