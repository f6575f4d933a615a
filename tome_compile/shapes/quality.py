"""Quality benchmark: what token merging costs in fidelity, on the project's own model.

``python -m tome_compile.shapes.quality`` generates a fixed set of pictures (every
colour x shape prompt x ``--seeds`` seeds: 120 pairs by default) with the plain model, and with
random ToMe and importance-based merging at each ratio, each through
``torch.compile(unet, backend=tome_backend(...))``. It prints two tables and writes a JSON file
with every per-picture number:

* fidelity to the plain model with the same seed: PSNR and SSIM (mean and percentile bootstrap
  95% interval over pictures), probe accuracy, and the distance between the probe's features of
  the merged and the plain picture. The "plain, other seeds" row is the noise floor: the same
  prompts with a second seed set, i.e. how far apart two *different* correct pictures are;
* every other variant minus exact (random) ToMe at equal ratio, paired per picture: mean
  difference with its interval and the share of pictures on which the variant is closer to the
  plain picture (ties count 1/2). Variants: ``tome``, ``importance``, and plan reuse —
  ``tome-shared`` (``share_plan``), ``tome-shared-every3`` (+ ``plan_every=3``), ``importance-every2``...

These are fidelity to the unmerged model on our own 32x32 model, not FID or CLIP score.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from tome_compile.arguments import parse_command_line, positive_int
from tome_compile.errors import ToMeError
from tome_compile.shapes.sample import DEFAULT_GUIDANCE, DEFAULT_STEPS, TODO_ROW, write_atomically

__all__ = ["main", "run_quality"]

logger = logging.getLogger(__name__)

NOISE_FLOOR_SEED = 1_000_000  # the second plain seed set starts here
TODO_PAIRED_RATIO = 0.5  # paired against ToMe at its default ratio


def run_quality(model: Any, probe: Any, prompts: list[str], seeds: list[int], *, ratios: list[float],
                methods: tuple[str, ...] = ("tome", "importance"), steps: int = DEFAULT_STEPS,
                guidance_scale: float = DEFAULT_GUIDANCE,
                compiler: str = "inductor", progress: bool = True) -> dict[str, Any]:
    """Generate and score the fixed set; returns per-picture numbers and the summaries."""
    from tqdm import tqdm

    from tome_compile import tome_backend
    from tome_compile.bench import variant_options
    from tome_compile.shapes.metrics import PSNR_CAP_DB, bootstrap_mean, psnr, ssim
    from tome_compile.shapes.sample import compile_unet, generate

    runs: list[tuple[str, str, float]] = [("plain", "plain", 0.0), ("plain, other seeds", "plain", 0.0)]
    runs += [(f"{m} {r}", m, r) for r in ratios for m in methods if m != "todo"]
    if "todo" in methods:  # ToDo takes no ratio: one run, keys and values downsampled 2x per axis
        runs.append((TODO_ROW, "todo", TODO_PAIRED_RATIO))
    images: dict[str, torch.Tensor] = {}
    other_seeds = [NOISE_FLOOR_SEED + s for s in seeds]
    for name, variant, ratio in tqdm(
        runs, desc="quality", unit="method", disable=not progress, file=sys.stderr
    ):
        method = variant.split("-")[0]
        # Each run compiles afresh: Dynamo keeps every compile of the U-Net's forward and, past its
        # recompile limit (8), silently runs the plain model — the later variants would measure nothing.
        torch._dynamo.reset()
        options = {} if method == "todo" else {"ratio": ratio, **variant_options(variant)}
        backend = (None if method == "plain" else
                   tome_backend(seed=0, method=method, compiler=compiler, **options))
        unet = compile_unet(model.unet, method, ratio, compiler, backend=backend)
        images[name] = generate(model, prompts, other_seeds if name == "plain, other seeds" else seeds,
                                steps=steps, guidance_scale=guidance_scale, unet=unet)
        if backend is not None and not any(report.modified for report in backend.reports):
            raise ToMeError(f"{name}: the ToMe backend never rewrote a graph in this run; its pictures would "
                            "be the plain model's")
        if method == "importance" and not backend.driver.calls_by_kind["importance"]:
            raise ToMeError(f"{name}: no call had a guidance map (every call used ToMe plans); its pictures "
                            "would be random ToMe's")
        logger.info("generated %d pictures: %s", len(prompts), name)

    plain = images["plain"]
    plain_features = probe.embed(plain)
    per_image: dict[str, dict[str, list[float]]] = {}
    rows = []
    for name, imgs in images.items():
        predicted = probe.predict(imgs)
        correct = torch.tensor([float(p == q) for p, q in zip(predicted, prompts, strict=True)])
        row: dict[str, Any] = {"method": name, "probe_accuracy": float(correct.mean())}
        if name != "plain":
            p = psnr(imgs, plain).clamp(max=PSNR_CAP_DB)
            s = ssim(imgs, plain)
            f = (probe.embed(imgs) - plain_features).norm(dim=1)
            per_image[name] = {"psnr_db": p.tolist(), "ssim": s.tolist(), "feature_distance": f.tolist(),
                               "probe_correct": correct.tolist()}
            for key, values in (("psnr_db", p), ("ssim", s), ("feature_distance", f)):
                row[key] = bootstrap_mean(values)
        rows.append(row)

    paired = []
    if "tome" in methods:
        pairs = [(f"{v} {r}", v, r) for r in ratios for v in methods if v not in ("tome", "todo")]
        if "todo" in methods and TODO_PAIRED_RATIO in ratios:  # against ToMe at its default ratio
            pairs.append((TODO_ROW, TODO_ROW, TODO_PAIRED_RATIO))
        for name, variant, r in pairs:
            a, b = per_image[name], per_image[f"tome {r}"]
            entry: dict[str, Any] = {"ratio": r, "variant": variant}
            for key in ("psnr_db", "ssim"):
                x, y = (
                    torch.tensor(a[key], dtype=torch.float64),
                    torch.tensor(b[key], dtype=torch.float64),
                )
                entry[f"delta_{key}"] = bootstrap_mean(x - y)
                entry[f"closer_{key}"] = bootstrap_mean((x > y).double() + 0.5 * (x == y).double())
            paired.append(entry)
    return {"pictures": len(prompts), "prompts": prompts, "seeds": seeds, "other_seeds": other_seeds,
            "steps": steps, "guidance_scale": guidance_scale, "compiler": compiler, "ratios": ratios,
            "rows": rows, "paired": paired, "per_image": per_image}


def _ci(v: tuple[float, float, float], fmt: str) -> str:
    return f"{v[0]:{fmt}} [{v[1]:{fmt}}, {v[2]:{fmt}}]"


def format_tables(result: dict[str, Any]) -> str:
    lines = [(f"{result['pictures']} prompt x seed pairs, {result['steps']} DDIM steps, guidance "
             f"scale {result['guidance_scale']}, compiler {result['compiler']}; "
             "mean [bootstrap 95% interval]; "
             "fidelity to the plain model with the same seed"), "",
             "| method | PSNR vs plain (dB) | SSIM vs plain | probe feature distance | probe accuracy |",
             "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r["method"] == "plain":
            lines.append(f"| plain | - | - | - | {r['probe_accuracy']:.1%} |")
            continue
        lines.append(f"| {r['method']} | {_ci(r['psnr_db'], '.2f')} | {_ci(r['ssim'], '.4f')} | "
                     f"{_ci(r['feature_distance'], '.3f')} | {r['probe_accuracy']:.1%} |")
    if result["paired"]:
        lines += [
            "",
            "each variant minus exact random ToMe at equal ratio, paired per picture:",
            "",
            "| variant | ratio | delta PSNR (dB) | delta SSIM | variant closer (PSNR) "
            "| variant closer (SSIM) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for e in result["paired"]:
            lines.append(f"| {e['variant']} | {e['ratio']} | {_ci(e['delta_psnr_db'], '+.2f')} | "
                         f"{_ci(e['delta_ssim'], '+.4f')} | {_ci(e['closer_psnr_db'], '.0%')} | "
                         f"{_ci(e['closer_ssim'], '.0%')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from tome_compile.shapes.data import COLOURS, SHAPES

    parser = argparse.ArgumentParser(prog="python -m tome_compile.shapes.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a shapes-model folder (default: the shipped one)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--variants", nargs="+", default=["tome", "importance"],
                        help="tome, importance, and plan reuse: METHOD[-shared][-everyK] "
                             "(e.g. tome-shared tome-shared-every3), and todo (K/V downsampled 2x, one "
                             "row, no ratio); paired deltas are against tome")
    parser.add_argument("--seeds", type=positive_int, default=4, help="seeds per prompt (30 prompts)")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help="DDIM steps")
    parser.add_argument("--guidance-scale", "--guidance", dest="guidance_scale", type=float,
                        default=DEFAULT_GUIDANCE, help="CFG scale")
    parser.add_argument("--compiler", default="inductor", help="inner compiler: inductor or eager")
    parser.add_argument("--out", default="bench/quality.json", help="JSON with every per-picture number")
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from tome_compile import ToMeConfig
        from tome_compile.bench import variant_options
        from tome_compile.shapes.model import load_model
        from tome_compile.shapes.probe import load_probe

        if "tome" not in args.variants:
            raise ValueError(f"--variants {args.variants}: include tome, the reference of the paired deltas")
        for r in args.ratios:
            for variant in args.variants:
                if variant == "todo":
                    continue
                if variant.split("-")[0] not in ("tome", "importance"):
                    raise ValueError(f"--variants: {variant!r} must be todo or start with tome or importance")
                ToMeConfig(ratio=r, method=variant.split("-")[0], **variant_options(variant))
        if args.seeds < 1:
            raise ValueError(f"--seeds {args.seeds} must be >= 1 (4 gives the default 120 pairs)")
        out = Path(args.out)
        if not out.parent.is_dir():
            raise ValueError(
                f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist; create it first"
            )
        model = load_model(args.model)
        prompts = [f"{c} {s}" for c in COLOURS for s in SHAPES for _ in range(args.seeds)]
        seeds = [k for _ in COLOURS for _ in SHAPES for k in range(args.seeds)]
        result = run_quality(
            model,
            load_probe(),
            prompts,
            seeds,
            ratios=args.ratios,
            methods=tuple(args.variants),
            steps=args.steps,
            guidance_scale=args.guidance_scale,
            compiler=args.compiler,
        )
    except (ToMeError, ValueError) as e:
        print(f"quality: error: {e}", file=sys.stderr)
        return 2
    result["model"] = args.model or "shipped"
    result["command"] = "python -m tome_compile.shapes.quality " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_atomically(out, lambda path: path.write_text(json.dumps(result, indent=1)))
    print(format_tables(result))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
