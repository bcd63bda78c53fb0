"""Prometheus metrics of one worker process, served on `RESPOOL_WORKER_METRICS_PORT` (0: not served).

Run times are measured from the moment this worker starts a response's run (its lease taken).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Seconds: first tokens come in milliseconds to seconds; whole responses in seconds to minutes.
_FIRST_EVENT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_RESPONSE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


_GATHERED_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
_WEBHOOK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600, 86400)


class WorkerMetrics:
    """The metrics one worker process keeps."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.in_flight = Gauge(
            "respool_responses_in_flight", "Responses this worker runs now.", registry=registry
        )
        self.events = Counter(
            "respool_events", "Events this worker appended to response streams.", registry=registry
        )
        self.first_event = Histogram(
            "respool_time_to_first_event_seconds",
            "From a run's start to its first output event.",
            buckets=_FIRST_EVENT_BUCKETS,
            registry=registry,
        )
        self.completion = Histogram(
            "respool_response_seconds",
            "From a run's start to its end.",
            buckets=_RESPONSE_BUCKETS,
            registry=registry,
        )
        self.finished = Counter(
            "respool_responses_finished",
            "Responses this worker ended, by status.",
            ["status"],
            registry=registry,
        )
        self.gathered_ends = Histogram(
            "respool_gathered_ends",
            "How many background responses' ends each gathered statement recorded (RESPOOL_GATHER_ENDS_MS).",
            buckets=_GATHERED_BUCKETS,
            registry=registry,
        )
        self.upstream_errors = Counter(
            "respool_upstream_errors", "Upstream calls that failed, by kind.", ["kind"], registry=registry
        )
        self.orphans = Counter(
            "respool_orphans_recovered",
            "Responses taken over after their worker stopped (run again, or ended), sweep included.",
            registry=registry,
        )
        self.cancels = Counter(
            "respool_cancels", "Cancels that stopped a running response.", registry=registry
        )
        self.webhooks_sent = Counter(
            "respool_webhooks_delivered",
            "Webhook deliveries a receiver acknowledged (2xx).",
            registry=registry,
        )
        self.webhook_failures = Counter(
            "respool_webhook_failed_attempts",
            "Webhook delivery attempts that failed (an answer other than 2xx, or none).",
            registry=registry,
        )
        self.webhooks_given_up = Counter(
            "respool_webhooks_given_up", "Webhook deliveries given up after their retries.", registry=registry
        )
        self.webhook_latency = Histogram(
            "respool_webhook_latency_seconds",
            "From a response's end to its webhook's acknowledgement.",
            buckets=_WEBHOOK_BUCKETS,
            registry=registry,
        )

    def serve(self, port: int) -> None:
        """Serve `/metrics` on `port`, from a thread of its own."""
        start_http_server(port, registry=self.registry)
