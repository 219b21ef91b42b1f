// Node-local all-reduce, reduce and all-gather over shared-memory segments (see the header for the protocol).
#include "parallel/shared_memory.hpp"

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "parallel/mpi.hpp"
#include "parallel/watchdog.hpp"

namespace strata::parallel {

struct NodeSharedMemory::Counters {
  std::atomic<uint64_t> arrived{0}, reduced{0}, done{0};
  // The operation `arrived` names, so that peers can check it is theirs too.
  std::atomic<int64_t> segment{0}, offset{0}, count{0}, root{0};
};

struct NodeSharedMemory::Op {
  // What `root` is for each kind: the rank that receives the sum (>= 0), or one of these.
  static constexpr int kAllReduce = -1, kAllGather = -2;
  uint64_t seq = 0;
  Tensor keep;            // keeps the segments mapped while the operation runs
  std::vector<char*> at;  // the range's first byte in every rank's mapping
  int64_t segment = 0, offset = 0;
  int64_t count = 0;  // f32 elements to reduce; all-gather: bytes of the whole range
  int root = kAllReduce;
  float scale = 1;  // 1 / size for an average
  int phase = 0;    // 0 queued, 1 arrived, 2 reduced (all-gather: chunks copied), 3 done, 4 complete
};

// The header of a mailbox slot; the message follows it, 64 bytes in.
struct NodeSharedMemory::Slot {
  std::atomic<uint64_t> full{0};  // 0: free; else the message's number from its sender (1, 2, ...)
  int64_t tag = 0, bytes = 0;
};

struct NodeSharedMemory::Message {
  Tensor keep;  // the data (kept alive until copied)
  int peer = 0, tag = 0;
  bool done = false;
};

namespace {

constexpr int kComplete = 4;
constexpr int64_t kSlotHeader = 64;
constexpr int64_t kMailboxLimit = int64_t{64} << 20;  // bytes per rank's inbox
static_assert(sizeof(NodeSharedMemory::Slot) <= kSlotHeader);

// Every segment this process has mapped, by its local address: the allocator that unmaps
// them when their tensor goes away (no collective needed: any rank may free at any time).
// Leaked on purpose, like the other allocators: tensors may be freed after main.
class SegmentRegistry final : public Allocator {
 public:
  struct Mapping {
    uint64_t group = 0;     // the NodeSharedMemory that made it
    int64_t segment = 0;    // its serial number, the same on every rank of the group
    size_t bytes = 0;       // of each rank's segment
    std::vector<char*> at;  // every rank's segment, mapped here
    int rank = 0;           // this process's rank in the group
  };

  void* allocate(size_t) override { STRATA_THROW("shared segments come from NodeSharedMemory::allocate"); }
  void deallocate(void* ptr, size_t) noexcept override {
    std::lock_guard lock(mutex_);
    const auto it = mappings_.find(static_cast<char*>(ptr));
    if (it == mappings_.end()) return;
    for (char* p : it->second.at) munmap(p, it->second.bytes);
    in_use_ -= it->second.bytes;
    mappings_.erase(it);
  }
  Device device() const override { return Device::cpu(); }
  // This rank's own segments (the peers' mappings are theirs, counted by them).
  size_t peak_in_use() const override {
    std::lock_guard lock(mutex_);
    return peak_;
  }

  void add(Mapping m) {
    std::lock_guard lock(mutex_);
    in_use_ += m.bytes;
    peak_ = std::max(peak_, in_use_);
    char* own = m.at[static_cast<size_t>(m.rank)];
    mappings_.emplace(own, std::move(m));
  }
  // The mapping of `group` that holds [p, p + bytes), if any.
  bool find(uint64_t group, const void* p, size_t bytes, Mapping& out) const {
    std::lock_guard lock(mutex_);
    const char* c = static_cast<const char*>(p);
    auto it = mappings_.upper_bound(const_cast<char*>(c));
    if (it == mappings_.begin()) return false;
    --it;
    if (it->second.group != group || c + bytes > it->first + it->second.bytes) return false;
    out = it->second;
    return true;
  }

