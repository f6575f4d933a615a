"""What one ``tome-serve`` replica runs: the model, one denoiser per served ratio, and batched
denoising loops whose pictures do not depend on what they were batched with.

An image depends only on its own request — alone, or batched with any others:

* **every loop has the same batch**: the requests of a loop are padded to ``batch_size`` images
  (copies of the first; their pictures are dropped). A row's numbers then depend on neither its
  position nor its neighbours (measured on this CPU: bit-identical); a batch of another size would
  change them in the last bits (batch 1 vs 4: 5e-7), enough to flip a near-tied merge;
* **every loop is one generation** (``tome_compile.generation()``): its partitions restart from
  the server's seed, its maps and plans are its own;
* the starting noise of each picture comes from its own seed, and importance merging's random
  keys are drawn once for all images (``PartitionSampler.draw_keys``), not per row.

Nothing here imports Ray: the offline reference of a served picture is ``Engine(spec).render``.
"""

from __future__ import annotations

import copy
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeConfigError, ToMeModelError
from tome_compile.serve.request import Job, Limits, Settings
from tome_compile.state import generation

__all__ = ["Engine", "Rendered", "ServeSpec"]

logger = logging.getLogger("tome_compile.serve")


@dataclass(frozen=True)
class ServeSpec:
    """How a replica serves (``tome-serve``'s options; the Serve application's arguments).

    Args:
        model: ``"shapes"`` (the shipped model), a shapes-model folder or a local diffusers
            pipeline folder (``model_index.json``).
        onnx: serve this ``tome-export`` file through ``ToMeSession`` (its ratio and method; its
            traced size, or every one of ``sizes`` from an any-size file).
        ratio: the merge ratio; requests may ask for it or 0 (the plain model).
        ratios: the served ratios instead (``--ratios 0 0.3 0.5``): one denoiser each, compiled and
            warmed up at start; a request picks one (default: the largest) and is batched only with
            requests of the same ratio and size.
        batch_size: images per denoising loop (requests with equal settings are batched; every
            loop is padded to it). 1 = no batching.
    """

    model: str = "shapes"
    onnx: str | None = None
    method: str = "tome"
    ratio: float = 0.5
    ratios: tuple[float, ...] | None = None
    plan_every: int = 1
    compiler: str = "inductor"
    batch_size: int = 4
    seed: int = 0
    sizes: tuple[int, ...] | None = None  # picture sizes served (default: the model's own)
    device: str = "cpu"  # "cuda" where the replica has a GPU (tome-serve --num-gpus-per-replica)

    def __post_init__(self) -> None:
        self.tome_config(self.ratio)
        if self.ratios is not None:
            if not self.ratios or any(isinstance(r, bool) or not isinstance(r, (int, float))
                                      for r in self.ratios):
                raise ToMeConfigError(f"ratios={self.ratios!r} must be merge ratios, e.g. (0, 0.3, 0.5)")
            for r in self.ratios:
                self.tome_config(float(r))
            if self.onnx is not None:
                raise ToMeConfigError(f"ratios={list(self.ratios)}: an ONNX file serves the ratio it was "
                                      "exported with; export one file per ratio, or serve the model")
        if (
            isinstance(self.batch_size, bool)
            or not isinstance(self.batch_size, int)
            or not 1 <= self.batch_size <= 64
        ):
            raise ToMeConfigError(f"batch_size={self.batch_size!r} must be an int in [1, 64]")
        if self.sizes is not None and (not self.sizes or any(isinstance(s, bool) or not isinstance(s, int)
                                                             or s < 8 or s % 8 for s in self.sizes)):
            raise ToMeConfigError(f"sizes={self.sizes!r} must be picture sizes, multiples of 8")

    def served_ratios(self) -> tuple[float, ...]:
        """The ratios served (0: the plain model): ``ratios``, else 0 and ``ratio``."""
        chosen = self.ratios if self.ratios is not None else (0.0, self.ratio)
        return tuple(sorted({float(r) for r in chosen}))

    def tome_config(self, ratio: float) -> ToMeConfig:
        """The ToMe settings of the denoiser that merges ``ratio`` (validated)."""
        return ToMeConfig(ratio=ratio, method=self.method, plan_every=self.plan_every, seed=self.seed)


@dataclass(frozen=True)
class Rendered:
    """One request's picture and where its time went."""

    png: bytes
    seed: int
    compute_ms: float  # the denoising loop it ran in
    batch: int  # requests in that loop (the rest of the batch was padding)


