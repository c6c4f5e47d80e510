"""What the command line shows beside the benchmarks: the machine facts of ``um.info()`` (``_info``)."""
