#!/usr/bin/env bash
# Before/after pairs again, interleaved twice; every figure into one file (figures.jsonl).
OUT=$(realpath -m "${OUT:-out}"); mkdir -p "$OUT"; work=/tmp/b2; mkdir -p $work
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/oldsite scratch/before/base >/dev/null || exit 1
for round in 1 2; do for name in launch pool; do for tag in old new; do
  if [ $tag = old ]; then pp=/tmp/oldsite:/tmp/site; flag=-P; else pp=/tmp/site; flag=; fi
  (cd /tmp && PYTHONPATH=$pp timeout -s INT 90 python3 $flag -m umem_numba bench $name --json $work/$tag-$name-$round.json > $work/$tag-$name-$round.log 2>&1)
  python3 -c "
import json,sys
d=json.load(open('$work/$tag-$name-$round.json'))
for f in d['figures']: print(json.dumps(dict(tag='$tag',bench='$name',round=$round,name=f['name'],value=f['value'],unit=f['unit'])))
" >> $OUT/figures.jsonl
done; done; done
tar -czf $OUT/logs.tgz -C $work .
python3 - "$OUT/figures.jsonl" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
t = collections.defaultdict(dict)
for r in rows: t[(r['bench'], r['name'])][(r['tag'], r['round'])] = r['value']
for (b, n), v in t.items():
    print(f"{b:6} {n[:70]:70} old {v.get(('old',1),float('nan')):8.3f} {v.get(('old',2),float('nan')):8.3f}  new {v.get(('new',1),float('nan')):8.3f} {v.get(('new',2),float('nan')):8.3f}")
PY
