"""Joint attention (#38): SD3's ``JointTransformerBlock`` concatenates its text and image tokens
into one attention; the pass merges the image tokens only (the text kept whole), at the
concatenation of q, k and v, and unmerges the image part of the attention's output. Flux's double-
and single-stream blocks are merged at the attention op (after its rotary embedding), on the grid
its pipeline gives (its latent comes packed: ``set_packed_grid``)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import call, compiled, tiny_inputs, tiny_unet
from joint_reference import flux_tome, joint_tome
from tome_compile.passes.dataflow import module_path

import tome_compile
from tome_compile import ToMeWarning, tome_backend


def tiny_sd3(qk_norm=None, dual_attention_layers=()):
    """SD3-medium's layout, tiny (SD3.5 Medium's: ``qk_norm="rms_norm"`` and dual-attention blocks)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                  caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                                  pos_embed_max_size=32, qk_norm=qk_norm,
                                  dual_attention_layers=dual_attention_layers)
    inputs = dict(hidden_states=torch.randn(2, 4, 16, 16), encoder_hidden_states=torch.randn(2, 5, 32),
                  pooled_projections=torch.randn(2, 16), timestep=torch.tensor([999.0, 999.0]))
    return model.eval(), inputs


def tiny_flux(grid=(8, 8), batch=1):
    """Flux's layout, tiny: one double-stream and one single-stream block, a packed ``grid``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
    h, w = grid
    tokens = torch.arange(h * w)
    image_ids = torch.stack([torch.zeros(h * w), tokens // w, tokens % w], dim=1).float()
    inputs = dict(hidden_states=torch.randn(batch, h * w, 16),
                  encoder_hidden_states=torch.randn(batch, 5, 32), pooled_projections=torch.randn(batch, 16),
                  timestep=torch.tensor([1.0] * batch), img_ids=image_ids, txt_ids=torch.zeros(5, 3))
    return model.eval(), inputs


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def compile_sd3(model, ratio=0.5, **options):
    backend = tome_backend(ratio, compiler="eager", **options)
    return torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True), backend


@pytest.mark.parametrize("sd35", [False, True])
def test_sd3_merges_the_image_tokens_only_and_equals_the_reference(sd35):
    """SD3-medium (linear projections, then reshapes): the image tokens merged once, at the input of
    to_q / to_k / to_v (what the reference's merge of q, k and v equals). SD3.5 Medium (a qk-norm
    between projection and attention): q, k and v's image parts merged at their concatenation, and
    its dual-attention block's image-only attn2 (a self-attention through a qk-norm) merged as a
    U-Net's."""
    model, inputs = tiny_sd3(*(("rms_norm", (0,)) if sd35 else ()))
    merged, backend = compile_sd3(model, use_rand=False)
    out = run(merged, inputs)
    assert (out - run(joint_tome(model, 0.5), inputs)).abs().max() < 1e-5
    assert (out - run(model, inputs)).abs().max() > 1e-3  # it does merge
    (report,) = backend.reports
    joint = [(f"transformer_blocks.{k}.attn", "joint-attention", 64, 32, (8, 8)) for k in range(2)]
    if sd35:
        joint.insert(1, ("transformer_blocks.0.attn2", "self-attention", 64, 32, (8, 8)))
    assert [(s.path, s.kind, s.tokens, s.tokens_after, s.grid) for s in report.rewritten] == joint
    assert all(s.reason.startswith("joint attention, image 64 → 32, text 5 kept; downsample 1")
               for s in report.rewritten if s.kind == "joint-attention")
    merges = [n for n in report.graph_module.graph.nodes if n.meta.get("tome", {}).get("role") == "merge"]
    readers = [sorted(module_path(u) for u in n.users) for n in merges]
    if not sd35:  # one merge per block, read by the image projections alone
        assert readers == [[f"transformer_blocks.{k}.attn.to_{p}" for p in "kqv"] for k in range(2)]
    else:  # q, k and v each merged where it is concatenated with the text's; attn2's input once
        assert sum(all(u.target in (torch.cat, torch.concat) for u in n.users) for n in merges) == 6
        assert ["transformer_blocks.0.attn2.to_k", "transformer_blocks.0.attn2.to_q",
                "transformer_blocks.0.attn2.to_v"] in readers and len(merges) == 7
    assert report.count_nodes("unmerge") == len(joint)  # each attention's output, once


