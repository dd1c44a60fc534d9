"""The OpenAI server's Prometheus metrics (``/metrics``), under vLLM's names (``vllm:...``)."""

from __future__ import annotations


class Metrics:
    """Prometheus metrics under vLLM's names (``vllm:``...), in a registry of this server's own."""

    def __init__(self, server):
        """``server``: the ``jaxmamba.serve.OpenAIServer`` these metrics belong to (its ``model_name`` and
        ``engine``; not imported here: serve imports this module)."""
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = CollectorRegistry()
        labels = {"model_name": server.model_name}
        names, values = list(labels), list(labels.values())
        buckets = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               names + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", names, buckets=buckets,
                              registry=self.registry).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", names,
                             buckets=buckets, registry=self.registry).labels(*values)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", names, buckets=buckets,
                             registry=self.registry).labels(*values)
        size_buckets = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
        self.prompt_len = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", names,
                                    buckets=size_buckets, registry=self.registry).labels(*values)
        self.output_len = Histogram("vllm:request_generation_tokens", "Generated tokens per request", names,
                                    buckets=size_buckets, registry=self.registry).labels(*values)
        self.values = values

        class _EngineCollector:
            def collect(inner):
                # One series per engine (vLLM's ``engine`` label): a data-parallel front's replicas apart.
                replicas = getattr(server.engine, "replicas", [server.engine])
                engine_names = names + ["engine"]
                families = {name: (GaugeMetricFamily(name, doc, labels=engine_names), field) for name, doc, field in (
                    ("vllm:num_requests_running", "Requests in model execution batches", "running"),
                    ("vllm:num_requests_waiting", "Requests waiting to be processed", "waiting"),
                    ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", "block_usage"))}
                families |= {name: (CounterMetricFamily(name, doc, labels=engine_names), field)
                             for name, doc, field in (
                    ("vllm:prompt_tokens", "Prefill tokens processed", "num_prompt_tokens"),
                    ("vllm:generation_tokens", "Generation tokens processed", "num_generated_tokens"),
                    ("vllm:num_preemptions", "Cumulative preemptions", "num_preemptions"),
                    ("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens", "num_prefix_query_tokens"),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", "num_prefix_hit_tokens"))}
                for i, replica in enumerate(replicas):
                    row = _engine_row(replica)
                    for family, field in families.values():
                        family.add_metric(values + [str(i)], row[field])
                yield from (family for family, _ in families.values())
                router = getattr(server.engine, "router", None)
                if router is not None:
                    routed = CounterMetricFamily("jaxmamba:data_parallel_routed_requests",
                                                 "Requests the data-parallel front routed to each engine, and how",
                                                 labels=engine_names + ["by"])
                    for i, load in enumerate(router.loads):
                        routed.add_metric(values + [str(i), "load"], load.routed - load.affinity_routed)
                        routed.add_metric(values + [str(i), "prefix_affinity"], load.affinity_routed)
                    yield routed

        self.registry.register(_EngineCollector())

    def finished(self, reason: str | None) -> None:
        self.success.labels(*self.values, reason or "abort").inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _engine_row(engine) -> dict:
    """One engine's (an ``AsyncLLM``'s) counters and queue lengths, read on its engine thread."""
    core = engine.engine_core
    s, running, waiting = engine.call(
        lambda: (core.stats, len(core.scheduler.running), len(core.scheduler.waiting))).result(60)
    return {"running": running, "waiting": waiting, **{f: getattr(s, f) for f in (
        "block_usage", "num_prompt_tokens", "num_generated_tokens", "num_preemptions", "num_prefix_query_tokens",
        "num_prefix_hit_tokens")}}
