# Sourced by the Slurm job scripts in jobs/: runs train under the job's launcher in the job's
# run directory and applies Strata's one preemption rule (docs/slurm.md):
#   - The time-limit warning (#SBATCH --signal=B:USR1@T) and a manual preemption
#     (scancel --signal=USR1 --batch JOB) reach this shell as USR1. It is passed to the ranks,
#     which save a checkpoint and exit 3, and this shell requeues the job: the same job id, so
#     the same run directory, and --resume auto continues from the checkpoint.
#   - A plain scancel (and Slurm's own preemption) sends SIGTERM to every process of the job:
#     the ranks save if they can and exit 3; this shell never requeues then (a cancelled job stays
#     cancelled; Slurm requeues a job it preempts with PreemptMode=REQUEUE itself).
# Usage, in a job script:
#   source jobs/lib/run.sh
#   strata_args "$@"                  # the arguments given to sbatch after the script
#   strata_default --save-every 469   # a default of the job, unless those arguments set it
#   strata_run ./build/train --config FILE
# train gets the job's arguments and defaults, then the run directory's --checkpoint-dir,
# --resume auto, --log-file and --metrics unless given. STRATA_LAUNCHER=srun|mpirun chooses the
# launcher; default: srun --mpi=pmix where Slurm has PMIx, else Open MPI's mpirun (which reads
# the allocation from Slurm). STRATA_NTASKS=N outside Slurm (no SLURM_JOB_ID): mpirun starts N
# ranks on this machine (--oversubscribe, unbound: a workstation or a test).
# STRATA_ELASTIC=N (an elastic job, docs/slurm.md "Elastic jobs"): when train ends because ranks
# were lost (a node failed or its ranks were killed: the watchdog's exit 5, or the launcher
# reporting a rank killed or a node failure), train is launched again on the nodes left, at most
# N times, with --layout auto (a layout re-planned for the smaller world) and --resume auto (the
# newest checkpoint, in any layout). STRATA_RANKS_PER_NODE=k (nodes simulated on one machine,
# as train treats them) makes the nodes sim0, sim1, ... of k ranks each.

STRATA_ARGS=()
strata_args() { STRATA_ARGS=("$@"); }
# Appends FLAG VALUE to the arguments unless they hold FLAG already (as FLAG or FLAG=...).
strata_default() {
  local a
  for a in "${STRATA_ARGS[@]}"; do [[ "$a" == "$1" || "$a" == "$1="* ]] && return 0; done
  STRATA_ARGS+=("$1" "$2")
}