def test_sd3_ratio_zero_is_the_plain_model_and_blocks_select():
    model, inputs = tiny_sd3()
    plain, backend = compile_sd3(model, ratio=0.0)
    assert torch.equal(run(plain, inputs), run(model, inputs))
    assert not backend.reports or not any(r.modified for r in backend.reports)
    one, backend = compile_sd3(model, use_rand=False, blocks=(1,))
    out = run(one, inputs)
    (report,) = backend.reports
    assert [s.path for s in report.rewritten] == ["transformer_blocks.1.attn"]
    (skipped,) = [s for s in report.sites if not s.rewritten]
    assert skipped.reason == "block 0 is not in blocks=1"
    ref = joint_tome(model, 0.5, select=re.compile(r"^transformer_blocks\.1$"))
    assert (out - run(ref, inputs)).abs().max() < 1e-5


def test_sd3_oracle_and_todo():
    """The oracle (benchmark bound) keeps the first N - r image tokens of each of q, k, v; ToDo on
    joint attention is not built and says so (the model runs plain)."""
    from tome_compile import ToMeBackend, ToMeConfig

    model, inputs = tiny_sd3()
    backend = ToMeBackend(ToMeConfig(0.5, use_rand=False), compiler="eager", oracle=True)
    oracle = torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True)
    assert run(oracle, inputs).shape == (2, 4, 16, 16)
    assert [s.tokens_after for s in backend.reports[0].rewritten] == [32, 32]
    todo, backend = compile_sd3(model, method="todo")
    with pytest.warns(ToMeWarning, match="ToDo on joint attention is not built"):
        out = run(todo, inputs)
    assert torch.equal(out, run(model, inputs))