 private:
  mutable std::mutex mutex_;
  std::map<char*, Mapping> mappings_;
  size_t in_use_ = 0, peak_ = 0;
};

SegmentRegistry& registry() {
  static auto* r = new SegmentRegistry;
  return *r;
}

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

// Waiting for a peer: spin briefly, then give the core away (ranks may outnumber cores), and
// now and then let MPI progress, in case a peer waits on an MPI operation of this rank.
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

class SharedWork final : public Work {
 public:
  SharedWork(NodeSharedMemory& group, std::shared_ptr<NodeSharedMemory::Op> op) : group_(group), op_(std::move(op)) {}
  // A dropped handle still completes: peers read this rank's memory until then.
  ~SharedWork() override {
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] shared-memory all-reduce: %s (ignored in a destructor)\n", process_rank(),
                   e.what());
    }
  }
  // A complete operation no longer needs its group (which completes everything before it goes).
  void wait() override {
    if (op_->phase != kComplete) group_.wait_for(*op_);
  }
  bool test() override {
    if (op_->phase != kComplete) group_.progress();
    return op_->phase == kComplete;
  }

 private:
  NodeSharedMemory& group_;
  std::shared_ptr<NodeSharedMemory::Op> op_;
};

class MessageWork final : public Work {
 public:
  MessageWork(NodeSharedMemory& group, std::shared_ptr<NodeSharedMemory::Message> m)
      : group_(group), m_(std::move(m)) {}
  // A dropped handle still completes, as MPI's do.
  ~MessageWork() override {
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] shared-memory message: %s (ignored in a destructor)\n", process_rank(), e.what());
    }
  }
  void wait() override {
    if (!m_->done) group_.wait_for(*m_);
  }
  bool test() override {
    if (!m_->done) group_.progress();
    return m_->done;
  }

 private:
  NodeSharedMemory& group_;
  std::shared_ptr<NodeSharedMemory::Message> m_;
};

}  // namespace

std::unique_ptr<NodeSharedMemory> NodeSharedMemory::create(MPI_Comm comm) {
  int rank = 0, size = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  MPI_Comm node = split_by_node(comm);
  int node_size = 0;
  MPI_CHECK(MPI_Comm_size(node, &node_size));
  MPI_CHECK(MPI_Comm_free(&node));
  if (size < 2 || !all_ok(comm, node_size == size)) return nullptr;

  std::unique_ptr<NodeSharedMemory> group(new NodeSharedMemory(comm, rank, size));
  int64_t serial = 0;
  std::string why_not;
  const std::vector<char*> at =
      map_segments(comm, rank, size, static_cast<size_t>(sysconf(_SC_PAGESIZE)), serial, why_not);
  if (at.empty()) return nullptr;
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
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  for (Counters* c : counters_) munmap(c, page);
  for (char* p : inboxes_) munmap(p, inbox_bytes_);
}

bool NodeSharedMemory::enable_messages(int64_t max_bytes, int slots, std::string& why_not) {
  STRATA_CHECK(inboxes_.empty(), "enable_messages called twice");
  int64_t capacity = (std::max<int64_t>(max_bytes, 1) + 63) / 64 * 64;
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &capacity, 1, MPI_INT64_T, MPI_MAX, comm_));
  const int64_t stride = kSlotHeader + capacity;
  const int64_t fit = kMailboxLimit / (stride * size_);
  if (fit < 1) {
    why_not = strata::detail::cat("a message of ", capacity, " bytes does not fit the ", kMailboxLimit >> 20,
                                  " MiB of mailboxes per rank");
    return false;
  }
  const int n = static_cast<int>(std::min<int64_t>(std::max(slots, 1), fit));
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = (static_cast<size_t>(stride * n * size_) + page - 1) / page * page;
  int64_t serial = 0;
  std::vector<char*> at = map_segments(comm_, rank_, size_, bytes, serial, why_not);
  if (at.empty()) return false;
  // Fresh tmpfs pages are zero: every slot starts free. Construct the headers of the own inbox.
  for (int64_t k = 0; k < int64_t{n} * size_; ++k) new (at[static_cast<size_t>(rank_)] + k * stride) Slot();
  MPI_CHECK(MPI_Barrier(comm_));  // nobody writes a peer's slot before the peer made it an object
  inboxes_ = std::move(at);
  inbox_bytes_ = bytes;
  slots_ = n;
  slot_capacity_ = capacity;
  slot_stride_ = stride;
  sent_.assign(static_cast<size_t>(size_), 0);
  seen_.assign(static_cast<size_t>(size_), 0);
  return true;
}

NodeSharedMemory::Slot& NodeSharedMemory::slot(int receiver, int sender, int k) const {
  char* base = inboxes_[static_cast<size_t>(receiver)];
  return *reinterpret_cast<Slot*>(base + (int64_t{sender} * slots_ + k) * slot_stride_);
}

