"""tome-export: ORT parity, tomesd parity, op inventory, CLI and its bad inputs, atomic writes."""

from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import onnx
import pytest
import torch
from conftest import call, tiny_inputs, tiny_unet, tomesd_reference
from tome_compile.export import ToMeSession, check_op_inventory, cli, export_onnx, lean_memory_options
from tome_compile.export.cli import main
from tome_compile.passes import SEED_INPUT
from torch.multiprocessing.reductions import StorageWeakRef

from tome_compile import ToMeConfig, ToMeError, ToMeExportError, tome_backend

HW = 128  # image size of the tiny latent-space models: 16 x 16 latent, 256 tokens at full resolution


@pytest.fixture(scope="module")
def unet(sd15):
    return sd15[0]


@pytest.fixture(scope="module")
def sd15_folder(tmp_path_factory, unet):
    folder = tmp_path_factory.mktemp("tiny_sd15")
    unet.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def exported(tmp_path_factory, unet):
    """The default export: fused attention, any batch, float timestep, hashed destinations."""
    out = tmp_path_factory.mktemp("onnx") / "unet.onnx"
    return export_onnx(
        copy.deepcopy(unet), out, ToMeConfig(ratio=0.5, seed=0), height=HW, width=HW, seq_len=7, atol=1e-4
    )


@pytest.fixture(scope="module")
def exported_partition(tmp_path_factory, unet):
    """--partition-input: the destinations drawn by the caller (bit-exact with tome_backend)."""
    out = tmp_path_factory.mktemp("onnx_partition") / "unet.onnx"
    return export_onnx(
        copy.deepcopy(unet),
        out,
        ToMeConfig(ratio=0.5, seed=0),
        height=HW,
        width=HW,
        seq_len=7,
        atol=1e-4,
        partition_input=True,
    )


def ort_session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def standard_feed(batch, t=999.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"sample": torch.randn(batch, 4, 16, 16, generator=g).numpy(),
            "timestep": np.array([t], dtype=np.float32),
            "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g).numpy()}


def attention_modules(unet):
    from diffusers.models.attention_processor import Attention

    return sum(isinstance(m, Attention) for m in unet.modules())


def test_default_export_is_what_ort_users_deploy(exported, unet):
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    assert exported.path.is_file() and exported.path.with_name("unet.onnx.data").is_file()
    assert exported.input_names == ["sample", "timestep", "encoder_hidden_states", "tome_seed"]
    assert exported.optional_inputs == ["tome_seed"]
    assert [s.path for s in exported.report.rewritten] == [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.1.transformer_blocks.0.attn1"]
    assert exported.parity_max_abs is not None and exported.parity_max_abs <= 1e-4
    model = onnx.load(str(exported.path), load_external_data=False)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    # every attention of the U-Net (merged, unmerged, cross) is one fused node
    assert ops.count(("com.microsoft", "MultiHeadAttention")) == attention_modules(unet) == 8
    assert not any(op.startswith("Random") for _, op in ops)  # destinations hashed, not drawn
    assert not {"ReduceL2", "ReduceMax", "Softmax"} & {op for _, op in ops}  # shape inference reads all
    assert "GroupNormalization" not in {
        op for _, op in ops
    }  # opset 20: InstanceNormalization (CUDA EP has it)
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    assert inputs["timestep"].elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in inputs["timestep"].shape.dim] == [1]
    assert inputs["sample"].shape.dim[0].dim_param and inputs["encoder_hidden_states"].shape.dim[0].dim_param
    assert [i.name for i in model.graph.initializer if i.name.startswith("tome")] == ["tome_seed"]
    assert [o.name for o in model.graph.output] == ["out_sample"]
    assert check_op_inventory(exported.path).ok
    inferred = SymbolicShapeInference.infer_shapes(onnx.load(str(exported.path)), auto_merge=True)
    assert inferred is not None


def test_portable_export_has_no_contrib_ops(tmp_path, unet):
    # batch=1 too: a dynamic batch is traced at 2 (torch.export would specialise a size-1 axis)
    result = export_onnx(copy.deepcopy(unet), tmp_path / "p.onnx", ToMeConfig(ratio=0.5, use_rand=False),
                         height=HW, width=HW, seq_len=7, atol=1e-4, portable=True, batch=1)
    model = onnx.load(str(result.path), load_external_data=False)
    assert {n.domain for n in model.graph.node} == {""} and result.fused_attention == 0
    assert sum(n.op_type == "Softmax" for n in model.graph.node) == 8


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


def test_any_batch_with_standard_inputs_only(exported, exported_partition):
    from tome_compile.sampler import hashed_partition

    hashed, drawn = ort_session(exported.path), ort_session(exported_partition.path)
    cells = sum(a * b for a, b in next(s for s in exported_partition.report.inputs).cells)
    for batch in (1, 2, 4):
        feed = standard_feed(batch)
        got = hashed.run(None, feed)[0]  # tome_seed omitted: its default, 0
        assert got.shape == feed["sample"].shape
        # the graph's destinations are hashed_partition(seed, timestep): fed to the partition
        # export (== tome_backend with that partition) they give the same output
        partition = hashed_partition(torch.tensor(0), torch.tensor([999.0]), cells, 4).numpy()
        ref = drawn.run(None, {**feed, "tome_partition": partition})[0]
        assert np.abs(got - ref).max() < 1e-5
        assert np.array_equal(got, hashed.run(None, {**feed, "tome_seed": np.array(0)})[0])


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


def test_tome_seed_changes_the_output(exported):
    session, feed = ort_session(exported.path), standard_feed(2)
    a = session.run(None, {**feed, "tome_seed": np.array(0)})[0]
    b = session.run(None, {**feed, "tome_seed": np.array(7)})[0]
    assert np.abs(a - b).max() > 1e-3


def test_session_equals_compiled_backend(exported_partition, unet):
    # Same seed => same partition sequence => the ONNX and torch.compile paths agree call by call.
    session = ToMeSession(exported_partition.path, seed=3)
    assert session.provider == "CPUExecutionProvider"
    backend = tome_backend(0.5, compiler="eager", seed=3)
    compiled = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    inputs = tiny_inputs(unet)
    for _ in range(2):
        got = session(
            inputs.sample, inputs.timestep, encoder_hidden_states=inputs.encoder_hidden_states
        ).sample
        assert (got - call(compiled, inputs)).abs().max() < 1e-4
    tuple_out = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states, return_dict=False)
    assert isinstance(tuple_out, tuple) and tuple_out[0].shape == inputs.sample.shape


