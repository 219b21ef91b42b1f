#!/usr/bin/env bash
# The sanitizer stage (CI runs it after scripts/test.sh): a CPU-only build of the unit and MPI
# tests under AddressSanitizer + UndefinedBehaviorSanitizer in build-asan, run through CTest,
# then the tests of the two threads (the prefetching loader, the background checkpoint writer)
# under ThreadSanitizer in build-tsan. Any sanitizer report fails the stage: UBSan does not
# recover, ASan and TSan exit non-zero.
# Extra arguments go to both ctest runs (e.g. -R test_io_ to run fewer tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/openblas-env.sh
jobs=$(nproc)
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

# -O1 -g1: line numbers in reports at a fraction of -O0's test time. No NDEBUG: asserts stay.
configure() {  # configure <dir> <sanitizer flags>
  cmake -S . -B "$1" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DSTRATA_CUDA=OFF \
    -DSTRATA_BUILD_BENCH=OFF "${launcher[@]}" -DCMAKE_CXX_FLAGS="$2 -fno-omit-frame-pointer" \
    -DCMAKE_EXE_LINKER_FLAGS="$2" -DCMAKE_SHARED_LINKER_FLAGS="$2" >/dev/null
}

# The targets that CTest's `unit` and `mpi` tests run: the GoogleTest binaries, named as their
# tests (less an _npN suffix for the rank count), and every word of a test's command line that is
# a file of the build tree (the tools the python checks are handed: strata-data, strata-events).
# CTest lists a test's command only once its executable exists, hence the names as well.
test_targets() {  # test_targets <dir>
  local all
  all=$(cmake --build "$1" --target help | sed -n 's/^\.\.\. \([^ ]*\).*/\1/p')
  ctest --test-dir "$1" -N -L '^(unit|mpi)$' --show-only=json-v1 | python3 -c '
import json, os, re, sys
build = os.path.realpath(sys.argv[1])
for test in json.load(sys.stdin)["tests"]:
    print(re.sub(r"_np[0-9]+$", "", test["name"]))
    for word in test.get("command", []):
        if os.path.realpath(word).startswith(build + os.sep):
            print(os.path.basename(word))' "$1" | sort -u | grep -Fxf <(echo "$all")
}

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# detect_leaks=0: Open MPI (and hwloc, PMIx under it) leave their world's allocations to the
# OS at exit, so LeakSanitizer reports hundreds of leaks with stacks entirely inside libmpi
# that no suppression list stays complete for across Open MPI versions; the tests' own
# tensors are RAII-owned. Use-after-free, overflows and UB are still fatal.
export ASAN_OPTIONS=detect_leaks=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

echo "== ASan + UBSan: unit and MPI tests (build-asan)"
configure build-asan "-fsanitize=address,undefined -fno-sanitize-recover=all"
mapfile -t targets < <(test_targets build-asan)
cmake --build build-asan -j "$jobs" --target "${targets[@]}"
ctest --test-dir build-asan -L '^(unit|mpi)$' --output-on-failure -j "$jobs" "$@"

echo "== TSan: the prefetching loader and the background checkpoint writer (build-tsan)"
configure build-tsan "-fsanitize=thread"
cmake --build build-tsan -j "$jobs" --target test_io_loader test_io_checkpoint_saver
# Suppressions for uninstrumented libraries only (tests/tsan.supp says why each is there).
TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
  ctest --test-dir build-tsan -R '^test_io_(loader|checkpoint_saver)$' --output-on-failure "$@"
