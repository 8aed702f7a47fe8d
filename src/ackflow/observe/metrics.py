"""Prometheus metrics of a run, served on an opt-in port (127.0.0.1 by default).

Metrics are updated after state changes (a pull, a settled batch), never per row.
Each engine has its own registry, so several runs in one process do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ackflow.core.errors import ConfigError


class Metrics:
    """The metrics of one run. ``serve(port)`` exposes them at ``/metrics``."""

    def __init__(self, max_inflight: int) -> None:
        r = self.registry = CollectorRegistry()
        self.pulled = Counter("ackflow_messages_pulled", "Messages pulled from sources", registry=r)
        self.acked = Counter("ackflow_messages_acked", "Messages acked", registry=r)
        self.nacked = Counter("ackflow_messages_nacked", "Messages nacked (to be retried)", registry=r)
        self.dead_lettered = Counter(
            "ackflow_messages_dead_lettered", "Messages dead-lettered", ["step"], registry=r
        )
        self.released = Counter(
            "ackflow_messages_released", "Messages given back unprocessed at shutdown", registry=r
        )
        self.recovered = Counter(
            "ackflow_messages_recovered", "In-flight messages of a dead consumer delivered again", registry=r
        )
        self.redelivered = Counter(
            "ackflow_messages_redelivered",
            "Deliveries lost with their broker channel (delivered again)",
            registry=r,
        )
        self.dead_letter_write_failures = Counter(
            "ackflow_dead_letter_write_failures",
            "Given-up messages whose dead-letter write (error sink, or the source's dead-letter "
            "route) failed or was refused (nacked, retried)",
            registry=r,
        )
        self.rows_written = Counter("ackflow_rows_written", "Rows written", ["sink"], registry=r)
        self.in_flight = Gauge("ackflow_in_flight", "Unsettled messages", registry=r)
        self.max_inflight = Gauge("ackflow_max_inflight", "The in-flight window", registry=r)
        self.throttled = Gauge(
            "ackflow_throttled", "1 while the window is full and pulling stops", registry=r
        )
        self.throttle_episodes = Counter(
            "ackflow_throttle_episodes", "Transitions into the throttled state", registry=r
        )
        self.batch_seconds = Histogram(
            "ackflow_batch_duration_seconds",
            "Wall time of a batch (all its Spark jobs)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.batch_size = Histogram(
            "ackflow_batch_size_messages",
            "Messages per batch",
            buckets=(1, 10, 100, 500, 1000, 2000, 5000, 10000, 50000),
            registry=r,
        )
        self.bisections = Counter("ackflow_bisections", "Failed Spark jobs split in halves", registry=r)
        self.systemic = Gauge(
            "ackflow_systemic_failure",
            "1 while every message fails the same way at a step (messages "
            "are given back, never dead-lettered)",
            ["step"],
            registry=r,
        )
        self.given_back_systemic = Counter(
            "ackflow_messages_given_back_systemic",
            "Failed deliveries given back because the failure was systemic",
            registry=r,
        )
        self.jobs = Counter("ackflow_spark_jobs", "Spark jobs run (bisection jobs included)", registry=r)
        self.source_connected = Gauge(
            "ackflow_source_connected",
            "1 while the source is connected and consuming; 0 while it reconnects (a lost "
            "connection, a broker restart, a consumer the broker cancelled)",
            registry=r,
        )
        self.source_connected.set(1)
        self.max_inflight.set(max_inflight)
        w = ["window"]
        self.window_gauges = {
            "open_windows": Gauge("ackflow_window_open", "Open windows in the state store", w, registry=r),
            "refused_windows": Gauge(
                "ackflow_window_refused",
                "Closed windows whose result the output refused or could not be made (kept in state)",
                w,
                registry=r,
            ),
            "watermark_s": Gauge(
                "ackflow_window_watermark_seconds",
                "The window's watermark (event time, epoch s)",
                w,
                registry=r,
            ),
            "watermark_lag_s": Gauge(
                "ackflow_window_watermark_lag_seconds",
                "Wall clock minus the watermark: how far behind now windows close",
                w,
                registry=r,
            ),
            "late_rows": Gauge(
                "ackflow_window_late_rows",
                "Rows that came below the watermark (since the state began)",
                w,
                registry=r,
            ),
            "windows_written": Gauge(
                "ackflow_window_results_written",
                "Closed windows written (since the state began)",
                w,
                registry=r,
            ),
            "state_bytes": Gauge(
                "ackflow_window_state_bytes", "Size of the state store's file", w, registry=r
            ),
            "output_failures": Gauge(
                "ackflow_window_output_failures",
                "Failed attempts (this run) to write due windows (they stay in state and are tried again)",
                w,
                registry=r,
            ),
        }
        self.dedupe_repeats = Counter(
            "ackflow_dedupe_dropped",
            "Rows a dedupe operator dropped as repeats of a key it holds (their messages acked)",
            ["dedupe"],
            registry=r,
        )
        self._episodes_seen = 0
        self._server: Any = None

    def window(self, in_flight: int, throttled: bool, episodes: int) -> None:
        self.in_flight.set(in_flight)
        self.throttled.set(1 if throttled else 0)
        if episodes > self._episodes_seen:
            self.throttle_episodes.inc(episodes - self._episodes_seen)
            self._episodes_seen = episodes

    def dedupe_dropped(self, name: str, n: int) -> None:
        self.dedupe_repeats.labels(name).inc(n)

    def windows(self, name: str, facts: dict[str, Any]) -> None:
        """A window operator's state, as its timer last read it."""
        for key, gauge in self.window_gauges.items():
            value = facts.get(key)
            if isinstance(value, (int, float)):
                gauge.labels(window=name).set(value)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"metrics: cannot listen on {host}:{port}: {e}") from e

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
