#!/usr/bin/env bash
# A real one-node Slurm cluster (slurmctld + slurmd + munge) whose files all live in one folder, for the
# tests and for trying `python -m harness run --slurm` on a workstation. Needs root and Debian's slurm-wlm
# and munge (scripts/install-test-tools.sh installs them).
#
#   scripts/slurm-one-node.sh start DIR     # then: export SLURM_CONF=DIR/slurm.conf; sinfo
#   scripts/slurm-one-node.sh stop DIR
#
# Settings (../shared/RECIPES.md): linuxproc process tracking and no task plugin need no cgroup set-up;
# cons_tres so that two jobs could share the node by cores; its own munge socket and key, so a system
# munged, if any, is left alone. MinJobAge=5: `sbatch --wait` first polls after 2 s and multiplies its wait
# by 4 (up to 32 s) while the wait is under half of MinJobAge (src/sbatch/sbatch.c, _job_wait), so under the
# default of 300 s a 10 s job returned after 2 + 8 + 32 s; at 5 it polls every 2 s, and a finished job's
# record outlives the next poll.
set -euo pipefail
action=${1:?usage: slurm-one-node.sh start|stop DIR}
dir=$(mkdir -p "${2:?usage: slurm-one-node.sh start|stop DIR}" && cd "$2" && pwd)

stop() {
    for daemon in slurmd slurmctld munged; do
        if [ -f "$dir/$daemon.pid" ]; then
            kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
        fi
    done
    sleep 1
    for daemon in slurmd slurmctld munged; do
        if [ -f "$dir/$daemon.pid" ]; then
            kill -9 "$(cat "$dir/$daemon.pid")" 2>/dev/null || true
            rm -f "$dir/$daemon.pid"
        fi
    done
}

if [ "$action" = stop ]; then
    stop
    exit 0
fi
[ "$action" = start ] || { echo "slurm-one-node.sh: unknown action $action; allowed: start, stop" >&2; exit 2; }
for tool in slurmctld slurmd munged sinfo; do
    command -v "$tool" >/dev/null || { echo "slurm-one-node.sh: $tool not found (install slurm-wlm and munge)" >&2; exit 3; }
done
[ "$(id -u)" = 0 ] || { echo "slurm-one-node.sh: slurmd must run as root" >&2; exit 3; }

node=$(hostname -s)
cpus=$(nproc)
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
ports=${PARBENCH_SLURM_PORTS:-16817-16818}
mkdir -p "$dir/state" "$dir/spool"
dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge.key"
cat > "$dir/slurm.conf" <<EOF
ClusterName=parbench
SlurmctldHost=$node
SlurmctldPort=${ports%-*}
SlurmdPort=${ports#*-}
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=5
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmdSpoolDir=$dir/spool
StateSaveLocation=$dir/state
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=$node CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

stop
munged --force --socket="$dir/munge.socket" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
    if [ "$(sinfo -h -o %T 2>/dev/null)" = idle ]; then
        echo "slurm: one-node cluster up ($node, $cpus CPUs); export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 1
done
echo "slurm-one-node.sh: node $node not idle after 60 s; see $dir/slurmctld.log and $dir/slurmd.log" >&2
sinfo >&2 || true
exit 1
