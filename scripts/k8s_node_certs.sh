#!/usr/bin/env bash
# Per-node certificates of the node agents: CN node/<node name> (the agent refuses any other), SANs the node's name,
# its InternalIP(s) (the agent advertises HOST_IP:50060) and 127.0.0.1 (exec probe). Why a script: one DaemonSet
# cannot mount a Secret per node, and cert-manager's csi-driver only templates POD_NAME, POD_NAMESPACE, POD_UID and
# SERVICE_ACCOUNT_NAME into a certificate, not the node name (docs/security.md "Deployment").
#
# For every node given (default: the nodes labelled $NODE_SELECTOR):
#   1. a cert-manager Certificate elastico-node-<node> (issuer elastico-ca; renewed by cert-manager into the Secret
#      elastico-node-<node>-tls);
#   2. a one-shot pod pinned to that node copies the Secret to the host directory /etc/elastico/node-tls, which the
#      DaemonSet mounts read-only. Only that node's kubelet can read the Secret (the pod bound to it references it),
#      so no node sees another node's key. Files are swapped atomically (..data symlink); the agent reloads them.
# Re-run it after adding a GPU node and at least every 30 days (renewBefore), e.g. weekly from cron, so each node
# holds its renewed certificate before the old one expires.
set -euo pipefail
NS=${NS:-elastico}
NODE_SELECTOR=${NODE_SELECTOR:-nvidia.com/gpu.present=true}
IMAGE=${IMAGE:-registry.example.com/elastico:0.1.0}  # the suite's image (kustomization.yaml images)
HOST_DIR=/etc/elastico/node-tls  # node-agent.yaml volume "tls"

if [ $# -gt 0 ]; then nodes=("$@"); else mapfile -t nodes < <(kubectl get nodes -l "$NODE_SELECTOR" -o name | sed 's|^node/||'); fi
[ ${#nodes[@]} -gt 0 ] || { echo "no nodes (give names, or label GPU nodes $NODE_SELECTOR)" >&2; exit 1; }

for node in "${nodes[@]}"; do
  [ ${#node} -le 59 ] || { echo "$node: node/<name> exceeds the 64-character common name" >&2; exit 1; }
  ips=$(kubectl get node "$node" -o jsonpath='{range .status.addresses[?(@.type=="InternalIP")]}{.address}{" "}{end}')
  ip_list=$(for ip in $ips 127.0.0.1; do printf '"%s", ' "$ip"; done | sed 's/, $//')
  kubectl apply -f - <<EOF
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: elastico-node-$node
  namespace: $NS
  labels: {app.kubernetes.io/part-of: elastico, app.kubernetes.io/name: node-agent}
spec:
  commonName: node/$node
  secretName: elastico-node-$node-tls
  duration: 2160h
  renewBefore: 720h
  privateKey: {algorithm: ECDSA, size: 256, rotationPolicy: Always}
  usages: ["digital signature", "server auth", "client auth"]
  dnsNames: ["$node", "localhost"]
  ipAddresses: [$ip_list]
  issuerRef: {name: elastico-ca, kind: Issuer, group: cert-manager.io}
EOF
  kubectl -n "$NS" wait --for=condition=Ready "certificate/elastico-node-$node" --timeout=120s
  pod=elastico-node-cert-$node
  kubectl -n "$NS" delete pod "$pod" --ignore-not-found --wait=true >/dev/null
  kubectl apply -f - <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $pod
  namespace: $NS
  labels: {app.kubernetes.io/part-of: elastico, app.kubernetes.io/name: elastico-node-cert}
spec:
  nodeName: $node
  restartPolicy: Never
  serviceAccountName: elastico
  automountServiceAccountToken: false
  tolerations: [{operator: Exists}]
  containers:
    - name: install
      image: $IMAGE
      command:
        - sh
        - -ec
        - |
          cd /host && chmod 0700 .
          ts=..\$(date +%Y%m%d%H%M%S)-\$\$
          mkdir -m 0700 "\$ts" && cp /secret/ca.crt /secret/tls.crt /secret/tls.key "\$ts"/ && chmod 0600 "\$ts"/*
          ln -sfn "\$ts" ..data_tmp && mv -Tf ..data_tmp ..data
          for f in ca.crt tls.crt tls.key; do [ -L "\$f" ] || ln -sfn "..data/\$f" "\$f"; done
          for d in ..2*; do [ "\$d" = "\$ts" ] || rm -rf "\$d"; done
      securityContext:
        runAsUser: 0  # the agent runs as root and reads the key; nobody else on the node may
        allowPrivilegeEscalation: false
        capabilities: {drop: ["ALL"]}
      volumeMounts:
        - {name: secret, mountPath: /secret, readOnly: true}
        - {name: host, mountPath: /host}
  volumes:
    - name: secret
      secret: {secretName: elastico-node-$node-tls}
    - name: host
      hostPath: {path: $HOST_DIR, type: DirectoryOrCreate}
EOF
  if ! kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Succeeded "pod/$pod" --timeout=180s; then
    kubectl -n "$NS" logs "pod/$pod" >&2 || true
    exit 1
  fi
  kubectl -n "$NS" delete pod "$pod" --wait=false >/dev/null
  echo "$node: node/$node installed at $HOST_DIR"
done
