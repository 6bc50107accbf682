#!/usr/bin/env bash
# End to end on kind: build the three images, create a cluster, install the chart,
# apply a CPU pool with the default model and send a chat request through the gateway.
# Needs: docker, kind, kubectl, helm, curl. Not run by CI (see e2e/README.md).
set -euo pipefail

CLUSTER="${CLUSTER:-sluice-e2e}"
TAG="${TAG:-e2e}"
NS="${NS:-sluice}"
POOL_NS="${POOL_NS:-default}"
REGISTRY="${REGISTRY:-ghcr.io/sluice-dev}"
KEEP="${KEEP:-0}"  # 1: leave the cluster running
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

log() { printf '\n==> %s\n' "$*"; }

log "building images ($TAG)"
export DOCKER_BUILDKIT=1
docker build -f operator/Dockerfile -t "$REGISTRY/sluice-operator:$TAG" .
docker build -f gateway/Dockerfile -t "$REGISTRY/sluice-gateway:$TAG" .
docker build -f engine_image/Dockerfile -t "$REGISTRY/sluice-engine:$TAG" \
  --build-arg BASE_IMAGE=ubuntu:24.04 \
  --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .

if ! kind get clusters | grep -qx "$CLUSTER"; then
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --wait 180s
fi
cleanup() {
  [[ -n "${PF_PID:-}" ]] && kill "$PF_PID" 2>/dev/null || true
  if [[ "$KEEP" != 1 ]]; then kind delete cluster --name "$CLUSTER"; fi
}
trap cleanup EXIT
kubectl config use-context "kind-$CLUSTER"

log "loading images into kind"
for image in sluice-operator sluice-gateway sluice-engine; do
  kind load docker-image --name "$CLUSTER" "$REGISTRY/$image:$TAG"
done

log "installing the chart"
helm upgrade --install sluice charts/sluice --namespace "$NS" --create-namespace \
  --set operator.image.tag="$TAG" --set gateway.image.tag="$TAG" \
  --set operator.engineImage="$REGISTRY/sluice-engine:$TAG" \
  --set operator.replicas=1 --set gateway.replicas=1 \
  --set gateway.watchNamespace="$POOL_NS" \
  --wait --timeout 5m

log "applying a CPU pool with the default model"
kubectl apply -n "$POOL_NS" -f charts/sluice/examples/pool-cpu.yaml
kubectl wait -n "$POOL_NS" --for=condition=Ready inferencepools.sluice.dev/smollm2 --timeout=15m
kubectl get -n "$POOL_NS" inferencepools.sluice.dev -o wide

log "sending a chat request through the gateway"
kubectl port-forward -n "$NS" svc/sluice-gateway 18080:80 >/dev/null 2>&1 &
PF_PID=$!
for _ in $(seq 1 30); do curl -fsS http://127.0.0.1:18080/health >/dev/null 2>&1 && break; sleep 2; done
response="$(curl -fsS --retry 10 --retry-all-errors --retry-delay 3 \
  http://127.0.0.1:18080/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "smollm2-135m-instruct", "max_tokens": 16,
       "messages": [{"role": "user", "content": "Say hello."}]}')"
echo "$response"
echo "$response" | grep -q '"choices"' || { echo "no choices in the response" >&2; exit 1; }

log "scaling with kubectl (scale subresource) and checking the Deployment follows"
kubectl scale -n "$POOL_NS" inferencepools.sluice.dev/smollm2 --replicas=2
kubectl rollout status -n "$POOL_NS" deployment/smollm2-serve --timeout=10m

log "deleting the pool: children are garbage-collected"
kubectl delete -n "$POOL_NS" inferencepools.sluice.dev/smollm2 --wait --timeout=2m
kubectl wait -n "$POOL_NS" --for=delete deployment/smollm2-serve --timeout=2m || true
log "e2e passed"
