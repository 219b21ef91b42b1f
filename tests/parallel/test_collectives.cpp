// MpiCommunicator under real MPI (2 and 4 ranks): every collective, blocking and async, at odd
// sizes and for every dtype, against a serial reference computed locally from each rank's
// known contribution. Integer-valued contributions make the sums exact in every dtype, so
// those checks are equalities; one test adds arbitrary values in bf16/f16 with a tolerance.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "parallel/collective_values.hpp"
#include "parallel/comm/mpi_communicator.hpp"
#include "parallel/comm/shared_memory.hpp"

namespace strata::parallel {
namespace {

using namespace testing_values;

std::string label(DType t, int64_t n, bool async) {
  return strata::detail::cat(dtype_name(t), " n=", n, async ? " async" : " blocking");
}

class Collectives : public testing::Test {
 protected:
  MpiCommunicator comm_{MPI_COMM_WORLD, "world"};
  int rank_ = comm_.rank();
  int size_ = comm_.size();
};

TEST_F(Collectives, Identity) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(comm_.rank(), rank);
  EXPECT_EQ(comm_.size(), size);
  EXPECT_EQ(comm_.name(), "world");
  EXPECT_NE(comm_.comm(), MPI_COMM_WORLD);  // a private duplicate
}

TEST_F(Collectives, AllReduceSum) {
  for (DType type : kAllTypes)
    for (int64_t n : kSizes)
      for (bool async : {false, true}) {
        SCOPED_TRACE(label(type, n, async));
        Tensor t = filled(type, n, rank_);
        if (async) {
          WorkPtr w = comm_.all_reduce_async(t, ReduceOp::Sum);
          w->wait();
        } else {
          comm_.all_reduce(t, ReduceOp::Sum);
        }
        EXPECT_EQ(count_wrong(t, [&](int64_t i) { return reference_sum(type, size_, 0, i); }), 0);
      }
}

TEST_F(Collectives, DoubleSumIsExactAndTheSameEverywhere) {
  // Values no f32 sum could hold: 1 + rank * 2^-40 needs 41 bits of mantissa.
  std::vector<double> values{1.0 + std::ldexp(static_cast<double>(rank_), -40), -0.5 * rank_, 0.0};
  all_reduce_sum(comm_, values);
  double expected = 0;
  for (int r = 0; r < size_; ++r) expected += 1.0 + std::ldexp(static_cast<double>(r), -40);
  EXPECT_EQ(values[0], expected);
  EXPECT_EQ(values[1], -0.25 * size_ * (size_ - 1));
  EXPECT_EQ(values[2], 0.0);
  // Every rank holds the same bits.
  double first = values[0];
  MPI_Bcast(&first, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  EXPECT_EQ(values[0], first);
}

TEST_F(Collectives, AllReduceAvg) {
  // Sizes 2 and 4 are powers of two: the average of integers is exact in every float dtype.
  for (DType type : kFloatTypes)
    for (int64_t n : kSizes)
      for (bool async : {false, true}) {
        SCOPED_TRACE(label(type, n, async));
        Tensor t = filled(type, n, rank_);
        if (async)
          comm_.all_reduce_async(t, ReduceOp::Avg)->wait();
        else
          comm_.all_reduce(t, ReduceOp::Avg);
        EXPECT_EQ(count_wrong(t, [&](int64_t i) { return reference_sum(type, size_, 0, i) / size_; }), 0);
      }
}

TEST_F(Collectives, AvgOfIntegersIsRefused) {
  for (DType type : {DType::I32, DType::U8}) {
    Tensor t = filled(type, 3, rank_);
    EXPECT_THROW(comm_.all_reduce_async(t, ReduceOp::Avg), Error) << dtype_name(type);
  }
  comm_.barrier();  // nothing was started: the communicator is still in step on every rank
}

// bf16/f16 with arbitrary values: each pairwise step adds in f32 and rounds once, so the
// result is within size * u * sum|x| of the exact sum (u = 2^-8 for bf16, 2^-11 for f16).
TEST_F(Collectives, HalfPrecisionSumWithinTolerance) {
  const int64_t n = 10007;
  auto value = [](int rank, int64_t i) {
    return std::sin(0.37 * static_cast<double>(i) + 1.3 * rank) * std::exp2(static_cast<double>(i % 9) - 4.0);
  };
  for (DType type : {DType::BF16, DType::F16}) {
    SCOPED_TRACE(dtype_name(type));
    const double u = type == DType::BF16 ? std::exp2(-8.0) : std::exp2(-11.0);
    Tensor t = Tensor::empty({n}, type);
    for (int64_t i = 0; i < n; ++i) set(t, i, value(rank_, i));
    comm_.all_reduce(t, ReduceOp::Sum);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      double exact = 0, magnitude = 0;
      Tensor one = Tensor::empty({1}, type);
      for (int r = 0; r < size_; ++r) {
        set(one, 0, value(r, i));  // what rank r actually sent: its value rounded to the dtype
        exact += get(one, 0);
        magnitude += std::abs(get(one, 0));
      }
      if (std::abs(get(t, i) - exact) > size_ * u * magnitude + 1e-7) {
        if (wrong++ == 0) ADD_FAILURE() << "[" << i << "] " << get(t, i) << " vs " << exact;
      }
    }
    EXPECT_EQ(wrong, 0);
  }
}

TEST_F(Collectives, ReduceScatterPlacesChunkOfRank) {
  for (DType type : kAllTypes)
    for (int64_t n : kSizes)
      for (bool async : {false, true}) {
        SCOPED_TRACE(label(type, n, async));
        Tensor in = filled(type, n * size_, rank_);
        Tensor out = Tensor::empty({n}, type);
        if (async)
          comm_.reduce_scatter_async(in, out, ReduceOp::Sum)->wait();
        else
          comm_.reduce_scatter(in, out, ReduceOp::Sum);
        EXPECT_EQ(count_wrong(out, [&](int64_t i) { return reference_sum(type, size_, rank_ * n, i); }), 0);
      }
}

TEST_F(Collectives, ReduceScatterAvg) {
  for (DType type : kFloatTypes) {
    SCOPED_TRACE(dtype_name(type));
    const int64_t n = 1003;
    Tensor in = filled(type, n * size_, rank_);
    Tensor out = Tensor::empty({n}, type);
    comm_.reduce_scatter(in, out, ReduceOp::Avg);
    EXPECT_EQ(count_wrong(out, [&](int64_t i) { return reference_sum(type, size_, rank_ * n, i) / size_; }), 0);
  }
}

TEST_F(Collectives, ReduceScatterChecksSizes) {
  Tensor in = Tensor::empty({7});
  Tensor out = Tensor::empty({3});
  EXPECT_THROW(comm_.reduce_scatter_async(in, out, ReduceOp::Sum), Error);
  EXPECT_THROW(comm_.reduce_scatter_async(in, in.view(0, {1}), ReduceOp::Sum), Error);
}

TEST_F(Collectives, AllGatherPlacesChunkFromEachRank) {
  for (DType type : kAllTypes)
    for (int64_t n : kSizes)
      for (bool async : {false, true}) {
        SCOPED_TRACE(label(type, n, async));
        Tensor in = filled(type, n, rank_);
        Tensor out = Tensor::empty({n * size_}, type);
        if (async)
          comm_.all_gather_async(in, out)->wait();
        else
          comm_.all_gather(in, out);
        EXPECT_EQ(count_wrong(out,
                              [&](int64_t i) {
                                return contribution(type, static_cast<int>(i / std::max<int64_t>(n, 1)),
                                                    i % std::max<int64_t>(n, 1));
                              }),
                  0);
      }
}

TEST_F(Collectives, AllGatherInPlace) {
  // ZeRO's shape: my shard is already chunk rank() of the full buffer.
  for (DType type : kAllTypes) {
    SCOPED_TRACE(dtype_name(type));
    const int64_t n = 1001;
    Tensor out = Tensor::zeros({n * size_}, type);
    Tensor mine = out.view(rank_ * n, {n});
    mine.copy_from(filled(type, n, rank_));
    comm_.all_gather(mine, out);
    EXPECT_EQ(count_wrong(out, [&](int64_t i) { return contribution(type, static_cast<int>(i / n), i % n); }), 0);
  }
}

TEST_F(Collectives, ReduceToEveryRoot) {
  // The root gets the sum in place; the others only send and keep their own values.
  for (DType type : kAllTypes)
    for (int64_t n : kSizes)
      for (int root = 0; root < size_; ++root)
        for (bool async : {false, true}) {
          SCOPED_TRACE(label(type, n, async) + " root " + std::to_string(root));
          Tensor t = filled(type, n, rank_);
          if (async)
            comm_.reduce_async(t, root, ReduceOp::Sum)->wait();
          else
            comm_.reduce(t, root, ReduceOp::Sum);
          EXPECT_EQ(count_wrong(t,
                                [&](int64_t i) {
                                  return rank_ == root ? reference_sum(type, size_, 0, i)
                                                       : contribution(type, rank_, i);
                                }),
                    0);
        }
}

TEST_F(Collectives, ReduceAvgScalesOnlyTheRoot) {
  for (DType type : kFloatTypes) {
    SCOPED_TRACE(dtype_name(type));
    const int64_t n = 1003;
    Tensor t = filled(type, n, rank_);
    comm_.reduce(t, size_ - 1, ReduceOp::Avg);
    EXPECT_EQ(count_wrong(t,
                          [&](int64_t i) {
                            return rank_ == size_ - 1 ? reference_sum(type, size_, 0, i) / size_
                                                      : contribution(type, rank_, i);
                          }),
              0);
  }
}

TEST_F(Collectives, ReduceChecksRoot) {
  Tensor t = Tensor::empty({3});
  EXPECT_THROW(comm_.reduce_async(t, size_, ReduceOp::Sum), Error);
  EXPECT_THROW(comm_.reduce_async(Tensor::empty({3}, DType::I32), 0, ReduceOp::Avg), Error);
  comm_.barrier();  // nothing was started
}

TEST_F(Collectives, BroadcastFromEveryRoot) {
  for (DType type : kAllTypes)
    for (int64_t n : kSizes)
      for (int root = 0; root < size_; ++root)
        for (bool async : {false, true}) {
          SCOPED_TRACE(label(type, n, async) + " root " + std::to_string(root));
          Tensor t = filled(type, n, rank_);
          if (async)
            comm_.broadcast_async(t, root)->wait();
          else
            comm_.broadcast(t, root);
          EXPECT_EQ(count_wrong(t, [&](int64_t i) { return contribution(type, root, i); }), 0);
        }
}

TEST_F(Collectives, SendRecvRingWithTagsOutOfOrder) {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (DType type : kAllTypes) {
    SCOPED_TRACE(dtype_name(type));
    const int64_t sizes[] = {3, 1000003, 1, 0};  // tag k carries sizes[k] elements
    std::vector<Tensor> out, in(4);
    std::vector<WorkPtr> work;
    // Receives posted in reverse tag order, before the sends: matching is by tag, not order.
    for (int tag = 3; tag >= 0; --tag) {
      in[tag] = Tensor::zeros({sizes[tag]}, type);
      work.push_back(comm_.recv_async(in[tag], prev, tag));
    }
    for (int tag = 0; tag < 4; ++tag) {
      out.push_back(filled(type, sizes[tag], rank_, 1000 * tag));
      work.push_back(comm_.send_async(out.back(), next, tag));
    }
    for (auto& w : work) w->wait();
    for (int tag = 0; tag < 4; ++tag)
      EXPECT_EQ(count_wrong(in[tag], [&](int64_t i) { return contribution(type, prev, 1000 * tag + i); }), 0)
          << "tag " << tag;
  }
}

TEST_F(Collectives, SendRecvSameTagKeepsOrder) {
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  Tensor a = filled(DType::I32, 5, rank_, 0), b = filled(DType::I32, 5, rank_, 100);
  Tensor ra = Tensor::empty({5}, DType::I32), rb = Tensor::empty({5}, DType::I32);
  WorkPtr r1 = comm_.recv_async(ra, prev, 7);
  WorkPtr r2 = comm_.recv_async(rb, prev, 7);
  comm_.send(a, next, 7);
  comm_.send(b, next, 7);
  r2->wait();
  r1->wait();
  EXPECT_EQ(count_wrong(ra, [&](int64_t i) { return contribution(DType::I32, prev, i); }), 0);
  EXPECT_EQ(count_wrong(rb, [&](int64_t i) { return contribution(DType::I32, prev, 100 + i); }), 0);
}

TEST_F(Collectives, BarrierWaitsForTheLastRank) {
  using Clock = std::chrono::steady_clock;
  const auto delay = std::chrono::milliseconds(100);
  comm_.barrier();
  const auto start = Clock::now();
  if (rank_ == size_ - 1) std::this_thread::sleep_for(delay);
  WorkPtr w = comm_.barrier_async();
  while (!w->test()) comm_.progress();
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, delay / 2);  // every rank left the barrier only after the sleeper entered it
}

