#!/usr/bin/env bash
# A real Slurm for tests, run as root, with every file (munge key and socket, slurm.conf, spool, PID files, logs)
# under STATE_DIR. One node: munged + slurmctld + slurmd on 127.0.0.1. Several nodes (DPOTRAIN_SLURM_NODES=2):
# each slurmd in a network namespace of its own (its own address, hostname, spool and log), slurmctld in one more,
# joined by a bridge; munged stays outside, reached through its socket file. Addresses exist only inside the
# namespaces this script makes, and stop removes exactly those.
#
# Usage:
#   tests/slurm/cluster.sh start  [STATE_DIR]   # install if missing, start, wait for the node(s) to be idle
#   tests/slurm/cluster.sh stop   [STATE_DIR]   # cancel its jobs, stop the daemons (and namespaces) it started
#   tests/slurm/cluster.sh status [STATE_DIR]   # exit 0 when munged, slurmctld and every slurmd run
#   tests/slurm/cluster.sh install [STATE_DIR]  # only install what start would (scripts/test.sh: while pip runs)
#
#   eval "$(tests/slurm/cluster.sh start)"      # start prints `export SLURM_CONF=...` on stdout
#   sbatch --gpus-per-node=0 job.sh                # a header asking for GPUs needs this override
#
# STATE_DIR defaults to /tmp/dpotrain-slurm. One single-node cluster per machine: its ports are fixed; a cluster of
# several nodes lives in namespaces of its own (named after its STATE_DIR) and runs beside it.
# Overrides (environment):
#   DPOTRAIN_SLURM_PORT=6817      slurmctld port; slurmd uses PORT+1
#   DPOTRAIN_SLURM_TIMEOUT=60     seconds to wait for the node to become idle (and for stop)
#   DPOTRAIN_SLURM_GRACE_TIME=90  preemption grace time of the default partition `debug` (SIGTERM, then SIGKILL this
#                                 many seconds later); a job in partition `urgent` preempts it
#   DPOTRAIN_SLURM_CPUS=N         advertise N CPUs instead of the real count (SlurmdParameters=
#                                 config_overrides lets the node claim more than it has)
#   DPOTRAIN_SLURM_NODES=1        nodes; 2 or more: network namespaces (needs `ip` from iproute2 and CAP_NET_ADMIN).
#                                 Kept in STATE_DIR: stop and status need not be told again. (install: 2 or more
#                                 also installs iproute2 where `ip` is missing)
#
# Progress goes to stderr; stdout carries only lines a shell can `eval`:
#   `# cluster.sh: started` or `# cluster.sh: already running`, then `export SLURM_CONF=...`, and with several
#   nodes `export DPOTRAIN_SLURM_CLIENT_NETNS=...`: the controller's namespace, where clients must run:
#   ip netns exec "$DPOTRAIN_SLURM_CLIENT_NETNS" sbatch --nodes=2 --gpus-per-node=0 job.sh
# Requires root (apt-get install, and SlurmUser=root). Debian 12: slurm-wlm 22.05.
set -euo pipefail

PATH=/usr/sbin:/sbin:$PATH
PACKAGES=(slurmctld slurmd slurm-client munge)
CTLD_PORT=${DPOTRAIN_SLURM_PORT:-6817}
TIMEOUT=${DPOTRAIN_SLURM_TIMEOUT:-60}
GRACE_TIME=${DPOTRAIN_SLURM_GRACE_TIME:-90}

