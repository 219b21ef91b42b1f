// The POSIX shared-memory segments under NodeSharedMemory. Every buffer the group shares
// (its counters, the buffers from allocate(), the mailboxes) is one segment per rank: each rank
// creates its own in /dev/shm and maps every peer's, so a rank reads a peer's data where it
// lies. A segment's name exists only while every rank of the group is inside the call that
// makes it (map_segments): it is unlinked as soon as every rank has opened it, so nothing is
// left in /dev/shm however the job ends later, and a signal handler that ends the process
// meanwhile unlinks it (unlink_shared_segments_for_exit). A mapping lives as long as its
// tensor: the registry of mapped segments is the allocator that unmaps it, and it counts the
// peak bytes of this rank's own segments.
#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "parallel/comm/shared_memory_internal.hpp"
#include "parallel/runtime/mpi.hpp"
#include "parallel/runtime/watchdog.hpp"

namespace strata::parallel {

namespace {

uint64_t next_group_id() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

bool all_ok(MPI_Comm comm, bool ok) {
  int all = ok ? 1 : 0;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm));
  return all == 1;
}

// The names of this process's own segments while they exist in /dev/shm, in fixed slots that a
// signal handler can read (unlink_shared_segments_for_exit: no allocation, no lock). A name
// lives only inside map_segments, from shm_open until every rank of the group has opened it;
// one per thread at a time, so a few slots are plenty (a name that finds none is only not
// registered).
struct NameSlot {
  std::atomic<int> state{0};  // kFree, kWriting, kNamed
  char name[64] = {};
};
constexpr int kFree = 0, kWriting = 1, kNamed = 2;
NameSlot g_names[8];
static_assert(std::atomic<int>::is_always_lock_free);

// A segment name this process creates: registered from just before shm_open until unlink()
// (also on the way out of an exception). Before rather than after, so no signal finds the name
// created but not registered; a handler in between unlinks a name that is not there yet.
class OwnName {
 public:
  explicit OwnName(std::string name) : name_(std::move(name)) {}
  OwnName(const OwnName&) = delete;
  OwnName& operator=(const OwnName&) = delete;
  ~OwnName() { unlink(); }
  // shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600): a descriptor, or -1 with errno set.
  int create() {
    for (NameSlot& s : g_names) {
      int expected = kFree;
      if (name_.size() < sizeof s.name && s.state.compare_exchange_strong(expected, kWriting)) {
        std::memcpy(s.name, name_.c_str(), name_.size() + 1);
        s.state.store(kNamed, std::memory_order_release);
        slot_ = &s;
        break;
      }
    }
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    const int saved = errno;
    created_ = fd >= 0;
    if (!created_) release();  // not ours (EEXIST: a stale name): never unlinked
    errno = saved;
    return fd;
  }
  // Removes the name (peers that opened it keep their mappings) and forgets it.
  void unlink() noexcept {
    if (created_) shm_unlink(name_.c_str());
    created_ = false;
    release();
  }
  const std::string& name() const { return name_; }

 private:
  void release() noexcept {
    if (slot_ != nullptr) slot_->state.store(kFree, std::memory_order_release);
    slot_ = nullptr;
  }
  std::string name_;
  NameSlot* slot_ = nullptr;
  bool created_ = false;
};

}  // namespace

