#!/bin/bash
# A real Slurm cluster on this one machine, for trying launch/slurm/pretrain.sbatch and for the tests:
# Debian's slurm-wlm + MUNGE, one slurmctld and three slurmd daemons on 127.0.0.1 acting as nodes n1, n2
# (partition `debug`, the default) and n3 (partitions `low` and `high`, where a `high` job preempts a
# `low` one with PreemptMode=REQUEUE). Needs root; installs the packages with apt-get when missing.
#
#   launch/slurm/local_cluster.sh up       install if needed, write the config, start the daemons, wait
#                                           until every node is idle (does nothing more if already up)
#   launch/slurm/local_cluster.sh status   daemons and nodes; exit 0 when up and every node responds
#   launch/slurm/local_cluster.sh down     cancel the cluster's jobs, stop the daemons by their PID files
#
# Exit status 3 means Slurm cannot be installed or started here (not root, no apt-get, a foreign Slurm
# configuration in the way); tests that need the cluster skip on it. Settings (environment):
#   LINSCALE_SLURM_DIR   state, spool, logs and PID files (default /var/tmp/linscale-slurm)
#   LINSCALE_SLURM_CONF  the slurm.conf written and used (default /etc/slurm/slurm.conf, where the Slurm
#                        commands look; elsewhere, export SLURM_CONF to the same path for the commands)
#   LINSCALE_SLURM_CPUS  CPUs each node advertises (default 12). Deliberately more than a small machine has
#                        (SlurmdParameters=config_overrides): a few small jobs run side by side, and a
#                        job asking for more CPUs than a node has fails at once instead of pending forever.
#   LINSCALE_SLURM_PORT  first of four TCP ports (default 6817: slurmctld, then one per slurmd)
set -euo pipefail

DIR=${LINSCALE_SLURM_DIR:-/var/tmp/linscale-slurm}
CONF=${LINSCALE_SLURM_CONF:-/etc/slurm/slurm.conf}
CPUS=${LINSCALE_SLURM_CPUS:-12}
PORT=${LINSCALE_SLURM_PORT:-6817}
NODES=(n1 n2 n3)
MARK="# linscale local cluster (launch/slurm/local_cluster.sh)"
HOSTS_MARK="# linscale local Slurm nodes"
export SLURM_CONF=$CONF

say() { echo "[local_cluster] $*" >&2; }
cannot() { say "$*"; exit 3; }
die() { say "$*"; exit 1; }

# -- install --------------------------------------------------------------------------------------------
have_slurm() { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null

install_slurm() {
  have_slurm && return 0
  [[ $(id -u) == 0 ]] || cannot "Slurm is not installed and installing it needs root: run as root, or install slurmctld slurmd slurm-client munge"
  command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get here: install slurmctld, slurmd, slurm-client and munge (Slurm 22.05 or newer)"
  say "installing slurmctld slurmd slurm-client munge with apt-get"
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
             slurmctld slurmd slurm-client munge)
  "${apt[@]}" >"$DIR/apt.log" 2>&1 || { apt-get update -q >>"$DIR/apt.log" 2>&1 && "${apt[@]}" >>"$DIR/apt.log" 2>&1; } \
    || cannot "apt-get could not install Slurm (log: $DIR/apt.log)"
  have_slurm || cannot "apt-get ran but slurmctld/slurmd/sbatch/munged are still missing (log: $DIR/apt.log)"
}

# -- configuration ----------------------------------------------------------------------------------------
write_config() {
  local host tmp
  host=$(uname -n)
  host=${host%%.*}
  mkdir -p "$(dirname "$CONF")" "$DIR"/{state,log,run} "${NODES[@]/#/$DIR/spool/}"
  if [[ -e $CONF ]] && ! grep -qxF "$MARK" "$CONF"; then
    cannot "$CONF exists and was not written by this script (a real cluster's?); leaving it alone. Use another path: LINSCALE_SLURM_CONF=/path/slurm.conf, and export SLURM_CONF=/path/slurm.conf for the Slurm commands"
  fi
  tmp=$(mktemp)
  cat >"$tmp" <<EOF
$MARK
ClusterName=linscale
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again once its old credential expired: 10 s instead of 120
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
# one host, no cgroups: processes are tracked by parentage, tasks are not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# nodes advertise the CPUs configured here, not the machine's
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=900
# SIGTERM to SIGKILL: time for a trainer on a busy machine to write its checkpoint
KillWait=60
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
EOF
  local i=0 n
  for n in "${NODES[@]}"; do
    i=$((i + 1))
    echo "NodeName=$n NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=4000 State=UNKNOWN" >>"$tmp"
  done
  cat >>"$tmp" <<EOF
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF
PartitionName=low Nodes=n3 MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=high Nodes=n3 MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
  if [[ -e $CONF ]] && cmp -s "$tmp" "$CONF"; then rm -f "$tmp"; return 1; fi  # unchanged
  install -m 644 "$tmp" "$CONF" 2>/dev/null || { cp "$tmp" "$CONF"; chmod 644 "$CONF"; }
  rm -f "$tmp"
  return 0
}

