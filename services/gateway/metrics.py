"""The gateway's Prometheus metrics: vLLM's names with a `pagoda:` prefix, and the same
families again under vLLM's own `vllm:` names, for dashboards and tests written for vLLM.

Each quantity is measured once, under its `pagoda:` name; the `vllm:` families are aliases,
copied from those at each scrape (`VllmAliases`), so the two never disagree. Request timings
and token counts are measured here, where the client's stream is; the engine's queue and cache
gauges, and its preemption and prefix-cache counts, come from its health details, refreshed on
each scrape.
"""
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proto.requests import HealthResponse
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from shared.speculative import ACCEPTED_PER_POS_DETAIL

# Buckets of vLLM's histograms for the same quantities.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)
_N_BUCKETS = (1, 2, 5, 10, 20)

# `pagoda:` family -> its `vllm:` names (several where vLLM has renamed one over versions).
VLLM_ALIASES = {
    "pagoda:num_requests_running": ["vllm:num_requests_running"],
    "pagoda:num_requests_waiting": ["vllm:num_requests_waiting"],
    "pagoda:num_requests_swapped": ["vllm:num_requests_swapped"],
    "pagoda:kv_cache_usage_perc": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    "pagoda:prefix_cache_hit_rate": ["vllm:gpu_prefix_cache_hit_rate"],
    "pagoda:prefix_cache_queries": ["vllm:prefix_cache_queries",
                                    "vllm:gpu_prefix_cache_queries"],
    "pagoda:prefix_cache_hits": ["vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"],
    "pagoda:preemptions": ["vllm:num_preemptions"],
    "pagoda:prompt_tokens": ["vllm:prompt_tokens"],
    "pagoda:generation_tokens": ["vllm:generation_tokens"],
    "pagoda:request_success": ["vllm:request_success"],
    "pagoda:time_to_first_token_seconds": ["vllm:time_to_first_token_seconds"],
    "pagoda:time_per_output_token_seconds": ["vllm:time_per_output_token_seconds",
                                             "vllm:inter_token_latency_seconds"],
    "pagoda:e2e_request_latency_seconds": ["vllm:e2e_request_latency_seconds"],
    "pagoda:request_queue_time_seconds": ["vllm:request_queue_time_seconds"],
    "pagoda:request_prefill_time_seconds": ["vllm:request_prefill_time_seconds"],
    "pagoda:request_decode_time_seconds": ["vllm:request_decode_time_seconds"],
    "pagoda:request_inference_time_seconds": ["vllm:request_inference_time_seconds"],
    "pagoda:request_prompt_tokens": ["vllm:request_prompt_tokens"],
    "pagoda:request_generation_tokens": ["vllm:request_generation_tokens"],
    "pagoda:request_params_n": ["vllm:request_params_n"],
    "pagoda:request_params_max_tokens": ["vllm:request_params_max_tokens"],
    "pagoda:iteration_tokens_total": ["vllm:iteration_tokens_total"],
    "pagoda:cache_config_info": ["vllm:cache_config_info"],
    "pagoda:spec_decode_num_drafts": ["vllm:spec_decode_num_drafts"],
    "pagoda:spec_decode_num_draft_tokens": ["vllm:spec_decode_num_draft_tokens"],
    "pagoda:spec_decode_num_accepted_tokens": ["vllm:spec_decode_num_accepted_tokens"],
    "pagoda:spec_decode_num_accepted_tokens_per_pos": [
        "vllm:spec_decode_num_accepted_tokens_per_pos"],
}