namespace shm_detail {

void* SegmentRegistry::allocate(size_t) { STRATA_THROW("shared segments come from NodeSharedMemory::allocate"); }

void SegmentRegistry::deallocate(void* ptr, size_t) noexcept {
  std::lock_guard lock(mutex_);
  const auto it = mappings_.find(static_cast<char*>(ptr));
  if (it == mappings_.end()) return;
  for (char* p : it->second.at) munmap(p, it->second.bytes);
  in_use_ -= it->second.bytes;
  mappings_.erase(it);
}

size_t SegmentRegistry::peak_in_use() const {
  std::lock_guard lock(mutex_);
  return peak_;
}

void SegmentRegistry::add(Mapping m) {
  std::lock_guard lock(mutex_);
  in_use_ += m.bytes;
  peak_ = std::max(peak_, in_use_);
  char* own = m.at[static_cast<size_t>(m.rank)];
  mappings_.emplace(own, std::move(m));
}

void SegmentRegistry::count(int64_t bytes) {
  std::lock_guard lock(mutex_);
  in_use_ = static_cast<size_t>(static_cast<int64_t>(in_use_) + bytes);
  peak_ = std::max(peak_, in_use_);
}

bool SegmentRegistry::find(uint64_t group, const void* p, size_t bytes, Mapping& out) const {
  std::lock_guard lock(mutex_);
  const char* c = static_cast<const char*>(p);
  auto it = mappings_.upper_bound(const_cast<char*>(c));
  if (it == mappings_.begin()) return false;
  --it;
  if (it->second.group != group || c + bytes > it->first + it->second.bytes) return false;
  out = it->second;
  return true;
}

SegmentRegistry& registry() {
  static auto* r = new SegmentRegistry;
  return *r;
}

// Collective: every rank creates a segment of `bytes` and maps everyone's. Returns the
// mappings (index = rank) and the segment's serial number, or nothing on every rank if any
// rank failed. The names are unlinked before returning, so nothing is left in /dev/shm even
// if the job is killed later. They exist only while every rank is inside this call: the
// first collective is an all-reduce, not a broadcast, so no rank creates its name and then
// waits there for a peer that is still busy elsewhere (a second stop signal or a deadline
// ending the process meanwhile finds it in g_names; a SIGKILL would leave it).
std::vector<char*> map_segments(MPI_Comm comm, int rank, int size, size_t bytes, int64_t& serial,
                                std::string& why_not) {
  // Names unique on the node: rank 0's pid and how many segments it has made.
  static uint64_t made = 0;
  uint64_t tag[2] = {0, 0};
  if (rank == 0) {
    tag[0] = static_cast<uint64_t>(getpid());
    tag[1] = made++;
  }
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, tag, 2, MPI_UINT64_T, MPI_MAX, comm));
  serial = static_cast<int64_t>(tag[1]);
  const auto name = [&](int r) { return strata::detail::cat("/strata-", tag[0], "-", tag[1], "-", r); };

  std::vector<char*> at(static_cast<size_t>(size), nullptr);
  std::string error;
  const auto map = [&](int r, int fd) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      error = strata::detail::cat("mmap of ", name(r), ": ", std::strerror(errno));
    else
      at[static_cast<size_t>(r)] = static_cast<char*>(p);
    close(fd);
  };
  OwnName own(name(rank));
  const int fd = own.create();
  if (fd < 0) {
    error = strata::detail::cat("shm_open ", own.name(), ": ", std::strerror(errno));
  } else {
    // posix_fallocate reserves the pages now: a full /dev/shm fails here, not with SIGBUS later.
    const int rc =
        ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? posix_fallocate(fd, 0, static_cast<off_t>(bytes)) : errno;
    if (rc != 0) {
      error = strata::detail::cat("reserving ", bytes, " bytes in /dev/shm: ", std::strerror(rc));
      close(fd);
    } else {
      map(rank, fd);
    }
  }
  bool ok = all_ok(comm, error.empty());
  if (ok) {
    for (int r = 0; r < size && error.empty(); ++r) {
      if (r == rank) continue;
      const int peer = shm_open(name(r).c_str(), O_RDWR, 0);
      if (peer < 0)
        error = strata::detail::cat("shm_open ", name(r), ": ", std::strerror(errno));
      else
        map(r, peer);
    }
    ok = all_ok(comm, error.empty());  // also: every rank has opened every name
  }
  own.unlink();
  if (ok) return at;
  for (char* p : at)
    if (p) munmap(p, bytes);
  why_not = error.empty() ? "another rank of the group could not map its segment" : error;
  return {};
}

