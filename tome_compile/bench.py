"""Speed and memory benchmark: plain vs ToMe vs the oracle bound, side by side in one run.

    python -m tome_compile.bench                       # SD 1.5 architecture, batch 2, fp32, 512² and 1024²
    python -m tome_compile.bench --sizes 512 --ratio 0.5 --repeats 5 --json bench.json

Variants (each timed once per round, rounds interleaved so machine noise hits all alike):

* ``eager``          the plain U-Net;
* ``tomesd``         tomesd.apply_patch (eager), the existing tool;
* ``inductor``       torch.compile(unet) with inductor;
* ``inductor+tome``  torch.compile(unet, backend=tome_backend(ratio));
* ``inductor+tome-shared``, ``inductor+tome-shared-every2``, ``inductor+tome-every3``, ...: plan
  reuse — ``share_plan=True`` and/or ``plan_every=k``; a round times a whole cycle of ``k`` calls
  (one planning call, ``k - 1`` reusing calls) and reports the mean per call;
* ``oracle``         the same rewritten attentions on N - r tokens with merge/unmerge costing
  nothing (first N - r tokens in, a copy out): the bound ToMe's speed-up can reach.

Prints medians, ratios against ``inductor`` (and ``eager``), peak memory per call, compile times;
then a per-block table: attention at N and N - r tokens against the merge overhead.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tome_compile.arguments import image_size, parse_command_line, positive_int
from tome_compile.backend import ToMeBackend
from tome_compile.config import ToMeConfig, parse_blocks
from tome_compile.errors import ToMeError
from tome_compile.models import example_inputs, is_dit, load_unet, video_layout
from tome_compile.packed import set_packed_grid

__all__ = ["main", "run_benchmark"]

VARIANTS = (
    "eager",
    "tomesd",
    "inductor",
    "inductor+tome",
    "inductor+tome-shared",
    "inductor+tome-shared-every2",
    "inductor+tome-shared-every3",
    "inductor+tome-every2",
    "inductor+tome-every3",
    "inductor+todo",
    "oracle",
)


def variant_options(name: str) -> dict[str, Any]:
    """``inductor+tome[-shared][-everyK]`` -> the ToMeConfig changes it names."""
    parts = name.split("-")[1:]
    options: dict[str, Any] = {}
    for part in parts:
        if part == "shared":
            options["share_plan"] = True
        elif part.startswith("every") and part[5:].isdigit():
            options["plan_every"] = int(part[5:])
        else:
            raise ToMeError(f"unknown variant {name!r}: plan-reuse variants are NAME[-shared][-everyK], "
                            "e.g. tome-shared, tome-shared-every3")
    return options


logger = logging.getLogger("tome_compile.bench")


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator stats, or sampled RSS on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.rss()
            self._stop = threading.Event()
            self._max = self.base
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, self.rss()) - self.base


@dataclass
class VariantResult:
    name: str
    times: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    first_call_s: float = 0.0
    sites: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _variants(unet: torch.nn.Module, names: list[str], config: ToMeConfig
              ) -> tuple[dict[str, Callable[..., Any]], dict[str, ToMeBackend]]:
    out: dict[str, Callable[..., Any]] = {}
    backends: dict[str, ToMeBackend] = {}
    for name in names:
        if name == "eager":
            out[name] = unet
        elif name == "tomesd":
            import tomesd

            if not hasattr(unet, "config") or video_layout(unet) or is_dit(unet):
                raise ToMeError(f"tomesd does not run on a {type(unet).__name__} (video U-Nets: it reads the "
                                "frames as the image size and divides by zero; PixArt: it merges nothing; "
                                "Zero123++: it would merge the reference pass); leave the tomesd variant out")

            patched = copy.deepcopy(unet)
            tomesd.apply_patch(patched, ratio=config.ratio, max_downsample=config.max_downsample,
                               sx=config.sx, sy=config.sy, use_rand=config.use_rand)
            out[name] = patched
        elif name == "inductor":
            out[name] = torch.compile(unet, dynamic=False)
        elif name == "inductor+todo":  # ToDo: K/V downsampled 2x per axis where ToMe would merge
            todo = ToMeConfig(method="todo", max_downsample=config.max_downsample, seed=config.seed)
            backends[name] = ToMeBackend(todo)
            out[name] = torch.compile(unet, backend=backends[name], dynamic=False)
        elif name.startswith("inductor+tome") or name == "oracle":
            variant = config.replace(**variant_options(name)) if name != "oracle" else config
            backends[name] = ToMeBackend(variant, oracle=name == "oracle")
            out[name] = torch.compile(unet, backend=backends[name], dynamic=False)
        else:
            raise ToMeError(f"unknown variant {name!r}; choose from {VARIANTS}")
    return out, backends


def run_size(unet: torch.nn.Module, size: int, args: argparse.Namespace, config: ToMeConfig,
             progress: Any) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.model == "zero123":  # size = one view: 3 x 2 views tiled, plus the condition view
        from tome_compile.multiview import zero123_inputs

        sample, kwargs = zero123_inputs(unet, batch=args.batch, view=size, device=device)
    else:
        inputs = example_inputs(
            unet, batch=args.batch, height=size, width=size, device=device, frames=args.frames
        )
        kwargs = inputs.kwargs()
        sample = kwargs.pop("hidden_states" if inputs.dit else "sample")
        if inputs.grid is not None:  # Flux: its packed latent's grid, as its pipeline gives it
            set_packed_grid(unet, inputs.grid)
    torch._dynamo.reset()
    models, backends = _variants(unet, args.variants, config)
    results = {name: VariantResult(name) for name in models}
    # Every variant compiles the same forward: past Dynamo's recompile limit (8 by default) the
    # later ones would silently run the plain model. Room for all of them, and a check below.
    limit = torch._dynamo.config.patch(recompile_limit=max(8, 2 * len(models) + 2))
    with torch.inference_mode(), limit:
        for name, model in models.items():
            progress.set_postfix_str(f"{size}² {name}: first call (compile)")
            start = time.perf_counter()
            model(sample, **kwargs)
            _sync(device)
            results[name].first_call_s = time.perf_counter() - start
            for _ in range(backends[name].config.plan_every - 1 if name in backends else 0):
                model(sample, **kwargs)  # warm the reusing graph too
            if name in backends and not any(r.modified for r in backends[name].reports):
                raise ToMeError(
                    f"{name}: the ToMe backend rewrote no graph; timing it would time the plain model"
                )
            progress.update(1)
        for round_ in range(args.repeats):
            for name, model in models.items():
                progress.set_postfix_str(f"{size}² {name}: round {round_ + 1}/{args.repeats}")
                gc.collect()
                calls = backends[name].config.plan_every if name in backends else 1  # a whole reuse cycle
                with PeakMemory(device) as peak:
                    start = time.perf_counter()
                    for _ in range(calls):
                        model(sample, **kwargs)
                    _sync(device)
                    elapsed = (time.perf_counter() - start) / calls
                results[name].times.append(elapsed)
                results[name].peak_bytes.append(peak.peak)
                progress.update(1)
    for name, backend in backends.items():
        results[name].sites = len(backend.reports[-1].rewritten) if backend.reports else 0
    del models
    gc.collect()
    return {"size": size, "variants": {k: {**asdict(v), "median_s": v.median} for k, v in results.items()}}


def block_overhead(size: int, args: argparse.Namespace, config: ToMeConfig) -> dict[str, Any]:
    """One 4096-token-class block (SD 1.5 first level: C=320, 8 heads): attention at N and N - r
    against the cost of plan + merge + unmerge, each compiled with inductor."""
    from tome_compile.merge import (
        importance_plan,
        importance_pool_size,
        merge_tokens,
        partition_cells,
        tome_plan,
        unmerge_tokens,
    )

    device = torch.device(args.device)
    h = w = size // 8
    n, c, heads, b = h * w, 320, 8, args.batch
    r = min(int(n * config.ratio), n - partition_cells(h, w, config.sx, config.sy))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, n, c, generator=g).to(device)
    wq = torch.randn(3 * c, c, generator=g).to(device) / c ** 0.5

    def attention(t: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.nn.functional.linear(t, wq).view(b, -1, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)

    def tome_overhead(t: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        slot, weight = tome_plan(t, choice, h, w, config.sx, config.sy, r)
        return unmerge_tokens(merge_tokens(t, slot, weight)[:, : n - r], slot)

    def importance_overhead(t: torch.Tensor, imp: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        slot, weight = importance_plan(t, imp, key, h, w, r, config.pool_factor, config.dst_fraction)
        return unmerge_tokens(merge_tokens(t, slot, weight)[:, : n - r], slot)

    choice = torch.randint(config.sx * config.sy, (partition_cells(h, w, config.sx, config.sy),),
                           generator=g).to(device)
    imp = torch.rand(b // 2, h, w, generator=g).to(device)
    key = torch.rand(b // 2, importance_pool_size(n, r, config.pool_factor, config.dst_fraction),
                     generator=g).to(device)
    attn_c = torch.compile(attention, dynamic=False)
    over_c = torch.compile(tome_overhead, dynamic=False)
    imp_c = torch.compile(importance_overhead, dynamic=False)
    cases = {"attention N": lambda: attn_c(x), "attention N-r": lambda: attn_c(x[:, : n - r]),
             "plan+merge+unmerge": lambda: over_c(x, choice),
             "importance plan+merge+unmerge": lambda: imp_c(x, imp, key)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    with torch.inference_mode():
        for fn in cases.values():
            fn()
        for _ in range(max(args.repeats, 5)):
            for name, fn in cases.items():
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"size": size, "tokens": n, "r": r, "median_s": med,
            "saving_s": med["attention N"] - med["attention N-r"],
            "overhead_share_of_saving": med["plan+merge+unmerge"] / max(
                med["attention N"] - med["attention N-r"], 1e-12)}


def format_tables(result: dict[str, Any]) -> str:
    lines = []
    for entry in result["sizes"]:
        v = entry["variants"]
        base = v.get("inductor", v.get("eager"))
        eager = v.get("eager")
        frames = f", {result['frames']} frames" if result.get("frames") else ""
        shape = (f"{3 * entry['size']}x{2 * entry['size']} (3 x 2 views) + a {entry['size']}² reference view"
                 if result["model"] == "zero123" else f"{entry['size']}x{entry['size']}")
        lines.append(f"\n{result['model']} {shape}{frames}, batch {result['batch']}, "
                     f"{result['dtype']}, ratio {result['ratio']}, {result['device']}, "
                     f"median of {result['repeats']}")
        lines.append(
            "| variant | median s | vs inductor | vs eager | peak mem / call | first call s | sites |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|")
        for name, row in v.items():
            vs_ind = f"{base['median_s'] / row['median_s']:.2f}x" if base else "-"
            vs_eager = f"{eager['median_s'] / row['median_s']:.2f}x" if eager else "-"
            mem = statistics.median(row["peak_bytes"]) / 2 ** 30
            sites = "-" if row["sites"] is None else str(row["sites"])
            lines.append(f"| {name} | {row['median_s']:.3f} | {vs_ind} | {vs_eager} | {mem:.2f} GB | "
                         f"{row['first_call_s']:.1f} | {sites} |")
        if "inductor" in v and "oracle" in v:
            t0, t2 = v["inductor"]["median_s"], v["oracle"]["median_s"]
            bound = t0 - t2
            for name in (k for k in v if k.startswith("inductor+tome")):
                t1 = v[name]["median_s"]
                share = (t0 - t1) / bound if bound > 0 else float("nan")
                lines.append(f"{name}: speed-up {t0 / t1:.3f}x vs oracle {t0 / t2:.3f}x: keeps "
                             f"{share:.0%} of the oracle's time saving")
    if result.get("blocks"):
        lines.append("\nPer block (C=320, 8 heads, inductor), median s:")
        lines.append("| tokens | r | attention N | attention N-r | saving | ToMe plan+merge+unmerge | "
                     "overhead / saving | importance plan+merge+unmerge |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for blk in result["blocks"]:
            m = blk["median_s"]
            lines.append(
                f"| {blk['tokens']} | {blk['r']} | {m['attention N']:.4f} | {m['attention N-r']:.4f} | "
                f"{blk['saving_s']:.4f} | {m['plan+merge+unmerge']:.4f} | "
                f"{blk['overhead_share_of_saving']:.0%} | "
                f"{m.get('importance plan+merge+unmerge', float('nan')):.4f} |"
            )
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    config = _config(args)
    if args.blocks_only:
        result = {"model": args.model, "batch": args.batch, "sizes": [], "blocks": [
            block_overhead(size, args, config) for size in args.sizes]}
        return result
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.model == "zero123":  # Zero123++: its SD 2 U-Net (random weights) in the two-pass wrapper
        from tome_compile.multiview import build_zero123

        unet = build_zero123(load_unet("sd21", dtype=dtype)[0])
        description = "Zero123++ wrapper (reference attention) around the built-in sd21 U-Net, RANDOM weights"
    else:
        unet, description = load_unet(args.model, dtype=dtype)
    unet = unet.to(args.device)
    print(f"model: {description}", flush=True)
    total = len(args.sizes) * len(args.variants) * (args.repeats + 1)
    result: dict[str, Any] = {
        "model": args.model,
        "batch": args.batch,
        "dtype": args.dtype,
        "ratio": args.ratio,
        "device": args.device,
        "repeats": args.repeats,
        "frames": args.frames,
        "config": asdict(config),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "sizes": [],
        "blocks": [],
    }
    with tqdm(total=total, desc="bench", unit="call", file=sys.stderr) as progress:
        for size in args.sizes:
            result["sizes"].append(run_size(unet, size, args, config, progress))
    if not args.no_blocks:
        for size in args.sizes:
            result["blocks"].append(block_overhead(size, args, config))
    return result


def _config(args: argparse.Namespace) -> ToMeConfig:
    return ToMeConfig(
        ratio=args.ratio,
        max_downsample=args.max_downsample,
        seed=0,
        pool_factor=args.pool_factor,
        merge_crossattn=args.merge_crossattn,
        blocks=parse_blocks(args.merge_blocks) if args.merge_blocks else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tome-bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m tome_compile.bench\n"
               "  python -m tome_compile.bench --sizes 512 --variants inductor inductor+tome oracle\n"
               "  python -m tome_compile.bench --model ./my-sd15-pipeline --device cuda --dtype fp16")
    parser.add_argument(
        "--model",
        default="sd15",
        help="sd15 | sd21 | sdxl | animatediff | svd | pixart | sd3 | flux (FLUX.1-dev at full width, 1 + 2 "
        "blocks) | zero123 (the Zero123++ wrapper around sd21: --sizes is one view's size, 320: 960 x 640 "
        "tiled) | a local diffusers folder",
    )
    parser.add_argument("--frames", type=positive_int, default=None,
                        help="video U-Nets: frames per video (16 / 25)")
    parser.add_argument("--merge-blocks", default=None, metavar="LIST",
                        help="ToMeConfig.blocks, e.g. 7-20 (PixArt)")
    parser.add_argument("--merge-crossattn", action="store_true", help="merge cross-attention queries too")
    parser.add_argument("--pool-factor", type=float, default=1.4, help="importance pool factor (PixArt: 1)")
    parser.add_argument("--sizes", type=image_size, nargs="+", default=[512, 1024],
                        help="image sizes (square)")
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--max-downsample", type=positive_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed rounds (median reported)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["eager", "tomesd", "inductor", "inductor+tome", "oracle"],
        choices=VARIANTS,
        help="default: eager tomesd inductor inductor+tome oracle; the plan "
        "reuse variants (inductor+tome-shared[-everyK], -everyK) are opt in",
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="bench.json", help="where to write the raw results")
    parser.add_argument("--no-blocks", action="store_true", help="skip the per-block overhead table")
    parser.add_argument("--blocks-only", action="store_true", help="only the per-block overhead table")
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args
    try:
        _config(args)  # (--sizes: image_size refused a size that is not a multiple of 8)
        result = run_benchmark(args)
    except ToMeError as e:
        print(f"tome-bench: error: {e}", file=sys.stderr)
        return 2
    text = format_tables(result)
    print(text)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
