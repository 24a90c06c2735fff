#!/usr/bin/env bash
# Makes a local stand-in for deploy/Dockerfile's base image, `python:3.12-slim`, on a host that reaches no
# container registry (a sandbox whose only way out is the package indexes): Debian bookworm from the apt
# mirror (debootstrap), this host's Python 3.12 (pyenv's, or python3.12 on PATH; its site-packages left out)
# in /usr/local, and the host's extra CA certificates, so that pip inside the build reaches the package
# index through a TLS-intercepting proxy. Where Docker Hub is reachable, skip this: `docker build` pulls
# the real image. Needs root, dockerd running and debootstrap (apt-get install docker.io debootstrap).
#
#   bash scripts/docker_base.sh            # tags python:3.12-slim unless it exists
set -euo pipefail
cd "$(dirname "$0")/.."
tag="python:3.12-slim"
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "docker_base: $tag exists"
  exit 0
fi
source scripts/python.sh
python=$(find_python 3.12)
prefix=$("$python" -c 'import sys; print(sys.base_prefix)')
# the Debian mirror apt uses (deb822 or one-line sources), else Debian's own
mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
  grep -oE 'https?://[^ ]+/debian/?$|https?://[^ ]+/debian ' | head -1 | tr -d ' ' || true)
mirror=${mirror:-http://deb.debian.org/debian}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# the base: bookworm minbase with the libraries CPython's extension modules link against
if ! docker image inspect local/debian:bookworm >/dev/null 2>&1; then
  debootstrap --variant=minbase --include=ca-certificates,libssl3,libffi8,zlib1g,libbz2-1.0,liblzma5,libsqlite3-0,libreadline8,libncursesw6,libuuid1,libgdbm6,libexpat1 \
    bookworm "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -20 "$work/debootstrap.log" >&2
    exit 1
  }
  tar -C "$work/root" -c . | docker import - local/debian:bookworm
  rm -rf "$work/root"
fi

# Python 3.12 without the host's site-packages (pip comes back through ensurepip), and the CA certificates
mkdir -p "$work/ctx/python" "$work/ctx/ca"
tar -C "$prefix" --exclude='lib/python3.12/site-packages/*' --exclude='__pycache__' -c . | tar -C "$work/ctx/python" -x
cp /usr/local/share/ca-certificates/*.crt "$work/ctx/ca/" 2>/dev/null || true
cat >"$work/ctx/Dockerfile" <<'EOF'
FROM local/debian:bookworm
COPY python /usr/local
COPY ca /usr/local/share/ca-certificates
RUN update-ca-certificates >/dev/null && ldconfig \
    && ln -sf python3.12 /usr/local/bin/python3 && ln -sf python3 /usr/local/bin/python \
    && python3 -m ensurepip --default-pip >/dev/null \
    && ln -sf pip3 /usr/local/bin/pip \
    && python3 -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid; print("python", __import__("sys").version)'
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    LANG=C.UTF-8
CMD ["python3"]
EOF
docker build -q -t "$tag" "$work/ctx"
echo "docker_base: tagged $tag ($(docker run --rm "$tag" python3 --version))"
