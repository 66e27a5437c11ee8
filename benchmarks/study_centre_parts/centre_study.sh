#!/bin/bash
# centred decode: which part of centring costs (timing only; the variants' outputs are wrong)
for v in noprod noadd both; do rm -rf /tmp/t-$v; mkdir -p /tmp/t-$v; cp -r . /tmp/t-$v/ 2>/dev/null; (cd /tmp/t-$v && git apply .devbundle/$v.patch); done
D=benchmarks/results/2026-11-27-h100-split-merge  # ab_decode.py; patches from benchmarks/study_centre_parts/ copied to .devbundle/
for r in 1 2; do
  AUTO_ONLY=1 python $D/ab_decode.py $OUT/base-$r.json 8x32768 384x2304 2>&1 | grep -v -i warn
  for v in noprod noadd both; do echo "== $v"; TQ_TREE=/tmp/t-$v AUTO_ONLY=1 python $D/ab_decode.py $OUT/$v-$r.json 8x32768 384x2304 2>&1 | grep -v -i warn | grep centred; done
done
