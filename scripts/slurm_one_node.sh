#!/bin/bash
# A one-node SLURM cluster on this machine, as root (Debian/Ubuntu), for the requeue test in `make faults`
# (tests/faults/test_slurm_requeue.py, skipped where `sinfo` reaches no cluster). Not for production use.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }
command -v slurmctld >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge
host=$(hostname)
mkdir -p /var/spool/slurmd /var/spool/slurmctld /var/log/slurm /etc/slurm /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$host
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmUser=root
AuthType=auth/munge
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
NodeName=$host CPUs=$(nproc) RealMemory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 )) State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
[ -f /etc/munge/munge.key ] || mungekey -c
chown -R munge:munge /etc/munge /run/munge
pgrep -x munged >/dev/null || su -s /bin/sh munge -c munged
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
sleep 3
sinfo
