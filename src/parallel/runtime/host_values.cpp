#include "parallel/runtime/host_values.hpp"

#include <algorithm>

#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

namespace {

// Completes `request` under the watchdog's deadline (recorded as operation `seq`).
void wait_for(MPI_Request& request, uint64_t seq) {
  watchdog::Wait deadline_of(seq);
  for (int done = 0; !done; watchdog::poll()) MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
  watchdog::completed(seq);
}

}  // namespace

std::vector<int64_t> all_gather_values(MpiCommunicator& comm, const std::vector<int64_t>& mine) {
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(comm.size()));
  const int n = static_cast<int>(mine.size());
  const uint64_t seq =
      watchdog::started(comm.channel(), "all_gather i64", n * int64_t{sizeof(int64_t)}, DType::U8, -1, true);
  MPI_Request request;
  MPI_CHECK(MPI_Iallgather(mine.data(), n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm.comm(), &request));
  wait_for(request, seq);
  return all;
}

int64_t broadcast_value(MpiCommunicator& comm, int64_t value, int root) {
  const uint64_t seq = watchdog::started(comm.channel(), "broadcast i64", sizeof value, DType::U8, root, true);
  MPI_Request request;
  MPI_CHECK(MPI_Ibcast(&value, 1, MPI_INT64_T, root, comm.comm(), &request));
  wait_for(request, seq);
  return value;
}

void send_values(MpiCommunicator& comm, const std::vector<double>& values, int peer, int tag) {
  const auto n = static_cast<int64_t>(values.size());
  const uint64_t seq = watchdog::started(comm.channel(), "send f64", n * 8, DType::U8, peer, false);
  MPI_Request request;
  MPI_CHECK(MPI_Isend(values.data(), static_cast<int>(n), MPI_DOUBLE, peer, tag, comm.comm(), &request));
  wait_for(request, seq);
}

std::vector<double> recv_values(MpiCommunicator& comm, int peer, int tag) {
  const uint64_t seq = watchdog::started(comm.channel(), "recv f64", 0, DType::U8, peer, false);
  MPI_Status status;
  {  // MPI_Iprobe, not MPI_Probe: the length is learnt under the deadline too
    watchdog::Wait deadline_of(seq);
    for (int found = 0; !found; watchdog::poll()) MPI_CHECK(MPI_Iprobe(peer, tag, comm.comm(), &found, &status));
  }
  int count = 0;
  MPI_CHECK(MPI_Get_count(&status, MPI_DOUBLE, &count));
  std::vector<double> values(static_cast<size_t>(count));
  MPI_CHECK(MPI_Recv(values.data(), count, MPI_DOUBLE, peer, tag, comm.comm(), MPI_STATUS_IGNORE));  // already here
  watchdog::completed(seq);
  return values;
}

namespace {
constexpr int64_t kBytesPiece = int64_t{1} << 30;
}

void send_bytes(MpiCommunicator& comm, const std::string& bytes, int peer, int tag) {
  send_values(comm, {static_cast<double>(bytes.size())}, peer, tag);  // exact below 2^53
  for (int64_t at = 0; at < static_cast<int64_t>(bytes.size()); at += kBytesPiece) {
    const int n = static_cast<int>(std::min(kBytesPiece, static_cast<int64_t>(bytes.size()) - at));
    const uint64_t seq = watchdog::started(comm.channel(), "send bytes", n, DType::U8, peer, false);
    MPI_Request request;
    MPI_CHECK(MPI_Isend(bytes.data() + at, n, MPI_CHAR, peer, tag, comm.comm(), &request));
    wait_for(request, seq);
  }
}

std::string recv_bytes(MpiCommunicator& comm, int peer, int tag) {
  const std::vector<double> size = recv_values(comm, peer, tag);
  STRATA_CHECK(size.size() == 1 && size[0] >= 0, "recv_bytes: a bad length message from rank ", peer);
  std::string bytes(static_cast<size_t>(size[0]), '\0');
  for (int64_t at = 0; at < static_cast<int64_t>(bytes.size()); at += kBytesPiece) {
    const int n = static_cast<int>(std::min(kBytesPiece, static_cast<int64_t>(bytes.size()) - at));
    const uint64_t seq = watchdog::started(comm.channel(), "recv bytes", n, DType::U8, peer, false);
    MPI_Request request;
    MPI_CHECK(MPI_Irecv(bytes.data() + at, n, MPI_CHAR, peer, tag, comm.comm(), &request));
    wait_for(request, seq);
  }
  return bytes;
}

}  // namespace strata::parallel