TEST_F(Collectives, ManyOverlappingAsyncOpsCompleteInOrder) {
  // A backward pass's shape: many buckets started one after another, progress() between them,
  // then waited in the order they were started.
  struct Op {
    Tensor t;
    DType type;
    WorkPtr work;
  };
  std::vector<Op> ops;
  const int64_t sizes[] = {1, 3, 1000, 65537, 300001};
  for (int k = 0; k < 20; ++k) {
    const DType type = kAllTypes[k % 5];
    Op op{filled(type, sizes[k % 5], rank_, k), type, nullptr};
    op.work = comm_.all_reduce_async(op.t, ReduceOp::Sum);
    comm_.progress();
    ops.push_back(std::move(op));
  }
  Tensor gathered = Tensor::empty({3 * size_}, DType::I32);
  WorkPtr gather = comm_.all_gather_async(filled(DType::I32, 3, rank_), gathered);
  EXPECT_GT(comm_.in_flight(), 0);
  for (int k = 0; k < 20; ++k) {
    ops[k].work->wait();
    EXPECT_EQ(count_wrong(ops[k].t, [&](int64_t i) { return reference_sum(ops[k].type, size_, k, i); }), 0)
        << "op " << k;
  }
  gather->wait();
  EXPECT_EQ(count_wrong(gathered, [&](int64_t i) { return contribution(DType::I32, static_cast<int>(i / 3), i % 3); }),
            0);
  comm_.progress();
  EXPECT_EQ(comm_.in_flight(), 0);
}

