#!/usr/bin/env bash
# A one-node Slurm on this machine (localhost), for the Slurm scenarios CI runs
# (tests/features/test_slurm.py): `install` takes Debian's Slurm, munge and Open MPI with PMIx;
# `start` writes a slurm.conf under $SLURM_DIR and starts munged, slurmctld and slurmd; `stop`
# ends them. Root only (slurmd starts the jobs' tasks as their users). Needs no systemd and no
# cgroups: processes are tracked by /proc (proctrack/linuxproc), tasks bound to cores by
# sched_setaffinity (task/affinity: the scripts' --cpu-bind=cores).
# Afterwards: `export SLURM_CONF=$SLURM_DIR/slurm.conf` and sbatch, srun, squeue work as on a cluster.
set -euo pipefail
SLURM_DIR=${SLURM_DIR:-/tmp/mpifsdp-slurm}
NODE=$(hostname -s)

install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # build-essential: mpi4py is built from source against this Open MPI (make install MPI=site)
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client slurm-wlm-basic-plugins \
    munge procps build-essential openmpi-bin libopenmpi-dev libpmix-dev >/dev/null
}

write_conf() {
  mkdir -p "$SLURM_DIR"/{state,spool,log}
  # The node's CPUs as slurmd counts them; a 2-core machine runs one 2-task job at a time.
  # cred_expire: a requeued job waits for its first run's credential to expire (120 s by default).
  local node_line
  node_line=$(slurmd -C | head -1)
  cat >"$SLURM_DIR/slurm.conf" <<CONF
ClusterName=mpifsdp-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=cred_expire=20
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
KillWait=30
InactiveLimit=0
MinJobAge=600
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  stop  # a controller or node daemon of an earlier start (their state is cleared: -c)
  write_conf
  mkdir -p /run/munge && chown munge:munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then  # the package makes one; a slimmed image may have lost it
    mungekey -c -k /etc/munge/munge.key && chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  export SLURM_CONF=$SLURM_DIR/slurm.conf
  slurmctld -c -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  # The node answers once slurmd has registered with the controller.
  for _ in $(seq 60); do
    if sinfo -h -N -o %T 2>/dev/null | grep -qx idle; then
      echo "Slurm is up: export SLURM_CONF=$SLURM_CONF"; return 0
    fi
    sleep 1
  done
  echo "Slurm did not start: see $SLURM_DIR/log" >&2; tail -20 "$SLURM_DIR"/log/*.log >&2; return 1
}

stop() {
  local conf=$SLURM_DIR/slurm.conf
  if pgrep -f "^slurmctld (-c )?-f $conf" >/dev/null; then  # the jobs an aborted run left
    SLURM_CONF=$conf timeout 20 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
  fi
  pkill -f "^slurm(ctld|d) (-c )?-f $conf" || true
  for _ in $(seq 30); do
    pgrep -f "^slurm(ctld|d) (-c )?-f $conf" >/dev/null || return 0
    sleep 1
  done
  pkill -9 -f "^slurm(ctld|d) (-c )?-f $conf" || true
}

"${1:?usage: one_node.sh install|start|stop}"
