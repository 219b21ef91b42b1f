// Stop signals: SIGTERM, SIGUSR1 (Slurm's warning before a preemption) and SIGINT only set a
// flag, which the training loop reads at step boundaries and the stage engine agrees on over
// every rank; the run then saves and exits kExitPreempted. A second SIGTERM or SIGINT while the
// stop is pending exits at once (kExitSecondSignal), after the parallel runtime's exit cleanups.
#pragma once

namespace strata::train {

// Installs the async-signal-safe handlers.
void install_preemption_handlers();
// Whether a stop signal has arrived.
bool stop_requested();

}  // namespace strata::train
