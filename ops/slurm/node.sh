#!/usr/bin/env bash
# One node of a multi-node exgrpo-async job; ops/slurm/exgrpo.sbatch runs it once per node with srun.
#
#   nodes 0..L-1   learner ranks: torchrun (static rendezvous at HEAD:RDZV_PORT, node rank = SLURM_NODEID)
#                  runs `exgrpo-async learner` on P ranks per node (the node's first P GPUs); rank 0, the
#                  lead, is on node 0 and binds the ZeroMQ socket, the weight-sync store and /metrics on
#                  HEAD (fixed ports below); the other ranks only follow it
#   every node     actors on the GPUs left over (all of an actor node's): one `exgrpo-async actor --learner
#                  tcp://HEAD:ZMQ_PORT` per TP group (actor.engine.tensor_parallel_size GPUs each, out of
#                  CUDA_VISIBLE_DEVICES), CurveZMQ keys, /metrics on every interface, listed in the
#                  Prometheus targets under this node's address (EXGRPO_NODE_ADDR)
#
# Everything comes from the environment (the defaults in brackets); extra arguments are dotted config
# overrides, applied after the recipe's own (e.g. learner.max_steps=400):
#   SLURM_NODEID, SLURM_NNODES, SLURM_JOB_NODELIST, SLURM_JOB_ID   (set by srun; for a test set them by hand)
#   EXGRPO_HEAD_ADDR       node 0's address on the cluster network [node 0 of `scontrol show hostnames`,
#                          resolved to IPv4 with getent]; `node.sh --head-addr` prints it
#   EXGRPO_NODE_ADDR       this node's address for Prometheus [HEAD on node 0, else SLURMD_NODENAME or hostname]
#   EXGRPO_CONFIG          config file [the embedded CPU demo]; relative paths in it (data files) resolve
#                          against the folder node.sh starts in (srun: the submit folder, i.e. the repository)
#   EXGRPO_RUN_NAME        the run folder's name (also the `run` label in Prometheus) [slurm-$SLURM_JOB_ID]
#   EXGRPO_OUT             job folder [$PWD/runs/$EXGRPO_RUN_NAME]; each node works in its own
#                          EXGRPO_NODE_DIR [$EXGRPO_OUT/node-$SLURM_NODEID]: logs, and on node 0 the run folder
#                          $EXGRPO_NODE_DIR/$EXGRPO_RUN_NAME; no node reads or writes another node's folder
#   EXGRPO_RESUME=1        continue the run in that run folder from its newest checkpoint
#   EXGRPO_KEYS            CurveZMQ key folder made by ops/make-keys before srun [$EXGRPO_OUT/keys]; an actor
#                          node uses $EXGRPO_KEYS/clients/node$SLURM_NODEID when it exists, else the folder itself
#   EXGRPO_LEARNER_NODES   L, nodes that run learner ranks [1]
#   EXGRPO_GPUS_PER_NODE   [SLURM_GPUS_ON_NODE, else the CUDA_VISIBLE_DEVICES list, else nvidia-smi -L, else 0]
#   EXGRPO_LEARNER_PROCS_PER_NODE   learner ranks per learner node [GPUs per node, at least 1];
#                          learner.world_size is set to L times this
#   EXGRPO_ACTORS_PER_NODE [GPUs left after this node's learner ranks / tensor_parallel_size; without
#                          GPUs: 0 on learner nodes, 1 on the others]
#   EXGRPO_ZMQ_PORT [29510]  EXGRPO_STORE_PORT [29511]  EXGRPO_RDZV_PORT [29512]  EXGRPO_METRICS_PORT [29513]
#   EXGRPO_ACTOR_METRICS_PORT [0: a free port per actor]
#   EXGRPO_SD_DIR          Prometheus file-SD folder the learner writes <run>.json into [ops/prometheus/targets]
#   EXGRPO_IFNAME          network interface for gloo/NCCL (sets GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)
#   EXGRPO_LEARNER_WAIT_S  how long actors wait for the learner's port [3600]
#   EXGRPO_ACTOR_RESTARTS  restarts of an actor that exits with an error [3]
#   EXGRPO_ACTOR_GRACE_S   on a learner node, how long its actors get to stop after the learner ends [60]
#   EXGRPO_DRY_RUN=1       print the commands instead of running them
#   PYTHON [.venv/bin/python]  TORCHRUN [torchrun next to PYTHON]
# Ports, what is encrypted and what is not: docs/multinode.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PY=${PYTHON:-$ROOT/.venv/bin/python}
die() { echo "node.sh: $*" >&2; exit 2; }

