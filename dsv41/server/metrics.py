"""Prometheus metrics of one server, in its own registry (no process-wide default registry: two servers
in one process, or a server in a test, count apart)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.request import Completion

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("dsv41_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.requests_started = Counter("dsv41_requests_started", "Generation requests taken by the engine",
                                        registry=r)
        self.requests_finished = Counter("dsv41_requests_finished", "Generation requests by finish reason",
                                         ["reason"], registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("dsv41_cached_prompt_tokens", "Prompt tokens reused from kept sequences",
                                     registry=r)
        self.generation_tokens = Counter("dsv41_generation_tokens", "Tokens generated", registry=r)
        self.drafted_tokens = Counter("dsv41_speculative_drafted_tokens", "DSpark drafts proposed", registry=r)
        self.accepted_tokens = Counter("dsv41_speculative_accepted_tokens", "DSpark drafts accepted", registry=r)
        self.requests_waiting = Gauge("dsv41_queue_depth", "Requests waiting for a cache slot", registry=r)
        self.requests_running = Gauge("dsv41_running_rows", "Requests in the running batch", registry=r)
        self.slots_in_use = Gauge("dsv41_cache_slots_in_use", "Cache slots holding a running or kept sequence",
                                  registry=r)
        self.prefix_hits = Gauge("dsv41_prefix_cache_hits", "Requests that continued a kept sequence", registry=r)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "Submission to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("dsv41_inter_token_latency_seconds", "Between consecutive tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)

    def finished(self, completion: Completion) -> None:
        self.requests_finished.labels(completion.finish_reason).inc()
        self.prompt_tokens.inc(completion.prompt_tokens)
        self.cached_tokens.inc(completion.cached_tokens)
        self.drafted_tokens.inc(completion.drafted)
        self.accepted_tokens.inc(completion.accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
