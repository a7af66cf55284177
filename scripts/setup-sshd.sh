#!/usr/bin/env bash
# Installs what the SSH and provider tests need (OpenSSH server and client) and creates the
# unprivileged test user they log in as. Idempotent: a second run changes nothing.
set -euo pipefail

TEST_USER="${GPUBENCH_SSH_TEST_USER:-gpubench-test}"

if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
else
  SUDO=
fi

need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh-keygen >/dev/null || need+=(openssh-client)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup-sshd: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  # policy-rc.d keeps the package from starting (and enabling) a system-wide sshd on port 22:
  # the tests run their own sshd on a free loopback port with a private config.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod 755 /usr/sbin/policy-rc.d
    trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  # Nor should the fresh install leave a system-wide sshd enabled for the next boot.
  if command -v systemctl >/dev/null; then
    $SUDO systemctl disable --quiet ssh.service 2>/dev/null || true
  fi
fi

# sshd refuses to start without its privilege-separation directory.
[ -d /run/sshd ] || $SUDO install -d -m 0755 /run/sshd

# A dedicated unprivileged user with /bin/sh, so that no login shell startup slows the commands.
if ! id -u "$TEST_USER" >/dev/null 2>&1; then
  echo "setup-sshd: creating user $TEST_USER"
  $SUDO useradd --create-home --shell /bin/sh "$TEST_USER"
fi
# sshd refuses logins to a locked account ('!' in /etc/shadow, useradd's default) even with a
# valid key; '*' means "no password login" and still allows keys.
if $SUDO getent shadow "$TEST_USER" | cut -d: -f2 | grep -q '^!'; then
  $SUDO usermod -p '*' "$TEST_USER"
fi
