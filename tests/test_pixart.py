"""PixArt-α (a DiT): one token grid for every block, so ``blocks=`` selects; adaLN modulation
between norm1 and attn1; cross-attention queries merged with the block's plan."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import compiled, run, tiny_pixart, tiny_pixart_inputs
from test_importance import RecordingCompiler
from video_reference import per_frame_tome

from tome_compile import ToMeConfig, ToMeConfigError, tome_backend
from tome_compile.guidance import importance_map

SELECTED = re.compile(r"^transformer_blocks\.[12]$")




@pytest.mark.parametrize("options, rewritten", [
    (dict(blocks=range(1, 3), merge_crossattn=True),
     ["transformer_blocks.1.attn1", "transformer_blocks.1.attn2", "transformer_blocks.2.attn1",
      "transformer_blocks.2.attn2"]),
    (dict(blocks=(1, 2)), ["transformer_blocks.1.attn1", "transformer_blocks.2.attn1"]),
    (dict(), [f"transformer_blocks.{k}.attn1" for k in range(4)]),  # the patch grid is full resolution
])
def test_block_selection_and_sites(options, rewritten):
    model, backend = compiled(tiny_pixart(), ratio=0.5, **options)
    latent, kwargs = tiny_pixart_inputs()
    run(model, latent, kwargs)
    (report,) = backend.reports
    assert [s.path for s in report.rewritten] == rewritten
    assert all(s.tokens == 64 and s.tokens_after == 32 for s in report.rewritten)
    assert report.count_nodes("merge") == report.count_nodes("unmerge") == len(rewritten)
    skipped = {s.path: s.reason for s in report.sites if not s.rewritten and s.kind == "self-attention"}
    if "blocks" in options:
        assert skipped == {"transformer_blocks.0.attn1": "block 0 is not in blocks=1-2",
                           "transformer_blocks.3.attn1": "block 3 is not in blocks=1-2"}
    rewritten_row = report.rewritten[0]
    assert rewritten_row.grid == (8, 8) and rewritten_row.downsample == 1  # 16 x 16 latent, patch 2


@pytest.mark.parametrize("cross", [True, False])
def test_equals_the_loop_reference(cross):
    dit = tiny_pixart()
    latent, kwargs = tiny_pixart_inputs()
    model, _ = compiled(dit, ratio=0.5, use_rand=False, blocks=range(1, 3), merge_crossattn=cross)
    ref = per_frame_tome(dit, 0.5, select=SELECTED, patch=2, cross=cross)
    out = run(model, latent, kwargs)
    assert (out - run(ref, latent, kwargs)).abs().max() < 1e-4
    assert (out - run(dit, latent, kwargs)).abs().max() > 1e-3


def test_ratio_zero_is_bit_identical_and_bad_blocks_are_refused():
    dit = tiny_pixart()
    latent, kwargs = tiny_pixart_inputs()
    model, _ = compiled(dit, ratio=0.0, blocks=range(7, 21))
    assert torch.equal(run(model, latent, kwargs), run(dit, latent, kwargs))
    assert ToMeConfig(blocks=range(7, 21)).blocks == tuple(range(7, 21))
    for bad in ((-1,), ("7",), 7, (True,)):
        with pytest.raises(ToMeConfigError, match="blocks="):
            ToMeConfig(blocks=bad)


def test_importance_reads_the_noise_half_of_a_learned_sigma_output():
    dit = tiny_pixart()
    latent, kwargs = tiny_pixart_inputs()
    recorder = RecordingCompiler()
    backend = tome_backend(0.5, compiler=recorder, method="importance", pool_factor=1.0, blocks=range(1, 3),
                           merge_crossattn=True, seed=3)
    model = torch.compile(copy.deepcopy(dit), backend=backend, fullgraph=True)
    plain_tome, _ = compiled(
        dit, ratio=0.5, pool_factor=1.0, blocks=range(1, 3), merge_crossattn=True, seed=3
    )
    rng = torch.get_rng_state()
    outs = []
    for t in (999, 900, 800):
        kwargs["timestep"] = torch.tensor([t, t])
        outs.append(run(model, latent, kwargs))
    assert torch.equal(torch.get_rng_state(), rng)
    kwargs["timestep"] = torch.tensor([999, 999])
    assert torch.equal(outs[0], run(plain_tome, latent, kwargs))  # first step: the ToMe fallback
    tome_graph, imp_graph = recorder.graphs
    assert len(tome_graph["calls"]) == 1 and len(imp_graph["calls"]) == 2
    for k in (0, 1):
        used = imp_graph["calls"][k]["tome_importance"]
        eps = outs[k][:, :4]  # [eps; variance]: the guidance map is the noise's
        assert used.shape == (1, 16, 16) and torch.allclose(used[0], (eps[1] - eps[0]).abs().mean(0))
        assert not torch.allclose(used, importance_map(outs[k]))  # all 8 channels would differ
    assert not torch.equal(outs[2], run(plain_tome, latent, kwargs))


def test_pixart_pipeline_end_to_end_without_recompiles():
    from diffusers import AutoencoderKL, DDIMScheduler, PixArtAlphaPipeline
    from torch._dynamo.utils import counters

    vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8,
                        sample_size=16)
    pipe = PixArtAlphaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=tiny_pixart(),
                               scheduler=DDIMScheduler())
    backend = tome_backend(0.5, compiler="eager", method="importance", pool_factor=1.0, blocks=range(1, 3),
                           merge_crossattn=True, seed=0)
    pipe.transformer = torch.compile(pipe.transformer, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    counters.clear()
    images = pipe(prompt=None, negative_prompt=None, prompt_embeds=torch.randn(1, 7, 32, generator=g),
                  prompt_attention_mask=torch.ones(1, 7), negative_prompt_embeds=torch.zeros(1, 7, 32),
                  negative_prompt_attention_mask=torch.ones(1, 7), num_inference_steps=4, guidance_scale=4.5,
                  height=16, width=16, output_type="latent", generator=g, use_resolution_binning=False).images
    assert images.shape == (1, 4, 16, 16) and torch.isfinite(images).all()
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0
    assert [r.method for r in backend.reports] == ["tome", "importance"] and backend.importance.calls == 4
    assert len(backend.reports[0].rewritten) == 4


@pytest.mark.parametrize("method", ["tome", "importance"])
def test_onnx_runtime_equals_the_compiled_backend_call_by_call(tmp_path, method):
    from tome_compile.export import ToMeSession, export_onnx

    dit = tiny_pixart()
    config = ToMeConfig(
        ratio=0.5, method=method, seed=0, blocks=(1, 2), merge_crossattn=True, pool_factor=1.0
    )
    result = export_onnx(
        copy.deepcopy(dit),
        tmp_path / "pixart.onnx",
        config,
        height=128,
        width=128,
        seq_len=7,
        atol=1e-4,
        partition_input=True,
    )
    assert result.input_names[:4] == ["sample", "timestep", "encoder_hidden_states", "encoder_attention_mask"]
    assert len(result.report.rewritten) == 4
    assert result.fused_attention == 4  # the self-attentions; the masked cross-attentions stay plain ONNX
    session = ToMeSession(result.path, seed=5)
    model, backend = compiled(dit, ratio=config.replace(seed=5))
    latent, kwargs = tiny_pixart_inputs()
    kwargs["encoder_attention_mask"] = torch.tensor([[1.0] * 5 + [0.0] * 2] * 2)  # padded text
    for t in (999, 900, 800):  # as the pipeline calls it: hidden_states=, a timestep per image
        kwargs["timestep"] = torch.tensor([t, t])
        got = session(hidden_states=latent, **kwargs).sample
        expected = run(model, latent, kwargs)
        assert got.shape == (2, 8, 16, 16) and (got - expected).abs().max() < 1e-4
    if method == "importance":
        assert session.meta.noise_channels == 4
        assert torch.allclose(session.importance.map, backend.importance.map, atol=1e-5)
