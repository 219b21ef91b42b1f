// Point-to-point messages through shared memory (the pipeline's activations and gradients),
// once enable_messages() has set up the mailboxes: every rank owns an inbox segment with a few
// slots per sender. A send copies the message into the next slot of the receiver's inbox (or,
// with that slot still full, at a later call of this group) and marks it full; the receiver
// copies it out and marks it free. When every slot from a peer is full and no receive takes
// them, the oldest is moved to this rank's memory (an unexpected message, as MPI keeps them), so
// a sender never waits on a receive that is started later. Open MPI moves a 128 KiB message
// with a rendezvous (a request, the receiver's single copy, an acknowledgement); here it is two
// copies and one flag.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "parallel/comm/shared_memory_internal.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::parallel {

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

constexpr int64_t kSlotHeader = 64;
constexpr int64_t kMailboxLimit = int64_t{64} << 20;  // bytes per rank's inbox
static_assert(sizeof(NodeSharedMemory::Slot) <= kSlotHeader);

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

using shm_detail::map_segments;
using shm_detail::registry;
using shm_detail::relax;

namespace {

// A slot's payload (the largest message, in cache lines) and how many slots per sender fit.
struct MailboxShape {
  int64_t capacity = 0, stride = 0;
  int slots = 0;  // 0: one slot would exceed kMailboxLimit
  int64_t bytes(int size) const {
    const int64_t page = sysconf(_SC_PAGESIZE);
    return slots == 0 ? 0 : (stride * slots * size + page - 1) / page * page;
  }
};

MailboxShape mailbox_shape(int64_t max_bytes, int slots, int size) {
  MailboxShape m;
  m.capacity = (std::max<int64_t>(max_bytes, 1) + 63) / 64 * 64;
  m.stride = kSlotHeader + m.capacity;
  const int64_t fit = kMailboxLimit / (m.stride * size);
  m.slots = static_cast<int>(std::min<int64_t>(std::max(slots, 1), fit));
  return m;
}

}  // namespace

int64_t NodeSharedMemory::mailbox_bytes(int64_t max_bytes, int slots, int size) {
  return mailbox_shape(max_bytes, slots, size).bytes(size);
}

bool NodeSharedMemory::enable_messages(int64_t max_bytes, int slots, std::string& why_not) {
  STRATA_CHECK(inboxes_.empty(), "enable_messages called twice");
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &max_bytes, 1, MPI_INT64_T, MPI_MAX, comm_));
  const MailboxShape shape = mailbox_shape(max_bytes, slots, size_);
  const int64_t stride = shape.stride, capacity = shape.capacity;
  const int n = shape.slots;
  if (n < 1) {
    why_not = strata::detail::cat("a message of ", capacity, " bytes does not fit the ", kMailboxLimit >> 20,
                                  " MiB of mailboxes per rank");
    return false;
  }
  const auto bytes = static_cast<size_t>(shape.bytes(size_));
  int64_t serial = 0;
  std::vector<char*> at = map_segments(comm_, rank_, size_, bytes, serial, why_not);
  if (at.empty()) return false;
  registry().count(static_cast<int64_t>(bytes));
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

}  // namespace strata::parallel
