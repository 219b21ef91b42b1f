# Sourced by the test scripts. The tests were validated with OpenBLAS's Haswell kernels, which
# the development machines' environment used to set; without OPENBLAS_CORETYPE, OpenBLAS 0.3.21
# does not recognise these CPUs and runs generic kernels (GEMM 3-4x slower), and train says so
# on stderr, which tests that count stderr lines would see. A value already set is kept.
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -qw avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell; fi
