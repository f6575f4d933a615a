"""Benchmarks and checks that measure the library (they are not part of it): ONNX Runtime speed
(``python -m tome_compile.benchmarks.ort``), export and per-call memory (``...benchmarks.memory``)
and the CUDA check (``...benchmarks.gpu_check``). The inductor benchmark is ``tome-bench``."""