# node names must resolve: MASTER_ADDR is the first node's name
hosts_entry() {
  local missing=() n
  for n in "${NODES[@]}"; do getent hosts "$n" >/dev/null || missing+=("$n"); done
  (( ${#missing[@]} )) || return 0
  echo "127.0.0.1 ${missing[*]} $HOSTS_MARK" >>/etc/hosts
}

# -- daemons ----------------------------------------------------------------------------------------------
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_ok && return 0
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  rm -f /run/munge/munged.pid
  runuser -u munge -- munged 2>"$DIR/log/munged.err" || die "munged did not start: $(cat "$DIR/log/munged.err")"
  for _ in $(seq 50); do
    if munge_ok && [[ -s /run/munge/munged.pid ]]; then
      cp /run/munge/munged.pid "$DIR/run/munged.pid"  # marks this munged as ours: `down` stops it
      return 0
    fi
    sleep 0.1
  done
  die "munged started but munge -n | unmunge fails (log: /var/log/munge/munged.log)"
}

start_slurm() {
  if ! pid_alive "$DIR/run/slurmctld.pid"; then
    # -i: start even if the saved state does not match the configuration (nodes or partitions changed)
    slurmctld -i -f "$CONF" || die "slurmctld did not start (log: $DIR/log/slurmctld.log)"
  fi
  local n
  for n in "${NODES[@]}"; do
    pid_alive "$DIR/run/slurmd-$n.pid" || slurmd -N "$n" -f "$CONF" || die "slurmd -N $n did not start (log: $DIR/log/slurmd-$n.log)"
  done
}

nodes_idle() {  # every node responding and idle or running jobs (not down, drained or unknown)
  local states
  states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u) || return 1
  [[ $(grep -cE ' (idle|mixed|allocated|completing)$' <<<"$states") == "${#NODES[@]}" ]]
}

wait_ready() {
  local t0=$SECONDS n
  until nodes_idle; do
    if (( SECONDS - t0 > 90 )); then
      sinfo -N 2>&1 >&2 || true
      die "nodes not idle after 90 s (logs: $DIR/log/)"
    fi
    # a node that registered before slurmctld knew it, or was down at a restart, is told to come back
    if (( SECONDS - t0 > 5 )); then
      for n in $(sinfo -h -N -t down,drained,fail -o '%N' 2>/dev/null | sort -u); do
        scontrol update NodeName="$n" State=RESUME 2>/dev/null || true
      done
    fi
    sleep 0.5
  done
}

stop_pidfile() {  # stop a daemon by its PID file: TERM, then KILL after 20 s
  local f=$1 pid
  [[ -s $f ]] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { say "pid $pid did not stop on TERM; killing it"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  rm -f "$f"
}

# -- commands ---------------------------------------------------------------------------------------------
up() {
  [[ $(id -u) == 0 ]] || { have_slurm && status >/dev/null 2>&1 && return 0; cannot "starting the Slurm daemons needs root"; }
  mkdir -p "$DIR"
  install_slurm
  local changed=0
  write_config && changed=1
  hosts_entry
  if (( changed )) && pid_alive "$DIR/run/slurmctld.pid"; then
    say "configuration changed: restarting the daemons"
    stop_daemons
  fi
  start_munge
  start_slurm
  wait_ready
  say "up: $(sinfo -h -o '%P %D %T %N' | tr '\n' ';') config $CONF, logs $DIR/log"
}

stop_daemons() {
  local n
  for n in "${NODES[@]}"; do stop_pidfile "$DIR/run/slurmd-$n.pid"; done
  stop_pidfile "$DIR/run/slurmctld.pid"
}

down() {
  if pid_alive "$DIR/run/slurmctld.pid"; then
    # jobs first: their processes belong to slurmstepd, which outlives slurmd
    local jobs
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ') || true
    if [[ -n ${jobs// } ]]; then
      say "cancelling jobs: $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      # squeue without -t lists pending, running and completing jobs: wait until their processes are gone
      for _ in $(seq 240); do [[ -z $(squeue -h -o %A 2>/dev/null | tr -d ' \n') ]] && break; sleep 0.5; done
    fi
  fi
  stop_daemons
  stop_pidfile "$DIR/run/munged.pid"   # only a munged this script started has this file
  say "down"
}

status() {
  local ok=0 f name
  for f in "$DIR"/run/slurmctld.pid "${NODES[@]/#/$DIR/run/slurmd-}" "$DIR"/run/munged.pid; do
    f=${f%.pid}.pid
    name=$(basename "$f" .pid)
    if pid_alive "$f"; then echo "$name: running (pid $(cat "$f"))"
    elif [[ $name == munged ]] && munge_ok; then echo "munged: running (not started by this script)"
    else echo "$name: not running"; ok=1; fi
  done
  if (( ok == 0 )) && nodes_idle; then
    sinfo -N -o '%N %P %C %T' 2>&1
    return 0
  fi
  return 1
}

case ${1:-} in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
