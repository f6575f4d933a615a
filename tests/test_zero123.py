"""Issue #22: multi-view (Zero123++) — reference attention. The wrapper runs its U-Net twice per call
(write pass over the noised condition latent, read pass over the tiled views); the pass merges the
read pass's view tokens (queries and the self part of keys/values), keeps the reference tokens
whole, and leaves the write pass alone. Compiled as users compile it: the whole wrapper.

#35: each compile test runs on our replica and on Zero123++'s own ``RefOnlyNoisedUNet`` /
``ReferenceOnlyAttnProc`` (``../shared/third_party/zero123plus/pipeline.py``; skipped in a clone
without it), whose processor is a module wrapping a chained processor: the sites are found by
dataflow, whatever processor sits in the module path."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from zero123_reference import (
    cfg_inputs,
    tiny_zero123,
    tiny_zero123_inputs,
    tiny_zero123plus,
    tomesd_reference,
    zero123plus_module,
)

from tome_compile import generation, tome_backend
from tome_compile.guidance import importance_map

READ_SITES = ["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1",
              "unet.up_blocks.1.attentions.0.transformer_blocks.0.attn1",
              "unet.up_blocks.1.attentions.1.transformer_blocks.0.attn1"]


@pytest.fixture(scope="module", params=["replica", "zero123plus"])
def zero123(request):
    """The wrapper, as our replica and as Zero123++'s own pipeline file builds it."""
    if request.param == "replica":
        return tiny_zero123(), tiny_zero123_inputs()
    if zero123plus_module() is None:
        pytest.skip("../shared/third_party/zero123plus is not beside this clone")
    return tiny_zero123plus(), tiny_zero123_inputs()


@pytest.fixture(scope="module")
def replica():
    """The replica alone: the exportable form and the export (one export for both wrappers: the
    folder holds a plain U-Net and its scheduler either way)."""
    return tiny_zero123(), tiny_zero123_inputs()


def run(model, inputs, timesteps, seed=1):
    """The wrapper called as the pipeline calls it, one call per timestep (the global RNG seeded
    first: the wrapper draws the condition latent's noise from it)."""
    sample, kwargs = inputs
    torch.manual_seed(seed)
    outs = []
    with torch.no_grad():
        for t in timesteps:
            outs.append(model(sample, torch.tensor(t), **kwargs).sample)
    return outs


def unet_report(backend):
    """The report of the graph that holds the U-Net passes (the scheduler's graph breaks make others)."""
    return next(r for r in backend.reports if r.sites)


def test_the_read_pass_is_merged_and_the_write_pass_left_alone(zero123):
    wrapper, inputs = zero123
    backend = tome_backend(0.5, compiler="eager", use_rand=False)
    run(torch.compile(copy.deepcopy(wrapper), backend=backend), inputs, [999])
    report = unet_report(backend)
    assert [s.path for s in report.rewritten] == READ_SITES
    assert all(s.kind == "self-attention + reference" and s.tokens == 96 and s.tokens_after == 48
               and s.reason.endswith("; 16 reference tokens kept") for s in report.rewritten)
    writes = [s for s in report.sites if s.kind == "self-attention"]
    assert len(writes) == 4 and all("reference pass" in s.reason and not s.rewritten for s in writes)
    assert all(not s.rewritten for s in report.sites if s.kind == "cross-attention")
    assert report.count_nodes("merge") == report.count_nodes("unmerge") == 3
    line = next(s.line() for s in report.rewritten)
    assert "self-attention + reference  96 -> 48 tokens  rewritten [attn1]" in line


@pytest.mark.parametrize("use_rand,cfg", [(False, False), (True, False), (False, True)])
def test_equals_tomesd_on_the_view_tokens_of_the_read_pass(zero123, use_rand, cfg):
    """With ``is_cfg_guidance`` the processor runs row 0 (no reference) and the other rows (with
    it) as two attention ops: one site, merged once before the rows are split."""
    wrapper, inputs = zero123
    inputs = cfg_inputs(inputs) if cfg else inputs
    model = torch.compile(
        copy.deepcopy(wrapper), backend=tome_backend(0.5, compiler="eager", use_rand=use_rand, seed=3)
    )
    reference = tomesd_reference(wrapper, ratio=0.5, use_rand=use_rand)
    if use_rand:
        reference.wrapper.unet._tome_info["args"]["generator"] = torch.Generator().manual_seed(3)
    with generation():
        ours = run(model, inputs, [999, 749, 499])
    expected = run(reference, inputs, [999, 749, 499])
    plain = run(wrapper, inputs, [999, 749, 499])
    for a, b, p in zip(ours, expected, plain, strict=True):
        assert (a - b).abs().max() < 1e-5
        assert (a - p).abs().max() > 1e-3  # merging changed the output


