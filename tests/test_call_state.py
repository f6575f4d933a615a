"""Issue #18: the state kept between calls (guidance maps, plans, random draws) has an owner, known
generation boundaries and a known guidance layout. One test (or more) per numbered item, the call
made as a user makes it, checked against a reference: a fresh model / session, the same call after
``reset()``, or the expected one-line refusal."""

from __future__ import annotations

import copy
import threading
import warnings

import numpy as np
import pytest
import torch
from conftest import TINY_SD15, call, tiny_inputs, tiny_pipeline

import tome_compile
from tome_compile import ToMeConfig, ToMeConfigError, generation, tome_backend
from tome_compile.errors import ToMeExportError
from tome_compile.models import build_unet


def compile_tome(unet, **options):
    backend = tome_backend(0.5, compiler=options.pop("compiler", "eager"), **options)
    return torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True), backend


def steps(model, inputs, latent, timesteps, barrier=None):
    """A bare denoising loop: the U-Net called with falling timesteps."""
    outs = []
    for t in timesteps:
        if barrier is not None:
            barrier.wait(timeout=60)
        with torch.no_grad():
            outs.append(
                model(latent, torch.tensor(t), encoder_hidden_states=inputs.encoder_hidden_states).sample
            )
    return outs


def sd_pipe(unet, **options):
    from diffusers import StableDiffusionPipeline

    from tome_compile.pipeline import apply

    pipe = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet), options.pop("scheduler", None))
    return apply(pipe, 0.5, compiler="eager", **options)


def generate(pipe, latents, steps=4, **kwargs):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1, 7, 32, generator=g)
    with torch.no_grad():
        return pipe(
            prompt_embeds=emb,
            negative_prompt_embeds=torch.zeros(1, 7, 32),
            num_inference_steps=steps,
            guidance_scale=7.5,
            height=16,
            width=16,
            output_type="latent",
            latents=latents,
            **kwargs,
        ).images


def latent(seed):
    return torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(seed))


# 1. a new generation that does not start above the last timestep -------------------------------
def test_1_one_step_generations_twice_through_the_pipeline(sd15):
    from diffusers import EulerDiscreteScheduler

    unet, _ = sd15
    turbo = dict(scheduler=EulerDiscreteScheduler(timestep_spacing="trailing"), plan_every=2, seed=0)
    pipe = sd_pipe(unet, **turbo)
    generate(pipe, latent(1), steps=1)  # t=999
    second = generate(pipe, latent(2), steps=1)  # t=999 again: must not reuse the first image's plans
    fresh = generate(sd_pipe(unet, **turbo), latent(2), steps=1)
    assert torch.equal(second, fresh)
    assert pipe.tome.call_state() is None  # the pipeline's generation ended with its call


def test_1_bare_calls_one_step_twice_and_heun_repeats(sd15):
    unet, inputs = sd15
    model, backend = compile_tome(unet, method="importance", plan_every=2, seed=0)
    first = steps(model, inputs, inputs.sample, [999])[0]
    again = steps(model, inputs, inputs.sample.flip(-1), [999])[0]  # the same t: a new generation
    fresh, _ = compile_tome(unet, method="importance", plan_every=2, seed=0)
    assert torch.equal(again, steps(fresh, inputs, inputs.sample.flip(-1), [999])[0])
    assert backend.call_state().generations == 2 and not torch.equal(first, again)
    # Heun / DPM2 call twice per step (999, 900, 900, 800): one generation, the map and plans kept
    steps(model, inputs, inputs.sample, [999, 900, 900, 800])
    state = backend.call_state()
    assert state.generations == 3 and state.generation_calls == 4 and state.map is not None


