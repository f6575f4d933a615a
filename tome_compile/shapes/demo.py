"""``tome-demo``: pictures from the project's own model — plain, ToMe and importance-based merging.

Generates a grid (rows = method, columns = prompt/seed) with classifier-free guidance, each method
through ``torch.compile(unet, backend=tome_backend(...))`` (plain: inductor), and prints a table:
seconds per image and speed-up, PSNR and SSIM of each merged picture against the plain one with
the same seed (fidelity to the unmerged model), and probe-classifier accuracy. JSON beside the PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tome_compile.errors import ToMeError, ToMeModelError

__all__ = ["main"]

DEFAULT_PROMPTS = ["red circle", "blue square", "green triangle", "yellow cross", "magenta ring", "cyan circle"]
EPILOG = """examples:
  tome-demo                                   # shipped model, ratio 0.5, 6 prompts x 2 seeds
  tome-demo --ratio 0.7 --steps 30 --out demo_0.7.png
  tome-demo --prompts "red ring" "blue cross" --seeds 4 --compiler eager
"""


def _weights_folder(model: str | None) -> Path:
    folder = Path(model) if model else Path(__file__).parent / "weights"
    if not (folder / "model.safetensors").is_file():
        raise ToMeModelError(f"{str(folder)!r} has no model.safetensors: give a folder written by "
                             "python -m tome_compile.shapes.train (diffusers pipelines are not supported "
                             "by the demo yet)")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tome-demo", description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a shapes-model folder (default: the shipped one)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    parser.add_argument("--compiler", default="inductor", help="inner compiler: inductor or eager")
    parser.add_argument("--out", default="tome_demo.png")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (ToMeError, ValueError) as e:
        print(f"tome-demo: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import numpy as np
    from PIL import Image
    from tqdm import tqdm

    from tome_compile import ToMeConfig, tome_backend
    from tome_compile.shapes.data import tokenize
    from tome_compile.shapes.metrics import psnr, ssim
    from tome_compile.shapes.model import load_model
    from tome_compile.shapes.probe import load_probe
    from tome_compile.shapes.sample import generate

    for p in args.prompts:
        tokenize(p)  # clear error for an unknown word
    ToMeConfig(ratio=args.ratio, method="importance")  # validates the ratio for both methods
    folder = _weights_folder(args.model)
    model = load_model(folder)
    probe = load_probe()
    prompts = [p for p in args.prompts for _ in range(args.seeds)]
    seeds = [s for _ in args.prompts for s in range(args.seeds)]
    methods: dict[str, Any] = {
        "plain": torch.compile(model.unet, backend=args.compiler, dynamic=False)
        if args.compiler != "eager" else model.unet,
        f"tome {args.ratio}": torch.compile(model.unet, dynamic=False, backend=tome_backend(
            args.ratio, seed=0, compiler=args.compiler)),
        f"importance {args.ratio}": torch.compile(model.unet, dynamic=False, backend=tome_backend(
            args.ratio, seed=0, method="importance", compiler=args.compiler)),
    }
    images: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    with tqdm(total=2 * len(methods), desc="tome-demo", unit="run", file=sys.stderr) as bar:
        for name, unet in methods.items():
            bar.set_postfix_str(f"{name}: compile + warm-up")
            generate(model, prompts, seeds, steps=2, guidance=args.guidance, unet=unet)  # same shapes: no recompile later
            bar.update(1)
            bar.set_postfix_str(f"{name}: {len(prompts)} pictures")
            start = time.perf_counter()
            images[name] = generate(model, prompts, seeds, steps=args.steps, guidance=args.guidance, unet=unet)
            seconds[name] = (time.perf_counter() - start) / len(prompts)
            bar.update(1)
    plain = images["plain"]
    rows = []
    for name, imgs in images.items():
        predicted = probe.predict(imgs)
        rows.append({
            "method": name, "seconds_per_image": seconds[name], "speedup": seconds["plain"] / seconds[name],
            "psnr_db": None if name == "plain" else float(psnr(imgs, plain).mean()),
            "ssim": None if name == "plain" else float(ssim(imgs, plain).mean()),
            "probe_accuracy": sum(p == q for p, q in zip(predicted, prompts)) / len(prompts),
        })
    grid = np.concatenate([np.concatenate(list((images[n].permute(0, 2, 3, 1).numpy() * 255).astype(np.uint8)), 1)
                           for n in images], 0)
    out = Path(args.out)
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(out)
    meta = {"model": str(folder), "prompts": prompts, "seeds": seeds, "steps": args.steps,
            "guidance": args.guidance, "compiler": args.compiler, "rows": list(images), "results": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    print(f"{len(prompts)} pictures per method, {args.steps} steps, guidance {args.guidance}; "
          "PSNR/SSIM = fidelity to the plain model with the same seed")
    print("| method | s / image | speed-up | PSNR vs plain | SSIM vs plain | probe accuracy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        fid = ("-", "-") if r["psnr_db"] is None else (f"{r['psnr_db']:.1f} dB", f"{r['ssim']:.3f}")
        print(f"| {r['method']} | {r['seconds_per_image']:.3f} | {r['speedup']:.2f}x | {fid[0]} | {fid[1]} | "
              f"{r['probe_accuracy']:.0%} |")
    print(f"wrote {out} (rows: {', '.join(images)}) and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
