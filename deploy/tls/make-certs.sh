#!/usr/bin/env bash
# Make a private CA and certificates for ominix-runtime: the engine and the workers, for mutual TLS.
#
#   deploy/tls/make-certs.sh OUT_DIR [NAME ...]
#
# NAME: extra DNS names or IP addresses the engine and workers are reached at (localhost and 127.0.0.1
# are always included). Writes into OUT_DIR, one distinct identity (subject CN) per role:
#   ca.pem, ca.key          the CA (keep ca.key offline; only ca.pem is distributed)
#   engine.pem, engine.key  CN "ominix-runtime engine": served on the engine port and presented to workers
#                           as a client certificate (server and client authentication); the only
#                           identity a worker lets open Run (worker --engine-identity)
#   worker.pem, worker.key  CN "ominix-runtime worker": served on the worker port (server authentication)
#   client.pem, client.key  CN "ominix-runtime client": a front-end client of the engine port (client
#                           authentication only; a worker refuses it)
# Certificates are valid for DAYS days (default 365).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
out=$1
shift
days=${DAYS:-365}
mkdir -p "$out"
umask 077

san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi
done

openssl req -x509 -newkey rsa:3072 -nodes -sha256 -days "$days" \
  -keyout "$out/ca.key" -out "$out/ca.pem" -subj "/CN=ominix-runtime CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

leaf() {
  local name=$1 usage=$2
  local ext
  ext=$(mktemp)
  printf '%s\n' \
    "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=$usage" \
    "subjectAltName=$san" >"$ext"
  openssl req -new -newkey rsa:2048 -nodes -sha256 -keyout "$out/$name.key" -out "$out/$name.csr" \
    -subj "/CN=ominix-runtime $name" 2>/dev/null
  openssl x509 -req -sha256 -days "$days" -in "$out/$name.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" \
    -CAcreateserial -out "$out/$name.pem" -extfile "$ext" 2>/dev/null
  rm -f "$out/$name.csr" "$ext"
}

leaf engine serverAuth,clientAuth
leaf worker serverAuth
leaf client clientAuth
rm -f "$out/ca.srl"
chmod 644 "$out"/*.pem
echo "certificates for $san written to $out"
