#!/usr/bin/env bash
# leftovers.sh TOKEN [--kill]: the processes still running that a CI step
# started. .ci/run runs each step with KVSWAP_CI_STEP=TOKEN in its
# environment, which every process the step starts inherits (a forkserver,
# an engine's workers, a daemon that left its session), so after the step
# has ended any process whose environment holds it is a leftover. Those
# that end by themselves within KVSWAP_LEFTOVER_GRACE_S seconds (default 30:
# a forkserver sees its parent's exit a moment later) are not. Prints
# "PID ARGS" for each leftover; with --kill, also ends them (SIGKILL).
# Exits 1 when it found any, 0 when none.
set -uo pipefail
token="${1:?usage: leftovers.sh TOKEN [--kill]}"
holding() {  # one grep over every process's environment (NUL-separated entries)
  grep -lzxF "KVSWAP_CI_STEP=$token" /proc/[0-9]*/environ 2>/dev/null | sed 's#^/proc/\([0-9]*\)/environ$#\1#'
}
deadline=$((SECONDS + ${KVSWAP_LEFTOVER_GRACE_S:-30}))
while found=($(holding)); [ "${#found[@]}" -gt 0 ] && [ "$SECONDS" -lt "$deadline" ]; do
  sleep 0.5
done
[ "${#found[@]}" = 0 ] && exit 0
for pid in "${found[@]}"; do
  echo "$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-200)"
done
if [ "${2:-}" = --kill ]; then
  kill -KILL "${found[@]}" 2>/dev/null
fi
exit 1
