"""The server's histograms for /metrics: request latencies and draft tokens accepted per step,
in Prometheus' text format (cumulative buckets, sum and count)."""

from __future__ import annotations

import threading
import time

# Upper bounds, in seconds: requests of a few ms (tiny models) to minutes (long answers on a CPU).
LATENCY_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_GAP_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Counts of observed values by upper bound (one more bucket past the last: +Inf)."""

    def __init__(self, name: str, help_text: str, bounds, labels: str = ""):
        self.name, self.help_text, self.labels = name, help_text, labels
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum, self.count = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        if times <= 0:
            return
        bucket = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        with self._lock:
            self.counts[bucket] += times
            self.sum += value * times
            self.count += times

    def text(self) -> list[str]:
        """Its lines of the Prometheus text format."""
        sep = "," if self.labels else ""
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        out = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.bounds + ("+Inf",), counts):
            running += n
            out.append(f'{self.name}_bucket{{{self.labels}{sep}le="{bound}"}} {running}')
        braces = f"{{{self.labels}}}" if self.labels else ""
        out += [f"{self.name}_sum{braces} {round(total, 6)}", f"{self.name}_count{braces} {count}"]
        return out


class RequestMetrics:
    """Per finished request: time to first token, mean gap between its tokens, end-to-end time;
    and, when a method drafts, how many drafted tokens each of its target passes accepted."""

    def __init__(self, method: str | None, max_accepted: int = 16):
        self.ttft = Histogram(
            "specjax_time_to_first_token_seconds", "from submission to the first token", LATENCY_BOUNDS
        )
        self.token_gap = Histogram(
            "specjax_inter_token_latency_seconds",
            "a request's mean time between tokens after its first",
            TOKEN_GAP_BOUNDS,
        )
        self.e2e = Histogram("specjax_request_latency_seconds", "from submission to the last token", LATENCY_BOUNDS)
        self.accepted = None
        if method is not None:
            self.accepted = Histogram(
                "specjax_accepted_tokens_per_step",
                "drafted tokens the target accepted in one pass",
                range(max_accepted + 1),
                labels=f'method="{method}"',
            )

    def observe(self, handle) -> None:
        """A request's figures, once it has ended (its Handle's times and accepted histogram)."""
        if handle.first_token_at is None:
            return
        finished_at = handle.finished_at or time.perf_counter()  # a stop string: the text ended now
        self.ttft.observe(handle.first_token_at - handle.submitted)
        self.e2e.observe(finished_at - handle.submitted)
        if len(handle.tokens) > 1:
            self.token_gap.observe((finished_at - handle.first_token_at) / (len(handle.tokens) - 1))
        if self.accepted is not None and handle.accepted_hist is not None:
            for accepted, steps in enumerate(handle.accepted_hist):
                self.accepted.observe(accepted, int(steps))

    def text(self) -> list[str]:
        out = self.ttft.text() + self.token_gap.text() + self.e2e.text()
        return out + (self.accepted.text() if self.accepted is not None else [])
