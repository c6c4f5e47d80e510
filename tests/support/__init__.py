"""Helpers the tests share (kernels, random data, seeds) and the scripts tests run in other processes."""
