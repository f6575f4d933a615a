"""Runtime state of importance-based merging: the guidance map of the previous U-Net call.

Wu et al. (2025) rank tokens by the classifier-free-guidance magnitude of the *previous*
denoising step: ``imp = mean_channels(|eps_cond - eps_uncond|)``. A CFG batch's output holds both
halves (``[uncond; cond]``), so the state fills itself from each output and no pipeline change is
needed. A new generation must not reuse the last one's map: the state drops it when the timestep
goes back up, when the latent shape changes, or on :meth:`reset`.
"""

from __future__ import annotations

import torch

__all__ = ["ImportanceState", "importance_map"]


def importance_map(eps: torch.Tensor) -> torch.Tensor:
    """``[2P, C, H, W] -> [P, H, W]``: mean over channels of ``|eps_cond - eps_uncond|``."""
    p = eps.shape[0] // 2
    return (eps[p:] - eps[:p]).abs().float().mean(dim=1)


class ImportanceState:
    """The map to use at the next call, or None (first call of a generation, or no CFG pair)."""

    def __init__(self) -> None:
        self.map: torch.Tensor | None = None
        self.shape: tuple[int, ...] | None = None
        self.timestep: float | None = None
        self.calls = 0

    def reset(self) -> None:
        """Forget the map: the next call falls back to ToMe."""
        self.map = None
        self.timestep = None

    @staticmethod
    def _scalar(timestep: object) -> float | None:
        if isinstance(timestep, torch.Tensor):
            if timestep.numel() == 0:
                return None
            # One scalar read per call (the generation check); a CPU tensor costs no sync.
            return float(timestep.reshape(-1)[0])
        if isinstance(timestep, (int, float)):
            return float(timestep)
        return None

    def current(self, sample_shape: tuple[int, ...], timestep: object) -> torch.Tensor | None:
        """The map for this call; drops a stale one first (new shape, timestep went back up)."""
        t = self._scalar(timestep)
        if self.map is not None and (tuple(sample_shape) != self.shape
                                     or (t is not None and self.timestep is not None and t > self.timestep)):
            self.reset()
        self.shape = tuple(sample_shape)
        self.timestep = t
        return self.map

    def update(self, eps: torch.Tensor) -> None:
        """Fill the map from this call's output (a CFG batch); anything else clears it."""
        self.calls += 1
        if eps.dim() == 4 and eps.shape[0] % 2 == 0 and eps.shape[0] > 0:
            self.map = importance_map(eps.detach())
        else:
            self.map = None
