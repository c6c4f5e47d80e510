#!/usr/bin/env bash
# usage: .ci/proof/run_revert.sh <checkout of c16682b> <patch name|none> "<seeds>" <node ids...>
# Applies .ci/proof/<patch>.patch in the checkout, runs the node ids over the simulated driver for
# each seed (the checkout's own .venv), prints each summary line, and restores the checkout.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
wt=$1; patch=$2; seeds=$3; shift 3
cd "$wt" || exit 2
if [ "$patch" != none ]; then git apply "$here/$patch.patch" || exit 3; fi
for seed in $seeds; do
  out="$(UMEM_SIM_SEED=$seed NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -rfE -p no:cacheprovider "$@" 2>&1)"
  echo "$patch seed=$seed rc=$? $(echo "$out" | tail -1)"
done
if [ "$patch" != none ]; then git apply -R "$here/$patch.patch"; fi