TEST_F(Collectives, TestPollsUntilComplete) {
  Tensor t = filled(DType::F32, 1000003, rank_);
  WorkPtr w = comm_.all_reduce_async(t, ReduceOp::Avg);
  while (!w->test()) comm_.progress();
  EXPECT_TRUE(w->test());  // stays complete; Avg scaling applied once
  w->wait();
  EXPECT_EQ(count_wrong(t, [&](int64_t i) { return reference_sum(DType::F32, size_, 0, i) / size_; }), 0);
}

TEST_F(Collectives, DroppedHandleStillCompletes) {
  Tensor t = filled(DType::F32, 100003, rank_);
  comm_.all_reduce_async(t, ReduceOp::Sum);  // the handle's destructor waits
  EXPECT_EQ(count_wrong(t, [&](int64_t i) { return reference_sum(DType::F32, size_, 0, i); }), 0);
}

// Shared memory from allocate(): CTest runs every rank on this node, so the group is one node.
class SharedMemory : public Collectives {
 protected:
  // Arbitrary floats (not integers): the sum's rounding is then visible. Rank r's element i.
  static float value(int rank, int64_t i) { return std::sin(0.37f * static_cast<float>(i) + 1.3f * rank) * 1e3f; }
  Tensor allocate_filled(int64_t n) {
    Tensor t = comm_.allocate(n, DType::F32, Device::cpu());
    for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = value(rank_, i);
    return t;
  }
  // Runs `f`, which must throw an Error whose message contains `fragment` (on every rank).
  template <class F>
  static void expect_error(F f, const std::string& fragment) {
    try {
      f();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no error saying \"" << fragment << "\"";
  }
  // The sum in rank order, in f32: what the shared-memory all-reduce must give bitwise.
  float rank_order_sum(int64_t i) const {
    float s = value(0, i) + value(1, i);
    for (int r = 2; r < size_; ++r) s += value(r, i);
    return s;
  }
};

TEST_F(SharedMemory, AllocatesZeroedSharedBuffers) {
  for (int64_t n : {1, 1000, 1000003}) {
    const Tensor t = comm_.allocate(n, DType::F32, Device::cpu());
    ASSERT_EQ(t.numel(), n);
    EXPECT_TRUE(comm_.in_shared_memory(t));
    EXPECT_TRUE(comm_.in_shared_memory(t.view(n / 2, {n - n / 2})));
    EXPECT_EQ(count_wrong(t, [](int64_t) { return 0.0; }), 0);
  }
  EXPECT_FALSE(comm_.in_shared_memory(Tensor::zeros({10})));
}

TEST_F(SharedMemory, AllReduceIsTheRankOrderSumOnEveryRank) {
  // Bitwise: each chunk is summed once, in rank order, by its owner and copied to the others.
  for (int64_t n : {1, 3, 17, 1000003}) {
    SCOPED_TRACE(n);
    Tensor t = allocate_filled(n);
    comm_.all_reduce(t, ReduceOp::Sum);
    EXPECT_EQ(count_wrong(t, [&](int64_t i) { return rank_order_sum(i); }), 0);
  }
}

TEST_F(SharedMemory, AverageAndOddRangesOfOneBuffer) {
  const int64_t n = 100003;
  Tensor t = allocate_filled(n);
  const Tensor head = t.view(0, {5}), middle = t.view(5, {70001}), tail = t.view(70006, {n - 70006});
  comm_.all_reduce(middle, ReduceOp::Avg);
  comm_.all_reduce(tail, ReduceOp::Sum);
  const float inv = 1.0f / static_cast<float>(size_);
  EXPECT_EQ(count_wrong(head, [&](int64_t i) { return value(rank_, i); }), 0);  // untouched
  EXPECT_EQ(count_wrong(middle, [&](int64_t i) { return rank_order_sum(5 + i) * inv; }), 0);
  EXPECT_EQ(count_wrong(tail, [&](int64_t i) { return rank_order_sum(70006 + i); }), 0);
}

TEST_F(SharedMemory, BucketsStartedInTurnCompleteWhateverTheWaitOrder) {
  // the bucket reducer's pattern: one bucket after another, progress() in between; waited backwards
  // here, and mixed with an MPI all-reduce of ordinary memory.
  const int64_t n = 300007;
  Tensor t = allocate_filled(n);
  Tensor plain = filled(DType::F32, 1001, rank_);
  const int64_t cuts[] = {0, 1, 4096, 150001, 299999, n};
  std::vector<WorkPtr> works;
  for (int k = 0; k < 5; ++k) {
    works.push_back(comm_.all_reduce_async(t.view(cuts[k], {cuts[k + 1] - cuts[k]}), ReduceOp::Sum));
    comm_.progress();
  }
  WorkPtr mpi = comm_.all_reduce_async(plain, ReduceOp::Sum);
  EXPECT_GT(comm_.in_flight(), 0);
  for (int k = 4; k >= 0; --k) works[static_cast<size_t>(k)]->wait();
  mpi->wait();
  EXPECT_EQ(count_wrong(t, [&](int64_t i) { return rank_order_sum(i); }), 0);
  EXPECT_EQ(count_wrong(plain, [&](int64_t i) { return reference_sum(DType::F32, size_, 0, i); }), 0);
  comm_.progress();
  EXPECT_EQ(comm_.in_flight(), 0);
}

TEST_F(SharedMemory, TestPollsAndADroppedHandleCompletes) {
  Tensor t = allocate_filled(65536);
  WorkPtr w = comm_.all_reduce_async(t, ReduceOp::Sum);
  while (!w->test()) {
  }
  comm_.all_reduce_async(t, ReduceOp::Avg);  // dropped: its destructor waits
  // Every rank held the same sums s: their average is (s + s + ...) * (1 / size) in f32.
  const auto average_of_sums = [&](int64_t i) {
    const float s = rank_order_sum(i);
    float sum = s + s;
    for (int r = 2; r < size_; ++r) sum += s;
    return sum * (1.0f / static_cast<float>(size_));
  };
  EXPECT_EQ(count_wrong(t, average_of_sums), 0);
}

TEST_F(SharedMemory, ReduceToEveryRootLeavesTheOthersUnchanged) {
  // ZeRO's reduce of a bucket's pieces to their owners: pieces of one buffer, one per root.
  const int64_t piece = 10007;
  Tensor t = allocate_filled(piece * size_);
  std::vector<WorkPtr> works;
  for (int root = 0; root < size_; ++root)
    works.push_back(comm_.reduce_async(t.view(root * piece, {piece}), root, root % 2 ? ReduceOp::Avg : ReduceOp::Sum));
  for (WorkPtr& w : works) w->wait();
  const float inv = 1.0f / static_cast<float>(size_);
  EXPECT_EQ(count_wrong(t,
                        [&](int64_t i) {
                          const int64_t root = i / piece;
                          if (root != rank_) return static_cast<double>(value(rank_, i));
                          return static_cast<double>(root % 2 ? rank_order_sum(i) * inv : rank_order_sum(i));
                        }),
            0);
}

TEST_F(SharedMemory, AllGatherInPlaceOfAnyDtypeBetweenReduces) {
  // ZeRO's parameters after the sharded step: each rank's chunk is its own, the rest is stale
  // until the all-gather; bf16 (mixed precision's parameters) and an odd chunk size. The
  // all-reduces on either side check that the operations stay in order.
  const int64_t chunk = 4099;
  Tensor params = comm_.allocate(chunk * size_, DType::BF16, Device::cpu());
  ASSERT_TRUE(comm_.in_shared_memory(params));
  Tensor grads = allocate_filled(3001);
  const auto stored = [](int rank, int64_t i) { return static_cast<float>((i * 3 + rank * 11) % 256); };
  for (int64_t i = 0; i < chunk * size_; ++i)  // exact in bf16: integers below 256
    params.data<bf16>()[i] = bf16::from_float(i / chunk == rank_ ? stored(rank_, i) : -1.0f);
  comm_.all_reduce(grads, ReduceOp::Sum);
  const int64_t before = comm_.bytes_sent();
  WorkPtr w = comm_.all_gather_async(params.view(rank_ * chunk, {chunk}), params);
  WorkPtr after = comm_.all_reduce_async(grads, ReduceOp::Sum);
  w->wait();
  after->wait();
  EXPECT_EQ(comm_.bytes_sent() - before,
            static_cast<int64_t>(params.nbytes()) * (size_ - 1) / size_ + 4 * 3001 * 2 * (size_ - 1) / size_);
  int64_t wrong = 0;
  for (int64_t i = 0; i < chunk * size_; ++i)
    wrong += params.data<bf16>()[i].to_float() != stored(static_cast<int>(i / chunk), i);
  EXPECT_EQ(wrong, 0);
  // Summed twice: each element is (its rank-order sum) * size, rounded the same way everywhere.
  std::vector<float> all(3001 * static_cast<size_t>(size_));
  MPI_Allgather(grads.raw(), 3001, MPI_FLOAT, all.data(), 3001, MPI_FLOAT, MPI_COMM_WORLD);
  EXPECT_EQ(std::memcmp(all.data(), all.data() + 3001 * (size_ - 1), 3001 * sizeof(float)), 0);
}

TEST_F(SharedMemory, NoSegmentKeepsANameOnceMapped) {
  // Each segment's name goes as soon as every rank has opened it, so a rank killed later
  // (SIGKILL, a second stop signal) leaves nothing in /dev/shm. Names: /strata-<rank 0's pid>-...
  int pid = static_cast<int>(getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const std::string prefix = strata::detail::cat("strata-", pid, "-");
  Tensor t = allocate_filled(100003);
  comm_.reserve_messages(4096, 2);
  MPI_Barrier(MPI_COMM_WORLD);
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm"))
    EXPECT_NE(entry.path().filename().string().rfind(prefix, 0), 0u) << entry.path();
  // Nothing is registered for the exit path any more: it unlinks nothing, the buffers still work.
  unlink_shared_segments_for_exit();
  comm_.all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(count_wrong(t, [&](int64_t i) { return rank_order_sum(i); }), 0);
}

TEST_F(SharedMemory, BytesSentCountedAsTheRing) {
  Tensor t = allocate_filled(1000);
  const int64_t before = comm_.bytes_sent();
  comm_.all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(comm_.bytes_sent() - before, 4000 * 2 * (size_ - 1) / size_);
}

TEST_F(SharedMemory, DifferentRangesOnDifferentRanksAreAnError) {
  // A bug in the caller, not a hang: every rank sees the mismatch and throws.
  MpiCommunicator comm(MPI_COMM_WORLD, "mismatch");
  Tensor t = comm.allocate(64, DType::F32, Device::cpu());
  // Found when starting (the peers are there already) or when waiting.
  expect_error([&] { comm.all_reduce_async(t.view(rank_ == 0 ? 0 : 16, {32}), ReduceOp::Sum)->wait(); },
               "all-reduces 32 elements at byte");
}

TEST_F(SharedMemory, AllGatherTakesTheSharedPath) {
  // Different offsets on different ranks: MPI would gather silently; the shared path compares
  // the ranges every rank announced, which proves the all-gather went through it.
  MpiCommunicator comm(MPI_COMM_WORLD, "gather mismatch");
  Tensor t = comm.allocate(64 * size_ + 16, DType::F32, Device::cpu());
  const Tensor out = t.view(rank_ == 0 ? 0 : 16, {64 * size_});
  expect_error([&] { comm.all_gather_async(out.view(rank_ * 64, {64}), out)->wait(); }, "all-gathers");
}

TEST_F(SharedMemory, MessagesThroughMailboxesKeepMpiOrder) {
  // Around the ring, more messages than slots: later sends wait for a free slot, and receives
  // started in reverse order make the receiver move messages aside. Two messages with one tag
  // go to the receives in the order these were started, as MPI matches them; one larger than
  // the mailboxes goes through MPI.
  MpiCommunicator comm(MPI_COMM_WORLD, "messages");
  const int64_t n = 1001;
  comm.reserve_messages(n * 4, 2);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const auto message = [&](int from, int k, int64_t numel) {
    Tensor t = Tensor::empty({numel});
    for (int64_t i = 0; i < numel; ++i) t.data<float>()[i] = value(from, k * numel + i);
    return t;
  };
  std::vector<WorkPtr> works;
  const int tags[] = {0, 1, 2, 3, 4, 7, 7};
  for (int k = 0; k < 7; ++k) works.push_back(comm.send_async(message(rank_, k, n), next, tags[k]));
  works.push_back(comm.send_async(message(rank_, 9, 3 * n), next, 9));
  std::vector<Tensor> got(8);
  for (int k = 8; k-- > 0;) {
    got[k] = Tensor::empty({k == 7 ? 3 * n : n});
    works.push_back(comm.recv_async(got[k], prev, k == 7 ? 9 : tags[k]));
  }
  for (WorkPtr& w : works) w->wait();
  const int sent_as[] = {0, 1, 2, 3, 4, 6, 5};  // got[6] was started first of the two tag-7 receives
  for (int k = 0; k < 8; ++k) {
    const Tensor want = k == 7 ? message(prev, 9, 3 * n) : message(prev, sent_as[k], n);
    EXPECT_EQ(std::memcmp(got[k].raw(), want.raw(), want.nbytes()), 0) << "message " << k;
  }
  EXPECT_EQ(comm.in_flight(), 0);
}

TEST_F(SharedMemory, ReceivesWithOneTagTakeMessagesInTheOrderTheyWereStarted) {
  // Many receives with one tag wait before their messages are sent: a pass over them must not
  // give a message that arrives in the middle of the pass to a later receive (a race seen about
  // once in 100 runs of the test above on a loaded machine; here many times per run).
  MpiCommunicator comm(MPI_COMM_WORLD, "one tag");
  comm.reserve_messages(64, 2);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  constexpr int kMessages = 200;
  std::vector<Tensor> got(kMessages);
  std::vector<WorkPtr> works;
  for (int k = 0; k < kMessages; ++k) {
    got[k] = Tensor::zeros({4});
    works.push_back(comm.recv_async(got[k], prev, 7));
  }
  for (int k = 0; k < kMessages; ++k) {
    Tensor t = Tensor::empty({4});
    for (int i = 0; i < 4; ++i) t.data<float>()[i] = static_cast<float>(k);
    works.push_back(comm.send_async(t, next, 7));
  }
  for (WorkPtr& w : works) w->wait();
  int out_of_order = 0;
  for (int k = 0; k < kMessages; ++k) out_of_order += got[k].data<float>()[0] != static_cast<float>(k);
  EXPECT_EQ(out_of_order, 0);
}

TEST_F(SharedMemory, MessageOfAnotherSizeIsAnError) {
  // MPI would take 400 bytes into an 800-byte receive silently; the mailbox compares the sizes,
  // which also proves the message went through it.
  MpiCommunicator comm(MPI_COMM_WORLD, "message sizes");
  comm.reserve_messages(4000, 2);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  comm.send(Tensor::zeros({100}), next, 5);
  Tensor into = Tensor::empty({200});
  expect_error([&] { comm.recv(into, prev, 5); }, "has 400 bytes, the receive expects 800");
  comm.barrier();  // every rank has checked before the communicators go
}

TEST_F(SharedMemory, MessagesTooLargeForTheMailboxesGoThroughMpi) {
  // 40 MiB messages do not fit the 64 MiB of mailboxes per rank: every rank falls back alike
  // (rank 0 says so once), and MPI then takes a smaller message into a larger receive, which
  // the mailboxes would refuse.
  MpiCommunicator comm(MPI_COMM_WORLD, "no mailboxes");
  comm.reserve_messages(int64_t{40} << 20, 2);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  WorkPtr sent = comm.send_async(allocate_filled(100), next, 3);
  Tensor into = Tensor::empty({200});
  comm.recv(into, prev, 3);
  sent->wait();
  EXPECT_EQ(into.data<float>()[99], value(prev, 99));
}

TEST_F(Collectives, SubCommunicatorFromSplit) {
  // Even and odd world ranks: each half reduces among itself only.
  MPI_Comm half;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank_ % 2, rank_, &half), MPI_SUCCESS);
  {
    MpiCommunicator sub(half, "half");
    EXPECT_EQ(sub.size(), (size_ + 1 - rank_ % 2) / 2);
    Tensor t = Tensor::empty({1}, DType::I32);
    t.data<int32_t>()[0] = rank_;
    sub.all_reduce(t, ReduceOp::Sum);
    int want = 0;
    for (int r = rank_ % 2; r < size_; r += 2) want += r;
    EXPECT_EQ(t.data<int32_t>()[0], want);
  }
  MPI_Comm_free(&half);
}