def tiny_vae():
    """A 2-stage VAE of 4 latent channels (the tiny pipelines' latent: 1/2 of the image)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                         latent_channels=4, norm_num_groups=8, sample_size=32).eval()


def tiny_sd3_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    model, _ = tiny_sd3()
    vae = tiny_vae()
    pipe = StableDiffusion3Pipeline(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                                    text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                    text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    kwargs = dict(prompt_embeds=torch.randn(1, 5, 32, generator=g),
                  negative_prompt_embeds=torch.randn(1, 5, 32, generator=g),
                  pooled_prompt_embeds=torch.randn(1, 16, generator=g),
                  negative_pooled_prompt_embeds=torch.randn(1, 16, generator=g),
                  height=64, width=64, num_inference_steps=3, output_type="latent")
    return pipe, kwargs


@pytest.mark.parametrize("options", [dict(seed=3), dict(method="importance", seed=3),
                                     dict(plan_every=2, seed=3)])
def test_apply_on_a_stable_diffusion_3_pipeline(options):
    """As StableDiffusion3Pipeline calls it (CFG rows, a tensor timestep per image, 3 steps): one
    graph for every step and image; the same seed gives the same image; a batch of two prompts;
    remove(pipe) gives the plain pipeline back, bit for bit."""
    pipe, kwargs = tiny_sd3_pipeline()

    def image(**more):
        return pipe(**{**kwargs, **more}, generator=torch.Generator().manual_seed(1)).images

    plain = image()
    tome_compile.apply(pipe, 0.5, compiler="eager", **options)
    torch._dynamo.utils.counters.clear()
    first = image()
    assert torch.equal(image(), first)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # every step, both images
    assert (first - plain).abs().max() > 1e-3
    two = {k: v.repeat(2, *[1] * (v.dim() - 1)) for k, v in kwargs.items() if torch.is_tensor(v)}
    assert image(**two).shape == (2, 4, 32, 32)  # two prompts: batch 4 with the CFG rows
    report = pipe.tome.reports[-1]
    assert [s.tokens_after for s in report.rewritten] == [128, 128]
    assert report.method == options.get("method", "tome")
    tome_compile.remove(pipe)
    assert torch.equal(image(), plain)


def compile_flux(model, grid, ratio=0.5, **options):
    model = copy.deepcopy(model)
    tome_compile.set_packed_grid(model, grid)
    backend = tome_backend(ratio, compiler="eager", **options)
    return torch.compile(model, backend=backend, fullgraph=True), backend


def test_flux_merges_the_image_tokens_after_the_rotary_embedding_and_equals_the_reference():
    """Flux (a 6x8 packed grid, two images): its double-stream block (q, k, v concatenated, then
    rotated) and its single-stream block (the streams concatenated before the projections) merge
    their image tokens at the attention op, each rotated at its own position, the text whole —
    as the eager reference written from #38's description does; ``blocks=`` selects among both."""
    grid = (6, 8)
    model, inputs = tiny_flux(grid, batch=2)
    merged, backend = compile_flux(model, grid, use_rand=False)
    out = run(merged, inputs)
    assert (out - run(flux_tome(model, 0.5, grid), inputs)).abs().max() < 1e-5
    assert (out - run(model, inputs)).abs().max() > 1e-3  # it does merge
    (report,) = backend.reports
    assert [(s.path, s.kind, s.tokens, s.tokens_after, s.grid) for s in report.rewritten] == [
        ("transformer_blocks.0.attn", "joint-attention", 48, 24, (6, 8)),
        ("single_transformer_blocks.0.attn", "joint-attention", 48, 24, (6, 8))]
    assert report.rewritten[0].reason.startswith("joint attention, image 48 → 24, text 5 kept; ")
    assert report.rewritten[1].reason.startswith(
        "single-stream joint attention, image 48 → 24, text 5 kept; ")
    gm = report.graph_module
    roles = [(n.meta["tome"]["role"], n.meta["tome"]["site"]) for n in gm.graph.nodes
             if "tome" in n.meta and n.meta["tome"]["role"] in ("merge", "unmerge")]
    for site in ("transformer_blocks.0.attn", "single_transformer_blocks.0.attn"):
        assert sorted(r for r, p in roles if p == site) == ["merge"] * 3 + ["unmerge"]
    merges = [n for n in gm.graph.nodes if n.meta.get("tome", {}).get("role") == "merge"]
    assert all(n.target is tome_compile.merge.merge_joint for n in merges)
    assert all(any(u.target is torch._C._nn.scaled_dot_product_attention for u in n.users) for n in merges)
    # blocks=(1,): the single-stream block alone, as the reference merging it alone
    single = re.compile(r"^single_transformer_blocks\.\d+$")
    merged, backend = compile_flux(model, grid, use_rand=False, blocks=(1,))
    assert (run(merged, inputs) - run(flux_tome(model, 0.5, grid, single), inputs)).abs().max() < 1e-5
    assert [s.path for s in backend.reports[0].rewritten] == ["single_transformer_blocks.0.attn"]
    # ratio 0: the plain transformer, bit for bit
    zero, _ = compile_flux(model, grid, ratio=0.0)
    assert torch.equal(run(zero, inputs), run(model, inputs))


def test_flux_without_its_grid_is_reported_and_another_grid_is_another_graph():
    """Negative: compiled without its grid, Flux's tokens are not told apart — both blocks reported
    (the reason names the fix), the plain output bit for bit. A transposed grid (same token count)
    is another graph, never the first grid's plans. A U-Net shows no joint attention."""
    model, inputs = tiny_flux((4, 8))
    backend = tome_backend(0.5, compiler="eager")
    with pytest.warns(ToMeWarning, match="rewrote nothing: .*set_packed_grid"):
        got = run(torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True), inputs)
    assert torch.equal(got, run(model, inputs))
    (result,) = backend.reports
    assert {s.kind for s in result.sites} == {"joint-attention"} and not result.rewritten
    assert all("no patch grid to tell its image tokens from its text tokens" in s.reason
               for s in result.sites)
    merged, backend = compile_flux(model, (4, 8), use_rand=False)
    run(merged, inputs)
    tome_compile.set_packed_grid(merged._orig_mod, (8, 4))
    transposed = dict(inputs, img_ids=tiny_flux((8, 4))[1]["img_ids"])
    assert (run(merged, transposed) - run(flux_tome(model, 0.5, (8, 4)), transposed)).abs().max() < 1e-5
    assert [r.rewritten[0].grid for r in backend.reports] == [(4, 8), (8, 4)]
    with pytest.raises(tome_compile.ToMeConfigError, match=r"packed grid \(0, 4\): give two positive ints"):
        tome_compile.set_packed_grid(model, (0, 4))
    # negative: a U-Net's self- and cross-attention are never read as joint attention
    unet = tiny_unet()
    unet_model, unet_backend = compiled(unet, ratio=0.5, use_rand=False)
    call(unet_model, tiny_inputs(unet))
    assert {s.kind for s in unet_backend.reports[0].sites} == {"self-attention", "cross-attention"}


