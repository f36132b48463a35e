#!/usr/bin/env bash
# A JuiceFS volume for a strawq queue: format it once, mount it on every node.
#
#   META_URL=... STORAGE=s3 BUCKET=... deploy/juicefs/mount.sh format   # once, from any node
#   META_URL=... deploy/juicefs/mount.sh mount                          # on every node
#   META_URL=... deploy/juicefs/mount.sh umount                         # on every node
#
# The mount keeps close-to-open consistency and synchronous durability, which the queue
# relies on (docs/filesystem-contract.md §4, docs/operations.md): no --writeback,
# --open-cache 0, --negative-entry-cache 0, no --readdir-cache, the same --heartbeat on every
# node, background jobs left on. `format` sets --trash-days 0 (a dedicated queue volume:
# deleted records free their space at once). Verify every mount afterwards with
# `strawq doctor` (docs/operations.md §1).
#
# Environment (every node must use the same META_URL, MOUNT_POINT and HEARTBEAT):
#   META_URL        required. The metadata engine, with synchronous durability:
#                   mysql://user:pass@(host:3306)/juicefs, postgres://user:pass@host:5432/juicefs,
#                   tikv://pd1:2379,pd2:2379/jfs, or redis://:pass@host:6379/1 with the Redis
#                   server on `appendfsync always`. sqlite3:// is one host only (refused unless
#                   ALLOW_SQLITE=1, for a single-machine test).
#   MOUNT_POINT     where to mount (default /mnt/jfs); the same path on every node, because a
#                   storage declaration records it
#   CACHE_DIR       local block cache (default /var/jfsCache)
#   HEARTBEAT       client session heartbeat (default 12s); the same on every node
#   META_CACHE      default | zero. "zero" adds --attr-cache 0 --entry-cache 0
#                   --dir-entry-cache 0 (millisecond visibility, more metadata round trips);
#                   "default" keeps JuiceFS's 1 s TTLs, which the queue is designed for
#   EXTRA_MOUNT_OPTS  more `juicefs mount` options (word-split); options that break the
#                   queue's contract (--writeback, --readdir-cache, --open-cache N>0,
#                   --no-bgjob) are refused
#   VOLUME_NAME     format only: the volume's name (default strawq)
#   STORAGE, BUCKET format only: object storage type and bucket URL (e.g. s3,
#                   https://my-bucket.s3.us-east-1.amazonaws.com). Credentials come from the
#                   ACCESS_KEY / SECRET_KEY environment variables, which juicefs reads itself
#   JUICEFS         the juicefs binary (default: juicefs on PATH)
set -euo pipefail

prog=$(basename "$0")
die() { echo "$prog: error: $*" >&2; exit 1; }
note() { echo "$prog: $*" >&2; }

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -eq 1 ]] || usage
cmd=$1

[[ -n "${META_URL:-}" ]] || die "META_URL is not set: name the metadata engine, e.g." \
    "META_URL='mysql://user:pass@(db:3306)/juicefs' (see the header of $0)"
case "$META_URL" in
    sqlite3://*)
        [[ "${ALLOW_SQLITE:-0}" == 1 ]] || die "META_URL is SQLite, which only one host can" \
            "use: other nodes would not share the queue. Use MySQL/PostgreSQL, TiKV, or Redis" \
            "with appendfsync always (set ALLOW_SQLITE=1 for a single-host test)"
        note "warning: SQLite metadata is single-host; fine for a test, never for a cluster" ;;
    redis://*|rediss://*|unix://*)
        note "note: with Redis, durability needs 'appendfsync always' on the server;" \
            "strawq doctor cannot read the server's setting" ;;
esac

JUICEFS=${JUICEFS:-juicefs}
command -v "$JUICEFS" >/dev/null 2>&1 || die "juicefs binary '$JUICEFS' not found; install" \
    "JuiceFS (https://juicefs.com/docs/community/installation) or set JUICEFS=/path/to/juicefs"

MOUNT_POINT=${MOUNT_POINT:-/mnt/jfs}
CACHE_DIR=${CACHE_DIR:-/var/jfsCache}
HEARTBEAT=${HEARTBEAT:-12s}
VOLUME_NAME=${VOLUME_NAME:-strawq}