@pytest.mark.parametrize("timestep", [999, 999.0, torch.tensor(999), torch.tensor([999.0]),
                                      torch.tensor([999, 999])])
def test_session_takes_every_timestep_form(exported, unet, timestep):
    session = ToMeSession(exported.path, seed=0)
    inputs = tiny_inputs(unet)
    got = session(inputs.sample, timestep, inputs.encoder_hidden_states).sample
    feed = {"sample": inputs.sample.numpy(), "timestep": np.array([999.0], np.float32),
            "encoder_hidden_states": inputs.encoder_hidden_states.numpy()}
    assert np.array_equal(got.numpy(), ort_session(exported.path).run(None, feed)[0])


def test_session_rejects_wrong_shapes(exported, exported_partition):
    session = ToMeSession(exported.path, seed=0)
    # any size, but in multiples of the U-Net's downsampling (the tiny U-Net: 2)
    with pytest.raises(ToMeExportError, match="multiples of 2 .*images in multiples of 16 pixels"):
        session(torch.zeros(2, 4, 9, 8), torch.tensor(1), torch.zeros(2, 7, 32))
    with pytest.raises(ToMeExportError, match="fixed per export"):  # --partition-input keeps its size
        ToMeSession(exported_partition.path, seed=0)(torch.zeros(2, 4, 8, 8), torch.tensor(1),
                                                      torch.zeros(2, 7, 32))
    with pytest.raises(ToMeExportError, match="different values"):
        session(torch.zeros(2, 4, 16, 16), torch.tensor([1, 2]), torch.zeros(2, 7, 32))


def test_session_plans_lean_memory_on_the_cpu_ep(exported):
    """ToMeSession's CPU default is lean_memory_options (every value its own buffer: ORT's reuse
    plan held 1.55 GB at the peak of an SD 1.5 call where the live values are 0.22 GB), the same
    numbers as ORT's own plan; options the caller gives are used as given."""
    import onnxruntime as ort

    lean = ToMeSession(exported.path, providers=["CPUExecutionProvider"], seed=0)
    options = lean.session.get_session_options()
    assert not options.enable_mem_reuse and not options.enable_mem_pattern
    given = ToMeSession(exported.path, providers=["CPUExecutionProvider"], seed=0,
                        session_options=ort.SessionOptions())
    assert given.session.get_session_options().enable_mem_reuse  # negative: the caller's, untouched
    feed = standard_feed(2)
    args = (feed["sample"], feed["timestep"], feed["encoder_hidden_states"])
    assert np.array_equal(lean(*args), given(*args))
    assert lean_memory_options(ort.SessionOptions()).enable_mem_reuse is False


def test_fp16_export_runs_on_the_cpu_ep(tmp_path, unet, exported):
    result = export_onnx(copy.deepcopy(unet), tmp_path / "h.onnx", ToMeConfig(ratio=0.5, seed=0), height=HW,
                         width=HW, seq_len=7, fp16=True)
    assert result.parity_provider == "CPUExecutionProvider"  # checked vs PyTorch fp16, not skipped
    assert result.parity_max_rel is not None and result.parity_max_rel < 1e-2
    model = onnx.load(str(result.path), load_external_data=False)
    scatters = [n for n in model.graph.node if n.op_type == "ScatterElements"]
    assert scatters and all(
        n.input[0] in {c.output[0] for c in model.graph.node if c.op_type == "Cast"}
        for n in scatters
        if any(a.name == "reduction" and a.s == b"add" for a in n.attribute)
    )
    feed = standard_feed(2)
    half = ort_session(result.path).run(
        None,
        {
            k: v.astype(np.float16) if v.dtype == np.float32 and k != "timestep" else v
            for k, v in feed.items()
        },
    )[0]
    full = ort_session(exported.path).run(None, feed)[0]
    assert half.dtype == np.float16
    # fp16 vs the fp32 export: same destinations, fp16 rounding only
    assert np.abs(half.astype(np.float32) - full).max() < 2e-2 * max(1.0, float(np.abs(full).max()))


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


