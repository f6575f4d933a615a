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

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from tome_compile.export.metadata import PAIRS_AXIS, ExportMetadata
from tome_compile.export.parity import default_providers

from tome_compile.errors import ToMeExportError
from tome_compile.families import needs
from tome_compile.guidance import GUIDANCE, random_destinations
from tome_compile.inputs import SEED_INPUT
from tome_compile.state import CallDriver, CallState, check_seed

__all__ = ["ToMeSession", "lean_memory_options"]

logger = logging.getLogger("tome_compile.export")

_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(double)": np.float64}
_TORCH = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}
_NUMPY_OF = {torch.float32: np.float32, torch.float16: np.float16}

# What a keyword of the diffusers call stands for, when this export has no input of that name.
_NOT_EXPORTED = {
    "down_block_additional_residuals": "ControlNet residual inputs",
    "mid_block_additional_residual": "ControlNet residual inputs",
    "down_intrablock_additional_residuals": "T2I-Adapter residual inputs",
    "timestep_cond": "timestep_cond input (LCM's guidance embedding)",
    "class_labels": "class_labels input",
    "cross_attention_kwargs": "per-call attention arguments (LoRA scale, IP-Adapter: fixed at export)",
    "joint_attention_kwargs": "per-call attention arguments (LoRA scale, IP-Adapter: fixed at export)",
    "guidance": "guidance input (Flux.1-dev's distilled guidance scale)",
    "attention_mask": "attention_mask input",
    "encoder_attention_mask": "encoder_attention_mask input",
    "added_time_ids": "added_time_ids input (SVD)",
}


class _Output(SimpleNamespace):
    sample: Any

    def __getitem__(self, index: int) -> Any:
        return (self.sample,)[index]


def lean_memory_options(options: Any = None) -> Any:
    """``onnxruntime.SessionOptions`` (``options``, or new ones) with every value in a buffer of
    its own, freed after its last reader: ``enable_mem_reuse`` and ``enable_mem_pattern`` off.

    ONNX Runtime's default plan hands a freed buffer to a later value of the same size, which keeps
    it allocated in between: for a U-Net that chains the feed-forwards' buffers of the first block
    of a resolution to the last, through the whole call (SD 1.5, 512², batch 2, CPU EP: 0.78 GB at
    the peak of a call where the live values never exceed 0.22 GB). Lean, the peak is the live
    values'; each value's memory is requested and freed at its size (with the CPU arena on, the
    arena serves it). See the README's ONNX Runtime memory table for the time it costs."""
    import onnxruntime as ort

    options = ort.SessionOptions() if options is None else options
    options.enable_mem_reuse = False
    options.enable_mem_pattern = False
    return options


