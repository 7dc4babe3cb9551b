"""The benchmarks: each script is a module, run from the repository root as ``python -m benchmarks.<script>``
(benchmarks/README.md); ``benchmarks.common`` holds what they share."""