TEST_F(Collectives, BytesSentFollowTheDocumentedConvention) {
  // 4 * size_ floats (divisible by every size): each operation adds its documented share.
  const int64_t n = 4 * size_, bytes = 4 * n;
  const Tensor t = Tensor::zeros({n}), out = Tensor::zeros({n * size_}), chunk = Tensor::zeros({n / size_});
  const auto sent = [&](const auto& op) {
    const int64_t before = comm_.bytes_sent();
    op();
    return comm_.bytes_sent() - before;
  };
  EXPECT_EQ(sent([&] { comm_.all_reduce(t, ReduceOp::Sum); }), 2 * (size_ - 1) * bytes / size_);
  EXPECT_EQ(sent([&] { comm_.reduce(t, 0, ReduceOp::Sum); }), rank_ == 0 ? 0 : bytes);
  EXPECT_EQ(sent([&] { comm_.broadcast(t, 1); }), rank_ == 1 ? bytes : 0);
  EXPECT_EQ(sent([&] { comm_.all_gather(t, out); }), (size_ - 1) * bytes);
  EXPECT_EQ(sent([&] { comm_.reduce_scatter(t, chunk, ReduceOp::Sum); }), (size_ - 1) * bytes / size_);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  EXPECT_EQ(sent([&] {
              WorkPtr r = comm_.recv_async(chunk, prev, 9);
              comm_.send(t.view(0, {n / size_}), next, 9);
              r->wait();
            }),
            bytes / size_);
}

}  // namespace
}  // namespace strata::parallel