WorkPtr NodeSharedMemory::send_async(const Tensor& t, int peer, int tag) { return start_message(sends_, t, peer, tag); }

WorkPtr NodeSharedMemory::recv_async(const Tensor& t, int peer, int tag) { return start_message(recvs_, t, peer, tag); }

WorkPtr NodeSharedMemory::start_message(std::deque<std::shared_ptr<Message>>& queue, const Tensor& t, int peer,
                                        int tag) {
  if (inboxes_.empty() || !t.device().is_cpu() || static_cast<int64_t>(t.nbytes()) > slot_capacity_) return nullptr;
  auto m = std::make_shared<Message>();
  m->keep = t;
  m->peer = peer;
  m->tag = tag;
  queue.push_back(m);
  progress_messages();  // a send is copied now if its slot is free, a receive if its message is there
  return std::make_unique<MessageWork>(*this, std::move(m));
}

NodeSharedMemory::Slot* NodeSharedMemory::oldest_message(int peer, int tag, int* full) const {
  Slot* oldest = nullptr;
  uint64_t oldest_number = 0;
  int count = 0;
  for (int k = 0; k < slots_; ++k) {
    Slot& s = slot(rank_, peer, k);
    const uint64_t number = s.full.load(std::memory_order_acquire);
    if (number == 0 || number > seen_[static_cast<size_t>(peer)]) continue;
    ++count;
    if ((tag < 0 || s.tag == tag) && (oldest == nullptr || number < oldest_number)) {
      oldest = &s;
      oldest_number = number;
    }
  }
  if (full != nullptr) *full = count;
  return oldest;
}

void NodeSharedMemory::progress_messages() {
  const auto payload = [](Slot& s) { return reinterpret_cast<char*>(&s) + kSlotHeader; };
  const auto finish = [](Message& m) {
    m.done = true;
    m.keep = Tensor();
  };
  // Sends to one peer go in order, into its slots in turn: a full slot holds back that peer's
  // later sends, not the other peers'.
  std::vector<bool> held(static_cast<size_t>(size_), false);
  for (auto it = sends_.begin(); it != sends_.end();) {
    Message& m = **it;
    const auto peer = static_cast<size_t>(m.peer);
    Slot& s = slot(m.peer, rank_, static_cast<int>(sent_[peer] % static_cast<uint64_t>(slots_)));
    if (held[peer] || s.full.load(std::memory_order_acquire) != 0) {
      held[peer] = true;
      ++it;
      continue;
    }
    std::memcpy(payload(s), m.keep.raw(), m.keep.nbytes());
    s.tag = m.tag;
    s.bytes = static_cast<int64_t>(m.keep.nbytes());
    s.full.store(++sent_[peer], std::memory_order_release);
    finish(m);
    it = sends_.erase(it);
  }
  // What this pass sees of the inboxes: each peer's messages numbered up to seen_, found in
  // number order (message n is in slot (n - 1) % slots_). Slots fill while a pass looks at them;
  // without this a later receive could take a message that arrived after an earlier receive
  // with its tag looked, or one whose elder in another slot it did not see yet.
  for (int peer = 0; peer < size_; ++peer) {
    uint64_t& seen = seen_[static_cast<size_t>(peer)];
    while (slot(rank_, peer, static_cast<int>(seen % static_cast<uint64_t>(slots_)))
               .full.load(std::memory_order_acquire) == seen + 1)
      ++seen;
  }
  // Each receive takes the oldest message with its tag from its peer: moved aside first, then
  // in the slots.
  const auto take = [&](Message& m, const char* data, int64_t bytes) {
    STRATA_CHECK(bytes == static_cast<int64_t>(m.keep.nbytes()), "message with tag ", m.tag, " from rank ", m.peer,
                 " has ", bytes, " bytes, the receive expects ", m.keep.nbytes());
    std::memcpy(m.keep.raw(), data, static_cast<size_t>(bytes));
    finish(m);
  };
  for (auto it = recvs_.begin(); it != recvs_.end();) {
    Message& m = **it;
    const auto early = std::find_if(unexpected_.begin(), unexpected_.end(),
                                    [&](const Unexpected& u) { return u.peer == m.peer && u.tag == m.tag; });
    if (early != unexpected_.end()) {
      take(m, early->data.data(), static_cast<int64_t>(early->data.size()));
      unexpected_.erase(early);
    } else if (Slot* s = oldest_message(m.peer, m.tag)) {
      take(m, payload(*s), s->bytes);
      s->full.store(0, std::memory_order_release);
    } else {
      ++it;
      continue;
    }
    it = recvs_.erase(it);
  }
  // A peer whose slots are all full would wait for receives that may come later (or after a
  // receive it waits for itself): its oldest message moves here.
  for (int peer = 0; peer < size_; ++peer) {
    int full = 0;
    Slot* oldest = oldest_message(peer, /*tag=*/-1, &full);
    if (full < slots_) continue;
    const char* data = payload(*oldest);
    unexpected_.push_back({peer, oldest->tag, std::vector<char>(data, data + oldest->bytes)});
    oldest->full.store(0, std::memory_order_release);
  }
}

