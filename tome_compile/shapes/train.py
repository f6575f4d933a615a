"""Train the shapes model on CPU: ``python -m tome_compile.shapes.train --minutes 110 --out DIR``.

DDPM noise prediction (squared-cosine schedule, 1000 steps) on freshly rendered pictures (each
batch its own seeds, so no picture repeats), 10% of prompts dropped to the null prompt for
classifier-free guidance, AdamW with a short warm-up and a cosine decay over the run's wall-clock
budget. Writes the weights (``model.safetensors``: the final weights, which are what ships), the
settings, the wall time and the loss curve to ``--out`` (``train_log.json``); the optimizer state
and, with ``--ema``, an exponential moving average of the weights go to
``--out/train_state.pt`` (not shipped) so that ``--resume`` continues exactly where a run stopped.
(The shipped run tracked an EMA with decay 0.999; at the end of the cosine decay it was worse than
the final weights on held-out seeds, so the final weights ship and the EMA is off by default.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.shapes.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=110.0, help="wall-clock budget")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr-fraction", type=float, default=0.05,
                        help="the cosine decay ends at lr x this at the end of --minutes")
    parser.add_argument("--ema", type=float, default=0.0,
                        help="also track an EMA of the weights with this decay per step (0 = off)")
    parser.add_argument("--p-uncond", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    from diffusers import DDPMScheduler

    from tome_compile.shapes.data import VOCAB, render_batch, tokenize
    from tome_compile.shapes.model import build_model, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    log_path = out / "train_log.json"
    log = {"settings": vars(args), "steps": 0, "seconds": 0.0, "loss": [], "images_seen": 0}
    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    state_path = out / "train_state.pt"
    state: dict = {}
    if args.resume and log_path.is_file():
        model.load_state_dict(load_model(out).state_dict())
        if state_path.is_file():
            state = torch.load(state_path, weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
        log = json.loads(log_path.read_text())
        log.setdefault("runs", []).append(dict(vars(args)))
    else:
        log["runs"] = [dict(vars(args))]
    ema = None
    if args.ema:  # starts from the saved average when resuming one, else from the current weights
        ema = build_model(args.seed).requires_grad_(False)
        ema.load_state_dict(state.get("ema", model.state_dict()))
    model.train()
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    null = torch.tensor([VOCAB.index("<null>")] * 2)
    g = torch.Generator().manual_seed(args.seed + log["steps"])
    start, step, window = time.perf_counter(), log["steps"], []
    log_start, had_state = step, bool(state)
    previous_seconds = float(log["seconds"])
    budget = args.minutes * 60
    while step < args.max_steps and time.perf_counter() - start < budget:
        seeds = range(step * args.batch, (step + 1) * args.batch)
        images, prompts = render_batch(seeds, 32)
        x0 = torch.from_numpy(images)
        ids = torch.tensor([tokenize(p) for p in prompts])
        drop = torch.rand(len(ids), generator=g) < args.p_uncond
        ids[drop] = null
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, 1000, (len(ids),), generator=g)
        xt = scheduler.add_noise(x0, noise, t)
        warm = 1.0 if had_state else min(1.0, (step - log_start + 1) / 200)
        progress = min(1.0, (time.perf_counter() - start) / budget)
        decay = args.min_lr_fraction + (1 - args.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * decay
        pred = model.unet(xt, t, encoder_hidden_states=model.text(ids)).sample
        loss = torch.nn.functional.mse_loss(pred, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if ema is not None:
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - args.ema)
        step += 1
        window.append(loss.item())
        if step % 25 == 0:
            elapsed = previous_seconds + time.perf_counter() - start
            log["loss"].append([step, round(sum(window) / len(window), 5), round(elapsed, 1)])
            window = []
            print(f"step {step} loss {log['loss'][-1][1]:.4f} {elapsed / 60:.1f} min", flush=True)
        if step % 200 == 0 or not math.isfinite(loss.item()):
            _save(model, ema, optimizer, out, log, step, previous_seconds + time.perf_counter() - start, args)
    _save(model, ema, optimizer, out, log, step, previous_seconds + time.perf_counter() - start, args)
    print(f"trained {step} steps in {log['seconds'] / 60:.1f} min; wrote {out}", file=sys.stderr)
    return 0


def _save(model: torch.nn.Module, ema: torch.nn.Module | None, optimizer: torch.optim.Optimizer,
          out: Path, log: dict, step: int, seconds: float, args: argparse.Namespace) -> None:
    from tome_compile.shapes.model import save_model

    log["seconds"], log["steps"], log["images_seen"] = round(seconds, 1), step, step * args.batch
    save_model(model, out, {"train": {"steps": step, "batch": args.batch, "lr": args.lr}})
    state = {"optimizer": optimizer.state_dict()}
    if ema is not None:
        state["ema"] = ema.state_dict()
    tmp = out / "train_state.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(out / "train_state.pt")
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
