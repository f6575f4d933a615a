"""``tome-export --into DIR``: replace the U-Net of an Optimum ONNX Stable Diffusion folder.

Optimum (``ORTStableDiffusionPipeline.from_pretrained(DIR)``) and diffusers' ONNX pipelines read
``DIR/model_index.json`` and ``DIR/unet/model.onnx``; the U-Net there takes ``sample``,
``timestep`` (float32) and ``encoder_hidden_states`` and returns ``out_sample`` — the names and
types ``tome-export`` writes. Its weights may sit in an external data file beside it (Optimum:
``model.onnx_data``); the new export writes ``model.onnx.data``. The new files are moved in only
after every check passed (the old model stays on any failure); the old weight files the new model
does not use are removed afterwards.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from tome_compile.errors import ToMeExportError

__all__ = ["check_into_config", "check_optimum_folder", "external_data_files", "remove_stale_external_data"]

logger = logging.getLogger("tome_compile.export")

UNET_FILE = Path("unet") / "model.onnx"


def check_optimum_folder(folder: Path) -> Path:
    """``folder/unet/model.onnx`` if ``folder`` is laid out like an Optimum ONNX SD folder."""
    if not folder.is_dir():
        raise ToMeExportError(f"--into {str(folder)!r}: no such folder")
    if not (folder / "model_index.json").is_file():
        raise ToMeExportError(f"--into {str(folder)!r} has no model_index.json: not an Optimum / diffusers "
                              "ONNX pipeline folder (export one with `optimum-cli export onnx`)")
    if not (folder / "unet").is_dir():
        raise ToMeExportError(f"--into {str(folder)!r} has no unet/ folder")
    return folder / UNET_FILE


def check_into_config(folder: Path, unet: torch.nn.Module) -> None:
    """The U-Net being exported must have the architecture of the one it replaces."""
    config_path = folder / "unet" / "config.json"
    if not config_path.is_file():
        return
    theirs = json.loads(config_path.read_text())
    ours = dict(unet.config)
    for key in ("in_channels", "out_channels", "cross_attention_dim", "block_out_channels"):
        a, b = theirs.get(key), ours.get(key)
        if a is not None and b is not None and list(a if isinstance(a, (list, tuple)) else [a]) != list(
                b if isinstance(b, (list, tuple)) else [b]):
            raise ToMeExportError(f"--model's U-Net has {key}={b}, the one in {str(config_path)!r} has {a}: "
                                  "not the same architecture; give the U-Net of this pipeline")


def external_data_files(model_path: Path) -> list[Path]:
    """Files the ONNX model at ``model_path`` keeps its tensors in (none if it does not exist)."""
    import onnx

    if not model_path.is_file():
        return []
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable old model: nothing to clean up after
        return []
    names = set()
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                names.add(entry.value)
    return [model_path.parent / name for name in sorted(names)]


def remove_stale_external_data(old: Sequence[Path], new: Sequence[Path]) -> list[Path]:
    """Remove the replaced model's weight files the new model does not use. Returns the removed."""
    keep = {p.resolve() for p in new}
    removed = []
    for path in old:
        if path.exists() and path.resolve() not in keep:
            path.unlink()
            removed.append(path)
            logger.info("removed %s (weights of the replaced U-Net)", path)
    return removed
