#!/usr/bin/env bash
# The Secrets deploy/kubernetes reads but does not ship (docs/security.md "Deployment"):
#   elastico-redis-users     random passwords of the Redis users allocator, predictor, node, admin (hex: URL-safe)
#   elastico-auth-tokens     tokens.json of the allocator (hashes only): the extender's token (role scheduler) and
#                            an operator token
#   elastico-extender-token  the extender's token itself (ELASTICO_CLIENT_TOKEN_FILE)
# The operator token is written to $OPERATOR_TOKEN_FILE (default ./elastico-operator.token, mode 0600), never
# printed. Run from the repository (needs python -m elastico.auth, kubectl, openssl) before or after
# `kubectl apply -k deploy/kubernetes`. Existing Secrets are kept; ROTATE=1 replaces them (then restart Redis and
# its clients for new passwords, the extender for a new token; the allocator re-reads tokens.json by itself). ROTATE=1
# starts a new tokens.json: tenant tokens added since are dropped (manage those with python -m elastico.auth on the
# Secret's tokens.json and re-apply it).
set -euo pipefail
NS=${NS:-elastico}
PY=${PYTHON:-python3}
OPERATOR_TOKEN_FILE=${OPERATOR_TOKEN_FILE:-./elastico-operator.token}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
umask 077

exists() { [ "${ROTATE:-0}" != 1 ] && kubectl -n "$NS" get secret "$1" >/dev/null 2>&1; }
apply_secret() {  # name, then --from-file=... arguments
  local name=$1; shift
  kubectl -n "$NS" create secret generic "$name" "$@" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  echo "secret $NS/$name written"
}

kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS"

if exists elastico-redis-users; then
  echo "secret $NS/elastico-redis-users kept"
else
  args=()
  for user in allocator predictor node admin; do
    openssl rand -hex 32 | tr -d '\n' > "$DIR/$user"
    args+=("--from-file=$user=$DIR/$user")
  done
  apply_secret elastico-redis-users "${args[@]}"
fi

if exists elastico-auth-tokens && exists elastico-extender-token; then
  echo "secrets $NS/elastico-auth-tokens and $NS/elastico-extender-token kept"
else
  # the extender submits pods' jobs without a command (a pod's containers are its workload): no allow-list
  "$PY" -m elastico.auth --file "$DIR/tokens.json" issue --name kube-extender --role scheduler > "$DIR/extender.token"
  "$PY" -m elastico.auth --file "$DIR/tokens.json" issue --name operator --role operator --allow-command '*' \
    > "$DIR/operator.token"
  apply_secret elastico-auth-tokens "--from-file=tokens.json=$DIR/tokens.json"
  apply_secret elastico-extender-token "--from-file=token=$DIR/extender.token"
  install -m 0600 "$DIR/operator.token" "$OPERATOR_TOKEN_FILE"
  echo "operator token written to $OPERATOR_TOKEN_FILE (its certificate: secret $NS/elastico-operator-tls)"
fi
