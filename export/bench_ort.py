"""ONNX Runtime benchmark: baseline export vs ToMe export vs the oracle, side by side.

    python -m tome_compile.export.bench_ort                 # SD 1.5 architecture, batch 2, 512² and 1024², CPU EP
    python -m tome_compile.export.bench_ort --sizes 512 --workdir /tmp/ort-bench

Each variant is exported with ``export_onnx`` (checked and parity-tested), loaded in its own
session, and timed in interleaved rounds; medians, ratios against the baseline, and the peak
memory of a call above the session's resting level are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.export.bench_ort", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="ort-bench", help="where the exported models go (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the exported models")
    parser.add_argument("--json", default="bench_ort.json")
    args = parser.parse_args(argv)

    import onnxruntime as ort
    import torch
    from tqdm import tqdm

    from tome_compile.bench import PeakMemory
    from tome_compile.config import ToMeConfig
    from tome_compile.export import ToMeSession, export_onnx
    from tome_compile.models import example_inputs, load_unet

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    variants = {"baseline": (ToMeConfig(ratio=0.0), False),
                f"tome {args.ratio}": (ToMeConfig(ratio=args.ratio, seed=0), False),
                "oracle": (ToMeConfig(ratio=args.ratio, seed=0), True)}
    result: dict[str, Any] = {"model": args.model, "batch": args.batch, "ratio": args.ratio,
                              "repeats": args.repeats, "onnxruntime": ort.__version__,
                              "threads": torch.get_num_threads(), "sizes": []}
    total = len(args.sizes) * len(variants) * (2 + args.repeats)
    with tqdm(total=total, desc="bench-ort", unit="step", file=sys.stderr) as bar:
        for size in args.sizes:
            sessions, exports, paths = {}, {}, {}
            for label, (config, oracle) in variants.items():  # export all first: one big model in memory
                bar.set_postfix_str(f"{size}² export {label}")
                unet, _ = load_unet(args.model)
                start = time.perf_counter()
                exported = export_onnx(unet, workdir / f"{size}_{label.split()[0]}.onnx", config,
                                       batch=args.batch, height=size, width=size, force=True, oracle=oracle)
                exports[label] = {"export_s": time.perf_counter() - start,
                                  "parity_max_abs": exported.parity_max_abs,
                                  "sites": len(exported.report.rewritten)}
                paths[label] = exported.path
                del unet, exported
                gc.collect()
                bar.update(1)
            for label, path in paths.items():
                sessions[label] = ToMeSession(path, seed=0, providers=["CPUExecutionProvider"])
            inputs = example_inputs(load_unet(args.model)[0], batch=args.batch, height=size, width=size)
            times: dict[str, list[float]] = {k: [] for k in sessions}
            peaks: dict[str, list[int]] = {k: [] for k in sessions}
            for label, session in sessions.items():  # warm-up
                bar.set_postfix_str(f"{size}² warm-up {label}")
                session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
                bar.update(1)
            for round_ in range(args.repeats):
                for label, session in sessions.items():
                    bar.set_postfix_str(f"{size}² {label} round {round_ + 1}")
                    with PeakMemory(torch.device("cpu")) as peak:
                        start = time.perf_counter()
                        session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
                        times[label].append(time.perf_counter() - start)
                    peaks[label].append(peak.peak)
                    bar.update(1)
            result["sizes"].append({"size": size, "variants": {
                k: {**exports[k], "times": times[k], "median_s": statistics.median(times[k]),
                    "peak_bytes": peaks[k]} for k in sessions}})
            del sessions
            gc.collect()
            if not args.keep:
                for f in workdir.glob(f"{size}_*"):
                    f.unlink()
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    for entry in result["sizes"]:
        v = entry["variants"]
        base = v["baseline"]["median_s"]
        print(f"\nONNX Runtime CPU EP, {args.model} {entry['size']}x{entry['size']}, batch {args.batch}, fp32, "
              f"median of {args.repeats}")
        print("| variant | median s | vs baseline | peak mem / call | parity max abs | sites |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, row in v.items():
            print(f"| {label} | {row['median_s']:.3f} | {base / row['median_s']:.2f}x | "
                  f"{statistics.median(row['peak_bytes']) / 2**30:.2f} GB | {row['parity_max_abs']:.1e} | "
                  f"{row['sites']} |")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
