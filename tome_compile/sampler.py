"""The random numbers of the merge, drawn outside the graph or hashed inside it.

Drawn (``PartitionSampler``): tomesd draws ``randint(sx*sy, (h//sy, w//sx, 1))`` per block call
from a generator it forks off the global RNG; inside a compiled graph that would either break
the graph or consume the sampler's random numbers. Here the caller-side wrapper draws the same
numbers, in the same order (one draw per rewritten block, in execution order), from a generator
of its own, and feeds them to the graph as the ``tome_partition`` input (and importance merging's
destination keys as ``tome_dst_key``).

Hashed (``hashed_partition``, ``hashed_keys``): the deployment form of the same draws, computed in
the exported graph from a ``tome_seed`` input and the timestep, so that a plain three-input client
runs the file as is.
"""

from __future__ import annotations

import torch

__all__ = ["PartitionSampler", "block_cells", "hashed_block_cells", "hashed_counter", "hashed_keys",
           "hashed_partition"]


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


# --- In-graph randomness for deployment (ONNX): a counter-based hash, no Random* op -------------
# Values stay below 2**31 so every product fits int64 (no overflow in any backend); only integer
# Mul/Add/Mod/Div, which every ONNX Runtime provider has for int64.
_HASH_PRIME = 2147483647  # 2**31 - 1
_HASH_ROUNDS = ((1103515245, 12345), (48271, 2891336453 % _HASH_PRIME), (69621, 7))


def _hash_int(x: torch.Tensor) -> torch.Tensor:
    """Three rounds of an affine step, a squaring and a 16-bit rotation, all mod 2**31 - 1 (affine
    steps alone compose to one affine map: consecutive counters would give a progression)."""
    for mul, add in _HASH_ROUNDS:
        x = (x * mul + add) % _HASH_PRIME
        x = (x * x + x // 65536) % _HASH_PRIME  # squaring: the non-linear step
        x = ((x % 65536) * 32768 + x // 65536) % _HASH_PRIME
    return x


def _hash_base(seed: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """``[1]`` int64 from the seed and the step's timestep (its first element; x1000, rounded, so
    fractional timesteps differ too)."""
    t = (timestep.reshape(-1)[:1].to(torch.float32) * 1000.0).round().to(torch.int64) % _HASH_PRIME
    s = seed.reshape(-1)[:1].to(torch.int64) % _HASH_PRIME
    return _hash_int(_hash_int(s) + t)


def hashed_counter(seed: torch.Tensor, timestep: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` int64 in ``[0, 2**31 - 1)``: counter ``i`` hashed with ``(seed, timestep)``.
    Deterministic for a given (seed, timestep), different across steps and across positions."""
    return _hashed(seed, timestep, torch.arange(n, device=timestep.device, dtype=torch.int64))


def _hashed(seed: torch.Tensor, timestep: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Each int64 ``counter`` hashed with ``(seed, timestep)``."""
    return _hash_int(_hash_base(seed, timestep) + counter)


def _choices(hashed: torch.Tensor, choices: int) -> torch.Tensor:
    """Hashed counters -> destination choices in ``[0, choices)`` (the hash's high bits)."""
    return (hashed // 1024) % choices


def hashed_partition(seed: torch.Tensor, timestep: torch.Tensor, n: int, choices: int) -> torch.Tensor:
    """A destination partition drawn in the graph: ``[n]`` int64 in ``[0, choices)`` (the layout
    of a drawn ``tome_partition``: every random block's cells, concatenated)."""
    return _choices(hashed_counter(seed, timestep, n), choices)


def _zero_after(metric: torch.Tensor) -> torch.Tensor:
    """0 (int64, 0-d) read off ``metric``: the argmax of its first element. ONNX Runtime's default
    order runs a node as soon as its inputs are ready, so a block's cells computed from the graph's
    inputs alone are made at the start of a call and held until the block runs (through the
    U-Net's peak); this 0 makes them wait for the block."""
    return metric.reshape(-1).narrow(0, 0, 1).argmax()


def block_cells(partition: torch.Tensor, offset: int, cells: int, metric: torch.Tensor) -> torch.Tensor:
    """A block's ``cells`` of the drawn partition, from ``offset``, made when the block runs
    (``metric``: the block's input; see :func:`_zero_after`)."""
    return torch.narrow(partition, 0, offset, cells) + _zero_after(metric)


def hashed_block_cells(seed: torch.Tensor, timestep: torch.Tensor, offset: int, cells: int, choices: int,
                       metric: torch.Tensor) -> torch.Tensor:
    """:func:`block_cells` of :func:`hashed_partition`: the same numbers, only this block's counters
    hashed, when the block runs."""
    counter = torch.arange(offset, offset + cells, device=timestep.device, dtype=torch.int64)
    return _choices(_hashed(seed, timestep, counter + _zero_after(metric)), choices)


def hashed_keys(seed: torch.Tensor, timestep: torch.Tensor, like: torch.Tensor, m: int) -> torch.Tensor:
    """Importance's destination keys drawn in the graph: ``[P, m]`` float32 in ``[0, 1)``, the
    same keys for every CFG pair (``P = like.shape[0]``)."""
    keys = (hashed_counter(seed, timestep, m) // 128).to(torch.float32) * (1.0 / 2 ** 24)
    return keys.unsqueeze(0).expand(like.shape[0], m)
