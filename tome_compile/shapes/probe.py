"""A small probe classifier (shape and colour) that scores whether a picture matches its prompt.

``python -m tome_compile.shapes.probe --out DIR`` trains it on rendered pictures (a few minutes
on CPU) and reports held-out accuracy; ``load_probe(DIR)`` loads it. Its penultimate features
also serve as a feature space for distances between pictures (never called FID).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tome_compile.shapes.data import COLOURS, SHAPES, render_batch

__all__ = ["Probe", "load_probe", "main"]


class Probe(torch.nn.Module):
    """``[B, 3, 32, 32]`` in ``[-1, 1]`` -> (shape logits ``[B, 5]``, colour logits ``[B, 6]``)."""

    def __init__(self) -> None:
        super().__init__()
        def block(cin: int, cout: int) -> torch.nn.Sequential:
            return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.GroupNorm(8, cout),
                                       torch.nn.SiLU(), torch.nn.MaxPool2d(2))
        self.features = torch.nn.Sequential(block(3, 32), block(32, 64), block(64, 64),
                                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.shape_head = torch.nn.Linear(64, len(SHAPES))
        self.colour_head = torch.nn.Linear(64, len(COLOURS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.shape_head(f), self.colour_head(f)

    @torch.no_grad()
    def embed(self, images01: torch.Tensor) -> torch.Tensor:
        """Penultimate features ``[B, 64]`` of pictures in ``[0, 1]`` (for feature distances)."""
        return self.features(images01 * 2 - 1)

    @torch.no_grad()
    def predict(self, images01: torch.Tensor) -> list[str]:
        """Prompts predicted for ``[B, 3, 32, 32]`` pictures in ``[0, 1]``."""
        s, c = self(images01 * 2 - 1)
        return [
            f"{list(COLOURS)[ci]} {SHAPES[si]}"
            for si, ci in zip(s.argmax(1).tolist(), c.argmax(1).tolist(), strict=True)
        ]


def _labels(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    words = [p.split() for p in prompts]
    return (torch.tensor([SHAPES.index(w[1]) for w in words]),
            torch.tensor([list(COLOURS).index(w[0]) for w in words]))


def load_probe(folder: str | Path | None = None) -> Probe:
    """The probe in ``folder``; the one shipped with the package when ``None`` (no network)."""
    from safetensors.torch import load_file

    if folder is None:
        from tome_compile.shapes.model import SHIPPED_WEIGHTS

        folder = SHIPPED_WEIGHTS
    probe = Probe()
    probe.load_state_dict(load_file(str(Path(folder) / "probe.safetensors")))
    return probe.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.shapes.probe", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    torch.manual_seed(args.seed)
    probe = Probe()
    opt = torch.optim.AdamW(probe.parameters(), lr=2e-3, weight_decay=1e-4)
    start = time.perf_counter()
    offset = 10_000_000  # seeds disjoint from the diffusion model's training pictures
    for step in range(args.steps):
        images, prompts = render_batch(range(offset + step * args.batch, offset + (step + 1) * args.batch))
        x = torch.from_numpy(images)
        x = x + 0.05 * torch.randn_like(x)  # generated pictures are a little noisy
        ys, yc = _labels(prompts)
        s, c = probe(x)
        loss = torch.nn.functional.cross_entropy(s, ys) + torch.nn.functional.cross_entropy(c, yc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 250 == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    probe.eval()
    images, prompts = render_batch(range(20_000_000, 20_002_000))  # held out
    predicted = probe.predict((torch.from_numpy(images) + 1) / 2)
    accuracy = sum(p == q for p, q in zip(predicted, prompts, strict=True)) / len(prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in probe.state_dict().items()}, str(out / "probe.safetensors"))
    (out / "probe_log.json").write_text(json.dumps(
        {"settings": vars(args), "heldout_accuracy": accuracy, "heldout_images": len(prompts),
         "seconds": round(time.perf_counter() - start, 1)}, indent=1))
    print(f"held-out accuracy (shape and colour both right) {accuracy:.3f}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
