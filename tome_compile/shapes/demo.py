"""``tome-demo``: pictures from the project's own model — plain, ToMe, importance-based merging and
ToDo (keys and values downsampled).

Generates a grid (rows = method, columns = prompt/seed) with classifier-free guidance, each method
through ``torch.compile(unet, backend=tome_backend(...))`` (plain: inductor), and prints a table:
seconds per image and speed-up, PSNR and SSIM of each merged picture against the plain one with
the same seed (fidelity to the unmerged model), and probe-classifier accuracy. JSON beside the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tome_compile.arguments import image_size, parse_command_line, positive_int
from tome_compile.errors import ToMeError
from tome_compile.shapes.grid import labelled_grid
from tome_compile.shapes.sample import (
    DEFAULT_GUIDANCE,
    DEFAULT_STEPS,
    TODO_ROW,
    compile_unet,
    write_atomically,
)
from tome_compile.targets import load_target

__all__ = ["main"]

DEFAULT_PROMPTS = [
    "red circle",
    "blue square",
    "green triangle",
    "yellow cross",
    "magenta ring",
    "cyan circle",
]
EPILOG = """examples:
  tome-demo                                   # shipped model, ratio 0.5, 6 prompts x 1 seed, eager
  tome-demo --compiler inductor --seeds 2     # the compiled speed-up (cold compiles: minutes)
  tome-demo --ratio 0.7 --steps 30 --out demo_0.7.png
  tome-demo --prompts "red ring" "blue cross" --seeds 4 --compiler eager
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tome-demo", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=None,
        help="a shapes-model folder, a local diffusers pipeline folder "
        "(model_index.json) or U-Net folder (default: the shipped shapes model)",
    )
    parser.add_argument("--size", type=image_size, default=None,
                        help="picture height and width for a diffusers pipeline (default: its own)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"denoising steps (default: {DEFAULT_STEPS} for the shapes model, 25 for a pipeline)",
    )
    parser.add_argument(
        "--guidance-scale",
        "--guidance",
        dest="guidance_scale",
        type=float,
        default=None,
        help=f"CFG scale (default: {DEFAULT_GUIDANCE} for the shapes model, 7.5 for a pipeline)",
    )
    parser.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    parser.add_argument("--seeds", type=positive_int, default=1, help="seeds per prompt (default 1)")
    parser.add_argument(
        "--compiler",
        default="eager",
        help="inner compiler of torch.compile(unet, backend=tome_backend(...)): eager (default: "
        "a first run in about 30 s) or inductor (the compiled speed; about 3 minutes of "
        "cold compiles on 2 cores, about 1 minute from inductor's cache)",
    )
    parser.add_argument("--out", default="tome_demo.png")
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args
    try:
        return _run(args)
    except (ToMeError, ValueError) as e:
        print(f"tome-demo: error: {e}", file=sys.stderr)
        return 2


def _output_path(text: str) -> Path:
    """``--out``: a picture path, or a folder (existing, or ending in a separator) that gets
    ``tome_demo.png``; the JSON goes beside the picture."""
    from PIL import Image

    out = Path(text)
    if out.is_dir() or text.endswith(("/", os.sep)):
        out.mkdir(parents=True, exist_ok=True)
        return out / "tome_demo.png"
    if out.suffix.lower() not in Image.registered_extensions():
        raise ValueError(f"--out {text!r} is neither a folder nor a picture path; give a folder (results/) "
                         "or a file with a picture suffix such as .png")
    if not out.parent.is_dir():
        raise ValueError(f"--out {text!r}: folder {str(out.parent)!r} does not exist; create it first")
    return out


def _row_label(row: dict[str, Any]) -> list[str]:
    """The row's method and the table's key figures, drawn beside the row."""
    lines = [row["method"], f"{row['speedup']:.2f}x speed" if row["psnr_db"] is not None
             else f"{row['seconds_per_image']:.3f} s/image"]
    if row["psnr_db"] is not None:
        lines.append(f"{row['psnr_db']:.1f} dB PSNR")
    if row["probe_accuracy"] is not None:
        lines.append(f"probe {row['probe_accuracy']:.0%}")
    return lines


def ran_as_another_method(backends: dict[str, Any]) -> dict[str, str]:
    """The rows (name -> the label they get instead) whose backend never ran its method: an
    importance backend none of whose calls had a guidance map (every call fell back to ToMe
    plans), a backend that rewrote no graph (its pictures are the plain model's)."""
    wrong = {}
    for name, backend in backends.items():
        if not any(report.modified for report in backend.reports):
            wrong[name] = f"{name} (rewrote nothing: plain)"
        elif backend.config.method == "importance" and not backend.driver.calls_by_kind["importance"]:
            wrong[name] = f"{name} (ran as tome)"
    return wrong


