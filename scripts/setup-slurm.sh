#!/usr/bin/env bash
# Installs what the Slurm tests need: Debian's slurmctld, slurmd, the client commands (sbatch,
# squeue, scancel, sacct, scontrol) and munge. Idempotent: a second run changes nothing.
# The tests start their own single-node cluster on loopback from a private slurm.conf and munge
# key (tests/support/slurm_fixtures.py): no system-wide daemon is configured or started here.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
else
  SUDO=
fi

need=()
[ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
[ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
[ -x /usr/sbin/munged ] || need+=(munge)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi

echo "setup-slurm: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d keeps the packages from starting system-wide daemons (munge, slurmd, slurmctld).
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod 755 /usr/sbin/policy-rc.d
  trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
fi
# Another apt run (a parallel set-up) may hold the dpkg lock for a while: wait for it.
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  if $SUDO apt-get -o DPkg::Lock::Timeout=60 update -qq &&
    $SUDO apt-get -o DPkg::Lock::Timeout=60 install -y -qq --no-install-recommends "${need[@]}"; then
    break
  fi
  [ "$attempt" -lt 10 ] || exit 1
  echo "setup-slurm: apt-get failed (attempt $attempt); retrying in 15 s"
  sleep 15
done
if command -v systemctl >/dev/null; then
  for unit in munge slurmd slurmctld; do
    $SUDO systemctl disable --quiet "$unit.service" 2>/dev/null || true
  done
fi