head_addr() {
  if [ -n "${EXGRPO_HEAD_ADDR:-}" ]; then echo "$EXGRPO_HEAD_ADDR"; return; fi
  [ -n "${SLURM_JOB_NODELIST:-}" ] || die "set EXGRPO_HEAD_ADDR (or run under SLURM)"
  local name ip
  name=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')  # reads all: no SIGPIPE under pipefail
  ip=$(getent ahostsv4 "$name" | awk 'NR == 1 {print $1}')
  [ -n "$ip" ] || die "cannot resolve node 0 ($name); set EXGRPO_HEAD_ADDR"
  case "$ip" in 127.*) die "node 0 ($name) resolves to $ip, a loopback address; set EXGRPO_HEAD_ADDR to its address on the cluster network";; esac
  echo "$ip"
}

if [ "${1:-}" = "--head-addr" ]; then head_addr; exit 0; fi

NODE=${SLURM_NODEID:-0}
NNODES=${SLURM_NNODES:-1}
HEAD=$(head_addr)
L=${EXGRPO_LEARNER_NODES:-1}
[ "$L" -ge 1 ] && [ "$L" -le "$NNODES" ] || die "EXGRPO_LEARNER_NODES=$L must be between 1 and the $NNODES nodes"
RUN_NAME=${EXGRPO_RUN_NAME:-slurm-${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}}
OUT=$(realpath -m "${EXGRPO_OUT:-$PWD/runs/$RUN_NAME}")
NODE_DIR=$(realpath -m "${EXGRPO_NODE_DIR:-$OUT/node-$NODE}")
KEYS=$(realpath -m "${EXGRPO_KEYS:-$OUT/keys}")
SD_DIR=$(realpath -m "${EXGRPO_SD_DIR:-$ROOT/ops/prometheus/targets}")
CONFIG=""; CONFIG_ARGS=()
if [ -n "${EXGRPO_CONFIG:-}" ]; then CONFIG=$(realpath "$EXGRPO_CONFIG"); CONFIG_ARGS=(--config "$CONFIG"); fi
RESUME_ARGS=(); [ "${EXGRPO_RESUME:-0}" = 0 ] || RESUME_ARGS=(--resume)
ZMQ_PORT=${EXGRPO_ZMQ_PORT:-29510}
STORE_PORT=${EXGRPO_STORE_PORT:-29511}
RDZV_PORT=${EXGRPO_RDZV_PORT:-29512}
METRICS_PORT=${EXGRPO_METRICS_PORT:-29513}
ACTOR_METRICS_PORT=${EXGRPO_ACTOR_METRICS_PORT:-0}
if [ "$NODE" -eq 0 ]; then NODE_ADDR=${EXGRPO_NODE_ADDR:-$HEAD}; else NODE_ADDR=${EXGRPO_NODE_ADDR:-${SLURMD_NODENAME:-$(hostname)}}; fi
[ -f "$KEYS/server.key" ] || die "no CurveZMQ keys in $KEYS: run ops/make-keys $KEYS before srun (exgrpo.sbatch does)"

