"""tome-export's other forms: portable, --no-rand (tomesd parity), fp16 SDXL into Optimum, the op
inventory, importance, LCM's timestep_cond, refused attention."""


from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import onnx
import pytest
import torch
from conftest import call, tiny_inputs, tiny_unet, tomesd_reference
from export_helpers import (
    HW,
    _optimum_folder,
    ort_session,
    shared_merge_zeros,
    standard_feed,
)
from tome_compile.export import ToMeSession, check_op_inventory, export_onnx
from tome_compile.export.cli import main
from torch.multiprocessing.reductions import StorageWeakRef

from tome_compile import ToMeConfig, ToMeExportError, tome_backend


def test_unfusable_attention_is_refused_not_half_fused(tmp_path, unet):
    from diffusers.models.attention_processor import AttnProcessor

    classic = copy.deepcopy(unet)
    classic.set_attn_processor(AttnProcessor())  # baddbmm + softmax: no scaled_dot_product_attention
    # static: the classic processor's reshapes bake the token count (rewritten in a fixed-size
    # graph; in an any-size graph they are expressions of the input size and its sites stay unmerged)
    with pytest.raises(
        ToMeExportError, match="0 of the U-Net's 8 attentions became MultiHeadAttention.*--portable"
    ):
        export_onnx(
            classic, tmp_path / "c.onnx", ToMeConfig(ratio=0.5, seed=0), height=HW, width=HW, seq_len=7,
            static=True,
        )
    assert list(tmp_path.iterdir()) == []


def test_hashed_destinations_are_deterministic_and_vary():
    from tome_compile.sampler import hashed_partition

    def draw(seed, t):
        return hashed_partition(torch.tensor(seed), torch.tensor([t]), 192, 4)

    assert torch.equal(draw(0, 999.0), draw(0, 999.0))
    assert (draw(0, 999.0) != draw(0, 979.0)).float().mean() > 0.6  # ~3/4 of the cells differ
    assert (draw(0, 999.0) != draw(1, 999.0)).float().mean() > 0.6
    assert (draw(0, 999.0) != draw(0, 999.5)).float().mean() > 0.6  # fractional timesteps too
    counts = torch.bincount(hashed_partition(torch.tensor(0), torch.tensor([1.0]), 40000, 4), minlength=4)
    assert counts.min() > 9500 and counts.max() < 10500  # uniform over the sx*sy choices
    first, second = draw(0, 999.0)[:96], draw(0, 999.0)[96:]  # two blocks' slices differ
    assert (first != second).float().mean() > 0.6


def test_fp16_references_compute_products_in_fp32(unet):
    """Issue #20: the fp16 parity reference ran PyTorch's scalar fp16 CPU kernels (the README's SDXL
    check at 1024² ran for hours). Convolutions and matrix products now compute in fp32 on the fp16
    values and round back (as ORT's CPU EP runs an fp16 graph); everything else stays fp16."""
    from tome_compile.export.parity import Fp32Compute

    half = copy.deepcopy(unet).half()
    inputs = tiny_inputs(unet, batch=2)
    args = (inputs.sample.half(), inputs.timestep, inputs.encoder_hidden_states.half())
    with torch.no_grad():
        plain = half(*args, return_dict=False)[0]
        with Fp32Compute() as mode:
            fast = half(*args, return_dict=False)[0]
        # what it emulates: the same fp16 weights and inputs, each product in fp32, rounded to fp16
        to_k = half.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k
        x = args[2][0, :3].float() @ to_k.weight.float().t()
        with Fp32Compute():
            y = to_k(args[2][0, :3])
    assert fast.dtype == torch.float16 and mode.upcast >= 33 + 50  # every conv2d and linear of the tiny U-Net
    assert torch.equal(y, x.half())
    assert (fast.float() - plain.float()).abs().max() < 1e-2 * max(1.0, plain.float().abs().max().item())
    with torch.no_grad(), Fp32Compute() as mode:  # negative case: fp32 values are left alone, bit for bit
        full = unet(inputs.sample, inputs.timestep, inputs.encoder_hidden_states, return_dict=False)[0]
    assert mode.upcast == 0 and torch.equal(full, call(unet, inputs))


