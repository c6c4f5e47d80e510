"""What the command line and the benchmarks show: machine facts (``_info``), pictures and progress bars (``_plot``)."""
