"""Runtime state carried across U-Net calls: the guidance map of the previous call (importance
merging) and the plans of an earlier call (``plan_every``).

Wu et al. (2025) rank tokens by the classifier-free-guidance magnitude of the *previous*
denoising step: ``imp = mean_channels(|eps_cond - eps_uncond|)``. A CFG batch's output holds both
halves (``[uncond; cond]``), so the state fills itself from each output and no pipeline change is
needed. A new generation must not reuse the last one's map or plans: the state drops them when
the timestep goes back up, when the latent shape changes, or on :meth:`reset`.
"""

from __future__ import annotations

import torch

__all__ = ["ImportanceState", "StepState", "importance_map"]


def importance_map(eps: torch.Tensor, channel_axis: int = 1, channels: int | None = None) -> torch.Tensor:
    """``[2P, C, H, W] -> [P, H, W]``: mean over channels of ``|eps_cond - eps_uncond|``.

    A video output (``[2P, C, F, H, W]``, AnimateDiff; ``[2P, F, C, H, W]`` with
    ``channel_axis=2``, SVD) gives ``[P*F, H, W]``: one map per frame, in the order the U-Net
    folds frames into its batch (``b * F + f``), which is the order of its attention rows.
    ``channels``: use only the first ones (an output of ``[eps; variance]``, PixArt)."""
    p = eps.shape[0] // 2
    if channels is not None:
        eps = eps.narrow(channel_axis, 0, channels)
    diff = (eps[p:] - eps[:p]).abs().float().mean(dim=channel_axis)
    return diff.reshape(-1, *diff.shape[-2:])


class StepState:
    """What one model carries from a U-Net call to the next within a generation: the guidance map
    (importance merging; None on the first call or without a CFG pair) and the plans of an earlier
    call (``plan_every``; None when the next call must plan)."""

    def __init__(self) -> None:
        self.map: torch.Tensor | None = None
        self.shape: tuple[int, ...] | None = None
        self.timestep: float | None = None
        self.calls = 0
        self.plans: tuple[torch.Tensor, torch.Tensor] | None = None
        self.plan_kind: str | None = None
        self.plan_age = 0  # calls that have used ``plans``, the one that made them included
        self.plans_made = 0

    def reset(self) -> None:
        """Forget the map and the plans: the next call falls back to ToMe and plans afresh."""
        self.map = None
        self.timestep = None
        self.plans = None
        self.plan_kind = None
        self.plan_age = 0

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
        """Start a call: drop what a new generation must not see (another shape, the timestep
        went back up); returns the map for this call."""
        t = self._scalar(timestep)
        held = self.map is not None or self.plans is not None
        if held and (tuple(sample_shape) != self.shape
                     or (t is not None and self.timestep is not None and t > self.timestep)):
            self.reset()
        self.shape = tuple(sample_shape)
        self.timestep = t
        return self.map

    def plans_to_reuse(self, kind: str, every: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plans this call reuses, or None: it must plan (none held, they are ``every`` calls
        old, or they are of another kind — importance's first step with a map plans afresh)."""
        if self.plans is None or self.plan_kind != kind or self.plan_age >= every:
            return None
        self.plan_age += 1
        return self.plans

    def keep_plans(self, kind: str, plans: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The plans this call made (its extra outputs)."""
        self.plans, self.plan_kind, self.plan_age = plans, kind, 1
        self.plans_made += 1

    def update(self, eps: torch.Tensor, channel_axis: int = 1, channels: int | None = None) -> None:
        """Fill the map from this call's output (a CFG batch; 5-D: a video's, see
        :func:`importance_map`); anything else clears it."""
        self.calls += 1
        if eps.dim() in (4, 5) and eps.shape[0] % 2 == 0 and eps.shape[0] > 0:
            self.map = importance_map(eps.detach(), channel_axis, channels)
        else:
            self.map = None


# The name this state had before it carried plans too.
ImportanceState = StepState
