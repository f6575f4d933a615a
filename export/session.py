"""``ToMeSession``: an ONNX Runtime session that stands in for the U-Net in a diffusers loop.

    session = ToMeSession("unet_tome.onnx", seed=0)          # CUDA EP when available, else CPU
    noise_pred = session(latents, t, encoder_hidden_states=emb).sample

It feeds the ToMe inputs the export declares: ``tome_seed`` (the default export: the graph hashes
the destinations from it and the timestep), or, for ``--partition-input`` exports, a partition
drawn every call from its own seeded generator (the same sequence ``tome_backend(seed=...)``
draws). It converts torch tensors to the model's input types (float32 ``[1]`` timestep) and
returns torch tensors on the caller's device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tome_compile.export.onnx_export import METADATA_KEY, METADATA_VERSION, default_providers
from tome_compile.passes import SEED_INPUT

from tome_compile.errors import ToMeExportError
from tome_compile.importance import StepState
from tome_compile.inputs import ToMeInputSpec, draw_tome_inputs
from tome_compile.sampler import PartitionSampler

__all__ = ["ToMeSession"]

logger = logging.getLogger("tome_compile.export")

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(double)": np.float64}
_TORCH = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}
_NUMPY_OF = {torch.float32: np.float32, torch.float16: np.float16}


class _Output(SimpleNamespace):
    sample: torch.Tensor

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.sample,)[index]


class ToMeSession:
    """ONNX Runtime session of a ``tome-export`` model with the U-Net's call signature.

    Args:
        path: the ``.onnx`` file (its ``.onnx.data`` beside it).
        providers: ONNX Runtime providers; default CUDA EP when available, else CPU.
        seed: seed of the partition generator (``None``: from the OS; hashed exports get 0).
        io_binding: bind torch tensors to the session by pointer (no NumPy round trip; the output
            is written into a torch tensor on the input's device). Default: on for the CUDA EP.
    """

    def __init__(self, path: str | Path, *, providers: Sequence[str] | None = None,
                 seed: int | None = None, session_options: Any = None, io_binding: bool | None = None) -> None:
        import onnx
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise ToMeExportError(f"no ONNX model at {str(path)!r}")
        model = onnx.load(str(path), load_external_data=False)
        meta = {p.key: p.value for p in model.metadata_props}.get(METADATA_KEY)
        self.meta: dict[str, Any] = json.loads(meta) if meta else {}
        if self.meta and self.meta.get("version") != METADATA_VERSION:
            raise ToMeExportError(f"{str(path)!r} was written by another tome-compile version (metadata "
                                  f"version {self.meta.get('version')}, this one reads {METADATA_VERSION}); "
                                  "export it again with this tome-export")
        self.specs = [ToMeInputSpec.from_json(d) for d in self.meta.get("tome_inputs", [])]
        self._uses_map = any(spec.draw == "importance" for spec in self.specs)
        # plan_every exports return their plans as extra outputs; later calls feed them back
        self._keeps_plans = bool(self.meta.get("tome_outputs"))
        self.plan_every = int(self.meta.get("plan_every", 1))
        if providers is None:
            providers = default_providers()
        self.session = ort.InferenceSession(str(path), sess_options=session_options,
                                            providers=list(providers))
        self.provider = self.session.get_providers()[0]
        logger.info("ToMeSession: %s on %s", path.name, self.provider)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.sampler = PartitionSampler(seed)
        self.importance = StepState()  # the importance map and plan_every's plans
        self.config = SimpleNamespace(**self.meta.get("unet_config", {}))
        self.dtype = torch.float16 if self.meta.get("dtype") == "float16" else torch.float32
        self.device = torch.device("cpu")
        self.io_binding = self.provider == "CUDAExecutionProvider" if io_binding is None else io_binding

    def reset(self, seed: int | None = None) -> None:
        """Start a new generation: restart the random sequence, forget the importance map and plans."""
        self.sampler.reseed(seed)
        self.importance.reset()

    def _feed(self, name: str, value: Any) -> np.ndarray | torch.Tensor:
        if name not in self.inputs:
            raise ToMeExportError(f"input {name!r} is not an input of this model ({list(self.inputs)})")
        spec = self.inputs[name]
        if self.io_binding and name != "timestep" and isinstance(value, torch.Tensor) and spec.type in _TORCH:
            self._check_shape(name, tuple(value.shape))  # bound by pointer, stays on its device
            return value.detach().to(_TORCH[spec.type]).contiguous()
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        array = array.astype(_NUMPY.get(spec.type, array.dtype), copy=False)
        if len(spec.shape) == 0:
            array = array.reshape(())
        elif name == "timestep" and list(spec.shape) == [1] and array.size != 1:
            flat = array.reshape(-1)  # diffusers may pass one timestep per image: all the same
            if not (flat == flat[0]).all():
                raise ToMeExportError(f"timestep holds different values {flat.tolist()[:4]}...; this "
                                      "export takes one timestep per call (shape [1])")
            array = flat[:1]
        elif name == "timestep" and list(spec.shape) == [1]:
            array = array.reshape(1)
        elif name == "timestep" and array.size == 1 and len(spec.shape) == 1:  # PixArt: one per image
            array = np.full(tuple(d if isinstance(d, int) else 1 for d in spec.shape), array.reshape(()),
                            dtype=array.dtype)
        self._check_shape(name, tuple(array.shape))
        return array

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        want = list(self.inputs[name].shape)
        if any(isinstance(d, int) and d != got for d, got in zip(want, shape)) or len(want) != len(shape):
            raise ToMeExportError(f"{name} has shape {shape}, this export takes {tuple(want)} "
                                  "(the image size and text length are fixed per export, and the batch "
                                  "of importance exports; export again for another)")

    def _run(self, feed: dict[str, np.ndarray | torch.Tensor], device: torch.device
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call: plain ``run`` on NumPy arrays, or IO binding (torch tensors by pointer, the
        output written into a torch tensor allocated on ``device``). Returns the sample and the
        extra outputs (plan_every's plans, on the CPU)."""
        # ONNX Runtime cannot bind an optional input (an initializer with a default): such a call
        # takes the plain path; a default value is simply left out.
        if SEED_INPUT in feed and not feed[SEED_INPUT].any():  # the default, 0
            del feed[SEED_INPUT]
        optional = [k for k in feed if k not in self.inputs]
        if not self.io_binding or optional:
            arrays = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in feed.items()}
            first, *rest = self.session.run(None, arrays)
            return torch.from_numpy(first).to(device), [torch.from_numpy(r) for r in rest]
        binding = self.session.io_binding()
        for name, value in feed.items():
            if isinstance(value, torch.Tensor):
                binding.bind_input(name, value.device.type, value.device.index or 0, _NUMPY_OF[value.dtype],
                                   list(value.shape), value.data_ptr())
            else:
                binding.bind_cpu_input(name, value)
        output, *extras = self.session.get_outputs()
        for extra in extras:  # small: ORT allocates them on the CPU
            binding.bind_output(extra.name, "cpu")
        sample = feed["sample"]  # the output has its shape, or its own static one (SVD, PixArt: other channels)
        shape = tuple(d if isinstance(d, int) else sample.shape[i] for i, d in enumerate(output.shape))
        out = torch.empty(shape, dtype=_TORCH[output.type], device=device)
        binding.bind_output(output.name, out.device.type, out.device.index or 0, _NUMPY_OF[out.dtype],
                            list(out.shape), out.data_ptr())
        if out.device.type == "cuda":
            binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        if out.device.type == "cuda":
            binding.synchronize_outputs()
        return out, [torch.from_numpy(v.numpy()) for v in binding.get_outputs()[1:]]

    def _tome_feed(self, sample_shape: tuple[int, ...], timestep: Any) -> tuple[dict[str, np.ndarray], str]:
        """The ToMe inputs, drawn as ``tome_backend`` draws them (same specs, same order), and the
        kind of plan the call uses. A call that plans leaves the plan inputs out (their defaults:
        reuse off); one that reuses feeds the plans an earlier call returned."""
        state = self._uses_map or self._keeps_plans
        current = self.importance.current(tuple(sample_shape), timestep) if state else None
        kind = "importance" if current is not None else "tome"
        plans = self.importance.plans_to_reuse(kind, self.plan_every) if self._keeps_plans else None
        values = draw_tome_inputs(self.specs, self.sampler, current, "cpu", plans)
        feed = {spec.name: value.numpy() for spec, value in zip(self.specs, values)
                if plans is not None or spec.draw not in ("plan_slot", "plan_weight", "reuse")}
        return feed, kind if plans is None else "reuse"

    def __call__(self, sample: torch.Tensor | None = None, timestep: Any = None, encoder_hidden_states: torch.Tensor | None = None,
                 added_cond_kwargs: dict[str, torch.Tensor] | None = None, return_dict: bool = True,
                 added_time_ids: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = None,
                 hidden_states: torch.Tensor | None = None, **_: Any) -> Any:
        if sample is None:  # PixArt's pipeline names the latent hidden_states
            sample = hidden_states
        feed = {"sample": self._feed("sample", sample),
                "timestep": self._feed("timestep", timestep),
                "encoder_hidden_states": self._feed("encoder_hidden_states", encoder_hidden_states)}
        for name in ("text_embeds", "time_ids"):
            if name in self.inputs:
                if not added_cond_kwargs or name not in added_cond_kwargs:
                    raise ToMeExportError(f"this SDXL export needs added_cond_kwargs[{name!r}]")
                feed[name] = self._feed(name, added_cond_kwargs[name])
        if "encoder_attention_mask" in self.inputs:  # PixArt
            mask = encoder_attention_mask if encoder_attention_mask is not None else torch.ones(
                encoder_hidden_states.shape[:2])
            feed["encoder_attention_mask"] = self._feed("encoder_attention_mask", mask)
        for name in ("resolution", "aspect_ratio"):  # PixArt-α 1024
            if name in self.inputs:
                if not added_cond_kwargs or added_cond_kwargs.get(name) is None:
                    raise ToMeExportError(f"this PixArt export needs added_cond_kwargs[{name!r}]")
                feed[name] = self._feed(name, added_cond_kwargs[name])
        if "added_time_ids" in self.inputs:  # SVD
            if added_time_ids is None:
                raise ToMeExportError("this SVD export needs added_time_ids (fps, motion bucket, noise "
                                      "augmentation per video)")
            feed["added_time_ids"] = self._feed("added_time_ids", added_time_ids)
        tome, kind = self._tome_feed(tuple(feed["sample"].shape), timestep)
        feed.update(tome)
        result, extras = self._run(feed, sample.device if isinstance(sample, torch.Tensor) else torch.device("cpu"))
        if self._keeps_plans and kind != "reuse":
            self.importance.keep_plans(kind, (extras[0], extras[1]))
        if self._uses_map:
            self.importance.update(result, int(self.meta.get("channel_axis", 1)), self.meta.get("noise_channels"))
        return _Output(sample=result) if return_dict else (result,)
