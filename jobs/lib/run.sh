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
# the allocation from Slurm).

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
  # Each rank gets its --cpus-per-task cores; train's default thread count follows the mask.
  local cmd
  case "$launcher" in
    srun) cmd=(srun --mpi=pmix --cpu-bind=cores) ;;
    mpirun)
      cmd=(mpirun --quiet --map-by "slot:PE=${SLURM_CPUS_PER_TASK:-1}" --bind-to core)
      # On a scancel mpirun gets SIGTERM too and kills the ranks 1 s later (Open MPI's default),
      # mid-save for a large checkpoint: give them 25 s, below Slurm's KillWait (default 30 s).
      export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-25}
      ;;
    *) echo "strata: STRATA_LAUNCHER must be srun or mpirun, found '$launcher'" >&2; return 2 ;;
  esac
  echo "strata: job ${SLURM_JOB_ID:-?} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST:-?}," \
       "$launcher, run directory $run_dir"
  local preempted=0 rc pid="" launched=0 follower=""
  local log_file log_start
  log_file=$(strata_value --log-file)
  log_start=$(stat -c %s "$log_file" 2>/dev/null || echo 0)
  # Slurm may send the time-limit USR1 up to a minute early, even right at the start: give train
  # 3 s to install its handlers (a rank without them would die of USR1 instead of saving).
  trap 'preempted=1; if [ -n "$pid" ]; then ((SECONDS - launched < 3)) && sleep 3; kill -USR1 "$pid" 2>/dev/null; fi' USR1
  # The ranks get Slurm's SIGTERM themselves: this shell only waits for their save (a handler,
  # not '' (ignored), which the launcher and ranks would inherit), and with mpirun copies the
  # save's lines into the job's output, which mpirun no longer forwards.
  trap 'if [ "$launcher" = mpirun ] && [ -z "$follower" ] && [ -n "$log_file" ]; then
          strata_follow_final_lines "$log_file" "$log_start" & follower=$!
        fi' TERM INT
  "${cmd[@]}" "$@" "${STRATA_ARGS[@]}" &
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
  case "$rc" in
    0) echo "strata: finished" ;;
    3) echo "strata: stopped by a signal, checkpoint saved in $run_dir/checkpoints" ;;
    *) echo "strata: train exited $rc (docs/slurm.md, exit codes)" ;;
  esac
  if [ "$preempted" = 1 ] && [ "$rc" = 3 ]; then
    echo "strata: preempted: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$rc"
}