def test_fp16_parity_session_keeps_the_weights_fp16(exported):
    """Issue #20: the CPU EP's default level stores an fp32 copy of every fp16 conv / matmul weight
    (the README's SDXL parity peaked at 4.1x the weights); an fp16 check loads at basic level with
    priority-based order (each weight cast when its op runs). fp32 files keep the default."""
    import onnxruntime as ort
    from tome_compile.export import parity

    half = parity.session(exported.path, fp16=True).get_session_options()
    full = parity.session(exported.path, fp16=False).get_session_options()
    assert half.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert half.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert full.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert full.execution_order == ort.ExecutionOrder.DEFAULT


def test_no_rand_export_equals_tomesd_at_any_batch(tmp_path, unet):
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
                         height=HW, width=HW, seq_len=7, atol=1e-4, release_weights=True)
    assert result.parity_max_abs is not None and result.parity_max_abs < 1e-4
    assert all(p.numel() == 0 for p in model.parameters()) and all(p.numel() > 0 for p in unet.parameters())
    gc.collect()
    assert sum(not s.expired() for s in storages) == 0
    with pytest.raises(ReferenceError):
        repr(dead_proxy.training)  # it was dead throughout
    assert result.input_names == ["sample", "timestep", "encoder_hidden_states"]  # exactly the standard ones
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
            for i in onnx.load(str(result.path), load_external_data=False).graph.input}
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
                 "--seq-len", "7", "--max-downsample", "2", "--fp16", "--optimize", "cpu", "--no-rand"])
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


