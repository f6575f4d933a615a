"""Multi-view generation (Zero123++): a stand-in for the wrapper its diffusers pipeline puts around
the U-Net, written from the pipeline's public description (``sudo-ai/zero123plus``), for the
tests and the benchmark. Users run the pipeline's own: ``pipe.prepare()`` wraps ``pipe.unet``,
then ``pipe.unet = torch.compile(pipe.unet, backend=tome_backend(...))``.

Six 320 x 320 views are tiled 3 rows x 2 columns in one latent (120 x 80). Every call runs the
U-Net twice: over the condition image's latent noised to the call's timestep in "write" mode (each
``attn1`` stores its input), then over the sample in "read" mode (each ``attn1``'s keys and values
read ``cat([its input, the stored reference], dim=1)``). The ToMe pass merges the read pass's view
tokens and keeps the reference tokens whole; the write pass is left alone (its inputs are the
references).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from tome_compile.errors import ToMeModelError

__all__ = ["MultiViewExport", "RefOnlyNoisedUNet", "ReferenceOnlyAttnProc", "build_zero123", "load_multiview",
           "two_passes", "zero123_inputs"]


class ReferenceOnlyAttnProc:
    """Wraps a standard processor; with ``enabled`` (every ``attn1``): "w" stores the attention's
    input under its name, "r" reads keys and values from ``cat([input, stored], dim=1)``. With
    ``is_cfg_guidance`` the first (unconditional) row runs without the reference."""

    def __init__(self, chained: Any, enabled: bool, name: str) -> None:
        self.chained, self.enabled, self.name = chained, enabled, name

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mode: str = "w",
        ref_dict: dict | None = None,
        is_cfg_guidance: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        if self.enabled and is_cfg_guidance:
            first = self.chained(attn, hidden_states[:1], encoder_hidden_states[:1], attention_mask)
            hidden_states, encoder_hidden_states = hidden_states[1:], encoder_hidden_states[1:]
        if self.enabled:
            if mode == "w":
                ref_dict[self.name] = encoder_hidden_states
            elif mode == "r":
                encoder_hidden_states = torch.cat([encoder_hidden_states, ref_dict.pop(self.name)], dim=1)
        out = self.chained(attn, hidden_states, encoder_hidden_states, attention_mask)
        if self.enabled and is_cfg_guidance:
            out = torch.cat([first, out])
        return out


class RefOnlyNoisedUNet(torch.nn.Module):
    """The wrapper the pipeline puts around its U-Net (``pipe.prepare()``): two passes per call."""

    def __init__(self, unet: torch.nn.Module, train_sched: Any, val_sched: Any) -> None:
        super().__init__()
        self.unet, self.train_sched, self.val_sched = unet, train_sched, val_sched
        unet.set_attn_processor(
            {
                name: ReferenceOnlyAttnProc(AttnProcessor2_0(), name.endswith("attn1.processor"), name)
                for name in unet.attn_processors
            }
        )

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        class_labels: torch.Tensor | None = None,
        *,
        cross_attention_kwargs: dict,
        **kwargs: Any,
    ) -> Any:
        cond_lat = cross_attention_kwargs["cond_lat"]
        is_cfg_guidance = cross_attention_kwargs.get("is_cfg_guidance", False)
        noise = torch.randn_like(cond_lat)
        noisy = self.train_sched.add_noise(cond_lat, noise, timestep.reshape(-1))
        noisy = self.val_sched.scale_model_input(noisy, timestep.reshape(-1))
        return two_passes(
            self.unet, noisy, sample, timestep, encoder_hidden_states, class_labels, is_cfg_guidance, **kwargs
        )


def two_passes(
    unet: torch.nn.Module,
    noisy_cond_lat: torch.Tensor,
    sample: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    class_labels: torch.Tensor | None = None,
    is_cfg_guidance: bool = False,
    **kwargs: Any,
) -> Any:
    """The wrapper's two U-Net passes: "w" over the noised condition latent (every ``attn1``
    stores its input), then "r" over the sample (keys and values read the stored reference)."""
    ref_dict: dict[str, torch.Tensor] = {}
    cond_states = encoder_hidden_states[1:] if is_cfg_guidance else encoder_hidden_states
    unet(noisy_cond_lat, timestep, encoder_hidden_states=cond_states, class_labels=class_labels,
         cross_attention_kwargs={"mode": "w", "ref_dict": ref_dict}, **kwargs)
    return unet(
        sample,
        timestep,
        encoder_hidden_states,
        class_labels=class_labels,
        cross_attention_kwargs={"mode": "r", "ref_dict": ref_dict, "is_cfg_guidance": is_cfg_guidance},
        **kwargs,
    )


class MultiViewExport(torch.nn.Module):
    """The Zero123++ wrapper in an exportable form: every input explicit, nothing data-dependent.

    ``forward(sample, timestep, encoder_hidden_states, cond_lat, noise)`` runs what the wrapper runs
    per call, with the noise of the condition latent an input (the wrapper draws it with
    ``torch.randn_like``: a random op would break parity with PyTorch) and the two scheduler calls
    in closed form: the training scheduler's ``add_noise`` (``sqrt(ac[t]) x + sqrt(1 - ac[t]) n``)
    and the pipeline scheduler's ``scale_model_input`` (divide by ``sqrt(sigma(t)^2 + 1)``, sigma
    interpolated over the training sigmas at ``t`` as Euler schedulers set theirs) — the
    scheduler's own code looks the step up with ``nonzero`` / ``.item()``, which no exporter keeps.
    The closed form is checked against the scheduler's sigmas at construction.

    Args:
        wrapper: the pipeline's wrapper (anything with ``unet``, ``train_sched``, ``val_sched``:
            Zero123++'s ``RefOnlyNoisedUNet`` or :class:`RefOnlyNoisedUNet`), after ``prepare()``.
        is_cfg_guidance: the wrapper's flag: the first (unconditional) row reads no reference.
    """

    extra_inputs = ("cond_lat", "noise")

    def __init__(self, wrapper: Any, *, is_cfg_guidance: bool = False) -> None:
        super().__init__()
        self.unet, self.is_cfg_guidance = wrapper.unet, is_cfg_guidance
        train, val = wrapper.train_sched, wrapper.val_sched
        ac = train.alphas_cumprod.to(torch.float64)
        self.register_buffer("sqrt_ac", ac.sqrt().float(), persistent=False)
        self.register_buffer("sqrt_one_minus_ac", (1 - ac).sqrt().float(), persistent=False)
        val_ac = val.alphas_cumprod.to(torch.float64)
        sigmas = ((1 - val_ac) / val_ac).sqrt()
        self.register_buffer("sigmas", sigmas.float(), persistent=False)
        timesteps = getattr(val, "timesteps", None)
        if timesteps is not None and hasattr(val, "sigmas") and len(val.sigmas) == len(timesteps) + 1:
            ours = self.sigma(timesteps.to(torch.float32).reshape(-1)).double()
            theirs = val.sigmas[:-1].to(torch.float64)
            if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6):
                worst = float((ours - theirs).abs().max())
                raise ToMeModelError(
                    f"{type(val).__name__}'s sigmas are not its training sigmas interpolated at "
                    f"its timesteps (max difference {worst:.3g}): the exportable form computes "
                    "scale_model_input in that closed form; use the pipeline's default "
                    "scheduler (Euler ancestral)"
                )

    @property
    def config(self) -> Any:
        return self.unet.config

    @property
    def dtype(self) -> torch.dtype:
        return self.unet.dtype

    def sigma(self, timestep: torch.Tensor) -> torch.Tensor:
        """The pipeline scheduler's sigma at ``timestep`` (float, [n]): linear interpolation over
        the training sigmas, as Euler schedulers compute theirs."""
        t = timestep.to(torch.float32).clamp(0, len(self.sigmas) - 1)
        low = t.floor().clamp(max=len(self.sigmas) - 2)
        frac = t - low
        low = low.long()
        return self.sigmas[low] * (1 - frac) + self.sigmas[low + 1] * frac

    def noised_condition(
        self, cond_lat: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor
    ) -> torch.Tensor:
        """``val_sched.scale_model_input(train_sched.add_noise(cond_lat, noise, t), t)``, closed form."""
        t = timestep.reshape(-1).to(torch.float32)
        index = t.round().long().clamp(0, len(self.sqrt_ac) - 1)
        shape = (-1,) + (1,) * (cond_lat.dim() - 1)
        noisy = (self.sqrt_ac[index].reshape(shape) * cond_lat.float()
                 + self.sqrt_one_minus_ac[index].reshape(shape) * noise.float())
        scale = (self.sigma(t) ** 2 + 1).rsqrt().reshape(shape)
        return (noisy * scale).to(cond_lat.dtype)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                cond_lat: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor]:
        noisy = self.noised_condition(cond_lat, noise, timestep)
        out = two_passes(self.unet, noisy, sample, timestep, encoder_hidden_states,
                         is_cfg_guidance=self.is_cfg_guidance, return_dict=False)
        return (out[0],)


def build_zero123(unet: torch.nn.Module, steps: int = 28, scheduler: Any = None) -> RefOnlyNoisedUNet:
    """The wrapper around ``unet`` as Zero123++'s ``prepare()`` builds it: ``scheduler`` (default
    Euler ancestral, trailing spacing) scales the condition latent, a DDPM scheduler of the same
    config noises it; ``steps`` of the pipeline."""
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler

    val = scheduler if scheduler is not None else EulerAncestralDiscreteScheduler(timestep_spacing="trailing")
    val.set_timesteps(steps)
    return RefOnlyNoisedUNet(unet, DDPMScheduler.from_config(val.config), val).eval()


def load_multiview(spec: str, *, dtype: torch.dtype = torch.float32) -> tuple[MultiViewExport, str]:
    """``"zero123"`` (the built-in SD 2 U-Net, random weights) or a local folder (a U-Net, or a
    Zero123++ pipeline folder: its ``unet/`` and its ``scheduler/`` config) in the exportable form
    of the two-pass wrapper."""
    from pathlib import Path

    from tome_compile.models import load_unet

    if spec == "zero123":
        unet, description = load_unet("sd21", dtype=dtype)
        description = "Zero123++ wrapper around the built-in sd21 architecture with RANDOM weights"
        scheduler = None
    else:
        unet, description = load_unet(spec, dtype=dtype)
        folder = Path(spec) / "scheduler"
        scheduler = None
        if (folder / "scheduler_config.json").is_file():
            from diffusers import EulerAncestralDiscreteScheduler

            scheduler = EulerAncestralDiscreteScheduler.from_pretrained(folder, local_files_only=True)
        description = f"Zero123++ wrapper around the {description}" + (
            f", scheduler {folder}" if scheduler is not None else ", default Euler ancestral scheduler")
    return MultiViewExport(build_zero123(unet, scheduler=scheduler)), description


def zero123_inputs(
    wrapper: RefOnlyNoisedUNet,
    *,
    batch: int = 2,
    view: int = 320,
    seq_len: int = 77,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(sample, kwargs)`` as the pipeline calls the wrapper: the 3 x 2 tiled views' latent
    ``[B, 4, 3 * view / 8, 2 * view / 8]`` (960 x 640 pictures: 120 x 80), the embeddings and the
    condition latent of one view (its CFG row: a blank image's)."""
    cfg = wrapper.unet.config
    g = torch.Generator().manual_seed(seed)
    v = view // 8
    sample = torch.randn(batch, cfg.in_channels, 3 * v, 2 * v, generator=g)
    ehs = torch.randn(batch, seq_len, cfg.cross_attention_dim, generator=g)
    cond = torch.randn(batch, cfg.in_channels, v, v, generator=g)
    timestep = torch.tensor(int(wrapper.val_sched.timesteps[0]))
    return sample.to(device), {"timestep": timestep.to(device), "encoder_hidden_states": ehs.to(device),
                               "cross_attention_kwargs": {"cond_lat": cond.to(device)}}