if [ -n "${EXGRPO_GPUS_PER_NODE:-}" ]; then G=$EXGRPO_GPUS_PER_NODE
elif [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then G=$SLURM_GPUS_ON_NODE
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then G=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
elif command -v nvidia-smi >/dev/null 2>&1; then G=$(nvidia-smi -L | grep -c '^GPU' || true)
else G=0; fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a DEVICES <<<"$CUDA_VISIBLE_DEVICES"
else DEVICES=(); for ((d = 0; d < G; d++)); do DEVICES+=("$d"); done; fi
P=${EXGRPO_LEARNER_PROCS_PER_NODE:-$((G > 0 ? G : 1))}

# the recipe's overrides; the command line's come after them, so they win
OVERRIDES=(learner.world_size=$((L * P)) transport.host="$HEAD" transport.port="$ZMQ_PORT"
           transport.curve_keys_dir="$KEYS" weight_sync.port="$STORE_PORT" metrics.host="$HEAD"
           metrics.port="$METRICS_PORT" metrics.actor_host=0.0.0.0 metrics.actor_port="$ACTOR_METRICS_PORT"
           metrics.sd_dir="$SD_DIR" "$@")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the config is checked on every node before anything starts; it gives the TP size and the thread counts
read -r TP LEARNER_THREADS ACTOR_THREADS < <("$PY" - "$CONFIG" "${OVERRIDES[@]}" <<'PY'
import sys
from exgrpo_async.config_io import load_config
try:
    c = load_config(sys.argv[1] or None, sys.argv[2:])
except ValueError as e:
    sys.exit(f"node.sh: {e}")
print(c.actor.engine.tensor_parallel_size, c.learner.threads, c.actor.threads)
PY
) || die "bad config or overrides"
if [ -n "${EXGRPO_IFNAME:-}" ]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$EXGRPO_IFNAME} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$EXGRPO_IFNAME}
fi

show() { printf '%q ' "$@"; echo; }  # a command line, for EXGRPO_DRY_RUN=1
LEARNER_PID=""
ACTOR_PIDS=()
stop_children() {
  trap - TERM INT
  kill -TERM $LEARNER_PID "${ACTOR_PIDS[@]}" 2>/dev/null || true
  wait || true
  exit 143
}
trap stop_children TERM INT
mkdir -p "$NODE_DIR"  # the processes keep the folder node.sh started in: relative paths in the config
                     # (data files) resolve as they do for `exgrpo-async train`; what they write is in NODE_DIR
echo "node.sh: node $NODE of $NNODES ($NODE_ADDR), head $HEAD; folder $NODE_DIR"

# ------------------------------------------------------------------ learner ranks (nodes 0..L-1)
USED=0
if [ "$NODE" -lt "$L" ]; then
  USED=$((G > 0 ? P : 0))
  [ "$USED" -le "${#DEVICES[@]}" ] || die "$P learner ranks per node need more than the ${#DEVICES[@]} GPUs"
  TORCHRUN=${TORCHRUN:-$(dirname "$PY")/torchrun}
  RUN_DIR=$NODE_DIR/$RUN_NAME
  echo "node.sh: learner ranks $((NODE * P))..$((NODE * P + P - 1)) of $((L * P))$([ "$NODE" -ne 0 ] || echo "; run folder $RUN_DIR")"
  LEARNER_ENV=(OMP_NUM_THREADS="$LEARNER_THREADS")
  [ "$G" -eq 0 ] || LEARNER_ENV+=(CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${DEVICES[*]:0:$P}")")
  # static rendezvous: node rank = SLURM_NODEID, so global rank 0 (the lead, which binds HEAD) is on
  # node 0; c10d orders the nodes by host name and could put it anywhere
  cmd=(env "${LEARNER_ENV[@]}" "$TORCHRUN" --nnodes "$L" --nproc-per-node "$P" --node-rank "$NODE"
       --rdzv-backend static --rdzv-endpoint "$HEAD:$RDZV_PORT" --max-restarts 0
       -m exgrpo_async.launcher.cli learner "${CONFIG_ARGS[@]}" --run-dir "$RUN_DIR" "${RESUME_ARGS[@]}" "${OVERRIDES[@]}")
  if [ "${EXGRPO_DRY_RUN:-0}" = 1 ]; then show "${cmd[@]}"; else "${cmd[@]}" & LEARNER_PID=$!; fi  # $!: torchrun itself
fi

