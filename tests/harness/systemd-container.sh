#!/bin/bash
# systemd-container.sh - a throwaway systemd *system* manager (with a system
# D-Bus and journald) for tests, booted with systemd-nspawn on an overlayfs view
# of the host root (lower=/ read-only, upper=scratch dir), so nothing the
# container writes reaches the host. It never boots systemd on the host's own
# root: that would wipe the host's /tmp and touch kernel settings.
#
#   systemd-container.sh deps                install systemd-container (= systemd's version)
#   systemd-container.sh start  [NAME]       boot, wait for running/degraded
#   systemd-container.sh exec   NAME CMD...  run CMD inside (nsenter, all namespaces)
#   systemd-container.sh run    NAME [SYSTEMD-RUN-OPTS] CMD...
#                                            run CMD inside as a transient service
#                                            (systemd-run --pipe --wait: real cgroup)
#   systemd-container.sh reboot NAME         reboot in place (upper dir kept)
#   systemd-container.sh stop   [NAME]       power off, clean cgroups, delete state
#   systemd-container.sh stop-all            stop every container under LAB_STATE
#   systemd-container.sh status [NAME] | leader NAME
# Env: LAB_STATE (state root, default /var/tmp/llm-gateway-containers), LAB_KEEP=1
# (stop keeps state), LAB_REUSE=1 (start reuses the upper dir = cold reboot),
# LAB_BIND="DIR..." (bind host dirs read-write at the same path: use it for
# the code under test, files changed on the host in the overlay's lower layer
# can show stale inside), LAB_BIND_RO (the same, read-only), LAB_LOWER (lower layer, default /; e.g. a
# debootstrapped rootfs), LAB_MASK (units to mask), LAB_PRIVATE_NETWORK=0
# (share the host network namespace), LAB_NSPAWN_ARGS, LAB_BOOT_TIMEOUT,
# LAB_MEMORY_CGROUP=0 (on a hybrid cgroup host, leave the container's v1 memory
# hierarchy read-only as nspawn mounts it: units then get no MemoryCurrent).
# Needs: root, systemd-container (same version as installed systemd), util-linux.
set -euo pipefail

