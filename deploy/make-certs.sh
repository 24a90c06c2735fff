#!/usr/bin/env bash
# Self-signed CA + the two TLS Secrets of components/tls, for trying TLS out (use cert-manager or your
# PKI in production). Prints the Secrets as YAML: bash deploy/make-certs.sh [NAMESPACE] | kubectl apply -f -
set -euo pipefail
ns="${1:-default}"
kubectl="${KUBECTL:-kubectl}"
case "$kubectl" in */*) kubectl="$(cd "$(dirname "$kubectl")" && pwd)/$(basename "$kubectl")" ;; esac
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cd "$dir"
quiet() { "$@" >/dev/null 2>&1; }
quiet openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=pdserve-ca" -keyout ca.key -out ca.crt
cert() {  # NAME CN SANS EKU
  quiet openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr"
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$3" "$4" >"$1.ext"
  quiet openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$1.ext" -out "$1.crt"
}
# prefill: server cert (decode checks the name pdserve-prefill), also client auth for its exec probes
cert prefill pdserve-prefill \
  "DNS:pdserve-prefill,DNS:pdserve-prefill.$ns,DNS:pdserve-prefill.$ns.svc,DNS:localhost" serverAuth,clientAuth
# decode: public server cert, and the client cert `decode` that prefill's --allowed-peer-names admits
cert decode pdserve-decode \
  "DNS:pdserve-decode,DNS:pdserve-decode.$ns,DNS:pdserve-decode.$ns.svc,DNS:localhost" serverAuth
cert client decode "DNS:decode" clientAuth
"$kubectl" create secret generic pdserve-prefill-tls -n "$ns" --dry-run=client -o yaml \
  --from-file=tls.crt=prefill.crt --from-file=tls.key=prefill.key --from-file=ca.crt=ca.crt
echo ---
"$kubectl" create secret generic pdserve-decode-tls -n "$ns" --dry-run=client -o yaml \
  --from-file=tls.crt=decode.crt --from-file=tls.key=decode.key --from-file=ca.crt=ca.crt \
  --from-file=client.crt=client.crt --from-file=client.key=client.key
