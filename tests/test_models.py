"""Built-in architectures (the real SD 1.5 / 2.1 / SDXL U-Nets) and loading local checkpoints."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_unet

from tome_compile import ToMeModelError
from tome_compile.models import architecture_config, example_inputs, load_unet


@pytest.mark.parametrize("name, params", [
    ("sd15", 859_520_964),   # the published parameter counts of these U-Nets
    ("sd21", 865_910_724),
    ("sdxl", 2_567_463_684),
])
def test_builtin_architectures_are_the_real_ones(name, params):
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):  # shapes only: no 3-10 GB of random weights
        unet = UNet2DConditionModel(**architecture_config(name))
    assert sum(p.numel() for p in unet.parameters()) == params


def test_sdxl_inputs_include_added_conditions():
    unet = tiny_unet("sdxl")
    inputs = example_inputs(unet, batch=2, height=64, width=64)
    assert inputs.text_embeds.shape == (2, 16) and inputs.time_ids.shape == (2, 6)
    assert set(inputs.kwargs()["added_cond_kwargs"]) == {"text_embeds", "time_ids"}


def test_load_unet_and_pipeline_folders(tmp_path):
    unet = tiny_unet("sd15")
    unet.save_pretrained(tmp_path / "pipe" / "unet")
    loaded, description = load_unet(tmp_path / "pipe")  # a pipeline folder: its unet/ is used
    assert "local U-Net" in description and description.endswith("unet")
    for a, b in zip(loaded.state_dict().values(), unet.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec, words", [
    ("/nonexistent/model", "not found"),
    ("sd4", "not found"),
])
def test_load_unet_errors(spec, words):
    with pytest.raises(ToMeModelError, match=words):
        load_unet(spec)


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ToMeModelError, match="no config.json"):
        load_unet(tmp_path / "empty")


def test_unknown_architecture_name():
    with pytest.raises(ToMeModelError, match="built-in ones are"):
        architecture_config("sd4")


def test_each_family_describes_its_inputs_once():
    """#33: one record per model family (tome_compile.families), read by the example inputs, the
    export's tracing / dynamic axes / metadata / batch-1 check and ToMeSession's refusals."""
    from conftest import tiny_pixart, tiny_video_unet
    from test_joint import tiny_flux, tiny_sd3
    from zero123_reference import tiny_zero123

    from tome_compile.families import family_of, needs
    from tome_compile.multiview import MultiViewExport

    models = {"unet": tiny_unet("sd15"), "sdxl": tiny_unet("sdxl"), "pixart": tiny_pixart(),
              "animatediff": tiny_video_unet("animatediff"), "svd": tiny_video_unet("svd"),
              "multiview": MultiViewExport(tiny_zero123()), "sd3": tiny_sd3()[0], "flux": tiny_flux()[0]}
    for name, model in models.items():
        family = family_of(model)
        assert family.name == name
        size = (48, 32) if family.multiview else (128, 128)  # multi-view: 3 x 2 views of 16 x 16
        frames = 2 if family.video_layout else None
        inputs = example_inputs(model, batch=2, height=size[0], width=size[1], seq_len=7, frames=frames)
        assert len(inputs.args()) == len(family.names)  # one example value per input, in graph order
    assert family_of(models["sdxl"]).names[3:] == ["text_embeds", "time_ids"]
    assert family_of(models["multiview"]).per_image == ("sample", "encoder_hidden_states", "cond_lat",
                                                        "noise")
    assert not family_of(models["svd"]).dynamic_batch
    assert family_of(models["pixart"]).timestep == "float32[batch]"
    # SD3: the pooled text embedding, 333 text tokens (77 CLIP + 256 T5) by default, 1/8 of the image
    sd3 = example_inputs(models["sd3"], batch=1, height=128, width=128)
    assert family_of(models["sd3"]).names[3:] == ["pooled_projections"]
    assert sd3.encoder_hidden_states.shape == (1, 333, 32) and sd3.sample.shape == (1, 4, 16, 16)
    # Flux: the packed latent (16 pixels a token), the tokens' positions, 512 T5 tokens by default
    flux = example_inputs(models["flux"], batch=1, height=128, width=192)
    assert family_of(models["flux"]).names[3:] == ["pooled_projections", "img_ids", "txt_ids"]
    assert flux.sample.shape == (1, 96, 16) and flux.grid == (8, 12) and flux.txt_ids.shape == (512, 3)
    assert flux.img_ids[13].tolist() == [0.0, 1.0, 1.0]  # row 1, column 1 of the 8x12 grid
    assert needs("time_ids") == "added_cond_kwargs['time_ids'] (SDXL's size and crop conditioning)"
    assert needs("not_an_input") == "not_an_input"  # negative: an unknown name is said as it is
