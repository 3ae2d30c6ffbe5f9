"""Prometheus metrics of the server, on a registry of its own (so several apps can live in one process).

Speculative-decoding counters take vLLM's names (`spec_decode_num_drafts`, `_num_draft_tokens`,
`_num_accepted_tokens`, `_num_accepted_tokens_per_pos{position}`) under the `specdec:` prefix, so vLLM
dashboards' PromQL works after a prefix swap: acceptance rate = rate(accepted) / rate(draft_tokens), mean
acceptance length = 1 + rate(accepted) / rate(drafts). Counts are prefix-accepted tokens (a draft after the
first rejection is never counted as accepted).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "specdec:"
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Number of spec decoding drafts (row-rounds that drafted).", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Number of draft tokens.", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Number of accepted tokens.", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ["position"], registry=r)
        self.requests = Counter(p + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r)
        self.request_errors = Counter(p + "request_errors", "Requests answered with an error, by HTTP status.", ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens.", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in the decoding batch.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for a batch slot.", registry=r)
        self.batch_size = Histogram(p + "batch_size", "Rows in each decoding round.", buckets=BATCH_BUCKETS, registry=r)
        self.gamma = Gauge(p + "gamma", "Draft length cap chosen for the latest round (0 = plain decoding).", registry=r)
        self.gamma_chosen = Histogram(p + "gamma_chosen", "Draft length cap chosen per round.",
                                      buckets=(0, 1, 2, 3, 4, 5, 6, 8), registry=r)
        self.round_seconds = Histogram(p + "round_seconds", "Wall time of one batched decoding round.",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "Time between a request's token emissions, divided over the tokens emitted.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to last token.", buckets=LATENCY_BUCKETS, registry=r)

    def record_round(self, drafted: int, accepted: int) -> None:
        """One row's round: `drafted` draft tokens, of which the first `accepted` were accepted."""
        if drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(drafted)
            self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
