"""CPU and memory samples from /proc: the engine's CPU time (/proc/<pid>/stat) and RSS
(/proc/<pid>/status), summed over the engine process and its descendants (vLLM's engine core and
Ollama's runners do the work in child processes), the node's memory (/proc/meminfo) and load
(/proc/loadavg). Read directly on this machine; over SSH, one shell loop per node streams one line
per interval."""

from __future__ import annotations

import os
from pathlib import Path

from pytest_gpubench.core.processes import process_tree
from pytest_gpubench.targets import Target, on_this_machine
from pytest_gpubench.telemetry.samplers import (
    LineStream,
    PollingSampler,
    ProcSample,
    Sample,
    Sampler,
    StreamingTarget,
    StreamSampler,
)

KIB_PER_MIB = 1024.0
# The fields of /proc/<pid>/stat after the command name's closing parenthesis start at field 3
# (state); utime and stime are fields 14 and 15 (proc(5)), in clock ticks.
UTIME_AFTER_COMM = 14 - 3
STIME_AFTER_COMM = 15 - 3

# Streams `clk_tck N` once, then per interval one tab-separated line: the engine's stat line
# (empty without one), the VmRSS of its process tree in kB, MemTotal and MemAvailable in kB, the
# 1-minute load, and the utime + stime ticks of the process tree (the kernel's `children` files
# list each thread's children). $1: the engine pid (empty for none), $2: the interval in seconds.
# A write to a closed channel ends the loop.
REMOTE_LOOP = r"""
pid=$1 interval=$2
tree() {
  echo "$1"
  for f in /proc/$1/task/*/children; do
    for c in $(cat "$f" 2>/dev/null); do tree "$c"; done
  done
}
echo "clk_tck $(getconf CLK_TCK 2>/dev/null || echo 100)" || exit 0
while :; do
  stat= rss= ticks=
  if [ -n "$pid" ]; then
    stat=$(cat "/proc/$pid/stat" 2>/dev/null)
  fi
  if [ -n "$stat" ]; then
    pids=$(tree "$pid")
    rss=$(for p in $pids; do cat "/proc/$p/status" 2>/dev/null; done |
      awk '/^VmRSS:/ {s+=$2} END {print s+0}')
    ticks=$(for p in $pids; do cat "/proc/$p/stat" 2>/dev/null; echo; done |
      awk 'NF {sub(/.*\) /, ""); t+=$12+$13} END {print t+0}')
  fi
  mem=$(awk '/^MemTotal:/ {t=$2} /^MemAvailable:/ {a=$2} END {print t, a}' /proc/meminfo)
  read -r load rest < /proc/loadavg
  printf '%s\t%s\t%s\t%s\t%s\n' "$stat" "$rss" "$mem" "$load" "$ticks" || exit 0
  sleep "$interval"
done
"""


def cpu_seconds(stat_line: str, clk_tck: float) -> float:
    """utime + stime of a /proc/<pid>/stat line, in seconds (the name may hold spaces)."""
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    return (int(fields[UTIME_AFTER_COMM]) + int(fields[STIME_AFTER_COMM])) / clk_tck


def rss_kib(status_text: str) -> float | None:
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1])
    return None


def meminfo_kib(meminfo_text: str) -> tuple[float | None, float | None]:
    """(MemTotal, MemAvailable) in kB."""
    found: dict[str, float] = {}
    for line in meminfo_text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            found[key] = float(rest.split()[0])
    return found.get("MemTotal"), found.get("MemAvailable")


