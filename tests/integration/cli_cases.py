#!/usr/bin/env python3
"""End-to-end cases for the train program, one CTest test per case.

Usage: cli_cases.py CASE --train PATH --workdir DIR [--mpirun PATH] [--data-tool PATH] [--sample-tool PATH]
Datasets are written here with h5py (an oracle we did not write), so every case also checks
that h5py-written files load. Bad-input cases assert: exit code 2, exactly one line on
stderr naming what was expected and what was found, no crash or traceback.

The cases live by topic in cases_cli.py (command line, bad inputs, divergence, rank failure),
cases_parallel.py (DDP, pipeline, ZeRO), cases_checkpoint.py (resume, bad checkpoints,
preemption, export), cases_checkpoint_validation.py (manifests, fallback, the directory lock), cases_async_save.py (--async-save),
cases_parallel_io.py (--checkpoint-io parallel),
cases_accuracy.py (Fashion-MNIST, mixed precision), cases_gpt.py (the
GPT language model: layouts, resume, learning, bad inputs, torch export) and cases_sample.py
(strata-sample on a tiny trained GPT) cases_tensor_parallel.py (--tp), cases_sequence_parallel.py (--sequence-parallel), cases_llama.py (--model llama), cases_recompute.py (--recompute), cases_memory.py
(--device-memory) and cases_data.py (damaged data files, flag ranges, a second signal) and cases_watchdog.py (a stopped rank, differing
collectives) and cases_trace.py (--trace, the progress split) and cases_netns.py (ranks in two network namespaces: equivalence,
a cut link) and cases_elastic.py (jobs/lib/run.sh continuing on the nodes left) and cases_docs.py (the commands of
docs/migration.md and docs/troubleshooting.md), on the helpers
of harness.py; this script only dispatches.
"""
import cases_accuracy
import cases_async_save
import cases_checkpoint
import cases_checkpoint_validation
import cases_cli
import cases_data
import cases_docs
import cases_elastic
import cases_gpt
import cases_llama
import cases_memory
import cases_netns
import cases_parallel
import cases_parallel_io
import cases_recompute
import cases_sample
import cases_sequence_parallel
import cases_tensor_parallel
import cases_trace
import cases_watchdog
import harness

if __name__ == "__main__":
    harness.main([cases_cli, cases_data, cases_parallel, cases_checkpoint, cases_checkpoint_validation, cases_async_save,
                  cases_parallel_io,
                  cases_accuracy,
                  cases_gpt, cases_sample,
                  cases_tensor_parallel, cases_sequence_parallel, cases_llama, cases_recompute, cases_memory, cases_watchdog, cases_trace, cases_netns,
                  cases_elastic,
                  cases_docs])
