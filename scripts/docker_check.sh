#!/usr/bin/env bash
# Build the specserve image and prove it serves: start the container, wait for /health, send the
# README's requests (completions and chat, plain and streaming), check the answers, the non-root
# user and what the image holds, stop it, and print image size and start-to-healthy seconds.
#
#   scripts/docker_check.sh          (or: make docker-check)
#
# Environment (all optional):
#   IMAGE        tag to build (default specserve:check)
#   BASE_IMAGE   base for both stages; default python:3.11-slim when it can be pulled, else a
#                Debian bookworm base made here from Debian packages (debootstrap + docker import,
#                tagged $LOCAL_BASE and reused by later runs)
#   LOCAL_BASE   tag of that local base (default specserve-base:bookworm)
#   PORT         host port on 127.0.0.1 (default: a free one)
#   TORCH_WHEEL  a torch wheel to put in the build context (default: found with `pip download`
#                when PyTorch's CPU index is unreachable)
#   CA_BUNDLE    CA bundle for pip inside the build (default: the host's, e.g. for a TLS-inspecting
#                proxy); used in the build stage only
#   DOCKER_BUILDKIT=0  build with the legacy builder (default: BuildKit where a client offers it)
# Needs root where Docker is not yet installed or running (it installs docker.io and starts
# dockerd, leaving it running). Exits non-zero on the first failed check.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

IMAGE=${IMAGE:-specserve:check}
LOCAL_BASE=${LOCAL_BASE:-specserve-base:bookworm}
DEFAULT_BASE=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
CPU_INDEX=https://download.pytorch.org/whl/cpu
MODEL=smollm2-135m-instruct
CONTAINER=specserve-check-$$
WORK=$(mktemp -d /tmp/specserve-docker-check.XXXXXX)

log() { echo "[docker-check] $*"; }
fail() { echo "[docker-check] FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

cleanup() {
    local code=$?
    if [ -n "${DOCKER:-}" ] && "$DOCKER" container inspect "$CONTAINER" >/dev/null 2>&1; then
        if [ $code -ne 0 ]; then
            log "container log (last 40 lines):"
            "$DOCKER" logs --tail 40 "$CONTAINER" 2>&1 | sed 's/^/    /' || true
        fi
        "$DOCKER" rm -f "$CONTAINER" >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
    exit $code
}
trap cleanup EXIT

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@";
    else fail "needs root for: $*"; fi
}

apt_install() {
    log "apt-get install $*"
    as_root apt-get update -qq >"$WORK/apt.log" 2>&1 || true
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        >>"$WORK/apt.log" 2>&1 || { tail -20 "$WORK/apt.log"; fail "apt-get install $*"; }
}

# ------------------------------------------------------------------ the Docker engine and client
ensure_engine() {
    if docker info >/dev/null 2>&1; then return; fi
    if ! command -v dockerd >/dev/null; then apt_install docker.io; fi
    if ! docker info >/dev/null 2>&1; then
        log "starting dockerd (log: /tmp/dockerd.log)"
        as_root sh -c 'nohup dockerd >/tmp/dockerd.log 2>&1 &'
        for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
        docker info >/dev/null 2>&1 || { tail -20 /tmp/dockerd.log; fail "dockerd did not start"; }
    fi
}

# A client that can build with BuildKit: one with the buildx plugin, or a pre-23 client (its
# BuildKit is built in; Debian's docker.io 20.10 is one). Otherwise the legacy builder, which this
# Dockerfile also supports.
pick_client() {
    local candidate version
    if [ "${DOCKER_BUILDKIT:-}" = 0 ]; then  # asked for the legacy builder
        DOCKER=$(command -v docker) BUILDKIT=0; return
    fi
    for candidate in $(which -a docker | awk '!seen[$0]++'); do
        if "$candidate" buildx version >/dev/null 2>&1; then
            DOCKER=$candidate BUILDKIT=1; return
        fi
    done
    for candidate in $(which -a docker | awk '!seen[$0]++'); do
        version=$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null || true)
        if [ -n "$version" ] && [ "${version%%.*}" -lt 23 ] 2>/dev/null; then
            DOCKER=$candidate BUILDKIT=1; return
        fi
    done
    DOCKER=$(command -v docker) BUILDKIT=0
}

