"""What ``tome-export`` stores in the model (``metadata_props["tome_compile"]``, JSON) and
``ToMeSession`` reads back: one dataclass, written and read by the same code."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeExportError
from tome_compile.inputs import ToMeInputSpec

__all__ = ["METADATA_KEY", "METADATA_VERSION", "PAIRS_AXIS", "ExportMetadata"]

METADATA_KEY = "tome_compile"
# ``batch`` of an importance export that takes any batch of classifier-free-guidance pairs (an even
# batch, the uncond and cond halves), and the name of its map input's row axis: one row per pair
PAIRS_AXIS = "cfg_pairs"
METADATA_VERSION = 2  # 2: the ToMe inputs are described by ToMeInputSpec.to_json() under "tome_inputs"


@dataclass(frozen=True)
class ExportMetadata:
    """The export's description. A file without it (a plain Optimum U-Net) reads as the defaults:
    no ToMe inputs, no plan state, float32."""

    version: int = METADATA_VERSION
    config: dict[str, Any] = field(default_factory=dict)  # the ToMeConfig, as asdict()
    inputs: list[str] = field(default_factory=list)  # every graph input, in order
    tome_inputs: list[ToMeInputSpec] = field(default_factory=list)  # the ones the pass appended
    output: str = "out_sample"
    tome_outputs: list[ToMeInputSpec] = field(default_factory=list)  # plan_every's plans, fed back
    batch: int | str = "dynamic"  # or PAIRS_AXIS, or the one batch of a fixed-batch file
    height: int | None = None
    width: int | None = None
    seq_len: int | None = None
    timestep: str = "float32[1]"
    latent_hw: list[int] = field(default_factory=list)
    family: str = ""  # families.ModelFamily.name: what its inputs are (tome_compile.families)
    video_layout: str | None = None
    frames: int | None = None
    channel_axis: int = 1  # the noise output's channel axis (the importance map reads it)
    noise_channels: int | None = None
    method: str = "tome"
    guidance: str | None = None
    attention: str = "com.microsoft.MultiHeadAttention"
    destinations: str = ""
    sites: list[str] = field(default_factory=list)
    unet_config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    multiview: dict[str, Any] | None = None
    # an export for every image size: symbolic batch (when ``batch`` says so), latent height and
    # width (each a multiple of ``latent_multiple``) and text length; ``height`` / ``width`` /
    # ``seq_len`` are then the traced example. False: those are the only size the file takes.
    any_size: bool = False
    latent_multiple: int = 1
    # graph fixes after conversion (convert.postprocess)
    fp32_scatters: int = 0
    int32_scatter_indices: int = 0
    optional_inputs: list[str] = field(default_factory=list)
    fused_attention: int = 0

    def tome_config(self) -> ToMeConfig:
        """The :class:`ToMeConfig` the file was exported with (the defaults for a plain U-Net)."""
        names = {f.name for f in dataclasses.fields(ToMeConfig)}
        return ToMeConfig(**{k: v for k, v in self.config.items() if k in names})

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["tome_inputs"] = [spec.to_json() for spec in self.tome_inputs]
        data["tome_outputs"] = [spec.to_json() for spec in self.tome_outputs]
        if self.multiview is None:
            del data["multiview"]
        return json.dumps(data, default=str)

    @classmethod
    def from_json(cls, text: str, where: str = "the model") -> ExportMetadata:
        data = json.loads(text)
        if data.get("version") != METADATA_VERSION:
            raise ToMeExportError(f"{where} was written by another tome-compile version (metadata version "
                                  f"{data.get('version')}, this one reads {METADATA_VERSION}); export it "
                                  "again with this tome-export")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("tome_inputs", "tome_outputs"):
            values[key] = [ToMeInputSpec.from_json(d) for d in values.get(key, [])]
        return cls(**values)

    @classmethod
    def of_model(cls, model: Any, where: str = "the model") -> ExportMetadata | None:
        """The metadata of an ``onnx.ModelProto``, or ``None`` when it has none (not a tome-export file)."""
        text = {p.key: p.value for p in model.metadata_props}.get(METADATA_KEY)
        return cls.from_json(text, where) if text else None

    def write(self, model: Any) -> None:
        """Store into an ``onnx.ModelProto`` or an onnx-ir model (``metadata_props`` mapping)."""
        model.metadata_props[METADATA_KEY] = self.to_json()
