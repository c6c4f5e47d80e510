#!/usr/bin/env bash
# Issue #19 "failed on today's code on the GPU": build the trees that run.sh runs (under scratch/before/,
# which git ignores; carry it to the GPU machine).  "Today's code" is ebcd2cb, the commit every #19 fix
# branch started from.  Each tree is that branch's tests-first commit (code still ebcd2cb's) with the
# item tests as they stood at the end of the branch, so later test refinements are included.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
here=.ci/proof/gpu-before
rm -rf scratch/before && mkdir -p scratch/before
tree() {  # name, commit, then test files as COMMIT:PATH taken from the end of the branch
  local name=$1 commit=$2; shift 2
  mkdir -p "scratch/before/$name"
  git archive "$commit" pyproject.toml README.md umem_numba tests kernels examples | tar -x -C "scratch/before/$name"
  for f in "$@"; do git show "$f" > "scratch/before/$name/${f#*:}"; done
}
tree pool 7e92722 48b4361:tests/test_fastpath_pool.py 48b4361:tests/test_emm.py 48b4361:tests/test_pool.py  # items 1 5 7 11
tree copy 1df973d c23172d:tests/test_fastpath_copy.py                      # items 2 4 6 10
tree launch 80d4ec2 b70b127:tests/test_fastpath_launch.py                  # items 3 9 14
tree exit 8f782f6 6a4cedd:tests/test_fastpath_exit.py 718b85a:tests/test_fdpass.py  # items 8 12 13
# small item: the PTX test skipped on any compile error.  Its check (eab4a55) runs a child pytest on
# its own file; the copy made here runs it on the old test file instead.
python3 - scratch/before/exit/tests <<'PY'
import sys
from pathlib import Path
src = Path("tests/kernels/test_stencil3d_vec.py").read_text()
start = src.index("def _nvvm_missing")
end = src.index("@pytest.mark.parametrize", src.index("def test_ptx_check_fails"))
body = src[start:end].replace("str(Path(__file__))", 'str(Path(__file__).with_name("test_stencil3d_vec.py"))')
head = "import os\nimport subprocess\nimport sys\nfrom pathlib import Path\n\nimport pytest\n\n\n"
Path(sys.argv[1], "test_stencil3d_check_before.py").write_text(head + body)
PY
tree base ebcd2cb                                                           # bench "before"
git show 3c0e4ad^:examples/heat2d.py > scratch/before/heat2d_old.py         # small item: the title
cp "$here/run.sh" "$here/bench2.sh" scratch/before/