class Engine:
    """The model and its denoisers; :meth:`render` makes the pictures of a list of jobs."""

    def __init__(self, spec: ServeSpec) -> None:
        from tome_compile.targets import load_target

        self.spec = spec
        self.target = load_target(None if spec.model == "shapes" else spec.model, device=spec.device)
        if spec.onnx is not None:
            self.denoisers, size, method, sizes = self._onnx(Path(spec.onnx))
        else:
            self.denoisers = {ratio: self._compile(ratio) for ratio in spec.served_ratios()}
            size, method = self.target.size, spec.method
            sizes = tuple(self.spec.sizes or (size,))
        self.method = method
        ratios = tuple(sorted(self.denoisers))
        self.limits = Limits(ratios=ratios, default_ratio=max(ratios), sizes=sizes, default_size=size,
                             default_steps=12 if self.target.shapes_prompts else 25,
                             default_guidance_scale=2.5 if self.target.shapes_prompts else 7.5,
                             check_prompt=self._shapes_prompt if self.target.shapes_prompts else None)

    @staticmethod
    def _shapes_prompt(prompt: str) -> None:
        from tome_compile.shapes.data import tokenize

        tokenize(prompt)

    def _compile(self, ratio: float) -> Any:
        """The denoiser of one ratio: ``torch.compile`` with ``tome_backend`` (0: the plain U-Net
        through the same compiler), each on its own copy of the U-Net."""
        from tome_compile.backend import tome_backend
        from tome_compile.shapes.sample import compile_unet

        spec = self.spec
        if ratio == 0:
            return compile_unet(self.target.unet, "plain", 0.0, spec.compiler)
        backend = tome_backend(spec.tome_config(ratio).replace(guidance="cfg"), compiler=spec.compiler)
        return torch.compile(copy.deepcopy(self.target.unet), backend=backend, dynamic=False)

    def _onnx(self, path: Path) -> tuple[dict[float, Any], int, str, tuple[int, ...]]:
        """The file's session, its traced size, method and the sizes served from it: ``sizes`` (or
        the traced size) from an any-size file, each a multiple of what its latent takes; only the
        traced size from a ``--static`` file."""
        from tome_compile.export.session import ToMeSession

        session = ToMeSession(path, seed=self.spec.seed)
        if not session.exported:
            raise ToMeModelError(f"{str(path)!r} is not a tome-export file (no tome_compile metadata)")
        meta = session.meta
        size = int(meta.height or 0)
        sizes = tuple(self.spec.sizes or (size,))
        if not meta.any_size:
            if sizes != (size,):
                raise ToMeConfigError(f"sizes={list(sizes)}: {str(path)!r} was exported for {size} only "
                                      "(tome-export --static); export it without --static to serve several "
                                      "sizes from one file")
        else:
            scale = size // int(meta.latent_hw[0]) if meta.latent_hw else 1  # pixels per latent row
            step = int(meta.latent_multiple) * max(scale, 1)
            if any(s % step for s in sizes):
                raise ToMeConfigError(f"sizes={list(sizes)}: {str(path)!r} takes picture sizes in multiples "
                                      f"of {step} (its U-Net's downsampling); e.g. {size} or {size + step}")
        ratio = float(meta.config.get("ratio", 0.0))
        return {ratio: session}, size, str(meta.config.get("method", "tome")), sizes

    def warm_up(self) -> float:
        """One loop per denoiser at every served size (the compiles): seconds taken."""
        start = time.perf_counter()
        prompt = "red circle" if self.target.shapes_prompts else "a photo"
        for ratio in self.denoisers:
            for size in self.limits.sizes:
                self.render(
                    [
                        Job(
                            prompt=prompt,
                            seed=0,
                            settings=Settings(
                                steps=2, guidance_scale=self.limits.default_guidance_scale, ratio=ratio,
                                size=size,
                            ),
                        )
                    ]
                )
        return time.perf_counter() - start

    def render(self, jobs: Sequence[Job]) -> list[Rendered]:
        """The pictures of ``jobs`` in order: one loop per group of equal settings (at most
        ``batch_size`` jobs each), every loop padded to ``batch_size`` images."""
        out: list[Rendered | None] = [None] * len(jobs)
        groups: dict[Settings, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.settings, []).append(i)
        size = self.spec.batch_size
        for settings, indices in groups.items():
            for start in range(0, len(indices), size):
                chunk = indices[start:start + size]
                began = time.perf_counter()
                pictures = self._loop([jobs[i] for i in chunk], settings)
                ms = (time.perf_counter() - began) * 1000.0
                for i, picture in zip(chunk, pictures, strict=True):
                    out[i] = Rendered(png=_png(picture), seed=jobs[i].seed, compute_ms=ms, batch=len(chunk))
        return [r for r in out if r is not None]

    def _loop(self, jobs: list[Job], settings: Settings) -> torch.Tensor:
        pad = self.spec.batch_size - len(jobs)
        prompts = [j.prompt for j in jobs] + [jobs[0].prompt] * pad
        seeds = [j.seed for j in jobs] + [jobs[0].seed] * pad
        with torch.no_grad(), generation():
            images = self.target.sample(self.denoisers[settings.ratio], prompts, seeds, settings.steps,
                                        settings.guidance_scale, size=settings.size)
        return images[:len(jobs)]


def _png(picture: torch.Tensor) -> bytes:
    """``[3, H, W]`` in ``[0, 1]`` -> PNG bytes (8 bits per channel)."""
    from PIL import Image

    array = (picture.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()