def test_ratio_zero_is_bit_identical_and_tome_adds_no_break_recompile_or_draw(zero123):
    from torch._dynamo.utils import counters

    wrapper, inputs = zero123
    eager = run(wrapper, inputs, [999, 749, 499])
    rng_eager = torch.get_rng_state()
    counters.clear()
    zero = run(torch.compile(copy.deepcopy(wrapper), backend=tome_backend(0.0, compiler="eager")), inputs,
               [999, 749, 499])
    assert all(torch.equal(a, b) for a, b in zip(zero, eager, strict=True))
    plain_counts = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    counters.clear()
    run(torch.compile(copy.deepcopy(wrapper), backend=tome_backend(0.5, compiler="eager", seed=0)), inputs,
        [999, 749, 499])
    assert (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]) == plain_counts
    assert torch.equal(torch.get_rng_state(), rng_eager)  # randn_like: the wrapper's draws, nothing more


def test_importance_uses_the_tiled_views_map_and_plans_are_reused(zero123):
    wrapper, inputs = zero123
    backend = tome_backend(0.5, compiler="eager", method="importance", plan_every=2, seed=0)
    outs = run(torch.compile(copy.deepcopy(wrapper), backend=backend), inputs, [999, 749, 499, 249])
    methods = [r.method for r in backend.reports if r.sites]
    assert methods[:2] == ["tome", "importance"]  # the fallback graph and the importance graph
    state = backend.call_state()
    assert state.calls == 4 and state.generations == 1
    assert state.map.shape == (1, 12, 8)  # one map per CFG pair over the 12 x 8 tiled latent
    assert torch.allclose(state.map, importance_map(outs[-1]))
    assert state.plans_made == 3  # fallback step plans; first step with a map plans afresh; then every 2
    # importance keeps other tokens than ToMe's similarity does: from the first step with a map on
    tome = run(torch.compile(copy.deepcopy(wrapper), backend=tome_backend(0.5, compiler="eager", plan_every=2,
                                                                           seed=0)), inputs, [999, 749])
    assert torch.equal(outs[0], tome[0]) and (outs[1] - tome[1]).abs().max() > 1e-4


# --- the exportable form and the ONNX export ----------------------------------------------------


def test_the_exportable_form_equals_the_wrapper_with_its_schedulers(replica):
    """MultiViewExport computes add_noise + scale_model_input in closed form; called as the pipeline
    calls the wrapper (the scheduler's step index at the call's timestep), the outputs agree."""
    from diffusers import EulerDiscreteScheduler

    from tome_compile.errors import ToMeModelError
    from tome_compile.multiview import MultiViewExport, build_zero123

    wrapper, (sample, kwargs) = copy.deepcopy(replica[0]), replica[1]
    exportable = MultiViewExport(wrapper)
    cond = kwargs["cross_attention_kwargs"]["cond_lat"]
    for i, t in enumerate(wrapper.val_sched.timesteps):
        wrapper.val_sched._step_index = i  # where the pipeline's scheduler.step() has brought it
        torch.manual_seed(i)
        noise = torch.randn_like(cond)
        torch.manual_seed(i)
        with torch.no_grad():
            expected = wrapper(sample, t.reshape(1).long(), **kwargs).sample
            ours = exportable(sample, t.reshape(1), kwargs["encoder_hidden_states"], cond, noise)[0]
        assert (ours - expected).abs().max() < 1e-5
    # Karras sigmas: the timesteps are set from the sigmas, so the closed form still holds
    karras = EulerDiscreteScheduler(use_karras_sigmas=True, timestep_spacing="trailing")
    MultiViewExport(build_zero123(copy.deepcopy(wrapper.unet), steps=4, scheduler=karras))
    # negative: sigmas that are not the training sigmas at the scheduler's timesteps are refused
    other = build_zero123(copy.deepcopy(wrapper.unet), steps=4)
    other.val_sched.sigmas = other.val_sched.sigmas * 1.1
    with pytest.raises(ToMeModelError, match="not its training sigmas interpolated"):
        MultiViewExport(other)


@pytest.fixture(scope="module")
def zero123_export(replica, tmp_path_factory):
    """tome-export --multiview of the tiny model's U-Net folder (random destinations drawn by the
    caller: bit-exact with the backend)."""
    from tome_compile.export.cli import main

    folder = tmp_path_factory.mktemp("z123")
    replica[0].unet.save_pretrained(folder / "unet")
    replica[0].val_sched.save_pretrained(folder / "scheduler")
    out = folder / "z123.onnx"
    assert (
        main(
            [
                str(out),
                "--model",
                str(folder),
                "--multiview",
                "--height",
                "96",
                "--width",
                "64",
                "--seq-len",
                "7",
                "--partition-input",
                "--no-cuda-check",
            ]
        )
        == 0
    )
    return out


