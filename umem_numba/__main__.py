"""Command line: ``python -m umem_numba info | bench {all,launch,prefetch,vmm,stencil,...}``.

``bench NAME`` runs one benchmark; ``bench all --out DIR`` runs every one in
``umem_numba._bench._BENCHES`` and writes one report (JSON, PNG charts, Markdown) into DIR.
The ``--help`` texts are written for users (plain text, public names only; tests/cli/test_cli_help.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ._bench import _BENCHES


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m umem_numba`` and the ``umem-numba`` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "bench" and (argv[1] in _BENCHES or argv[1] == "all"):
        # everything after the name, --help included, belongs to the benchmark
        name = "_report" if argv[1] == "all" else argv[1]
        module = importlib.import_module(f"umem_numba._bench.{name}")
        return int(module.main(argv[2:]) or 0)
    parser = argparse.ArgumentParser(
        prog="python -m umem_numba",
        description=(
            "umem_numba's command line: what matters about this machine for unified memory (info), "
            "and the benchmarks (bench)."
        ),
        epilog="python -m umem_numba COMMAND --help: the command's own options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_info = sub.add_parser(
        "info",
        help="describe the GPU(s), driver and library versions",
        description="The machine's facts for unified memory: each GPU, the driver, the library versions.",
    )
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_bench = sub.add_parser(
        "bench",
        help="run a benchmark, or all of them into one report",
        description="Run one benchmark (python -m umem_numba bench NAME --help: its options),\n"
        "or every one into one report (python -m umem_numba bench all --out DIR).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks:\n"
        + "\n".join(f"  {k:<9} {v}" for k, v in {"all": "every benchmark, one report (--out DIR)", **_BENCHES}.items()),
    )
    p_bench.add_argument("name", choices=["all", *sorted(_BENCHES)], metavar="NAME", help="the benchmark (below)")
    args, rest = parser.parse_known_args(argv)

    if args.command == "info":
        if rest:
            p_info.error(f"unrecognized arguments: {' '.join(rest)}")  # info's usage, not the top level's
        from ._cli._info import format_info, info

        data = info()
        print(json.dumps(data, indent=2) if args.json else format_info(data))
        return 0
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
