// Stop signals: SIGTERM, SIGUSR1 (Slurm's warning before a preemption) and SIGINT. During setup
// (until begin_training) one exits at once with kExitPreempted: nothing new to save, and setup
// may take long (loading data or a checkpoint). While training it only sets a flag, which the
// stage engine agrees on over every rank at the step's end; the run then saves and exits
// kExitPreempted. A second SIGTERM or SIGINT while that stop is pending exits at once
// (kExitSecondSignal). Both early exits run the parallel runtime's exit cleanups first.
#pragma once

namespace strata::train {

// Installs the async-signal-safe handlers (in setup mode).
void install_preemption_handlers();
// Setup is over: from now on a stop signal stops after the step under way.
void begin_training();
// Setup failed and every rank agreed on `code`, its line already printed: a stop signal from now
// on (mpirun ending the other ranks once the first has exited) exits with `code`, saying nothing
// more, so a bad input stays one line.
void end_after_failed_setup(int code);
// Whether a stop signal has arrived.
bool stop_requested();

}  // namespace strata::train
