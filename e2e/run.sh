#!/usr/bin/env bash
# End to end on kind: build the three images, create a cluster, install the chart,
# apply a CPU pool with the default model and send a chat request through the gateway
# (Envoy, asking the endpoint picker `sluice epp` which engine pod serves it).
# Needs: docker, kind, kubectl, helm, curl. Run by the release workflow, not by .ci/run
# (see e2e/README.md).
set -euo pipefail

CLUSTER="${CLUSTER:-sluice-e2e}"
TAG="${TAG:-e2e}"
NS="${NS:-sluice}"
POOL_NS="${POOL_NS:-default}"
REGISTRY="${REGISTRY:-ghcr.io/sluice-dev}"
KEEP="${KEEP:-0}"  # 1: leave the cluster running
# Envoy's official image, pulled once here and loaded into kind (no pulls from the node).
ENVOY_IMAGE="${ENVOY_IMAGE:-envoyproxy/envoy:distroless-v1.40.0}"
# GIE mode: a file or URL with the Gateway API Inference Extension's CRDs. Set, the chart is
# installed with gie.enabled=true and the pool goes to the release namespace.
GIE_CRDS="${GIE_CRDS:-}"
if [[ -n "$GIE_CRDS" ]]; then POOL_NS="$NS"; fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

log() { printf '\n==> %s\n' "$*"; }

log "building images ($TAG)"
# The classic builder: no BuildKit or buildx to install, no frontend image to pull.
export DOCKER_BUILDKIT=0
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
  local rc=$?
  [[ -n "${PF_PID:-}" ]] && kill "$PF_PID" 2>/dev/null || true
  if [[ $rc -ne 0 ]]; then  # what went wrong, before the cluster goes
    kubectl get pods -A -o wide || true
    kubectl logs -n "$NS" deploy/sluice-gateway --all-containers --tail=50 || true
    kubectl logs -n "$NS" deploy/sluice-picker --tail=50 || true
  fi
  if [[ "$KEEP" != 1 ]]; then kind delete cluster --name "$CLUSTER"; fi
}
trap cleanup EXIT
kubectl config use-context "kind-$CLUSTER"

log "loading images into kind"
for image in sluice-operator sluice-gateway sluice-engine; do
  kind load docker-image --name "$CLUSTER" "$REGISTRY/$image:$TAG"
done
docker pull "$ENVOY_IMAGE"
kind load docker-image --name "$CLUSTER" "$ENVOY_IMAGE"

gie_flags=()
if [[ -n "$GIE_CRDS" ]]; then
  log "installing GIE's CRDs ($GIE_CRDS)"
  kubectl apply -f "$GIE_CRDS"
  # the Gateway's data plane here is the chart's own Envoy, in the release namespace
  gie_flags=(--set gie.enabled=true --set
    "networkPolicy.gatewayFrom[0].namespaceSelector.matchLabels.kubernetes\.io/metadata\.name=$NS")
fi

log "installing the chart"
helm upgrade --install sluice charts/sluice --namespace "$NS" --create-namespace \
  --set operator.image.tag="$TAG" --set picker.image.tag="$TAG" \
  --set envoy.image.repository="${ENVOY_IMAGE%:*}" --set envoy.image.tag="${ENVOY_IMAGE##*:}" \
  --set operator.engineImage="$REGISTRY/sluice-engine:$TAG" \
  --set operator.replicas=1 --set picker.replicas=1 --set envoy.replicas=1 \
  --set "watchNamespaces={$POOL_NS}" ${gie_flags[@]+"${gie_flags[@]}"} \
  --wait --timeout 5m
kubectl rollout status -n "$NS" deployment/sluice-picker --timeout=2m
kubectl rollout status -n "$NS" deployment/sluice-gateway --timeout=2m

log "applying a CPU pool with the default model"
kubectl apply -n "$POOL_NS" -f charts/sluice/examples/pool-cpu.yaml
kubectl wait -n "$POOL_NS" --for=condition=Ready inferencepools.sluice.dev/smollm2 --timeout=15m
kubectl get -n "$POOL_NS" inferencepools.sluice.dev -o wide

if [[ -n "$GIE_CRDS" ]]; then
  log "GIE mode: the operator wrote the pool's GIE InferencePool"
  picker="$(kubectl get -n "$POOL_NS" inferencepools.inference.networking.k8s.io/smollm2 \
    -o jsonpath='{.spec.endpointPickerRef.name}:{.spec.endpointPickerRef.port.number}')"
  [[ "$picker" == "sluice-picker:9002" ]] || { echo "GIE pool names $picker" >&2; exit 1; }
fi

log "sending a chat request through the gateway (Envoy + picker)"
kubectl port-forward -n "$NS" svc/sluice-gateway 18080:80 >/dev/null 2>&1 &
PF_PID=$!
# Envoy answers any HTTP (404 off /v1/) once the port-forward is up
for _ in $(seq 1 30); do curl -sS -o /dev/null http://127.0.0.1:18080/ 2>/dev/null && break; sleep 2; done
KEY="$(kubectl get secret -n "$NS" sluice-api-keys -o jsonpath='{.data.default}' | base64 -d)"
code="$(curl -sS -o /dev/null -w '%{http_code}' http://127.0.0.1:18080/v1/models)"
[[ "$code" == "401" ]] || { echo "no key: expected 401, got $code" >&2; exit 1; }
response="$(curl -fsS --retry 10 --retry-all-errors --retry-delay 3 \
  http://127.0.0.1:18080/v1/chat/completions -H 'Content-Type: application/json' \
  -H "Authorization: Bearer $KEY" \
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
