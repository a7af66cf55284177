#!/usr/bin/env bash
# Installs the Debian packages the project needs to build llama-server, run the benchmarks and
# the tests (stunnel4 for TLS, chromium to check the HTML report in a browser), only those
# missing, so a second run costs nothing. OpenSSH for the tests: setup-sshd.sh.
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
command -v git >/dev/null || need+=(git)
command -v sha256sum >/dev/null || need+=(coreutils)
# The TLS terminator the tests and benchmarks_dev/client_overhead.py put in front of llama-server.
command -v stunnel4 >/dev/null || need+=(stunnel4)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
# The HTML report's test opens it in a real headless browser.
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  SUDO=sudo
else
  SUDO=
fi
echo "setup-system: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