SELF=$(readlink -f "$0")
STATE_ROOT=${LAB_STATE:-/var/tmp/llm-gateway-containers}
[[ $STATE_ROOT == /?* && $STATE_ROOT != *..* ]] || { echo "systemd-container: LAB_STATE must be an absolute path" >&2; exit 2; }
BOOT_TIMEOUT=${LAB_BOOT_TIMEOUT:-60}
STOP_TIMEOUT=${LAB_STOP_TIMEOUT:-30}
# Units that make no sense in a test container (mask = symlink to /dev/null).
MASK_UNITS=${LAB_MASK-"getty@tty1.service console-getty.service postgresql.service haproxy.service
 e2scrub_reap.service systemd-timesyncd.service apt-daily.timer
 apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer fstrim.timer
 man-db.timer"}

die() { echo "systemd-container: $*" >&2; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }
valid_name() { [[ $1 =~ ^[a-z][a-z0-9-]{0,30}$ ]] || die "bad name '$1'"; }

sdir() { echo "$STATE_ROOT/$1"; }
# supervisor = the bash running "_inner" in the private mount namespace; it
# re-runs nspawn when the container reboots (nspawn --keep-unit exits 133).
sup_pid() { local f; f="$(sdir "$1")/supervisor.pid"; [[ -s $f ]] && cat "$f"; }
alive() { local p; p=$(sup_pid "$1") || return 1; [[ -n $p ]] && kill -0 "$p" 2>/dev/null &&
          grep -q _inner "/proc/$p/cmdline" 2>/dev/null; }
child_named() {  # child_named PARENT COMM
  local p; for p in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    [[ $(cat "/proc/$p/comm" 2>/dev/null) == "$2" ]] && { echo "$p"; return 0; }
  done; return 1
}
nspawn_pid() { local s; s=$(sup_pid "$1") && child_named "$s" systemd-nspawn; }
leader() { local n; n=$(nspawn_pid "$1") && child_named "$n" systemd; }  # container PID 1

unified_host() { [[ $(stat -fc %T /sys/fs/cgroup) == cgroup2fs ]]; }

cg_dirs() {  # cgroup dirs this container lives in (hybrid v1+v2 or pure v2)
  local n=lab-$1
  if unified_host; then
    echo "/sys/fs/cgroup/$n"
  else
    echo "/sys/fs/cgroup/systemd/$n"
    [[ -d /sys/fs/cgroup/unified ]] && echo "/sys/fs/cgroup/unified/$n"
    memory_cg_dir "$1"
  fi
  return 0
}

# The container's own v1 memory cgroup, below the one we were started in (which
# need not be the root: we may ourselves be confined): nspawn makes the cgroup
# it starts in the container's memory root, so without one per container, two
# containers' system.slice would be one and the same directory. Written down at
# start, so that stop and cleanup find it from any cgroup.
memory_cg_dir() {
  local f own; f="$(sdir "$1")/memory-cgroup"
  [[ -d /sys/fs/cgroup/memory ]] || return 0
  if [[ -s $f ]]; then cat "$f"; return 0; fi
  own=$(sed -n 's/^[0-9]*:memory://p' /proc/self/cgroup)
  echo "/sys/fs/cgroup/memory${own%/}/lab-$1"
}

prepare_upper() {  # pre-seed config into the (fresh) upper layer
  local name=$1 u; u="$(sdir "$name")/upper"
  mkdir -p "$u/etc/systemd/system"
  systemd-id128 new > "$u/etc/machine-id"  # own machine-id => own journal dir
  echo "$name" > "$u/etc/hostname"
  ln -sfn /lib/systemd/system/multi-user.target "$u/etc/systemd/system/default.target"
  for unit in $MASK_UNITS; do ln -sfn /dev/null "$u/etc/systemd/system/$unit"; done
}

# Runs inside a private mount namespace (unshare -m); the overlay mount and
# the tmpfs on /run die with this namespace, i.e. when nspawn exits.
inner() {
  local name=$1 d; d=$(sdir "$name")
  mount -t tmpfs -o mode=755,size=16m "lab-$name-run" /run  # nspawn's /run/systemd/nspawn/* stays off the host disk
  mount -t overlay "lab-$name" -o "lowerdir=${LAB_LOWER:-/},upperdir=$d/upper,workdir=$d/work" "$d/merged"
  [[ $(findmnt -n -o FSTYPE --mountpoint "$d/merged") == overlay ]] || die "overlay not mounted, refusing to boot"
  local rc b binds=()
  for b in ${LAB_BIND:-}; do binds+=("--bind=$(readlink -f "$b")"); done
  for b in ${LAB_BIND_RO:-}; do binds+=("--bind-ro=$(readlink -f "$b")"); done
  [[ ${LAB_PRIVATE_NETWORK:-1} == 0 ]] || binds+=(--private-network)  # own netns: only lo
  local boot=(--boot)
  if [[ ${LAB_MEMORY_CGROUP:-1} != 0 ]] && ! unified_host; then
    # On a hybrid host nspawn mounts the v1 memory hierarchy read-only, so systemd could
    # make no memory cgroups: no MemoryCurrent, MemoryMax= not enforced. Its root is the
    # container's own cgroup (cgroup namespace, see memory_cg_dir): making it writable
    # hands the container nothing of the host's. PID 1 does that, then becomes systemd,
    # which finds the controller usable from the start ("bind": a plain remount would
    # change the cgroup superblock, shared with the host; the tmpfs above stays read-only).
    # Not a re-exec of a booted systemd: the services it started (a gateway enabled at
    # boot) would have it leave the bus under their calls.
    boot=(--kill-signal=SIGRTMIN+3 /bin/sh -c 'mountpoint -q /sys/fs/cgroup/memory &&
            mount -o remount,bind,rw /sys/fs/cgroup/memory; exec /lib/systemd/systemd')
  fi
  while :; do
    rc=0
    # shellcheck disable=SC2086
    systemd-nspawn --directory="$d/merged" --machine="$name" \
       --register=no --keep-unit --tmpfs=/tmp \
       --link-journal=no --resolv-conf=off --timezone=off --console=read-only \
       "${binds[@]}" ${LAB_NSPAWN_ARGS:-} "${boot[@]}" || rc=$?
    [[ $rc -eq 133 && ! -e $d/stopping ]] || exit "$rc"
    echo "systemd-container: container asked for reboot, re-running nspawn"
  done
}

wait_running() {  # until systemctl is-system-running --wait says running/degraded
  local name=$1 t0=$2 st l
  while :; do
    if l=$(leader "$name"); then
      st=$(timeout 30 nsenter -t "$l" -a systemctl is-system-running --wait 2>/dev/null || true)
      case $st in running|degraded) echo "$st"; return 0;; esac
    fi
    alive "$name" || { tail -n 30 "$(sdir "$name")/console.log" >&2; die "nspawn exited during boot"; }
    [[ $(elapsed "$t0" | cut -d. -f1) -lt $BOOT_TIMEOUT ]] || die "boot timeout (${BOOT_TIMEOUT}s)"
    sleep 0.1
  done
}

cmd_start() {
  local name=${1:-lab} d t0 st cg; valid_name "$name"; d=$(sdir "$name"); t0=$(now)
  [[ $EUID -eq 0 ]] || die "must be root (nspawn, overlayfs and cgroups need it)"
  command -v systemd-nspawn >/dev/null || die "systemd-nspawn missing: run '$SELF deps' (installs systemd-container pinned to systemd's version)"
  [[ -x /lib/systemd/systemd ]] || die "no /lib/systemd/systemd on this machine: apt-get install systemd"
  grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || true
  grep -qw overlay /proc/filesystems || die "the kernel has no overlayfs"
  alive "$name" && die "$name already running"
  cmd_cleanup "$name" keep  # stale cgroups/pids from a crashed run
  if [[ ${LAB_REUSE:-0} == 1 && -d $d/upper ]]; then
    rm -rf "$d/work" "$d/stopping" "$d/supervisor.pid"
  else
    rm -rf "$d"; mkdir -p "$d/upper"; prepare_upper "$name"
  fi
  mkdir -p "$d/work" "$d/merged"
  memory_cg_dir "$name" > "$d/memory-cgroup.new" && mv "$d/memory-cgroup.new" "$d/memory-cgroup"
  for cg in $(cg_dirs "$name"); do mkdir -p "$cg"; done
  # Detach (own session, no stdin) a supervisor that moves itself into our
  # cgroups, records its PID, enters a private mount namespace and runs nspawn.
  setsid bash -c '
      for cg in '"$(cg_dirs "$name" | tr '\n' ' ')"'; do echo $$ > "$cg/cgroup.procs"; done
      echo $$ > "'"$d"'/supervisor.pid"
      exec unshare --mount --propagation private -- "'"$SELF"'" _inner "'"$name"'"' \
      </dev/null >"$d/console.log" 2>&1 &
  for _ in $(seq 50); do [[ -s $d/supervisor.pid ]] && break; sleep 0.02; done
  st=$(wait_running "$name" "$t0") || { cmd_stop "$name"; exit 1; }
  delegate_memory "$name"
  # engines run as their own user (llm-engine): let it pass /root to the engine builds
  # and models bound under it (~/.cache/llm-gateway), as it would reach an installed
  # binary; the container's / is an overlay, so the host's /root is untouched
  cmd_exec "$name" chmod o+x /root
  echo "systemd-container: $name is $st after $(elapsed "$t0")s (supervisor $(sup_pid "$name"), leader $(leader "$name"))"
  if [[ $st == degraded ]]; then cmd_exec "$name" systemctl --failed --no-legend >&2 || true; fi
  return 0
}

# Says whether the container's systemd has the memory controller (see inner): a probe
# unit asks systemd for its own MemoryCurrent.
delegate_memory() {
  local name=$1 line
  unified_host && return 0
  if [[ ${LAB_MEMORY_CGROUP:-1} == 0 ]]; then
    echo "systemd-container: $name: memory controller not delegated (LAB_MEMORY_CGROUP=0): units get no MemoryCurrent"
    return 0
  fi
  line=$(cmd_exec "$name" systemd-run --quiet --wait --pipe --collect --unit=lab-memory-probe \
           -p MemoryAccounting=yes systemctl show -P MemoryCurrent lab-memory-probe.service) ||
    line="(the probe unit failed)"
  if [[ $line =~ ^[0-9]+$ ]]; then
    echo "systemd-container: $name: memory controller delegated (cgroup v1): units get MemoryCurrent"
  else
    # not fatal: the tests that need the memory controller say so themselves
    echo "systemd-container: $name: memory controller NOT delegated, units get no MemoryCurrent: $line"
  fi
  return 0
}

cmd_exec() {
  local name=$1; shift; local l
  l=$(leader "$name") || die "$name not running"
  nsenter -t "$l" -a env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
       HOME=/root LANG=C.UTF-8 TERM=dumb SYSTEMD_PAGER=cat SYSTEMD_COLORS=0 \
       PYTHONUNBUFFERED=1 CI="${CI:-}" "$@"
}

cmd_run() {  # the command runs as a transient service of the container's PID 1
  local name=$1; shift
  cmd_exec "$name" systemd-run --quiet --wait --pipe --collect --service-type=exec \
       -p KillMode=control-group -E CI="${CI:-}" -E PYTHONUNBUFFERED=1 "$@"
}

cmd_reboot() {
  local name=$1 t0 old st; t0=$(now); old=$(leader "$name") || die "$name not running"
  # nspawn exits 133 on reboot; our supervisor re-runs it in the same mount
  # namespace, so the overlay (upper dir = state) is kept.
  nsenter -t "$old" -a systemctl reboot --no-block 2>/dev/null || true
  while [[ $(leader "$name" || true) == "$old" ]]; do sleep 0.05; done
  st=$(wait_running "$name" "$t0")
  delegate_memory "$name"
  echo "systemd-container: $name rebooted, $st after $(elapsed "$t0")s (leader $(leader "$name"))"
}

cmd_cleanup() {  # remove the (empty) cgroups, and the state unless asked to keep it
  local name=$1 keep=${2:-} cg i p
  for cg in $(cg_dirs "$name"); do
    # Orphans (supervisor died without stopping the container): everything in
    # OUR lab-NAME cgroup is ours; SIGKILL to the container's PID 1 ends its pid ns.
    for p in $(cat "$cg/payload/init.scope/cgroup.procs" "$cg/supervisor/cgroup.procs" 2>/dev/null); do
      echo "systemd-container: killing leftover pid $p of $name" >&2; kill -KILL "$p" 2>/dev/null || true
    done
    for ((i = 0; i < 50; i++)); do
      [[ -d $cg ]] || break
      find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || sleep 0.1
    done
    if [[ -d $cg ]]; then echo "systemd-container: warning: cannot remove $cg" >&2; fi
  done
  if [[ -z $keep && ${LAB_KEEP:-0} != 1 ]]; then rm -rf "$(sdir "$name")"; fi
  return 0
}

cmd_stop() {
  local name=${1:-lab} s n='' l t0 i; t0=$(now)
  if alive "$name"; then
    s=$(sup_pid "$name"); touch "$(sdir "$name")/stopping"
    # SIGTERM to nspawn = SIGRTMIN+3 to the container's PID 1 = orderly shutdown
    # (re-sent every 2s: a signal that reaches PID 1 before systemd installed
    # its handlers is dropped by the kernel, e.g. when stop races with boot)
    for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
      alive "$name" || break
      if ((i % 20 == 0)) && n=$(nspawn_pid "$name"); then kill -TERM "$n"; fi
      sleep 0.1
    done
    if alive "$name"; then
      echo "systemd-container: $name did not stop in ${STOP_TIMEOUT}s, SIGKILL" >&2
      l=$(leader "$name") && kill -KILL "$l"   # PID 1 dies => whole PID namespace dies
      sleep 1; n=$(nspawn_pid "$name") && kill -KILL "$n"
      sleep 0.5; alive "$name" && kill -KILL "$s"
    fi
    while alive "$name"; do sleep 0.05; done
  fi
  cmd_cleanup "$name"
  echo "systemd-container: $name stopped in $(elapsed "$t0")s"
}

cmd_stop_all() {
  local d
  for d in "$STATE_ROOT"/*/; do
    [[ -e ${d}supervisor.pid || -d ${d}upper ]] || continue
    cmd_stop "$(basename "$d")"
  done
  return 0
}

cmd_deps() {  # systemd-container must match the installed systemd, else apt upgrades systemd
  command -v systemd-nspawn >/dev/null && return 0
  local v; v=$(dpkg-query -W -f='${Version}' systemd) || die "systemd is not installed (dpkg)"
  apt-get install -y -q --no-install-recommends "systemd-container=$v" >&2 ||
    { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "systemd-container=$v" >&2; } ||
    die "systemd-container=$v is not available from apt; installing another version would upgrade systemd itself, so this is left to you"
}

cmd_status() {
  local name=${1:-lab}
  if alive "$name"; then echo "$name: supervisor $(sup_pid "$name") nspawn $(nspawn_pid "$name" || echo '?') leader $(leader "$name" || echo '?')"
    cmd_exec "$name" systemctl is-system-running || true
  else echo "$name: not running"; return 3; fi
}

verb=${1:-}; shift || true
case $verb in
  start)  cmd_start "$@" ;;
  stop)   cmd_stop "$@" ;;
  stop-all) cmd_stop_all ;;
  deps)   cmd_deps ;;
  exec)   cmd_exec "$@" ;;
  run)    cmd_run "$@" ;;
  reboot) cmd_reboot "$@" ;;
  status) cmd_status "$@" ;;
  leader) leader "$@" ;;
  _inner) inner "$@" ;;
  *) sed -n '2,/^# Needs/p' "$0"; exit 2 ;;
esac
