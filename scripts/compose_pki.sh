#!/bin/sh
# The compose suite's CA, certificates and operator token (docker-compose.yml service "pki", run as root once per
# `docker compose up`), in the volume mounted at DIR (default /pki):
#   DIR/ca/                             the CA and its key: mounted by this service only
#   DIR/<service>/{tls.crt,tls.key,ca.crt}  one directory per identity (CN allocator, pricer, predictor,
#                                       node/<node id>, operator), each service mounts only its own (volume subpath)
#   DIR/auth/tokens.json                the allocator's tokens file (hashes)
#   DIR/operator/token                  the operator's bearer token (role operator), never printed
# The CA is kept across runs; certificates are re-issued on every run (restart = rotation); the operator token is
# issued once. SANs: the compose service name (what peers dial), localhost and 127.0.0.1 (healthchecks, ports).
set -eu
DIR=${1:-/pki}
OWNER=${ELASTICO_UID:-10001}  # the image's user; node agents run as root and read anything

own() { if [ "$(id -u)" = 0 ]; then chown -R "$OWNER:$OWNER" "$1"; fi; }

issue() {  # directory identity [host...]
  out=$DIR/$1
  name=$2
  shift 2
  set -- "$@" localhost 127.0.0.1
  hosts=""
  for h in "$@"; do hosts="$hosts --host $h"; done
  # shellcheck disable=SC2086  # one word per host
  python -m elastico.pki issue "$DIR/ca" "$name" $hosts >/dev/null
  stem=$(printf %s "$name" | tr / .)
  mkdir -p "$out"
  mv "$DIR/ca/$stem.crt" "$out/tls.crt"
  mv "$DIR/ca/$stem.key" "$out/tls.key"
  cp "$DIR/ca/ca.crt" "$out/ca.crt"
  chmod 0700 "$out"
  chmod 0600 "$out/tls.key"
  chmod 0644 "$out/tls.crt" "$out/ca.crt"
  own "$out"
}

umask 077
python -m elastico.pki init "$DIR/ca" >/dev/null
issue allocator allocator allocator
issue pricer pricer pricer
issue predictor predictor predictor
issue node-agent-1 node/sim-node-1 node-agent-1
issue node-agent-2 node/sim-node-2 node-agent-2
issue node-agent-gpu node/node-agent-gpu node-agent-gpu
issue operator operator

mkdir -p "$DIR/auth"
if [ ! -s "$DIR/operator/token" ] || [ ! -s "$DIR/auth/tokens.json" ]; then
  python -m elastico.auth --file "$DIR/auth/tokens.json" revoke --name operator >/dev/null || true
  python -m elastico.auth --file "$DIR/auth/tokens.json" issue --name operator --role operator --allow-command '*' \
    > "$DIR/operator/token.tmp"
  mv "$DIR/operator/token.tmp" "$DIR/operator/token"
fi
chmod 0700 "$DIR/auth"
own "$DIR/auth"
own "$DIR/operator"
echo "pki: certificates issued; operator credentials (certificate, key, CA, token):"
echo "  docker compose run --rm --no-deps -T pki tar -C $DIR/operator -c . | tar -x -C ./elastico-operator"
