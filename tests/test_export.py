"""tome-export: ORT parity, tomesd parity, op inventory, CLI and its bad inputs, atomic writes."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from conftest import call, tiny_inputs, tiny_unet, tomesd_reference
from tome_compile.export import ToMeSession, check_op_inventory, export_onnx
from tome_compile.export.cli import main

from tome_compile import ToMeConfig, ToMeExportError, tome_backend

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
    out = tmp_path_factory.mktemp("onnx") / "unet.onnx"
    result = export_onnx(copy.deepcopy(unet), out, ToMeConfig(ratio=0.5, seed=0), height=HW, width=HW, seq_len=7,
                         atol=1e-4)
    return result


def test_export_writes_checked_model_with_partition_input(exported):
    assert exported.path.is_file() and exported.path.with_name("unet.onnx.data").is_file()
    assert exported.input_names == ["sample", "timestep", "encoder_hidden_states", "tome_partition"]
    assert [s.path for s in exported.report.rewritten] == [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.1.transformer_blocks.0.attn1"]
    assert exported.parity_max_abs is not None and exported.parity_max_abs <= 1e-4
    model = onnx.load(str(exported.path), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert not any(op.startswith("Random") for op in ops)  # the partition is an input, not a Random* op
    assert "GroupNormalization" not in ops  # opset 20: InstanceNormalization, which CUDA EP has
    assert [o.name for o in model.graph.output] == ["out_sample"]
    assert check_op_inventory(exported.path).ok


def test_session_equals_compiled_backend(exported, unet):
    # Same seed => same partition sequence => the ONNX and torch.compile paths agree call by call.
    session = ToMeSession(exported.path, seed=3)
    assert session.provider == "CPUExecutionProvider"
    backend = tome_backend(0.5, compiler="eager", seed=3)
    compiled = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    inputs = tiny_inputs(unet)
    for _ in range(2):
        got = session(inputs.sample, inputs.timestep, encoder_hidden_states=inputs.encoder_hidden_states).sample
        assert (got - call(compiled, inputs)).abs().max() < 1e-4
    tuple_out = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states, return_dict=False)
    assert isinstance(tuple_out, tuple) and tuple_out[0].shape == inputs.sample.shape


def test_session_rejects_wrong_shapes(exported):
    session = ToMeSession(exported.path, seed=0)
    with pytest.raises(ToMeExportError, match="fixed per export"):
        session(torch.zeros(1, 4, 16, 16), torch.tensor(1), torch.zeros(1, 7, 32))


def test_no_rand_export_equals_tomesd(tmp_path, unet):
    result = export_onnx(copy.deepcopy(unet), tmp_path / "m.onnx", ToMeConfig(ratio=0.5, use_rand=False),
                         height=HW, width=HW, seq_len=7, atol=1e-4)
    assert result.input_names == ["sample", "timestep", "encoder_hidden_states"]  # exactly the standard ones
    inputs = tiny_inputs(unet)
    got = ToMeSession(result.path)(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    assert (got - call(ref, inputs)).abs().max() < 1e-4


def test_sdxl_export(tmp_path):
    unet = tiny_unet("sdxl")
    result = export_onnx(unet, tmp_path / "xl.onnx", ToMeConfig(ratio=0.5, max_downsample=2, use_rand=False),
                         height=HW, width=HW, seq_len=7, atol=1e-4)
    assert result.input_names == ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
    assert len(result.report.rewritten) == 6


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
    code = main([str(out), "--model", str(sd15_folder), "--height", str(HW), "--width", str(HW), "--seq-len", "7",
                 "--ratio", "0.4", "--no-rand"])
    printed = capsys.readouterr().out
    assert code == 0
    assert out.is_file() and (tmp_path / "cli.onnx.data").is_file()
    assert "rewrote 3 of 8 attention sites" in printed and "256 -> 154 tokens" in printed
    assert "parity (CPUExecutionProvider): max abs" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.onnx", "cli.onnx.data"]


@pytest.mark.parametrize("argv, words", [
    (["--model", "/nonexistent/unet"], "no such folder"),
    (["--ratio", "0.9"], "ratio=0.9"),
    (["--height", "100"], "--height 100 must be a positive multiple of 8"),
    (["--max-downsample", "3"], "max_downsample=3"),
    (["--batch", "0"], "--batch 0"),
])
def test_cli_bad_input(tmp_path, sd15_folder, capsys, argv, words):
    args = [str(tmp_path / "bad.onnx"), "--model", str(sd15_folder), "--height", str(HW), "--width", str(HW), "--seq-len", "7"]
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
                         atol=1e-4)
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
    assert proc.returncode == 143 and "SIGTERM" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