# ------------------------------------------------------------------ the base image
host_debian_mirror() {
    # The first non-security Debian URI in the host's apt sources (deb822 or one-line form).
    local uri
    uri=$(grep -h -E '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
              2>/dev/null | grep -v -- '-security' \
          | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' \
          | awk '{print $1; exit}')
    echo "${uri:-http://deb.debian.org/debian}"
}

make_local_base() {
    if "$DOCKER" image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
        log "reusing local base image $LOCAL_BASE"; return
    fi
    command -v debootstrap >/dev/null || apt_install debootstrap
    local mirror rootfs=$WORK/rootfs start
    mirror=$(host_debian_mirror)
    start=$(now)
    log "making $LOCAL_BASE from Debian packages (debootstrap bookworm from $mirror)"
    as_root debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log"; fail "debootstrap"; }
    as_root sh -c "rm -rf '$rootfs'/var/cache/apt/archives/*.deb '$rootfs'/var/lib/apt/lists/*"
    # An imported root filesystem has no image config: give it what a base image declares.
    as_root tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$LOCAL_BASE" >/dev/null
    as_root rm -rf "$rootfs"
    log "made $LOCAL_BASE in $(since "$start") s"
}

pick_base() {
    if [ -n "${BASE_IMAGE:-}" ]; then
        "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1 || "$DOCKER" pull "$BASE_IMAGE" \
            || fail "cannot get BASE_IMAGE=$BASE_IMAGE"
        return
    fi
    if "$DOCKER" image inspect "$DEFAULT_BASE" >/dev/null 2>&1 \
        || timeout 120 "$DOCKER" pull "$DEFAULT_BASE" >"$WORK/pull.log" 2>&1; then
        BASE_IMAGE=$DEFAULT_BASE
    else
        log "cannot pull $DEFAULT_BASE ($(tail -1 "$WORK/pull.log")); using a local Debian base"
        make_local_base
        BASE_IMAGE=$LOCAL_BASE
    fi
}

# ------------------------------------------------------------------ the build context
CA_BUNDLE=${CA_BUNDLE:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}

make_context() {
    CTX=$WORK/context
    mkdir -p "$CTX/docker-extra"
    # The working tree's files that git would track (a clean clone: exactly the clone); the
    # Dockerfile's .dockerignore still applies on top.
    if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git ls-files -z -co --exclude-standard \
            | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$CTX"
    else
        tar --exclude=./.git --exclude='./.venv*' -cf - . | tar -xf - -C "$CTX"
    fi
    BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
    if [ -f "$CA_BUNDLE" ]; then
        cp "$CA_BUNDLE" "$CTX/docker-extra/ca-certificates.crt"
        log "pip in the build stage trusts $CA_BUNDLE"
    fi
    # torch: PyTorch's CPU index when reachable, else a CPU wheel in the context.
    if [ -n "${TORCH_WHEEL:-}" ]; then
        cp "$TORCH_WHEEL" "$CTX/docker-extra/"
        BUILD_ARGS+=(--build-arg TORCH_INDEX_URL=)
    elif curl -sSf -m 20 ${CA_BUNDLE:+--cacert "$CA_BUNDLE"} -o /dev/null "$CPU_INDEX/torch/" 2>/dev/null
    then
        log "torch from $CPU_INDEX"
    else
        local pyver
        pyver=$("$DOCKER" run --rm --entrypoint python3 "$BASE_IMAGE" -c \
            'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
        log "$CPU_INDEX unreachable: torch==$TORCH_VERSION wheel for Python $pyver via pip download"
        python3 -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
            -d "$CTX/docker-extra" "torch==$TORCH_VERSION" >"$WORK/pip-download.log" 2>&1 \
            || { tail -5 "$WORK/pip-download.log"; fail "no torch wheel (set TORCH_WHEEL)"; }
        BUILD_ARGS+=(--build-arg TORCH_INDEX_URL=)
    fi
    local wheel
    for wheel in "$CTX"/docker-extra/torch-*.whl; do
        [ -e "$wheel" ] || continue
        case $(basename "$wheel") in
            *+cpu*) log "torch wheel in the context: $(basename "$wheel")" ;;
            *) fail "$(basename "$wheel") is not a CPU build (the CUDA one is gigabytes); set TORCH_WHEEL" ;;
        esac
    done
    # Proxies and package indexes of the host, when it has them (only http(s) indexes: a
    # file:// index on the host means nothing inside the build).
    local name value
    for name in HTTP_PROXY HTTPS_PROXY NO_PROXY ALL_PROXY http_proxy https_proxy no_proxy all_proxy; do
        [ -n "${!name:-}" ] && BUILD_ARGS+=(--build-arg "$name=${!name}") && log "passing $name"
    done
    for name in index-url extra-index-url trusted-host; do
        local var=PIP_$(echo "$name" | tr 'a-z-' 'A-Z_')
        value=${!var:-$(python3 -m pip config get "global.$name" 2>/dev/null || true)}
        if [ "$name" != trusted-host ]; then
            value=$(tr ' ' '\n' <<<"$value" | grep -E '^https?://' | tr '\n' ' ' | sed 's/ $//' || true)
        fi
        [ -n "$value" ] && BUILD_ARGS+=(--build-arg "$var=$value") && log "passing $var=$value"
    done
    return 0
}

