"""The benchmark CLI runs end to end on a tiny model and prints its table (timings are not tested)."""

from __future__ import annotations

import json

from conftest import tiny_unet

from tome_compile.bench import main


def test_bench_cli_smoke(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_unet("sd15").save_pretrained(folder)
    out = tmp_path / "b.json"
    code = main(["--model", str(folder), "--sizes", "128", "--repeats", "1", "--variants", "eager", "tomesd",
                 "--no-blocks", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| eager |" in printed and "| tomesd |" in printed
    data = json.loads(out.read_text())
    assert [s["size"] for s in data["sizes"]] == [128]
    assert set(data["sizes"][0]["variants"]) == {"eager", "tomesd"}


def test_bench_bad_input(capsys):
    assert main(["--sizes", "100", "--variants", "eager"]) == 2
    assert "argument --sizes: 100 is not a multiple of 8" in capsys.readouterr().err
    assert main(["--ratio", "0.9", "--variants", "eager"]) == 2


def test_bench_refuses_tomesd_where_it_does_not_run(capsys, monkeypatch):
    # video U-Nets: tomesd divides by zero; PixArt: it merges nothing — neither is a baseline
    from conftest import tiny_pixart, tiny_video_unet

    from tome_compile import bench

    for model in (tiny_video_unet("animatediff"), tiny_pixart()):
        monkeypatch.setattr(bench, "load_unet", lambda *a, m=model, **k: (m, "tiny"))
        assert main(["--sizes", "128", "--repeats", "1", "--variants", "tomesd", "--no-blocks"]) == 2
        assert "tomesd does not run on a " + type(model).__name__ in capsys.readouterr().err


def test_memory_bench_measures_in_fresh_processes(tmp_path):
    """benchmarks.memory: a tome-export run in a subprocess with its stages clocked, and one ONNX Runtime
    call per file in a fresh process (a failing export reported, not hidden)."""
    from tome_compile.benchmarks.memory import measure_call, measure_export

    folder = tmp_path / "tiny"
    tiny_unet("sd15").save_pretrained(folder)
    out = tmp_path / "t.onnx"
    result = measure_export(
        [
            str(out),
            "--model",
            str(folder),
            "--height",
            "64",
            "--width",
            "64",
            "--seq-len",
            "7",
            "--no-cuda-check",
            "--static",  # what is tested is the bench, not the size axes (a fixed export is faster)
        ]
    )
    assert result["returncode"] == 0 and out.is_file()
    names = [s["stage"] for s in result["stages"]]
    assert names[1] == "loading the U-Net" and any(n.startswith("converting to ONNX") for n in names)
    assert names[-1].startswith("writing") and all(s["seconds"] >= 0 for s in result["stages"])
    assert result["peak_gb"] >= max(s["peak_gb"] for s in result["stages"]) > 0.1  # Python + torch at least
    row = measure_call(out, batch=2, rounds=2)
    assert len(row["peaks_gb"]) == 2 and row["median_s"] > 0 and row["resting_gb"] > 0.1
    priority = measure_call(out, batch=1, rounds=1, order="priority")  # ONNX Runtime's other execution order
    assert row["order"] == "default" and priority["order"] == "priority" and priority["median_s"] > 0
    lean = measure_call(out, batch=1, rounds=1, memory="lean")  # no buffer reuse
    assert row["memory"] == "reuse" and lean["memory"] == "lean" and lean["median_s"] > 0
    # negative: a refused export is an exit code, not a table of zeros
    bad = measure_export([str(tmp_path / "x.onnx"), "--model", str(folder), "--height", "60"])
    assert (
        bad["returncode"] == 2
        and "multiple of 8" in bad["stderr_tail"]
        and not (tmp_path / "x.onnx").exists()
    )
