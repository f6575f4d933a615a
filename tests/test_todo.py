"""ToDo (token downsampling, #36): keys and values of the selected self-attentions read the token
grid downsampled by ``downsample_factor`` per axis; queries and output keep every token."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import CountingCompiler, call, tiny_inputs, tiny_unet
from tome_compile.passes.sites import module_path

from tome_compile import ToMeConfig, ToMeConfigError, ToMeWarning, tome_backend
from tome_compile.backend import ToMeBackend
from tome_compile.plans import downsample_kv


def todo_reference(unet, factor=2, mode="nearest", max_downsample=1):
    """ToDo as the paper describes it, written on the module: a pre-hook on each self-attention's
    to_k and to_v that downsamples their input's token grid (the latent's, divided by the block's
    downsampling, rounded up as diffusers' strided convolutions do)."""
    from diffusers.models.attention import BasicTransformerBlock

    ref = copy.deepcopy(unet)
    latent = {}

    def remember(module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        latent["hw"] = tuple(sample.shape[-2:])

    def down(module, args):
        (x,) = args
        big_h, big_w = latent["hw"]
        d = round(math.sqrt(big_h * big_w / x.shape[1]))
        h, w = math.ceil(big_h / d), math.ceil(big_w / d)
        if d > max_downsample or h * w != x.shape[1]:
            return None
        grid = x.reshape(x.shape[0], h, w, -1).permute(0, 3, 1, 2)
        small = torch.nn.functional.interpolate(grid, size=(h // factor, w // factor), mode=mode)
        return (small.permute(0, 2, 3, 1).reshape(x.shape[0], -1, x.shape[-1]),)

    ref.register_forward_pre_hook(remember, with_kwargs=True)
    for block in ref.modules():
        if isinstance(block, BasicTransformerBlock):
            block.attn1.to_k.register_forward_pre_hook(down)
            block.attn1.to_v.register_forward_pre_hook(down)
    return ref


def compiled_todo(unet, **options):
    backend = tome_backend(compiler="eager", method="todo", **options)
    return torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True), backend


@pytest.mark.parametrize("kind, options, hw", [
    ("sd15", {}, (16, 16)),
    ("sd15", {"downsample_factor": 3, "downsample_method": "bilinear"}, (16, 24)),  # 5x8 K/V grid
    ("sdxl", {"max_downsample": 2}, (16, 16)),  # SDXL: no attention at full resolution
])
def test_todo_equals_the_papers_reference_and_shortens_only_keys_and_values(kind, options, hw):
    unet = tiny_unet(kind)
    inputs = tiny_inputs(unet, hw=hw)
    model, backend = compiled_todo(unet, **options)
    got = call(model, inputs)
    factor = options.get("downsample_factor", 2)
    reference = todo_reference(unet, factor, options.get("downsample_method", "nearest"),
                               options.get("max_downsample", 1))
    expected = call(reference, inputs)
    assert (got - expected).abs().max() < 1e-5
    assert (got - call(unet, inputs)).abs().max() > 1e-3  # it changes the output
    # structure: the self-attentions max_downsample allows, one downsample node each, read by
    # to_k and to_v only (the queries and the output keep every token; no plan, no merge)
    (result,) = backend.reports
    rewritten = [s for s in result.sites if s.rewritten]
    allowed = [s for s in result.sites if s.kind == "self-attention"
               and s.downsample is not None and s.downsample <= options.get("max_downsample", 1)]
    assert rewritten and [s.path for s in rewritten] == [s.path for s in allowed]
    assert all(s.path.endswith("attn1") and s.tokens_after == s.tokens for s in rewritten)
    for site in rewritten:
        h, w = site.grid
        assert site.kv_tokens == (h // factor) * (w // factor)
        assert f"(K/V {site.tokens} -> {site.kv_tokens})" in site.line()
    graph = result.graph_module.graph
    downs = [n for n in graph.nodes if n.target is downsample_kv]
    assert len(downs) == len(rewritten)
    for d in downs:  # read by to_k and to_v of its own attn1, nothing else
        site = d.meta["tome"]["site"]
        assert sorted(module_path(u) for u in d.users) == [site + ".to_k", site + ".to_v"]
    assert not result.inputs and not any(n.target is not None and "merge" in str(n.target)
                                         for n in graph.nodes if n.op == "call_function")
    assert "ToDo: keys and values downsampled" in rewritten[0].reason


@pytest.mark.parametrize("kind", ["animatediff", "svd", "pixart"])
def test_todo_on_video_unets_frame_by_frame_and_on_pixart_on_the_patch_grid(kind):
    """Video U-Nets: each frame's spatial self-attention reads its own downsampled grid (temporal
    attention untouched: its tokens are frames); PixArt-α: every block's patch grid (h = H / 2)."""
    from conftest import run, tiny_pixart, tiny_pixart_inputs, tiny_video_inputs, tiny_video_unet

    if kind == "pixart":
        model, (sample, kwargs), options = tiny_pixart(), tiny_pixart_inputs(), {"max_downsample": 2}
    else:
        model, (sample, kwargs), options = tiny_video_unet(kind), tiny_video_inputs(kind), {}
    backend = tome_backend(compiler="eager", method="todo")
    got = run(torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True), sample, kwargs)
    expected = run(todo_reference(model, max_downsample=options.get("max_downsample", 1)), sample, kwargs)
    assert (got - expected).abs().max() < 1e-5
    assert (got - run(model, sample, kwargs)).abs().max() > 1e-3
    rewritten = [s for s in backend.reports[0].sites if s.rewritten]
    assert rewritten and all("temporal" not in s.path and "motion_modules" not in s.path for s in rewritten)
    grid, kv = ((8, 8), 16) if kind == "pixart" else ((16, 16), 64)
    assert all(s.grid == grid and s.kv_tokens == kv for s in rewritten)
    if kind == "pixart":
        assert len(rewritten) == 4  # every block: one patch grid


def test_downsample_factor_1_is_the_plain_model_bit_for_bit(sd15):
    unet, inputs = sd15
    model, backend = compiled_todo(unet, downsample_factor=1)
    assert torch.equal(call(model, inputs), call(unet, inputs))
    assert not backend.reports  # nothing asked: the backend does not run the pass


def test_one_graph_over_the_steps_and_the_global_rng_untouched(sd15):
    unet, inputs = sd15
    counter = CountingCompiler()
    model = torch.compile(copy.deepcopy(unet), backend=tome_backend(compiler=counter, method="todo"),
                          fullgraph=True)
    state = torch.get_rng_state()
    outs = []
    for t in (torch.tensor(999), torch.tensor(500), torch.tensor(1)):
        inputs.timestep = t
        outs.append(call(model, inputs))
    assert counter.calls == 1 and torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(outs[0], outs[1])


def test_todo_refuses_what_it_does_not_use_and_skips_what_it_cannot_downsample(sd15):
    unet, inputs = sd15
    for options, words in [({"ratio": 0.3}, "ratio=0.3 is not used by method='todo'"),
                           ({"merge_mlp": True}, "merge_crossattn / merge_mlp are ToMe's"),
                           ({"plan_every": 3}, "nothing to plan"),
                           ({"downsample_factor": 0}, "downsample_factor=0 must be >= 1"),
                           ({"downsample_method": "cubic"}, "downsample_method='cubic' is unknown")]:
        with pytest.raises(ToMeConfigError, match=words.replace("(", r"\(")):
            ToMeConfig(method="todo", **options)
    with pytest.raises(ToMeConfigError, match="oracle=True is ToMe's zero-cost bound"):
        ToMeBackend(ToMeConfig(method="todo"), oracle=True)
    fused = copy.deepcopy(unet)
    fused.fuse_qkv_projections()  # one linear for q, k and v: nothing to give the keys alone
    model, backend = compiled_todo(fused)
    with pytest.warns(ToMeWarning, match="rewrote nothing: .*fused QKV projection"):
        out = call(model, inputs)
    assert torch.equal(out, call(fused, inputs))
    skipped = [s for s in backend.reports[0].sites if s.kind == "self-attention" and s.downsample == 1]
    assert skipped and all(not s.rewritten and "fused QKV projection" in s.reason for s in skipped)


def test_tome_export_method_todo_serves_every_size_with_fused_attention(tmp_path, sd15_folder, unet, capsys):
    """``tome-export --method todo``: standard inputs only, every attention fused (the rewritten
    ones with 1/4 of the keys and values), and at two sizes (one non-square) the numbers of the
    backend through ToMeSession."""
    import onnx
    from export_helpers import HW, _base
    from tome_compile.export import ToMeSession
    from tome_compile.export.cli import main

    out = tmp_path / "todo.onnx"
    assert main([str(out), *_base(sd15_folder), "--method", "todo", "--downsample-factor", "2"]) == 0
    printed = capsys.readouterr().out
    assert "rewrote 3 of 8" in printed and "8 com.microsoft.MultiHeadAttention" in printed, printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["todo.onnx", "todo.onnx.data"]  # OUT.onnx's files
    model = onnx.load(str(out), load_external_data=False)
    assert [i.name for i in model.graph.input] == ["sample", "timestep", "encoder_hidden_states"]
    # one downsample per rewritten site, and the U-Net's own upsampler
    assert sum(n.op_type == "Resize" for n in model.graph.node) == 3 + 1
    session = ToMeSession(out)
    assert session.meta.any_size and session.meta.config["method"] == "todo"
    for hw in ((HW // 8, HW // 8), (24, 16)):
        inputs = tiny_inputs(unet, hw=hw)
        model_, _ = compiled_todo(unet)
        got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
        assert (got - call(model_, inputs)).abs().max() < 1e-4
        assert (got - call(unet, inputs)).abs().max() > 1e-3


def test_apply_method_todo_on_a_pipeline_equals_the_reference_and_remove_restores_it(sd15):
    """``tome_compile.apply(pipe, method="todo")`` on a diffusers pipeline (CFG: batch 2), a second
    generation right after the first: each equals the reference U-Net's; ``remove`` gives the
    plain pipeline back bit for bit."""
    from conftest import tiny_pipeline
    from diffusers import StableDiffusionPipeline
    from test_call_state import generate, latent

    import tome_compile

    unet, _ = sd15
    reference = tiny_pipeline(StableDiffusionPipeline, todo_reference(unet))
    plain = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet))
    pipe = tome_compile.apply(tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet)), method="todo",
                              compiler="eager")
    for seed in (1, 2):
        got = generate(pipe, latent(seed))
        assert (got - generate(reference, latent(seed))).abs().max() < 1e-4
        assert (got - generate(plain, latent(seed))).abs().max() > 1e-3
    assert [s.kv_tokens for s in pipe.tome.reports[0].sites if s.rewritten] == [64, 64, 64]
    tome_compile.remove(pipe)
    assert torch.equal(generate(pipe, latent(1)), generate(plain, latent(1)))
