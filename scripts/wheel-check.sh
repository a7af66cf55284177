#!/usr/bin/env bash
# make wheel-check: the package as a user gets it. Build the sdist and the wheel, check their
# metadata (twine), install the wheel into a fresh venv (its dependencies from the package index
# or pip's cache, never from this checkout), then do what the README's quick start does in an
# empty directory: `gpubench init`, commit, `pytest benchmarks/ -m warm` (the llama-server
# binary and the tiny model are found in ~/.cache/pytest-gpubench, as `make engine` left them).
# Also shows that the HTML report's plotting library is an extra: without it, one line.
# Usage: bash scripts/wheel-check.sh PYTHON   (a Python with build and twine: the test extra)
set -euo pipefail
python=${1:-python3}
# uv (GPUBENCH_UV, else the uv on PATH) installs into the fresh venv where it can be had, as a user
# who installs with uv does: about 3 times less CPU than pip, which compiles every installed module
# to bytecode (pip: 56 CPU-seconds of this script's 2-core run with an empty cache, 2026-11-29).
# Without uv, pip installs as before.
uv=${GPUBENCH_UV:-$(command -v uv || true)}
[ -n "$uv" ] && [ -x "$uv" ] && uv=$(realpath "$uv") || uv=  # the script changes directory
install() {  # install PYTHON REQUIREMENT
  if [ -n "$uv" ]; then
    "$uv" pip install --quiet --python "$1" "$2"
  else
    "$1" -m pip install --quiet "$2"
  fi
}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpubench-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$python" -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || {
  tail -30 "$work/build.log"; exit 1; }
"$python" -m twine check --strict "$work"/dist/*
wheel=$(ls "$work"/dist/*.whl)
# The listing read whole first: `unzip -l | grep -q` under pipefail fails when grep quits early
# and unzip gets SIGPIPE (it did once the wheel grew).
listing=$(unzip -l "$wheel")
grep -q 'pytest_gpubench/cli/templates/cells.yaml' <<<"$listing" || {
  echo "wheel-check: $wheel has no templates (package-data)"; exit 1; }
grep -q 'pytest_gpubench/config/samples/' <<<"$listing" || {
  echo "wheel-check: $wheel has no sample dataset (package-data)"; exit 1; }

python3 -m venv "$work/venv"
install "$work/venv/bin/python" "$wheel"
echo "wheel-check: installed $(basename "$wheel") with ${uv:-pip}: $(du -sh "$work/venv" | cut -f1) without [html]"

project="$work/project"
mkdir "$project"
cd "$project"
git init -q
"$work/venv/bin/gpubench" init
git add -A
git -c user.name=wheel-check -c user.email=wheel-check@localhost commit -qm benchmarks
# --gpubench-force-load: CI machines and this one are shared; the load guard would refuse.
"$work/venv/bin/pytest" benchmarks/ -m warm -p no:cacheprovider --gpubench-force-load -q
ledger=$(ls runs/*.jsonl)

# The HTML report without its extra: one line and exit status 2, no traceback.
set +e
"$work/venv/bin/gpubench" report --html "$ledger" -o report.html 2>"$work/html.err"
status=$?
set -e
if [ "$status" -ne 2 ] || [ "$(wc -l <"$work/html.err")" -ne 1 ]; then
  echo "wheel-check: gpubench report --html without matplotlib: exit $status"; cat "$work/html.err"
  exit 1
fi
echo "wheel-check: without [html]: $(cat "$work/html.err") (exit $status)"
install "$work/venv/bin/python" "$wheel[html]"
"$work/venv/bin/gpubench" report --html "$ledger" -o report.html >/dev/null
echo "wheel-check: installed with [html]: $(du -sh "$work/venv" | cut -f1); report.html written"
