#!/usr/bin/env bash
# make test, once `make setup` is done: what takes minutes and the suite needs only in part runs
# in the background from the start, beside the rest of the set-up and the suite:
#   - llama-server's source build (`make engine-build`: about 5 minutes of two cores on a fresh
#     machine, nothing once cached), which the tests that run the built binary wait for;
#   - vLLM's install (`make vllm`: about 2 minutes, mostly download), which the vLLM tests wait for;
#   - the wheel check (`make wheel-check`), which no test needs.
# The tests marked `serial` (they time the machine) wait for all three: each takes CPUs of its own.
# The waiting is the fixtures' (`llama_server`, `vllm_install`: tests/support/schedule.py reads the
# status files named by GPUBENCH_TEST_BUILD_STATUS and GPUBENCH_TEST_VLLM_STATUS), and the modules
# that need the build run after the others. sshd, Slurm and the docs site are set up first (seconds
# once their packages are in). A step that failed fails `make test` as before.
# Usage: MAKE=make bash scripts/test-suite.sh VENV_BIN PYTEST_ARGUMENT...
set -euo pipefail
bin=$1
shift
make_=${MAKE:-make}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpubench-test.XXXXXX")
started=$SECONDS
pids=()
names=()

# make TARGET in a session of its own (setsid: its process group is its pid, so that an early end
# stops it whole and nothing else); NAME.status holds its exit status once it has ended.
beside() {
  local name=$1
  setsid bash -c '"$1" --no-print-directory "$2" >"$3.log" 2>&1; echo $? >"$3.tmp"; mv "$3.tmp" "$3.status"' \
    beside "$make_" "$name" "$work/$name" </dev/null &
  pids+=("$!")
  names+=("$name")
  echo "test: make $name started in the background (log: $work/$name.log)"
}
stop() {
  local i
  for i in "${!pids[@]}"; do
    if [ ! -e "$work/${names[$i]}.status" ]; then
      kill -TERM -- "-${pids[$i]}" 2>/dev/null || true
    fi
  done
  rm -rf "$work"
}
trap stop EXIT

beside engine-build
beside vllm
beside wheel-check
"$make_" --no-print-directory sshd slurm docs
echo "test: sshd, Slurm and the docs site set up at $((SECONDS - started)) s; the suite starts"

set +e
GPUBENCH_TEST_BUILD_STATUS="$work/engine-build.status" GPUBENCH_TEST_VLLM_STATUS="$work/vllm.status" \
  GPUBENCH_TEST_WHEEL_STATUS="$work/wheel-check.status" "$bin/pytest" tests/ "$@"
suite=$?
set -e
echo "test: the suite ended at $((SECONDS - started)) s (exit $suite)"
if [ "$suite" -ne 0 ]; then
  exit "$suite"  # what still runs beside it is stopped (trap)
fi

failed=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || true
  name=${names[$i]}
  code=$(cat "$work/$name.status" 2>/dev/null || echo "?")
  if [ "$name" = wheel-check ] || [ "$code" != 0 ]; then
    echo "test: make $name (exit $code, ended by $((SECONDS - started)) s):"
    if [ "$code" = 0 ]; then cat "$work/$name.log"; else tail -40 "$work/$name.log"; fi
  fi
  [ "$code" = 0 ] || failed=1
done
exit "$failed"
