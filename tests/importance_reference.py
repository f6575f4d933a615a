"""A straightforward eager reference of importance-based merging, written from the spec
(DESIGN.md "Importance-based merging"): loops over pairs, images and tokens, Python sets."""

from __future__ import annotations

import torch


def reference_merge_unmerge(metric: torch.Tensor, x: torch.Tensor, importance: torch.Tensor,
                            dst_key: torch.Tensor | None, r: int, pool_factor: float = 1.4,
                            dst_fraction: float = 0.25) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Returns (merged tokens of each image, sorted by value; unmerge(merge(x)) ``[B, N, C]``)."""
    b, n, _ = metric.shape
    p = b // 2
    nd = int(n * dst_fraction)
    m = min(max(int((n - r) * pool_factor), nd), n)
    merged_rows: dict[int, torch.Tensor] = {}
    out = torch.empty_like(x)
    imp = importance.reshape(p, n)
    for pair in range(p):
        # 3. the important pool: top M by importance (ties: lower index first)
        order = sorted(range(n), key=lambda t: (-float(imp[pair, t]), t))
        pool = order[:m]
        pool_set = set(pool)
        # 4. destinations from the pool: smallest keys (random), or the most important (fixed)
        if dst_key is None:
            dsts = pool[:nd]
        else:
            ranked = sorted(range(m), key=lambda j: (float(dst_key[pair, j]), j))
            dsts = [pool[j] for j in ranked[:nd]]
        dst_set = set(dsts)
        srcs = [t for t in range(n) if t not in dst_set]
        for image in (pair, pair + p):  # uncond and cond share the partition
            unit = metric[image] / metric[image].norm(dim=-1, keepdim=True)
            best, score = {}, {}
            for s in srcs:
                sims = [float(unit[s] @ unit[d]) for d in sorted(dsts)]
                k = max(range(len(sims)), key=lambda i: (sims[i], -i))
                best[s], score[s] = sorted(dsts)[k], sims[k]
            # 5. every unimportant source first, then the most similar important ones
            ranked_src = sorted(srcs, key=lambda s: (s in pool_set, -score[s], s))
            merged = ranked_src[:min(r, len(srcs))]
            groups = {d: [d] for d in dsts}
            for s in merged:
                groups[best[s]].append(s)
            rows = []
            for s in srcs:
                if s not in set(merged):
                    out[image, s] = x[image, s]
                    rows.append(x[image, s])
            for members in groups.values():
                mean = torch.stack([x[image, t] for t in members]).mean(0)
                rows.append(mean)
                for t in members:
                    out[image, t] = mean
            merged_rows[image] = torch.stack(rows)
    return [merged_rows[i] for i in range(b)], out
