"""``tome-export``: write a ToMe-rewritten U-Net as ONNX (checked, atomically)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from tome_compile.arguments import dataclass_from_args
from tome_compile.config import DOWNSAMPLE_METHODS, METHODS, ToMeConfig, parse_blocks
from tome_compile.errors import ToMeError
from tome_compile.guidance import GUIDANCE

__all__ = ["main"]

# One INFO line per stage as it starts (silent by default): the memory benchmark's stage clock
_stages = logging.getLogger("tome_compile.export.stage")

EPILOG = """examples:
  tome-export unet_tome.onnx --model sd15                      # built-in SD 1.5 architecture, random weights
  tome-export out/unet.onnx --model ./stable-diffusion-v1-5 --height 768 --width 768
  tome-export sdxl.onnx --model sdxl --max-downsample 2 --height 1024 --width 1024 --batch 2
  tome-export unet.onnx --model ./my-unet --no-rand --ratio 0.4 --force
  tome-export --into ./sd15-onnx --model ./stable-diffusion-v1-5 --optimize cuda --fp16   # Optimum folder
  tome-export ad.onnx --model animatediff --frames 16 --batch 2          # video: batch and frames fixed
  tome-export pixart.onnx --model pixart --height 1024 --width 1024 --blocks 7-20 --merge-crossattn
  tome-export z123.onnx --model ./zero123plus --multiview --height 960 --width 640   # Zero123++ (two passes)
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tome-export", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_arguments(p.add_argument_group("model and inputs (what is exported, at which size)"))
    _tome_arguments(p.add_argument_group("token merging (tomesd's names)"))
    _onnx_arguments(p.add_argument_group("ONNX file and checks"))
    return p


def _model_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("out", nargs="?", help="output .onnx path (weights go to OUT.data beside it)")
    p.add_argument(
        "--model",
        default=None,
        help="local diffusers U-Net / PixArt transformer or pipeline folder, or sd15 | sd21 | sdxl | "
        "animatediff | svd | pixart | sd3 | zero123 (random weights), or shapes (the shipped trained model)",
    )
    p.add_argument(
        "--multiview",
        action="store_true",
        help="export the U-Net inside Zero123++'s two-pass reference wrapper (inputs cond_lat and noise; "
        "--height/--width are the 3 x 2 tiled views, 960 x 640); implied by --model zero123",
    )
    p.add_argument("--frames", type=int, default=None,
                   help="video U-Nets (AnimateDiff, SVD): frames per video (default 16 / 25)")
    p.add_argument("--height", type=int, default=512,
                   help="image height traced and checked, in pixels (the file takes any height in "
                        "multiples of 8 x the U-Net's downsampling: 64 for SD; --static fixes it)")
    p.add_argument("--width", type=int, default=512, help="image width traced and checked (see --height)")
    p.add_argument("--batch", type=int, default=2,
                   help="batch checked (the file takes any batch unless --static-batch; importance: "
                        "any even batch, in CFG pairs — with --partition-input or --plan-every this one)")
    p.add_argument(
        "--seq-len", type=int, default=77, help="text tokens in encoder_hidden_states (default 77)"
    )


def _tome_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--ratio", type=float, default=0.5, help="share of tokens merged (default 0.5)")
    p.add_argument("--max-downsample", type=int, default=1, help="1, 2, 4 or 8 (use 2 for SDXL)")
    p.add_argument("--sx", type=int, default=2)
    p.add_argument("--sy", type=int, default=2)
    p.add_argument("--no-rand", action="store_true", help="fixed destinations (tomesd's use_rand=False)")
    p.add_argument("--merge-crossattn", action="store_true")
    p.add_argument("--merge-mlp", action="store_true")
    p.add_argument("--share-plan", action="store_true",
                   help="one plan per resolution level per call (reused by the level's other blocks)")
    p.add_argument("--plan-every", type=int, default=1, metavar="K",
                   help="plan on every K-th call and reuse the plans in between (default 1: every call); "
                        "adds the tome_plan_slots/_weights and tome_reuse_plan inputs and two outputs, "
                        "which ToMeSession feeds back")
    p.add_argument("--method", default="tome", choices=METHODS)
    p.add_argument("--guidance", default="auto", choices=tuple(GUIDANCE),
                   help="importance: which rows of the batch are one image's: cfg [uncond; cond], pix2pix "
                        "[text; image; uncond], pag [uncond; cond; perturbed] (default auto: cfg for an "
                        "even batch, none for an odd one)")
    p.add_argument("--pool-factor", type=float, default=1.4, help="importance: pool size factor (PixArt: 1)")
    p.add_argument("--downsample-factor", type=int, default=2,
                   help="todo: keys and values read the token grid downsampled so much per axis (default 2)")
    p.add_argument("--downsample-method", default="nearest", choices=DOWNSAMPLE_METHODS,
                   help="todo: the interpolation (default nearest, as the reference code)")
    p.add_argument("--blocks", default=None, metavar="LIST",
                   help="only these transformer blocks, e.g. 7-20 (PixArt: the released importance code's)")


