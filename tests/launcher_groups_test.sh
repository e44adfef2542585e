#!/bin/sh
# strata run owns its ranks' process trees (Note [Ranks are process groups] in
# tools/run.cpp): rank 0 is a wrapper shell whose child holds the rank's
# output; when rank 1 fails, the launcher must stop both processes of rank 0
# and return within --grace, not wait for the child (60 s) to close its output.
#   launcher_groups_test.sh STRATA WORKDIR
set -u
strata=$1
work=$2
rm -rf "$work" && mkdir -p "$work"
"$strata" run -n 2 --grace 1 -- sh -c '
  if [ "$RANK" = 1 ]; then sleep 1; exit 3; fi
  sleep 60 &
  echo $! > "'"$work"'/helper.pid"
  wait' > "$work/out.txt" 2>&1
status=$?
cat "$work/out.txt"
[ "$status" -eq 3 ] || { echo "launcher exit status $status, expected 3 (rank 1's)"; exit 1; }
grep -q "strata run: rank 1 exited with status 3; stopping the other ranks" "$work/out.txt" || exit 1
# Alive: the process exists and is not a zombie (a killed orphan stays one
# where PID 1 does not reap).
alive() {
  state=$(sed -n 's/^[0-9]* (.*) \([A-Z]\) .*/\1/p' "/proc/$1/stat" 2> /dev/null)
  [ -n "$state" ] && [ "$state" != Z ]
}
helper=$(cat "$work/helper.pid")
sleep 0.2
if alive "$helper"; then
  echo "rank 0's helper (pid $helper) is still running"
  kill "$helper"
  exit 1
fi
# Starting ranks that cannot all be started (a low limit on open files):
# the error names the cause, and no rank is left behind.
(ulimit -n 24; "$strata" run -n 50 -- sh -c 'echo $$ >> "'"$work"'/started.pids"; sleep 60') > "$work/spawn.txt" 2>&1
status=$?
cat "$work/spawn.txt"
[ "$status" -ne 0 ] || { echo "strata run started 50 ranks with 24 file descriptors"; exit 1; }
grep -q "raise ulimit -n or start fewer ranks" "$work/spawn.txt" || exit 1
sleep 0.2
for pid in $(cat "$work/started.pids" 2> /dev/null); do
  if alive "$pid"; then echo "rank process $pid was left running"; kill "$pid"; exit 1; fi
done
echo "launcher: process groups stopped, nothing left behind"
