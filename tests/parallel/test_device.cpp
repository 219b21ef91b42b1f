// Device selection without MPI or a GPU: the GPU count, node size and build are injected, so
// every error a user can meet (`--device cuda` without CUDA or without a GPU, more ranks than
// GPUs with NCCL, NCCL on the CPU) is checked on any machine, with its message.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "parallel/runtime/device.hpp"

namespace strata::parallel {
namespace {

NodeGpus node(int local_rank, int local_size, int gpus, bool cuda_build = true, int distinct = 0) {
  NodeGpus n;
  n.node = "n1";
  n.local_rank = local_rank;
  n.local_size = local_size;
  n.visible_gpus = gpus;
  n.distinct_gpus = distinct;
  n.cuda_build = cuda_build;
  return n;
}

// The message of the input error `select` throws ("" and a failure if it does not).
template <class F>
std::string input_error(F select) {
  try {
    select();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Input);
    return e.message();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(SelectDevice, CpuNeedsNothing) {
  EXPECT_TRUE(select_device(DeviceKind::CPU, Transport::Mpi, node(3, 4, 0, false)).is_cpu());
}

TEST(SelectDevice, NcclOnTheCpuIsRefused) {
  EXPECT_EQ(input_error([] { select_device(DeviceKind::CPU, Transport::Nccl, node(0, 1, 8)); }),
            "--comm nccl needs --device cuda (NCCL moves GPU memory); use --comm mpi or auto with --device cpu");
}

TEST(SelectDevice, CudaInABuildWithoutCuda) {
  EXPECT_EQ(input_error([] { select_device(DeviceKind::CUDA, Transport::Mpi, node(0, 1, 0, false)); }),
            "--device cuda: this build of Strata has no CUDA (configure with -DSTRATA_CUDA=ON where nvcc is "
            "installed), or use --device cpu");
}

TEST(SelectDevice, CudaWithoutGpu) {
  EXPECT_EQ(input_error([] { select_device(DeviceKind::CUDA, Transport::Nccl, node(0, 1, 0)); }),
            "--device cuda: no CUDA device on node n1 (no GPU or driver, or CUDA_VISIBLE_DEVICES hides them); use "
            "--device cpu");
}

TEST(SelectDevice, OneGpuPerRankWithNccl) {
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(select_device(DeviceKind::CUDA, Transport::Nccl, node(r, 4, 4)), Device::cuda(r));
  EXPECT_EQ(select_device(DeviceKind::CUDA, Transport::Nccl, node(1, 2, 8)), Device::cuda(1));
}

TEST(SelectDevice, MoreRanksThanGpusIsAnErrorWithNccl) {
  EXPECT_EQ(input_error([] { select_device(DeviceKind::CUDA, Transport::Nccl, node(0, 4, 2)); }),
            "4 ranks on node n1 but only 2 GPUs: NCCL needs one GPU per rank; start at most 2 ranks per node, or use "
            "--comm mpi to share a GPU");
  EXPECT_EQ(input_error([] { select_device(DeviceKind::CUDA, Transport::Nccl, node(1, 2, 1, true, 1)); }),
            "2 ranks on node n1 but only 1 GPU: NCCL needs one GPU per rank; start at most 1 rank per node, or use "
            "--comm mpi to share a GPU");
}

TEST(SelectDevice, MpiSharesGpusRoundRobin) {
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(select_device(DeviceKind::CUDA, Transport::Mpi, node(r, 4, 2)), Device::cuda(r % 2));
  EXPECT_EQ(select_device(DeviceKind::CUDA, Transport::Mpi, node(1, 2, 1)), Device::cuda(0));
}

TEST(SelectDevice, OneVisibleGpuPerRankCountsAsDistinct) {
  // Slurm's --gpus-per-task: each rank sees one GPU as device 0, and they are different GPUs.
  EXPECT_EQ(select_device(DeviceKind::CUDA, Transport::Nccl, node(2, 4, 1, true, 4)), Device::cuda(0));
}

TEST(SelectDevice, ParseFlags) {
  EXPECT_EQ(parse_device_kind("cpu"), DeviceKind::CPU);
  EXPECT_EQ(parse_device_kind("cuda"), DeviceKind::CUDA);
  EXPECT_EQ(input_error([] { parse_device_kind("gpu"); }), "--device must be cpu or cuda, found 'gpu'");
  EXPECT_EQ(parse_transport("auto", DeviceKind::CUDA), Transport::Nccl);
  EXPECT_EQ(parse_transport("auto", DeviceKind::CPU), Transport::Mpi);
  EXPECT_EQ(parse_transport("mpi", DeviceKind::CUDA), Transport::Mpi);
  EXPECT_EQ(parse_transport("nccl", DeviceKind::CPU), Transport::Nccl);  // refused by select_device
  EXPECT_EQ(input_error([] { parse_transport("gloo", DeviceKind::CPU); }),
            "--comm must be auto, nccl or mpi, found 'gloo'");
  EXPECT_STREQ(transport_name(Transport::Nccl), "nccl");
}

}  // namespace
}  // namespace strata::parallel