def proc_sample(
    now: float,
    pid: int | None,
    *,
    stat_line: str | None,
    rss_kb: float | None,
    mem_total_kb: float | None,
    mem_available_kb: float | None,
    load1: float | None,
    clk_tck: float,
    tree_cpu_s: float | None = None,
) -> ProcSample:
    """One sample; the engine's CPU seconds are its process tree's (`tree_cpu_s`) where given,
    else its own stat line's."""
    alive = pid is not None and bool(stat_line)
    own_cpu_s = cpu_seconds(stat_line, clk_tck) if alive and stat_line else None
    used = (
        (mem_total_kb - mem_available_kb) / KIB_PER_MIB
        if mem_total_kb is not None and mem_available_kb is not None
        else None
    )
    return ProcSample(
        t=now,
        engine_pid=pid if alive else None,
        engine_cpu_s=(tree_cpu_s if tree_cpu_s is not None else own_cpu_s) if alive else None,
        engine_rss_mib=rss_kb / KIB_PER_MIB if alive and rss_kb is not None else None,
        mem_used_mib=used,
        mem_total_mib=mem_total_kb / KIB_PER_MIB if mem_total_kb is not None else None,
        load1=load1,
    )


def read_local(now: float, pid: int | None, root: Path = Path("/proc")) -> ProcSample:
    """This machine's /proc, read at once: the engine's figures summed over its process tree."""
    clk_tck = float(os.sysconf("SC_CLK_TCK"))
    stat_line = None
    rss_kb = tree_cpu_s = None
    if pid is not None:
        try:
            stat_line = (root / str(pid) / "stat").read_text()
        except OSError:
            stat_line = None  # the engine is gone (restarting): node figures only
    if pid is not None and stat_line:
        rss_kb, tree_cpu_s = 0.0, 0.0
        for member in sorted(process_tree(pid, root)):
            try:
                member_stat = (root / str(member) / "stat").read_text()
                member_status = (root / str(member) / "status").read_text()
            except OSError:
                continue  # a child that ended while we looked: its time went with it
            tree_cpu_s += cpu_seconds(member_stat, clk_tck)
            rss_kb += rss_kib(member_status) or 0.0
    total, available = meminfo_kib((root / "meminfo").read_text())
    return proc_sample(
        now,
        pid,
        stat_line=stat_line,
        rss_kb=rss_kb,
        mem_total_kb=total,
        mem_available_kb=available,
        load1=float((root / "loadavg").read_text().split()[0]),
        clk_tck=clk_tck,
        tree_cpu_s=tree_cpu_s,
    )


class RemoteLineParser:
    """Parses REMOTE_LOOP's lines; the clock tick rate comes first, on its own line."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.clk_tck = 100.0

    def __call__(self, line: str, now: float) -> list[Sample] | None:
        if line.startswith("clk_tck "):
            self.clk_tck = float(line.split()[1])
            return []
        stat_line, rss, mem, load, *rest = line.split("\t")
        ticks = rest[0].strip() if rest else ""
        total, _, available = mem.partition(" ")
        return [
            proc_sample(
                now,
                self.pid,
                stat_line=stat_line or None,
                rss_kb=float(rss) if rss.strip() else None,
                mem_total_kb=float(total) if total.strip() else None,
                mem_available_kb=float(available) if available.strip() else None,
                load1=float(load) if load.strip() else None,
                clk_tck=self.clk_tck,
                tree_cpu_s=float(ticks) / self.clk_tck if ticks else None,
            )
        ]


def proc_sampler(target: Target, interval_s: float) -> Sampler | None:
    """This machine read directly; a node that can stream a command through REMOTE_LOOP;
    None for a node that cannot."""
    if on_this_machine(target):

        def read(now: float, pid: int | None) -> list[Sample]:
            return [read_local(now, pid)]

        return PollingSampler("cpu", "proc", interval_s, read)
    if not isinstance(target, StreamingTarget):
        return None
    streaming: StreamingTarget = target

    def open_stream(pid: int | None) -> LineStream:
        argv = ["sh", "-c", REMOTE_LOOP, "sh", "" if pid is None else str(pid), f"{interval_s:g}"]
        return streaming.stream(argv)

    return StreamSampler("cpu", "proc", interval_s, open_stream, RemoteLineParser, follows_pid=True)
