"""Issue #32: round 4 of trying it as users would. One test (or more) per numbered defect, the call
made as a user makes it, each failing without its fix: the demo's importance row, ``apply`` /
``generation()`` agreeing, ``remove(pipe)``, and edge cases that raised from deep inside."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from conftest import call, tiny_inputs, tiny_pipeline
from test_call_state import compile_tome, generate, latent, sd_pipe

import tome_compile
from tome_compile import ToMeConfigError, ToMeWarning, generation


# The main command ---------------------------------------------------------------------------------
def test_demo_importance_row_is_importance_merging(tmp_path):
    """Six prompts with CFG are 12 rows: the old ``auto`` refused them and the importance row was
    the ToMe row (same pictures, same PSNR). Now it is importance merging."""
    from tome_compile.shapes.demo import main

    out = tmp_path / "demo.png"
    assert main(["--steps", "3", "--compiler", "eager", "--out", str(out)]) == 0  # the 6 default prompts
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["rows"] == ["plain", "tome 0.5", "importance 0.5", "todo x2"] and len(data["prompts"]) == 6
    tome, importance = data["results"][1], data["results"][2]
    assert abs(tome["psnr_db"] - importance["psnr_db"]) > 0.1  # other pictures, not the ToMe ones


def test_demo_never_labels_a_fallback_as_the_method():
    """A backend that never ran its method (importance without a map on any call, a backend that
    rewrote nothing) is named so: "(ran as tome)", "(rewrote nothing: plain)"."""
    from types import SimpleNamespace

    from tome_compile.shapes.demo import ran_as_another_method

    def backend(rewrote, importance_calls, method="tome"):
        calls = {"tome": 1, "importance": importance_calls}
        kind = SimpleNamespace(method=method)
        return SimpleNamespace(reports=[SimpleNamespace(modified=rewrote)], config=kind,
                               driver=SimpleNamespace(calls_by_kind=calls))

    assert ran_as_another_method({"tome 0.5": backend(True, 0),
                                  "importance 0.5": backend(True, 3, "importance")}) == {}
    fallback = {"tome 0.5": backend(True, 0), "importance 0.5": backend(True, 0, "importance")}
    assert ran_as_another_method(fallback) == {"importance 0.5": "importance 0.5 (ran as tome)"}
    assert ran_as_another_method({"tome 0.3": backend(False, 0), "todo x2": backend(False, 0, "todo")}) == {
        "tome 0.3": "tome 0.3 (rewrote nothing: plain)", "todo x2": "todo x2 (rewrote nothing: plain)"}


@pytest.mark.parametrize("guidance, images", [(None, 3), ("cfg", 3), ("pix2pix", 2)])
def test_auto_reads_cfg_pairs_from_every_even_batch(sd15, guidance, images):
    """Three images with CFG (6 rows) are an everyday batch: ``auto`` pairs them as CFG; a three-way
    pipeline is named (``apply`` does it from the pipeline)."""
    unet, _ = sd15
    options = {} if guidance is None else {"guidance": guidance}
    model, backend = compile_tome(unet, method="importance", seed=0, **options)
    six = tiny_inputs(unet, batch=6)
    with generation(), warnings.catch_warnings():
        warnings.simplefilter("error", ToMeWarning)  # no refusal, no fallback warning
        call(model, six)
        call(model, six)
    assert [r.method for r in backend.reports] == ["tome", "importance"]
    assert backend.reports[1].inputs[0].shape == (images, 16, 16)  # one map per image
    assert backend.driver.calls_by_kind == {"tome": 1, "importance": 1}


# 1, 10. PAG made from_pipe of an importance pipeline ------------------------------------------------
def test_1_pag_from_pipe_never_pairs_rows_of_another_layout(sd15):
    from diffusers import StableDiffusionPAGPipeline

    unet, _ = sd15
    sd = sd_pipe(unet, method="importance", seed=0)
    pag = StableDiffusionPAGPipeline.from_pipe(sd)
    pag.set_progress_bar_config(disable=True)
    with pytest.warns(ToMeWarning, match="stacks 'pag' guidance rows, but its shared denoiser's importance "
                                         "graph pairs 'cfg' rows"):
        tome_compile.apply(pag)
    emb = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(0))

    def run(**kwargs):
        with torch.no_grad():
            return pag(prompt_embeds=emb, negative_prompt_embeds=torch.zeros(1, 7, 32), num_inference_steps=3,
                       guidance_scale=7.5, num_images_per_prompt=2, height=16, width=16, output_type="latent",
                       **kwargs).images

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(pag_scale=3.0)  # CFG + PAG: 6 rows, three-way groups
    assert sd.tome.driver.calls_by_kind["importance"] == 0  # no map of 'cfg' pairs over 'pag' rows
    assert any("batches are 'pag' guidance but the importance graph pairs 'cfg'" in str(w.message)
               for w in caught)
    # 10: PAG's perturbed layer says what it is
    mid = next(s for r in sd.tome.reports for s in r.sites
               if s.path.startswith("mid_block") and s.path.endswith("attn1"))
    assert "perturbed-attention guidance" in mid.reason and "temporal" not in mid.reason
    run(pag_scale=0.0)  # negative: without PAG its batches are CFG pairs, and importance runs
    assert sd.tome.driver.calls_by_kind["importance"] == 2


# 3, 4, 11. generation() and apply() agree ------------------------------------------------------------
def test_3_generation_auto_keeps_the_map(sd15):
    unet, inputs = sd15
    model, backend = compile_tome(unet, method="importance", seed=0)
    for guidance in ("auto", None, "cfg"):
        kept = []
        with generation(guidance=guidance):
            for t in (999, 800, 600):
                model(inputs.sample, torch.tensor(t), encoder_hidden_states=inputs.encoder_hidden_states)
                kept.append(backend.call_state().map is not None)
        assert kept == [True, True, True], guidance


def test_4_an_outer_generation_seed_and_guidance_win(sd15):
    unet, _ = sd15
    pipe = sd_pipe(unet, seed=0)
    with generation(seed=12345):
        seeded = generate(pipe, latent(1))
    assert torch.equal(seeded, generate(sd_pipe(unet, seed=12345), latent(1)))
    assert not torch.equal(seeded, generate(pipe, latent(1)))  # the pipeline's own seed, 0, differs
    with pytest.raises(ToMeConfigError, match=r"generation\(guidance='pix2pix'\) around a "
                                              "StableDiffusionPipeline call whose batch is 'cfg'"):
        with generation(guidance="pix2pix"):
            generate(pipe, latent(1))


def test_11_one_generation_object_entered_twice(sd15):
    unet, inputs = sd15
    model, backend = compile_tome(unet, method="importance", plan_every=2, seed=0)

    def loop():
        ehs = inputs.encoder_hidden_states
        return [model(inputs.sample, torch.tensor(t), encoder_hidden_states=ehs).sample for t in (999, 800)]

    same = generation(seed=7)
    with same:
        first = loop()
    with same:  # a new generation: nothing of the first one's state
        assert backend.call_state() is None
        second = loop()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    with same, same:  # nested too: the inner one is a generation of its own
        loop()
    assert backend.call_state() is None


# remove(), and a second apply ------------------------------------------------------------------------
def test_remove_restores_the_plain_pipeline_bit_for_bit(sd15):
    from diffusers import StableDiffusionPipeline

    unet, _ = sd15
    plain = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet))
    expected = generate(plain, latent(1))
    pipe = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet))
    original = pipe.unet
    tome_compile.apply(pipe, 0.5, compiler="eager", seed=0)
    merged = generate(pipe, latent(1))
    assert not torch.equal(merged, expected)
    assert tome_compile.remove(pipe) is pipe
    assert pipe.unet is original and getattr(pipe, "tome", None) is None and "progress_bar" not in vars(pipe)
    assert torch.equal(generate(pipe, latent(1)), expected)
    tome_compile.remove(pipe)  # idempotent
    assert pipe.unet is original


def test_a_second_apply_replaces_the_first(sd15):
    unet, _ = sd15
    pipe = sd_pipe(unet, seed=0)
    generate(pipe, latent(1))
    with pytest.raises(ToMeConfigError, match="ratio=0.9 is outside"):
        tome_compile.apply(pipe, 0.9, compiler="eager")  # bad new settings: the old ones stay
    assert pipe.tome.config.ratio == 0.5
    tome_compile.apply(pipe, 0.3, compiler="eager", seed=0)  # not stacked on the first
    assert pipe.tome.config.ratio == 0.3 and not hasattr(pipe.unet._orig_mod, "_orig_mod")
    from diffusers import StableDiffusionPipeline

    fresh = tome_compile.apply(tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet)), 0.3,
                               compiler="eager", seed=0)
    assert torch.equal(generate(pipe, latent(1)), generate(fresh, latent(1)))


def test_regional_compilation_and_cache_hooks_are_refused(sd15):
    from diffusers import StableDiffusionPipeline
    from diffusers.hooks import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast

    unet, _ = sd15
    regional = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet))
    regional.unet.compile_repeated_blocks(fullgraph=True)
    with pytest.raises(ToMeConfigError, match="transformer_blocks.0 is compiled on its own .*does not see "
                                              "the latent's height and width"):
        tome_compile.apply(regional, 0.5, compiler="eager")
    cached = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet))
    apply_pyramid_attention_broadcast(cached.unet, PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, current_timestep_callback=lambda: 500))
    with pytest.raises(ToMeConfigError, match="has diffusers hooks .*pyramid_attention_broadcast"):
        tome_compile.apply(cached, 0.5, compiler="eager")
    assert getattr(cached, "tome", None) is None
    assert not isinstance(cached.unet, torch._dynamo.eval_frame.OptimizedModule)


# 6. command lines: bad numbers refused before any work ------------------------------------------------
@pytest.mark.parametrize("module, argv, words", [
    ("tome_compile.bench", ["--sizes", "0"], "argument --sizes: 0 is below 1"),
    ("tome_compile.bench", ["--sizes", "100"], "argument --sizes: 100 is not a multiple of 8"),
    ("tome_compile.bench", ["--repeats", "0"], "argument --repeats: 0 is below 1"),
    ("tome_compile.benchmarks.memory", ["call", "a.onnx", "--batch", "0"], "argument --batch: 0 is below 1"),
    ("tome_compile.benchmarks.ort", ["--batches", "0"], "argument --batches: 0 is below 1"),
    ("tome_compile.shapes.demo", ["--seeds", "-1"], "argument --seeds: -1 is below 1"),
    ("tome_compile.shapes.demo", ["--steps", "x"], "argument --steps: 'x' is not a whole number"),
])
def test_6_bad_numbers_are_one_line_at_once(module, argv, words, capsys):
    import importlib

    assert importlib.import_module(module).main(argv) == 2  # main(argv) -> int: argparse's code
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