class ToMeSession:
    """ONNX Runtime session of a ``tome-export`` model with the U-Net's call signature.

    It takes exactly what the export takes: every keyword of the diffusers call is fed to an input
    of the file or refused with one line (a ControlNet residual to an export without such inputs is
    an error, never silently dropped). NumPy in (diffusers' ONNX pipelines), NumPy out; torch in,
    torch out on the caller's device. The call state (importance map, ``plan_every``'s plans, the
    random draws) is the caller's — per thread, or per ``tome_compile.generation()`` — and is run by
    the same :class:`~tome_compile.state.CallDriver` as the ``torch.compile`` backend.

    Args:
        path: the ``.onnx`` file (its ``.onnx.data`` beside it).
        providers: ONNX Runtime providers; default CUDA EP when available, else CPU.
        seed: seed of every generation's partition draws (``None``: from the OS; hashed exports
            get 0), in ``[0, 2**63 - 1]``.
        io_binding: bind torch tensors to the session by pointer (no NumPy round trip; the output
            is written into a torch tensor on the input's device). Default: on for the CUDA EP.
        session_options: ``onnxruntime.SessionOptions``, used as given. Default on the CPU EP:
            :func:`lean_memory_options` (SD 1.5 at 512², batch 2: 0.31 GB above the loaded
            session instead of 1.55 GB, no slower); elsewhere ONNX Runtime's defaults.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        providers: Sequence[str] | None = None,
        seed: int | None = None,
        session_options: Any = None,
        io_binding: bool | None = None,
    ) -> None:
        import onnx
        import onnxruntime as ort

        if seed is not None:
            check_seed(seed, "ToMeSession(seed=...)")
        path = Path(path)
        if not path.is_file():
            raise ToMeExportError(f"no ONNX model at {str(path)!r}")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # protobuf's DecodeError, a truncated file's errors: none names the file
            raise ToMeExportError(
                f"{str(path)!r} is not a readable ONNX model ({type(e).__name__}: {e}); it may be "
                "truncated or another kind of file: export it again with tome-export"
            ) from e
        found = ExportMetadata.of_model(model, repr(str(path)))
        self.exported = found is not None  # written by tome-export (a plain Optimum U-Net is not)
        self.meta = found or ExportMetadata()
        self.specs = list(self.meta.tome_inputs)
        self._uses_map = any(spec.draw == "importance" for spec in self.specs)
        self.guidance = GUIDANCE.get(self.meta.guidance or "cfg") if self._uses_map else None
        # plan_every exports return their plans as extra outputs; later calls feed them back
        self._keeps_plans = bool(self.meta.tome_outputs)
        if providers is None:
            providers = default_providers()
        if session_options is None and list(providers)[:1] == ["CPUExecutionProvider"]:
            session_options = lean_memory_options()
        self.session = ort.InferenceSession(str(path), sess_options=session_options,
                                            providers=list(providers))
        self.provider = self.session.get_providers()[0]
        logger.info("ToMeSession: %s on %s", path.name, self.provider)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        tome_names = {spec.name for spec in self.specs}
        self._model_inputs = [name for name in self.inputs if name not in tome_names]
        defaults = {tensor.name for tensor in model.graph.initializer}
        self._required = {name for name in self._model_inputs if name not in defaults}  # no default value
        self.seed = seed
        self._said: set[str] = set()
        self.driver = CallDriver.for_config(self.meta.tome_config(), seed=seed, say=self._say_once)
        self.config = SimpleNamespace(**self.meta.unet_config)
        self.dtype = torch.float16 if self.meta.dtype == "float16" else torch.float32
        self.device = torch.device("cpu")
        self.io_binding = self.provider == "CUDAExecutionProvider" if io_binding is None else io_binding

    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        """What diffusers' Flux pipelines open around each transformer call (the context of its
        cache hooks): a file runs no such hooks."""
        yield

    @property
    def model(self) -> Any:
        """The ONNX Runtime session (diffusers' ``OnnxRuntimeModel.model``: its ONNX pipelines read
        the timestep's type from it)."""
        return self.session

    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.warning("%s", message)

    def call_state(self) -> CallState | None:
        """The calling thread's (or ``generation()``'s) state: guidance map, plans, counters."""
        return self.driver.state()

    @property
    def importance(self) -> CallState | None:
        """Old name of :meth:`call_state`."""
        return self.call_state()

    def reset(self, seed: int | None = None) -> None:
        """Every caller's next call starts a new generation: no map, no plans, the random sequence
        from ``seed`` (else the session's seed)."""
        if seed is not None:
            check_seed(seed, "reset(seed=...)")
        self.driver.reset(seed)

    def _feed(self, name: str, value: Any) -> np.ndarray | torch.Tensor:
        if name not in self.inputs:
            raise ToMeExportError(f"input {name!r} is not an input of this model ({list(self.inputs)})")
        spec = self.inputs[name]
        if self.io_binding and name != "timestep" and isinstance(value, torch.Tensor) and spec.type in _TORCH:
            self._check_shape(name, tuple(value.shape))  # bound by pointer, stays on its device
            return value.detach().to(_TORCH[spec.type]).contiguous()
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        array = array.astype(_NUMPY.get(spec.type, array.dtype), copy=False)
        if name == "timestep" and array.size == 0:
            raise ToMeExportError(f"timestep has no value (shape {tuple(array.shape)}); give the call's "
                                  "timestep: a number, or a tensor of one value (or one per image)")
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
        if len(want) != len(shape) or any(
            isinstance(d, int) and d != got for d, got in zip(want, shape, strict=True)
        ):
            fixed = ("the batch of an importance export with a drawn partition or plan reuse is fixed; "
                     "export again for another" if self.meta.any_size else
                     "the image size and text length are fixed per export (--static, and the "
                     "--partition-input / --plan-every / video / DiT / multi-view forms), and the batch "
                     "of importance exports with a drawn partition or plan reuse; export again for another")
            raise ToMeExportError(f"{name} has shape {shape}, this export takes {tuple(want)} ({fixed})")
        multiple = int(self.meta.latent_multiple or 1)
        if name == "sample" and self.meta.any_size and len(shape) == 4 \
                and (shape[2] % multiple or shape[3] % multiple):
            raise ToMeExportError(
                f"sample has a {shape[2]}x{shape[3]} latent; this export takes latents whose height and "
                f"width are multiples of {multiple} (the U-Net's downsampling: images in multiples of "
                f"{8 * multiple} pixels); pick the nearest such size")

    def _run(self, feed: dict[str, np.ndarray | torch.Tensor], device: torch.device
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call: plain ``run`` on NumPy arrays, or IO binding (torch tensors by pointer, the
        output written into a torch tensor allocated on ``device``). Returns the sample and the
        extra outputs (plan_every's plans, on the CPU), in the model's output order."""
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
        sample = feed[
            "sample"
        ]  # the output has its shape, or its own static one (SVD, PixArt: other channels)
        shape = tuple(d if isinstance(d, int) else sample.shape[i] for i, d in enumerate(output.shape))
        out = torch.empty(shape, dtype=_TORCH[output.type], device=device)
        binding.bind_output(output.name, out.device.type, out.device.index or 0, _NUMPY_OF[out.dtype],
                            list(out.shape), out.data_ptr())
        for extra in extras:  # small: ORT allocates them on the CPU; get_outputs() keeps the bind order
            binding.bind_output(extra.name, "cpu")
        if out.device.type == "cuda":
            binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        if out.device.type == "cuda":
            binding.synchronize_outputs()
        return out, [torch.from_numpy(v.numpy()) for v in binding.get_outputs()[1:]]

    def _gather_inputs(
        self,
        sample: Any,
        encoder_hidden_states: Any,
        added_cond_kwargs: dict[str, Any] | None,
        named: dict[str, Any],
    ) -> dict[str, Any]:
        """Every model input of this call by name: each keyword fed to an input of the file, or
        refused with one line (never silently dropped); a missing required one named."""
        given: dict[str, Any] = {"sample": sample, "encoder_hidden_states": encoder_hidden_states}
        named = dict(named)
        if "cond_lat" in self._model_inputs and isinstance(named.get("cross_attention_kwargs"), dict):
            named.update(self._multiview_kwargs(named.pop("cross_attention_kwargs")))
        for source, values in (("", named), ("added_cond_kwargs", added_cond_kwargs or {})):
            for name, value in values.items():
                unused = name in ("cross_attention_kwargs", "joint_attention_kwargs") and value == {}
                if value is None or unused:
                    continue  # what diffusers passes for "not used"
                if name in self._model_inputs:
                    given[name] = value
                    continue
                where = f"added_cond_kwargs[{name!r}]" if source else name
                if name in {spec.name for spec in self.specs}:
                    raise ToMeExportError(f"{where}: ToMe's inputs are fed by ToMeSession itself; to feed "
                                          "them by hand, run session.model (the ONNX Runtime session) "
                                          "with every input")
                what = _NOT_EXPORTED.get(name, f"input named {name!r}")
                raise ToMeExportError(
                    f"this export has no {what}, but {where} was given: it would be ignored; "
                    f"the export takes {', '.join(self._model_inputs)} (run this model "
                    "through torch.compile(backend=tome_backend(...)) for the others)"
                )
        if "noise" in self._model_inputs and given.get("noise") is None and given.get("cond_lat") is not None:
            given["noise"] = self._condition_noise(given["cond_lat"])
        if "encoder_attention_mask" in self._model_inputs and "encoder_attention_mask" not in given \
                and isinstance(encoder_hidden_states, (torch.Tensor, np.ndarray)):  # PixArt: all tokens
            given["encoder_attention_mask"] = np.ones(encoder_hidden_states.shape[:2], dtype=np.float32)
        for name in self._model_inputs:
            if name != "timestep" and given.get(name) is None and name in self._required:
                raise ToMeExportError(f"this export needs {needs(name)}; it was not given")
        return {name: value for name, value in given.items() if value is not None}

    def _multiview_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A multi-view export called as Zero123++'s pipeline calls its wrapper:
        ``cross_attention_kwargs={"cond_lat": ..., "is_cfg_guidance": ...}``."""
        out = {}
        for key, value in kwargs.items():
            if key == "is_cfg_guidance":
                exported = bool((self.meta.multiview or {}).get("is_cfg_guidance", False))
                if bool(value) != exported:
                    raise ToMeExportError(
                        f"cross_attention_kwargs['is_cfg_guidance']={bool(value)}, but this "
                        f"export was made with is_cfg_guidance={exported}; export it again "
                        "with MultiViewExport(wrapper, is_cfg_guidance=...)"
                    )
            elif key in ("cond_lat", "noise"):
                out[key] = value
            else:
                raise ToMeExportError(
                    f"cross_attention_kwargs[{key!r}] is not an input of this multi-view export "
                    "(it takes cond_lat, optionally noise, and is_cfg_guidance as exported)"
                )
        return out

    @staticmethod
    def _condition_noise(cond_lat: Any) -> Any:
        """The condition latent's noise, drawn as the wrapper draws it: ``torch.randn_like`` on the
        global RNG (so a seeded pipeline gives the same numbers as the PyTorch wrapper)."""
        if isinstance(cond_lat, torch.Tensor):
            return torch.randn_like(cond_lat)
        array = np.asarray(cond_lat)
        return torch.randn(array.shape, dtype=torch.float32).numpy().astype(array.dtype)

    def _check_batch(self, feed: dict[str, Any]) -> None:
        """Inputs with a dynamic batch axis must have the sample's batch (ORT would say it deep
        inside an attention node)."""
        batch = int(feed["sample"].shape[0])
        if self.meta.batch == PAIRS_AXIS and batch % 2:
            raise ToMeExportError(
                f"sample has batch {batch}; this importance export takes classifier-free-guidance pairs "
                "(an even batch: the uncond half, then the cond half), its map one row per pair; "
                "run with a guidance scale > 1, or export with --method tome for a batch without pairs")
        for name, value in feed.items():
            dims = self.inputs[name].shape if name in self.inputs else []
            if name != "sample" and dims and not isinstance(dims[0], int) and dims[0] != PAIRS_AXIS \
                    and len(value.shape) and int(value.shape[0]) != batch:
                raise ToMeExportError(
                    f"{name} has batch {int(value.shape[0])}, the sample has {batch}: one row "
                    "per sample (with classifier-free guidance, repeat the text embeddings "
                    "for the uncond and cond halves)"
                )

    def _check_packed_grid(self, feed: dict[str, Any]) -> None:
        """A packed latent (Flux) has the token count of its grid whichever way round it lies
        (32x64 and 64x32): the positions it is sent (``img_ids``: each token's row and column) must
        be the grid the file merges on, or the plans would be another grid's."""
        ids = feed.get("img_ids")
        want = tuple(self.meta.latent_hw or ())
        if ids is None or len(want) != 2:
            return
        ids = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        got = (int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1) if ids.ndim == 2 and ids.shape[0] else None
        if got != want:
            shown = f"{got[0]}x{got[1]}" if got else "an empty"
            raise ToMeExportError(
                f"img_ids describe {'a ' if got else ''}{shown} token grid; this export merges on "
                f"the {want[0]}x{want[1]} grid it was traced at (height {16 * want[0]}, width "
                f"{16 * want[1]} for Flux); export again for another size")

    def __call__(self, sample: Any = None, timestep: Any = None, encoder_hidden_states: Any = None,
                 added_cond_kwargs: dict[str, Any] | None = None, return_dict: bool = True, *,
                 hidden_states: Any = None, **named: Any) -> Any:
        if sample is None:  # PixArt's pipeline names the latent hidden_states
            sample = hidden_states
        if sample is None:
            raise ToMeExportError("ToMeSession needs the latent: sample (or hidden_states for PixArt)")
        if timestep is None:
            raise ToMeExportError(
                "ToMeSession needs the timestep of the call (a number or a tensor); without "
                "it the time embedding would be garbage"
            )
        if len(getattr(sample, "shape", ())) == 0 or int(sample.shape[0]) == 0:
            raise ToMeExportError(f"sample has shape {tuple(getattr(sample, 'shape', ()))}: give a batch of "
                                  "at least one latent [B, C, H, W] (B >= 1)")
        given = self._gather_inputs(sample, encoder_hidden_states, added_cond_kwargs, named)
        feed = {name: self._feed(name, value) for name, value in given.items() if name != "timestep"}
        feed["timestep"] = self._feed("timestep", timestep)
        self._check_batch(feed)
        self._check_packed_grid(feed)
        shape = tuple(feed["sample"].shape)
        call = self.driver.begin(None, shape, timestep, layout=self.guidance, keeps_plans=self._keeps_plans,
                                 random=random_destinations(True, shape[0]))
        specs = self.specs
        if self.meta.any_size:  # the importance map follows the call's latent
            specs = [spec.at_latent(int(shape[-2]), int(shape[-1])) for spec in specs]
        if self.meta.batch == PAIRS_AXIS:  # ... and its rows the call's CFG pairs
            specs = [spec.with_rows(shape[0] // 2) for spec in specs]
        values = self.driver.inputs(call, specs, "cpu")
        feed.update({spec.name: value.numpy() for spec, value in zip(specs, values, strict=True)
                     if call.plans is not None or spec.draw not in ("plan_slot", "plan_weight", "reuse")})
        device = sample.device if isinstance(sample, torch.Tensor) else torch.device("cpu")
        result, extras = self._run(feed, device)
        plans = (extras[0], extras[1]) if self._keeps_plans else None
        self.driver.finish(call, result, plans, int(self.meta.channel_axis),
                           self.meta.noise_channels)
        if isinstance(sample, np.ndarray):  # diffusers' ONNX pipelines: NumPy in, a list of arrays out
            return [result.numpy()]
        return _Output(sample=result) if return_dict else (result,)
