"""Destination partitions drawn outside the graph, from a dedicated generator.

tomesd draws ``randint(sx*sy, (h//sy, w//sx, 1))`` per block call from a generator it forks off
the global RNG; inside a compiled graph that would either break the graph or consume the
sampler's random numbers. Here the caller-side wrapper draws the same numbers, in the same order
(one draw per rewritten block, in execution order), from a generator of its own, and feeds them
to the graph as the ``tome_partition`` input.
"""

from __future__ import annotations

import torch

__all__ = ["PartitionSampler"]


class PartitionSampler:
    """Draws destination choices; the global RNG state is never read nor advanced.

    Args:
        seed: seeds one generator per device (the same seed on each); ``None`` seeds from the OS.
        generator: use this generator instead (its device decides where the draw happens).
    """

    def __init__(self, seed: int | None = None, generator: torch.Generator | None = None) -> None:
        self.seed = seed
        self._given = generator
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if self._given is not None:
            return self._given
        device = torch.device(device)
        if device not in self._generators:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self._generators[device] = g
        return self._generators[device]

    def reseed(self, seed: int | None) -> None:
        """Start the sequence again (from ``seed``)."""
        self.seed = seed
        self._generators.clear()

    def draw(self, cells: list[tuple[int, int]], choices: int, device: torch.device) -> torch.Tensor:
        """``[sum(h*w for h, w in cells)]`` int64 in ``[0, choices)``, drawn per block in order."""
        g = self.generator(device)
        parts = [torch.randint(choices, (ch, cw, 1), generator=g, device=g.device).reshape(-1)
                 for ch, cw in cells]
        out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=g.device)
        return out.to(device, non_blocking=True)

    def draw_keys(self, pairs: int, total: int, device: torch.device) -> torch.Tensor:
        """``[pairs, total]`` uniform keys of importance merging's destination draw: one draw, the
        same keys for every image of the batch (each applies them to its own pool), so an image's
        destinations do not depend on its position in the batch or on the batch size — what lets
        a server batch requests without changing a picture. The backend and ``ToMeSession`` both
        draw through here, in the same order, so the compiled and ONNX paths see the same numbers."""
        g = self.generator(device)
        keys = torch.rand(1, total, generator=g, device=g.device).expand(pairs, total)
        return keys.to(device, non_blocking=True)
