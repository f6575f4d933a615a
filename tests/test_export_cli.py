"""tome-export on the command line: success, --into an Optimum folder, bad input, atomic writes,
disk full, stale temp folders, signals."""


from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from export_helpers import (
    FIXED,
    HW,
    _base,
    _optimum_folder,
    one_error_line,
    ort_session,
    standard_feed,
)
from tome_compile.export import cli, export_onnx
from tome_compile.export.cli import main

from tome_compile import ToMeConfig, ToMeExportError


def test_cli_success_into_an_optimum_folder(tmp_path, sd15_folder, capsys):
    # the README's flow in one export: --into an Optimum folder, a ratio, the CPU optimizer (the plain
    # OUT.onnx path's files are checked by test_todo.py's tome-export test)
    folder = _optimum_folder(tmp_path)
    code = main(["--into", str(folder)] + _base(sd15_folder) + ["--ratio", "0.4", "--optimize", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "rewrote 3 of 8 attention sites" in printed and "256 -> 154 tokens" in printed
    assert "parity (CPUExecutionProvider): max abs" in printed  # checked again after the optimizer
    assert "attention: 8 com.microsoft.MultiHeadAttention nodes" in printed
    assert "SkipLayerNormalization 8" in printed and "NhwcConv" not in printed  # CPU: no CUDA-only fusions
    unet_dir = folder / "unet"
    assert sorted(p.name for p in unet_dir.iterdir()) == ["config.json", "model.onnx", "model.onnx.data"]
    assert "removed" in printed and "model.onnx_data" in printed  # the old weights, no longer used
    model = onnx.load(str(unet_dir / "model.onnx"), load_external_data=False)
    assert "tome_compile" in {p.key for p in model.metadata_props}  # ToMeSession still reads it
    # what Optimum's ORT U-Net does: read the timestep type from the session, send [t] of it
    session = ort_session(unet_dir / "model.onnx")
    timestep_type = next(i.type for i in session.get_inputs() if i.name == "timestep")
    assert timestep_type == "tensor(float)" and [i.name for i in session.get_outputs()] == ["out_sample"]
    required = [i.name for i in session.get_inputs() if i.name != "tome_seed"]
    assert required == ["sample", "timestep", "encoder_hidden_states"]
    feed = standard_feed(3)
    out = session.run(None, {"sample": feed["sample"], "timestep": np.array([981], dtype=np.float32),
                             "encoder_hidden_states": feed["encoder_hidden_states"]})[0]
    assert out.shape == feed["sample"].shape and np.isfinite(out).all()


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
    code = main([str(tmp_path / "bad.onnx")] + _base(sd15_folder) + argv)
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
    code = main([str(tmp_path / "fail.onnx"), "--atol", "0"] + _base(sd15_folder) + FIXED)
    assert code == 2 and "parity check failed" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


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
    assert main([str(tmp_path / "x.onnx")] + _base(sd15_folder) + FIXED) == 2
    err = capsys.readouterr().err
    assert f"no space left in {str(tmp_path)!r}" in err and one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_stale_partial_folders_are_swept(tmp_path, sd15_folder, capsys, monkeypatch):
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
    # the sweep happens when the export makes its own folder; the conversion is not what is tested
    # (test_cli_success_into_an_optimum_folder and test_export.py write whole files): it fails here
    from tome_compile.export import onnx_export

    def convert_fails(run):
        assert run.tmp is not None and run.tmp.parent == tmp_path
        raise ToMeExportError("no conversion in this test")

    monkeypatch.setitem(onnx_export._STAGE_FUNCTIONS, "convert", convert_fails)
    assert main([str(tmp_path / "x.onnx"), "--no-rand"] + _base(sd15_folder) + FIXED) == 2
    assert "no conversion in this test" in capsys.readouterr().err
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([live.name, other.name])  # the dead one swept, ours removed on failure


def test_sigterm_cleans_up(tmp_path, sd15_folder):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "x.onnx"
    argv = [sys.executable, "-m", "tome_compile.export.cli", str(out)] + _base(sd15_folder) + FIXED
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
