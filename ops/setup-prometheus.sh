#!/usr/bin/env bash
# Idempotent set-up of Prometheus and promtool, for the monitoring tests (tests/unit/test_ops_monitoring.py,
# tests/integration/test_prometheus.py) and for watching runs (ops/prometheus/README.md).
#
# - Both on PATH already: nothing to do, exit 0.
# - Root with apt-get (Debian/Ubuntu, CI images): installs Debian's `prometheus` package (binaries
#   /usr/bin/prometheus and /usr/bin/promtool). The package would start a system service; a temporary
#   /usr/sbin/policy-rc.d that exits 101 stops invoke-rc.d from starting it (the file is removed
#   afterwards, and only if this script created it). The tests start their own Prometheus on a free
#   loopback port.
# - Otherwise: says what to install and exits 1.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\n# temporary, from exgrpo-async ops/setup-prometheus.sh: start no service\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        created_policy=1
        trap 'rm -f "$policy"' EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq        # wait for another apt/dpkg instead of failing at once
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus
    if [ "$created_policy" -eq 1 ]; then
        rm -f "$policy"
        trap - EXIT
    fi
    if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
        echo "installed: $(prometheus --version 2>&1 | head -n 1)"
        exit 0
    fi
    echo "setup-prometheus: the prometheus package did not provide prometheus and promtool on PATH" >&2
    exit 1
fi

cat >&2 <<'EOF'
setup-prometheus: prometheus and promtool are not on PATH, and this is not root with apt-get.
Install them, then re-run this script to check:
  - Debian/Ubuntu:  sudo apt-get install --no-install-recommends prometheus
                    (then `sudo systemctl disable --now prometheus` if you do not want the service)
  - elsewhere:      the release tarball from https://prometheus.io/download/ (prometheus-*.linux-amd64.tar.gz);
                    put its prometheus and promtool binaries on PATH
EOF
exit 1
