#!/usr/bin/env bash
# Build dist/llm-gateway_<version>_<arch>.deb from this repository: the app in its own
# virtual environment under /usr/lib/llm-gateway (on the system python3, pinned deps from
# constraints.txt), the systemd units, tmpfiles.d, sysusers.d, the polkit rule and a default
# /etc/llm-gateway/gateway.toml (a conffile). Needs: python3-venv, dpkg-dev; network for pip.
#   packaging/build-deb.sh [OUTDIR]      prints the .deb's path
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=$(realpath -m "${1:-dist}")
PREFIX=/usr/lib/llm-gateway
PY=/usr/bin/python3
log() { echo "build-deb: $*" >&2; }
[[ -x $PY ]] || { log "needs $PY (the package runs on the system python)"; exit 1; }
VERSION=$($PY -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
ARCH=$(dpkg --print-architecture)
STAGE=$(mktemp -d /var/tmp/llm-gateway-deb.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT

log "venv at $PREFIX/venv"
$PY -m venv "$STAGE$PREFIX/venv"
VPIP=("$STAGE$PREFIX/venv/bin/python" -m pip -q --disable-pip-version-check)
"${VPIP[@]}" install -c constraints.txt setuptools >&2
"${VPIP[@]}" install --no-build-isolation -c constraints.txt "$REPO" >&2
# the venv was built in the staging tree: point its scripts at the installed path
for f in "$STAGE$PREFIX"/venv/bin/*; do
    [[ -f $f && ! -L $f ]] && sed -i "1s|^#!$STAGE$PREFIX/|#!$PREFIX/|" "$f"
done
grep -rl "$STAGE" "$STAGE$PREFIX/venv/bin" | xargs -r sed -i "s|$STAGE$PREFIX|$PREFIX|g"

install -Dm644 -t "$STAGE/lib/systemd/system" units/llm-gateway.socket units/llm-gateway-admin.socket units/llm-gateway.service \
    units/llm-engine@.service units/llm-engines.slice
install -Dm644 tmpfiles.d/llm-gateway.conf "$STAGE/usr/lib/tmpfiles.d/llm-gateway.conf"
install -Dm644 packaging/sysusers.d/llm-gateway.conf "$STAGE/usr/lib/sysusers.d/llm-gateway.conf"
install -Dm644 packaging/polkit/50-llm-gateway.rules \
    "$STAGE/usr/share/polkit-1/rules.d/50-llm-gateway.rules"
install -Dm644 packaging/gateway.toml "$STAGE/etc/llm-gateway/gateway.toml"
install -Dm644 README.md "$STAGE/usr/share/doc/llm-gateway/README.md"
# the pages README.md links to, where its links (docs/NAME.md) lead
for page in docs/*.md; do
    install -Dm644 "$page" "$STAGE/usr/share/doc/llm-gateway/$page"
done
install -Dm644 packaging/grafana/llm-gateway.json \
    "$STAGE/usr/share/doc/llm-gateway/grafana/llm-gateway.json"
# several gateways behind HAProxy (docs/fleet.md): an example, not a configuration in force
install -Dm644 packaging/haproxy/haproxy.cfg \
    "$STAGE/usr/share/doc/llm-gateway/examples/haproxy.cfg"
mkdir -p "$STAGE/usr/bin"
ln -s "$PREFIX/venv/bin/llm-gateway" "$STAGE/usr/bin/llm-gateway"

mkdir -p "$STAGE/DEBIAN"
SIZE=$(du -sk --exclude=DEBIAN "$STAGE" | cut -f1)
cat > "$STAGE/DEBIAN/control" <<CONTROL
Package: llm-gateway
Version: $VERSION
Architecture: $ARCH
Maintainer: llm-gateway developers <llm-gateway@localhost>
Installed-Size: $SIZE
Depends: python3 (>= 3.11), systemd (>= 252), dbus, polkitd
Recommends: llama.cpp-tools | nvidia-driver
Section: net
Priority: optional
Description: one OpenAI-compatible endpoint for local LLM engines, systemd-native
 llm-gateway routes OpenAI API requests to local inference engines (llama.cpp's
 llama-server, whisper.cpp's whisper-server), each run as its own systemd unit on a
 private unix socket, started on demand within a GPU memory budget, with call records.
CONTROL
echo /etc/llm-gateway/gateway.toml > "$STAGE/DEBIAN/conffiles"
install -m755 packaging/debian/postinst packaging/debian/prerm packaging/debian/postrm "$STAGE/DEBIAN/"
mkdir -p "$OUT"
DEB=$OUT/llm-gateway_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zgzip --build "$STAGE" "$DEB" >&2
log "built $DEB ($(du -h "$DEB" | cut -f1))"
echo "$DEB"