# ------------------------------------------------------------------ checks against the container
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

post() {  # path, json body -> response body on stdout
    curl -sS -f -m 120 "http://127.0.0.1:$PORT$1" -H 'Content-Type: application/json' -d "$2"
}

# Prints the generated text of a response (JSON or an SSE stream); checks the stream's shape.
answer_text() {  # kind (completion|chat), stream (0|1)
    python3 -c '
import json, sys
kind, stream = sys.argv[1], sys.argv[2] == "1"
raw = sys.stdin.read()
if not stream:
    choice = json.loads(raw)["choices"][0]
    print(choice["text"] if kind == "completion" else choice["message"]["content"], end="")
    sys.exit(0)
events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
assert events and events[-1] == "[DONE]", "stream does not end with data: [DONE]"
text = ""
for event in events[:-1]:
    for choice in json.loads(event)["choices"]:
        if kind == "completion":
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
print(text, end="")
' "$1" "$2"
}

check_requests() {
    local completion chat out text
    completion='{"model": "'$MODEL'", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
    chat='{"model": "'$MODEL'", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 32, "temperature": 0}'
    out=$(post /v1/completions "$completion") || fail "/v1/completions"
    text=$(answer_text completion 0 <<<"$out")
    log "/v1/completions -> $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$text")"
    [[ $text == *Paris* ]] || fail "completion does not name Paris: $out"
    COMPLETION_TEXT=$text

    out=$(post /v1/completions "${completion%\}}, \"stream\": true}") || fail "streamed /v1/completions"
    text=$(answer_text completion 1 <<<"$out") || fail "bad completion stream: $out"
    log "/v1/completions stream -> $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$text")"
    [ "$text" = "$COMPLETION_TEXT" ] || fail "streamed completion differs from the plain one"

    out=$(post /v1/chat/completions "$chat") || fail "/v1/chat/completions"
    text=$(answer_text chat 0 <<<"$out")
    log "/v1/chat/completions -> $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$text")"
    [[ $text == *4* ]] || fail "chat answer to 2+2 has no 4: $out"
    CHAT_TEXT=$text

    out=$(post /v1/chat/completions "${chat%\}}, \"stream\": true}") || fail "streamed chat"
    text=$(answer_text chat 1 <<<"$out") || fail "bad chat stream: $out"
    log "/v1/chat/completions stream -> $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$text")"
    [ "$text" = "$CHAT_TEXT" ] || fail "streamed chat answer differs from the plain one"
}