def _onnx_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--into", metavar="DIR", default=None,
                   help="replace DIR/unet/model.onnx of an Optimum ONNX Stable Diffusion folder "
                        "(OUT is then omitted; --model must give the U-Net's weights)")
    p.add_argument("--partition-input", action="store_true",
                   help="take the random destinations as a tome_partition input drawn by the caller "
                        "(ToMeSession; bit-exact with tome_backend(seed=)) instead of hashing them in the "
                        "graph from the timestep and the optional tome_seed input (default)")
    p.add_argument("--portable", action="store_true",
                   help="plain ONNX attention (MatMul/Softmax) instead of com.microsoft.MultiHeadAttention, "
                        "for runtimes without ONNX Runtime's contrib ops")
    p.add_argument("--static-batch", action="store_true",
                   help="fix the batch to --batch (default: any batch from one file)")
    p.add_argument("--static", action="store_true",
                   help="fix the image size and text length to --height/--width/--seq-len (CUDA graphs, "
                        "TensorRT profiles); default: an image U-Net's file takes any size and text length")
    p.add_argument("--optimize", choices=["cpu", "cuda"], default=None,
                   help="run ONNX Runtime's transformer optimizer (model_type=unet) for that provider "
                        "and check parity again")
    p.add_argument(
        "--opset", type=int, default=20, help="ONNX opset 18..23 (default 20; 23 has no CUDA group norm)"
    )
    p.add_argument("--fp16", action="store_true",
                   help="export in float16 (runs on the CPU EP too: the merge's scatter stays float32)")
    p.add_argument("--no-cuda-check", action="store_true",
                   help="do not require every op to have a CUDA EP kernel")
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="parity tolerance, times max(1, max |output|) (default 1e-3, fp16 5e-2)",
    )
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("-v", "--verbose", action="store_true")


class _UsageError(ToMeError):
    pass


MAX_BATCH = 64


class _Terminated(BaseException):
    """SIGTERM arrived: unwind (the export's temp folder is removed on the way out)."""


# Set by the signal handlers and checked again at every export step and before the output is moved
# into place: the exception a handler raises can be lost in a library (torch.onnx's capture falls
# back to its next strategy on any error; C++ callbacks can turn it into one), and an export that
# finished after a SIGTERM (CI saw one exit 0) is worse than one that stopped.
_interrupted: list[str] = []


# True while the ONNX conversion runs: a signal then only sets the flag, and the export stops at
# the next stage. An exception raised inside torch.onnx.export is caught by its capture strategies
# anyway, and one raised while its graph capture holds torch's dispatch state crashed the process
# (SIGSEGV in CI-like SIGTERM runs instead of a clean exit 143).
_deferred = [False]


def _on_sigterm(signum: int, frame: object) -> None:
    _stop("SIGTERM", _Terminated)


def _on_sigint(signum: int, frame: object) -> None:
    _stop("interrupted", KeyboardInterrupt)


def _stop(name: str, error: type[BaseException]) -> None:
    _interrupted.append(name)
    if _deferred[0]:
        print(f"tome-export: {name}: stopping after the ONNX conversion", file=sys.stderr, flush=True)
        return
    raise error


