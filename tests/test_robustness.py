"""Issue #9: the calls users make that used to give silent wrong numbers, a recompile per step,
or an obscure crash. One test (or more) per numbered item; tiny models, the eager inner compiler."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
from conftest import CountingCompiler, call, tiny_inputs, tiny_unet, tomesd_reference
from tome_compile.passes import find_unet_io

from tome_compile import ToMeConfig, ToMeWarning, merge_self_attention, tome_backend
from tome_compile.guidance import importance_map


def run_steps(model, unet_inputs, timesteps, as_tensor):
    outs = []
    for t in timesteps:
        with torch.no_grad():
            out = model(unet_inputs.sample, torch.tensor(t) if as_tensor else t,
                        encoder_hidden_states=unet_inputs.encoder_hidden_states).sample
        outs.append(out)
    return outs


# 1. importance + Python-int timesteps: a new generation must not use the last one's map.
def test_importance_python_int_timesteps_reset_per_generation(sd15):
    unet, inputs = sd15
    backend = tome_backend(0.5, compiler="eager", method="importance", use_rand=False)
    model = torch.compile(copy.deepcopy(unet), backend=backend)
    steps = [999, 500, 250]
    first = run_steps(model, inputs, steps, as_tensor=False)
    second = run_steps(model, inputs, steps, as_tensor=False)  # no reset(): found from the timestep
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    # ...and the same numbers as tensor timesteps (the path that always worked)
    tensor_backend = tome_backend(0.5, compiler="eager", method="importance", use_rand=False)
    tensor_model = torch.compile(copy.deepcopy(unet), backend=tensor_backend)
    for a, b in zip(first, run_steps(tensor_model, inputs, steps, as_tensor=True), strict=True):
        assert (a - b).abs().max() < 1e-5
    # negative: without the reset the first step of generation 2 would have used a map
    assert backend.importance.calls == 6 and backend.importance.map is not None


def test_unet_io_finds_a_baked_int_timestep(sd15):
    from conftest import GraphCapture

    unet, inputs = sd15
    capture = GraphCapture()
    model = torch.compile(copy.deepcopy(unet), backend=capture)
    run_steps(model, inputs, [999, 500], as_tensor=False)
    baked, symbolic = (find_unet_io(gm) for gm, _ in capture.graphs)
    assert baked.timestep_index is None and baked.timestep_constant == 999.0  # Dynamo baked the int
    assert symbolic.timestep_index is not None and symbolic.timestep_constant is None
    assert (baked.sample_index, baked.output_index) == (0, 0)


# 2. fused QKV (diffusers' speed guide): merged, equal to tomesd on the same model.
@pytest.mark.parametrize("use_rand", [False, True])
def test_fused_qkv_projections_are_merged(use_rand):
    unet = tiny_unet("sd15")
    unet.fuse_qkv_projections()
    inputs = tiny_inputs(unet)
    backend = tome_backend(0.5, compiler="eager", use_rand=use_rand, seed=4)
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    ref = tomesd_reference(unet, seed=4 if use_rand else None, ratio=0.5, use_rand=use_rand)
    assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4
    report = backend.reports[0]
    assert [s.path for s in report.rewritten] == [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.1.transformer_blocks.0.attn1"]
    kinds = [s.kind for s in report.sites]
    assert kinds.count("cross-attention") == 4 and "unknown" not in kinds
    assert report.count_nodes("merge") == 3


def test_unrecognised_attention_is_warned_about(sd15):
    # negative: an attention whose q is not a projection cannot be merged; the warning says so.
    from conftest import dynamo_graph
    from tome_compile.passes import find_attention_sites

    from tome_compile.backend import warn_if_nothing_rewritten

    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    for site in find_attention_sites(gm):
        q = site.anchor.args[0]
        with gm.graph.inserting_before(site.anchor):
            scaled = gm.graph.call_function(torch.mul, (q, 1.0))
        scaled.meta = dict(q.meta)
        site.anchor.replace_input_with(q, scaled)
    gm.recompile()
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5))
    assert not result.modified and {s.kind for s in result.sites} == {"unknown"}
    with pytest.warns(ToMeWarning, match="down_blocks.0.attentions.0.transformer_blocks.0.attn1: q/k/v"):
        warn_if_nothing_rewritten(result, ToMeConfig(ratio=0.5))


# 3. one importance backend on two U-Nets: each model keeps its own map.
def test_one_importance_backend_on_two_unets():
    unet_a, unet_b = tiny_unet("sd15", seed=0), tiny_unet("sd15", seed=1)
    inputs = tiny_inputs(unet_a)
    shared = tome_backend(0.5, compiler="eager", method="importance", use_rand=False)
    model_a = torch.compile(copy.deepcopy(unet_a), backend=shared)
    model_b = torch.compile(copy.deepcopy(unet_b), backend=shared)
    own = tome_backend(0.5, compiler="eager", method="importance", use_rand=False)
    alone_a = torch.compile(copy.deepcopy(unet_a), backend=own)
    steps = [torch.tensor(t) for t in (999, 800, 600)]
    for t in steps:  # interleaved, as two pipelines sharing one backend would call them
        inputs.timestep = t
        a = call(model_a, inputs)
        b = call(model_b, inputs)
        assert torch.equal(a, call(alone_a, inputs))  # A never sees B's map
    assert torch.allclose(shared.importance_state(model_a._orig_mod).map, importance_map(a))
    assert torch.allclose(shared.importance_state(model_b._orig_mod).map, importance_map(b))
    assert not torch.equal(shared.importance_state(model_a._orig_mod).map,
                           shared.importance_state(model_b._orig_mod).map)


# 4. Python-int timesteps: no re-specialisation per denoising step.
@pytest.mark.parametrize("method", ["tome", "importance"])
def test_python_int_timesteps_do_not_recompile_per_step(sd15, method):
    unet, inputs = sd15
    counter = CountingCompiler()
    backend = tome_backend(0.5, compiler=counter, method=method, seed=0)
    model = torch.compile(copy.deepcopy(unet), backend=backend)
    run_steps(model, inputs, [999, 900, 800, 700, 600, 500, 400, 300], as_tensor=False)
    graphs = 2 if method == "importance" else 1
    # Dynamo: one graph with the first int baked in, one with a symbolic int; then never again.
    assert counter.calls == 2 * graphs
    assert len(backend.reports) == 2 * graphs and all(len(r.rewritten) == 3 for r in backend.reports)


def test_python_int_timesteps_with_dynamic_false_are_called_out(sd15):
    # Dynamo (not ToMe) recompiles per int value under dynamic=False and, after its recompile
    # limit, silently runs the plain model: the backend sees the second baked value and says so.
    unet, inputs = sd15
    backend = tome_backend(0.5, compiler="eager", seed=0)
    model = torch.compile(copy.deepcopy(unet), backend=backend, dynamic=False)
    with pytest.warns(ToMeWarning, match=r"pass torch.tensor\(t\), or leave dynamic unset"):
        run_steps(model, inputs, [999, 500], as_tensor=False)
    with warnings.catch_warnings():  # tensor timesteps under dynamic=False: nothing to say
        warnings.simplefilter("error", ToMeWarning)
        torch._dynamo.reset()
        quiet = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", seed=0),
                              dynamic=False)
        run_steps(quiet, inputs, [999, 500, 250], as_tensor=True)


# 5. dynamic=True: works, specialised per concrete shape.
def test_dynamic_true(sd15):
    unet = sd15[0]
    counter = CountingCompiler()
    backend = tome_backend(0.5, compiler=counter, use_rand=False)
    model = torch.compile(copy.deepcopy(unet), backend=backend, dynamic=True)
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ToMeWarning)  # tensor timesteps: nothing to warn about
        for hw in [(16, 16), (16, 16), (24, 20)]:
            for t in (999, 500):
                x = tiny_inputs(unet, hw=hw)
                x.timestep = torch.tensor(t)
                assert (call(model, x) - call(ref, x)).abs().max() < 1e-4
    assert [r.rewritten[0].tokens for r in backend.reports] == [256, 480]  # one per resolution


def test_dynamic_true_with_python_int_timesteps_says_what_to_do(sd15):
    unet, inputs = sd15
    backend = tome_backend(0.5, compiler="eager", use_rand=False)
    model = torch.compile(copy.deepcopy(unet), backend=backend, dynamic=True)
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    with pytest.warns(ToMeWarning, match=r"torch.tensor\(t\)"):
        outs = run_steps(model, inputs, [999, 500], as_tensor=False)
    expected = run_steps(ref, inputs, [999, 500], as_tensor=False)
    for a, b in zip(outs, expected, strict=True):  # correct numbers for every timestep value
        assert (a - b).abs().max() < 1e-4


# 6. a latent narrower than the stride: the block is left unmerged and reported.
@pytest.mark.parametrize("hw", [(8, 1), (1, 8), (3, 1)])
def test_latent_narrower_than_the_stride(hw):
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet, hw=hw)
    backend = tome_backend(0.5, compiler="eager", seed=0)
    model = torch.compile(copy.deepcopy(unet), backend=backend)
    with pytest.warns(ToMeWarning, match="narrower than the sx=2 x sy=2"):
        out = call(model, inputs)
    assert torch.equal(out, call(unet, inputs))
    assert backend.reports[0].rewritten == []


def test_latent_wide_enough_in_one_direction_still_merges():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet, hw=(16, 2))
    backend = tome_backend(0.5, compiler="eager", use_rand=False)
    model = torch.compile(copy.deepcopy(unet), backend=backend)
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4
    assert len(backend.reports[0].rewritten) == 3


# 10. mode="reduce-overhead" / "max-autotune-no-cudagraphs": accepted and passed to inductor;
#     an unknown mode is one clear error.
def test_compile_mode_reaches_inductor(sd15, monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kw):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    unet, inputs = sd15
    model = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, seed=0), mode="reduce-overhead")
    call(model, inputs)
    assert seen == [{"triton.cudagraphs": True}]
    assert real is not spy
    from tome_compile import ToMeConfigError

    torch._dynamo.reset()
    bad = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, seed=0), mode="fastest")
    with pytest.raises(Exception, match="mode='fastest' is not an inductor mode") as info:
        call(bad, inputs)
    inner = getattr(info.value, "inner_exception", info.value)  # Dynamo wraps backend errors
    assert isinstance(inner, ToMeConfigError)


def test_skipped_sites_log_one_line_each(caplog, monkeypatch):
    import importlib

    from conftest import dynamo_graph
    from diffusers.models.attention_processor import AttnProcessor

    unet = tiny_unet("sd15")
    unet.set_attn_processor(AttnProcessor())
    inputs = tiny_inputs(unet)
    gm = dynamo_graph(unet, inputs)
    monkeypatch.setattr(importlib.import_module("tome_compile.passes.rewrite"), "_replace_literal_tokens",
                        lambda *a, **k: 0)
    with caplog.at_level(logging.INFO):
        result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    assert result.rewritten == []
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    per_site = [r for r in caplog.records if "left unmerged" in r.getMessage()]
    assert len(per_site) == 3


def test_importance_on_an_odd_batch_says_so_once():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet, batch=3)
    backend = tome_backend(0.5, compiler="eager", method="importance", seed=0)
    model = torch.compile(copy.deepcopy(unet), backend=backend)
    with pytest.warns(ToMeWarning, match="batch of 3 holds no pair") as record:
        call(model, inputs)
        call(model, inputs)
    assert sum("holds no pair" in str(w.message) for w in record) == 1
    ref = tomesd_reference(unet, ratio=0.5, seed=0)  # odd batch: tomesd's fixed destinations
    assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("error", ToMeWarning)
        call(model, inputs)  # not again