def test_no_rand_portable_export_equals_tomesd_at_any_batch_and_size(tmp_path, unet):
    # --portable (plain ONNX attention, no contrib ops), traced at batch 1 (a dynamic batch is
    # otherwise traced at 2: torch.export would specialise a size-1 axis); one file for both forms,
    # whose conversion is the slow part of the test
    # release_weights (what tome-export sets): the PyTorch references are computed first, then the
    # weights freed, so the model and the ORT session are never resident together — their bytes
    # too: onnxscript's rewrite rules kept the exported graph (every attention Linear's weight)
    # alive after the conversion (40 of these 208 storages; 86% of SDXL's weights)
    model = copy.deepcopy(unet)
    storages = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
    # the clearing walks every live object: a dead weakref.proxy among them (CI had one from
    # another test) raised ReferenceError in isinstance and failed the export
    dead_proxy = weakref.proxy(torch.nn.Identity())
    result = export_onnx(model, tmp_path / "m.onnx", ToMeConfig(ratio=0.5, use_rand=False),
                         height=HW, width=HW, seq_len=7, atol=1e-4, release_weights=True, portable=True,
                         batch=1)
    assert result.parity_max_abs is not None and result.parity_max_abs < 1e-4
    assert all(p.numel() == 0 for p in model.parameters()) and all(p.numel() > 0 for p in unet.parameters())
    gc.collect()
    assert sum(not s.expired() for s in storages) == 0
    with pytest.raises(ReferenceError):
        repr(dead_proxy.training)  # it was dead throughout
    assert result.input_names == ["sample", "timestep", "encoder_hidden_states"]  # exactly the standard ones
    graph = onnx.load(str(result.path), load_external_data=False).graph
    assert {n.domain for n in graph.node} == {""} and result.fused_attention == 0
    assert sum(n.op_type == "Softmax" for n in graph.node) == 8  # every attention, as plain ONNX
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    session = ToMeSession(result.path)
    # one file, each batch and image size (#34: square or not, grids the stride does not divide,
    # another text length) equal to tomesd on the PyTorch model at that size
    for batch, hw, text in ((1, (16, 16), 7), (2, (16, 16), 7), (4, (16, 16), 7), (2, (12, 20), 7),
                            (1, (24, 16), 3), (2, (10, 6), 11)):
        inputs = tiny_inputs(unet, batch=batch, hw=hw, seed=batch)
        g = torch.Generator().manual_seed(text)
        inputs.encoder_hidden_states = torch.randn(batch, text, 32, generator=g)
        got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
        assert got.shape == inputs.sample.shape and (got - call(ref, inputs)).abs().max() < 1e-4, (batch, hw)
    meta = session.meta
    assert meta.any_size and meta.latent_multiple == 2 and (meta.height, meta.width) == (HW, HW)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in graph.input}
    free = (dims["sample"][0], *dims["sample"][2:], *dims["encoder_hidden_states"][:2])
    assert all(isinstance(d, str) for d in free)
    assert dims["sample"][1] == 4 and dims["timestep"] == [1]


