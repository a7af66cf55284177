"""The fixed shell scripts an SSH node runs: start a background server, check it, stop it.

Values reach a script only as positional parameters (`sh -c SCRIPT sh ARG...`); the remote side
needs a POSIX `sh` and the coreutils (or busybox) `setsid`, `kill`, `cat`, `sed`, `cut`, `tr`.
"""

from __future__ import annotations

# Shell functions the scripts below share. `running`: whether pid $1 runs. A zombie counts as
# gone: an orphan waits for init to reap it, which in some containers takes seconds, and kill -0
# still succeeds on it meanwhile.
SHELL_FUNCTIONS = r"""
running() {
  if [ -d /proc/self ]; then
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
  else
    kill -0 "$1" 2>/dev/null
  fi
}

# Stops process group $1: SIGTERM, then SIGKILL when its leader still runs after $2 tenths of a
# second; the final SIGKILL also takes any member the leader left behind.
stop_group() {
  kill -TERM -"$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null || return 0
  i=0
  while running "$1" && [ "$i" -lt "$2" ]; do sleep 0.1; i=$((i + 1)); done
  kill -KILL -"$1" 2>/dev/null
  return 0
}
"""

# Runs argv as a background process that outlives the SSH channel: its own session (setsid, so
# no SIGHUP from sshd and a process group stop() can kill whole), stdio on /dev/null and the log
# (so sshd does not keep the channel open waiting for the pipes), and its pid written by itself
# just before exec (so the pid is right even where setsid has to fork). A process that an
# earlier run started under the same pid file and never stopped (pytest killed with -9) is
# stopped first, if it still runs the same program and the SSH connection that started it is
# gone: on a GPU node it would hold the memory the new one needs. Each one stopped is reported
# on a `stale <pid>` line. Without /proc nothing is ever taken for stale.
START_SCRIPT = (
    SHELL_FUNCTIONS
    + r"""
dir=$1 log=$2 pidfile=$3
shift 3
mkdir -p "$dir" || exit 1
# The SSH connection this start comes through: the nearest sshd process above this shell.
owner=$$
while [ "$owner" -gt 1 ]; do
  case "$(cat "/proc/$owner/comm" 2>/dev/null)" in sshd*) break ;; esac
  owner=$(sed 's/.*) //' "/proc/$owner/stat" 2>/dev/null | cut -d' ' -f2)
  case "$owner" in ''|*[!0-9]*) owner=1 ;; esac
done
old=$(cat "$pidfile" 2>/dev/null)
case "$old" in ''|*[!0-9]*) old= ;; esac
old_owner=$(cat "$pidfile.owner" 2>/dev/null)
case "$old_owner" in ''|*[!0-9]*) old_owner=1 ;; esac
# Stale: still running the same program, while the connection that started it is gone (a
# server of another run that is still connected is left alone).
if [ -n "$old" ] && running "$old" && ! running "$old_owner" \
    && [ "$(tr '\000' '\n' 2>/dev/null < "/proc/$old/cmdline" | head -n 1)" = "$1" ]; then
  stop_group "$old" 50
  echo "stale $old"
fi
rm -f "$pidfile"
echo "$owner" > "$pidfile.owner"
setsid sh -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" </dev/null >>"$log" 2>&1 &
i=0
while [ ! -s "$pidfile" ] && [ "$i" -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
cat "$pidfile"
"""
)

ALIVE_SCRIPT = SHELL_FUNCTIONS + 'running "$1"\n'

STOP_SCRIPT = SHELL_FUNCTIONS + 'stop_group "$1" "$2"\n'

FREE_PORT_PY = (
    "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
)