void relax(uint64_t& spins, MPI_Comm comm) {
  watchdog::poll();  // the deadline of the wait this spin is part of
  if (++spins % 256 == 0) {
    int flag = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, MPI_STATUS_IGNORE);
  }
  if (spins < 2000)
    _mm_pause();
  else
    sched_yield();
}

}  // namespace shm_detail

using shm_detail::map_segments;
using shm_detail::registry;
using shm_detail::SegmentRegistry;

bool NodeSharedMemory::one_node(MPI_Comm comm) {
  int size = 0;
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Comm node = split_by_node(comm);
  int node_size = 0;
  MPI_CHECK(MPI_Comm_size(node, &node_size));
  MPI_CHECK(MPI_Comm_free(&node));
  return size >= 2 && all_ok(comm, node_size == size);
}

std::unique_ptr<NodeSharedMemory> NodeSharedMemory::create(MPI_Comm comm) {
  int rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  if (!one_node(comm)) return nullptr;
  // Before the first name exists: a process that must exit from a signal handler unlinks them.
  register_exit_cleanup(unlink_shared_segments_for_exit);

  std::unique_ptr<NodeSharedMemory> group(new NodeSharedMemory(comm, rank, size));
  int64_t serial = 0;
  std::string why_not;
  const std::vector<char*> at = map_segments(comm, rank, size, static_cast<size_t>(counters_bytes()), serial, why_not);
  if (at.empty()) return nullptr;
  registry().count(counters_bytes());
  group->own_counters_ = at[static_cast<size_t>(rank)];
  new (group->own_counters_) Counters();  // the page is zero already; this makes it an object
  for (char* p : at) group->counters_.push_back(reinterpret_cast<Counters*>(p));
  return group;
}

NodeSharedMemory::NodeSharedMemory(MPI_Comm comm, int rank, int size)
    : comm_(comm), rank_(rank), size_(size), id_(next_group_id()) {}

NodeSharedMemory::~NodeSharedMemory() {
  try {
    if (!queue_.empty()) wait_for(*queue_.back());
    while (!sends_.empty()) wait_for(*sends_.back());  // not yet in a slot: would be lost
  } catch (...) {                                      // destructors do not throw; the job is failing anyway
  }
  for (Counters* c : counters_) munmap(c, static_cast<size_t>(counters_bytes()));
  for (char* p : inboxes_) munmap(p, inbox_bytes_);
  // Only this rank's own segments were counted (create, enable_messages).
  registry().count(
      -((counters_.empty() ? 0 : counters_bytes()) + (inboxes_.empty() ? 0 : static_cast<int64_t>(inbox_bytes_))));
}

int64_t NodeSharedMemory::counters_bytes() { return sysconf(_SC_PAGESIZE); }

int64_t NodeSharedMemory::buffer_bytes(int64_t bytes) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  return std::max<int64_t>((bytes + page - 1) / page, 1) * page;
}

Tensor NodeSharedMemory::allocate(int64_t numel, DType dtype, std::string& why_not) {
  const auto bytes = static_cast<size_t>(buffer_bytes(numel * static_cast<int64_t>(dtype_size(dtype))));
  int64_t serial = 0;
  std::vector<char*> at = map_segments(comm_, rank_, size_, bytes, serial, why_not);
  if (at.empty()) return Tensor();
  char* own = at[static_cast<size_t>(rank_)];
  registry().add({id_, serial, bytes, std::move(at), rank_});
  // Zeroed: fresh tmpfs pages.
  return Tensor::over(std::make_shared<Storage>(own, bytes, Device::cpu(), registry()), {numel}, dtype);
}

bool NodeSharedMemory::holds(const Tensor& t) const {
  SegmentRegistry::Mapping m;
  return t.defined() && t.device().is_cpu() && registry().find(id_, t.raw(), t.nbytes(), m);
}

size_t shared_memory_peak_bytes() { return registry().peak_in_use(); }

void unlink_shared_segments_for_exit() noexcept {
  const int saved = errno;
  for (NameSlot& s : g_names)
    if (s.state.load(std::memory_order_acquire) == kNamed) shm_unlink(s.name);
  errno = saved;
}

}  // namespace strata::parallel
