"""How ``tome-serve``'s front end answers: a refusal (:class:`Refused`: HTTP status, message, the
field, a code) and the counters of what it answered (:class:`Metrics`, ``GET /metrics``).

A module of its own, imported by ``app.py``: defined in ``app.py`` after the deployments, these
names were undefined in the front end's replica (``NameError`` at its start; Ray Serve ships the
deployment classes to their replicas pickled)."""

from __future__ import annotations

import logging
import urllib.request
from typing import Any, Callable, Iterator

from tome_compile.serve.engine import Rendered

__all__ = ["Metrics", "RayServeMetrics", "Refused"]

logger = logging.getLogger("tome_compile.serve")


class Metrics:
    """The front end's counters (``GET /metrics``, prometheus_client): requests by endpoint and
    status, refusals by reason, pictures, and per picture the requests in its loop and the loop's
    time. A registry of its own per front end (no clash with another in the same process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("tome_serve_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.refusals = Counter("tome_serve_refusals", "Requests refused, by reason (invalid_request: "
                                "the field named in the answer)", ["reason"], registry=self.registry)
        self.pictures = Counter("tome_serve_pictures", "Pictures made", registry=self.registry)
        self.batch = Histogram("tome_serve_batch_requests", "Requests in the denoising loop of each picture",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.compute = Histogram("tome_serve_compute_seconds", "The denoising loop of each picture",
                                 registry=self.registry)

    def answered(self, endpoint: str, rendered: list[Rendered]) -> None:
        self.requests.labels(endpoint, "200").inc()
        for r in rendered:
            self.pictures.inc()
            self.batch.observe(r.batch)
            self.compute.observe(r.compute_ms / 1000.0)

    def refused(self, endpoint: str, error: Refused) -> None:
        self.requests.labels(endpoint, str(error.status)).inc()
        self.refusals.labels(error.code or "invalid_request").inc()


class RayServeMetrics:
    """Ray Serve's own metrics (``ray_serve_*``: requests, latencies, queue lengths and replicas per
    deployment) on our ``/metrics``: a prometheus_client collector that reads each live Ray node's
    metrics export port when scraped and keeps the ``ray_serve_`` families, samples of all nodes in
    one family each. ``tome_serve_ray_nodes_scraped{outcome}`` says how many nodes answered: Ray
    Serve pushes its metrics every few seconds, so a fresh server has none yet.

    ``nodes`` gives the (host, port) pairs to read; by default Ray's live nodes."""

    PREFIX = "ray_serve_"

    def __init__(self, nodes: Callable[[], list[tuple[str, int]]] | None = None,
                 timeout_s: float = 2.0) -> None:
        self.nodes = nodes or _ray_metrics_ports
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily
        from prometheus_client.parser import text_string_to_metric_families

        families: dict[str, Any] = {}
        outcome = {"ok": 0, "failed": 0}
        for host, port in self.nodes():
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=self.timeout_s) as r:
                    text = r.read().decode()
            except OSError as e:
                logger.warning("Ray's metrics on %s:%d did not answer: %s", host, port, e)
                outcome["failed"] += 1
                continue
            outcome["ok"] += 1
            for family in text_string_to_metric_families(text):
                if not family.name.startswith(self.PREFIX):
                    continue
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
        scraped = GaugeMetricFamily("tome_serve_ray_nodes_scraped", "Ray nodes whose metrics (ray_serve_*) "
                                    "this scrape read, by outcome", labels=["outcome"])
        for name, count in outcome.items():
            scraped.add_metric([name], count)
        yield scraped


def _ray_metrics_ports() -> list[tuple[str, int]]:
    """Each live Ray node's metrics export port (Prometheus text)."""
    import ray

    return [(n["NodeManagerAddress"], int(n["MetricsExportPort"])) for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


class Refused(Exception):
    """A request answered with an error: HTTP status, message, the field (``param``) and a code."""

    def __init__(self, status: int, message: str, *, retry: bool = False, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry, self.param, self.code = status, message, retry, param, code
