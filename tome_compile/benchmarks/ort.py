"""ONNX Runtime benchmark: the optimised plain model vs ToMe vs the oracle, side by side.

    python -m tome_compile.benchmarks.ort      # SD 1.5 architecture, 512² batch 2 and 1024² batch 1, CPU EP
    python -m tome_compile.benchmarks.ort --sizes 512 --batches 2 --workdir /tmp/ort-bench
    python -m tome_compile.benchmarks.ort --variants baseline baseline-static tome tome-static --one-session

The baseline is what an ONNX Runtime user deploys today: the same U-Net exported with every
attention a fused ``com.microsoft.MultiHeadAttention`` (ratio 0 through the same exporter) and
run through ORT's transformer optimizer (``model_type="unet"``, the provider's fusions). ToMe
and the oracle go through the same path. Each variant is exported with ``export_onnx`` (checked
and parity-tested), loaded in its own session and timed in interleaved rounds; medians, ratios
against the baseline, and the peak memory of a call above the session's resting level are
printed and written as JSON.

Exports take every image size (``tome-export``'s default): a variant's file is exported once, at the
first size, and the same file runs every later size — as a deployment would. A ``-static`` variant
(``baseline-static``, ``tome-static``) is ``tome-export --static``: one file per size, traced there;
side by side with its dynamic twin it gives the cost of the symbolic shapes.
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

from tome_compile.arguments import image_size, parse_command_line, positive_int

__all__ = ["main"]


class _SessionPool:
    """Sessions by variant; with ``one_at_a_time`` each is freed after use (memory-bound sizes)."""

    def __init__(self, paths: dict[str, Path], one_at_a_time: bool) -> None:
        self.paths, self.one_at_a_time = paths, one_at_a_time
        self.sessions: dict[str, Any] = {}

    def __call__(self, label: str) -> Any:
        from tome_compile.export import ToMeSession

        if label not in self.sessions:
            self.sessions[label] = ToMeSession(self.paths[label], seed=0, providers=["CPUExecutionProvider"])
        return self.sessions[label]

    def release(self, label: str) -> None:
        if self.one_at_a_time:
            self.sessions.pop(label, None)
            gc.collect()

    def close(self) -> None:
        self.sessions.clear()
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.benchmarks.ort", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--sizes", type=image_size, nargs="+", default=[512, 1024])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[2, 1],
                        help="batch per size (default 2 at 512², 1 at 1024²)")
    parser.add_argument("--no-optimize", action="store_true",
                        help="skip ORT's transformer optimizer (compare unoptimised exports)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--workdir", default="ort-bench", help="where the exported models go (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the exported models")
    parser.add_argument("--json", default="bench_ort.json")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["baseline", "tome", "oracle"],
        help="baseline, tome, oracle, and plan reuse: tome-shared (share_plan=True; 'shared' "
        "for short), tome-shared-every3 (+ plan_every=3: a round times a cycle of 3 calls "
        "and reports the mean), tome-every2, ...; todo (ToDo: keys and values downsampled 2x)",
    )
    parser.add_argument("--reuse", action="store_true",
                        help="reuse models already exported to --workdir by an earlier run")
    parser.add_argument("--one-session", action="store_true",
                        help="hold one session at a time (load, run, free, in each round): for sizes where "
                             "ONNX Runtime CPU materialises N x N attention (1024²: 8.6 GB per image)")
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args
    if len(args.batches) == 1:
        args.batches = args.batches * len(args.sizes)
    if len(args.batches) != len(args.sizes):
        parser.error(f"--batches {args.batches} must give one batch per size {args.sizes} (or one for all)")

    import onnxruntime as ort
    import torch
    from tqdm import tqdm

    from tome_compile.bench import PeakMemory, variant_options
    from tome_compile.config import ToMeConfig
    from tome_compile.errors import ToMeError
    from tome_compile.export import export_onnx
    from tome_compile.models import example_inputs, load_unet

    variants: dict[str, tuple[Any, bool, bool]] = {}  # label: (config, oracle, static)
    try:
        for name in args.variants:
            static = name.endswith("-static")
            base = name.removesuffix("-static")
            if base == "baseline":
                variants[name] = (ToMeConfig(ratio=0.0), False, static)
            elif base == "oracle":
                variants[name] = (ToMeConfig(ratio=args.ratio, seed=0), True, static)
            elif base == "todo":  # ToDo: keys and values downsampled 2x per axis, no ratio, nothing planned
                variants[f"{name} x2"] = (ToMeConfig(method="todo", seed=0), False, static)
            elif base.split("-")[0] in ("tome", "shared"):
                options = variant_options("tome-shared" if base == "shared" else base)
                variants[f"{name} {args.ratio}"] = (ToMeConfig(ratio=args.ratio, seed=0, **options), False,
                                                    static)
            else:
                raise ToMeError(f"unknown variant {name!r}: use baseline, oracle, tome[-shared][-everyK], "
                                "todo, each optionally -static")
    except ToMeError as e:
        parser.error(str(e))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"model": args.model, "ratio": args.ratio,
                              "optimized": not args.no_optimize,
                              "repeats": args.repeats, "onnxruntime": ort.__version__,
                              "threads": torch.get_num_threads(), "sizes": []}
    total = len(args.sizes) * len(variants) * (2 + args.repeats)
    any_size: dict[str, Path] = {}  # label: a file for every size, exported at the first size
    with tqdm(total=total, desc="bench-ort", unit="step", file=sys.stderr) as bar:
        for size, batch in zip(args.sizes, args.batches, strict=True):
            exports: dict[str, dict[str, Any]] = {}
            paths: dict[str, Path] = {}
            for label, (config, oracle, static) in variants.items():  # export all first: one big model
                bar.set_postfix_str(f"{size}² export {label}")
                path = workdir / f"{size if static else 'any'}_{label.split()[0]}.onnx"
                if label in any_size:  # the file traced at an earlier size
                    exports[label] = {"export_s": None, "parity_max_abs": None, "sites": None,
                                      "traced_at": any_size[label].name}
                    paths[label] = any_size[label]
                    bar.update(1)
                    continue
                if args.reuse and path.is_file():
                    exports[label] = {"export_s": None, "parity_max_abs": None, "sites": None}
                    paths[label] = path
                    bar.update(1)
                    continue
                unet, _ = load_unet(args.model)
                start = time.perf_counter()
                exported = export_onnx(unet, path, config, batch=batch, height=size, width=size, force=True,
                                       oracle=oracle, optimize=None if args.no_optimize else "cpu",
                                       static=static)
                exports[label] = {"export_s": time.perf_counter() - start,
                                  "parity_max_abs": exported.parity_max_abs,
                                  "sites": len(exported.report.rewritten),
                                  "fused_attention": exported.fused_attention,
                                  "fusions": exported.fusions}
                paths[label] = exported.path
                if not static:
                    any_size[label] = exported.path
                del unet, exported
                gc.collect()
                bar.update(1)
            session_of = _SessionPool(paths, args.one_session)

            inputs = example_inputs(load_unet(args.model)[0], batch=batch, height=size, width=size)
            gc.collect()
            times: dict[str, list[float]] = {k: [] for k in paths}
            cycle = {k: variants[k][0].plan_every for k in paths}
            peaks: dict[str, list[int]] = {k: [] for k in paths}
            # Peak memory: the first run of a fresh session grows its arena to what a call needs;
            # later runs reuse it. So the warm-up run is the one measured.
            for label in paths:  # warm-up (with --one-session each round warms its fresh session)
                if not args.one_session:
                    bar.set_postfix_str(f"{size}² warm-up {label}")
                    session = session_of(label)
                    with PeakMemory(torch.device("cpu")) as peak:
                        for _ in range(cycle[label]):  # plan_every: the reusing branch warms up too
                            session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
                    peaks[label].append(peak.peak)
                bar.update(1)
            for round_ in range(args.repeats):
                for label in paths:
                    bar.set_postfix_str(f"{size}² {label} round {round_ + 1}")
                    session = session_of(label)
                    if args.one_session:  # a fresh session's first run grows its arena: measured, not timed
                        with PeakMemory(torch.device("cpu")) as peak:
                            session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
                        peaks[label].append(peak.peak)
                    start = time.perf_counter()
                    for _ in range(cycle[label]):  # plan_every=k: one planning call, k - 1 reusing
                        session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
                    times[label].append((time.perf_counter() - start) / cycle[label])
                    session_of.release(label)
                    bar.update(1)
            result["sizes"].append({"size": size, "batch": batch, "variants": {
                k: {**exports[k], "times": times[k], "median_s": statistics.median(times[k]),
                    "peak_bytes": peaks[k]} for k in paths}})
            session_of.close()
            if not args.keep:
                for f in workdir.glob(f"{size}_*"):
                    f.unlink()
            with open(args.json, "w") as f:  # after every size: a later size running out of memory
                json.dump(result, f, indent=2)  # does not lose the earlier ones
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    for entry in result["sizes"]:
        v = entry["variants"]
        base = v["baseline"]["median_s"] if "baseline" in v else None
        how = "unoptimised" if args.no_optimize else "ORT transformer optimizer (cpu)"
        print(f"\nONNX Runtime {ort.__version__} CPU EP, {args.model} {entry['size']}x{entry['size']}, "
              f"batch {entry['batch']}, fp32, fused MultiHeadAttention + {how}, median of {args.repeats}")
        print("| variant | median s | vs baseline | peak mem / call (first run) | parity max abs | sites |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, row in v.items():
            ratio = f"{base / row['median_s']:.2f}x" if base else "-"
            parity = "-" if row["parity_max_abs"] is None else f"{row['parity_max_abs']:.1e}"
            print(
                f"| {label} | {row['median_s']:.3f} | {ratio} | "
                f"{statistics.median(row['peak_bytes']) / 2**30:.2f} GB | {parity} | {row['sites'] or '-'} |"
            )
        if base and "oracle" in v and base > v["oracle"]["median_s"]:
            bound = base - v["oracle"]["median_s"]
            for label in (k for k in v if k not in ("baseline", "oracle") and "-static" not in k):
                print(
                    f"{label}: keeps {(base - v[label]['median_s']) / bound:.0%} of the oracle's time saving"
                )
        for label in v:
            name, _, rest = label.partition(" ")
            twin = f"{name}-static {rest}".strip()
            if twin in v and "-static" not in name:
                cost = v[label]["median_s"] / v[twin]["median_s"] - 1
                print(f"{label}: the any-size file takes {cost:+.1%} per call vs the --static file")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
