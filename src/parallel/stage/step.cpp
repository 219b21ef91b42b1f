#include "parallel/stage/step.hpp"

namespace strata::parallel {

StageCallbacks step_callbacks(const PipelineExecutor& executor, ChunkRunner& chunks,
                              const layers::SoftmaxCrossEntropy& loss, const MicroBatches& data,
                              const layers::StepInfo& step, float loss_scale, double& loss_sum) {
  StageCallbacks work;
  work.input = data.input;
  work.forward = [&chunks, &data, step](int micro, int chunk, const Tensor& x, std::vector<layers::Context>& ctx) {
    layers::StepInfo info = step;
    info.first_sample += micro * data.size;
    return chunks.forward(chunk, x, ctx, info);
  };
  work.loss = [&loss, &data, loss_scale, &loss_sum](int micro, const Tensor& y) {
    layers::Context ctx;
    loss_sum += loss.forward(y, data.labels(micro), ctx);
    return loss.backward(ctx, loss_scale);
  };
  work.backward = [&chunks, &executor](int, int chunk, const Tensor& dy, std::vector<layers::Context>& ctx,
                                       bool last_of_step) {
    return chunks.backward(chunk, dy, ctx, last_of_step, !executor.first_virtual_stage(chunk));
  };
  return work;
}

}  // namespace strata::parallel