void NodeSharedMemory::wait_for(const Message& m) {
  uint64_t spins = 0;
  for (progress_messages(); !m.done; progress_messages()) relax(spins, comm_);
}

Tensor NodeSharedMemory::allocate(int64_t numel, DType dtype, std::string& why_not) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = std::max<size_t>((static_cast<size_t>(numel) * dtype_size(dtype) + page - 1) / page, 1) * page;
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

WorkPtr NodeSharedMemory::all_reduce_async(const Tensor& t, bool average) {
  return start_reduce(t, Op::kAllReduce, average);
}

WorkPtr NodeSharedMemory::reduce_async(const Tensor& t, int root, bool average) {
  return start_reduce(t, root, average);
}

WorkPtr NodeSharedMemory::start_reduce(const Tensor& t, int root, bool average) {
  if (t.dtype() != DType::F32) return nullptr;
  auto op = std::make_shared<Op>();
  op->root = root;
  op->count = t.numel();
  op->scale = average ? 1.0f / static_cast<float>(size_) : 1.0f;
  return start(std::move(op), t);
}

WorkPtr NodeSharedMemory::all_gather_async(const Tensor& in, const Tensor& out) {
  if (in.dtype() != out.dtype() || out.numel() != in.numel() * size_ ||
      in.raw() != static_cast<const char*>(out.raw()) + static_cast<size_t>(rank_) * in.nbytes())
    return nullptr;
  auto op = std::make_shared<Op>();
  op->root = Op::kAllGather;
  op->count = static_cast<int64_t>(out.nbytes());
  return start(std::move(op), out);
}

WorkPtr NodeSharedMemory::start(std::shared_ptr<Op> op, const Tensor& t) {
  SegmentRegistry::Mapping m;
  if (!t.device().is_cpu() || !registry().find(id_, t.raw(), t.nbytes(), m)) return nullptr;
  op->seq = ++started_;
  op->keep = t;
  op->segment = m.segment;
  op->offset = static_cast<const char*>(t.raw()) - m.at[static_cast<size_t>(rank_)];
  for (char* base : m.at) op->at.push_back(base + op->offset);
  queue_.push_back(op);
  progress();  // publishes the arrival now if nothing is ahead of it
  return std::make_unique<SharedWork>(*this, std::move(op));
}

void NodeSharedMemory::progress() {
  if (!sends_.empty() || !recvs_.empty()) progress_messages();
  while (!queue_.empty()) {
    Op& op = *queue_.front();
    while (op.phase < kComplete && advance(op)) {
    }
    if (op.phase < kComplete) return;
    queue_.pop_front();
  }
}

void NodeSharedMemory::wait_for(const Op& op) {
  uint64_t spins = 0;
  for (progress(); op.phase < kComplete; progress()) relax(spins, comm_);
}

void NodeSharedMemory::sum_into_own(const Op& op, int64_t begin, int64_t end) {
  // Elements [begin, end) = sum over ranks in rank order, through a block on the stack: the
  // own values are read before they are overwritten.
  constexpr int64_t kBlock = 1024;
  float block[kBlock];
  const auto floats = [&](int r) { return reinterpret_cast<float*>(op.at[static_cast<size_t>(r)]); };
  float* out = floats(rank_);
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = std::min(kBlock, end - b);
    const float* __restrict first = floats(0) + b;
    const float* __restrict second = floats(1) + b;
    for (int64_t i = 0; i < n; ++i) block[i] = first[i] + second[i];
    for (int r = 2; r < size_; ++r) {
      const float* __restrict next = floats(r) + b;
      for (int64_t i = 0; i < n; ++i) block[i] += next[i];
    }
    float* __restrict dst = out + b;
    for (int64_t i = 0; i < n; ++i) dst[i] = block[i] * op.scale;
  }
}

