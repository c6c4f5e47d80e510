"""Benchmarks behind ``python -m umem_numba bench NAME``; each module has ``main(argv)``."""
