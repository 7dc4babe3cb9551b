"""The sections of the GPU battery (``python -m benchmarks.gpu_check``, ``make gpu-check``), one module each."""
