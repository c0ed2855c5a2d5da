#!/usr/bin/env bash
# exit 0 when tools/bench_hc_boundary.py's log ($1) shows no MISMATCH and poll faster than lastcta
log=${1:?log}
[ -f "$log" ] || exit 1
grep -q "MISMATCH" "$log" && exit 1
python3 - "$log" <<'PY'
import re, sys
txt = open(sys.argv[1]).read()
def tot(name):
    v = [float(m.group(1)) for m in re.finditer(rf"hc_boundary {name}\s+([0-9.]+) us / boundary", txt)]
    return sum(v) if v else None
a, b = tot("lastcta"), tot("poll")
print(f"hc_pick: lastcta {a} us, poll {b} us")
sys.exit(0 if a and b and b < 0.98 * a else 1)
PY