def test_1_img2img_after_an_interrupted_run(sd15):
    from diffusers import StableDiffusionImg2ImgPipeline

    from tome_compile.pipeline import apply

    unet, _ = sd15
    options = dict(method="importance", plan_every=2, seed=0)

    def interrupted_then_img2img(pipe, img2img):
        def stop(p, i, t, kwargs):
            p._interrupt = i >= 1  # the user stops the run after its second step (t = 801)
            return kwargs

        generate(pipe, latent(1), steps=10, callback_on_step_end=stop)
        with torch.no_grad():  # then img2img at strength 0.3: it starts at t = 201, below 801
            return img2img(prompt_embeds=torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(3)),
                           negative_prompt_embeds=torch.zeros(1, 7, 32), image=latent(5), strength=0.3,
                           num_inference_steps=10, guidance_scale=7.5, output_type="latent",
                           generator=torch.Generator().manual_seed(4)).images

    def img2img_of(pipe):
        img2img = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
        img2img.set_progress_bar_config(disable=True)
        return img2img

    pipe = sd_pipe(unet, **options)
    got = interrupted_then_img2img(pipe, apply(img2img_of(pipe)))  # apply() on a from_pipe: marks only
    fresh = img2img_of(sd_pipe(unet, **options))
    fresh = apply(fresh)
    with torch.no_grad():
        expected = fresh(prompt_embeds=torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(3)),
                         negative_prompt_embeds=torch.zeros(1, 7, 32), image=latent(5), strength=0.3,
                         num_inference_steps=10, guidance_scale=7.5, output_type="latent",
                         generator=torch.Generator().manual_seed(4)).images
    assert torch.equal(got, expected)
    # negative: without apply() the bare-call rule cannot see this boundary (its documented limit)
    from diffusers import StableDiffusionPipeline

    bare = tiny_pipeline(StableDiffusionPipeline, copy.deepcopy(unet))
    bare.unet = torch.compile(bare.unet, backend=tome_backend(0.5, compiler="eager", **options))
    stale = interrupted_then_img2img(bare, img2img_of(bare))
    assert (stale - expected).abs().max() > 1e-4


def test_apply_refuses_compiled_denoisers(sd15):
    from diffusers import StableDiffusionPipeline

    unet, _ = sd15
    compiled_pipe = tiny_pipeline(StableDiffusionPipeline, torch.compile(copy.deepcopy(unet)))
    with pytest.raises(ToMeConfigError, match="already torch.compile'd"):
        tome_compile.apply(compiled_pipe, 0.5)
    # a second apply() replaces the first (tests/test_round4.py), a shared denoiser takes no settings
    pipe = sd_pipe(unet)
    from diffusers import StableDiffusionImg2ImgPipeline

    img2img = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
    with pytest.raises(ToMeConfigError, match="already runs with ToMe .* or remove\\(pipe\\) first"):
        tome_compile.apply(img2img, 0.3)


def test_second_image_equals_a_fresh_pipeline_without_recompiles(sd15):
    from torch._dynamo.utils import counters

    unet, _ = sd15
    options = dict(method="importance", plan_every=2, seed=0)
    pipe = sd_pipe(unet, **options)
    generate(pipe, latent(1))
    counters.clear()
    second = generate(pipe, latent(2))
    assert counters["stats"]["unique_graphs"] == 0  # compiled once, at the first image
    assert torch.equal(second, generate(sd_pipe(unet, **options), latent(2)))
    assert [r.method for r in pipe.tome.reports].count("importance") == 1


# 2, 6, 7, 8, 9, 10, 15: ToMeSession on a plan_every export with drawn destinations ----------------
@pytest.fixture(scope="module")
def every_export(tmp_path_factory, sd15):
    from tome_compile.export import export_onnx

    unet, _ = sd15
    path = tmp_path_factory.mktemp("every") / "unet.onnx"
    return export_onnx(copy.deepcopy(unet), path, ToMeConfig(ratio=0.5, plan_every=2, seed=0), height=128,
                       width=128, seq_len=7, atol=1e-4, partition_input=True).path


def session_loop(session, inputs, sample, timesteps, numpy=False):
    outs = []
    for t in timesteps:
        if numpy:  # as diffusers' OnnxStableDiffusionPipeline calls its unet
            out = session(sample=sample.numpy(), timestep=np.array([t], dtype=np.float32),
                          encoder_hidden_states=inputs.encoder_hidden_states.numpy())[0]
            outs.append(torch.from_numpy(out))
        else:
            outs.append(
                session(sample, torch.tensor(t), encoder_hidden_states=inputs.encoder_hidden_states).sample
            )
    return outs


def test_2_numpy_timesteps_start_new_generations(every_export, sd15):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    session = ToMeSession(every_export, seed=3)
    session_loop(session, inputs, inputs.sample, [999, 500], numpy=True)
    second = session_loop(session, inputs, inputs.sample.flip(-1), [999, 500], numpy=True)
    fresh = session_loop(
        ToMeSession(every_export, seed=3), inputs, inputs.sample.flip(-1), [999, 500], numpy=True
    )
    assert all(torch.equal(a, b) for a, b in zip(second, fresh, strict=True))
    assert session.call_state().generations == 2 and session.call_state().plans_made == 2
    out = session(sample=inputs.sample.numpy(), timestep=np.int64(999),
                  encoder_hidden_states=inputs.encoder_hidden_states.numpy())
    assert isinstance(out, list) and isinstance(out[0], np.ndarray)  # NumPy in, a list of arrays out