def _check_interrupted() -> None:
    """Raise again what a signal handler raised, if it was swallowed on the way up."""
    if _interrupted:
        raise _Terminated if _interrupted[0] == "SIGTERM" else KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:  # the exporter's own chatter (optional torchvision ops, deprecations)
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    main_thread = threading.current_thread() is threading.main_thread()
    _interrupted.clear()
    _deferred[0] = False
    previous = ((signal.signal(signal.SIGTERM, _on_sigterm), signal.signal(signal.SIGINT, _on_sigint))
                if main_thread else None)
    try:
        return _run(args)
    except ToMeError as e:
        print(f"tome-export: error: {e}", file=sys.stderr)
        return 2
    except (_Terminated, KeyboardInterrupt) as e:
        name = "SIGTERM" if isinstance(e, _Terminated) else "interrupted"
        print(f"tome-export: {name}: stopped; nothing was written", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        _deferred[0] = False
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


def _run(args: argparse.Namespace) -> int:
    _check_sizes(args)
    out, replaced = _destination(args)
    config = _config(args)
    multiview = _check_model(args)
    result = _export(args, out, config, _options(args), multiview)
    _print_report(args, result, replaced)
    return 0


def _check_sizes(args: argparse.Namespace) -> None:
    from tome_compile.export.convert import check_opset

    for name in ("height", "width"):
        value = getattr(args, name)
        if value <= 0 or value % 8:
            raise _UsageError(f"--{name} {value} must be a positive multiple of 8")
    if not 1 <= args.batch <= MAX_BATCH:
        raise _UsageError(f"--batch {args.batch} is outside [1, {MAX_BATCH}]: it is the batch the export is "
                          "checked at (2 = one image with guidance); the file takes any batch anyway")
    if args.seq_len < 1:
        raise _UsageError(f"--seq-len {args.seq_len} must be >= 1 (text tokens; 77 for CLIP)")
    if args.opset is not None:
        check_opset(args.opset)


def _config(args: argparse.Namespace) -> ToMeConfig:
    """The ToMe flags carry ToMeConfig's field names; only the inverted and parsed ones are named."""
    return dataclass_from_args(ToMeConfig, args, use_rand=not args.no_rand, seed=0,
                               blocks=parse_blocks(args.blocks) if args.blocks is not None else None)


def _check_model(args: argparse.Namespace) -> bool:
    """The model and the multi-view options; returns whether the export is multi-view."""
    from tome_compile.models import ARCHITECTURES, SHAPES

    if args.frames is not None and not 1 <= args.frames <= 128:
        raise _UsageError(f"--frames {args.frames} is outside [1, 128] (AnimateDiff: 16, SVD: 14 or 25)")
    known = (*ARCHITECTURES, SHAPES, "zero123")
    if args.model not in known and not Path(args.model).exists():
        raise _UsageError(f"--model {args.model!r}: no such folder, and not one of {known}")
    multiview = args.multiview or args.model == "zero123"
    if multiview and (args.height % 24 or args.width % 16):
        raise _UsageError(
            f"--height {args.height} --width {args.width}: a multi-view picture is 3 x 2 views of a "
            "multiple of 8 pixels each (height a multiple of 24, width of 16; Zero123++: "
            "--height 960 --width 640)"
        )
    if multiview and args.into:
        raise _UsageError(
            "--into replaces the U-Net of an Optimum Stable Diffusion folder; a multi-view export "
            "(cond_lat, noise inputs) has no such folder: give OUT instead"
        )
    if multiview and args.model in (*ARCHITECTURES, SHAPES):
        raise _UsageError(
            f"--multiview wraps a local Zero123++ U-Net or pipeline folder (or use --model zero123), "
            f"not --model {args.model}"
        )
    return multiview


def _options(args: argparse.Namespace) -> Any:
    from tome_compile.export.onnx_export import ExportOptions

    return dataclass_from_args(ExportOptions, args, force=args.force or bool(args.into),
                               require_cuda_kernels=not args.no_cuda_check,
                               dynamic_batch=not args.static_batch, release_weights=True)


def _export(args: argparse.Namespace, out: Path, config: ToMeConfig, options: Any, multiview: bool) -> Any:
    """Load the model and export it, with a progress bar over the export's stages."""
    from tome_compile.export.onnx_export import export_onnx
    from tome_compile.export.optimum import check_into_config
    from tqdm import tqdm

    from tome_compile.models import load_unet

    steps = ["load", *options.stages()]
    with tqdm(total=len(steps), desc="tome-export", unit="step", file=sys.stderr) as bar:
        bar.set_postfix_str("loading the U-Net")
        _stages.info("loading the U-Net")
        dtype = torch.float16 if args.fp16 else torch.float32
        if multiview:
            from tome_compile.multiview import load_multiview

            unet, description = load_multiview(args.model, dtype=dtype)
        else:
            unet, description = load_unet(args.model, dtype=dtype)
        print(f"model: {description}", flush=True)
        bar.update(1)

        def step(message: str) -> None:
            _check_interrupted()
            _deferred[0] = message.startswith("converting to ONNX")
            _stages.info("%s", message)
            bar.set_postfix_str(message)
            bar.update(1) if bar.n < bar.total - 1 else None

        with torch.no_grad():
            if args.into:
                check_into_config(Path(args.into), unet)
            result = export_onnx(unet, out, config, options, step=step)
        bar.update(bar.total - bar.n)
    return result


def _print_report(args: argparse.Namespace, result: Any, replaced: list[Path]) -> None:
    from tome_compile.export.optimum import remove_stale_external_data

    print(result.report.summary())
    inv = result.inventory
    print(f"ops (opset {inv.opset}): {sum(inv.op_counts.values())} nodes, {len(inv.op_counts)} op types; "
          "onnx.checker passed; every op has a CUDA EP kernel" if not args.no_cuda_check else
          f"ops (opset {inv.opset}): {sum(inv.op_counts.values())} nodes; onnx.checker passed")
    if result.fused_attention:
        print(f"attention: {result.fused_attention} com.microsoft.MultiHeadAttention nodes")
    if result.fusions:
        print(f"ONNX Runtime optimizer ({args.optimize}): "
              + ", ".join(f"{k} {v}" for k, v in sorted(result.fusions.items())))
    if result.parity_max_abs is not None:
        print(f"parity ({result.parity_provider}): max abs {result.parity_max_abs:.3g}, "
              f"max rel {result.parity_max_rel:.3g}")
    else:
        print("parity: not checked")
    print("inputs: " + ", ".join(result.input_names) + " -> out_sample"
          + (f" (optional: {', '.join(result.optional_inputs)})" if result.optional_inputs else ""))
    for f in result.files:
        print(f"wrote {f} ({f.stat().st_size / 2**20:.1f} MiB)")
    for f in remove_stale_external_data(replaced, result.files):
        print(f"removed {f} (the replaced U-Net's weights)")


def _destination(args: argparse.Namespace) -> tuple[Path, list[Path]]:
    """OUT, or DIR/unet/model.onnx with ``--into`` (plus the old model's weight files, removed
    once the new one is in place)."""
    from tome_compile.export.optimum import check_optimum_folder, external_data_files
    from tome_compile.export.output_files import check_output_path

    if args.into:
        if args.out:
            raise _UsageError(f"give either OUT ({args.out!r}) or --into {args.into!r}, not both")
        if args.model is None:
            raise _UsageError("--into needs --model with the U-Net's weights (a diffusers folder): an "
                              "Optimum folder holds only ONNX files, and random weights would replace yours")
        out = check_optimum_folder(Path(args.into))
        return check_output_path(out, True), external_data_files(out)
    if not args.out:
        raise _UsageError("give an output path OUT (…/unet.onnx) or --into DIR")
    args.model = args.model or "sd15"
    return check_output_path(args.out, args.force), []


def _entry() -> None:
    """Console entry point. After an interrupt the export has already removed its temp folder;
    exit at once rather than through interpreter shutdown, which can crash (SIGSEGV, seen in 2 of
    ~17 SIGTERM runs) while the interrupted exporter's state is half torn down."""
    code = main()
    if code in (130, 143):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    _entry()
