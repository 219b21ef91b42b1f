#include "parallel/runtime/watchdog.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/tensor.hpp"
#include "core/trace.hpp"
#include "parallel/comm/communicator.hpp"
#include "parallel/runtime/mpi.hpp"

namespace strata::parallel::watchdog {

namespace {

double g_timeout_s = kSetupTimeoutS;
int64_t g_step = -1;
int g_bucket = -1;
thread_local Wait* t_wait = nullptr;
void (*g_expired_hook)(const std::string&) = nullptr;
const Clock::time_point g_origin = Clock::now();

double since_origin(Clock::time_point t) { return std::chrono::duration<double>(t - g_origin).count(); }

// One rank's heartbeat (one cache line). beat_ns: CLOCK_MONOTONIC, the same clock for every
// process on a node; 0 = the rank is not on this node.
struct Heartbeat {
  std::atomic<int64_t> beat_ns;
  std::atomic<uint64_t> seq;
  int64_t bytes;  // of its last started operation (op on comm): fixed fields, no formatting per operation
  char op[24], comm[16];
};
static_assert(sizeof(Heartbeat) == 64);
Heartbeat* g_beats = nullptr;
int g_world_size = 0, g_world_rank = 0;
std::vector<std::string> g_hosts;  // every world rank's host, to name a rank on another node
size_t g_beats_bytes = 0;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

void beat() {
  if (g_beats) g_beats[g_world_rank].beat_ns.store(now_ns(), std::memory_order_relaxed);
}

uint64_t mix(uint64_t h, uint64_t v) {  // splitmix64 of the combination: order-sensitive
  uint64_t x = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t mix_string(uint64_t h, const char* s) {
  for (; *s; ++s) h = mix(h, static_cast<unsigned char>(*s));
  return h;
}
constexpr uint64_t k52 = (uint64_t{1} << 52) - 1;

std::vector<std::weak_ptr<Channel>>& channels() {
  static std::vector<std::weak_ptr<Channel>> all;
  return all;
}

// A Record as it travels between ranks (no pointers).
struct WireRecord {
  uint64_t seq, collective, key;
  char comm[16], op[24];
  int64_t bytes, step;
  int32_t dtype, peer;
};

}  // namespace

void set_timeout(double seconds) { g_timeout_s = seconds; }
double timeout() { return g_timeout_s; }
AtLeast::AtLeast(double seconds) : saved_(g_timeout_s) { g_timeout_s = std::max(g_timeout_s, seconds); }
AtLeast::~AtLeast() { g_timeout_s = saved_; }
void set_step(int64_t step) { g_step = step; }
InBucket::InBucket(int bucket) { g_bucket = bucket; }
InBucket::~InBucket() { g_bucket = -1; }

std::shared_ptr<Channel> open_channel(MPI_Comm comm, const std::string& name) {
  auto c = std::make_shared<Channel>();
  c->name = name;
  int size = 0;
  MPI_Comm_size(comm, &size);
  MPI_Group group, world;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[static_cast<size_t>(i)] = i;
  c->world_ranks.resize(static_cast<size_t>(size));
  MPI_Group_translate_ranks(group, size, ranks.data(), world, c->world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  // Members create their communicators in the same order, so counting same-named groups with
  // the same members tells duplicates apart identically on every member.
  static std::map<uint64_t, int> seen;
  uint64_t key = mix_string(0, name.c_str());
  for (int r : c->world_ranks) key = mix(key, static_cast<uint64_t>(r));
  key = mix(key, static_cast<uint64_t>(seen[key]++));
  c->key = (key & k52) | 1;  // never 0: 0 marks an empty slot of a fingerprint row
  channels().push_back(c);
  return c;
}

std::string describe(const Record& r) {
  std::string s =
      detail::cat("#", r.seq, " ", r.op, " of ", log::format_bytes(r.bytes), " ", dtype_name(r.dtype), " on ", r.comm);
  if (r.peer >= 0)
    s += detail::cat(std::strncmp(r.op, "send", 4) == 0 || std::strncmp(r.op, "recv", 4) == 0 ? " peer " : " root ",
                     r.peer);
  if (r.collective > 0) s += detail::cat(" (collective ", r.collective, " there");
  if (r.step >= 0)
    s += detail::cat(r.collective > 0 ? ", " : " (", r.bucket > 0 ? detail::cat("bucket ", r.bucket, " of ") : "",
                     "step ", r.step + 1);
  if (r.collective > 0 || r.step >= 0) s += ")";
  return s;
}

uint64_t fingerprint_mix(uint64_t h, const Record& r) {
  h = mix_string(h, r.op);
  h = mix(h, static_cast<uint64_t>(r.bytes));
  h = mix(h, static_cast<uint64_t>(r.dtype));
  return mix(h, static_cast<uint64_t>(r.peer + 1));
}

Record& FlightRecorder::start(std::shared_ptr<Channel> channel, const char* op, int64_t bytes, DType dtype, int peer,
                              bool collective) {
  Record& r = ring_[next_ % kRecorderSize];
  r.seq = next_++;
  // strncpy, not snprintf: this runs for every operation (~1 us of a 50 us step otherwise).
  std::strncpy(r.comm, channel ? channel->name.c_str() : "?", sizeof r.comm - 1);
  std::strncpy(r.op, op, sizeof r.op - 1);
  r.bytes = bytes;
  r.dtype = dtype;
  r.peer = peer;
  r.step = g_step;
  r.bucket = g_bucket;
  r.start_s = since_origin(Clock::now());
  r.done = false;
  r.tag = -1;
  r.flow = 0;
  r.trace_ns = trace::recording() ? trace::now_ns() : 0;
  r.collective = 0;
  if (collective && channel) {
    r.collective = ++channel->collectives;
    channel->hash = fingerprint_mix(channel->hash, r);
  }
  r.channel = std::move(channel);
  return r;
}

void FlightRecorder::complete(uint64_t seq) {
  Record& r = ring_[seq % kRecorderSize];
  if (r.seq == seq) r.done = true;
}

const Record* FlightRecorder::find(uint64_t seq) const {
  const Record& r = ring_[seq % kRecorderSize];
  return r.seq == seq && seq > 0 ? &r : nullptr;
}

std::vector<Record> FlightRecorder::entries() const {
  std::vector<Record> out;
  const uint64_t first = next_ > kRecorderSize ? next_ - kRecorderSize : 1;
  for (uint64_t s = first; s < next_; ++s) out.push_back(ring_[s % kRecorderSize]);
  return out;
}

std::string FlightRecorder::dump() const {
  std::string text;
  for (const Record& r : entries()) {
    char times[64];
    std::snprintf(times, sizeof times, " started at %.3f s, %s", r.start_s, r.done ? "completed" : "NOT completed");
    text += detail::cat("[rank ", process_rank(), "] flight recorder: ", describe(r), times, "\n");
  }
  return text;
}

FlightRecorder& recorder() {
  static FlightRecorder r;
  return r;
}

uint64_t started(const std::shared_ptr<Channel>& channel, const char* op, int64_t bytes, DType dtype, int peer,
                 bool collective, int tag) {
  Record& r = recorder().start(channel, op, bytes, dtype, peer, collective);
  if (tag >= 0 && channel && peer >= 0 && peer < static_cast<int>(channel->world_ranks.size())) {
    const bool send = std::strncmp(op, "send", 4) == 0;
    const int other = channel->world_ranks[static_cast<size_t>(peer)];
    const int from = send ? process_rank() : other, to = send ? other : process_rank();
    uint64_t key =
        mix(mix(mix(channel->key, static_cast<uint64_t>(from)), static_cast<uint64_t>(to)), static_cast<uint64_t>(tag));
    // How many such messages this rank sent (or received) before; per direction, so that a
    // rank messaging itself counts its sends and receives alike.
    static std::map<std::pair<uint64_t, bool>, uint64_t> messages;
    r.tag = tag;
    r.flow = (mix(key, messages[{key, send}]++) & k52) | 1;  // exact in a JSON number
  }
  if (g_beats) {
    Heartbeat& h = g_beats[g_world_rank];
    h.seq.store(r.seq, std::memory_order_relaxed);
    h.bytes = r.bytes;
    std::memcpy(h.op, r.op, sizeof h.op);
    std::memcpy(h.comm, r.comm, sizeof h.comm);
    beat();
  }
  return r.seq;
}

void completed(uint64_t seq) {
  const Record* r = recorder().find(seq);
  if (!r || r->done) return;
  recorder().complete(seq);
  if (r->trace_ns == 0) return;
  // Started while recording: in the trace even if recording stopped since (it belongs to the window).
  trace::Event e;
  e.begin_ns = r->trace_ns;
  e.end_ns = trace::now_ns();
  e.track = trace::Track::Communication;
  const bool message = r->flow != 0;
  const int peer = r->channel && r->peer >= 0 && r->peer < static_cast<int>(r->channel->world_ranks.size())
                       ? r->channel->world_ranks[static_cast<size_t>(r->peer)]
                       : -1;
  e.name = detail::cat(r->op, " ", r->comm);
  if (message) e.name += detail::cat(std::strncmp(r->op, "send", 4) == 0 ? " to " : " from ", "rank ", peer);
  e.args = detail::cat("\"group\":", trace::json_string(r->comm), ",\"bytes\":", r->bytes);
  if (r->peer >= 0) e.args += detail::cat(message ? ",\"peer\":" : ",\"root\":", message ? peer : r->peer);
  if (r->bucket > 0) e.args += detail::cat(",\"bucket\":", r->bucket);
  if (message) e.args += detail::cat(",\"tag\":", r->tag, ",\"flow\":", r->flow);
  e.flow = r->flow;
  e.flow_out = message && std::strncmp(r->op, "send", 4) == 0;
  trace::record(std::move(e));
}

std::vector<std::pair<std::string, double>> waited_seconds() {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& weak : channels())
    if (const auto c = weak.lock()) {
      auto it = std::find_if(out.begin(), out.end(), [&](const auto& p) { return p.first == c->name; });
      if (it == out.end()) it = out.insert(out.end(), {c->name, 0.0});
      it->second += c->waited_s;
    }
  return out;
}

Wait::Wait(uint64_t seq) : seq_(seq), start_(Clock::now()), outer_(t_wait) {
  deadline_ = start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(g_timeout_s));
  t_wait = this;
}
Wait::~Wait() {
  t_wait = outer_;
  const Record* r = recorder().find(seq_);
  if (!r) return;
  const Clock::time_point end = Clock::now();
  if (!outer_ && r->channel) r->channel->waited_s += std::chrono::duration<double>(end - start_).count();
  if (!trace::recording()) return;
  trace::Event e;
  e.end_ns = trace::now_ns();
  e.begin_ns = e.end_ns - std::chrono::duration_cast<std::chrono::nanoseconds>(end - start_).count();
  e.track = trace::Track::Wait;
  e.name = detail::cat("wait: ", r->op, " ", r->comm);
  e.args = detail::cat("\"group\":", trace::json_string(r->comm), ",\"bytes\":", r->bytes);
  trace::record(std::move(e));
}
Wait* current_wait() { return t_wait; }
void set_expired_hook(void (*hook)(const std::string&)) { g_expired_hook = hook; }

void Wait::check() {
  const Clock::time_point now = Clock::now();
  beat();
  if (now < deadline_) [[likely]]
    return;
  const std::string line = report(seq_, std::chrono::duration<double>(now - start_).count());
  if (g_expired_hook) {
    g_expired_hook(line);
    deadline_ = Clock::time_point::max();  // report once
    return;
  }
  std::fprintf(stderr, "%s\n%s", line.c_str(), recorder().dump().c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, kExitTimeout);
  _exit(kExitTimeout);
}

std::string report(uint64_t seq, double waited_s) {
  const Record* r = recorder().find(seq);
  std::string waiting_for;
  if (r && r->channel && g_beats) {
    // Members of the communicator without a recent heartbeat; if every member is alive (waiting
    // on someone else, e.g. a pipeline neighbour), any such rank on this node.
    const int64_t now = now_ns();
    const auto quiet = [&](int w) {
      const Heartbeat& h = g_beats[w];
      const int64_t at = h.beat_ns.load(std::memory_order_relaxed);
      const double quiet_s = static_cast<double>(now - at) * 1e-9;
      if (at == 0 || quiet_s <= std::min(1.0, g_timeout_s / 2)) return std::string();
      return detail::cat("rank ", w, " (no sign of life for ", static_cast<int>(quiet_s * 10) / 10.0,
                         " s; last started #", h.seq.load(), " ", std::string(h.op, strnlen(h.op, sizeof h.op)), " of ",
                         log::format_bytes(h.bytes), " on ", std::string(h.comm, strnlen(h.comm, sizeof h.comm)), ")");
    };
    std::string stale;
    std::vector<std::pair<std::string, std::string>> unknown;  // (host, its ranks), hosts in first-seen order
    for (int w : r->channel->world_ranks) {
      if (w == g_world_rank || w < 0 || w >= g_world_size) continue;
      if (g_beats[w].beat_ns.load(std::memory_order_relaxed) == 0) {
        const std::string host = static_cast<size_t>(w) < g_hosts.size() ? g_hosts[static_cast<size_t>(w)] : "?";
        auto it = std::find_if(unknown.begin(), unknown.end(), [&](const auto& u) { return u.first == host; });
        if (it == unknown.end()) it = unknown.insert(unknown.end(), {host, ""});
        it->second += detail::cat(it->second.empty() ? "" : ", ", w);
      } else if (const std::string q = quiet(w); !q.empty()) {
        stale += (stale.empty() ? "" : ", ") + q;
      }
    }
    if (!stale.empty()) {
      waiting_for = "; waiting for " + stale;
    } else {
      for (int w = 0; w < g_world_size; ++w)
        if (const std::string q = w == g_world_rank ? "" : quiet(w); !q.empty())
          stale += (stale.empty() ? "" : ", ") + q;
      waiting_for = stale.empty() ? "; every peer on this node is alive (waiting elsewhere)"
                                  : "; its peers on this node are alive, waiting in turn for " + stale;
    }
    if (!unknown.empty()) {
      waiting_for += "; ranks";
      for (size_t k = 0; k < unknown.size(); ++k)
        waiting_for += detail::cat(k ? ", " : " ", unknown[k].second, " (", unknown[k].first, ")");
      waiting_for += ": unknown (not on this node)";
    }
  }
  char waited[32];
  std::snprintf(waited, sizeof waited, "%.1f", waited_s);
  return detail::cat("[rank ", process_rank(), "] watchdog: ", r ? describe(*r) : detail::cat("operation #", seq),
                     " not complete after ", waited, " s (--timeout ", g_timeout_s, ")", waiting_for,
                     "; aborting the job");
}

std::vector<double> fingerprint_row() {
  std::vector<double> row(kFingerprintValues, 0.0);
  std::erase_if(channels(), [](const auto& c) { return c.expired(); });
  size_t slot = 0;
  for (const auto& weak : channels()) {
    const auto c = weak.lock();
    if (slot == kMaxChannels) break;  // more communicators than slots: the first ones are compared
    row[3 * slot] = static_cast<double>(c->key);
    row[3 * slot + 1] = static_cast<double>(c->hash & k52);
    row[3 * slot + 2] = static_cast<double>(c->collectives);
    ++slot;
  }
  return row;
}

bool compare_fingerprints(const std::vector<double>& rows, int ranks, uint64_t& key, int& rank_a, int& rank_b) {
  // Every (key, rank) slot sorted by key, then rank: members of one group are adjacent, and each
  // is compared with the lowest rank of its group. O(slots log slots); the buffer is reused
  // because this runs every step.
  struct Slot {
    double key;
    int rank;
    const double* v;
  };
  static std::vector<Slot> slots;
  slots.clear();
  for (int r = 0; r < ranks; ++r)
    for (int k = 0; k < kMaxChannels; ++k)
      if (const double* v = &rows[static_cast<size_t>(r * kFingerprintValues + 3 * k)]; v[0] != 0)
        slots.push_back({v[0], r, v});
  std::sort(slots.begin(), slots.end(),
            [](const Slot& a, const Slot& b) { return a.key < b.key || (a.key == b.key && a.rank < b.rank); });
  for (size_t i = 1, first = 0; i < slots.size(); ++i) {
    if (slots[i].key != slots[first].key) {
      first = i;
      continue;
    }
    const double *f = slots[first].v, *v = slots[i].v;
    if (f[1] != v[1] || f[2] != v[2]) {
      key = static_cast<uint64_t>(v[0]);
      rank_a = slots[first].rank;
      rank_b = slots[i].rank;
      return true;
    }
  }
  return false;
}

std::string first_difference(const std::vector<Record>& a, int rank_a, const std::vector<Record>& b, int rank_b) {
  const auto same = [](const Record& x, const Record& y) {
    return std::strcmp(x.op, y.op) == 0 && x.bytes == y.bytes && x.dtype == y.dtype && x.peer == y.peer;
  };
  std::map<uint64_t, const Record*> of_b;
  for (const Record& r : b) of_b[r.collective] = &r;
  uint64_t last_a = 0, last_b = b.empty() ? 0 : b.back().collective;
  for (const Record& r : a) {
    last_a = r.collective;
    const auto it = of_b.find(r.collective);
    if (it != of_b.end() && !same(r, *it->second))
      return detail::cat("collective ", r.collective, " on ", r.comm, " differs: rank ", rank_a, " ", describe(r),
                         "; rank ", rank_b, " ", describe(*it->second));
  }
  if (last_a != last_b) {  // one side issued more
    const bool a_more = last_a > last_b;
    const std::vector<Record>& more = a_more ? a : b;
    const uint64_t n = std::min(last_a, last_b) + 1;
    for (const Record& r : more)
      if (r.collective == n)
        return detail::cat("collective ", n, " on ", r.comm, " differs: rank ", a_more ? rank_a : rank_b, " ",
                           describe(r), "; rank ", a_more ? rank_b : rank_a, " issued no collective ", n, " there");
  }
  return "the collectives differ before the last operations the flight recorders hold";
}

void sum_checking_fingerprints(Communicator& world, std::vector<double>& values) {
  const int n = world.size();
  const size_t width = values.size() + kFingerprintValues;
  std::vector<double> row = values;
  const std::vector<double> prints = fingerprint_row();
  row.insert(row.end(), prints.begin(), prints.end());
  const int64_t bytes = static_cast<int64_t>(width * sizeof(double));
  const Tensor all = Tensor::empty({n * bytes}, DType::U8);
  std::memcpy(all.view(world.rank() * bytes, {bytes}).raw(), row.data(), static_cast<size_t>(bytes));
  if (n > 1) world.all_gather(all.view(world.rank() * bytes, {bytes}), all);
  const auto* rows = static_cast<const double*>(all.raw());
  std::vector<double> fingerprints(static_cast<size_t>(n) * kFingerprintValues);
  for (size_t i = 0; i < values.size(); ++i) {
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += rows[static_cast<size_t>(r) * width + i];
    values[i] = sum;
  }
  for (int r = 0; r < n; ++r)
    std::copy_n(rows + static_cast<size_t>(r) * width + values.size(), kFingerprintValues,
                fingerprints.begin() + static_cast<ptrdiff_t>(r) * kFingerprintValues);
  uint64_t key = 0;
  int rank_a = 0, rank_b = 0;
  if (!compare_fingerprints(fingerprints, n, key, rank_a, rank_b)) return;
  // Every rank saw the same rows: all exchange their records of that channel.
  std::vector<WireRecord> mine(kRecorderSize);
  size_t count = 0;
  for (const Record& r : recorder().entries())
    if (r.collective > 0 && r.channel && r.channel->key == key) {
      WireRecord& w = mine[count++];
      w = {r.seq, r.collective, key, {}, {}, r.bytes, r.step, static_cast<int32_t>(r.dtype), r.peer};
      std::memcpy(w.comm, r.comm, sizeof w.comm);
      std::memcpy(w.op, r.op, sizeof w.op);
    }
  const int64_t wire = static_cast<int64_t>(kRecorderSize * sizeof(WireRecord));
  const Tensor records = Tensor::zeros({n * wire}, DType::U8);
  std::memcpy(records.view(world.rank() * wire, {wire}).raw(), mine.data(), static_cast<size_t>(wire));
  world.all_gather(records.view(world.rank() * wire, {wire}), records);
  const auto side = [&](int rank) {
    std::vector<Record> out;
    const auto* w = static_cast<const WireRecord*>(records.raw()) + static_cast<size_t>(rank) * kRecorderSize;
    for (int i = 0; i < kRecorderSize && w[i].collective > 0; ++i) {
      Record r;
      r.seq = w[i].seq;
      r.collective = w[i].collective;
      std::memcpy(r.comm, w[i].comm, sizeof r.comm);
      std::memcpy(r.op, w[i].op, sizeof r.op);
      r.bytes = w[i].bytes;
      r.step = w[i].step;
      r.dtype = static_cast<DType>(w[i].dtype);
      r.peer = w[i].peer;
      out.push_back(r);
    }
    return out;
  };
  if (world.rank() == 0) {
    std::fprintf(stderr, "[rank 0] watchdog: the ranks disagree about their collectives: %s; aborting the job\n%s",
                 first_difference(side(rank_a), rank_a, side(rank_b), rank_b).c_str(), recorder().dump().c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitTimeout);
    _exit(kExitTimeout);
  }
  world.barrier();  // rank 0 never joins: its MPI_Abort ends this rank (or the deadline does)
  _exit(kExitTimeout);
}

void open_heartbeats(MPI_Comm world, MPI_Comm node) {
  MPI_Comm_rank(world, &g_world_rank);
  MPI_Comm_size(world, &g_world_size);
  g_hosts = host_names(world);
  int local = 0;
  MPI_Comm_rank(node, &local);
  // The node's first rank names the segment (its pid is unique on the node).
  int pid = static_cast<int>(getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, node);
  const std::string name = detail::cat("/strata-heartbeat-", pid);
  g_beats_bytes = sizeof(Heartbeat) * static_cast<size_t>(g_world_size);
  int ok = 1;
  if (local == 0) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ok = fd >= 0 && ftruncate(fd, static_cast<off_t>(g_beats_bytes)) == 0;
    if (fd >= 0) close(fd);
  }
  MPI_Bcast(&ok, 1, MPI_INT, 0, node);
  void* at = MAP_FAILED;
  if (ok) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      at = mmap(nullptr, g_beats_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
    }
  }
  int mapped = at != MAP_FAILED;
  MPI_Allreduce(MPI_IN_PLACE, &mapped, 1, MPI_INT, MPI_MIN, node);
  if (local == 0) shm_unlink(name.c_str());  // every rank has it mapped (or gave up): nothing to leak
  if (!mapped) {                             // no names in reports, nothing else changes
    if (at != MAP_FAILED) munmap(at, g_beats_bytes);
    return;
  }
  g_beats = static_cast<Heartbeat*>(at);
  beat();
}

void close_heartbeats() {
  if (g_beats) munmap(g_beats, g_beats_bytes);
  g_beats = nullptr;
}

}  // namespace strata::parallel::watchdog