check_image_contents() {
    # Nothing from the build stage but the venv and the model: no sources, build inputs (torch
    # wheel, CA bundle) or pip caches; the converted model is baked in.
    local found
    found=$("$DOCKER" run --rm --entrypoint sh "$IMAGE" -c '
        ls -d /src /tmp/extra 2>/dev/null
        find / -xdev \( -name "torch-*.whl" -o -path "*/docker-extra*" -o -path "*/.cache/pip" \) \
            -print 2>/dev/null
        test -f "$XDG_CACHE_HOME/specserve/models/smollm2-135m-instruct/.specserve-import.json" \
            || echo "no converted model under $XDG_CACHE_HOME"
        test "$(id -u)" = 1000 || echo "runs as uid $(id -u)"
        true')
    [ -z "$found" ] || fail "image holds what it should not: $found"
    log "image: no sources, torch wheel, CA copy or pip cache; converted model baked in; uid 1000"
}

# ------------------------------------------------------------------ main
ensure_engine
pick_client
log "docker client $DOCKER ($("$DOCKER" version --format '{{.Client.Version}}')), engine" \
    "$("$DOCKER" version --format '{{.Server.Version}}'), BuildKit=$BUILDKIT"
pick_base
log "base image $BASE_IMAGE"
make_context

start=$(now)
log "building $IMAGE (log: $WORK/build.log while it runs)"
PROGRESS=()
[ "$BUILDKIT" = 1 ] && PROGRESS=(--progress=plain)
if ! DOCKER_BUILDKIT=$BUILDKIT "$DOCKER" build "${PROGRESS[@]}" "${BUILD_ARGS[@]}" -t "$IMAGE" \
        "$CTX" >"$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log"
    fail "docker build"
fi
BUILD_SECONDS=$(since "$start")
SIZE_BYTES=$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE")
SIZE=$(python3 -c "import sys; print(f'{int(sys.argv[1]) / 1e9:.2f} GB')" "$SIZE_BYTES")
log "built $IMAGE in $BUILD_SECONDS s: $SIZE"
check_image_contents

PORT=${PORT:-$(free_port)}
start=$(now)
"$DOCKER" run -d --name "$CONTAINER" -p "127.0.0.1:$PORT:8000" "$IMAGE" >/dev/null
HEALTHY=""
for _ in $(seq 1200); do
    if curl -sf -m 2 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then HEALTHY=$(since "$start"); break; fi
    [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$CONTAINER")" = true ] || fail "container exited"
    sleep 0.25
done
[ -n "$HEALTHY" ] || fail "no /health answer within 300 s"
log "container answered /health $HEALTHY s after docker run (127.0.0.1:$PORT)"
if "$DOCKER" logs "$CONTAINER" 2>&1 | grep -q "Converting"; then fail "the container converted the model"; fi

DOCKER_HEALTHY=""
for _ in $(seq 120); do
    status=$("$DOCKER" inspect -f '{{.State.Health.Status}}' "$CONTAINER")
    if [ "$status" = healthy ]; then DOCKER_HEALTHY=$(since "$start"); break; fi
    [ "$status" = unhealthy ] && fail "HEALTHCHECK reports unhealthy"
    sleep 0.5
done
[ -n "$DOCKER_HEALTHY" ] || fail "HEALTHCHECK never reported healthy"
log "docker reports the container healthy (HEALTHCHECK) $DOCKER_HEALTHY s after docker run"

check_requests

uid=$("$DOCKER" exec "$CONTAINER" id -u)
pid1=$("$DOCKER" exec "$CONTAINER" sh -c 'tr "\0" " " </proc/1/cmdline; grep "^Uid:" /proc/1/status')
log "exec id -u -> $uid; PID 1: $pid1"
[ "$uid" = 1000 ] || fail "the container runs as uid $uid"
[[ $pid1 == *specserve\ serve* ]] || fail "PID 1 is not the server: $pid1"
[[ $pid1 =~ Uid:[[:space:]]+1000[[:space:]] ]] || fail "PID 1 does not run as uid 1000: $pid1"

start=$(now)
"$DOCKER" stop -t 30 "$CONTAINER" >/dev/null
STOP_SECONDS=$(since "$start")
code=$("$DOCKER" inspect -f '{{.State.ExitCode}}' "$CONTAINER")
log "docker stop: exit $code after $STOP_SECONDS s"
[ "$code" = 0 ] || fail "the server did not exit cleanly on SIGTERM (exit $code)"

echo
echo "docker-check PASSED: image $IMAGE ($SIZE, base $BASE_IMAGE, built in $BUILD_SECONDS s);" \
     "start to /health $HEALTHY s, to HEALTHCHECK healthy $DOCKER_HEALTHY s; stop $STOP_SECONDS s, exit 0"
