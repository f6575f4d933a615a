"""Load benchmark of ``tome-serve``: requests/s and latency at a few concurrencies, for batching on
vs off and ToMe vs plain, side by side on one machine.

    python -m tome_compile.serve.bench                      # inductor, shapes model, concurrency 1 4 8
    python -m tome_compile.serve.bench --compiler eager --requests 4 --concurrency 1 4

For each batching setting it deploys the application on a local Ray instance (the command's own,
stopped at the end), waits for ``/healthz``, then for ToMe (the server's ratio) and plain
(``ratio: 0`` — the same replicas, the plain U-Net) drives ``POST /generate`` (``--api openai``:
``POST /v1/images/generations``) from ``c`` client
threads over loopback, each sending ``--requests`` requests one after the other. Every request
has its own seed. Prints a table (requests/s, p50 and p95 latency, mean batch) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from tome_compile.arguments import parse_command_line, positive_int

__all__ = ["drive", "main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, bytes, dict[str, str]]:
    """``POST`` JSON; ``(status, body, headers)`` — an HTTP error status is returned, not raised."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def wait_healthy(base: str, timeout: float) -> dict[str, Any]:
    """Poll ``GET /healthz`` until it answers 200 (the replicas compiled and warmed up)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=15) as response:
                if response.status == 200:
                    return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = e
        time.sleep(1.0)
    raise TimeoutError(f"{base}/healthz did not answer 200 within {timeout:g} s (last: {last})")


def openai_body(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/generate`` body as the same request to ``/v1/images/generations`` (one picture)."""
    from tome_compile.serve.openai_api import RENAMED

    ours_to_openai = {ours: theirs for theirs, ours in RENAMED.items()}
    return {ours_to_openai.get(k, k): v for k, v in body.items()}


def drive(base: str, clients: int, requests: int, body: dict[str, Any], seed0: int,
          api: str = "generate", n: int = 1) -> dict[str, Any]:
    """``clients`` threads each send ``requests`` requests in a row; latencies and statuses.
    ``api="openai"``: the same requests through ``POST /v1/images/generations``, ``n`` pictures each
    (seeds ``seed`` .. ``seed + n - 1``)."""
    latencies: list[float] = []
    batches: list[int] = []
    failures: list[int] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for i in range(requests):
            start = time.perf_counter()
            request = {**body, "seed": seed0 + (k * requests + i) * n}
            if api == "openai":
                status, _, headers = post(base + "/v1/images/generations", {**openai_body(request), "n": n})
            else:
                status, _, headers = post(base + "/generate", request)
            took = time.perf_counter() - start
            with lock:
                if status == 200:
                    latencies.append(took)
                    batches.append(int(headers.get("x-batch-size", headers.get("X-Batch-Size", "1"))))
                else:
                    failures.append(status)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] if ordered else float("nan")
    return {"clients": clients, "requests": clients * requests, "ok": len(latencies), "failures": failures,
            "wall_s": wall, "requests_per_s": len(latencies) / wall if wall else 0.0, "n": n,
            "images_per_s": n * len(latencies) / wall if wall else 0.0,
            "p50_s": statistics.median(ordered) if ordered else float("nan"), "p95_s": p95,
            "mean_batch": statistics.mean(batches) if batches else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.serve.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--method", default="tome", choices=["tome", "importance"])
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--steps", type=positive_int, default=12)
    parser.add_argument("--batch-size", type=positive_int, default=4,
                        help="max batch size of the batching-on runs")
    parser.add_argument("--batch-wait-ms", type=float, default=20.0)
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=positive_int, default=6,
                        help="requests per client at each concurrency")
    parser.add_argument("--replicas", type=positive_int, default=1)
    parser.add_argument("--cpus-per-replica", type=float, default=None,
                        help="default: every CPU of the machine shared by the replicas")
    parser.add_argument("--api", default="generate", choices=["generate", "openai"],
                        help="the endpoint driven: /generate (PNG) or /v1/images/generations (base64)")
    parser.add_argument("--n", type=positive_int, default=1,
                        help="with --api openai: pictures per request (OpenAI's n)")
    parser.add_argument("--json", default="serve_bench.json")
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args
    if args.n > 1 and args.api != "openai":
        print("error: --n is OpenAI's n: give --api openai too", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from tome_compile.serve.app import AppOptions, build_app
    from tome_compile.serve.engine import ServeSpec

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False)
    rows: list[dict[str, Any]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for batching, size in (("on", args.batch_size), ("off", 1)):
            spec = ServeSpec(method=args.method, ratio=args.ratio, compiler=args.compiler, batch_size=size)
            cpus = args.cpus_per_replica or max(1.0, (os.cpu_count() or 1) // args.replicas)
            options = AppOptions(
                replicas=args.replicas,
                batch_wait_ms=args.batch_wait_ms,
                cpus_per_replica=cpus,
                max_queued=4 * max(args.concurrency),
                request_timeout_s=600,
            )
            start = time.perf_counter()
            serve.run(build_app(spec, options), name="bench", route_prefix="/", blocking=False)
            health = wait_healthy(base, 1800)
            ready_s = time.perf_counter() - start
            print(f"batching {batching} (batch {size}): ready in {ready_s:.0f} s ({health})", file=sys.stderr)
            for label, ratio in ((f"tome {args.ratio}", args.ratio), ("plain", 0.0)):
                body = {"prompt": "red circle", "steps": args.steps, "ratio": ratio}
                drive(base, 1, 2, body, seed0=10 ** 6, api=args.api, n=args.n)  # warm-up
                for clients in args.concurrency:
                    row = drive(base, clients, args.requests, body, seed0=1000 * clients, api=args.api,
                                n=args.n)
                    rows.append({"batching": batching, "batch_size": size, "variant": label, **row})
                    print(
                        f"  {label:10s} c={clients}: {row['requests_per_s']:.2f} req/s "
                        f"({row['images_per_s']:.2f} images/s), "
                        f"p50 {row['p50_s']:.2f} s, "
                        f"p95 {row['p95_s']:.2f} s, mean batch {row['mean_batch']:.1f}, "
                        f"failures {row['failures']}",
                        file=sys.stderr,
                    )
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"api": args.api, "n": args.n, "compiler": args.compiler, "method": args.method,
              "ratio": args.ratio, "steps": args.steps,
              "replicas": args.replicas, "requests_per_client": args.requests, "cpus": os.cpu_count(),
              "machine": platform.machine(), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"tome-serve load benchmark ({args.api} API, {args.n} picture(s) per request): shapes model, "
        f"{args.steps} steps, {args.compiler}, "
        f"{args.replicas} replica(s), "
        f"{os.cpu_count()} CPUs; {args.requests} requests per client"
    )
    print("| batching | variant | clients | requests/s | images/s | p50 latency | p95 latency | mean batch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batching']} ({r['batch_size']}) | {r['variant']} | {r['clients']} | "
            f"{r['requests_per_s']:.2f} | {r['images_per_s']:.2f} | "
            f"{r['p50_s']:.2f} s | {r['p95_s']:.2f} s | {r['mean_batch']:.1f} |"
        )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
