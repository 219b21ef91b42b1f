#include "parallel/values.hpp"

#include "parallel/mpi.hpp"

namespace strata::parallel {

std::vector<int64_t> all_gather_values(MpiCommunicator& comm, const std::vector<int64_t>& mine) {
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(comm.size()));
  const int n = static_cast<int>(mine.size());
  MPI_CHECK(MPI_Allgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm.comm()));
  return all;
}

int64_t broadcast_value(MpiCommunicator& comm, int64_t value, int root) {
  MPI_CHECK(MPI_Bcast(&value, 1, MPI_INT64_T, root, comm.comm()));
  return value;
}

void send_values(MpiCommunicator& comm, const std::vector<double>& values, int peer, int tag) {
  MPI_CHECK(MPI_Send(values.data(), static_cast<int>(values.size()), MPI_DOUBLE, peer, tag, comm.comm()));
}

std::vector<double> recv_values(MpiCommunicator& comm, int peer, int tag) {
  MPI_Status status;
  MPI_CHECK(MPI_Probe(peer, tag, comm.comm(), &status));
  int count = 0;
  MPI_CHECK(MPI_Get_count(&status, MPI_DOUBLE, &count));
  std::vector<double> values(static_cast<size_t>(count));
  MPI_CHECK(MPI_Recv(values.data(), count, MPI_DOUBLE, peer, tag, comm.comm(), MPI_STATUS_IGNORE));
  return values;
}

}  // namespace strata::parallel
