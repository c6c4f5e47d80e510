"""Other libraries' memory through umem_numba: numba's External Memory Management plugin (``_emm``)."""
