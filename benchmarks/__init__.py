"""kdpemb benchmarks: `python -m benchmarks NAME [--json] [--quick]`.

Each benchmark measures its baseline in the same run and reports ratios,
because absolute times on shared machines are noisy.
"""
