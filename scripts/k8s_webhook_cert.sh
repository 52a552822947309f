#!/usr/bin/env bash
# TLS for the ElastiCo admission webhook without cert-manager: a self-signed CA and a serving certificate for
# elastico-webhook.elastico.svc, stored as the Secret elastico-webhook-tls, and the CA set as the
# MutatingWebhookConfiguration's caBundle. Run after `kubectl apply -k deploy/kubernetes`; re-run to rotate.
set -euo pipefail
NS=${NS:-elastico}
SVC=elastico-webhook
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=elastico-webhook-ca" \
  -keyout "$DIR/ca.key" -out "$DIR/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$SVC.$NS.svc" -keyout "$DIR/tls.key" -out "$DIR/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.%s,DNS:%s.%s.svc\n' "$SVC" "$SVC" "$NS" "$SVC" "$NS" > "$DIR/ext.cnf"
openssl x509 -req -in "$DIR/tls.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" -CAcreateserial -days 825 \
  -extfile "$DIR/ext.cnf" -out "$DIR/tls.crt" 2>/dev/null
kubectl -n "$NS" create secret tls elastico-webhook-tls --cert "$DIR/tls.crt" --key "$DIR/tls.key" \
  --dry-run=client -o yaml | kubectl apply -f -
kubectl patch mutatingwebhookconfiguration elastico --type=json \
  -p "[{\"op\":\"add\",\"path\":\"/webhooks/0/clientConfig/caBundle\",\"value\":\"$(base64 -w0 < "$DIR/ca.crt")\"}]"
kubectl -n "$NS" rollout restart deployment/elastico-webhook
