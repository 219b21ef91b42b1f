// What the three parts of NodeSharedMemory share: the page of counters every rank publishes
// (made with the group, read by the collectives), the registry of mapped segments (the
// buffers allocate() hands out, which the collectives look up), the collective that makes and
// maps one segment per rank (for the counters, the buffers and the mailboxes), and the wait
// between two polls of a peer's memory. Private to shared_memory_*.cpp.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/comm/shared_memory.hpp"

namespace strata::parallel {

struct NodeSharedMemory::Counters {
  std::atomic<uint64_t> arrived{0}, reduced{0}, done{0};
  // The operation `arrived` names, so that peers can check it is theirs too.
  std::atomic<int64_t> segment{0}, offset{0}, count{0}, root{0};
};

namespace shm_detail {

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

  void* allocate(size_t) override;
  void deallocate(void* ptr, size_t) noexcept override;
  Device device() const override { return Device::cpu(); }
  // This rank's own segments (the peers' mappings are theirs, counted by them).
  size_t peak_in_use() const override;

  void add(Mapping m);
  // A segment of this rank's that no tensor holds (a group's counters, its inbox), mapped
  // (+bytes) or unmapped (-bytes): counted like the buffers, as the cap counts them.
  void count(int64_t bytes);
  // The mapping of `group` that holds [p, p + bytes), if any.
  bool find(uint64_t group, const void* p, size_t bytes, Mapping& out) const;

 private:
  mutable std::mutex mutex_;
  std::map<char*, Mapping> mappings_;
  size_t in_use_ = 0, peak_ = 0;
};

SegmentRegistry& registry();

// Collective: every rank creates a segment of `bytes` and maps everyone's. Returns the
// mappings (index = rank) and the segment's serial number, or nothing on every rank if any
// rank failed (`why_not` then says what failed). No name is left in /dev/shm afterwards.
std::vector<char*> map_segments(MPI_Comm comm, int rank, int size, size_t bytes, int64_t& serial, std::string& why_not);

// Waiting for a peer: spin briefly, then give the core away (ranks may outnumber cores), and
// now and then let MPI progress, in case a peer waits on an MPI operation of this rank.
void relax(uint64_t& spins, MPI_Comm comm);

}  // namespace shm_detail
}  // namespace strata::parallel
