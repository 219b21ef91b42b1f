// Strata's dtypes on MPI: the MPI datatype of each dtype and the MPI_Op that sums it. The
// 16-bit float formats (bf16, f16) have no MPI type: they travel as a 2-byte derived type, and
// their sum is a user-defined MPI_Op that adds in f32 and rounds back once per pair. Avg is
// Sum followed by scale_host() on the result.
#pragma once

#include <mpi.h>

#include <cstdint>

#include "core/dtype.hpp"
#include "parallel/comm/communicator.hpp"

namespace strata::parallel {

// Creates the half types and ops once (after MPI_Init, on the thread that calls MPI; later
// calls do nothing). They are freed at MPI_Finalize.
void create_half_types();

// The MPI datatype of one element of `t`.
MPI_Datatype mpi_type(DType t);

// The MPI_Op that sums `t` (MPI_SUM, or the half sums); checks that Avg gets a float dtype.
MPI_Op mpi_sum(DType t, ReduceOp op);

// Multiplies the n elements of `dtype` at host memory `data` by `factor` (Avg's 1/size);
// non-float dtypes are left alone.
void scale_host(void* data, DType dtype, int64_t n, float factor);

}  // namespace strata::parallel