def test_cli_success(tmp_path, sd15_folder, capsys):
    out = tmp_path / "cli.onnx"
    code = main(
        [
            str(out),
            "--model",
            str(sd15_folder),
            "--height",
            str(HW),
            "--width",
            str(HW),
            "--seq-len",
            "7",
            "--ratio",
            "0.4",
            "--optimize",
            "cpu",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert out.is_file() and (tmp_path / "cli.onnx.data").is_file()
    assert "rewrote 3 of 8 attention sites" in printed and "256 -> 154 tokens" in printed
    assert "parity (CPUExecutionProvider): max abs" in printed  # checked again after the optimizer
    assert "attention: 8 com.microsoft.MultiHeadAttention nodes" in printed
    assert "SkipLayerNormalization 8" in printed and "NhwcConv" not in printed  # CPU: no CUDA-only fusions
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.onnx", "cli.onnx.data"]
    model = onnx.load(str(out), load_external_data=False)
    assert "tome_compile" in {p.key for p in model.metadata_props}  # ToMeSession still reads it
    got = ort_session(out).run(None, standard_feed(3))[0]
    assert got.shape == (3, 4, 16, 16) and np.isfinite(got).all()


def test_optimizer_finds_the_plain_exports_fusions(tmp_path, unet, exported):
    from tome_compile.export.onnx_export import optimize_for_ort

    plain = export_onnx(
        copy.deepcopy(unet),
        tmp_path / "plain.onnx",
        ToMeConfig(ratio=0.0),
        height=HW,
        width=HW,
        seq_len=7,
        check_parity=False,
    )
    assert plain.report.rewritten == [] and plain.fused_attention == 8
    for provider in ("cpu", "cuda"):
        ours = optimize_for_ort(exported.path, tmp_path / f"ours_{provider}.onnx", provider)
        theirs = optimize_for_ort(plain.path, tmp_path / f"plain_{provider}.onnx", provider)
        for op in ("MultiHeadAttention", "LayerNormalization", "SkipLayerNormalization", "GroupNorm",
                   "SkipGroupNorm"):
            assert ours.get(op, 0) == theirs.get(op, 0), (provider, op, ours, theirs)
        assert theirs["SkipLayerNormalization"] == 8
    assert theirs["GroupNorm"] + theirs["SkipGroupNorm"] == 21  # CUDA: every group norm fused
    # the optimised any-size file keeps Optimum's symbolic axes and runs another size, non-square
    optimized = onnx.load(str(tmp_path / "ours_cpu.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in [*optimized.graph.input, *optimized.graph.output]}
    assert dims["sample"] == dims["out_sample"] == ["batch_size", 4, "height", "width"]
    assert dims["encoder_hidden_states"] == ["batch_size", "sequence_length", 32]
    g = torch.Generator().manual_seed(3)
    feed = {"sample": torch.randn(1, 4, 12, 20, generator=g).numpy(),
            "timestep": np.array([500.0], np.float32),
            "encoder_hidden_states": torch.randn(1, 5, 32, generator=g).numpy()}
    got = ort_session(tmp_path / "ours_cpu.onnx").run(None, feed)[0]
    want = ort_session(exported.path).run(None, feed)[0]
    assert got.shape == (1, 4, 12, 20) and np.abs(got - want).max() <= 1e-4


def test_gpu_check_runs_one_file_at_two_sizes(exported, sd15_folder):
    """gpu_check's any-size part, on two CPU sessions (the GPU machine runs it CUDA vs CPU): one
    file at the traced size and a non-square one, the same numbers from both sessions."""
    from tome_compile.benchmarks.gpu_check import two_sizes

    rows = two_sizes(exported.path, str(sd15_folder), [(HW, HW), (96, 160)], batch=2, repeats=1,
                     providers=("CPUExecutionProvider", "CPUExecutionProvider"))
    assert [size for size, _, _ in rows] == [(HW, HW), (96, 160)]
    assert all(t > 0 and diff == 0.0 for _, t, diff in rows)


def test_optimizer_leaves_the_weights_on_disk_and_writes_only_live_ones(tmp_path, exported):
    """Issue #20 (export memory): ORT's optimizer runs on the graph with its matrices and kernels
    on disk (only vectors are read in; for CUDA also the Conv kernels NhwcConv transposes), and the
    optimised file's data holds exactly the tensors its graph uses, copied byte for byte."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data
    from tome_compile.export.ort_optimizer import load_for_fusions, optimize_for_ort

    def on_disk(proto):
        return {t.name for t in proto.graph.initializer if uses_external_data(t)}

    src = onnx.load(str(exported.path), load_external_data=False)
    cpu, cuda = load_for_fusions(exported.path, "cpu"), load_for_fusions(exported.path, "cuda")
    matrices = {t.name for t in src.graph.initializer if sum(d > 1 for d in t.dims) >= 2}
    kernels = {n.input[1] for n in src.graph.node if n.op_type == "Conv"}
    assert len(matrices) > 50 and kernels <= matrices
    assert on_disk(cpu) == matrices  # vectors read in, every matrix and kernel left on disk
    assert on_disk(cuda) == matrices - kernels  # NhwcConv reads the kernels
    assert all(t.raw_data or t.float_data for t in cpu.graph.initializer if t.name not in matrices)

    dst = tmp_path / "opt" / "unet.onnx"
    fusions = optimize_for_ort(exported.path, dst, "cpu")
    assert fusions["SkipLayerNormalization"] == 8 and fusions["MultiHeadAttention"] == 8
    assert sorted(p.name for p in dst.parent.iterdir()) == ["unet.onnx", "unet.onnx.data"]
    out = onnx.load(str(dst), load_external_data=False)
    used = {name for n in out.graph.node for name in n.input}
    stored = [t for t in out.graph.initializer if uses_external_data(t)]
    assert {t.name for t in stored} <= used and {ExternalDataInfo(t).location for t in stored} == {
        "unet.onnx.data"
    }
    assert (dst.parent / "unet.onnx.data").stat().st_size == sum(ExternalDataInfo(t).length for t in stored)
    full_src = {
        t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(exported.path)).graph.initializer
    }
    full_out = onnx.load(str(dst))
    for t in full_out.graph.initializer:
        if t.name in matrices:  # streamed from the source's data file
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), full_src[t.name])
    feed = standard_feed(2)
    np.testing.assert_allclose(
        ort_session(dst).run(None, feed)[0], ort_session(exported.path).run(None, feed)[0], atol=1e-5
    )


def test_into_replaces_the_unet_of_an_optimum_folder(tmp_path, sd15_folder, capsys):
    folder = _optimum_folder(tmp_path)
    code = main(["--into", str(folder), "--model", str(sd15_folder), "--height", str(HW), "--width", str(HW),
                 "--seq-len", "7"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    unet_dir = folder / "unet"
    assert sorted(p.name for p in unet_dir.iterdir()) == ["config.json", "model.onnx", "model.onnx.data"]
    assert "removed" in printed and "model.onnx_data" in printed  # the old weights, no longer used
    # what Optimum's ORT U-Net does: read the timestep type from the session, send [t] of it
    session = ort_session(unet_dir / "model.onnx")
    timestep_type = next(i.type for i in session.get_inputs() if i.name == "timestep")
    assert timestep_type == "tensor(float)" and [i.name for i in session.get_outputs()] == ["out_sample"]
    required = [i.name for i in session.get_inputs() if i.name != "tome_seed"]
    assert required == ["sample", "timestep", "encoder_hidden_states"]
    feed = standard_feed(2)
    out = session.run(None, {"sample": feed["sample"], "timestep": np.array([981], dtype=np.float32),
                             "encoder_hidden_states": feed["encoder_hidden_states"]})[0]
    assert out.shape == feed["sample"].shape


def _optimum_folder(tmp_path, pipeline="ORTStableDiffusionPipeline"):
    """A folder laid out like `optimum-cli export onnx` writes: model_index.json, unet/model.onnx
    with its weights in unet/model.onnx_data, unet/config.json."""
    folder = tmp_path / "sd-onnx"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text(f'{{"_class_name": "{pipeline}"}}')
    (folder / "unet" / "config.json").write_text('{"in_channels": 4, "cross_attention_dim": 32}')
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
    w = onnx.numpy_helper.from_array(np.ones(4096, np.float32)[:4].copy(), "w")
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "w"], ["y"])], "old", [x], [y], [w])
    )
    onnx.save(model, str(folder / "unet" / "model.onnx"), save_as_external_data=True,
              location="model.onnx_data", size_threshold=0)
    return folder


@pytest.mark.parametrize(
    "give_model, words", [(False, "--into needs --model"), (True, "cross_attention_dim")]
)
def test_into_refuses_and_keeps_the_old_unet(tmp_path, sd15_folder, capsys, give_model, words):
    folder = _optimum_folder(tmp_path)
    extra = []
    if give_model:  # the folder's U-Net is another architecture (SD 1.5's 768-wide text)
        (folder / "unet" / "config.json").write_text('{"in_channels": 4, "cross_attention_dim": 768}')
        extra = ["--model", str(sd15_folder)]
    before = {p.name: p.read_bytes() for p in (folder / "unet").iterdir()}
    assert (
        main(["--into", str(folder)] + extra + ["--height", str(HW), "--width", str(HW), "--seq-len", "7"])
        == 2
    )
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in (folder / "unet").iterdir()} == before


@pytest.mark.parametrize("opset", ["5", "17", "24"])
def test_cli_rejects_opsets_the_exporter_cannot_write(tmp_path, sd15_folder, capsys, opset):
    assert main([str(tmp_path / "x.onnx"), "--opset", opset] + _base(sd15_folder)) == 2
    err = capsys.readouterr().err
    assert f"opset {opset} is not supported" in err and "18..23" in err and one_error_line(err)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, words", [
    (["--model", "/nonexistent/unet"], "no such folder"),
    (["--ratio", "0.9"], "ratio=0.9"),
    (["--height", "100"], "--height 100 must be a positive multiple of 8"),
    (["--max-downsample", "3"], "max_downsample=3"),
    (["--batch", "0"], "--batch 0"),
])
def test_cli_bad_input(tmp_path, sd15_folder, capsys, argv, words):
    args = [
        str(tmp_path / "bad.onnx"),
        "--model",
        str(sd15_folder),
        "--height",
        str(HW),
        "--width",
        str(HW),
        "--seq-len",
        "7",
    ]
    code = main(args + argv)
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and err.startswith("tome-export: error:") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_to_overwrite_and_folders(tmp_path, sd15_folder, capsys):
    existing = tmp_path / "keep.onnx"
    existing.write_text("precious")
    base = ["--model", str(sd15_folder), "--height", str(HW), "--width", str(HW), "--seq-len", "7"]
    assert main([str(existing)] + base) == 2
    assert "--force" in capsys.readouterr().err and existing.read_text() == "precious"
    assert main([str(tmp_path / "missing" / "x.onnx")] + base) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(tmp_path / "x.txt")] + base) == 2
    assert "must end in .onnx" in capsys.readouterr().err
    assert main(["/proc/tome.onnx"] + base) == 2  # a folder nothing can be written to
    assert "write" in capsys.readouterr().err


def test_failed_export_leaves_nothing_behind(tmp_path, sd15_folder, capsys):
    # A parity tolerance of 0 cannot be met: the export fails after writing to its temp folder.
    code = main([str(tmp_path / "fail.onnx"), "--model", str(sd15_folder), "--height", str(HW),
                 "--width", str(HW), "--seq-len", "7", "--atol", "0"])
    assert code == 2 and "parity check failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and onnxruntime-gpu")
def test_cuda_session_parity(exported, unet):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu not installed")
    cpu = ToMeSession(exported.path, seed=1, providers=["CPUExecutionProvider"])
    gpu = ToMeSession(exported.path, seed=1)
    assert gpu.provider == "CUDAExecutionProvider"
    inputs = tiny_inputs(unet)
    a = cpu(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    b = gpu(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    assert (a - b).abs().max() < 1e-3


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
    assert session.importance.calls == 3


def test_importance_default_export_runs_with_standard_inputs(tmp_path, unet):
    config = ToMeConfig(ratio=0.5, method="importance", seed=0)
    result = export_onnx(copy.deepcopy(unet), tmp_path / "imp.onnx", config, height=HW, width=HW, seq_len=7,
                         atol=1e-4)
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


# Issue #9 items 7-9: a foreign model folder, bad sizes, disk full, SIGTERM, stale temp folders.
def one_error_line(err):
    """One line of error (the progress bar shares stderr), no traceback."""
    return err.count("tome-export: error:") == 1 and "Traceback" not in err and err.count("Error") == 0


def _base(folder):
    return ["--model", str(folder), "--height", str(HW), "--width", str(HW), "--seq-len", "7"]


def test_cli_rejects_a_vae_folder(tmp_path, capsys):
    from diffusers import AutoencoderKL

    vae = tmp_path / "vae"
    AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                  up_block_types=("UpDecoderBlock2D",), norm_num_groups=8).save_pretrained(vae)
    out = tmp_path / "out"
    out.mkdir()
    assert main([str(out / "x.onnx")] + _base(vae)) == 2
    err = capsys.readouterr().err
    assert "holds a AutoencoderKL, not a UNet2DConditionModel" in err and one_error_line(err)
    assert list(out.iterdir()) == []


def test_cli_rejects_an_empty_config(tmp_path, capsys):
    folder = tmp_path / "empty_config"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main([str(tmp_path / "x.onnx")] + _base(folder)) == 2
    err = capsys.readouterr().err
    assert "is not a diffusers U-Net config" in err and one_error_line(err)


def test_cli_names_missing_weight_keys(tmp_path, unet, capsys):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    unet.save_pretrained(folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors.pop("conv_in.weight")
    save_file(tensors, weights)
    out = tmp_path / "out"
    out.mkdir()
    assert main([str(out / "x.onnx")] + _base(folder)) == 2
    err = capsys.readouterr().err
    assert "lack 1 of the U-Net's tensors (conv_in.weight)" in err and "nan" not in err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("argv, words", [
    (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
    (["--batch", "100000"], "--batch 100000 is outside [1, 64]"),
    (["--frames", "0"], "--frames 0 is outside [1, 128]"),
    (["--blocks", "7-x"], "blocks '7-x': give indices and ranges like 7-20"),
    (["--blocks", "-3"], "blocks '-3'"),
    (["--frames", "4"], "frames=4 is for video U-Nets; UNet2DConditionModel takes images"),
])
def test_cli_rejects_sizes_before_any_work(tmp_path, sd15_folder, capsys, argv, words):
    assert main([str(tmp_path / "x.onnx")] + _base(sd15_folder) + argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_disk_full_is_one_line(tmp_path, sd15_folder, capsys, monkeypatch):
    import errno

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", full)
    assert main([str(tmp_path / "x.onnx")] + _base(sd15_folder)) == 2
    err = capsys.readouterr().err
    assert f"no space left in {str(tmp_path)!r}" in err and one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_stale_partial_folders_are_swept(tmp_path, sd15_folder, capsys):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f".x.onnx.partial-{dead.stdout.strip()}-abc"
    stale.mkdir()
    (stale / "x.onnx.data").write_bytes(b"0" * 1024)
    import os

    live = tmp_path / f".x.onnx.partial-{os.getpid()}-def"  # a running export's folder: kept
    live.mkdir()
    other = tmp_path / ".y.onnx.partial-1-ghi"  # another output's: not ours to judge
    other.mkdir()
    assert main([str(tmp_path / "x.onnx"), "--no-rand"] + _base(sd15_folder)) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([live.name, other.name, "x.onnx", "x.onnx.data"])


def test_sigterm_cleans_up(tmp_path, sd15_folder):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "x.onnx"
    proc = subprocess.Popen([sys.executable, "-m", "tome_compile.export.cli", str(out)] + _base(sd15_folder),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".x.onnx.partial-*")):  # wait for the export to start writing
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "SIGTERM" in err and "Traceback" not in err, err[-4000:]
    assert list(tmp_path.iterdir()) == []


def test_a_signal_right_after_the_temp_folder_is_made_leaves_nothing(tmp_path, unet, monkeypatch):
    # CI: test_sigterm_cleans_up sends SIGTERM the moment the folder appears; the handler raised
    # between mkdir and the folder's path reaching export_onnx, and the folder stayed behind.
    import os
    import tempfile
    from pathlib import Path

    from tome_compile.export import ExportOptions, onnx_export, output_files

    real_mkdtemp = tempfile.mkdtemp
    made = []

    def mkdtemp_then_signal(*args, **kwargs):
        made.append(Path(real_mkdtemp(*args, **kwargs)))
        raise KeyboardInterrupt  # what the SIGINT handler raises at the next bytecode

    monkeypatch.setattr(output_files.tempfile, "mkdtemp", mkdtemp_then_signal)
    for name in ("trace", "rewrite", "convert"):  # nothing to trace: only the folder's life is tested
        monkeypatch.setitem(onnx_export._STAGE_FUNCTIONS, name, lambda run: None)
    other = tmp_path / f".x.onnx.partial-{os.getpid() + 1}-keep"  # not this process's: left alone here
    other.mkdir()
    monkeypatch.setattr(output_files, "alive", lambda pid: True)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(unet, tmp_path / "x.onnx", ToMeConfig(ratio=0.5), ExportOptions(height=HW, width=HW))
    assert len(made) == 1 and made[0].parent == tmp_path  # the folder was made, then removed
    assert sorted(tmp_path.iterdir()) == [other]


@pytest.mark.parametrize("signum, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_swallowed_interrupt_still_stops_the_export(
    tmp_path, sd15_folder, monkeypatch, capsys, signum, code
):
    # A library between the handler and main() can lose the exception the handler raises (CI saw a
    # SIGTERMed export run to the end and exit 0): the next step must stop it all the same.
    import os
    import signal
    import time

    from tome_compile.export import onnx_export

    reached = []

    def export_that_loses_the_signal(unet, out, config, options=None, *, step, **kwargs):
        step("tracing")
        try:
            os.kill(os.getpid(), getattr(signal, signum))
            time.sleep(5)  # the handler raises in here
        except BaseException:  # noqa: BLE001 — what a careless library does
            reached.append("swallowed")
        step("converting")
        reached.append("went on")  # must not happen
        out.write_text("half")

    monkeypatch.setattr(onnx_export, "export_onnx", export_that_loses_the_signal)
    out = tmp_path / "x.onnx"
    assert main([str(out)] + _base(sd15_folder)) == code
    assert reached == ["swallowed"] and not out.exists()
    assert "stopped; nothing was written" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is not cli._on_sigterm  # handlers put back


def test_session_io_binding_equals_numpy_path(exported, unet):
    # The CUDA EP path (tensors bound by pointer, output written into a torch tensor), run on CPU.
    inputs = tiny_inputs(unet)
    plain = ToMeSession(exported.path, seed=0, io_binding=False)
    bound = ToMeSession(exported.path, seed=0, io_binding=True)
    a = plain(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    b = bound(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    assert bound.io_binding and torch.equal(a, b)
    with pytest.raises(ToMeExportError, match="multiples of 2"):
        bound(torch.zeros(2, 4, 8, 7), 1, torch.zeros(2, 7, 32))


def test_merge_scatters_take_int32_indices(exported):
    """ORT materialises the merge's expanded [B, N, C] index: every ScatterElements reads it as
    int32 (a Cast before the Expand), counted in the metadata; parity is the fixture's check."""
    model = onnx.load(str(exported.path), load_external_data=False)
    nodes = list(model.graph.node)
    for node in model.graph.node:  # If branches (none in the default export, but keep it honest)
        nodes += [n for attr in node.attribute if attr.g is not None for n in attr.g.node]
    made = {out: n for n in nodes for out in n.output}
    scatters = [n for n in nodes if n.op_type == "ScatterElements" and made[n.input[1]].op_type == "Expand"]
    assert scatters and ToMeSession(exported.path).meta.int32_scatter_indices == len(scatters)
    for scatter in scatters:
        expand = made[scatter.input[1]]
        cast = made[expand.input[0]]
        assert expand.op_type == "Expand" and cast.op_type == "Cast"
        assert next(a.i for a in cast.attribute if a.name == "to") == onnx.TensorProto.INT32
    # the int64 Expands they replaced are gone, not left dead in the graph
    read = {name for n in nodes for name in n.input} | {o.name for o in model.graph.output}
    assert all(n.output[0] in read for n in nodes if n.op_type == "Expand")


def shared_merge_zeros(model) -> list[str]:
    """The zeros (``Expand``, through any ``Cast``) that more than one merge's ScatterElements
    starts from: a value the model computes once and holds from the first merge to the last."""
    nodes = list(model.graph.node)
    made = {out: n for n in nodes for out in n.output}
    seen: dict[str, int] = {}
    for n in nodes:
        if n.op_type == "ScatterElements" and n.input[1] in made and made[n.input[1]].op_type == "Expand":
            source = made.get(n.input[0])
            while source is not None and source.op_type == "Cast":
                source = made.get(source.input[0])
            if source is not None and source.op_type == "Expand":
                seen[source.output[0]] = seen.get(source.output[0], 0) + 1
    return [name for name, count in seen.items() if count > 1]


def test_each_merge_starts_from_its_own_zeros(exported, tmp_path):
    """Issue #20: a shape-only ``torch.zeros`` in the merge was one ``Expand`` for every merge of a
    size, alive from the first merge to the last (SD 1.5 512², batch 2: 5.2 MB at the peak of an
    ORT call; measured 0.820 -> 0.815 GB per call). The zeros now come from each merge's own plan."""
    model = onnx.load(str(exported.path), load_external_data=False)
    scatters = [n for n in model.graph.node if n.op_type == "ScatterElements"]
    assert len(scatters) >= 3 and shared_merge_zeros(model) == []
    # negative: two scatters planted on one Expand are found
    h = onnx.helper
    planted = h.make_graph(
        [h.make_node("Expand", ["z", "shape"], ["zeros"]), h.make_node("Expand", ["i", "shape"], ["index"]),
         h.make_node("ScatterElements", ["zeros", "index", "x"], ["a"], axis=1, reduction="add"),
         h.make_node("ScatterElements", ["zeros", "index", "y"], ["b"], axis=1, reduction="add")],
        "planted", [], [])
    assert shared_merge_zeros(h.make_model(planted)) == ["zeros"]


def made_before_the_blocks(model, late=("sample", "encoder_hidden_states")) -> dict[str, list[str]]:
    """What the merges read that the model can compute from its other inputs alone (constants, the
    batch size, ``tome_seed``, the timestep): ONNX Runtime's default order runs such a node at the
    start of a call, and every block that reads it holds it from there. Returns the values
    ``ScatterElements`` read as data or updates, and the values of more than one element made
    from ``tome_seed``."""
    from onnx import shape_inference

    model = shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.value_info) + list(model.graph.output)}
    # late: waits for a block (reads the latents or the text); early: made from the other inputs
    # (a Shape of the latents is early: ORT knows it at the start); constants alone fold away
    late_values, seeded = set(late), {SEED_INPUT}
    early = {i.name for i in model.graph.input} - late_values
    for n in model.graph.node:  # topological in a valid ONNX file
        if n.op_type in ("Shape", "Size") and n.input[0] in late:
            early.update(n.output)
        elif any(i in late_values for i in n.input):
            late_values.update(n.output)
        elif any(i in early for i in n.input):
            early.update(n.output)
            if any(i in seeded for i in n.input):
                seeded.update(n.output)
    scattered = [i for n in model.graph.node if n.op_type == "ScatterElements"
                 for i in (n.input[0], n.input[2]) if i in early]
    big = [v for v in seeded - {SEED_INPUT}
           if v not in shapes or None in shapes[v] or int(np.prod(shapes[v])) > 1]
    return {"scatter": sorted(set(scattered)), "seeded": sorted(big)}


def test_the_merges_make_nothing_before_their_block(exported):
    """Issue #20: ToMe's file held more than the plain one at the peak of an ORT call. Its merges
    scattered into shape-only ``zeros`` / ``empty`` / ``full`` / ``ones`` (one value for every block
    of a size, computed once and held from the first block to the last), and the hashed partition
    was computed for every block at once, from the seed, at the start of the call. Now every value
    a scatter reads comes from its block's input, and each block hashes its own cells when it
    runs: SD 1.5 512², batch 2, the live values at the peak 224.34 MB -> 224.31 MB = the plain
    file's +80 bytes (ORT's profile, execution order)."""
    model = onnx.load(str(exported.path), load_external_data=False)
    assert sum(n.op_type == "ScatterElements" for n in model.graph.node) >= 6
    assert made_before_the_blocks(model) == {"scatter": [], "seeded": []}
    # negative: a scatter from shape-only zeros and a whole partition hashed from the seed are found
    h = onnx.helper
    planted = h.make_graph(
        [h.make_node("Shape", ["sample"], ["shape"]), h.make_node("ConstantOfShape", ["shape"], ["zeros"]),
         h.make_node("ScatterElements", ["zeros", "index", "sample"], ["merged"], axis=1, reduction="add"),
         h.make_node("Expand", [SEED_INPUT, "shape"], ["hashed"])],
        "planted",
        [h.make_tensor_value_info("sample", onnx.TensorProto.FLOAT, [2, 8]),
         h.make_tensor_value_info(SEED_INPUT, onnx.TensorProto.INT64, []),
         h.make_tensor_value_info("index", onnx.TensorProto.INT64, [2, 8])],
        [h.make_tensor_value_info("merged", onnx.TensorProto.FLOAT, [2, 8]),
         h.make_tensor_value_info("hashed", onnx.TensorProto.INT64, [2, 8])])
    assert made_before_the_blocks(h.make_model(planted)) == {"scatter": ["zeros"], "seeded": ["hashed"]}


def test_metadata_round_trip_and_files_without_it(tmp_path, exported):
    """The metadata is one dataclass written and read by the same code (#19); a file without it is
    not a tome-export file (apply() and tome-serve refuse it: they test ``exported``, since the
    defaults of an empty ExportMetadata are a valid object); another version is refused."""
    from tome_compile.export.metadata import METADATA_KEY, ExportMetadata

    from tome_compile import apply

    model = onnx.load(str(exported.path), load_external_data=False)
    meta = ExportMetadata.of_model(model)
    assert meta is not None and ExportMetadata.from_json(meta.to_json()) == meta
    assert [s.name for s in meta.tome_inputs] == exported.report.input_names and meta.height == HW
    assert meta.optional_inputs == exported.optional_inputs
    assert meta.fused_attention == exported.fused_attention

    plain = _optimum_folder(tmp_path) / "unet" / "model.onnx"
    session = ToMeSession(plain)
    assert not session.exported and session.specs == [] and ToMeSession(exported.path).exported

    class Pipe:  # an ONNX pipeline: its unet is not a torch module
        unet = object()

    with pytest.raises(ToMeError, match="is not a tome-export file"):
        apply(Pipe(), onnx=plain)

    old = onnx.load(str(plain))
    old.metadata_props.add(key=METADATA_KEY, value='{"version": 1}')
    onnx.save(old, str(tmp_path / "old.onnx"))
    with pytest.raises(ToMeExportError, match="another tome-compile version .* version 1"):
        ToMeSession(tmp_path / "old.onnx")


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


def test_34_diffusers_onnx_pipeline_generates_two_sizes_from_one_file(exported):
    """#34: the file replaces Optimum's plain export, which serves every size: diffusers' ONNX
    pipeline (3 standard inputs, NumPy) generates at 128² and at 96 x 160 from the same file (it
    failed with ORT's "Got invalid dimensions for input: sample" before), and a raw client at a
    third size and batch 3 gets what ToMeSession gets."""
    from test_call_state import onnx_pipeline

    pipe = onnx_pipeline(exported.path)
    for height, width in ((128, 128), (96, 160)):
        g = np.random.RandomState(0)
        latents = g.randn(1, 4, height // 8, width // 8).astype(np.float32)
        out = pipe(prompt_embeds=np.ones((1, 7, 32), np.float32), negative_prompt_embeds=np.zeros((1, 7, 32),
                   np.float32), height=height, width=width, num_inference_steps=2, output_type="np",
                   latents=latents).images
        assert out.shape[1:3] == (height // 8, width // 8) and np.isfinite(out).all()
    # the raw file at a third size and batch 3 equals a ToMeSession call there (one code path)
    session = ToMeSession(exported.path)
    feed = {"sample": np.random.RandomState(1).randn(3, 4, 20, 12).astype(np.float32),
            "timestep": np.array([500.0], np.float32),
            "encoder_hidden_states": np.random.RandomState(2).randn(3, 5, 32).astype(np.float32)}
    raw = ort_session(exported.path).run(None, feed)[0]
    got = session(torch.from_numpy(feed["sample"]), 500.0, torch.from_numpy(feed["encoder_hidden_states"]))
    assert raw.shape == (3, 4, 20, 12) and np.array_equal(raw, got.sample.numpy())