def onnx_pipeline(path):
    """diffusers' ONNX pipeline on a tome-export file (a VAE decoder that returns the latent)."""
    import onnxruntime as ort
    from diffusers import DDIMScheduler, OnnxStableDiffusionPipeline
    from diffusers.pipelines.onnx_utils import OnnxRuntimeModel

    unet = OnnxRuntimeModel(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]),
                            model_save_dir=path.parent, latest_model_name=path.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = OnnxStableDiffusionPipeline(
            vae_encoder=None,
            vae_decoder=lambda latent_sample: [latent_sample],
            text_encoder=None,
            tokenizer=None,
            unet=unet,
            scheduler=DDIMScheduler(clip_sample=False),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_2_onnx_pipeline_through_apply(every_export):
    def image(pipe, seed):
        g = np.random.RandomState(seed)
        return pipe(
            prompt_embeds=np.ones((1, 7, 32), np.float32),
            negative_prompt_embeds=np.zeros((1, 7, 32), np.float32),
            height=128,
            width=128,
            num_inference_steps=3,
            output_type="np",
            latents=g.randn(1, 4, 16, 16).astype(np.float32),
        ).images

    pipe = tome_compile.apply(onnx_pipeline(every_export), seed=3)  # the unet becomes a ToMeSession
    assert type(pipe.unet).__name__ == "ToMeSession" and pipe.tome is pipe.unet
    image(pipe, 1)
    second = image(pipe, 2)
    assert np.array_equal(second, image(tome_compile.apply(onnx_pipeline(every_export), seed=3), 2))
    assert pipe.tome.call_state() is None  # each pipeline call was its own generation, now ended


# #32 items 2, 7, 8. ONNX: the file's settings, bad calls, bad files ------------------------------
def test_2_apply_refuses_settings_the_export_was_not_made_with(every_export):
    with pytest.raises(ToMeConfigError, match=r"ratio=0.1, method='importance', plan_every=3 asked of .*"
                                              r"exported with ratio=0.5, method='tome', plan_every=2"):
        tome_compile.apply(onnx_pipeline(every_export), 0.1, method="importance", plan_every=3)
    # negative: the file's own settings, and the seed, are fine
    pipe = tome_compile.apply(onnx_pipeline(every_export), 0.5, plan_every=2, seed=3)
    assert type(pipe.unet).__name__ == "ToMeSession"


def test_7_8_session_refuses_empty_calls_and_unreadable_files(every_export, sd15, tmp_path):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    session = ToMeSession(every_export, seed=0)
    ehs = inputs.encoder_hidden_states
    with pytest.raises(ToMeExportError, match=r"timestep has no value \(shape \(0,\)\)"):
        session(inputs.sample, torch.tensor([]), encoder_hidden_states=ehs)
    with pytest.raises(ToMeExportError, match=r"sample has shape \(0, 4, 16, 16\): give a batch of at least"):
        session(inputs.sample[:0], torch.tensor(999), encoder_hidden_states=ehs[:0])
    assert session.call_state() is None  # nothing ran
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(open(every_export, "rb").read()[:1000])
    text = tmp_path / "notes.onnx"
    text.write_text("not a model")
    for path in (truncated, text):
        with pytest.raises(ToMeExportError, match=f"{path.name}' is not a readable ONNX model"):
            ToMeSession(path)
    out = session(inputs.sample, torch.tensor(999), encoder_hidden_states=ehs).sample
    assert np.isfinite(out.numpy()).all()


def test_6_partition_input_export_equals_the_backend_at_an_odd_batch(every_export, sd15):
    from tome_compile.export import ToMeSession

    unet, inputs = sd15
    session = ToMeSession(every_export, seed=4)
    model, _ = compile_tome(unet, plan_every=2, seed=4)
    one = inputs.sample[:1]
    emb = copy.copy(inputs)
    emb.encoder_hidden_states = inputs.encoder_hidden_states[:1]
    for odd, even in zip(
        session_loop(session, emb, one, [999, 800, 600]), steps(model, emb, one, [999, 800, 600]), strict=True
    ):
        assert (odd - even).abs().max() < 1e-5
    # ... and the even batch after it still draws the backend's sequence
    session_two = session_loop(session, inputs, inputs.sample, [999, 800, 600])
    for a, b in zip(session_two, steps(model, inputs, inputs.sample, [999, 800, 600]), strict=True):
        assert (a - b).abs().max() < 1e-5


def test_7_reset_keeps_the_sessions_seed(every_export, sd15):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    session = ToMeSession(every_export, seed=9)
    before = session_loop(session, inputs, inputs.sample, [999, 800, 600])
    session.reset()
    after = session_loop(session, inputs, inputs.sample, [999, 800, 600])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    session.reset(seed=10)  # negative: another seed, other destinations
    assert not torch.equal(session_loop(session, inputs, inputs.sample, [999])[0], before[0])


def test_8_and_15_missing_or_mismatched_inputs_are_refused(every_export, sd15):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    session = ToMeSession(every_export, seed=0)
    with pytest.raises(ToMeExportError, match="needs the timestep"):
        session(inputs.sample, encoder_hidden_states=inputs.encoder_hidden_states)
    with pytest.raises(ToMeExportError, match=r"needs encoder_hidden_states \[B, L, D\]"):
        session(inputs.sample, torch.tensor(999))
    with pytest.raises(ToMeExportError, match="this export has no input named 'encoder_hidden_state'"):
        session(inputs.sample, torch.tensor(999), encoder_hidden_state=inputs.encoder_hidden_states)
    with pytest.raises(ToMeExportError, match="encoder_hidden_states has batch 1, the sample has 2"):
        session(inputs.sample, torch.tensor(999), encoder_hidden_states=inputs.encoder_hidden_states[:1])
    assert session.call_state() is None  # nothing ran


@pytest.mark.parametrize("name, words", [
    ("down_block_additional_residuals", "ControlNet residual inputs"),
    ("mid_block_additional_residual", "ControlNet residual inputs"),
    ("timestep_cond", "timestep_cond input"),
    ("class_labels", "class_labels input"),
    ("cross_attention_kwargs", "per-call attention arguments"),
])
def test_4_session_refuses_what_the_export_does_not_take(every_export, sd15, name, words):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    session = ToMeSession(every_export, seed=0)
    value = {"scale": 0.5} if name == "cross_attention_kwargs" else torch.zeros(2, 4)
    with pytest.raises(ToMeExportError, match=f"this export has no {words}.*{name}"):
        session(inputs.sample, torch.tensor(999), encoder_hidden_states=inputs.encoder_hidden_states,
                **{name: value})
    # None (what diffusers passes for "not used") is fine, and so is an unknown added_cond_kwargs None
    out = session(inputs.sample, torch.tensor(999), encoder_hidden_states=inputs.encoder_hidden_states,
                  added_cond_kwargs={"text_embeds": None}, **{name: None}).sample
    assert out.shape == inputs.sample.shape
    with pytest.raises(ToMeExportError, match=r"added_cond_kwargs\['text_embeds'\]"):
        session(inputs.sample, torch.tensor(999), encoder_hidden_states=inputs.encoder_hidden_states,
                added_cond_kwargs={"text_embeds": torch.zeros(2, 8)})


def test_9_the_graph_refuses_plans_of_another_batch(every_export, sd15):
    import onnxruntime as ort

    _, inputs = sd15
    raw = ort.InferenceSession(str(every_export), providers=["CPUExecutionProvider"])
    one = {"sample": inputs.sample[:1].numpy(), "timestep": np.array([999.0], dtype=np.float32),
           "encoder_hidden_states": inputs.encoder_hidden_states[:1].numpy(),
           "tome_partition": np.zeros(3 * 64, dtype=np.int64)}  # 3 blocks of 8 x 8 cells
    _, slots, weights = raw.run(None, one)  # a batch-1 call's plans
    two = {
        **one,
        "sample": inputs.sample.numpy(),
        "encoder_hidden_states": inputs.encoder_hidden_states.numpy(),
    }
    with pytest.raises(Exception, match="(?i)mismatch|invalid|dimension"):  # not broadcast to both images
        raw.run(None, {**two, "tome_plan_slots": slots, "tome_plan_weights": weights,
                       "tome_reuse_plan": np.array(True)})
    with pytest.raises(Exception, match="(?i)mismatch|invalid|dimension"):  # reuse without plans
        raw.run(None, {**two, "tome_reuse_plan": np.array(True)})
    out, slots2, weights2 = raw.run(None, two)  # positive: the batch's own plans are reused
    again = raw.run(None, {**two, "tome_plan_slots": slots2, "tome_plan_weights": weights2,
                           "tome_reuse_plan": np.array(True)})[0]
    assert np.array_equal(again, out)


def test_10_io_binding_feeds_the_plans_back(every_export, sd15):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    plain = ToMeSession(every_export, seed=0, io_binding=False)
    bound = ToMeSession(every_export, seed=0, io_binding=True)
    timesteps = [999, 800, 600, 400]
    for a, b in zip(session_loop(plain, inputs, inputs.sample, timesteps),
                    session_loop(bound, inputs, inputs.sample, timesteps), strict=True):
        assert torch.equal(a, b)
    assert bound.call_state().plans_made == 2 and bound.call_state().plans[1].dtype == torch.float32


# 3. two threads sharing one compiled U-Net / one session ---------------------------------------------
def run_in_threads(fn, latents):
    barrier = threading.Barrier(len(latents))
    results, errors = [None] * len(latents), []

    def work(i):
        try:
            results[i] = fn(latents[i], barrier)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(latents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def test_3_two_threads_share_one_compiled_unet(sd15):
    unet, inputs = sd15
    model, backend = compile_tome(unet, method="importance", plan_every=2, seed=0)
    timesteps = [999, 750, 500, 250]
    latents = [inputs.sample, inputs.sample.flip(-1)]
    alone = [steps(model, inputs, x, timesteps) for x in latents]  # one after the other
    together = run_in_threads(lambda x, barrier: steps(model, inputs, x, timesteps, barrier), latents)
    for a, b in zip(alone, together, strict=True):  # interleaved call by call, each thread's own state
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert backend.call_state().generations == 2  # this (main) thread's state: its two generations


def test_3_two_threads_share_one_session(every_export, sd15):
    from tome_compile.export import ToMeSession

    _, inputs = sd15
    session = ToMeSession(every_export, seed=0)
    timesteps = [999, 750, 500, 250]
    latents = [inputs.sample, inputs.sample.flip(-1)]
    alone = [session_loop(ToMeSession(every_export, seed=0), inputs, x, timesteps) for x in latents]

    def loop(x, barrier):
        outs = []
        for t in timesteps:
            barrier.wait(timeout=60)
            outs.extend(session_loop(session, inputs, x, [t]))
        return outs

    for a, b in zip(alone, run_in_threads(loop, latents), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# 5. the guidance layout is known: three-way guidance, two images ---------------------------------------
@pytest.mark.parametrize("guidance, independent", [("pix2pix", True), ("cfg", False)])
def test_5_three_way_guidance_pairs_the_rows_of_each_image(guidance, independent):
    from diffusers import StableDiffusionInstructPix2PixPipeline

    unet = build_unet(dict(TINY_SD15, in_channels=8))  # latents + the image's latents
    options = {} if guidance == "pix2pix" else {"guidance": guidance}  # pix2pix: found from the pipeline
    pipe = tome_compile.apply(tiny_pipeline(StableDiffusionInstructPix2PixPipeline, unet), 0.5,
                              method="importance", compiler="eager", seed=0, **options)
    g = torch.Generator().manual_seed(0)
    emb, image = torch.randn(1, 7, 32, generator=g), torch.randn(1, 4, 16, 16, generator=g)
    noise = torch.randn(2, 4, 16, 16, generator=g)

    def edit(latents):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return pipe(prompt_embeds=emb, negative_prompt_embeds=torch.zeros(1, 7, 32), image=image,
                        num_inference_steps=3, num_images_per_prompt=2, latents=latents, output_type="latent",
                        guidance_scale=7.5, image_guidance_scale=1.5).images

    first = edit(noise)
    other = noise.clone()
    other[1] = torch.randn(4, 16, 16, generator=g)  # only image 2's noise changes
    second = edit(other)
    assert [r.method for r in pipe.tome.reports] == ["tome", "importance"]
    images = 2 if independent else 3  # pix2pix: batch 6 = 3 chunks x 2 images; cfg reads 3 "pairs"
    assert pipe.tome.reports[1].inputs[0].shape == (images, 16, 16)  # one map per image
    assert torch.equal(first[0], second[0]) == independent  # cfg halves pair rows of two images
    assert not torch.equal(first[1], second[1])


def test_5_auto_pairs_an_even_batch_as_cfg_and_a_named_layout_as_named(sd15):
    unet, _ = sd15
    six = tiny_inputs(unet, batch=6)
    for guidance, images in (("auto", 3), ("pag", 2), ("none", None)):
        model, backend = compile_tome(unet, method="importance", seed=0, guidance=guidance)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(model, six)
        if images is None:  # negative: no guidance rows, nothing to rank by: ToMe plans, said once
            assert [r.method for r in backend.reports] == ["tome"]
            assert any("holds no pair of guidance rows" in str(w.message) for w in caught)
        else:
            assert [r.method for r in backend.reports] == ["tome", "importance"]
            assert backend.reports[1].inputs[0].shape == (images, 16, 16)


# 11, 12, 16: values checked at construction ------------------------------------------------------
@pytest.mark.parametrize("options, words", [
    (dict(seed=2 ** 70), r"seed=1180591620717411303424 is outside \[0, 2\*\*63 - 1\]"),
    (dict(seed=-1), "outside"),
    (dict(pool_factor=float("inf")), "pool_factor=inf must be a finite number"),
    (dict(pool_factor=float("nan")), "pool_factor=nan"),
    (dict(ratio=float("nan")), "ratio=nan"),
    (dict(guidance="halves"), "guidance='halves' is unknown"),
])
def test_11_12_bad_values_are_refused_at_construction(options, words):
    with pytest.raises(ToMeConfigError, match=words):
        tome_backend(**options)


def test_11_session_and_generation_seeds_are_checked(every_export):
    from tome_compile.export import ToMeSession

    with pytest.raises(ToMeConfigError, match=r"ToMeSession\(seed=...\)=9223372036854775808 is outside"):
        ToMeSession(every_export, seed=2 ** 63)
    with pytest.raises(ToMeConfigError, match="generation"), generation(seed=-5):
        pass


def test_16_numpy_numbers_are_accepted():
    config = ToMeConfig(ratio=np.float32(0.5), max_downsample=np.int64(2), use_rand=np.bool_(False),
                        seed=np.int64(3), blocks=np.arange(2))
    assert config == ToMeConfig(ratio=float(np.float32(0.5)), max_downsample=2, use_rand=False, seed=3,
                                blocks=(0, 1))
    assert type(config.max_downsample) is int and type(config.use_rand) is bool
    assert tome_backend(np.float64(0.25)).config.ratio == 0.25
    with pytest.raises(ToMeConfigError, match="max_downsample=3"):  # still checked after conversion
        ToMeConfig(max_downsample=np.int64(3))


# 13, 14: inversion, and Dynamo's reset ------------------------------------------------------------
def test_13_inversion_is_one_generation_inside_generation(sd15):
    from test_share_plan import KindCounter

    unet, inputs = sd15
    counter = KindCounter()
    backend = tome_backend(0.5, compiler=counter, plan_every=2, seed=0)
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    rising = [1, 201, 401, 601, 801]  # DDIM inversion: the timestep rises every call
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps(model, inputs, inputs.sample, rising)
    assert counter.runs == ["make"] * 5  # bare calls: each one a new generation ...
    assert sum("timestep rose at every call" in str(w.message) for w in caught) == 1  # ... and it says so
    with generation():
        steps(model, inputs, inputs.sample, rising)
    assert counter.runs[5:] == ["make", "reuse", "make", "reuse", "make"]


def test_14_dynamo_reset_starts_a_new_generation(sd15):
    unet, inputs = sd15
    model, backend = compile_tome(unet, plan_every=3, seed=0)
    with generation():
        steps(model, inputs, inputs.sample, [999])
        assert backend.call_state().plans_made == 1
        torch._dynamo.reset()  # Dynamo calls backend.reset(): documented, the next call plans afresh
        steps(model, inputs, inputs.sample, [900])
        assert backend.call_state().plans_made == 2 and backend.call_state().plan_age == 1


# 17. an export that merges nothing is refused ---------------------------------------------------------
def test_17_export_of_blocks_that_do_not_exist_is_refused(tmp_path, capsys):
    from diffusers import UNet2DConditionModel
    from tome_compile.export.cli import main

    folder = tmp_path / "unet"
    with torch.random.fork_rng(devices=[]):
        UNet2DConditionModel(**TINY_SD15).save_pretrained(folder)
    out = tmp_path / "out.onnx"
    code = main([str(out), "--model", str(folder), "--height", "128", "--width", "128", "--seq-len", "7",
                 "--blocks", "99"])
    err = capsys.readouterr().err
    assert (
        code == 2
        and "blocks=99 selects none of the blocks max_downsample=1 allows in this model (0,2-3" in err
    )
    assert not out.exists() and not list(tmp_path.glob(".out.onnx.partial-*"))
