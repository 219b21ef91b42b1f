// The world as the MPI tests see it: this rank, the world's size, and communicators split from
// it, shared by the tests instead of a copy in each.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <string>

#include "parallel/comm/mpi_communicator.hpp"

namespace strata::parallel::testing_world {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// The ranks of the world with the same `color`, ordered by world rank.
inline std::unique_ptr<MpiCommunicator> split_world(int color, const std::string& name) {
  MPI_Comm c = MPI_COMM_NULL;
  EXPECT_EQ(MPI_Comm_split(MPI_COMM_WORLD, color, world_rank(), &c), MPI_SUCCESS);
  auto comm = std::make_unique<MpiCommunicator>(c, name);
  MPI_Comm_free(&c);  // the communicator holds its own duplicate
  return comm;
}

}  // namespace strata::parallel::testing_world