def test_sdxl_fp16_export_into_an_optimum_folder_optimized(tmp_path, capsys):
    """Issue #20: the README's SDXL command (fp16, --optimize cpu) failed in onnx.checker: the exporter
    wrote a Concat of fp16 text_embeds and the fp32 time projection. Through --into an SDXL Optimum
    folder, with SDXL's text_embeds / time_ids inputs as Optimum names them."""
    unet = tiny_unet("sdxl")
    weights = tmp_path / "sdxl_unet"
    unet.save_pretrained(weights)
    folder = _optimum_folder(tmp_path, "ORTStableDiffusionXLPipeline")
    code = main(["--into", str(folder), "--model", str(weights), "--height", str(HW), "--width", str(HW),
                 "--seq-len", "7", "--max-downsample", "2", "--fp16", "--optimize", "cpu", "--no-rand",
                 "--static"])  # fixed size: half the conversion; the optimized any-size file: test_export.py
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert (
        "rewrote 6 of" in printed
        and "ONNX Runtime optimizer (cpu)" in printed
        and "MultiHeadAttention 28" in printed
    )
    session = ToMeSession(folder / "unet" / "model.onnx", seed=0)
    assert list(session.inputs)[:5] == [
        "sample",
        "timestep",
        "encoder_hidden_states",
        "text_embeds",
        "time_ids",
    ]
    assert session.dtype == torch.float16 and session.meta.dtype == "float16"
    # each merge has zeros of its own in the optimised fp16 file too (#20)
    assert shared_merge_zeros(onnx.load(str(folder / "unet" / "model.onnx"), load_external_data=False)) == []
    inputs = tiny_inputs(unet)
    half = copy.copy(inputs)
    for name in ("sample", "encoder_hidden_states", "text_embeds", "time_ids"):
        setattr(half, name, getattr(inputs, name).half())
    added = {"text_embeds": half.text_embeds, "time_ids": half.time_ids}
    got = session(half.sample, torch.tensor(999), half.encoder_hidden_states, added_cond_kwargs=added).sample
    backend = tome_backend(0.5, compiler="eager", max_downsample=2, use_rand=False)  # --no-rand
    expected = call(torch.compile(copy.deepcopy(unet).half(), fullgraph=True, backend=backend), half)
    assert got.dtype == torch.float16 and (got.float() - expected.float()).abs().max() < 2e-2
    with pytest.raises(ToMeExportError, match=r"needs added_cond_kwargs\['time_ids'\]"):
        session(inputs.sample.half(), torch.tensor(999), inputs.encoder_hidden_states.half(),
                added_cond_kwargs={"text_embeds": added["text_embeds"]})


def test_inventory_catches_planted_scatter_mean(tmp_path):
    class Planted(torch.nn.Module):
        def forward(self, x, index):
            return torch.zeros(2, 3, 4).scatter_reduce(1, index, x, reduce="mean", include_self=True)

    x = torch.randn(2, 6, 4)
    index = torch.tensor([0, 0, 1, 1, 2, 2]).view(1, 6, 1).expand(2, 6, 4).contiguous()
    path = tmp_path / "planted.onnx"
    torch.onnx.export(Planted().eval(), (x, index), str(path), dynamo=True, verbose=False)
    report = check_op_inventory(path, require_cuda=False)
    assert not report.ok
    assert any("scatter_reduce" in p and "overwrite" in p for p in report.problems)


def test_inventory_catches_index_add(tmp_path):
    # index_add exports as ScatterND(reduction="add"), which ORT's CPU kernel races on duplicates.
    class Planted(torch.nn.Module):
        def forward(self, x, index):
            return torch.zeros(4, 3).index_add(0, index, x)

    path = tmp_path / "index_add.onnx"
    torch.onnx.export(Planted().eval(), (torch.randn(6, 3), torch.tensor([0, 0, 1, 3, 3, 3])), str(path),
                      dynamo=True, verbose=False)
    report = check_op_inventory(path, require_cuda=False)
    assert any("ScatterND" in p and "race" in p for p in report.problems)


def test_inventory_flags_ops_without_cuda_kernel(tmp_path):
    # Group norm at opset 21+ is GroupNormalization, which ONNX Runtime's CUDA EP does not have.
    node = onnx.helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2)
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 2, 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 2, 2])],
        [onnx.numpy_helper.from_array(np.ones(4, np.float32), "s"),
         onnx.numpy_helper.from_array(np.zeros(4, np.float32), "b")])
    path = tmp_path / "gn.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21)]), str(path))
    report = check_op_inventory(path)
    assert report.cuda_missing == ["GroupNormalization (opset 21, version 21)"]
    assert not report.ok and check_op_inventory(path, require_cuda=False).ok