usage() { sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0" >&2; exit 2; }
log() { echo "cluster.sh: $*" >&2; }
die() { echo "cluster.sh: ERROR: $*" >&2; exit 1; }

[[ $# -ge 1 && $# -le 2 ]] || usage
CMD=$1
STATE_DIR=${2:-/tmp/dpotrain-slurm}
case $STATE_DIR in /*) ;; *) STATE_DIR=$PWD/$STATE_DIR ;; esac
STATE_DIR=${STATE_DIR%/}

CONF=$STATE_DIR/slurm.conf
MUNGE_DIR=$STATE_DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
RUN_DIR=$STATE_DIR/run
LOG_DIR=$STATE_DIR/log
SPOOL_DIR=$STATE_DIR/spool
export SLURM_CONF=$CONF

# Nodes: the number given at start is kept in STATE_DIR, so stop and status act on what start made.
NODES_FILE=$STATE_DIR/nodes
if [[ $CMD == start || $CMD == install ]]; then
    NODES=${DPOTRAIN_SLURM_NODES:-1}
else
    NODES=$(cat "$NODES_FILE" 2>/dev/null || echo 1)
fi
[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "DPOTRAIN_SLURM_NODES=$NODES: give a number of nodes from 1 to 99"

# Several nodes: namespaces named after STATE_DIR (two state dirs never share one), listed in NETNS_FILE as they
# are made: stop removes those and nothing else. Inside them the names (br0, eth0) and the subnet are private.
NETNS_FILE=$STATE_DIR/netns
NETNS_PREFIX=dpotrain-$(cksum <<<"$STATE_DIR" | cut -c1-6)
CTL_NS=""
SUBNET=10.77.0
if ((NODES > 1)); then
    CTL_NS=$NETNS_PREFIX-ctl
fi
node_name() { if ((NODES > 1)); then echo "node$1"; else hostname -s; fi; }
node_ns() { echo "$NETNS_PREFIX-node$1"; }
node_addr() { echo "$SUBNET.$((10 + $1))"; }

DAEMONS=(munged slurmctld)
if ((NODES > 1)); then
    for ((i = 1; i <= NODES; i++)); do DAEMONS+=("slurmd-node$i"); done
else
    DAEMONS+=(slurmd)
fi
pid_file() { echo "$RUN_DIR/$1.pid"; }
log_file() { echo "$LOG_DIR/$1.log"; }

# Daemon names (and so log and spool names): slurmd-node1, ... with several nodes; Slurm expands %n per node.
slurmd_name() { if ((NODES > 1)); then echo 'slurmd-%n'; else echo slurmd; fi; }

# Slurm clients (sinfo, scontrol, squeue, scancel) reach slurmctld only from inside its namespace.
client() { if [[ -n $CTL_NS ]]; then ip netns exec "$CTL_NS" "$@"; else "$@"; fi; }

# The PID in $1's PID file, if that process is alive AND is still $1 (a PID can be reused).
daemon_pid() {
    local f pid comm stat
    f=$(pid_file "$1")
    { pid=$(tr -dc 0-9 <"$f"); } 2>/dev/null || return 1
    [[ -n $pid ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ $comm == "${1%%-*}" ]] || return 1  # slurmd-node1 runs as slurmd
    # A zombie still has its comm; PID 1 of this VM reaps nothing, so exited daemons linger as <defunct>.
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]] || return 1
    echo "$pid"
}

all_running() {
    local d
    for d in "${DAEMONS[@]}"; do daemon_pid "$d" >/dev/null || return 1; done
}

node_state() { client sinfo -h -N -o '%T' 2>/dev/null | head -n1; }

print_env() {
    echo "# cluster.sh: $1"
    printf 'export SLURM_CONF=%q\n' "$CONF"
    [[ -z $CTL_NS ]] || printf 'export DPOTRAIN_SLURM_CLIENT_NETNS=%q\n' "$CTL_NS"
}

# The tail of each daemon's log: slurm*.log (timestamped), or the daemon's stdout/stderr (*.out:
# munged's log, and whatever a daemon printed before it opened its log file).
show_logs() {
    local d f
    for d in "${DAEMONS[@]}"; do
        f=$LOG_DIR/$d.log
        [[ -s $f ]] || f=$LOG_DIR/$d.out
        [[ -s $f ]] || continue
        echo "----- tail of $f -----" >&2
        tail -n 15 "$f" >&2
    done
}

install_packages() {
    local missing=0 bin
    for bin in munged mungekey slurmctld slurmd sbatch scontrol sinfo; do
        command -v "$bin" >/dev/null || missing=1
    done
    # Several nodes need `ip` (iproute2: not in every minimal image); nsenter and unshare are util-linux (essential).
    if ((NODES > 1)) && ! command -v ip >/dev/null; then
        PACKAGES+=(iproute2)
        missing=1
    fi
    [[ $missing == 0 ]] && return 0
    [[ $(id -u) == 0 ]] || die "Slurm is not installed and installing it needs root: run as root, or
  sudo apt-get install -y --no-install-recommends ${PACKAGES[*]}"
    command -v apt-get >/dev/null \
        || die "Slurm is not installed and there is no apt-get: install ${PACKAGES[*]} by hand"
    log "installing ${PACKAGES[*]} ..."
    local apt_log=$STATE_DIR/apt.log
    export DEBIAN_FRONTEND=noninteractive
    # Try with the current package lists first; refresh them only when that fails (missing or stale).
    # DPkg::Lock::Timeout: wait for another apt/dpkg run (a colleague's) instead of failing.
    local install=(apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=120 "${PACKAGES[@]}")
    if ! "${install[@]}" >"$apt_log" 2>&1; then
        log "apt-get install failed with the current package lists; running apt-get update"
        apt-get update >>"$apt_log" 2>&1 \
            || { tail -n 20 "$apt_log" >&2; die "apt-get update failed (log: $apt_log)"; }
        "${install[@]}" >>"$apt_log" 2>&1 \
            || { tail -n 20 "$apt_log" >&2; die "apt-get install ${PACKAGES[*]} failed (log: $apt_log)"; }
    fi
    for bin in munged mungekey slurmctld slurmd sbatch; do
        command -v "$bin" >/dev/null || die "$bin is still missing after apt-get install (log: $apt_log)"
    done
}

write_conf() {
    local host hw ctld_addr nodes_conf="" names i cpus first_job_id
    host=$(hostname -s)
    # `slurmd -C` prints "NodeName=... CPUs=2 Boards=1 ... RealMemory=..." then "UpTime=...".
    hw=$(slurmd -C | head -n1)
    [[ $hw == NodeName=* ]] || die "unexpected output of \`slurmd -C\`: $hw"
    if [[ -n ${DPOTRAIN_SLURM_CPUS:-} ]]; then
        cpus=$DPOTRAIN_SLURM_CPUS
        # Keep the topology consistent with the claimed CPU count.
        hw=$(sed -E "s/CPUs=[0-9]+/CPUs=$cpus/; s/SocketsPerBoard=[0-9]+/SocketsPerBoard=1/;
                     s/CoresPerSocket=[0-9]+/CoresPerSocket=$cpus/;
                     s/ThreadsPerCore=[0-9]+/ThreadsPerCore=1/" <<<"$hw")
    fi
    hw=${hw#* }  # the hardware without "NodeName=<this machine>"
    # Seconds since 2026 (below MaxJobId 67043328): a later start begins above the ids an earlier one used
    # (fewer than one job per second).
    first_job_id=$(( ($(date +%s) - 1767225600) % 60000000 + 1000 ))
    if ((NODES > 1)); then
        # Every node claims this machine's hardware: they share its cores, as nodes of a real cluster do not.
        ctld_addr=$SUBNET.1
        for ((i = 1; i <= NODES; i++)); do
            nodes_conf+="NodeName=$(node_name "$i") $hw State=UNKNOWN NodeAddr=$(node_addr "$i") NodeHostname=$(node_name "$i")"$'\n'
        done
        names="node[1-$NODES]"
    else
        ctld_addr=127.0.0.1
        nodes_conf="NodeName=$(node_name 1) $hw State=UNKNOWN NodeAddr=127.0.0.1 NodeHostname=$host"$'\n'
        names=$(node_name 1)
    fi
    cat >"$CONF" <<EOF
# Written by tests/slurm/cluster.sh: a $NODES-node test cluster. Regenerated on every fresh start.
ClusterName=dpotrain-test
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root

# munged runs with its socket under STATE_DIR. cred_expire=5 (default 120): a requeued job is
# eligible again cred_expire+1 s after it ends (5 is the least Slurm takes), so requeue-to-rerun drops from ~2 min to
# ~6 s (with sched_interval=1 below). Not lower: with cred_expire=2 slurmctld and slurmd log "AuthInfo=cred_expire=2
# invalid" and fall back to the default, and a job requeued at once had not started again 18 s later (session 45).
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=5

StateSaveLocation=$SPOOL_DIR/slurmctld
SlurmdSpoolDir=$SPOOL_DIR/$(slurmd_name)
SlurmctldPidFile=$RUN_DIR/slurmctld.daemon.pid
SlurmdPidFile=$RUN_DIR/$(slurmd_name).daemon.pid
SlurmctldLogFile=$(log_file slurmctld)
SlurmdLogFile=$(log_file "$(slurmd_name)")
SlurmctldDebug=info
SlurmdDebug=info
# No mail program on the test machine; without this slurmctld logs "Configured MailProg is invalid".
MailProg=/bin/true

# Processes tracked by parent PID, not cgroups: the slurmds of a several-node cluster share this machine's cgroup
# tree, where their jobs' folders (slurm/uid_0/job_<id>) would collide. task/affinity binds each task to its CPUs
# (sched_setaffinity), to cores by default (TaskPluginParam=cores, as on clusters that bind tasks to cores): a step
# gets one core per task unless it asks for more, and since Slurm 22.05 srun no longer inherits the job's
# --cpus-per-task (tests/test_slurm_cluster.py shows both). With automatic binding instead, such a step gets all
# of the job's CPUs here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=cores
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
# CR_Core: memory is not a consumable, so a job without --mem does not take the whole node.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides

SchedulerType=sched/backfill
# A requeued job becomes eligible at a begin time (cred_expire+1 s after it ends, above) that no event marks: the
# backfill scheduler runs only after a change, so the job starts at the main scheduler's next full pass, every
# sched_interval seconds. 1 s: it starts ~1 s after its begin time, not up to 5 s.
SchedulerParameters=bf_interval=1,sched_interval=1
JobRequeue=1
# Job ids go on from where an earlier start of the cluster left them (a fresh spool would count from 1 again):
# a job's log, logs/<name>-<id>.out with --open-mode=append, must never continue an earlier job's.
FirstJobId=$first_job_id
ReturnToService=2
MaxJobCount=100000
# Finished jobs stay visible to 'scontrol show job' and 'squeue -t all' for 10 minutes.
MinJobAge=600
# SIGTERM -> SIGKILL grace at the time limit or on scancel; room for a checkpoint save.
KillWait=30
InactiveLimit=0
Waittime=0
SlurmdTimeout=300

# No slurmdbd, so no sacct; finished jobs are also appended here (read with 'sacct -c').
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.txt

# Preemption as on shared clusters: a job submitted to the higher-priority partition "urgent" preempts the
# running jobs of "debug" (the default), which get SIGCONT+SIGTERM at once, SIGKILL GraceTime seconds later, and
# are requeued by Slurm.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE

${nodes_conf}PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_TIME
PartitionName=urgent Nodes=$names MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=10 PreemptMode=OFF
EOF
}

# --- several nodes: network namespaces -------------------------------------------------------------------
# <prefix>-ctl holds slurmctld and a bridge br0 ($SUBNET.1); <prefix>-nodeN holds slurmd N behind eth0
# ($SUBNET.(10+N)), a veth whose other end is on the bridge. Nothing is added to the machine's own namespace.
netns_exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }

make_netns() {
    local ns=$1
    # A namespace of this name that this state dir did not record is someone else's: leave it alone.
    if netns_exists "$ns"; then
        grep -qx "$ns" "$NETNS_FILE" 2>/dev/null \
            || die "network namespace $ns exists but was not made by this STATE_DIR ($STATE_DIR); remove it (ip netns del $ns) or use another STATE_DIR"
        ip netns del "$ns"
    fi
    ip netns add "$ns" || die "cannot make network namespace $ns (needs root with CAP_NET_ADMIN)"
    echo "$ns" >>"$NETNS_FILE"
    ip -n "$ns" link set lo up
}

make_network() {
    local i ns host
    command -v ip >/dev/null || die "several nodes need network namespaces: install iproute2 (apt-get install iproute2)"
    if ! command -v nsenter >/dev/null || ! command -v unshare >/dev/null; then
        die "several nodes need nsenter and unshare (util-linux)"
    fi
    host=$(hostname -s)
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 $host"
        for ((i = 1; i <= NODES; i++)); do echo "$(node_addr "$i") $(node_name "$i")"; done
    } >"$STATE_DIR/hosts"
    make_netns "$CTL_NS"
    ip -n "$CTL_NS" link add br0 type bridge
    ip -n "$CTL_NS" addr add "$SUBNET.1/24" dev br0
    ip -n "$CTL_NS" link set br0 up
    for ((i = 1; i <= NODES; i++)); do
        ns=$(node_ns "$i")
        make_netns "$ns"
        # Both ends are made inside the namespaces: the machine's own never sees them.
        ip link add eth0 netns "$ns" type veth peer name "veth$i" netns "$CTL_NS"
        ip -n "$CTL_NS" link set "veth$i" master br0 up
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

# Remove the namespaces this state dir made: first whatever still runs in them (job steps that outlived slurmd;
# they were started inside, so they are this cluster's), then the namespace. The veths and the bridge go with it.
remove_network() {
    local ns pids
    [[ -s $NETNS_FILE ]] || return 0
    while read -r ns; do
        [[ -n $ns ]] || continue
        if netns_exists "$ns"; then
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            if [[ -n $pids ]]; then
                log "ending processes left in $ns: $(echo "$pids" | tr '\n' ' ')"
                # shellcheck disable=SC2086  # one PID per word
                kill -TERM $pids 2>/dev/null || true
                sleep 1
                pids=$(ip netns pids "$ns" 2>/dev/null || true)
                # shellcheck disable=SC2086
                [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
            fi
            ip netns del "$ns" || log "could not remove network namespace $ns"
        fi
    done <"$NETNS_FILE"
    rm -f "$NETNS_FILE"
}

# Start slurmd for node $1 (and so its jobs) inside the node's network namespace, with
# - the node's name as hostname (own UTS namespace): slurmd finds its NodeName from it, as on a real node, and
#   gloo binds to the address that name resolves to;
# - STATE_DIR/hosts over /etc/hosts (own mount namespace, private: the machine's /etc/hosts is untouched): node
#   names resolve to their addresses, so the rendezvous address (the first node's name) works as on a real cluster.
# nsenter, not `ip netns exec`: that one mounts a fresh /sys, without the cgroup mounts slurmd needs.
# - STATE_DIR/node-local: a folder each node sees on its own (its STATE_DIR/node-local-<node> bound over it), for
#   what is node-local on a real cluster (a node's /tmp or scratch disk as DPOTRAIN_CACHE).
launch_slurmd() {
    local i=$1
    mkdir -p "$STATE_DIR/node-local" "$STATE_DIR/node-local-$(node_name "$i")"
    # shellcheck disable=SC2016  # $0 ... $3 are the inner shell's
    launch "slurmd-node$i" nsenter --net="/run/netns/$(node_ns "$i")" unshare --uts --mount \
        sh -c 'mount --bind "$2" /etc/hosts && mount --bind "$3-$0" "$3" && hostname "$0" && exec slurmd -D -f "$1"' \
        "$(node_name "$i")" "$CONF" "$STATE_DIR/hosts" "$STATE_DIR/node-local"
}

# Run daemon $1 in the foreground of its own session, in the background of this script: its PID
# is known at once (no race with a daemon that writes its PID file after forking), it survives this
# script, and a Ctrl-C or pytest's process-group signals do not reach it. 9>&-: it must not
# inherit (and hold) the start/stop lock. run/$1.pid is written by this script only; the daemons
# write (and truncate, and remove) their own PID files elsewhere (*.daemon.pid).
launch() {
    local name=$1 pid i
    shift
    setsid "$@" </dev/null >>"$LOG_DIR/$name.out" 2>&1 9>&- &
    pid=$!
    echo "$pid" >"$(pid_file "$name")"
    LAUNCHED+=("$name")
    # Until `setsid` has exec'd the daemon, the PID's comm is bash or setsid, not $name.
    for ((i = 0; i < 50; i++)); do
        daemon_pid "$name" >/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.02
    done
    daemon_pid "$name" >/dev/null || start_failed "$name did not start"
}
LAUNCHED=()

# Show the logs, stop what this start launched (the logs stay), and fail.
start_failed() {
    show_logs
    stop_daemons
    die "$1 (logs above; logs and slurm.conf in $STATE_DIR)"
}

# Poll until "$@" succeeds; die with the daemon logs if a daemon exits or TIMEOUT passes.
wait_until() {
    local what=$1 d
    shift
    local deadline=$((SECONDS + TIMEOUT))
    until "$@"; do
        for d in "${LAUNCHED[@]}"; do
            daemon_pid "$d" >/dev/null || start_failed "$d exited while waiting for $what"
        done
        ((SECONDS < deadline)) || start_failed "no $what within ${TIMEOUT}s"
        sleep 0.1
    done
}

munge_ok() { munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }
ctld_up() { client scontrol ping 2>/dev/null | grep -q 'is UP'; }
# Every node idle: as many idle nodes as nodes (sinfo lists a node once per partition).
node_idle() { [[ $(client sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | grep -c ' idle$') == "$NODES" ]]; }

stop_daemons() {
    local d pid deadline
    # Jobs first: slurmstepd and job processes outlive slurmd, so cancel this cluster's jobs while
    # slurmctld can still reach them.
    if daemon_pid slurmctld >/dev/null && daemon_pid "${DAEMONS[2]}" >/dev/null; then
        local jobs
        jobs=$(client squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
            # shellcheck disable=SC2086  # one job id per word
            client scancel $jobs 2>/dev/null || true
            deadline=$((SECONDS + 15))
            while [[ -n $(client squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < deadline)); do sleep 0.5; done
        fi
    fi
    for d in "${DAEMONS[@]:2}" slurmctld munged; do
        pid=$(daemon_pid "$d") || continue
        log "stopping $d (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$((SECONDS + TIMEOUT))
        while daemon_pid "$d" >/dev/null; do
            if ((SECONDS >= deadline)); then
                log "$d (pid $pid) ignored SIGTERM for ${TIMEOUT}s; sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
                sleep 0.5
                break
            fi
            sleep 0.2
        done
        rm -f "$(pid_file "$d")"
    done
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    remove_network
}

cmd_start() {
    install_packages
    [[ $(id -u) == 0 ]] || die "the test cluster runs its daemons as root (SlurmUser=root): run as root"
    local state i
    if all_running && state=$(node_state) && [[ $state =~ ^(idle|mixed|allocated|completing) ]]; then
        log "already running (SLURM_CONF=$CONF)"
        print_env "already running"
        return 0
    fi
    local before
    before=$(cat "$NODES_FILE" 2>/dev/null || echo "$NODES")
    [[ $before == "$NODES" ]] \
        || die "$STATE_DIR holds a $before-node cluster: stop it first (tests/slurm/cluster.sh stop $STATE_DIR) or use another STATE_DIR"
    # Partly up (a daemon died) or down: start from a clean slate so no old jobs come back.
    stop_daemons
    rm -rf "$SPOOL_DIR" "$LOG_DIR"
    mkdir -p "$MUNGE_DIR" "$RUN_DIR" "$LOG_DIR" "$SPOOL_DIR/slurmctld"
    chmod 0755 "$MUNGE_DIR"  # clients connect to the socket in it; the key itself is 0600
    echo "$NODES" >"$NODES_FILE"
    if ((NODES > 1)); then
        for ((i = 1; i <= NODES; i++)); do mkdir -p "$SPOOL_DIR/slurmd-node$i"; done
        trap remove_network EXIT  # a step that fails half-way leaves no namespace behind
        make_network
        trap - EXIT
    else
        mkdir -p "$SPOOL_DIR/slurmd"
    fi
    write_conf

    local t0=$EPOCHREALTIME
    [[ -s $MUNGE_DIR/munge.key ]] || mungekey --create --keyfile="$MUNGE_DIR/munge.key" >&2
    chmod 0600 "$MUNGE_DIR/munge.key"
    # --force: the state dir lives under /tmp (world-writable), which munged otherwise refuses.
    # In the foreground munged logs to stderr, i.e. log/munged.out.
    launch munged munged --foreground --force --socket="$MUNGE_SOCKET" \
        --key-file="$MUNGE_DIR/munge.key" --pid-file="$RUN_DIR/munged.daemon.pid" \
        --seed-file="$MUNGE_DIR/munged.seed"
    wait_until "munge/unmunge round trip" munge_ok
    if [[ -n $CTL_NS ]]; then
        launch slurmctld ip netns exec "$CTL_NS" slurmctld -D -f "$CONF"
    else
        launch slurmctld slurmctld -D -f "$CONF"
    fi
    # slurmd registers at start-up and retries only after a while: let slurmctld answer first.
    wait_until "answer from slurmctld (scontrol ping)" ctld_up
    if ((NODES > 1)); then
        for ((i = 1; i <= NODES; i++)); do launch_slurmd "$i"; done
    else
        launch slurmd slurmd -D -f "$CONF"
    fi
    wait_until "$NODES idle node(s) in sinfo" node_idle
    log "started in $(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $t0}")s:" \
        "$(client sinfo -h -N -o '%N %c CPUs %m MB' | paste -sd,) idle (SLURM_CONF=$CONF)"
    print_env "started"
}

cmd_status() {
    local d pid rc=0
    for d in "${DAEMONS[@]}"; do
        if pid=$(daemon_pid "$d"); then log "$d running (pid $pid)"; else log "$d not running"; rc=1; fi
    done
    ((rc == 0)) && log "node: $(node_state || echo '?') (SLURM_CONF=$CONF)"
    return $rc
}

# One start/stop at a time per STATE_DIR (two pytest sessions may start it together).
if ! { mkdir -p "$STATE_DIR" && exec 9>>"$STATE_DIR/.lock"; } 2>/dev/null; then
    die "cannot write to $STATE_DIR (run as root, or pass another STATE_DIR)"
fi
case $CMD in
    start) flock 9; cmd_start ;;
    stop) flock 9; stop_daemons; rm -f "$NODES_FILE"; log "stopped" ;;
    status) cmd_status ;;
    install) flock 9; install_packages ;;  # under the lock: a start waits for it, then finds everything installed
    *) usage ;;
esac
