"""GPU check: export, run on ONNX Runtime's CUDA EP, check parity, time baseline vs ToMe.

    python -m tome_compile.benchmarks.gpu_check --out /tmp/gpu-check      # needs CUDA + onnxruntime-gpu

For fp32 and fp16: exports the SD 1.5 architecture (random weights) at 512² batch 2 twice —
ratio 0 (baseline) and ToMe at ``--ratio`` (``--partition-input``, so the partition is the one
``tome_backend`` draws) — both with fused MultiHeadAttention and ORT's transformer optimizer for
CUDA, creates CUDA EP sessions (``ToMeSession``: IO binding), checks ORT-CUDA against
PyTorch-CUDA on the same inputs and partition, and prints median latencies side by side.
Then the default export (hashed destinations, every image size) once, fp32: the same file run on
the CUDA EP at ``--size`` and at ``--second-size`` (non-square), each against the same file on the
CPU EP (:func:`two_sizes`), with the median time per size.
Exits 2 with one line when there is no CUDA or no CUDA EP, so it is safe to run anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tome_compile.arguments import image_size, parse_command_line, positive_int

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_compile.benchmarks.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check", help="folder for the exported models")
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--size", type=image_size, default=512)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    parser.add_argument("--no-optimize", action="store_true", help="skip ORT's transformer optimizer (cuda)")
    parser.add_argument("--second-size", type=image_size, nargs=2, default=[768, 512], metavar=("H", "W"),
                        help="the other size the any-size file runs (default 768 512)")
    args = parse_command_line(parser, argv)
    if isinstance(args, int):
        return args

    import onnxruntime as ort

    if not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers():
        print("gpu_check: needs CUDA and onnxruntime-gpu (pip install -e '.[gpu]'); "
              f"torch.cuda={torch.cuda.is_available()}, providers={ort.get_available_providers()}",
              file=sys.stderr)
        return 2
    from tome_compile.config import ToMeConfig
    from tome_compile.export import ToMeSession, export_onnx
    from tome_compile.models import example_inputs, load_unet

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype_name in args.dtypes:
        fp16 = dtype_name == "fp16"
        sessions = {}
        for label, ratio in (("baseline", 0.0), (f"tome {args.ratio}", args.ratio)):
            unet, _ = load_unet(args.model)
            path = out / f"{args.model}_{dtype_name}_{'base' if ratio == 0 else 'tome'}.onnx"
            result = export_onnx(unet, path, ToMeConfig(ratio=ratio, seed=0),
                                 batch=args.batch, height=args.size, width=args.size, fp16=fp16, force=True,
                                 check_parity=False, partition_input=True,
                                 optimize=None if args.no_optimize else "cuda")
            session = ToMeSession(result.path, seed=0)
            assert session.provider == "CUDAExecutionProvider", session.provider
            # Parity: ORT CUDA vs the PyTorch model on CUDA, same inputs and partition.
            unet = unet.cuda().to(torch.float16 if fp16 else torch.float32)
            inputs = example_inputs(unet, batch=args.batch, height=args.size, width=args.size,
                                    device="cuda")
            got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
            if ratio == 0:
                with torch.no_grad():
                    ref = unet(**inputs.kwargs()).sample
                parity = float((got.float().cpu() - ref.float().cpu()).abs().max())
            else:
                from tome_compile import tome_backend

                session.reset(0)
                got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
                # Draw on a CPU generator, as the session does, so both see the same partition.
                backend = tome_backend(ratio, compiler="eager", generator=torch.Generator().manual_seed(0))
                compiled = torch.compile(unet, backend=backend, fullgraph=True)
                with torch.no_grad():
                    ref = compiled(**inputs.kwargs()).sample
                parity = float((got.float().cpu() - ref.float().cpu()).abs().max())
            sessions[label] = (session, inputs, parity)
            del unet
            torch.cuda.empty_cache()
        times = {label: [] for label in sessions}
        for _ in range(3):
            for session, inputs, _ in sessions.values():
                session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
        for _ in range(args.repeats):
            for label, (session, inputs, _) in sessions.items():
                start = time.perf_counter()
                session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states)
                times[label].append(time.perf_counter() - start)
        base = statistics.median(times["baseline"])
        for label, (_, _, parity) in sessions.items():
            med = statistics.median(times[label])
            rows.append((dtype_name, label, med, base / med, parity))
    print(f"\nONNX Runtime CUDA EP, {args.model} {args.size}x{args.size}, batch {args.batch}, "
          f"median of {args.repeats} (interleaved)")
    print("| dtype | variant | median s | speed-up | parity max abs vs PyTorch CUDA |")
    print("|---|---|---:|---:|---:|")
    for dtype_name, label, med, speedup, parity in rows:
        print(f"| {dtype_name} | {label} | {med:.4f} | {speedup:.2f}x | {parity:.2e} |")
    unet, _ = load_unet(args.model)
    path = out / f"{args.model}_fp32_any.onnx"
    export_onnx(unet, path, ToMeConfig(ratio=args.ratio, seed=0), batch=args.batch, height=args.size,
                width=args.size, force=True, check_parity=False)
    del unet
    sizes = [(args.size, args.size), tuple(args.second_size)]
    checked = two_sizes(path, args.model, sizes, args.batch, args.repeats)
    print(f"\none any-size file ({path.name}), CUDA EP vs the same file on the CPU EP, batch {args.batch}")
    print("| size | median s (CUDA) | max abs vs CPU EP |")
    print("|---|---:|---:|")
    for (h, w), med, diff in checked:
        print(f"| {h}x{w} | {med:.4f} | {diff:.2e} |")
    finite = all(np.isfinite(r[4]) for r in rows) and all(np.isfinite(d) for *_, d in checked)
    return 0 if finite else 1


def two_sizes(path: Path, model: str, sizes: list[tuple[int, int]], batch: int, repeats: int,
              providers: tuple[str, str] = ("CUDAExecutionProvider", "CPUExecutionProvider"),
              ) -> list[tuple[tuple[int, int], float, float]]:
    """One any-size file at each of ``sizes`` on ``providers[0]`` (timed, median of ``repeats``)
    against ``providers[1]``: ``[((h, w), median_s, max_abs), ...]``."""
    from tome_compile.export import ToMeSession
    from tome_compile.models import example_inputs, load_unet

    fast, reference = (ToMeSession(path, seed=0, providers=[p]) for p in providers)
    unet, _ = load_unet(model)
    rows = []
    for h, w in sizes:
        inputs = example_inputs(unet, batch=batch, height=h, width=w, seq_len=77)
        args = (inputs.sample.numpy(), inputs.timestep, inputs.encoder_hidden_states.numpy())
        want = np.asarray(reference(*args)[0])
        got = np.asarray(fast(*args)[0])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fast(*args)
            times.append(time.perf_counter() - start)
        rows.append(((h, w), statistics.median(times), float(np.abs(got - want).max())))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
