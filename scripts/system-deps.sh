#!/usr/bin/env bash
# Debian packages kvd needs: the Mooncake transfer engine's run-time libraries, and
# etcd-server (/usr/bin/etcd), which the tests start on loopback for discovery = etcd.
# Installs them when run as root and missing; otherwise says what to install.
set -euo pipefail
pkgs=(libibverbs1 librdmacm1 libnuma1 etcd-server)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "kvd needs the Debian packages: ${missing[*]} (run: sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
