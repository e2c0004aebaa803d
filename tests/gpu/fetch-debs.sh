#!/usr/bin/env bash
# Downloads (on a Debian 12 machine with network) the .deb files that step 5
# of tests/gpu/run.sh needs on a GPU machine that has only the CUDA toolkit:
# the regular build's libraries with their headers and every shared library
# they pull in beyond glibc and libstdc++ (about 27 MB). On the GPU machine:
#   LOOM_DEPS_DEBS=DIR tests/gpu/run.sh OUT
# unpacks them into OUT/deps (dpkg-deb -x, or ar + tar) and builds against it.
# Usage: tests/gpu/fetch-debs.sh DIR
set -euo pipefail
dir=${1:?usage: tests/gpu/fetch-debs.sh DIR}
mkdir -p "$dir"
cd "$dir"
apt-get download \
    libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libopenblas0 libgfortran5 libquadmath0 \
    libcjson-dev libcjson1 libzmq3-dev libzmq5 libsodium-dev libsodium23 libpgm-5.3-0 libnorm1 libbsd0 libmd0 \
    libprotobuf-c-dev libprotobuf-c1 protobuf-c-compiler libprotoc32 libprotobuf32 \
    libmicrohttpd-dev libmicrohttpd12 libgnutls28-dev libgnutls30 libhogweed6 libnettle8 libgmp10 libidn2-0 \
    libunistring2 libtasn1-6 libp11-kit0 libffi8 \
    libcurl4-openssl-dev libcurl4 libbrotli1 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libssl3 libzstd1 \
    libgssapi-krb5-2 libk5crypto3 libkrb5-3 libkrb5support0 libcom-err2 libkeyutils1 \
    libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3
echo "$(find "$dir" -name "*.deb" | wc -l) .deb files in $dir"