# The value of FLAG in the arguments (the last one given), or nothing.
strata_value() {
  local a value="" take=0
  for a in "${STRATA_ARGS[@]}"; do
    if ((take)); then value=$a; take=0
    elif [[ "$a" == "$1" ]]; then take=1
    elif [[ "$a" == "$1="* ]]; then value=${a#*=}
    fi
  done
  printf '%s' "$value"
}

# Copies rank 0's lines from its log FILE (from byte OFFSET, this run's start) into the job's
# output, from the line 'preemption signal received' on: mpirun stops forwarding the ranks'
# output at a scancel's SIGTERM while they save (docs/slurm.md), and sleeps until Slurm kills it.
# It may have forwarded the first of them before it stopped: a line the job's output already
# holds (the first looked for half a second after rank 0 wrote it) is not copied again. It ignores SIGTERM itself and
# ends when the runner kills it or with the job.
strata_follow_final_lines() {
  trap '' TERM INT
  local line copying=0 out
  out=$(readlink -f "/proc/$$/fd/1" 2>/dev/null || true)
  [ -f "$out" ] || out=/dev/null  # output to a pipe or terminal: nothing to compare with
  tail -c "+$(($2 + 1))" -F "$1" 2>/dev/null | while IFS= read -r line; do
    [[ "$line" == "preemption signal received"* ]] && copying=1
    ((copying)) || continue
    # mpirun forwards a line within milliseconds when it still forwards at all: the first may be
    # on its way.
    ((copying++ == 1)) && sleep 0.5
    grep -qxF -- "$line" "$out" || printf '%s\n' "$line"
  done
}

# --- Elastic jobs -------------------------------------------------------------------------------
# The job's nodes (Slurm's host names, or sim0, sim1, ... when simulated) and the ranks on each:
# rank r of a launch runs on STRATA_NODES[r / STRATA_PER_NODE] (block placement: srun's default
# distribution, mpirun's --map-by slot).
STRATA_NODES=()
STRATA_PER_NODE=0

# "2-3,5" -> "2 3 5"
strata_expand() {
  local part n
  local -a all=()
  for part in ${1//,/ }; do
    if [[ "$part" =~ ^([0-9]+)-([0-9]+)$ ]]; then
      for ((n = BASH_REMATCH[1]; n <= BASH_REMATCH[2]; ++n)); do all+=("$n"); done
    elif [[ "$part" =~ ^[0-9]+$ ]]; then
      all+=("$part")
    fi
  done
  printf '%s\n' "${all[*]}"
}

# The evidence of lost ranks and nodes in a launch's stderr (FILE), one per line: "rank R" (a rank
# that died or stopped answering), "unknown R [HOST]" (a rank a watchdog line could not see: on
# another node than the rank that wrote it, HOST where the line names it), "host H" (a node the
# launcher lost).
#  - The watchdog (exit 5): the first line that a wait passed --timeout; the launcher's own kill
#    lines that follow it are consequences (srun reports every rank killed then).
#  - Else the launcher: mpirun names the first process that died of SIGKILL (not under --quiet,
#    which elastic jobs leave out); srun the tasks killed before it aborted the step (it kills
#    the others itself, and says so in the same words, after "Job step aborted").
#  - A node the launcher lost: mpirun's "Remote daemon ... on node H", srun's "Node failure on H".
strata_elastic_evidence() {
  local file=$1 line r
  line=$(grep -m1 -E '\] watchdog: .* not complete after ' "$file")
  if [ -n "$line" ]; then
    grep -oE 'rank [0-9]+ \(no sign of life' <<<"$line" | awk '{print "rank", $2}'
    # "; ranks 2, 3 (hostB), 6 (hostC): unknown (not on this node)", or without the hosts.
    sed -nE 's/.*; ranks ([^:]+): unknown \(not on this node\).*/\1/p' <<<"$line" | awk -F', ' '{
      n = 0
      for (i = 1; i <= NF; ++i) {
        split($i, f, " "); ranks[++n] = f[1]
        if (f[2] != "") { gsub(/[()]/, "", f[2]); for (j = 1; j <= n; ++j) print "unknown", ranks[j], f[2]; n = 0 }
      }
      for (j = 1; j <= n; ++j) print "unknown", ranks[j]
    }'
  else
    sed -nE 's/.*process rank ([0-9]+) with PID [0-9]+ on node \S+ exited on signal 9 .*/rank \1/p' "$file"
    local tasks
    for tasks in $(sed -nE '/^srun: Job step aborted/q; s/^srun: error: \S+: tasks? ([0-9,-]+): Killed$/\1/p' "$file"); do
      for r in $(strata_expand "$tasks"); do echo "rank $r"; done
    done
  fi
  sed -nE 's/.*Remote daemon: .* on node (\S+).*/host \1/p; s/^srun: error: Node failure on (\S+).*/host \1/p' "$file"
}

# The indices (into STRATA_NODES) of the nodes Slurm has lost: no longer in the job's allocation
# (with --no-kill Slurm removes a failed node from it), down, drained, failing or not responding
# (sinfo's '*'), or not running a one-task step within STRATA_ELASTIC_PROBE_S seconds (default 30:
# a node Slurm has not noticed yet, SlurmdTimeout being minutes). Skips the indices given.
strata_elastic_slurm_lost() {
  local i host state current nodelist
  local -a probes=()
  nodelist=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -nE 's/.* NodeList=(\S+).*/\1/p')
  current=" $(scontrol show hostnames "$nodelist" 2>/dev/null | tr '\n' ' ') "
  for i in "${!STRATA_NODES[@]}"; do
    [[ " $* " == *" $i "* ]] && continue
    host=${STRATA_NODES[$i]}
    if [ -n "$nodelist" ] && [[ "$current" != *" $host "* ]]; then echo "$i"; continue; fi
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null | head -1)
    case "$state" in down*|drain*|drng*|fail*|maint*|*'*') echo "$i"; continue ;; esac
    ( timeout "${STRATA_ELASTIC_PROBE_S:-30}" srun --overlap --nodes=1 --ntasks=1 --nodelist="$host" true \
        >/dev/null 2>&1 || echo "$i" ) &
    probes+=($!)
  done
  ((${#probes[@]})) && wait "${probes[@]}"
  return 0
}

# "2 3 5" -> "2-3, 5"
strata_ranges() {
  local text="" first="" last="" r
  for r in $1 ""; do
    if [ -n "$last" ] && [ "$r" = $((last + 1)) ]; then last=$r; continue; fi
    if [ -n "$first" ]; then
      text+="${text:+, }$first"
      [ "$last" != "$first" ] && text+="-$last"
    fi
    first=$r; last=$r
  done
  printf '%s' "$text"
}

# Sets up an elastic job (STRATA_ELASTIC): --layout auto and --resume auto, the nodes and their
# ranks. A fixed layout in the job's arguments is refused: the nodes left may not hold it.
strata_elastic_setup() {
  local a world=${SLURM_NTASKS:-${STRATA_NTASKS:-}} sim=${STRATA_RANKS_PER_NODE:-}
  for a in "$@" "${STRATA_ARGS[@]}"; do
    case "$a" in
      --tp|--tp=*|--pp|--pp=*|--zero|--zero=*|--micro-batch|--micro-batch=*|--recompute|--recompute=*|\
      --schedule|--schedule=*|--virtual-stages|--virtual-stages=*)
        echo "strata: STRATA_ELASTIC: the layout is re-planned for the nodes left (--layout auto):" \
             "leave out ${a%%=*}" >&2
        return 2 ;;
    esac
  done
  if [ -n "$(strata_value --layout)" ] && [ "$(strata_value --layout)" != auto ]; then
    echo "strata: STRATA_ELASTIC: the layout is re-planned for the nodes left: --layout auto, found --layout" \
         "$(strata_value --layout)" >&2
    return 2
  fi
  if [ "$(strata_value --resume)" != auto ]; then
    echo "strata: STRATA_ELASTIC continues from the newest checkpoint (--resume auto), found --resume" \
         "$(strata_value --resume)" >&2
    return 2
  fi
  strata_default --layout auto
  STRATA_NODES=()
  if [ -n "$sim" ]; then
    if ! [[ "$sim" =~ ^[1-9][0-9]*$ && "$world" =~ ^[1-9][0-9]*$ ]] || ((world % sim)); then
      echo "strata: STRATA_ELASTIC with simulated nodes of STRATA_RANKS_PER_NODE=$sim ranks needs a world of whole" \
           "nodes (SLURM_NTASKS or STRATA_NTASKS), found '${world}'" >&2
      return 2
    fi
    STRATA_PER_NODE=$sim
    for ((a = 0; a < world / sim; ++a)); do STRATA_NODES+=("sim$a"); done
  elif [ -n "${SLURM_JOB_ID:-}" ]; then
    mapfile -t STRATA_NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-}")
    # SLURM_TASKS_PER_NODE, e.g. "4(x2)": the same number on every node, else not elastic.
    local counts
    counts=$(sed -E 's/\(x[0-9]+\)//g; s/,/\n/g' <<<"${SLURM_TASKS_PER_NODE:-}" | sort -u)
    if ! [[ "$counts" =~ ^[1-9][0-9]*$ ]] || ((${#STRATA_NODES[@]} == 0)); then
      echo "strata: STRATA_ELASTIC needs the same number of tasks on every node (--ntasks-per-node), found" \
           "SLURM_TASKS_PER_NODE='${SLURM_TASKS_PER_NODE:-}'" >&2
      return 2
    fi
    STRATA_PER_NODE=$counts
  else
    echo "strata: STRATA_ELASTIC needs Slurm, or nodes simulated on this machine (STRATA_RANKS_PER_NODE)" >&2
    return 2
  fi
}

# After a launch of an elastic job ended with exit code RC (not 0, 2, 3, 4; no stop signal): finds
# the nodes lost, drops them from STRATA_NODES and says so in one line; fails (no relaunch) when
# no node can be named as lost, none is left, or the job has continued LIMIT times (DONE so far).
strata_elastic_continue() {
  local rc=$1 done=$2 limit=$3 what kind r i
  local -a unknown=()
  local -A is_lost=()
  local count=${#STRATA_NODES[@]}
  # The node of a rank: the host named with it (on a cluster), else by block placement.
  strata_node_of() {
    local i
    if [ -n "$2" ] && [ -z "${STRATA_RANKS_PER_NODE:-}" ]; then
      for i in "${!STRATA_NODES[@]}"; do [ "${STRATA_NODES[$i]}" = "$2" ] && { echo "$i"; return; }; done
    fi
    (($1 / STRATA_PER_NODE < count)) && echo $(($1 / STRATA_PER_NODE))
  }
  local host
  while read -r kind what host; do
    case "$kind" in
      rank) i=$(strata_node_of "$what" ""); [ -n "$i" ] && is_lost[$i]=1 ;;
      unknown) i=$(strata_node_of "$what" "$host"); [ -n "$i" ] && unknown+=("$i") ;;
      host)
        [ -n "${STRATA_RANKS_PER_NODE:-}" ] && continue  # one real host: it names no simulated node
        for i in "${!STRATA_NODES[@]}"; do [ "${STRATA_NODES[$i]}" = "$what" ] && is_lost[$i]=1; done ;;
    esac
  done < <(strata_elastic_evidence "$run_dir/launcher-stderr.log")
  # Ranks a watchdog could not see count when they are all on one node (two nodes: the other one).
  if ((${#is_lost[@]} == 0 && ${#unknown[@]})) && [ "$(printf '%s\n' "${unknown[@]}" | sort -u | wc -l)" = 1 ]; then
    is_lost[${unknown[0]}]=1
  fi
  if [ -z "${STRATA_RANKS_PER_NODE:-}" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    for i in $(strata_elastic_slurm_lost "${!is_lost[@]}"); do is_lost[$i]=1; done
  fi
  if ((${#is_lost[@]} == 0)); then
    echo "strata: elastic: no lost node found (train exited $rc): not continuing"
    return 1
  fi
  local -a left=() names=()
  for i in "${!STRATA_NODES[@]}"; do
    if [ -n "${is_lost[$i]:-}" ]; then
      if ((STRATA_PER_NODE == 1)); then
        names+=("${STRATA_NODES[$i]} (rank $i)")
      else
        names+=("${STRATA_NODES[$i]} (ranks $(strata_ranges "$(seq -s ' ' $((i * STRATA_PER_NODE)) \
                $(((i + 1) * STRATA_PER_NODE - 1)))"))")
      fi
    else
      left+=("${STRATA_NODES[$i]}")
    fi
  done
  local plural="" ; ((${#names[@]} > 1)) && plural=s
  if ((${#left[@]} == 0)); then
    echo "strata: lost node$plural $(strata_ranges_join "${names[@]}"): no node left"
    return 1
  fi
  if ((done >= limit)); then
    echo "strata: lost node$plural $(strata_ranges_join "${names[@]}"): not continuing (STRATA_ELASTIC=$limit" \
         "relaunch(es) used)"
    return 1
  fi
  local step=0 latest ck
  ck=$(strata_value --checkpoint-dir)
  latest=$(cat "$ck/latest" 2>/dev/null || true)
  [[ "$latest" =~ ([0-9]+)\.h5$ ]] && step=$((10#${BASH_REMATCH[1]}))
  STRATA_NODES=("${left[@]}")
  echo "strata: lost node$plural $(strata_ranges_join "${names[@]}"): continuing on ${#left[@]} node(s)," \
       "$((${#left[@]} * STRATA_PER_NODE)) rank(s) from step $step"
}

strata_ranges_join() { local IFS=';'; local s="$*"; printf '%s' "${s//;/, }"; }

strata_run() {
  local run_dir="runs/${SLURM_JOB_NAME:-strata}-${SLURM_JOB_ID:-local}"
  mkdir -p "$run_dir"
  strata_default --run-dir "$run_dir"  # the job's, not a config file's run-dir (its config.ini goes here)
  strata_default --checkpoint-dir "$run_dir/checkpoints"
  strata_default --resume auto
  strata_default --log-file "$run_dir/train.log"
  strata_default --metrics "$run_dir/metrics.jsonl"
  local launcher=${STRATA_LAUNCHER:-}
  if [ -z "$launcher" ]; then
    if srun --mpi=list 2>&1 | grep -qw pmix; then launcher=srun; else launcher=mpirun; fi
  fi
  case "$launcher" in
    srun|mpirun) ;;
    *) echo "strata: STRATA_LAUNCHER must be srun or mpirun, found '$launcher'" >&2; return 2 ;;
  esac
  if [ -n "${STRATA_NTASKS:-}" ] && ! [[ "$STRATA_NTASKS" =~ ^[1-9][0-9]*$ ]]; then
    echo "strata: STRATA_NTASKS must be a positive number of ranks, found '$STRATA_NTASKS'" >&2; return 2
  fi
  local elastic=${STRATA_ELASTIC:-0}
  if ! [[ "$elastic" =~ ^[0-9]+$ ]]; then
    echo "strata: STRATA_ELASTIC must be how many times to continue on the nodes left (0: never), found '$elastic'" >&2
    return 2
  fi
  if ((elastic)); then strata_elastic_setup "$@" || return 2; fi
  # On a scancel mpirun gets SIGTERM too and kills the ranks 1 s later (Open MPI's default),
  # mid-save for a large checkpoint: give them 25 s, below Slurm's KillWait (default 30 s).
  # mpirun sleeps this out twice, its event loop blocked, when a rank dies (measured: 49 s at
  # 25, 9 s at 5, 1 s at 1): an elastic job, which is to end within --timeout when ranks are
  # lost, gives them min(25 s, --timeout / 2).
  if [ "$launcher" = mpirun ]; then
    local sigkill=25 timeout
    timeout=$(strata_value --timeout)
    if ((elastic)) && [[ "${timeout:-300}" =~ ^[0-9]+$ ]] && ((${timeout:-300} / 2 < sigkill)); then
      sigkill=$((timeout / 2 > 1 ? timeout / 2 : 1))
    fi
    export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-$sigkill}
  fi
  echo "strata: job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}," \
       "$launcher, run directory $run_dir"
  local preempted=0 stopped=0 rc pid="" launched=0 follower="" relaunches=0 ranks=""
  local log_file log_start err_file="$run_dir/launcher-stderr.log" err_fd tee_pid
  log_file=$(strata_value --log-file)
  log_start=$(stat -c %s "$log_file" 2>/dev/null || echo 0)
  # Slurm may send the time-limit USR1 up to a minute early, even right at the start: give train
  # 3 s to install its handlers (a rank without them would die of USR1 instead of saving).
  trap 'preempted=1; if [ -n "$pid" ]; then ((SECONDS - launched < 3)) && sleep 3; kill -USR1 "$pid" 2>/dev/null; fi' USR1
  # The ranks get Slurm's SIGTERM themselves: this shell only waits for their save (a handler,
  # not '' (ignored), which the launcher and ranks would inherit), and with mpirun copies the
  # save's lines into the job's output, which mpirun no longer forwards.
  trap 'stopped=1
        if [ "$launcher" = mpirun ] && [ -z "$follower" ] && [ -n "$log_file" ]; then
          strata_follow_final_lines "$log_file" "$log_start" & follower=$!
        fi' TERM INT
  while :; do
    # Each rank gets its --cpus-per-task cores; train's default thread count follows the mask.
    # A relaunch of an elastic job names its ranks and, on a cluster, the nodes left.
    local -a cmd=() hosts=()
    local node
    if ((relaunches)) && [ -z "${STRATA_RANKS_PER_NODE:-}" ]; then
      for node in "${STRATA_NODES[@]}"; do hosts+=("$node"); done
    fi
    case "$launcher" in
      srun)
        cmd=(srun --mpi=pmix --cpu-bind=cores)
        [ -n "$ranks" ] && cmd+=(--ntasks="$ranks")
        ((${#hosts[@]})) && cmd+=(--nodes="${#hosts[@]}" --nodelist="$(IFS=,; echo "${hosts[*]}")")
        ;;
      mpirun)
        cmd=(mpirun)
        # --quiet drops Open MPI's banner at exit 3, but also its line naming a rank that died:
        # an elastic job needs that line.
        ((elastic)) || cmd+=(--quiet)
        if [ -z "${SLURM_JOB_ID:-}" ] && [ -n "${STRATA_NTASKS:-}" ]; then
          cmd+=(-np "${ranks:-$STRATA_NTASKS}" --oversubscribe --bind-to none)
        else
          cmd+=(--map-by "slot:PE=${SLURM_CPUS_PER_TASK:-1}" --bind-to core)
          [ -n "$ranks" ] && cmd+=(-np "$ranks")
          ((${#hosts[@]})) && cmd+=(--host "$(IFS=,; echo "${hosts[*]/%/:$STRATA_PER_NODE}")")
        fi
        ;;
    esac
    ((relaunches)) && log_start=$(stat -c %s "$log_file" 2>/dev/null || echo 0)  # this launch's lines
    if ((elastic)); then
      # A copy of the launcher's stderr (what names the lost ranks) beside the job's output; tee
      # ignores a scancel's SIGTERM like the launcher's other output (the job's end stops it).
      : >"$err_file"
      exec {err_fd}> >(trap '' TERM INT; exec tee -a "$err_file" >&2)
      tee_pid=$!
      "${cmd[@]}" "$@" "${STRATA_ARGS[@]}" 2>&"$err_fd" {err_fd}>&- &
    else
      "${cmd[@]}" "$@" "${STRATA_ARGS[@]}" &
    fi
    pid=$!
    launched=$SECONDS
    while :; do  # a trapped signal interrupts wait: wait again until train has ended
      wait "$pid"
      rc=$?
      kill -0 "$pid" 2>/dev/null || break
    done
    if [ -n "$follower" ]; then  # let it copy the last lines, then stop it and its tail (they ignore SIGTERM)
      sleep 1
      pkill -KILL -P "$follower" 2>/dev/null
      kill -KILL "$follower" 2>/dev/null
    fi
    if ((elastic)); then
      exec {err_fd}>&-
      wait "$tee_pid" 2>/dev/null
    fi
    case "$rc" in
      0) echo "strata: finished" ;;
      3) echo "strata: stopped by a signal, checkpoint saved in $run_dir/checkpoints" ;;
      *) echo "strata: train exited $rc (docs/slurm.md, exit codes)" ;;
    esac
    case "$rc" in 0|2|3|4) break ;; esac
    ((elastic && !preempted && !stopped)) || break
    strata_elastic_continue "$rc" "$relaunches" "$elastic" || break
    relaunches=$((relaunches + 1))
    ranks=$((${#STRATA_NODES[@]} * STRATA_PER_NODE))
  done
  if [ "$preempted" = 1 ] && [ "$rc" = 3 ]; then
    echo "strata: preempted: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$rc"
}
