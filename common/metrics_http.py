"""Prometheus plumbing shared by the router and the workers: serve a registry over HTTP, read its
figures back as plain numbers (for `snapshot()`s), and scrape an exporter (for reports and tests).

    server = start_metrics_server(registry)            # 127.0.0.1, a port the OS picks
    print(server.url)                                  # http://127.0.0.1:PORT/metrics
    server.stop()                                      # the port is closed when this returns

The exporter is prometheus_client's own `start_http_server` (a threaded WSGI server on a daemon
thread; in 0.26 it returns the server and its thread). It binds 127.0.0.1 unless told otherwise:
metrics reveal load and model identity, so publishing them beyond the host (`host="0.0.0.0"` in a
pod) is an explicit choice of whoever starts it.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field
from threading import Thread
from typing import Any, Self

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from common.ports import bind_error

DEFAULT_HOST = "127.0.0.1"
LabelKey = tuple[tuple[str, str], ...]  # a sample's labels, sorted by name


@dataclass
class MetricsServer:
    """A running exporter, at the address it is bound to (the OS's port pick when asked for port 0)."""

    host: str
    port: int
    _httpd: Any = field(repr=False)
    _thread: Thread = field(repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal needs brackets
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops serving and closes the listening socket; idempotent."""
        if self._thread.is_alive():
            # shutdown() waits for serve_forever to notice (up to its 0.5 s poll interval)
            self._httpd.shutdown()
            self._thread.join(timeout_s)
        self._httpd.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_metrics_server(
    registry: CollectorRegistry, port: int = 0, host: str = DEFAULT_HOST, *, key: str = "metrics_port"
) -> MetricsServer:
    """Serves `registry` at http://host:port/metrics (any path answers) on a daemon thread.
    Raises common.ports.PortInUse (CannotListen for other reasons; both OSErrors) naming `key`, the
    config key the port came from, when the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as err:
        raise bind_error(key, host, port, err) from None
    return MetricsServer(str(httpd.server_address[0]), httpd.server_port, httpd, thread)  # IPv4/6: a str already


def sample_values(metric, suffix: str = "", skip_labels: int = 0) -> dict[tuple[str, ...], float]:
    """The current values of one prometheus_client metric (all its label sets), read through its
    public `collect()`: label values (in label-name order, the first `skip_labels` dropped) → value.
    `suffix` picks the sample: "_total" for counters, "_count" / "_sum" for histograms, "" for gauges."""
    values = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name == family.name + suffix:
                values[tuple(sample.labels.values())[skip_labels:]] = sample.value
    return values


def plain(values: dict[tuple[str, ...], float]) -> Any:
    """`sample_values` made JSON-friendly: an unlabelled metric → its number; a labelled one →
    {label value: number} ({"a/b": number} for several labels; {} before any label set was used)."""
    if list(values) == [()]:
        return values[()]
    return {"/".join(key): value for key, value in sorted(values.items())}


def histogram_totals(metric, skip_labels: int = 0) -> Any:
    """A histogram's observation count and sum of values, per label set, in the shape of `plain`."""
    counts, sums = sample_values(metric, "_count", skip_labels), sample_values(metric, "_sum", skip_labels)
    totals = {key: {"count": int(counts[key]), "sum": sums[key]} for key in counts}
    if list(totals) == [()]:
        return totals[()]
    return {"/".join(key): value for key, value in sorted(totals.items())}


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, LabelKey], float]:
    """Fetches an exporter's page and parses it: (sample name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
