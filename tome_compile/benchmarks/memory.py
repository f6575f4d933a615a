"""Memory benchmark, each measurement in a fresh process (one process that exports or loads several
models reuses freed memory without growing, and measures nothing).

    # peak resident memory and wall time per stage of a tome-export run
    python -m tome_compile.benchmarks.memory export -- sd15.onnx --model sd15 --optimize cpu
    # peak memory of one ONNX Runtime call above the session's resting level, per file
    python -m tome_compile.benchmarks.memory call plain.onnx tome.onnx --batch 2 --rounds 3
    # ... with ORT's own memory plan and without it, its CPU arena on and off
    python -m tome_compile.benchmarks.memory call plain.onnx tome.onnx --memory reuse lean --arena off on

``call`` runs every file in its own subprocess, by default with ORT's CPU memory arena off and glibc
told to return large frees to the system (``MALLOC_MMAP_THRESHOLD_=65536``), so resident memory
follows what ORT holds; a sampling thread reads ``/proc/self/statm`` every millisecond during the
call. The peak above the level just before the call is the call's own memory (activations and
temporaries). With the arena on, which keeps what it grew to, the peak counts from the loaded
session, first call included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tome_compile.arguments import parse_command_line, positive_int

__all__ = ["main"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_GB = 1e9


def _rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _Peak:
    """Highest resident size of ``pid`` while running (sampled every ``interval`` seconds)."""

    def __init__(self, pid: int | str = "self", interval: float = 0.001) -> None:
        self.pid, self.interval, self.peak, self._stop = pid, interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, _rss(self.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(self.interval)

    def __enter__(self) -> _Peak:
        self.peak = _rss(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss(self.pid)) if self.pid == "self" else self.peak


def _inputs(session: Any, batch: int, seed: int) -> dict[str, np.ndarray]:
    """Random model inputs of the file's shapes at ``batch`` (the timestep 999)."""
    g = np.random.default_rng(seed)
    tome = {spec.name for spec in session.specs}
    meta = session.meta
    traced = {"height": meta.latent_hw[0] if meta.latent_hw else None,  # an any-size file: the traced size
              "width": meta.latent_hw[1] if meta.latent_hw else None, "sequence_length": meta.seq_len}
    out: dict[str, np.ndarray] = {}
    for name, spec in session.inputs.items():
        if name in tome:
            continue
        if name == "timestep":
            out[name] = np.array([999.0], dtype=np.float32)
            continue
        shape = [d if isinstance(d, int) else traced.get(d) or batch for d in spec.shape]
        dtype = np.float16 if "float16" in spec.type else np.float32
        out[name] = g.standard_normal(shape).astype(dtype)
    if "time_ids" in out:
        h, w = session.meta.height or 1024, session.meta.width or 1024
        out["time_ids"] = np.array([[h, w, 0, 0, h, w]] * batch, dtype=out["time_ids"].dtype)
    return out


_ORDERS = {"default": "DEFAULT", "priority": "PRIORITY_BASED"}  # --order: ort.ExecutionOrder
# --memory: ONNX Runtime's own plan ("reuse": a freed buffer is handed to a later value of its size,
# the default) or every value its own buffer, freed after its last reader ("lean")
_MEMORY = ("reuse", "lean")


def _child(path: str, batch: int, rounds: int, seed: int, order: str = "default", memory: str = "reuse",
           arena: bool = False) -> dict[str, Any]:
    import onnxruntime as ort

    from tome_compile.export import ToMeSession, lean_memory_options

    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = arena
    options.execution_order = getattr(ort.ExecutionOrder, _ORDERS[order])
    if memory == "lean":
        lean_memory_options(options)
    session = ToMeSession(path, providers=["CPUExecutionProvider"], seed=0, session_options=options)
    feed = _inputs(session, batch, seed)
    sample = feed.pop("sample")
    timestep = feed.pop("timestep")
    ehs = feed.pop("encoder_hidden_states", None)
    added = {k: feed.pop(k) for k in ("text_embeds", "time_ids") if k in feed}
    resting = _rss()

    def call() -> None:
        session(sample, timestep, ehs, added_cond_kwargs=added or None, **feed)

    with _Peak() as first:
        call()  # first call: ORT's lazy initialisation
    peaks, times = [], []
    for _ in range(rounds):
        # the arena keeps what it grew to (in the first call too): its peaks count from the
        # session's resting level; without it, from the level before each call
        before = resting if arena else _rss()
        start = time.perf_counter()
        with _Peak() as peak:
            call()
        times.append(time.perf_counter() - start)
        peaks.append(peak.peak - before)
    if arena:
        peaks = [max(p, first.peak - resting) for p in peaks]
    return {
        "path": path,
        "batch": batch,
        "order": order,
        "memory": memory,
        "arena": arena,
        "resting_gb": resting / _GB,
        "peak_gb": statistics.median(peaks) / _GB,
        "peaks_gb": [p / _GB for p in peaks],
        "median_s": statistics.median(times),
    }