def test_importance_export_matches_compiled_path(tmp_path, unet):
    config = ToMeConfig(ratio=0.5, method="importance", seed=0)
    result = export_onnx(copy.deepcopy(unet), tmp_path / "imp.onnx", config, height=HW, width=HW, seq_len=7,
                         atol=1e-4, partition_input=True)
    assert result.input_names[3:] == ["tome_importance", "tome_has_map", "tome_dst_key", "tome_partition"]
    model = onnx.load(str(result.path), load_external_data=False)
    assert sum(n.op_type == "If" for n in model.graph.node) == 3  # one per site: importance | ToMe plan
    session = ToMeSession(result.path, seed=5)
    backend = tome_backend(config.replace(seed=5), compiler="eager")
    compiled = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    inputs = tiny_inputs(unet)
    for t in (999, 900, 800):  # step 1: ToMe fallback; steps 2-3: the previous step's map
        inputs.timestep = torch.tensor(t)
        got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
        assert (got - call(compiled, inputs)).abs().max() < 1e-4
        assert torch.allclose(session.importance.map, backend.importance.map, atol=1e-5)
        backend.importance.map = session.importance.map.clone()  # one map for the next plans (near-ties)
    assert session.importance.calls == 3


def test_importance_default_export_runs_with_standard_inputs(tmp_path, unet):
    config = ToMeConfig(ratio=0.5, method="importance", seed=0)
    # a fixed-size file (its defaults are what is tested; the size axes: the test below), which
    # converts in half the time
    result = export_onnx(copy.deepcopy(unet), tmp_path / "imp.onnx", config, height=HW, width=HW, seq_len=7,
                         atol=1e-4, static=True)
    assert result.input_names[3:] == ["tome_importance", "tome_has_map", "tome_seed"]
    assert sorted(result.optional_inputs) == ["tome_has_map", "tome_importance", "tome_seed"]
    session = ort_session(result.path)
    feed = standard_feed(2)
    plain = session.run(None, feed)[0]  # no map yet: the ToMe fallback branch
    with_defaults = session.run(None, {**feed, "tome_has_map": np.array(False),
                                       "tome_importance": np.zeros((1, 16, 16), np.float32)})[0]
    assert np.array_equal(plain, with_defaults)
    mapped = session.run(
        None,
        {
            **feed,
            "tome_has_map": np.array(True),
            "tome_importance": np.random.default_rng(0).random((1, 16, 16), np.float32),
        },
    )[0]
    assert np.abs(mapped - plain).max() > 1e-4  # the importance branch merges other tokens
    # through ToMeSession: step 1 without a map, step 2 with the previous step's
    tome_session = ToMeSession(result.path, seed=0)
    inputs = tiny_inputs(unet)
    for t in (999, 900):
        tome_session(inputs.sample, t, inputs.encoder_hidden_states)
    assert tome_session.importance.calls == 2 and tome_session.importance.map is not None


