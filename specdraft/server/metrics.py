"""Prometheus metrics of one server, under vLLM's names with a `specdraft:` prefix.

Dashboards built for vLLM (`vllm:spec_decode_num_accepted_tokens`, `vllm:num_requests_running`, ...) work
after a prefix change. Each server owns its own `CollectorRegistry`, so several servers in one process (the
tests start many) never collide in prometheus_client's global registry.

All updates come from the engine thread; prometheus_client's metrics are thread-safe, so `/metrics` reads
them from the HTTP thread without locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdraft.engine.metrics import SpecMetrics

PREFIX = "specdraft:"
# Seconds; vLLM's buckets, trimmed to what a CPU serves.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


@dataclass
class SpecSnapshot:
    """What of a request's `SpecMetrics` was already counted, so each round adds only its increment."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, names + list(extra), registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=self.registry)

        self._labels = labels
        self.running = gauge("num_requests_running", "Requests holding a KV-cache slot.").labels(**labels)
        self.waiting = gauge("num_requests_waiting", "Requests accepted and waiting for a slot.").labels(**labels)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache slots in use / max_batch (1 = full).").labels(**labels)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**labels)
        # vLLM's prefix-cache pair, in tokens: prompt tokens of finished requests, and those of them whose cache
        # entries were copied from an earlier prompt (the engine's prefix reuse).
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens of finished requests.").labels(**labels)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens of finished requests found in the "
                                         "cache (copied, not computed).").labels(**labels)
        self._success = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))
        self.aborted = counter("request_aborted", "Requests cancelled by a client disconnect or shutdown.").labels(
            **labels)
        self.drafts = counter("spec_decode_num_drafts", "Speculative rounds (a draft was verified).").labels(**labels)
        self.draft_tokens = counter("spec_decode_num_draft_tokens",
                                    "Draft positions offered (a chain's length, a tree's depth).").labels(**labels)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(**labels)
        self._accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position (0 = first).", ("position",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS).labels(
            **labels)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time per output token after the first (a round's gap shared by its tokens).",
                             ITL_BUCKETS).labels(**labels)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS).labels(
            **labels)
        self._state: tuple[int, int, int, int] | None = None

    def set_state(self, running: int, waiting: int, slots_in_use: int, max_batch: int) -> None:
        """The gauges, set only when they change: the engine thread calls this twice a round."""
        state = (running, waiting, slots_in_use, max_batch)
        if state == self._state:
            return
        self._state = state
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(slots_in_use / max_batch)

    def prompt_cache(self, metrics: SpecMetrics) -> None:
        """A finished request's prompt: its tokens, and those whose cache entries were reused."""
        self.prefix_cache_queries.inc(metrics.prompt_tokens)
        self.prefix_cache_hits.inc(metrics.prompt_tokens_cached)

    def finished(self, reason: str) -> None:
        self._success.labels(finished_reason=reason, **self._labels).inc()

    def observe_tokens(self, count: int, now: float, arrived: float, last_token_at: float | None) -> None:
        """A chunk of `count` tokens at `now`: the first token's TTFT, then each later token's share of the gap
        since the previous chunk (speculative rounds emit several tokens at once)."""
        if count <= 0:
            return
        self.generation_tokens.inc(count)
        if last_token_at is None:
            self.ttft.observe(now - arrived)
            count -= 1
            last_token_at = now
        for _ in range(count):
            self.itl.observe((now - last_token_at) / max(count, 1))

    def observe_spec(self, seen: SpecSnapshot, metrics: SpecMetrics) -> None:
        """Count what the request's metrics gained since `seen`, and move `seen` up to them."""
        if metrics.speculative_rounds == seen.drafts:  # no draft verified since: nothing else moved either
            return
        self.drafts.inc(metrics.speculative_rounds - seen.drafts)
        self.draft_tokens.inc(metrics.drafted - seen.draft_tokens)
        self.accepted.inc(metrics.accepted - seen.accepted)
        for position, total in enumerate(metrics.accepted_per_position):
            before = seen.accepted_per_position[position] if position < len(seen.accepted_per_position) else 0
            if total > before:
                self._accepted_pos.labels(position=str(position), **self._labels).inc(total - before)
        seen.drafts, seen.draft_tokens, seen.accepted = metrics.speculative_rounds, metrics.drafted, metrics.accepted
        seen.accepted_per_position = list(metrics.accepted_per_position)

    def render(self) -> bytes:
        return generate_latest(self.registry)
