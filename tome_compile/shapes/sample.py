"""Sampling from the shapes model with classifier-free guidance (DDIM), any U-Net callable.

``unet`` may be the plain U-Net, a ``torch.compile``d one (with ``tome_backend``) or a
``ToMeSession``: anything with the diffusers call signature. Each picture's starting noise comes
from its own seed, so the same (prompt, seed) pair is comparable across methods.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tome_compile.config import ToMeConfig
from tome_compile.shapes.model import ShapesModel

__all__ = ["DEFAULT_GUIDANCE", "DEFAULT_STEPS", "TODO_ROW", "compile_unet", "generate", "write_atomically"]

# Chosen on held-out seeds (500-503, every prompt; not the demo's or the benchmark's seeds): with
# the shipped weights, probe accuracy 94% at 12 DDIM steps / guidance 2.5, 76% at 20 steps /
# guidance 3. More steps make this small model add spurious detail at low noise levels.
DEFAULT_STEPS = 12
DEFAULT_GUIDANCE = 2.5
# The row of ToDo at its defaults (keys and values of the token grid downsampled per axis; no
# ratio), in the demo and the quality benchmark: named after the factor the backend runs with.
TODO_ROW = f"todo x{ToMeConfig(method='todo').downsample_factor}"


@torch.no_grad()
def generate(model: ShapesModel, prompts: list[str], seeds: list[int], *, steps: int = DEFAULT_STEPS,
             guidance_scale: float = DEFAULT_GUIDANCE, unet: Callable[..., Any] | None = None,
             size: int = 32) -> torch.Tensor:
    """``[N, 3, size, size]`` images in ``[0, 1]`` (the model was trained at 32); the batch is
    ``[uncond x N; cond x N]`` per step."""
    from diffusers import DDIMScheduler

    from tome_compile.state import generation as tome_generation

    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds; give one seed per prompt")
    unet = model.unet if unet is None else unet
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2",
                              clip_sample=True)
    scheduler.set_timesteps(steps)
    n = len(prompts)
    device = model.text.position.device  # the noise is drawn on the CPU from each seed, then moved there
    x = torch.cat([torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(s)) for s in seeds])
    x = x.to(device)
    cond = model.text.encode(prompts)
    uncond = model.text.encode([""] * n)
    ehs = torch.cat([uncond, cond])
    # one generation, its batches [uncond; cond]: the loop marked as the README tells users to mark theirs
    with tome_generation(guidance="cfg"):
        for t in scheduler.timesteps:
            eps = unet(torch.cat([x, x]), t, encoder_hidden_states=ehs).sample
            eps_uncond, eps_cond = eps.chunk(2)
            eps = eps_uncond + guidance_scale * (eps_cond - eps_uncond)
            x = scheduler.step(eps, t, x).prev_sample
    return ((x.clamp(-1, 1) + 1) / 2).float().cpu()


def compile_unet(unet: torch.nn.Module, method: str, ratio: float, compiler: str, backend: Any = None) -> Any:
    """The U-Net as ``tome-demo`` and the quality benchmark run it: ``method="plain"`` through
    ``compiler`` alone (``"eager"``: the module itself), ``"tome"`` / ``"importance"`` through
    ``backend``, default ``tome_backend(ratio, seed=0, method=method, compiler=compiler)``."""
    from tome_compile import tome_backend

    if method == "plain":
        return unet if compiler == "eager" else torch.compile(unet, backend=compiler, dynamic=False)
    if backend is None:
        backend = tome_backend(ratio, seed=0, method=method, compiler=compiler)
    return torch.compile(unet, dynamic=False, backend=backend)


def write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through a temporary file in the same folder, then rename: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
