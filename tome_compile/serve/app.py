"""The Ray Serve application: an HTTP front (FastAPI ingress) and the model replicas.

    serve run tome_compile.serve.app:build ratio=0.5 compiler=eager     # Serve's own CLI
    tome-serve --ratio 0.5                                              # the same, with a local Ray

* ``Frontend`` (no CPU reserved) answers ``POST /generate`` (one PNG) and OpenAI's
  ``POST /v1/images/generations`` (``n`` base64 PNGs, OpenAI's error object with 400 where
  ``/generate`` says 422). It checks each request (422 naming the field), forwards it to the
  model with a timeout (504), turns a full queue into 503 at once (its own count of the requests
  it has in the model, capped at what the replicas run plus ``max_queued``; Serve's
  ``max_queued_requests`` backpressure behind it) and a replica that died under the request into
  503, and answers ``GET /healthz`` and ``GET /metrics`` (Prometheus text). ``drain()``
  (``tome-serve``'s SIGTERM) stops admitting: new requests are 503 while the ones in the model
  finish.
* ``Renderer`` replicas hold an :class:`~tome_compile.serve.engine.Engine` (model compiled and
  warmed up before the replica reports ready); ``@serve.batch`` groups concurrent requests into
  one call, which runs one denoising loop per group of equal settings.

Replicas, autoscaling, placement on GPUs and multi-node clusters are Serve's: see ``build``'s
arguments and ``docs/serve_config.yaml``.
"""


import asyncio
import dataclasses
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from tome_compile.serve.engine import Engine, Rendered, ServeSpec
from tome_compile.serve.openai_api import error_body, images_body, parse_images_request
from tome_compile.serve.outcomes import Metrics, RayServeMetrics, Refused
from tome_compile.serve.request import Job, RequestError, parse_job

__all__ = ["AppOptions", "Frontend", "Renderer", "admission_limit", "build", "build_app"]

logger = logging.getLogger("tome_compile.serve")

api = FastAPI(title="tome-serve", description="Text-to-image with token merging (tome-compile) on Ray Serve")


def _error(status: int, message: str, retry: bool = False) -> JSONResponse:
    return JSONResponse(
        {"error": message}, status_code=status, headers={"Retry-After": "1"} if retry else None
    )


@dataclasses.dataclass(frozen=True)
class AppOptions:
    """Serving options beyond the model's (``ServeSpec``)."""

    replicas: int = 1
    min_replicas: int | None = None  # autoscaling when both are set
    max_replicas: int | None = None
    batch_wait_ms: float = 20.0
    max_queued: int = 32  # requests waiting per deployment before 503
    request_timeout_s: float = 120.0
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0

    @property
    def autoscaled(self) -> bool:
        """Serve scales the replicas between ``min_replicas`` and ``max_replicas``."""
        return self.min_replicas is not None and self.max_replicas is not None


def _ongoing_per_replica(spec: ServeSpec) -> int:
    """Requests one replica holds at once: the batch being rendered and the next one forming."""
    return max(2 * spec.batch_size, 2)


def admission_limit(spec: ServeSpec, options: AppOptions) -> int:
    """Requests one front end lets into the model at once: what the replicas hold
    (``max_replicas`` under autoscaling) plus ``max_queued`` waiting; the next one is 503 at once.

    Serve's ``max_queued_requests`` alone does not bound a burst: its router checks the queue
    before it counts a request in it, so requests that arrive together all pass the check (Ray
    2.60, 24 at once against 6 running + 4 queued: 10 to 19 admitted). The front end's own count
    is checked and raised with no ``await`` in between, so it is exact."""
    replicas = options.max_replicas if options.autoscaled else options.replicas
    return int(replicas) * _ongoing_per_replica(spec) + options.max_queued


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64, health_check_period_s=2.0,
                  health_check_timeout_s=30.0)
class Renderer:
    """One model replica. ``render`` takes one job per call; Serve batches concurrent calls."""

    def __init__(self, spec: ServeSpec, batch_wait_ms: float) -> None:
        import torch

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        self.spec = spec
        self.engine = Engine(spec)
        self.warm_up_s = self.engine.warm_up()
        self.render.set_max_batch_size(spec.batch_size)
        self.render.set_batch_wait_timeout_s(batch_wait_ms / 1000.0)
        logger.info("Renderer ready: %s, warm-up %.1f s", spec, self.warm_up_s)

    def limits(self) -> Any:
        return self.engine.limits

    def ready(self) -> dict[str, Any]:
        return {"model": self.spec.model, "onnx": self.spec.onnx, "method": self.engine.method,
                "ratios": list(self.engine.limits.ratios), "batch_size": self.spec.batch_size,
                "warm_up_s": round(self.warm_up_s, 2)}

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.02)
    async def render(self, jobs: list[Job]) -> list[Rendered]:
        # the loop runs in a thread: the replica keeps answering health checks meanwhile
        return await asyncio.to_thread(self.engine.render, jobs)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(api)
