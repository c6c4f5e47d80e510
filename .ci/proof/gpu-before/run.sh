#!/usr/bin/env bash
# Issue #19 tests-first commits on the GPU: each tree is today's code (ebcd2cb) with the item tests
# as they stood at the end of their fix branch.  Run from the repo root after .ci/gpu's prologue.
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"
root=$PWD
python3 -m pip uninstall -y -q umem-numba umem_numba >/dev/null 2>&1
run() {  # name, seconds, per-test (1: one process per test, the old code can segfault), test files...
  local name=$1 secs=$2 each=$3; shift 3
  local tree=$root/scratch/before/$name site=/tmp/before-$name
  echo "=== before/$name ($(date +%T))"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$tree" >/dev/null || return
  local files=(); for f in "$@"; do files+=("$tree/$f"); done
  local py=(env PYTHONPATH=$site:/tmp/site timeout -s INT "$secs" python3 -P -m pytest -q -rfEs -p no:cacheprovider
            --rootdir "$tree" --timeout 90 --tb=line)
  cd /tmp
  if [ "$each" = 1 ]; then
    PYTHONPATH=$site:/tmp/site python3 -P -m pytest -q -p no:cacheprovider --rootdir "$tree" --co "${files[@]}" 2>/dev/null \
      | grep "::" > "$OUT/before-$name.ids"
    while read -r id; do
      "${py[@]}" "$tree/$id" > "$OUT/one.log" 2>&1; rc=$?
      echo "$id rc=$rc $(grep -cE 'Segmentation fault' "$OUT/one.log") segv; $(tail -1 "$OUT/one.log")" | tee -a "$OUT/before-$name.log"
      grep -E "^E |AssertionError|Error:" "$OUT/one.log" | head -3 | cut -c1-300 >> "$OUT/before-$name.log"
    done < "$OUT/before-$name.ids"
  else
    "${py[@]}" --junitxml="$OUT/before-$name.xml" "${files[@]}" 2>&1 | tee "$OUT/before-$name.log" \
      | grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" | cut -c1-230
  fi
  cd "$root"
}
run pool 300 1 tests/test_fastpath_pool.py
run copy 120 0 tests/test_fastpath_copy.py
run launch 90 0 tests/test_fastpath_launch.py
run exit 150 0 tests/test_fastpath_exit.py tests/test_fdpass.py tests/test_stencil3d_check_before.py
# small item: this checkout's title test against the old example (the package reinstalled first)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
cp examples/heat2d.py /tmp/heat2d_now.py && cp scratch/before/heat2d_old.py examples/heat2d.py
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/examples/test_examples.py -k whole_title 2>&1 | tee "$OUT/before-title.log" | tail -3
cp /tmp/heat2d_now.py examples/heat2d.py