# Engine totals (health details) that are counters, so they come out as counter families.
_ENGINE_COUNTERS = {"pagoda:prefix_cache_queries": ("prefix_cache_queries",
                                                    "Prompt tokens looked up in the prefix cache"),
                    "pagoda:prefix_cache_hits": ("prefix_cache_hits",
                                                 "Prompt tokens found in the prefix cache"),
                    "pagoda:preemptions": ("preemptions",
                                                       "Preemptions since the engine started"),
                    # Speculative decoding (only when the engine runs it).
                    "pagoda:spec_decode_num_drafts": (
                        "spec_decode_num_drafts", "Sequence-steps that verified proposals"),
                    "pagoda:spec_decode_num_draft_tokens": (
                        "spec_decode_num_draft_tokens", "Proposed tokens verified"),
                    "pagoda:spec_decode_num_accepted_tokens": (
                        "spec_decode_num_accepted_tokens", "Proposed tokens accepted")}

# service_up's services, and the health detail that counts each one's live processes.
SERVICE_COUNTS = {"worker": "workers", "tokenizer": "tokenizers", "detokenizer": "detokenizers"}


@dataclass
class RequestTimer:
    """Timings of one engine request, as the gateway sees them (monotonic seconds)."""
    arrival: float = field(default_factory=time.monotonic)
    params: SamplingParams | None = None
    first_output: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    queue_time_s: float | None = None  # the engine's, from arrival to the first schedule
    prompt_tokens_counted: bool = False
    num_prompt_tokens: int = 0


