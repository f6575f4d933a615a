"""``tome-serve``: text-to-image with token merging, served by Ray Serve.

Starts a local Ray instance (or joins a cluster: ``--address`` / ``RAY_ADDRESS``), deploys the
application of :mod:`tome_compile.serve.app` and serves it over HTTP until Ctrl-C / SIGTERM, which
shut Serve (and a Ray instance this command started) down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from tome_compile.arguments import dataclass_from_args
from tome_compile.config import METHODS
from tome_compile.errors import ToMeError

__all__ = ["main"]

EPILOG = """examples:
  tome-serve                                           # shapes model, ToMe 0.5, inductor, 127.0.0.1:8000
  tome-serve --compiler eager --max-batch-size 8       # a first start in seconds
  tome-serve --model ./stable-diffusion-v1-5 --replicas 2 --num-gpus-per-replica 1
  tome-serve --onnx unet_tome.onnx                     # a tome-export file through ToMeSession
  tome-serve --address ray://head:10001 --min-replicas 1 --max-replicas 8   # a Ray cluster, autoscaling
  curl -s -X POST localhost:8000/generate -d '{"prompt": "red circle", "seed": 3}' -o out.png
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tome-serve", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="shapes",
        help="shapes (the shipped model), a shapes-model folder or a local diffusers pipeline folder",
    )
    p.add_argument(
        "--onnx", default=None, metavar="PATH", help="serve a tome-export file through ToMeSession"
    )
    p.add_argument(
        "--ratio", type=float, default=None, help="merge ratio, default 0.5 (requests: it or 0 = plain)"
    )
    p.add_argument("--ratios", type=float, nargs="+", default=None, metavar="R",
                   help="the ratios served instead, e.g. 0 0.3 0.5 (each compiled at start; a request's "
                        "'ratio' picks one, default the largest)")
    p.add_argument("--method", default="tome", choices=METHODS)
    p.add_argument("--plan-every", type=int, default=1, metavar="K")
    p.add_argument(
        "--compiler", default="inductor", help="inner compiler of torch.compile: inductor or eager"
    )
    p.add_argument("--seed", type=int, default=0, help="ToMe's partition seed (every batch restarts from it)")
    p.add_argument(
        "--sizes", default=None, help="picture sizes served, e.g. 32,64 (default: the model's own)"
    )
    p.add_argument("--replicas", type=int, default=1, help="model replicas (fixed)")
    p.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many replicas")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many replicas")
    p.add_argument("--max-batch-size", type=int, default=4,
                   help="requests per denoising loop; every loop is padded to it (1 = no batching)")
    p.add_argument("--batch-wait-ms", type=float, default=20.0, help="how long a batch waits to fill up")
    p.add_argument("--max-queued", type=int, default=32, help="queued requests before 503 (overload)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="per request, then 504")
    p.add_argument("--drain-timeout-s", type=float, default=None,
                   help="on SIGTERM, how long the requests in flight may take to finish before the server "
                        "stops (default: --request-timeout-s + 5)")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    p.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--address", default=None, help="a Ray cluster to join (default: RAY_ADDRESS, else a local Ray)"
    )
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    return p


