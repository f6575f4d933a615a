"""How ``tome-serve``'s front end answers: a refusal (:class:`Refused`: HTTP status, message, the
field, a code) and the counters of what it answered (:class:`Metrics`, ``GET /metrics``).

A module of its own, imported by ``app.py``: defined in ``app.py`` after the deployments, these
names were undefined in the front end's replica (``NameError`` at its start; Ray Serve ships the
deployment classes to their replicas pickled)."""

from __future__ import annotations

from tome_compile.serve.engine import Rendered

__all__ = ["Metrics", "Refused"]


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


class Refused(Exception):
    """A request answered with an error: HTTP status, message, the field (``param``) and a code."""

    def __init__(self, status: int, message: str, *, retry: bool = False, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry, self.param, self.code = status, message, retry, param, code