class EngineTotals(Collector):
    """The engine's counts since it started (from its health details) as counter families."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.values: dict[str, float] = {}

    def collect(self):
        for name, (key, doc) in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            if key in self.values:
                family.add_metric([self.model_name], self.values[key])
            yield family
        family = CounterMetricFamily("pagoda:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by position in the proposal",
                                     labels=["model_name", "position"])
        for key, value in self.values.items():
            if key.startswith(ACCEPTED_PER_POS_DETAIL):
                family.add_metric([self.model_name, key[len(ACCEPTED_PER_POS_DETAIL):]], value)
        yield family


class VllmAliases(Collector):
    """Every `pagoda:` family of `source` that vLLM has, again under its vLLM names."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        for family in self.source.collect():
            for alias in VLLM_ALIASES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                copy.samples = [s._replace(name=alias + s.name[len(family.name):])
                                for s in family.samples]
                yield copy


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
        # The engine reports when it first scheduled a request (with its first output): the
        # phases below split the request's time at that point and at its first token.
        self.queue_time = Histogram("pagoda:request_queue_time_seconds",
                                    "Time from arrival to the engine's first schedule", labels,
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("pagoda:request_prefill_time_seconds",
                                      "Time from the first schedule to the first token", labels,
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("pagoda:request_decode_time_seconds",
                                     "Time from the first token to the last", labels,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("pagoda:request_inference_time_seconds",
                                        "Time from the first schedule to the last token", labels,
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("pagoda:request_prompt_tokens",
                                               "Prompt tokens per finished request", labels,
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "pagoda:request_generation_tokens", "Tokens generated per finished request (all n "
            "samples)", labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.request_n = Histogram("pagoda:request_params_n", "The n of finished requests",
                                   labels, buckets=_N_BUCKETS, registry=r)
        self.request_max_tokens = Histogram("pagoda:request_params_max_tokens",
                                            "The max_tokens of finished requests", labels,
                                            buckets=_TOKEN_BUCKETS, registry=r)
        # The gateway sees each request's steps, not the engine's batches: this counts the
        # tokens one request advanced by in a step (its prompt with its first output).
        self.iteration_tokens = Histogram("pagoda:iteration_tokens_total",
                                          "Tokens a request advanced by per engine step",
                                          labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.cache_config = Gauge("pagoda:cache_config_info", "The engine's KV cache (value 1)",
                                  ["num_gpu_blocks"], registry=r)
        self.engine_totals = EngineTotals(model_name)
        r.register(self.engine_totals)
        self.vllm_registry = CollectorRegistry()
        self.vllm_registry.register(VllmAliases(r))
        self.service_up.labels("gateway").set(1)
        # Label children that each stream step observes, looked up once (on first use, so a
        # family has no sample before its first observation, as with `labels()`).
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels: str):
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, *labels)
        return child

    # -- per request ----------------------------------------------------------------------------
    def observe_output(self, timer: RequestTimer, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.model_name
        if timer.first_output is None:
            timer.first_output = now
            # Without the engine's figure (an error before any schedule), all of it was queue.
            timer.queue_time_s = min(out.queue_time_s if out.queue_time_s is not None
                                     else now - timer.arrival, now - timer.arrival)
            self.queue_time.labels(m).observe(timer.queue_time_s)
        iteration_tokens = 0
        if not timer.prompt_tokens_counted and out.num_prompt_tokens is not None:
            self.prompt_tokens.labels(m).inc(out.num_prompt_tokens)
            timer.prompt_tokens_counted = True
            timer.num_prompt_tokens = iteration_tokens = out.num_prompt_tokens
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            self._child(self.generation_tokens).inc(new_tokens)
            self._child(self.iteration_tokens).observe(iteration_tokens + new_tokens)
            if timer.last_token is None:
                timer.first_token = now
                self._child(self.ttft).observe(now - timer.arrival)
                self.prefill_time.labels(m).observe(
                    max(0.0, now - timer.arrival - timer.queue_time_s))
            else:
                # n > 1 advances every sequence by one token a step: time per step and sequence.
                per_step = max(len(c.token_ids) for c in out.outputs)
                self._child(self.tpot).observe((now - timer.last_token) / per_step)
            timer.last_token = now
        for c in out.outputs:
            if c.finish_reason is not None:
                self._child(self.request_success, c.finish_reason).inc()
        if out.finished:
            self.e2e.labels(m).observe(now - timer.arrival)
            self._observe_finished(timer, out, now)

    def _observe_finished(self, timer: RequestTimer, out: RequestOutput, now: float) -> None:
        m = self.model_name
        self.request_prompt_tokens.labels(m).observe(timer.num_prompt_tokens)
        self.request_generation_tokens.labels(m).observe(out.num_output_tokens or 0)
        if timer.params is not None:
            self.request_n.labels(m).observe(timer.params.n)
            if timer.params.max_tokens is not None:
                self.request_max_tokens.labels(m).observe(timer.params.max_tokens)
        if timer.first_token is not None:
            last = timer.last_token or now
            self.decode_time.labels(m).observe(last - timer.first_token)
            self.inference_time.labels(m).observe(
                max(0.0, last - timer.arrival - (timer.queue_time_s or 0.0)))

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    # -- on scrape ------------------------------------------------------------------------------
    def update_from_health(self, health: HealthResponse | None) -> None:
        m = self.model_name
        engine_ok = health is not None and health.status in ("ok", "degraded")
        self.service_up.labels("engine").set(1 if engine_ok else 0)
        details = health.details if health is not None else {}
        for service, key in SERVICE_COUNTS.items():
            count = int(details.get(key) or 0) if engine_ok else 0
            self.service_instances.labels(service).set(count)
            self.service_up.labels(service).set(1 if count > 0 else 0)
        if not engine_ok:
            return
        self.engine_totals.values = {key: details[key] for key, _ in _ENGINE_COUNTERS.values()
                                     if isinstance(details.get(key), (int, float))}
        self.engine_totals.values.update(
            {key: value for key, value in details.items()
             if key.startswith(ACCEPTED_PER_POS_DETAIL) and isinstance(value, (int, float))})
        if isinstance(details.get("device_blocks"), int):
            self.cache_config.clear()
            self.cache_config.labels(str(details["device_blocks"])).set(1)
        for gauge, key in ((self.running, "running"), (self.waiting, "waiting"),
                           (self.swapped, "swapped"), (self.kv_cache_usage, "kv_cache_usage"),
                           (self.prefix_hit_rate, "prefix_cache_hit_rate"),
                           (self.preemptions, "preemptions")):
            value = details.get(key)
            if isinstance(value, (int, float)):
                gauge.labels(m).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self.vllm_registry)