def options_from(args: argparse.Namespace) -> tuple[object, object]:
    """``(ServeSpec, AppOptions)`` of the command line (one line of error for a bad value)."""
    from tome_compile.serve.app import AppOptions
    from tome_compile.serve.engine import ServeSpec

    if (args.min_replicas is None) != (args.max_replicas is None):
        raise ToMeError("give both --min-replicas and --max-replicas (autoscaling), or --replicas N")
    if args.min_replicas is not None and not 0 <= args.min_replicas <= args.max_replicas:
        raise ToMeError(
            f"--min-replicas {args.min_replicas} must be in [0, --max-replicas {args.max_replicas}]"
        )
    if args.replicas < 1:
        raise ToMeError(f"--replicas {args.replicas} must be >= 1")
    for name in ("batch_wait_ms", "request_timeout_s", "num_cpus_per_replica", "num_gpus_per_replica",
                 "drain_timeout_s"):
        if getattr(args, name) is None:
            continue
        if getattr(args, name) < 0:
            raise ToMeError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0")
    if not 1 <= args.max_batch_size <= 64:
        raise ToMeError(f"--max-batch-size {args.max_batch_size} is outside [1, 64] (1 = no batching)")
    if args.max_queued < 1:
        raise ToMeError(f"--max-queued {args.max_queued} must be >= 1")
    if args.ratio is not None and args.ratios is not None:
        raise ToMeError(f"give --ratio {args.ratio:g} (served with 0) or --ratios (the whole set), not both")
    try:
        sizes = tuple(int(v) for v in args.sizes.split(",")) if args.sizes else None
    except ValueError:
        raise ToMeError(f"--sizes {args.sizes!r}: give sizes like 32,64") from None
    # the flags carry the fields' names; only the renamed ones are given
    spec = dataclass_from_args(ServeSpec, args, batch_size=args.max_batch_size, sizes=sizes,
                               ratios=tuple(args.ratios) if args.ratios is not None else None)
    options = dataclass_from_args(AppOptions, args, cpus_per_replica=args.num_cpus_per_replica,
                                  gpus_per_replica=args.num_gpus_per_replica)
    return spec, options


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        spec, options = options_from(args)
        if args.model not in ("shapes",) and not os.path.exists(args.model):
            raise ToMeError(
                f"--model {args.model!r}: no such folder (give shapes, a shapes-model folder or a "
                "diffusers pipeline folder)"
            )
        if args.onnx is not None and not os.path.isfile(args.onnx):
            raise ToMeError(f"--onnx {args.onnx!r}: no such file")
    except (ToMeError, ValueError) as e:
        print(f"tome-serve: error: {e}", file=sys.stderr)
        return 2
    return _serve(args, spec, options)


def _serve(args: argparse.Namespace, spec: object, options: object) -> int:
    import ray
    from ray import serve

    from tome_compile.serve.app import build_app

    stop, serving = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if not serving.is_set() or stop.is_set():  # still starting, or a second signal while draining
            stop.set()
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    address = args.address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address)
        else:
            # a loaded machine can take more than Serve's 5 s to start the HTTP proxy, which Serve
            # then kills and restarts in a loop; the local instance's processes inherit this
            os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
            ray.init(num_cpus=args.num_cpus, include_dashboard=False)
        for sig in previous:  # ray.init installs its own SIGTERM handler (it aborts the driver): ours again
            signal.signal(sig, on_signal)
        serve.start(http_options={"host": args.host, "port": args.port,
                                  "request_timeout_s": options.request_timeout_s + 5})
        print("tome-serve: deploying (the replicas compile and warm up before they serve)...", flush=True)
        serve.run(build_app(spec, options), name="tome", route_prefix="/", blocking=False)
        serving.set()
        if not stop.is_set():
            print(
                f"tome-serve: serving on http://{args.host}:{args.port} — POST /generate, "
                "POST /v1/images/generations, GET /healthz, GET /metrics "
                f"({'Ray cluster ' + address if address else 'local Ray'}); Ctrl-C or SIGTERM to stop",
                flush=True,
            )
        stop.wait()
        _drain(args.drain_timeout_s if args.drain_timeout_s is not None else options.request_timeout_s + 5)
        print("tome-serve: stopping", flush=True)
        return 0
    except KeyboardInterrupt:
        print(f"tome-serve: interrupted while {'draining' if serving.is_set() else 'starting'}; stopping",
              flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, then the shutdown below
        print(f"tome-serve: error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
              file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            if address:
                serve.delete("tome")  # leave the cluster's Serve running for its other applications
            else:
                serve.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down after a failed start
            print(f"tome-serve: shutting Serve down: {type(e).__name__}: {e}", file=sys.stderr)
        ray.shutdown()


def _drain(timeout_s: float) -> None:
    """Stop admitting (new requests 503), wait up to ``timeout_s`` for the requests in the model to be
    answered, then return (Serve is shut down after): a client in flight gets its picture, not a
    closed connection."""
    from ray import serve

    try:
        handle = serve.get_app_handle("tome")
        in_flight = handle.drain.remote().result(timeout_s=30)
        print(f"tome-serve: draining: no new requests; waiting for {in_flight} in flight (at most "
              f"{timeout_s:g} s; a second signal stops at once)", flush=True)
        deadline = time.monotonic() + timeout_s
        while in_flight and time.monotonic() < deadline:
            time.sleep(0.2)
            in_flight = handle.in_flight.remote().result(timeout_s=30)
        if in_flight:
            print(f"tome-serve: {in_flight} requests still in flight after {timeout_s:g} s; stopping anyway",
                  flush=True)
        time.sleep(1.0)  # the HTTP proxy sends the last answers on
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a front end that is gone has nothing to drain
        print(f"tome-serve: draining: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
