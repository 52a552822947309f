#!/usr/bin/env bash
# TLS for the ElastiCo admission webhook without cert-manager's CA injector: a self-signed CA and a serving
# certificate for elastico-webhook.elastico.svc, stored as the Secret elastico-webhook-tls (tls.crt, tls.key and
# ca.crt, which the webhook needs as ELASTICO_TLS_CA_FILE), and the CA set as the MutatingWebhookConfiguration's
# caBundle. deploy/kubernetes/certificates.yaml already issues this Secret with cert-manager (which the rest of the
# suite needs): use this only where that Certificate was removed, or cert-manager will overwrite the Secret.
# Run after `kubectl apply -k deploy/kubernetes`; re-run to rotate.
set -euo pipefail
NS=${NS:-elastico}
SVC=elastico-webhook
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=elastico-webhook-ca" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$SVC.$NS.svc" -keyout "$DIR/tls.key" -out "$DIR/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n' \
  "$SVC" "$SVC" "$NS" "$SVC" "$NS" > "$DIR/ext.cnf"
openssl x509 -req -in "$DIR/tls.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial -days 825 \
  -extfile "$DIR/ext.cnf" -out "$DIR/tls.crt" 2>/dev/null
kubectl -n "$NS" create secret generic elastico-webhook-tls --type=kubernetes.io/tls --from-file=tls.crt="$DIR/tls.crt" \
  --from-file=tls.key="$DIR/tls.key" --from-file=ca.crt="$DIR/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
kubectl patch mutatingwebhookconfiguration elastico --type=json \
  -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$(base64 -w0 < "$DIR/ca.crt")\"}]"
kubectl -n "$NS" rollout restart deployment/elastico-webhook
