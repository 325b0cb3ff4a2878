#!/usr/bin/env bash
# A real local Ray cluster (a head and a second node on loopback) runs a small sweep as Ray tasks, and the
# rows must equal the local process pool's (issue #42 part 4). Ray lives in a throwaway venv that sees the
# project's .venv (a .pth file), so `make test` never installs it. Then a dead address must be an error
# within the connect deadline, and a sweep on a cluster whose workers froze must end with the
# --ray-stall-s error, not hang. Writes one JSON object to $OUT (default docs/measurements/ray_check.json)
# and exits 1 when the rows differ or either failure is not handled.
#
#   scripts/ray_check.sh                  # needs .venv (make test) and PyPI (ray 2.60)
#   RAY_VENV=/tmp/rayvenv scripts/ray_check.sh   # reuse a venv that has ray
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-docs/measurements/ray_check.json}
RAY_VENV=${RAY_VENV:-$(mktemp -d)/venv}
TMP=$(mktemp -d)
if [ ! -x "$RAY_VENV/bin/ray" ]; then
  python3 -m venv "$RAY_VENV"
  "$RAY_VENV/bin/pip" install -q "ray>=2.60"
fi
SITE=$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$RAY_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' | {
  read -r dst; echo "import site; site.addsitedir('$SITE')" > "$dst/kvpool_dev.pth"; }
PY="$RAY_VENV/bin/python"
KVPOOL=("$PY" -c 'import sys; from kvpool.commands.main import main; sys.exit(main(sys.argv[1:]))')
RAY="$RAY_VENV/bin/ray"
export RAY_TMPDIR="$TMP/ray" RAY_USAGE_STATS_ENABLED=0
mkdir -p "$RAY_TMPDIR"
cleanup() { "$RAY" stop --force >/dev/null 2>&1 || true; }
trap cleanup EXIT
HEAD_PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$RAY" start --head --node-ip-address 127.0.0.1 --port "$HEAD_PORT" --num-cpus 1 --include-dashboard false \
  --temp-dir "$RAY_TMPDIR" --disable-usage-stats >"$TMP/head.log" 2>&1
"$RAY" start --address "127.0.0.1:$HEAD_PORT" --node-ip-address 127.0.0.1 --num-cpus 1 \
  >"$TMP/node.log" 2>&1
ARGS=(replay conversation --limit 1500 --policy lru,reference,bound --capacity-bytes 29GiB,89GiB,269GiB
      --json --no-progress)
t0=$(date +%s.%N)
"${KVPOOL[@]}" "${ARGS[@]}" --out-dir "$TMP/local" --jobs 2 >"$TMP/local.json"
t1=$(date +%s.%N)
"${KVPOOL[@]}" "${ARGS[@]}" --out-dir "$TMP/ray" --ray "127.0.0.1:$HEAD_PORT" >"$TMP/ray.json"
t2=$(date +%s.%N)
BAD_START=$(date +%s.%N)
set +e
"${KVPOOL[@]}" "${ARGS[@]}" --out-dir "$TMP/bad" --ray 127.0.0.1:9 >"$TMP/bad.out" 2>"$TMP/bad.err"
BAD_RC=$?
set -e
BAD_END=$(date +%s.%N)
# Frozen workers: every worker process of both nodes is stopped (SIGSTOP) as soon as it appears, the raylets
# left running, so Ray sees live nodes whose tasks never finish nor fail (what a hung filesystem or a
# debugger does). The sweep must end with the --ray-stall-s error, its tasks cancelled, well within the
# outer timeout (124 there is a hang and fails the check).
RAYLETS=$(pgrep -f 'raylet/raylet' | tr '\n' ' ')
workers() {  # the nodes' worker processes (titled ray::IDLE, ray::<task>), not their agents
  for r in $RAYLETS; do
    for p in $(pgrep -P "$r"); do
      case "$(ps -o args= -p "$p" 2>/dev/null)" in *Agent*|"") ;; *) echo "$p" ;; esac
    done
  done
}
( while true; do
    for w in $(workers); do kill -STOP "$w" 2>/dev/null || true; done
    sleep 0.1
  done ) &
FREEZER=$!
FROZEN_START=$(date +%s.%N)
set +e
timeout 300 "${KVPOOL[@]}" "${ARGS[@]}" --out-dir "$TMP/frozen" --ray "127.0.0.1:$HEAD_PORT" --ray-stall-s 10 \
  >"$TMP/frozen.json" 2>"$TMP/frozen.err"
FROZEN_RC=$?
set -e
FROZEN_END=$(date +%s.%N)
kill "$FREEZER" 2>/dev/null || true
FROZE=$(workers | wc -l)
for w in $(workers); do kill -CONT "$w" 2>/dev/null || true; done
"$PY" - "$TMP" "$OUT" "$t0" "$t1" "$t2" "$BAD_RC" "$BAD_START" "$BAD_END" "$($RAY --version)" \
  "$FROZEN_RC" "$FROZEN_START" "$FROZEN_END" "$FROZE" <<'PY'
import json, sys, time
tmp, out, t0, t1, t2, bad_rc, b0, b1, version, frozen_rc, f0, f1, froze = sys.argv[1:]
local = json.load(open(f"{tmp}/local.json"))["rows"]
ray = json.load(open(f"{tmp}/ray.json"))["rows"]
res = {
    "date": time.strftime("%Y-%m-%d"), "ray": version, "cluster": "head + 1 node on 127.0.0.1, 1 CPU each",
    "sweep": "conversation --limit 1500, lru,reference,bound x 29GiB,89GiB,269GiB (K3)",
    "points": len(local), "rows_equal": local == ray,
    "local_jobs2_wall_s": round(float(t1) - float(t0), 2), "ray_wall_s": round(float(t2) - float(t1), 2),
    "dead_address": {"rc": int(bad_rc), "wall_s": round(float(b1) - float(b0), 2),
                     "stderr": open(f"{tmp}/bad.err").read().strip().splitlines()[-1:]},
    # rc 2: the --ray-stall-s error; 124: the outer 300 s timeout, i.e. a hang
    "frozen_workers": {"rc": int(frozen_rc), "wall_s": round(float(f1) - float(f0), 2), "ray_stall_s": 10,
                    "workers_stopped": int(froze),
                    "stderr": open(f"{tmp}/frozen.err").read().strip().splitlines()[-1:]},
}
open(out, "w").write(json.dumps(res, indent=1) + "\n")
print(json.dumps(res))
frozen = res["frozen_workers"]
ok = res["rows_equal"] and res["dead_address"]["rc"] == 2
ok = ok and frozen["rc"] == 2 and frozen["workers_stopped"] > 0 and "still out" in "".join(frozen["stderr"])
sys.exit(0 if ok else 1)
PY