class Frontend:
    """HTTP: ``POST /generate`` (JSON -> PNG), ``POST /v1/images/generations`` (OpenAI's images API)
    and ``GET /healthz``."""

    def __init__(self, renderer: DeploymentHandle, timeout_s: float, admit: int) -> None:
        self.renderer = renderer
        self.timeout_s = timeout_s
        self.admit = admit  # admission_limit(): requests in the model at once, then 503
        self._in_model = 0  # requests of this front end in the model (one event loop: no lock)
        self._draining = False
        self._limits: Any = None
        self.metrics = Metrics()
        self.metrics.registry.register(RayServeMetrics())

    def drain(self) -> int:
        """Stop admitting (every new request 503, ``/healthz`` 503 ``draining``); the requests in the
        model go on. Returns how many are in it (``tome-serve``'s SIGTERM waits for 0)."""
        self._draining = True
        return self._in_model

    def in_flight(self) -> int:
        """Requests of this front end in the model now."""
        return self._in_model

    async def _get_limits(self) -> Any:
        if self._limits is None:
            self._limits = await self.renderer.limits.remote()
        return self._limits

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        """This front end's counters and Ray Serve's own metrics (``ray_serve_*``, read from Ray's
        metrics ports when scraped) in Prometheus' text format."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        # a thread: Ray's metrics are read over HTTP, and this loop answers the other requests
        text = await asyncio.to_thread(generate_latest, self.metrics.registry)
        return Response(content=text, media_type=CONTENT_TYPE_LATEST)

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        if self._draining:
            return JSONResponse({"status": "draining", "in_flight": self._in_model}, status_code=503)
        try:
            info = await asyncio.wait_for(self._await(self.renderer.ready.remote()), timeout=10.0)
        except Exception as e:  # noqa: BLE001 - not ready, for whatever reason: say which
            return JSONResponse({"status": "unavailable", "error": f"{type(e).__name__}: {str(e)[:200]}"},
                                status_code=503)
        return JSONResponse({"status": "ok", "in_flight": self._in_model, **info})

    @staticmethod
    async def _await(response: Any) -> Any:
        return await response

    @api.post("/generate")
    async def generate(self, request: Request) -> Response:
        received = time.perf_counter()
        try:
            jobs, (rendered,) = await self._pictures(request, lambda body, limits: [parse_job(body, limits)],
                                                     "/generate", invalid_status=422)
        except Refused as e:
            return _error(e.status, e.message, e.retry)
        total = (time.perf_counter() - received) * 1000.0
        job = jobs[0]
        return Response(content=rendered.png, media_type="image/png", headers={
            "X-Seed": str(rendered.seed), "X-Compute-Ms": f"{rendered.compute_ms:.1f}",
            "X-Batch-Size": str(rendered.batch), "X-Total-Ms": f"{total:.1f}",
            "X-Ratio": f"{job.settings.ratio:g}", "X-Steps": str(job.settings.steps)})

    @api.post("/v1/images/generations")
    async def images(self, request: Request) -> JSONResponse:
        """OpenAI's images API: ``n`` pictures (seeds ``seed`` ...), batched with the other requests,
        as base64 PNGs; refusals as OpenAI's error object (400 where ``/generate`` says 422)."""
        try:
            jobs, rendered = await self._pictures(request, parse_images_request, "/v1/images/generations",
                                                  invalid_status=400)
        except Refused as e:
            kind = "invalid_request_error" if e.status == 400 else "server_error"
            return JSONResponse(error_body(e.message, e.param, e.code, kind), status_code=e.status,
                                headers={"Retry-After": "1"} if e.retry else None)
        batch = max(r.batch for r in rendered)
        return JSONResponse(images_body([r.png for r in rendered], int(time.time())),
                            headers={"X-Seed": str(jobs[0].seed), "X-Batch-Size": str(batch)})

    async def _pictures(self, request: Request, parse: Any, endpoint: str, *, invalid_status: int
                        ) -> tuple[list[Job], list[Rendered]]:
        """One request admitted, rendered and counted (metrics): its jobs and their pictures, or
        :class:`Refused` (``invalid_status`` for a request that fails its checks)."""
        try:
            jobs = await self._admit(request, parse, invalid_status)
            try:
                rendered = await self._render_all(jobs)
            finally:
                self._in_model -= len(jobs)
        except Refused as e:
            self.metrics.refused(endpoint, e)
            raise
        self.metrics.answered(endpoint, rendered)
        return jobs, rendered

    async def _admit(self, request: Request, parse: Any, invalid_status: int) -> list[Job]:
        """The request's jobs (``parse(body, limits)``), counted into the model (the caller counts
        them out), or Refused."""
        if self._draining:
            raise Refused(503, "shutting down: this server takes no new requests (the ones in flight "
                           "finish); retry on another", retry=True, code="shutting_down")
        try:
            body = await request.json()
        except ValueError:
            raise Refused(invalid_status, "body: not JSON; send {\"prompt\": \"...\", \"seed\": 0, ...}",
                          param="body") from None
        try:
            jobs = parse(body, await self._get_limits())
        except RequestError as e:
            raise Refused(invalid_status, str(e), param=e.field) from None
        except Exception as e:  # noqa: BLE001 - the replicas' limits are not reachable yet
            raise Refused(503, f"the model is not ready ({type(e).__name__}); retry", retry=True,
                           code="not_ready") from None
        if self._in_model + len(jobs) > self.admit:
            raise Refused(503, f"overloaded: {self._in_model} requests are in the model, the limit is "
                           f"{self.admit} (what the replicas run + --max-queued); retry later", retry=True,
                           code="overloaded")
        self._in_model += len(jobs)  # checked and counted with no await in between
        return jobs

    async def _render_all(self, jobs: list[Job]) -> list[Rendered]:
        """Every job's picture (sent together: Serve batches them with each other and the rest); the
        first failure cancels the others."""
        tasks = [asyncio.ensure_future(self._render(job)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _render(self, job: Job) -> Rendered:
        response = self.renderer.render.remote(job)
        try:
            return await asyncio.wait_for(self._await(response), timeout=self.timeout_s)
        except asyncio.CancelledError:  # the client went away: the model's share of it goes too
            response.cancel()
            raise
        except asyncio.TimeoutError:
            response.cancel()
            raise Refused(504, f"no picture within {self.timeout_s:g} s (the request timeout); retry later",
                           code="timeout") from None
        except Exception as e:  # noqa: BLE001 - backpressure or a replica that died: 503, never a hang
            from ray.serve.exceptions import BackPressureError

            if isinstance(e, BackPressureError):
                raise Refused(503, "overloaded: the queue is full; retry later", retry=True,
                               code="overloaded") from None
            logger.warning("generate failed: %s: %s", type(e).__name__, e)
            raise Refused(503, f"the request failed in a model replica ({type(e).__name__}); retry",
                           retry=True, code="replica_failed") from None


def build_app(spec: ServeSpec, options: AppOptions | None = None) -> Any:
    """The Serve application for ``spec`` with ``options`` (replicas, batching, queue, resources)."""
    options = options or AppOptions()
    if options.gpus_per_replica > 0 and spec.device == "cpu":
        spec = dataclasses.replace(spec, device="cuda")  # the replica's GPU runs the model
    renderer_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": options.cpus_per_replica, "num_gpus": options.gpus_per_replica},
        "max_queued_requests": options.max_queued,
        "max_ongoing_requests": _ongoing_per_replica(spec),
    }
    if options.autoscaled:
        renderer_options["autoscaling_config"] = {"min_replicas": options.min_replicas,
                                                  "max_replicas": options.max_replicas,
                                                  "target_ongoing_requests": spec.batch_size}
        renderer_options["num_replicas"] = "auto"
    else:
        renderer_options["num_replicas"] = options.replicas
    renderer = Renderer.options(**renderer_options).bind(spec, options.batch_wait_ms)
    return Frontend.bind(renderer, options.request_timeout_s, admission_limit(spec, options))


def build(args: dict[str, Any]) -> Any:
    """Serve's application builder (``serve run tome_compile.serve.app:build key=value ...``, or
    ``import_path`` + ``args`` in a Serve config file): ``args`` are ``ServeSpec`` and
    ``AppOptions`` fields, as strings or JSON values."""
    spec_fields = {f.name: f for f in dataclasses.fields(ServeSpec)}
    option_fields = {f.name: f for f in dataclasses.fields(AppOptions)}
    unknown = sorted(set(args) - set(spec_fields) - set(option_fields))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; use {sorted(spec_fields) + sorted(option_fields)}")
    spec = ServeSpec(**{k: _typed(ServeSpec, k, v) for k, v in args.items() if k in spec_fields})
    options = AppOptions(**{k: _typed(AppOptions, k, v) for k, v in args.items() if k in option_fields})
    return build_app(spec, options)


def _typed(cls: type, name: str, value: Any) -> Any:
    """A builder argument (``serve run`` passes strings, a config file JSON values) as the field's
    type, read from its type hint (never from the annotation's text)."""
    from tome_compile.arguments import parse_field

    if not isinstance(value, str):
        return tuple(value) if isinstance(value, list) else value
    return parse_field(cls, name, value)