def test_importance_export_takes_every_size_and_batch_of_pairs_call_by_call(tmp_path, unet):
    """#34: importance merging's file takes every image size (its map [pairs, H, W] follows the
    latent; both plans of each block are computed from the call's shapes inside the If) and every
    batch of CFG pairs (the map's rows are the call's pairs): through ToMeSession at two sizes,
    one non-square, and batches 2 and 4, call by call equal to the backend, map included; a
    client feeding the standard inputs only runs at each batch; an odd batch and a size the U-Net
    cannot take are refused in one line."""
    config = ToMeConfig(ratio=0.5, method="importance", use_rand=False)
    result = export_onnx(copy.deepcopy(unet), tmp_path / "imp.onnx", config, height=HW, width=HW, seq_len=7,
                         atol=1e-4)
    assert [c for c in result.report.inputs if c.draw == "importance"][0].shape[0] == 2  # traced: 2 pairs
    model = onnx.load(str(result.path), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input}
    assert dims["sample"] == ["batch_size", 4, "height", "width"]
    assert dims["tome_importance"] == ["cfg_pairs", "importance_height", "importance_width"]
    assert dims["encoder_hidden_states"] == ["batch_size", "sequence_length", 32]
    assert sum(n.op_type == "If" for n in model.graph.node) == 3  # one per rewritten site
    session = ToMeSession(result.path, seed=0)
    assert session.meta.any_size and session.meta.batch == "cfg_pairs"
    for batch, hw in ((2, (16, 16)), (4, (24, 16))):
        session.reset()  # a new generation (its own map)
        backend = tome_backend(config, compiler="eager")
        compiled = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
        inputs = tiny_inputs(unet, batch=batch, hw=hw)
        for t in (999, 900, 800):  # step 1: ToMe fallback; then the previous step's map at this size
            inputs.timestep = torch.tensor(t)
            got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
            assert got.shape == inputs.sample.shape and (got - call(compiled, inputs)).abs().max() < 1e-4
            assert session.importance.map.shape == (batch // 2, *hw)
            assert torch.allclose(session.importance.map, backend.importance.map, atol=1e-5)
            backend.importance.map = session.importance.map.clone()  # one map for the next plans (near-ties)
        assert (got - call(unet, inputs)).abs().max() > 1e-3  # merged at this size too
        # a client that feeds no map (diffusers' ONNX pipeline) at this batch and size: the ToMe
        # branch, sized by the call (not by the traced default map), as ToMeSession's first step
        first = ToMeSession(result.path, seed=0)(inputs.sample, 999, inputs.encoder_hidden_states).sample
        feed = {"sample": inputs.sample.numpy(), "timestep": np.array([999.0], np.float32),
                "encoder_hidden_states": inputs.encoder_hidden_states.numpy()}
        assert np.abs(ort_session(result.path).run(None, feed)[0] - first.numpy()).max() < 1e-5
    inputs = tiny_inputs(unet, batch=3)
    with pytest.raises(ToMeExportError, match=r"^sample has batch 3; this importance export takes "
                                              r"classifier-free-guidance pairs \(an even batch"):
        session(inputs.sample, 999, inputs.encoder_hidden_states)
    inputs = tiny_inputs(unet, hw=(17, 16))
    with pytest.raises(ToMeExportError, match="multiples of 2"):
        session(inputs.sample, 999, inputs.encoder_hidden_states)
    # the map is the session's to size and feed (one row per pair): never taken by name
    inputs = tiny_inputs(unet, batch=2)
    given = np.zeros((1, 16, 16), np.float32)
    with pytest.raises(ToMeExportError, match=r"^tome_importance: ToMe's inputs are fed by ToMeSession "
                                              r"itself; to feed them by hand, run session.model"):
        session(inputs.sample, 999, inputs.encoder_hidden_states, tome_importance=given)


def test_lcm_timestep_cond_is_an_input_of_its_family(tmp_path):
    """#33: a family input added in one record (families.LCM: ``timestep_cond``, LCM's
    guidance-scale embedding) and its example value: the export takes it (per-image, dynamic
    batch), ToMeSession feeds it and equals the backend, and refuses a call without it."""
    from conftest import TINY_SD15

    from tome_compile.models import build_unet, example_inputs

    unet = build_unet(dict(TINY_SD15, time_cond_proj_dim=8))
    inputs = example_inputs(unet, batch=2, height=128, width=128, seq_len=7)
    assert inputs.family.name == "lcm" and inputs.family.names[-1] == "timestep_cond"
    path = export_onnx(copy.deepcopy(unet), tmp_path / "lcm.onnx", ToMeConfig(ratio=0.5, seed=0), height=128,
                       width=128, seq_len=7, partition_input=True).path
    session = ToMeSession(path, seed=0)
    assert session.meta.family == "lcm" and "timestep_cond" in session._model_inputs
    compiled = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", seed=0))
    kwargs = {"encoder_hidden_states": inputs.encoder_hidden_states, "timestep_cond": inputs.timestep_cond}
    for t in (999, 800):
        ours = session(inputs.sample, torch.tensor(t), **kwargs).sample
        with torch.no_grad():
            expected = compiled(inputs.sample, torch.tensor(t), **kwargs).sample
            plain = unet(inputs.sample, torch.tensor(t), **kwargs).sample
        assert (ours - expected).abs().max() < 1e-4 and (ours - plain).abs().max() > 1e-3
    with pytest.raises(ToMeExportError, match=r"this export needs timestep_cond \[B, D\]"):
        session(inputs.sample[:1], torch.tensor(999), encoder_hidden_states=inputs.encoder_hidden_states[:1])
