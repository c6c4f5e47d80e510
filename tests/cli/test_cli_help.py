"""``python -m umem_numba``'s help as a user reads it (issue #30 item 6).

Every ``--help`` text is plain text: no reST markup from the docstrings it was built from, and no
private names (``umem_numba._bench._BENCHES``, ``run(argv)``).  A bad flag is answered with the
usage of the command it was given to, not the top level's.
"""

from __future__ import annotations

import re

import pytest

from umem_numba.__main__ import _BENCHES, main

COMMANDS = [[], ["info"], ["bench"], *(["bench", name] for name in ["all", *_BENCHES])]

#: reST that a terminal shows as it is: literals, roles, emphasis, escapes.
_MARKUP = re.compile(r"``|:(class|func|meth|mod|data|attr|sup|sub|ref|doc):|\*\*|\\ ")
#: Names a user cannot import or call: private modules and attributes, the benchmark protocol.
_PRIVATE = re.compile(r"umem_numba\._|\b_BENCHES\b|\brun\(argv\)|\bmain\(argv\)")


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "top level")
def test_help_is_plain_text_without_private_names(capsys, command):
    code, out, err = _run(capsys, [*command, "--help"])
    assert code == 0, err
    prog = " ".join(["python -m umem_numba", *command])
    assert out.startswith(f"usage: {prog}"), out[:200]
    markup = sorted({m.group(0) for m in _MARKUP.finditer(out)})
    assert not markup, f"`{prog} --help` shows reST markup {markup}:\n{out}"
    private = sorted({m.group(0) for m in _PRIVATE.finditer(out)})
    assert not private, f"`{prog} --help` names private things {private}:\n{out}"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "top level")
def test_a_bad_flag_gets_the_usage_of_its_own_command(capsys, command):
    code, _, err = _run(capsys, [*command, "--bogus"])
    assert code == 2
    prog = " ".join(["python -m umem_numba", *command])
    assert err.startswith(f"usage: {prog} "), err
    last = err.splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), err
    # the flag is named, unless a required argument is missing first (argparse reports that first)
    assert "--bogus" in last or "required" in last, err
    if command:  # the top level's usage is not printed for a subcommand's flag
        assert "usage: python -m umem_numba [-h]" not in err, err
