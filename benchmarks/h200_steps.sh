# Shell helpers the H200 scripts source: stages with their time since START, a deadline, and steps run
# under it. Before sourcing: RES (results folder), START (date +%s), DEADLINE_S (seconds).
#   stage NAME         a line in $RES/stages.txt
#   left               seconds to the deadline (at least 1)
#   step NAME CMD...   CMD under the deadline: stdout to NAME.json, stderr to NAME.err, and NAME.time with
#                      wall seconds, exit code and (with EVALRUN_CACHE set) the files in the cache after it.
#                      With KEEP_DONE=1 a step whose NAME.time says exit 0 is kept (a later call resumes).
stage() { echo "$(date +%T) +$(( $(date +%s) - START ))s $1" >> "$RES/stages.txt"; }
left() { local s=$(( START + DEADLINE_S - $(date +%s) )); [ "$s" -gt 1 ] && echo "$s" || echo 1; }
step() {
  local name=$1; shift
  if [ "${KEEP_DONE:-0}" = 1 ] && grep -qs '"exit": 0' "$RES/$name.time"; then stage "$name: kept from an earlier call"; return; fi
  stage "$name"
  local t0=$(date +%s%N)
  timeout "$(left)" "$@" > "$RES/$name.json" 2> "$RES/$name.err"
  local rc=$?
  local files=null
  [ -n "${EVALRUN_CACHE:-}" ] && files=$(find "$EVALRUN_CACHE" -type f 2>/dev/null | wc -l)
  echo "{\"wall_s\": $(( ($(date +%s%N) - t0) / 1000000 ))e-3, \"exit\": $rc, \"cache_files_after\": $files}" > "$RES/$name.time"
}
