"""The gateway's Prometheus metrics: vLLM's names with a `pagoda:` prefix, in one registry.

Request timings and token counts are measured here, where the client's stream is; the engine's
queue and cache gauges come from its health details, refreshed on each scrape.
"""
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from proto.requests import HealthResponse
from services.engine.outputs import RequestOutput

# Buckets of vLLM's histograms for the same quantities.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)

# service_up's services, and the health detail that counts each one's live processes.
SERVICE_COUNTS = {"worker": "workers", "tokenizer": "tokenizers", "detokenizer": "detokenizers"}


@dataclass
class RequestTimer:
    """Timings of one engine request, as the gateway sees them (monotonic seconds)."""
    arrival: float = field(default_factory=time.monotonic)
    first_output: float | None = None
    last_token: float | None = None
    prompt_tokens_counted: bool = False


class GatewayMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        # From the engine's health details.
        self.running = Gauge("pagoda:num_requests_running",
                             "Requests in the engine's running batch", labels, registry=r)
        self.waiting = Gauge("pagoda:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=r)
        self.swapped = Gauge("pagoda:num_requests_swapped", "Requests swapped out to CPU memory",
                             labels, registry=r)
        self.kv_cache_usage = Gauge("pagoda:kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (1 = full)", labels,
                                    registry=r)
        self.prefix_hit_rate = Gauge("pagoda:prefix_cache_hit_rate",
                                     "Fraction of prompt blocks found in the prefix cache",
                                     labels, registry=r)
        self.preemptions = Gauge("pagoda:num_preemptions", "Preemptions since the engine started",
                                 labels, registry=r)
        self.service_up = Gauge("pagoda:service_up", "1 when the service answers (or has at least "
                                "one live process), else 0", ["service"], registry=r)
        self.service_instances = Gauge("pagoda:service_instances",
                                       "Live processes of each stateless service", ["service"],
                                       registry=r)
        # Measured by this gateway.
        self.pending = Gauge("pagoda:gateway_requests_in_flight",
                             "HTTP generation requests this gateway is serving", registry=r)
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens of requests served",
                                     labels, registry=r)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated", labels,
                                         registry=r)
        self.request_success = Counter("pagoda:request_success",
                                       "Completions finished, by finish reason",
                                       labels + ["finished_reason"], registry=r)
        self.request_errors = Counter("pagoda:request_errors", "Requests answered with an error",
                                      labels + ["status"], registry=r)
        self.ttft = Histogram("pagoda:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pagoda:time_per_output_token_seconds",
                              "Time between output tokens", labels, buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("pagoda:e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        # The engine does not report when it scheduled a request, so the time to its first output
        # (queueing + prefill) stands in for the queue time.
        self.queue_time = Histogram("pagoda:request_queue_time_seconds",
                                    "Time from arrival to the first output (queue + prefill)",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.service_up.labels("gateway").set(1)

    # -- per request ----------------------------------------------------------------------------
    def observe_output(self, timer: RequestTimer, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.model_name
        if timer.first_output is None:
            timer.first_output = now
            self.queue_time.labels(m).observe(now - timer.arrival)
        if not timer.prompt_tokens_counted and out.num_prompt_tokens is not None:
            self.prompt_tokens.labels(m).inc(out.num_prompt_tokens)
            timer.prompt_tokens_counted = True
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            self.generation_tokens.labels(m).inc(new_tokens)
            if timer.last_token is None:
                self.ttft.labels(m).observe(now - timer.arrival)
            else:
                # n > 1 advances every sequence by one token a step: time per step and sequence.
                per_step = max(len(c.token_ids) for c in out.outputs)
                self.tpot.labels(m).observe((now - timer.last_token) / per_step)
            timer.last_token = now
        for c in out.outputs:
            if c.finish_reason is not None:
                self.request_success.labels(m, c.finish_reason).inc()
        if out.finished:
            self.e2e.labels(m).observe(now - timer.arrival)

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    # -- on scrape ------------------------------------------------------------------------------
    def update_from_health(self, health: HealthResponse | None) -> None:
        m = self.model_name
        engine_ok = health is not None and health.status == "ok"
        self.service_up.labels("engine").set(1 if engine_ok else 0)
        details = health.details if health is not None else {}
        for service, key in SERVICE_COUNTS.items():
            count = int(details.get(key) or 0) if engine_ok else 0
            self.service_instances.labels(service).set(count)
            self.service_up.labels(service).set(1 if count > 0 else 0)
        if not engine_ok:
            return
        for gauge, key in ((self.running, "running"), (self.waiting, "waiting"),
                           (self.swapped, "swapped"), (self.kv_cache_usage, "kv_cache_usage"),
                           (self.prefix_hit_rate, "prefix_cache_hit_rate"),
                           (self.preemptions, "preemptions")):
            value = details.get(key)
            if isinstance(value, (int, float)):
                gauge.labels(m).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
