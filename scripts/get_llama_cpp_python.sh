#!/usr/bin/env bash
# Build (once) and cache a Python venv holding llama-cpp-python[server], built from its
# PyPI sdist for CPU: a second real engine for the tests (llama_cpp.server, the OpenAI-
# compatible server on FastAPI/uvicorn). Only the ggml and llama libraries are built (no
# llava/mtmd, common, tools, tests, examples; no OpenMP); the server's Python
# dependencies are pinned in scripts/llama-cpp-python.constraints.
#
#   PY=$(scripts/get_llama_cpp_python.sh)        # the venv's python on stdout, logs on stderr
#   scripts/get_llama_cpp_python.sh --cached-only # the path if built, else exit 3
#   "$PY" -m llama_cpp.server --model M.gguf --host 127.0.0.1 --port 8000
#
# The build is native (-march=native) and the venv runs the machine's python3, so the
# cache is keyed by version, compiler, CPU flags, interpreter and the constraints. The
# .pyc files are compiled at build time: the venv is used read-only (bind-mounted so in
# the test container, ProtectSystem=strict in a unit). A cached call runs nothing but
# the key computation.
# Env: LLAMA_CPP_PYTHON_VERSION, LLAMA_CPP_PYTHON_CACHE, JOBS.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
# sha256 of llama_cpp_python-0.3.36.tar.gz as served by PyPI; checked only for the pinned version.
PINNED_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
JOBS=${JOBS:-$(nproc)}
CACHE=${LLAMA_CPP_PYTHON_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/llama-cpp-python}
CONSTRAINTS=$(cd "$(dirname "$0")" && pwd)/llama-cpp-python.constraints
log() { echo "get_llama_cpp_python: $*" >&2; }

for tool in cmake c++ flock python3; do
    command -v "$tool" >/dev/null || { log "missing '$tool' (apt-get install -y cmake g++ util-linux python3-venv)"; exit 1; }
done
PYTHON=$(python3 -c 'import os, sys; print(os.path.realpath(sys.executable))')
KEY=$(printf '%s|%s|%s|%s|%s' "$VERSION" "$(c++ --version | head -n1)" \
      "$(grep -m1 '^flags' /proc/cpuinfo)" "$PYTHON $("$PYTHON" -V 2>&1)" \
      "$(sha256sum < "$CONSTRAINTS")" | sha256sum | cut -c1-16)
DEST=$CACHE/$VERSION-$KEY
PY=$DEST/bin/python
if [[ -x $PY ]]; then echo "$PY"; exit 0; fi
if [[ ${1:-} == --cached-only ]]; then log "not built yet: run $0"; exit 3; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9     # parallel first calls build once
if [[ -x $PY ]]; then echo "$PY"; exit 0; fi

WORK=$(mktemp -d "$CACHE/.build.XXXXXX")
trap 'rm -rf "$WORK" "$DEST.tmp"' EXIT
t0=$SECONDS
log "downloading llama-cpp-python==$VERSION (sdist)"
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -d "$WORK/dl" >&2
SDIST=$(ls "$WORK"/dl/llama_cpp_python-*.tar.gz)
if [[ $VERSION == 0.3.36 ]]; then
    echo "$PINNED_SHA256  $SDIST" | sha256sum -c --quiet - >&2 || { log "sdist sha256 mismatch"; exit 1; }
fi

rm -rf "$DEST.tmp"
"$PYTHON" -m venv "$DEST.tmp" ||
    { log "'python3 -m venv' failed: apt-get install python3-venv"; exit 1; }
VPIP=("$DEST.tmp/bin/python" -m pip --disable-pip-version-check --no-cache-dir)
"${VPIP[@]}" install -q -c "$CONSTRAINTS" scikit-build-core >&2
# Everything off but the llama library (the bindings load libllama and the ggml libraries;
# llava/mtmd is imported only for multimodal chat formats). llama.cpp's common library is
# not used by the bindings, but the wrapper forces LLAMA_BUILD_COMMON on (a cache FORCE):
# a normal variable set just after llama.cpp's project() shadows it there. No OpenMP: no
# libgomp, no spinning worker pool. Ninja when present (scikit-build-core picks it).
echo 'set(LLAMA_BUILD_COMMON OFF)' > "$WORK/no-common.cmake"
export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$WORK/no-common.cmake
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF -DGGML_NATIVE=ON
  -DGGML_BLAS=OFF -DGGML_CCACHE=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
log "building llama-cpp-python $VERSION (-j$JOBS; a few minutes)"
"${VPIP[@]}" install -q --no-build-isolation --no-binary llama-cpp-python -c "$CONSTRAINTS" \
    --config-settings=cmake.verbose=false \
    "$SDIST[server]" >&2
"${VPIP[@]}" uninstall -q -y scikit-build-core pathspec >&2    # build-time only
# The venv moves to $DEST: its scripts' shebangs and the .pyc's source paths name $DEST.
for f in "$DEST.tmp"/bin/*; do
    if [[ -f $f && ! -L $f ]]; then sed -i "1s|^#!$DEST.tmp/|#!$DEST/|" "$f"; fi
done
sed -i "s|$DEST.tmp|$DEST|g" "$DEST.tmp/pyvenv.cfg"
"$DEST.tmp/bin/python" -m compileall -q -j0 -s "$DEST.tmp" -p "$DEST" "$DEST.tmp/lib" >&2
got=$("$DEST.tmp/bin/python" -c 'import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)') ||
    { log "the built package does not import"; exit 1; }
[[ $got == "$VERSION" ]] || { log "built version '$got', expected '$VERSION'"; exit 1; }
rm -rf "$DEST"; mv "$DEST.tmp" "$DEST"     # publish atomically
log "built in $((SECONDS - t0))s: $PY ($(du -sh "$DEST" | cut -f1))"
echo "$PY"