def measure_call(path: str | Path, batch: int, rounds: int = 3, seed: int = 0, order: str = "default",
                 memory: str = "reuse", arena: bool = False) -> dict[str, Any]:
    """``_child`` in a fresh interpreter (arena off, large frees returned): one file's call memory,
    with ONNX Runtime's ``order`` of execution (``default`` or ``priority``) and ``memory`` plan
    (``reuse``: ORT's default; ``lean``: :func:`tome_compile.export.lean_memory_options`); ``arena``:
    ORT's CPU arena on (its default), the peak counted from the loaded session, first call included."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    code = ("import json, sys; from tome_compile.benchmarks.memory import _child; "
            f"print('RESULT ' + json.dumps(_child({str(path)!r}, {batch}, {rounds}, {seed}, {order!r}, "
            f"{memory!r}, {arena!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"measuring {path} failed (exit {proc.returncode}): {tail}")
    return json.loads(line[len("RESULT "):])


_CHILD = """
import logging, sys, time
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("STAGE %(message)s"))
logger = logging.getLogger("tome_compile.export.stage")
logger.addHandler(handler); logger.setLevel(logging.INFO); logger.propagate = False
from tome_compile.export.cli import main
code = main(sys.argv[1:])
print("STAGE done", flush=True)
sys.exit(code)
"""


def measure_export(argv: list[str]) -> dict[str, Any]:
    """``tome-export ARGV`` in a subprocess: peak resident memory and wall time per stage (the
    stages its progress bar shows: loading, tracing, rewriting, converting, the checks,
    optimizing, writing)."""
    proc = subprocess.Popen([sys.executable, "-u", "-c", _CHILD, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stages: list[dict[str, Any]] = [
        {"stage": "starting Python, imports", "peak_gb": 0.0, "start": time.perf_counter()}
    ]
    lock = threading.Lock()
    errors: list[str] = []
    report: list[str] = []

    def read_stdout() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("STAGE "):
                with lock:
                    stages.append({"stage": line[6:].strip(), "peak_gb": 0.0, "start": time.perf_counter()})
            else:
                report.append(line)

    def read_stderr() -> None:
        errors.extend(proc.stderr)  # type: ignore[arg-type]

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
    for reader in readers:
        reader.start()
    peak_all = 0
    while proc.poll() is None:
        try:
            rss = _rss(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        peak_all = max(peak_all, rss)
        with lock:
            stages[-1]["peak_gb"] = max(stages[-1]["peak_gb"], rss / _GB)
        time.sleep(0.02)
    for reader in readers:
        reader.join(timeout=5)
    end = time.perf_counter()
    if stages[-1]["stage"] == "done":
        end = stages.pop()["start"]
    for stage, following in zip(stages, [*stages[1:], None], strict=True):
        stage["seconds"] = (following["start"] if following else end) - stage.pop("start")
    return {"argv": argv, "returncode": proc.returncode, "peak_gb": peak_all / _GB, "stages": stages,
            "report": "".join(report), "stderr_tail": "".join(errors)[-2000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.benchmarks.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="peak RSS and wall time per stage of tome-export ARGS (after --)")
    e.add_argument("--json", default=None)
    e.add_argument("args", nargs=argparse.REMAINDER)
    c = sub.add_parser("call", help="peak memory of one ONNX Runtime call per file, each in a fresh process")
    c.add_argument("paths", nargs="+")
    c.add_argument("--batch", type=positive_int, default=2)
    c.add_argument("--rounds", type=positive_int, default=3)
    c.add_argument("--order", choices=list(_ORDERS), nargs="+", default=["default"],
                   help="ONNX Runtime's execution order(s); each file is measured with each")
    c.add_argument("--memory", choices=_MEMORY, nargs="+", default=["reuse"],
                   help="ONNX Runtime's memory plan(s): reuse (its default) or lean (no buffer reuse)")
    c.add_argument("--arena", choices=("off", "on"), nargs="+", default=["off"],
                   help="ONNX Runtime's CPU arena (on: its default; off: memory follows live values)")
    c.add_argument("--json", default=None)
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args
    if args.command == "export":
        argv_ = args.args[1:] if args.args[:1] == ["--"] else args.args
        result = measure_export(argv_)
        print("tome-export " + " ".join(argv_))
        print("| stage | peak RSS GB | wall s |\n|---|---:|---:|")
        for stage in result["stages"]:
            print(f"| {stage['stage']} | {stage['peak_gb']:.2f} | {stage['seconds']:.1f} |")
        data = [Path(a + ".data") for a in argv_ if a.endswith(".onnx")]
        weights = sum(p.stat().st_size for p in data if p.is_file()) / _GB
        ratio = (
            f" = {result['peak_gb'] / weights:.1f}x the {weights:.2f} GB of weights written"
            if weights
            else ""
        )
        print(f"exit {result['returncode']}; peak {result['peak_gb']:.2f} GB{ratio}")
        if args.json:
            Path(args.json).write_text(json.dumps({**result, "weights_gb": weights}, indent=2))
        if result["returncode"]:
            print(result["stderr_tail"][-800:], file=sys.stderr)
        return 0 if result["returncode"] == 0 else 1
    rows = [measure_call(p, args.batch, args.rounds, order=o, memory=m, arena=a == "on")
            for a in args.arena for m in args.memory for o in args.order for p in args.paths]
    print(f"batch {args.batch}, CPU EP, median of {args.rounds} calls after one warm-up")
    print("| file | order | memory | arena | resting GB | peak per call GB | median s |")
    print("|---|---|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {Path(row['path']).name} | {row['order']} | {row['memory']} | "
            f"{('off', 'on')[row['arena']]} | {row['resting_gb']:.2f} | "
            f"{row['peak_gb']:.3f} | "
            f"{row['median_s']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