def _run(args: argparse.Namespace) -> int:
    from PIL import Image
    from tqdm import tqdm

    from tome_compile import ToMeConfig, tome_backend
    from tome_compile.shapes.data import tokenize
    from tome_compile.shapes.metrics import PSNR_CAP_DB, psnr, ssim
    from tome_compile.shapes.probe import load_probe

    ToMeConfig(ratio=args.ratio, method="importance")  # validates the ratio for both methods
    out = _output_path(args.out)  # (--steps, --seeds: positive_int refused a number below 1)
    target = load_target(args.model, args.size)
    if args.steps is None:
        args.steps = DEFAULT_STEPS if target.shapes_prompts else 25
    if args.guidance_scale is None:
        args.guidance_scale = DEFAULT_GUIDANCE if target.shapes_prompts else 7.5
    if target.shapes_prompts:
        for p in args.prompts:
            tokenize(p)  # clear error for an unknown word
    prompts = [p for p in args.prompts for _ in range(args.seeds)]
    seeds = [s for _ in args.prompts for s in range(args.seeds)]
    backends = {f"{m} {args.ratio}": tome_backend(args.ratio, seed=0, method=m, compiler=args.compiler)
                for m in ("tome", "importance")}
    backends[TODO_ROW] = tome_backend(seed=0, method="todo", compiler=args.compiler)  # K/V 2x, no ratio
    methods: dict[str, Any] = {
        "plain": compile_unet(target.unet, "plain", 0.0, args.compiler),
        **{name: compile_unet(target.unet, b.config.method, args.ratio, args.compiler, backend=b)
           for name, b in backends.items()},
    }
    images: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    warmup: dict[str, float] = {}  # compile (cold or from the cache) + 2 steps
    with tqdm(total=2 * len(methods), desc="tome-demo", unit="run", file=sys.stderr) as bar:
        for name, compiled in methods.items():
            bar.set_postfix_str(f"{name}: compile + warm-up")
            start = time.perf_counter()
            # same shapes: no recompile
            target.sample(compiled, prompts, seeds, min(2, args.steps), args.guidance_scale)
            warmup[name] = time.perf_counter() - start
            bar.update(1)
            bar.set_postfix_str(f"{name}: {len(prompts)} pictures")
            start = time.perf_counter()
            images[name] = target.sample(compiled, prompts, seeds, args.steps, args.guidance_scale)
            seconds[name] = (time.perf_counter() - start) / len(prompts)
            bar.update(1)
    for name, label in ran_as_another_method(backends).items():  # never label a fallback as the method
        images[label] = images.pop(name)
        seconds[label] = seconds[name]
        warmup[label] = warmup[name]
    plain = images["plain"]
    probe = load_probe() if target.shapes_prompts else None
    rows = []
    for name, imgs in images.items():
        rows.append({
            "method": name, "seconds_per_image": seconds[name], "speedup": seconds["plain"] / seconds[name],
            "psnr_db": None if name == "plain" else float(psnr(imgs, plain).clamp(max=PSNR_CAP_DB).mean()),
            "ssim": None if name == "plain" else float(ssim(imgs, plain).mean()),
            "probe_accuracy": None if probe is None else
            sum(p == q for p, q in zip(probe.predict(imgs), prompts, strict=True)) / len(prompts),
            "compile_and_warmup_s": warmup[name],
        })
    picture = labelled_grid([(_row_label(r), images[r["method"]]) for r in rows],
                            [[p, f"seed {s}"] for p, s in zip(prompts, seeds, strict=True)],
                            scale=4 if plain.shape[-1] <= 64 else 1)  # 32x32 pictures: 4x larger
    write_atomically(
        out, lambda path: picture.save(path, format=Image.registered_extensions()[out.suffix.lower()])
    )
    meta = {"model": target.name, "prompts": prompts, "seeds": seeds, "steps": args.steps,
            "guidance_scale": args.guidance_scale, "compiler": args.compiler, "rows": list(images),
            "results": rows}
    write_atomically(out.with_suffix(".json"), lambda path: path.write_text(json.dumps(meta, indent=1)))
    print(f"{len(prompts)} pictures per method, {args.steps} steps, guidance scale {args.guidance_scale}; "
          "PSNR/SSIM = fidelity to the plain model with the same seed")
    print("| method | s / image | speed-up | PSNR vs plain | SSIM vs plain | probe accuracy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        fid = ("-", "-") if r["psnr_db"] is None else (f"{r['psnr_db']:.1f} dB", f"{r['ssim']:.3f}")
        accuracy = "n/a" if r["probe_accuracy"] is None else f"{r['probe_accuracy']:.0%}"
        print(f"| {r['method']} | {r['seconds_per_image']:.3f} | {r['speedup']:.2f}x | {fid[0]} | {fid[1]} | "
              f"{accuracy} |")
    if args.compiler == "eager":
        print("inner compiler eager: the rewritten graph runs op by op, so the speed-up is eager's; "
              "tome-demo --compiler inductor gives the compiled one (cold compiles take minutes)")
    print(f"compile + 2 warm-up steps ({args.compiler}): "
          + ", ".join(f"{r['method']} {r['compile_and_warmup_s']:.1f} s" for r in rows))
    print(f"wrote {out} (rows: {', '.join(images)}) and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
