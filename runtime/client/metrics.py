"""Prometheus metrics of one server (prometheus-client, names prefixed `plait:`).

Latencies are measured where the client sees them (the tokenizer manager); running/queued
requests, KV usage, cache hit rate and throughput come from the scheduler's periodic stats.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from plait.runtime.ipc.messages import GRAMMAR_CLOSED, FinishReason

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_ACCEPT_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"plait:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"plait:{name}", doc, labels, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"plait:{name}", doc, labels, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output chunks per token", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.queue = hist("queue_time_seconds", "Time waiting before admission", _LATENCY_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.requests = counter("num_requests", "Requests finished")
        self._grammar = Counter("plait:grammar_requests", "Constrained requests finished, by the grammar backend "
                                "that compiled them", labels + ["backend"], registry=r)
        self._grammar_outcomes = Counter(
            "plait:grammar_outcomes", "Constrained requests finished, by outcome: complete (the grammar's end), "
            "closed (completed early as the token budget ran low), cut (the budget ran out first), aborted",
            labels + ["outcome"], registry=r)
        self._model_name = model_name
        self.spec_verifies = counter("spec_verify_ct", "Forwards that verified a speculative draft (per request)")
        self.spec_drafted = counter("spec_draft_tokens", "Speculative draft tokens verified")
        self.spec_accepted = counter("spec_accepted_tokens", "Speculative draft tokens kept (acceptance rate: "
                                     "this over spec_draft_tokens)")
        self.spec_accept_length = hist("spec_accept_length", "Tokens per speculative verify (kept draft and the "
                                       "next token), per finished request", _ACCEPT_BUCKETS)
        self.running = gauge("num_running_reqs", "Requests running")
        self.queued = gauge("num_queue_reqs", "Requests waiting")
        self.kv_usage = gauge("token_usage", "Fraction of the KV pool in use")
        self.hit_rate = gauge("cache_hit_rate", "Prefix cache hit rate (tokens)")
        self.throughput = gauge("gen_throughput", "Generated tokens per second")

    def on_output(self, st, out, now: float) -> None:
        """One update of a request (st: ReqState, already applied)."""
        n = len(out.new_ids)
        if n:
            if st.prev_token_at is None:  # its first tokens
                self.ttft.observe(now - st.created)
            else:
                gap = (now - st.prev_token_at) / n
                for _ in range(n):
                    self.itl.observe(gap)
        if out.queue_time is not None:
            self.queue.observe(out.queue_time)

    def on_finish(self, st, now: float) -> None:
        self.e2e.observe(now - st.created)
        self.prompt_tokens.inc(st.counts["prompt_tokens"])
        self.generation_tokens.inc(st.counts["completion_tokens"])
        self.cached_tokens.inc(st.counts["cached_tokens"])
        self.requests.inc()
        if st.grammar_backend is not None:
            self._grammar.labels(self._model_name, st.grammar_backend).inc()
            self._grammar_outcomes.labels(self._model_name, grammar_outcome(st.finish)).inc()
        verifies, drafted, accepted = st.spec
        if verifies:
            self.spec_verifies.inc(verifies)
            self.spec_drafted.inc(drafted)
            self.spec_accepted.inc(accepted)
            self.spec_accept_length.observe(1 + accepted / verifies)

    def on_stats(self, s) -> None:
        self.running.set(s.num_running)
        self.queued.set(s.num_waiting)
        self.kv_usage.set(s.kv_used / s.kv_capacity if s.kv_capacity else 0.0)
        self.hit_rate.set(s.cache_hit_rate)
        self.throughput.set(s.gen_throughput)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def grammar_outcome(finish: FinishReason | None) -> str:
    """How a constrained request ended: complete, closed, cut or aborted."""
    if finish is None or finish.type == "abort":
        return "aborted"
    if finish.type == "length":
        return "closed" if finish.message == GRAMMAR_CLOSED else "cut"
    return "complete"