def tiny_flux_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    model, _ = tiny_flux()
    vae = tiny_vae()
    pipe = FluxPipeline(transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    kwargs = dict(prompt_embeds=torch.randn(1, 5, 32, generator=g),
                  pooled_prompt_embeds=torch.randn(1, 16, generator=g), height=32, width=48,
                  num_inference_steps=3, output_type="latent")
    return pipe, kwargs


def test_apply_on_a_flux_pipeline():
    """As FluxPipeline calls it (a packed 8x12 latent, 3 steps): the grid comes from the pipeline,
    one graph for every step and image, the same seed gives the same image; the transposed size is
    another graph on its own grid; two prompts are two images, never a CFG pair — importance says
    so and makes ToMe plans; remove(pipe) gives the plain pipeline back, bit for bit."""
    pipe, kwargs = tiny_flux_pipeline()

    def image(**more):
        return pipe(**{**kwargs, **more}, generator=torch.Generator().manual_seed(1)).images

    plain = image()
    tome_compile.apply(pipe, 0.5, compiler="eager", seed=3)
    torch._dynamo.utils.counters.clear()
    first = image()
    assert torch.equal(image(), first)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert (first - plain).abs().max() > 1e-3
    assert [(s.grid, s.tokens_after) for s in pipe.tome.reports[-1].rewritten] == [((8, 12), 48)] * 2
    assert image(height=48, width=32).shape == (1, 96, 16)
    assert [s.grid for s in pipe.tome.reports[-1].rewritten] == [(12, 8)] * 2
    tome_compile.apply(pipe, 0.5, compiler="eager", method="importance", seed=3)
    two = dict(prompt_embeds=kwargs["prompt_embeds"].repeat(2, 1, 1),
               pooled_prompt_embeds=kwargs["pooled_prompt_embeds"].repeat(2, 1))
    with pytest.warns(ToMeWarning, match="importance"):
        assert image(**two).shape == (2, 96, 16)
    assert pipe.tome.reports[-1].rewritten
    tome_compile.remove(pipe)
    assert torch.equal(image(), plain)
    assert "forward" not in vars(pipe.transformer) and "_prepare_latent_image_ids" not in vars(pipe)


def test_sd3_tome_export_runs_in_onnx_runtime_as_in_pytorch_at_every_size(tmp_path):
    """tome-export of an SD3 transformer: every joint attention rewritten and fused (ONNX Runtime's
    MultiHeadAttention over the merged image tokens and the text); one file for every image size
    and text length, its numbers PyTorch's at the traced size and at another, non-square one."""
    import onnx
    from export_helpers import ort_session
    from tome_compile.export import export_onnx

    from tome_compile import ToMeConfig, ToMeExportError

    model, inputs = tiny_sd3()
    result = export_onnx(model, tmp_path / "sd3.onnx", ToMeConfig(0.5, use_rand=False), height=128, width=128,
                         batch=2, seq_len=5)
    assert [s.kind for s in result.report.rewritten] == ["joint-attention"] * 2
    assert result.fused_attention == 2 and result.parity_max_abs < 1e-4
    assert result.input_names == ["sample", "timestep", "encoder_hidden_states", "pooled_projections"]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(str(result.path), load_external_data=False).graph.input}
    assert dims["sample"] == [2, 4, "height", "width"]
    assert dims["encoder_hidden_states"] == [2, "sequence_length", 32]
    session = ort_session(result.path)
    g = torch.Generator().manual_seed(1)
    other = dict(hidden_states=torch.randn(2, 4, 24, 16, generator=g),
                 encoder_hidden_states=torch.randn(2, 3, 32, generator=g),
                 pooled_projections=torch.randn(2, 16, generator=g), timestep=torch.tensor([999.0, 500.0]))
    for given, tokens in ((inputs, 64), (other, 96)):
        feed = {"sample": given["hidden_states"], "timestep": given["timestep"],
                "encoder_hidden_states": given["encoder_hidden_states"],
                "pooled_projections": given["pooled_projections"]}
        (got,) = session.run(None, {k: v.numpy() for k, v in feed.items()})
        merged, backend = compile_sd3(model, use_rand=False)
        want = run(merged, given)
        assert got.shape == tuple(given["hidden_states"].shape)
        assert abs(torch.from_numpy(got) - want).max() < 1e-4
        assert (want - run(model, given)).abs().max() > 1e-3  # merged, not the plain model
        assert [s.tokens for s in backend.reports[0].rewritten] == [tokens] * 2
    # the file as StableDiffusion3Pipeline's transformer (ToMeSession, 32x32 latent, CFG, 3 steps)
    # gives the images of the pipeline compiled with the same settings
    pipe, kwargs = tiny_sd3_pipeline()
    tome_compile.apply(pipe, onnx=result.path)
    compiled_pipe, _ = tiny_sd3_pipeline()
    tome_compile.apply(compiled_pipe, 0.5, compiler="eager", use_rand=False)
    images = [p(**kwargs, generator=torch.Generator().manual_seed(1)).images for p in (pipe, compiled_pipe)]
    assert images[0].shape == (1, 4, 32, 32) and (images[0] - images[1]).abs().max() < 1e-4
    # negative: a size off the patch grid (SD3 would run, cropped) is refused, nothing written
    with pytest.raises(ToMeExportError, match=r"^height=120, width=128: the traced latent 15x16 must be "
                                              r"a multiple of 2 \(the U-Net's downsampling, a DiT's patch"):
        export_onnx(model, tmp_path / "off.onnx", ToMeConfig(0.5), height=120, width=128, seq_len=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sd3.onnx", "sd3.onnx.data"]


def test_flux_tome_export_runs_in_onnx_runtime_and_as_its_pipelines_transformer(tmp_path):
    """tome-export of a Flux transformer (a fixed size: the grid is traced in): both blocks
    rewritten and fused, the rotary embedding in the graph; the file through ToMeSession equals
    the backend, and as FluxPipeline's transformer the compiled pipeline. Negative: the transposed
    grid (the same token count) is refused in one line, never merged on the traced grid."""
    from tome_compile.export import export_onnx
    from tome_compile.export.session import ToMeSession

    from tome_compile import ToMeConfig, ToMeExportError

    pipe, kwargs = tiny_flux_pipeline()
    model = copy.deepcopy(pipe.transformer)
    # the tiny pipeline's VAE downsamples 2x: its 32x48 image is the 8x12 grid of a 128x192 Flux image
    result = export_onnx(pipe.transformer, tmp_path / "flux.onnx", ToMeConfig(0.5, use_rand=False),
                         height=128, width=192, batch=1, seq_len=5)
    assert [(s.path, s.tokens, s.tokens_after) for s in result.report.rewritten] == [
        ("transformer_blocks.0.attn", 96, 48), ("single_transformer_blocks.0.attn", 96, 48)]
    assert result.fused_attention == 2 and result.parity_max_abs < 1e-4
    assert result.input_names == ["sample", "timestep", "encoder_hidden_states", "pooled_projections",
                                  "img_ids", "txt_ids"]
    session = ToMeSession(result.path)
    _, inputs = tiny_flux((8, 12))
    merged, _ = compile_flux(model, (8, 12), use_rand=False)
    got = session(**inputs, return_dict=False)[0]
    assert (got - run(merged, inputs)).abs().max() < 1e-4
    assert (got - run(model, inputs)).abs().max() > 1e-3
    with pytest.raises(ToMeExportError, match=r"^img_ids describe a 12x8 token grid; this export merges on "
                                              r"the 8x12 grid it was traced at"):
        session(**tiny_flux((12, 8))[1])
    tome_compile.apply(pipe, onnx=result.path)
    compiled_pipe, _ = tiny_flux_pipeline()
    tome_compile.apply(compiled_pipe, 0.5, compiler="eager", use_rand=False)
    images = [p(**kwargs, generator=torch.Generator().manual_seed(1)).images for p in (pipe, compiled_pipe)]
    assert images[0].shape == (1, 96, 16) and (images[0] - images[1]).abs().max() < 1e-4
