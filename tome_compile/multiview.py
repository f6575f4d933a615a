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

__all__ = ["RefOnlyNoisedUNet", "ReferenceOnlyAttnProc", "build_zero123", "zero123_inputs"]


class ReferenceOnlyAttnProc:
    """Wraps a standard processor; with ``enabled`` (every ``attn1``): "w" stores the attention's
    input under its name, "r" reads keys and values from ``cat([input, stored], dim=1)``. With
    ``is_cfg_guidance`` the first (unconditional) row runs without the reference."""

    def __init__(self, chained: Any, enabled: bool, name: str) -> None:
        self.chained, self.enabled, self.name = chained, enabled, name

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, mode: str = "w", ref_dict: dict | None = None,
                 is_cfg_guidance: bool = False, **kwargs: Any) -> torch.Tensor:
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
        unet.set_attn_processor({name: ReferenceOnlyAttnProc(AttnProcessor2_0(), name.endswith("attn1.processor"), name)
                                 for name in unet.attn_processors})

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                class_labels: torch.Tensor | None = None, *, cross_attention_kwargs: dict, **kwargs: Any) -> Any:
        cond_lat = cross_attention_kwargs["cond_lat"]
        is_cfg_guidance = cross_attention_kwargs.get("is_cfg_guidance", False)
        noise = torch.randn_like(cond_lat)
        noisy = self.train_sched.add_noise(cond_lat, noise, timestep.reshape(-1))
        noisy = self.val_sched.scale_model_input(noisy, timestep.reshape(-1))
        ref_dict: dict[str, torch.Tensor] = {}
        cond_states = encoder_hidden_states[1:] if is_cfg_guidance else encoder_hidden_states
        self.unet(noisy, timestep, encoder_hidden_states=cond_states, class_labels=class_labels,
                  cross_attention_kwargs={"mode": "w", "ref_dict": ref_dict}, **kwargs)
        return self.unet(sample, timestep, encoder_hidden_states, class_labels=class_labels,
                         cross_attention_kwargs={"mode": "r", "ref_dict": ref_dict,
                                                 "is_cfg_guidance": is_cfg_guidance}, **kwargs)


def build_zero123(unet: torch.nn.Module, steps: int = 28) -> RefOnlyNoisedUNet:
    """The wrapper around ``unet`` with Zero123++'s schedulers (DDPM to noise the condition latent,
    Euler ancestral to scale it; ``steps`` of the pipeline)."""
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler

    val = EulerAncestralDiscreteScheduler(timestep_spacing="trailing")
    val.set_timesteps(steps)
    return RefOnlyNoisedUNet(unet, DDPMScheduler(), val).eval()


def zero123_inputs(wrapper: RefOnlyNoisedUNet, *, batch: int = 2, view: int = 320, seq_len: int = 77, seed: int = 0,
                   device: str | torch.device = "cpu") -> tuple[torch.Tensor, dict[str, Any]]:
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
