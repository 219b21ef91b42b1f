// Host values between ranks with their own MPI types (MPI_INT64_T, MPI_DOUBLE): byte counts,
// metrics and timeline times, which the tensor collectives (f32, bf16, f16, i32, u8) cannot
// carry without disguising them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/comm/mpi_communicator.hpp"

namespace strata::parallel {

// Every rank's `mine` (the same length on every rank), concatenated in rank order.
std::vector<int64_t> all_gather_values(MpiCommunicator& comm, const std::vector<int64_t>& mine);
// `value` of rank `root`, on every rank.
int64_t broadcast_value(MpiCommunicator& comm, int64_t value, int root);
// Point-to-point, any length: the receiver learns it from the message.
void send_values(MpiCommunicator& comm, const std::vector<double>& values, int peer, int tag);
std::vector<double> recv_values(MpiCommunicator& comm, int peer, int tag);
// Bytes of any length (sent in pieces of at most 1 GiB: MPI counts are ints).
void send_bytes(MpiCommunicator& comm, const std::string& bytes, int peer, int tag);
std::string recv_bytes(MpiCommunicator& comm, int peer, int tag);

}  // namespace strata::parallel
