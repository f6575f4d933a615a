"""Paired fidelity measures between a merged picture and the plain model's picture (same seed)."""

from __future__ import annotations

import torch

__all__ = ["PSNR_CAP_DB", "bootstrap_mean", "psnr", "ssim"]

PSNR_CAP_DB = 100.0  # identical pictures have infinite PSNR; callers that average cap it here


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB of ``[N, C, H, W]`` pictures in ``[0, 1]`` (inf when identical)."""
    mse = ((a.float() - b.float()) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse)


def bootstrap_mean(values: torch.Tensor, *, resamples: int = 5000, level: float = 0.95,
                   seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` and its percentile bootstrap interval: ``(mean, low, high)``.

    Resamples the items (images) with replacement, all resamples in one indexing op; a fixed
    ``seed`` makes the interval reproducible. Paired comparisons pass per-image differences."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    if values.numel() < 2 or not torch.isfinite(values).all():
        raise ValueError(f"bootstrap needs >= 2 finite values, got {values.numel()} "
                         f"({int((~torch.isfinite(values)).sum())} not finite)")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, values.numel(), (resamples, values.numel()), generator=g)
    means = values[idx].mean(1)
    tail = (1 - level) / 2
    low, high = torch.quantile(means, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return float(values.mean()), low, high


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7, sigma: float = 1.5) -> torch.Tensor:
    """Per-image SSIM (Wang et al. 2004; Gaussian window, channels averaged) of pictures in [0, 1].

    A 7x7 window (not the usual 11x11) because the pictures are 32x32."""
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    coords = torch.arange(window, dtype=torch.float32) - (window - 1) / 2
    g = torch.exp(-(coords ** 2) / (2 * sigma ** 2))
    kernel = (g[:, None] * g[None, :]) / g.sum() ** 2
    ch = a.shape[1]
    kernel = kernel.expand(ch, 1, window, window).to(a.device)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, kernel, groups=ch)

    a, b = a.float(), b.float()
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1)
