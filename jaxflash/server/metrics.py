"""Prometheus metrics, named like vLLM's (`vllm:` becomes `jaxflash:`) so existing dashboards map over."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("jaxflash:time_to_first_token_seconds", "Time from submission to the first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("jaxflash:inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=_LATENCY, registry=r)
        self.running = Gauge("jaxflash:num_requests_running", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("jaxflash:num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.prompt_tokens = Counter("jaxflash:prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("jaxflash:generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("jaxflash:request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)
        self.hit_rate = Gauge("jaxflash:expert_cache_hit_rate", "Expert cache hits / lookups since start "
                              "(host-resident experts)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