bool NodeSharedMemory::advance(Op& op) {
  Counters& mine = *counters_[static_cast<size_t>(rank_)];
  const auto everyone = [&](std::atomic<uint64_t> Counters::*counter) {
    return std::all_of(counters_.begin(), counters_.end(),
                       [&](const Counters* c) { return (c->*counter).load(std::memory_order_acquire) >= op.seq; });
  };
  // Chunk r of the range: 16-element (64-byte) aligned pieces, so no two ranks write one cache line.
  const int64_t per = ((op.count + size_ - 1) / size_ + 15) & ~int64_t{15};
  const auto lo = [&](int r) { return std::min(op.count, r * per); };
  const auto hi = [&](int r) { return std::min(op.count, (r + 1) * per); };
  switch (op.phase) {
    case 0:
      mine.segment.store(op.segment, std::memory_order_relaxed);
      mine.offset.store(op.offset, std::memory_order_relaxed);
      mine.count.store(op.count, std::memory_order_relaxed);
      mine.root.store(op.root, std::memory_order_relaxed);
      mine.arrived.store(op.seq, std::memory_order_release);
      break;
    case 1: {
      if (!everyone(&Counters::arrived)) return false;
      const auto what = [](int64_t root, int64_t count) {
        return root == Op::kAllGather   ? strata::detail::cat("all-gathers ", count, " bytes")
               : root == Op::kAllReduce ? strata::detail::cat("all-reduces ", count, " elements")
                                        : strata::detail::cat("reduces ", count, " elements to rank ", root);
      };
      for (int r = 0; r < size_; ++r) {
        const Counters& c = *counters_[static_cast<size_t>(r)];
        STRATA_CHECK(c.segment.load(std::memory_order_relaxed) == op.segment &&
                         c.offset.load(std::memory_order_relaxed) == op.offset &&
                         c.count.load(std::memory_order_relaxed) == op.count &&
                         c.root.load(std::memory_order_relaxed) == op.root,
                     "shared-memory operation ", op.seq, ": rank ", r, " ", what(c.root.load(), c.count.load()),
                     " at byte ", c.offset.load(), " of buffer ", c.segment.load(), ", rank ", rank_, " ",
                     what(op.root, op.count), " at byte ", op.offset, " of buffer ", op.segment);
      }
      if (op.root == Op::kAllGather) {  // every other rank's chunk, from its own mapping
        const int64_t chunk = op.count / size_;
        for (int r = 0; r < size_; ++r)
          if (r != rank_)
            std::memcpy(op.at[static_cast<size_t>(rank_)] + r * chunk, op.at[static_cast<size_t>(r)] + r * chunk,
                        static_cast<size_t>(chunk));
      } else if (op.root == Op::kAllReduce) {  // this rank's chunk
        sum_into_own(op, lo(rank_), hi(rank_));
      } else if (op.root == rank_) {  // a reduce: everything, on the root only
        sum_into_own(op, 0, op.count);
      }
      mine.reduced.store(op.seq, std::memory_order_release);
      break;
    }
    case 2:
      // Once everyone has reduced, the root of a reduce has read all ranges and an all-gather
      // is complete; an all-reduce copies the other chunks' sums.
      if (!everyone(&Counters::reduced)) return false;
      for (int r = 0; r < size_ && op.root == Op::kAllReduce; ++r)
        if (r != rank_ && hi(r) > lo(r))
          std::memcpy(op.at[static_cast<size_t>(rank_)] + lo(r) * static_cast<int64_t>(sizeof(float)),
                      op.at[static_cast<size_t>(r)] + lo(r) * static_cast<int64_t>(sizeof(float)),
                      static_cast<size_t>(hi(r) - lo(r)) * sizeof(float));
      mine.done.store(op.seq, std::memory_order_release);
      break;
    case 3:
      if (!everyone(&Counters::done)) return false;
      break;
  }
  ++op.phase;
  return true;
}

size_t shared_memory_peak_bytes() { return registry().peak_in_use(); }

void unlink_shared_segments_for_exit() noexcept {
  const int saved = errno;
  for (NameSlot& s : g_names)
    if (s.state.load(std::memory_order_acquire) == kNamed) shm_unlink(s.name);
  errno = saved;
}

}  // namespace strata::parallel
