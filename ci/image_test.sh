#!/usr/bin/env bash
# Build the image (ci/image.sh), start it the way SageMaker does (`IMAGE serve`, SAGEMAKER_BIND_TO_PORT), and check
# /ping, a legacy request, a chat request, a streamed request, and a clean stop on SIGTERM (exit 0, not 137). Then
# a Hub id in the image: HF_MODEL_ID=org/smollm2 downloaded from a loopback Hub stand-in (tests/support/hub_stand_in.py)
# through HF_ENDPOINT, served, and answering.
# Loopback only: host networking with the server bound to 127.0.0.1. The container is removed by id, always.
#   IMAGE (sagemaker-llm:latest)  SKIP_BUILD=1 to test an image already built  READY_TIMEOUT (300 s)
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-sagemaker-llm:latest}
READY_TIMEOUT=${READY_TIMEOUT:-300}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
step() { echo "== image-test: $*"; }

cid=""
fail() {
  echo "image-test: FAILED: $*" >&2
  if [ -n "$cid" ]; then
    echo "--- last container log lines:" >&2
    podman logs --tail 40 "$cid" >&2 2>&1 || true
  fi
  exit 1
}
cleanup() {
  if [ -n "$cid" ]; then podman rm -f -t 0 "$cid" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  IMAGE="$IMAGE" bash ci/image.sh
fi
podman image exists "$IMAGE" || fail "image $IMAGE not found"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
step "image $IMAGE: $size bytes ($((size / 1000000)) MB)"

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
t0=$(now)
cid=$(podman run -d --network host -e SAGEMAKER_BIND_TO_PORT="$port" -e SERVER_HOST=127.0.0.1 "$IMAGE" serve) \
  || fail "podman run failed"
step "started container ${cid:0:12} on $url"

deadline=$(( $(date +%s) + READY_TIMEOUT ))
while :; do
  code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' "$url/ping" || true)
  [ "$code" = 200 ] && break
  running=$(podman inspect "$cid" --format '{{.State.Running}}' 2>/dev/null || echo false)
  [ "$running" = true ] || fail "the container exited before /ping answered 200"
  [ "$(date +%s)" -lt "$deadline" ] || fail "/ping not 200 after ${READY_TIMEOUT} s (last status: $code)"
  sleep 0.5
done
step "container start -> /ping 200: $(since "$t0") s"

python3 - "$url" <<'PY' || fail "a request check failed (see above)"
import json
import sys
import urllib.request

url = sys.argv[1]


def post(body, accept="application/json"):
    request = urllib.request.Request(
        url + "/invocations", json.dumps(body).encode(), {"Content-Type": "application/json", "Accept": accept}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, response.read()


def check(name, condition, detail):
    if not condition:
        print(f"image-test: {name}: {detail}", file=sys.stderr)
        sys.exit(1)
    print(f"== image-test: {name}: ok ({detail[:100]})")


status, raw = post({"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}})
body = json.loads(raw)
check("legacy", status == 200 and isinstance(body, dict) and isinstance(body.get("generated_text"), str), raw.decode())

status, raw = post({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16})
body = json.loads(raw)
content = (body.get("choices") or [{}])[0].get("message", {}).get("content")
check("chat", status == 200 and isinstance(content, str) and content.strip() != "", raw.decode())

status, raw = post(
    {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}, "stream": True},
    accept="application/jsonlines",
)
text = raw.decode()
check("stream ends with a newline", status == 200 and text.endswith("\n"), repr(text[-100:]))
lines = text.split("\n")[:-1]
try:
    records = [json.loads(line) for line in lines]
except ValueError as error:
    check("stream lines are JSON", False, f"{error}: {text!r}")
check("stream lines are JSON", len(records) >= 2, f"{len(records)} lines")
check("stream last line", isinstance(records[-1].get("generated_text"), str), json.dumps(records[-1]))
PY

# the int8 kernel the image built in its own stage is the one serving (on a CPU with AVX2 and FMA): the start line
# names it ("int8: 16-bit activations per block of 128 (...), our AVX-512 VNNI kernel", or "our AVX2 kernel")
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  logs=$(podman logs "$cid" 2>&1)
  grep -qE "int8: .*our (AVX2|AVX-512 VNNI) kernel" <<<"$logs" || fail "the start log does not say the int8 kernel runs"
  step "int8 kernel: in use"
fi

t=$(now)
podman stop -t 30 "$cid" >/dev/null || fail "podman stop failed"
code=$(podman inspect "$cid" --format '{{.State.ExitCode}}')
step "podman stop: $(since "$t") s, exit code $code"
if [ "$code" != 0 ]; then
  [ "$code" = 137 ] && fail "exit code 137: the server did not exit on SIGTERM within 30 s and was killed"
  fail "exit code $code after SIGTERM (want 0)"
fi
podman rm "$cid" >/dev/null
cid=""

podman run --rm --entrypoint python "$IMAGE" -c "import djl_python.encode_decode, boto3, huggingface_hub" \
  || fail "the image lacks djl_python, boto3 or huggingface_hub"
hub_log=$(mktemp)
.venv/bin/python -m tests.support.hub_stand_in org/smollm2=model_store/smollm2-135m-instruct >"$hub_log" 2>&1 &
hub_pid=$!
trap 'cleanup; kill $hub_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q '^http' "$hub_log" && break; sleep 0.1; done
hub_url=$(grep -m1 '^http' "$hub_log") || fail "the Hub stand-in did not start: $(cat "$hub_log")"
t0=$(now)
cid=$(podman run -d --network host -e SAGEMAKER_BIND_TO_PORT="$port" -e SERVER_HOST=127.0.0.1 \
  -e HF_MODEL_ID=org/smollm2 -e HF_ENDPOINT="$hub_url" "$IMAGE" serve) || fail "podman run (Hub id) failed"
deadline=$(( $(date +%s) + READY_TIMEOUT ))
until [ "$(curl -s -o /dev/null -m 2 -w '%{http_code}' "$url/ping" || true)" = 200 ]; do
  [ "$(podman inspect "$cid" --format '{{.State.Running}}' 2>/dev/null || echo false)" = true ] \
    || fail "the container serving a Hub id exited before /ping answered 200"
  [ "$(date +%s)" -lt "$deadline" ] || fail "/ping not 200 after ${READY_TIMEOUT} s (Hub id)"
  sleep 0.5
done
step "Hub id: container start -> download -> /ping 200: $(since "$t0") s"
logs=$(podman logs "$cid" 2>&1)  # (not piped into grep -q: pipefail would count podman's SIGPIPE as a failure)
grep -q "download: downloaded org/smollm2" <<<"$logs" || fail "no download line in the log"
answer=$(curl -s -m 60 "$url/invocations" -H 'Content-Type: application/json' \
  -d '{"inputs": "The capital of France is", "parameters": {"max_new_tokens": 8}}')
grep -q generated_text <<<"$answer" || fail "the Hub-id server did not answer: $answer"
models=$(curl -s -m 10 "$url/v1/models")
grep -q '"org/smollm2"' <<<"$models" || fail "/v1/models does not name org/smollm2: $models"
podman stop -t 30 "$cid" >/dev/null && podman rm "$cid" >/dev/null
cid=""
step "passed"
