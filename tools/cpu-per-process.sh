#!/usr/bin/env bash
# CPU per turn of each process of a bench: runs `BIN bench ARGS...`, reads the
# CPU time (utime + stime, /proc/PID/stat) of its redis-server and paceline
# processes over a window in the steady state, and prints each one's share of a
# core and, given the scenario's turns/s over that window, its ms per turn.
#
# Usage:
#   tools/cpu-per-process.sh target/release/paceline --scenario throughput --throughput-runs 2000 --queue-turns 0
# Environment: SKIP_S (default 4) seconds before the window, WINDOW_S (default 4) its length.
# The window must end before the bench does (2000 runs of the throughput scenario
# last ~10 s here). ms per turn = cores / turns per second (the bench's own figure,
# first submit to last finish) * 1000: read the cores, then divide.
set -euo pipefail
bin=$1; shift
skip=${SKIP_S:-4}; window=${WINDOW_S:-4}
out=$(mktemp)
"$bin" bench "$@" > "$out" 2>&1 &
bench=$!
snap() {
  for p in $(pgrep -f "paceline|redis-server"); do
    [ -r "/proc/$p/stat" ] || continue
    # Fields 14 and 15 (utime, stime) after the command name, which may hold spaces.
    ticks=$(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')
    echo "$p $ticks $(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-70)"
  done
}
sleep "$skip"; first=$(snap); sleep "$window"; second=$(snap)
wait "$bench"
hz=$(getconf CLK_TCK)
join <(echo "$first" | sort) <(echo "$second" | sort) -o 1.1,1.2,2.2,2.3,2.4,2.5,2.6 2>/dev/null \
  | awk -v hz="$hz" -v w="$window" '{d = ($3 - $2) / hz / w; if (d > 0) {$1 = $2 = $3 = ""; printf "%5.2f cores %s\n", d, $0}}'
grep -E "turns/s" "$out" || true
rm -f "$out"
