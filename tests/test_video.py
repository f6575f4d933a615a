"""Video U-Nets (AnimateDiff's UNetMotionModel, SVD's UNetSpatioTemporalConditionModel): spatial
self-attention merged frame by frame, temporal attention left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CountingCompiler, compiled, run, tiny_video_inputs, tiny_video_unet, tomesd_reference
from test_importance import RecordingCompiler
from video_reference import per_frame_tome, tomesd_per_frame

from tome_compile import tome_backend
from tome_compile.guidance import importance_map

KINDS = ["animatediff", "svd"]
# the full-resolution spatial blocks of the tiny models (16 x 16 latent, 256 tokens per frame)
SPATIAL = ["down_blocks.0.attentions.0.transformer_blocks.0.attn1",
           "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
           "up_blocks.1.attentions.1.transformer_blocks.0.attn1"]




@pytest.mark.parametrize("kind", KINDS)
def test_spatial_sites_rewritten_temporal_left_alone(kind):
    unet = tiny_video_unet(kind)
    sample, kwargs = tiny_video_inputs(kind, frames=4)
    # max_downsample=8: AnimateDiff's 4-frame motion attention at a 16 x 16 latent has 4 tokens,
    # which tomesd's size rule reads as a 2 x 2 grid at downsample 8 — it must still be left alone
    model, backend = compiled(unet, ratio=0.5, max_downsample=8)
    run(model, sample, kwargs)
    (report,) = backend.reports
    temporal = [s for s in report.sites if "motion_modules" in s.path or "temporal" in s.path]
    assert temporal and all(not s.rewritten and "temporal attention" in s.reason and "frames" in s.reason
                            for s in temporal)
    assert all(s.tokens == 4 for s in temporal)
    rewritten = [s.path for s in report.rewritten]
    assert set(SPATIAL) <= set(rewritten)
    assert all("motion_modules" not in p and "temporal" not in p for p in rewritten)
    assert report.count_nodes("merge") == report.count_nodes("unmerge") == len(rewritten)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_rand", [False, True])
def test_video_equals_tomesd_per_frame_and_the_per_frame_reference(kind, use_rand):
    unet = tiny_video_unet(kind)
    sample, kwargs = tiny_video_inputs(kind)
    counting = CountingCompiler()
    model, backend = compiled(unet, ratio=0.5, use_rand=use_rand, seed=11, compiler=counting)
    ref = tomesd_per_frame(unet, seed=11 if use_rand else None, ratio=0.5, use_rand=use_rand)
    for t in (999, 800, 600):  # with use_rand one partition per call, shared by batch x frames
        kwargs["timestep"] = torch.tensor(t)
        out = run(model, sample, kwargs)
        assert (out - run(ref, sample, kwargs)).abs().max() < 1e-4
    assert counting.calls == 1  # one graph over the steps: no recompile
    assert [s.path for s in backend.reports[0].rewritten] == SPATIAL
    spec = next((s for s in backend.reports[0].inputs if s.draw == "partition"), None)
    assert (spec is not None) == use_rand
    if use_rand:  # 64 destination cells per 16 x 16 block, one draw for every frame of every video
        assert spec.shape == (3 * 64,)
    assert (out - run(unet, sample, kwargs)).abs().max() > 1e-3  # it did merge
    if not use_rand:
        assert (out - run(per_frame_tome(unet, 0.5), sample, kwargs)).abs().max() < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_tomesd_itself_fails_on_video_unets(kind):
    # what the per-frame reference fixes: tomesd takes its size from sample.shape[2:4]
    unet = tiny_video_unet(kind)
    sample, kwargs = tiny_video_inputs(kind)
    with pytest.raises(ZeroDivisionError):
        run(tomesd_reference(unet, ratio=0.5, use_rand=False), sample, kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_ratio_zero_is_bit_identical(kind):
    unet = tiny_video_unet(kind)
    sample, kwargs = tiny_video_inputs(kind)
    model, _ = compiled(unet, ratio=0.0)
    assert torch.equal(run(model, sample, kwargs), run(unet, sample, kwargs))


@pytest.mark.parametrize("kind", KINDS)
def test_importance_maps_per_frame_fallback_and_reset(kind):
    unet = tiny_video_unet(kind)
    frames = 3
    sample, kwargs = tiny_video_inputs(kind, frames=frames)
    recorder = RecordingCompiler()
    backend = tome_backend(0.5, compiler=recorder, method="importance", seed=5)
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    plain_tome, _ = compiled(unet, ratio=0.5, seed=5)
    rng = torch.get_rng_state()
    outs = []
    for step, t in enumerate([999, 900, 800]):
        kwargs["timestep"] = torch.tensor(t)
        outs.append(run(model, sample, kwargs))
        if step == 0:  # no map yet: a ToMe step
            assert torch.equal(outs[0], run(plain_tome, sample, kwargs))
    assert torch.equal(torch.get_rng_state(), rng)
    tome_graph, imp_graph = recorder.graphs
    assert len(tome_graph["calls"]) == 1 and len(imp_graph["calls"]) == 2
    channel_axis = 1 if kind == "animatediff" else 2
    for k in (0, 1):  # the map of step k+1 is step k's guidance, one map per frame (row b * F + f)
        used = imp_graph["calls"][k]["tome_importance"]
        assert used.shape == (frames, 16, 16)  # batch 2 = one CFG pair x 3 frames
        eps = outs[k]
        for f in range(frames):
            frame = eps[:, :, f] if channel_axis == 1 else eps[:, f]
            assert torch.allclose(used[f], (frame[1] - frame[0]).abs().mean(0))
        assert torch.equal(used, importance_map(eps, channel_axis=channel_axis))
    assert not torch.equal(outs[2], run(plain_tome, sample, kwargs))  # the importance plans differ
    kwargs["timestep"] = torch.tensor(999)  # a new generation: the ToMe fallback again
    run(model, sample, kwargs)
    assert len(tome_graph["calls"]) == 2 and len(imp_graph["calls"]) == 2


@pytest.mark.parametrize("kind, axis", [("animatediff", 1), ("svd", 2)])
@pytest.mark.parametrize("frames", [3, 4])  # 4 frames = 4 output channels: found from the permute
def test_noise_output_channel_axis(kind, axis, frames):
    from conftest import GraphCapture
    from tome_compile.passes import find_unet_io

    unet = tiny_video_unet(kind)
    sample, kwargs = tiny_video_inputs(kind, frames=frames)
    capture = GraphCapture()
    run(torch.compile(unet, backend=capture, fullgraph=True), sample, kwargs)
    io = find_unet_io(capture.graphs[0][0])
    assert (io.channel_axis, io.sample_index, io.timestep_index is not None) == (axis, 0, True)


def test_animatediff_pipeline_end_to_end_without_recompiles():
    from diffusers import AnimateDiffPipeline, AutoencoderKL, DDIMScheduler
    from torch._dynamo.utils import counters

    unet = tiny_video_unet("animatediff")
    vae = AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8,
                        sample_size=16)  # one block: latent = image size
    pipe = AnimateDiffPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, motion_adapter=None,
                               scheduler=DDIMScheduler())
    backend = tome_backend(0.5, compiler="eager", method="importance", seed=0)
    pipe.unet = torch.compile(pipe.unet, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    counters.clear()
    frames = pipe(
        prompt_embeds=torch.randn(1, 7, 32, generator=g),
        negative_prompt_embeds=torch.zeros(1, 7, 32),
        num_frames=3,
        num_inference_steps=4,
        guidance_scale=7.5,
        height=16,
        width=16,
        output_type="latent",
        generator=g,
    ).frames
    assert frames.shape == (1, 4, 3, 16, 16) and torch.isfinite(frames).all()
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0
    assert [r.method for r in backend.reports] == ["tome", "importance"] and backend.importance.calls == 4
    assert backend.importance.map.shape == (3, 16, 16)  # the CFG pair's map, per frame
    assert [s.path for s in backend.reports[0].rewritten] == SPATIAL


@pytest.mark.parametrize("kind, method", [("animatediff", "importance"), ("svd", "tome")])
def test_onnx_runtime_equals_the_compiled_backend_call_by_call(tmp_path, kind, method):
    import onnx
    from tome_compile.export import ToMeSession, export_onnx

    from tome_compile import ToMeConfig

    unet = tiny_video_unet(kind)
    config = ToMeConfig(ratio=0.5, method=method, seed=0)
    # partition_input: the destinations drawn as tome_backend(seed=) draws them (bit-exact)
    result = export_onnx(
        copy.deepcopy(unet),
        tmp_path / "video.onnx",
        config,
        height=128,
        width=128,
        seq_len=7,
        frames=3,
        atol=1e-4,
        partition_input=True,
    )
    assert [s.path for s in result.report.rewritten] == SPATIAL
    assert result.fused_attention == sum(1 for s in result.report.sites)  # temporal attention fused too
    meta = ToMeSession(result.path).meta
    assert (meta.frames, meta.channel_axis, meta.batch) == (3, 1 if kind == "animatediff" else 2, 2)
    if method == "importance":  # one map per frame of the CFG pair; its default has every row
        model = onnx.load(str(result.path), load_external_data=False)
        default = next(i for i in model.graph.initializer if i.name == "tome_importance")
        assert list(default.dims) == [3, 16, 16]
    session = ToMeSession(result.path, seed=5)
    model, backend = compiled(unet, ratio=config.replace(seed=5))
    sample, kwargs = tiny_video_inputs(kind, frames=3)
    for t in (999, 900, 800):  # importance: step 1 the ToMe fallback, then the previous step's maps
        kwargs["timestep"] = torch.tensor(t)
        got, expected = session(sample, **kwargs).sample, run(model, sample, kwargs)
        assert got.shape == expected.shape and (got - expected).abs().max() < 1e-4
        if method == "importance":
            assert torch.allclose(session.importance.map, backend.importance.map, atol=1e-5)
            # the next plans from one map: the two maps differ by float noise (~1e-6), enough to
            # reorder near-equal scores and merge other tokens (0.005 apart at step 3 here)
            backend.importance.map = session.importance.map.clone()
    if method == "importance":
        assert torch.allclose(session.importance.map, backend.importance.map, atol=1e-5)
        assert session.importance.map.shape == (3, 16, 16)
    with pytest.raises(Exception, match="frames=3 is for video U-Nets"):
        from conftest import tiny_unet
        export_onnx(tiny_unet("sd15"), tmp_path / "image.onnx", config, frames=3)


def test_one_video_is_no_cfg_pair_even_with_an_even_frame_count():
    # 1 video x 4 frames = 4 attention rows: even, but no [uncond; cond] pair — fixed destinations
    # (tomesd's rule for a batch without pairs) and no importance graph
    unet = tiny_video_unet("animatediff")
    sample, kwargs = tiny_video_inputs("animatediff", batch=1, frames=4)
    model, backend = compiled(unet, ratio=0.5, method="importance", seed=0)
    with pytest.warns(UserWarning, match="a batch of 1 holds no pair"):  # 1 video, not 4 rows
        out = run(model, sample, kwargs)
    (report,) = backend.reports
    assert all("batch 1 is odd: fixed destinations" in s.reason for s in report.rewritten)
    assert not report.inputs  # no partition drawn, no map
    fixed, _ = compiled(unet, ratio=0.5, use_rand=False)
    assert torch.equal(out, run(fixed, sample, kwargs))