def test_export_structure_and_session_equals_the_compiled_wrapper(replica, zero123_export):
    import onnx
    from tome_compile.export import ToMeSession
    from tome_compile.export.attention import CONTRIB_DOMAIN

    from tome_compile.multiview import MultiViewExport

    session = ToMeSession(zero123_export, seed=3)
    meta = session.meta
    assert meta.inputs[:5] == ["sample", "timestep", "encoder_hidden_states", "cond_lat", "noise"]
    assert meta.multiview["passes"] == 2 and meta.multiview["cond_lat"] == [4, 4, 4]
    rewritten = [line for line in meta.sites if "rewritten" in line]
    assert [line.split()[0] for line in rewritten] == READ_SITES
    assert all("self-attention + reference  96 -> 48 tokens" in line and "16 reference tokens kept" in line
               for line in rewritten)
    model = onnx.load(str(zero123_export), load_external_data=False)
    # 8 attentions per pass, less the write pass's last block (attn1's output and attn2: nothing reads them)
    assert (
        sum(n.op_type == "MultiHeadAttention" and n.domain == CONTRIB_DOMAIN for n in model.graph.node) == 14
    )

    wrapper, (sample, kwargs) = replica
    compiled = torch.compile(MultiViewExport(copy.deepcopy(wrapper)),
                             backend=tome_backend(0.5, compiler="eager", seed=3))
    # the same weights in Zero123++'s own wrapper (its processors in the U-Net), when beside the clone
    own = None if zero123plus_module() is None else torch.compile(
        MultiViewExport(tiny_zero123plus()), backend=tome_backend(0.5, compiler="eager", seed=3))
    cond, ehs = kwargs["cross_attention_kwargs"]["cond_lat"], kwargs["encoder_hidden_states"]
    plain = MultiViewExport(copy.deepcopy(wrapper))
    with generation(), torch.no_grad():
        for i, t in enumerate([999, 749, 499]):
            torch.manual_seed(i)  # the session draws the condition's noise as the wrapper: randn_like
            ours = session(sample, t, ehs, cross_attention_kwargs={"cond_lat": cond}).sample
            torch.manual_seed(i)
            noise = torch.randn_like(cond)
            expected = compiled(sample, torch.tensor([float(t)]), ehs, cond, noise)[0]
            assert (ours - expected).abs().max() < 1e-4
            if own is not None:
                assert (ours - own(sample, torch.tensor([float(t)]), ehs, cond, noise)[0]).abs().max() < 1e-4
            assert (ours - plain(sample, torch.tensor([float(t)]), ehs, cond, noise)[0]).abs().max() > 1e-3
    # NumPy in (diffusers' ONNX pipelines), one image, noise given by the caller
    one = session(
        sample[:1].numpy(),
        np.array([999.0], dtype=np.float32),
        ehs[:1].numpy(),
        cond_lat=cond[:1].numpy(),
        noise=np.zeros((1, 4, 4, 4), dtype=np.float32),
    )
    assert one[0].shape == (1, 4, 12, 8) and np.isfinite(one[0]).all()


def test_session_refuses_a_multiview_call_without_its_condition(replica, zero123_export):
    from tome_compile.export import ToMeSession

    from tome_compile.errors import ToMeExportError

    session = ToMeSession(zero123_export, seed=0)
    sample, kwargs = replica[1]
    ehs, cond = kwargs["encoder_hidden_states"], kwargs["cross_attention_kwargs"]["cond_lat"]
    with pytest.raises(ToMeExportError, match="cond_lat"):
        session(sample, 999, ehs)
    with pytest.raises(ToMeExportError, match="is_cfg_guidance"):
        session(sample, 999, ehs, cross_attention_kwargs={"cond_lat": cond, "is_cfg_guidance": True})
    with pytest.raises(ToMeExportError, match="'scale'"):
        session(sample, 999, ehs, cross_attention_kwargs={"cond_lat": cond, "scale": 0.5})
    with pytest.raises(ToMeExportError, match="cond_lat has batch 1"):
        session(sample, 999, ehs, cross_attention_kwargs={"cond_lat": cond[:1]})


def test_cli_refuses_a_multiview_size_that_is_not_3_by_2_views(tmp_path, capsys):
    from tome_compile.export.cli import main

    assert main([str(tmp_path / "z.onnx"), "--model", "zero123", "--height", "512", "--width", "512"]) == 2
    assert "height a multiple of 24" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_inner_unet_compiled_alone_leaves_the_write_pass_alone_and_says_so(zero123):
    """#32 item 9: compiling ``wrapper.unet`` instead of the wrapper merged the write pass (16 -> 8
    tokens at 3 sites) silently. Its stored inputs are graph outputs: those sites are skipped with
    the reason, a warning says so once, and the pictures equal the wrapper compiled whole."""
    from tome_compile import ToMeWarning

    wrapper, inputs = zero123
    inner = copy.deepcopy(wrapper)
    backend = tome_backend(0.5, compiler="eager", use_rand=False)
    inner.unet = torch.compile(inner.unet, backend=backend)
    with pytest.warns(ToMeWarning, match="stores attention inputs for a later call"):
        got = run(inner, inputs, [999, 749])
    write, read = backend.reports[0], backend.reports[1]
    assert not write.rewritten and all(s.reason.startswith("reference write pass: its input is stored")
                                       for s in write.sites if s.kind == "self-attention")
    assert [s.path for s in read.rewritten] == [p.removeprefix("unet.") for p in READ_SITES]
    whole_backend = tome_backend(0.5, compiler="eager", use_rand=False)
    whole = run(torch.compile(copy.deepcopy(wrapper), backend=whole_backend), inputs, [999, 749])
    assert all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))
