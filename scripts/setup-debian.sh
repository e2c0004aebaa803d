#!/usr/bin/env bash
# Installs what Loom needs to build and test on Debian 12 (bookworm): the
# libraries (ZeroMQ, protobuf-c, libmicrohttpd, cJSON, libcurl, OpenBLAS),
# etcd for the membership tests, iproute2 for the network-namespace test,
# tcpdump for the loopback capture of the security test, openssl for the
# etcd TLS test's certificates,
# Debian's numpy/torch for the reference implementation, Debian's jinja2 (the chat-template reference renderer), Debian's jsonschema
# (it validates the outputs of constrained decoding), Debian's Kubernetes
# client (its API models check the manifests), gnuplot for plots, and the npm
# packages of the tests.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
packages=(build-essential cmake pkg-config git curl ca-certificates
          libzmq3-dev libsodium-dev libprotobuf-c-dev protobuf-c-compiler libmicrohttpd-dev libcjson-dev
          libcurl4-openssl-dev libopenblas-dev etcd-server etcd-client iproute2 tcpdump openssl
          python3 python3-numpy python3-torch python3-jinja2 python3-yaml python3-kubernetes python3-jsonschema python3-cryptography
          gnuplot-nox clang libclang-rt-14-dev libgnutls28-dev)
# Node.js: use the one on the machine when there is one (Debian's npm conflicts with others).
command -v node >/dev/null && command -v npm >/dev/null || packages+=(nodejs npm)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
ref="$root/tests/reference"
if [ ! -f "$ref/node_modules/.package-lock.json" ] || [ "$ref/package-lock.json" -nt "$ref/node_modules/.package-lock.json" ]; then
    echo "setup: installing the test npm packages" >&2
    (cd "$root/tests/reference" && npm ci --no-audit --no-fund --loglevel=error)
fi
