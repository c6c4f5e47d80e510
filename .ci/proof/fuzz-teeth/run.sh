#!/usr/bin/env bash
# Score the API fuzzer (tests/fuzz) against planted bugs, one at a time (issue #27 item 6).
#   .ci/proof/fuzz-teeth/run.sh [ENTRY...]   ENTRY: a mutation name (mutations.py list), revert:COMMIT or none
# With no ENTRY: the baseline (none: it must survive), every mutation, then every fix commit of fixes.txt
# (its library change reverted).
# Each entry runs in its own copy of the working tree: the fuzzer on CI's seeds, every family, under
# the simulated driver, unshrunk (UMEM_FUZZ_SHRINK=0), stopping at the first failure; a failing run
# kills the entry. PARALLEL entries at once (default 1), each with JOBS pytest workers (default 2).
# The reverts are read from git when this runs in a checkout, else from $PATCHES/<commit>.patch
# (made by `run.sh --patches DIR` in a checkout). Logs in $LOGS; one line per entry on stdout.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
py="${PYTHON:-python3}"
logs="${LOGS:-/tmp/fuzz-teeth-logs}"
patches="${PATCHES:-$logs/patches}"
mkdir -p "$logs" "$patches"
fixes() { grep -v '^#' "$here/fixes.txt" | awk 'NF {print $1}'; }
if [ "${1:-}" = "--patches" ]; then
    mkdir -p "$2"
    for c in $(fixes); do git -C "$root" show "$c" -- umem_numba > "$2/$c.patch"; done
    exit 0
fi

one() {  # ENTRY -> one result line
    local entry=$1 name=${1//[:\/]/_} tree rc start secs first
    tree="$(mktemp -d)"
    cp -r "$root/umem_numba" "$root/tests" "$root/kernels" "$root/pyproject.toml" "$tree/"
    if [ "$entry" = none ]; then
        :  # the baseline: the tree as it is (must survive)
    elif [[ $entry == revert:* ]]; then
        local c=${entry#revert:}
        [ -s "$patches/$c.patch" ] || git -C "$root" show "$c" -- umem_numba > "$patches/$c.patch"
        (cd "$tree" && git apply -R "$patches/$c.patch") || { echo -e "$entry\tdoes not apply"; rm -rf "$tree"; return; }
    else
        "$py" "$here/mutations.py" apply "$entry" "$tree" || { rm -rf "$tree"; return; }
    fi
    start=$(date +%s)
    (cd "$tree" && PYTHONPATH="$tree" UMEM_FUZZ_SHRINK=0 NUMBA_ENABLE_CUDASIM=1 timeout "${BOX:-600}" \
        "$py" -m pytest -x -q -p no:cacheprovider -p no:randomly -n "${JOBS:-2}" -m fuzz tests/fuzz) > "$logs/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    first=$(grep -m1 -oE "test_fuzz\[[a-z]+\]" <(grep -E "^FAILED" "$logs/$name.log") || true)
    if [ $rc -eq 0 ]; then
        echo -e "$entry\tsurvived\t${secs}s"
    else
        echo -e "$entry\tkilled\t${secs}s\t${first:-exit $rc}"
    fi
    rm -rf "$tree"
}
export -f one
export here root py logs patches
entries=("$@")
if [ ${#entries[@]} -eq 0 ]; then
    entries=(none)
    mapfile -t -O 1 entries < <("$py" "$here/mutations.py" list | cut -f1)
    for c in $(fixes); do entries+=("revert:$c"); done
fi
printf '%s\n' "${entries[@]}" | xargs -P "${PARALLEL:-1}" -I{} bash -c 'one "$@"' _ {} | tee "$logs/results.tsv"
echo "killed $(grep -c $'\tkilled' "$logs/results.tsv") of $(wc -l < "$logs/results.tsv")"