# ------------------------------------------------------------------ actors (the GPUs left over)
if [ -n "${EXGRPO_ACTORS_PER_NODE:-}" ]; then A=$EXGRPO_ACTORS_PER_NODE
elif [ "$G" -gt 0 ]; then A=$(((G - USED) / TP))
elif [ "$NODE" -lt "$L" ]; then A=0
else A=1; fi
[ "$G" -eq 0 ] || [ $((USED + A * TP)) -le ${#DEVICES[@]} ] \
  || die "$A actors x TP $TP after $USED learner GPUs need more than the ${#DEVICES[@]} GPUs"
[ "$A" -gt 0 ] || [ "$NODE" -lt "$L" ] || die "no actor fits on this node: $G GPUs, tensor_parallel_size=$TP"
ACTOR_KEYS=$KEYS/clients/node$NODE
[ -d "$ACTOR_KEYS" ] || ACTOR_KEYS=$KEYS
LEARNER=tcp://$HEAD:$ZMQ_PORT

wait_for_learner() {  # the learner's socket opens once its weights are published (minutes for a big model)
  local deadline=$((SECONDS + ${EXGRPO_LEARNER_WAIT_S:-3600}))
  until (exec 3<>"/dev/tcp/$HEAD/$ZMQ_PORT") 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || { echo "node.sh: no learner at $HEAD:$ZMQ_PORT after ${EXGRPO_LEARNER_WAIT_S:-3600}s" >&2; return 1; }
    [ -z "$LEARNER_PID" ] || kill -0 "$LEARNER_PID" 2>/dev/null || return 1  # this node's learner rank died
    sleep 2
  done
}

actor_slot() {  # one actor, restarted when it fails (the learner re-issues its work)
  local i=$1 gpus=$2 log=$NODE_DIR/actor-$1.log tries=0 rc pid=
  trap '[ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null; wait; exit 143' TERM INT
  local cmd=("$PY" -m exgrpo_async.launcher.cli actor --learner "$LEARNER" --keys "$ACTOR_KEYS" --advertise-host "$NODE_ADDR")
  if [ "${EXGRPO_DRY_RUN:-0}" = 1 ]; then echo "CUDA_VISIBLE_DEVICES=$gpus $(show "${cmd[@]}")"; return 0; fi
  wait_for_learner || return 1
  while :; do
    CUDA_VISIBLE_DEVICES=$gpus OMP_NUM_THREADS=$ACTOR_THREADS "${cmd[@]}" >>"$log" 2>&1 &
    pid=$!
    rc=0; wait "$pid" || rc=$?
    pid=
    [ "$rc" -ne 0 ] || return 0
    tries=$((tries + 1))
    echo "node.sh: actor $i exited with code $rc (last lines of $log):" >&2
    tail -n 20 "$log" >&2 || true
    [ "$tries" -le "${EXGRPO_ACTOR_RESTARTS:-3}" ] || return "$rc"
    echo "node.sh: restarting actor $i ($tries/${EXGRPO_ACTOR_RESTARTS:-3})" >&2
    sleep 5
  done
}

[ "$A" -eq 0 ] || echo "node.sh: $A actor(s) joining $LEARNER with keys $ACTOR_KEYS; logs $NODE_DIR/actor-*.log"
for ((i = 0; i < A; i++)); do
  gpus=""
  [ "$G" -eq 0 ] || gpus=$(IFS=,; echo "${DEVICES[*]:$((USED + i * TP)):$TP}")
  actor_slot "$i" "$gpus" &
  ACTOR_PIDS+=($!)
done

# ------------------------------------------------------------------ wait
rc=0
if [ -n "$LEARNER_PID" ]; then
  wait "$LEARNER_PID" || rc=$?
  # the learner told this node's actors to stop when it finished; give them a moment, then make sure
  for ((t = 0; t < ${EXGRPO_ACTOR_GRACE_S:-60}; t++)); do
    alive=0
    for pid in "${ACTOR_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 1 ] || break
    sleep 1
  done
  kill -TERM "${ACTOR_PIDS[@]}" 2>/dev/null || true
  wait || true
  exit "$rc"
fi
for pid in "${ACTOR_PIDS[@]}"; do wait "$pid" || rc=$?; done
exit "$rc"