is_mounted() {  # field 5 of mountinfo is the mount point
    local mp
    mp=$(realpath -m "$1")
    awk -v mp="$mp" '$5 == mp { found = 1 } END { exit found ? 0 : 1 }' /proc/self/mountinfo
}

build_mount_opts() {  # sets MOUNT_OPTS (in this shell, so that `die` stops the script)
    MOUNT_OPTS=(--open-cache 0 --negative-entry-cache 0 --heartbeat "$HEARTBEAT"
                --cache-dir "$CACHE_DIR")
    case "${META_CACHE:-default}" in
        default) ;;
        zero) MOUNT_OPTS+=(--attr-cache 0 --entry-cache 0 --dir-entry-cache 0) ;;
        *) die "META_CACHE=${META_CACHE}: expected 'default' or 'zero'" ;;
    esac
    local -a extra=()
    if [[ -n "${EXTRA_MOUNT_OPTS:-}" ]]; then
        # shellcheck disable=SC2206  # word splitting is the point
        extra=(${EXTRA_MOUNT_OPTS})
    fi
    local i o
    for ((i = 0; i < ${#extra[@]}; i++)); do
        o=${extra[$i]}
        case "$o" in
            --writeback|--writeback=*)
                die "EXTRA_MOUNT_OPTS has $o: with writeback a publish is committed before its" \
                    "data is uploaded, and losing this node's cache disk loses records the" \
                    "queue reported durable" ;;
            --readdir-cache|--readdir-cache=true)
                die "EXTRA_MOUNT_OPTS has $o: listings would lag by the attr TTL" ;;
            --no-bgjob)
                die "EXTRA_MOUNT_OPTS has --no-bgjob: stale sessions are cleaned by the" \
                    "background job of a live client; keep it on" ;;
            --open-cache=*|--open-cache)
                local v=${o#--open-cache=}
                if [[ "$o" == --open-cache ]]; then v=${extra[$((i + 1))]:-}; fi
                [[ "$v" =~ ^0+(\.0*)?s?$ ]] || die "EXTRA_MOUNT_OPTS sets --open-cache $v:" \
                    "a cached open skips the metadata check and breaks close-to-open" ;;
        esac
    done
    MOUNT_OPTS+=("${extra[@]}")
}

cmd_format() {
    if "$JUICEFS" status "$META_URL" >/dev/null 2>&1; then
        note "a volume already exists at META_URL; setting --trash-days 0 on it"
        "$JUICEFS" config "$META_URL" --trash-days 0 --yes
        return
    fi
    [[ -n "${STORAGE:-}" && -n "${BUCKET:-}" ]] || die "format needs STORAGE and BUCKET" \
        "(e.g. STORAGE=s3 BUCKET=https://my-bucket.s3.us-east-1.amazonaws.com)"
    note "formatting volume $VOLUME_NAME (storage $STORAGE, trash days 0)"
    "$JUICEFS" format --storage "$STORAGE" --bucket "$BUCKET" --trash-days 0 \
        "$META_URL" "$VOLUME_NAME"
}

cmd_mount() {
    if is_mounted "$MOUNT_POINT"; then
        die "$MOUNT_POINT is already a mount point; run '$prog umount' first"
    fi
    build_mount_opts
    mkdir -p "$MOUNT_POINT" "$CACHE_DIR"
    note "mounting at $MOUNT_POINT with: ${MOUNT_OPTS[*]}"
    "$JUICEFS" mount -d "${MOUNT_OPTS[@]}" "$META_URL" "$MOUNT_POINT"
    local i
    for ((i = 0; i < 600; i++)); do
        if is_mounted "$MOUNT_POINT" && [[ -r "$MOUNT_POINT/.config" ]]; then
            note "mounted; verify it with: strawq doctor $MOUNT_POINT/<dir> --quick"
            return 0
        fi
        sleep 0.1
    done
    die "$MOUNT_POINT did not become a live JuiceFS mount within 60 s (see /var/log/juicefs.log)"
}

cmd_umount() {
    if ! is_mounted "$MOUNT_POINT"; then
        note "$MOUNT_POINT is not mounted"
        return 0
    fi
    "$JUICEFS" umount "$MOUNT_POINT"
}

case "$cmd" in
    format) cmd_format ;;
    mount) cmd_mount ;;
    umount) cmd_umount ;;
    *) usage ;;
esac
