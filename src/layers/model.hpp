// A model is a list of top-level layers with their shapes inferred from the dataset's sample
// shape; a pipeline stage is a contiguous range of it. The zoo that builds models is zoo.hpp;
// the flat buffers their parameters live in, parameter_store.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "layers/layer.hpp"

namespace strata::layers {

class Model {
 public:
  // The output's last dimension must be num_classes: (K) for a classifier, (T, V) for a
  // language model (classes = vocabulary). The input may be i32 tokens ({T} per sample).
  // A tensor-parallel model (tp of T > 1 ranks, which its layers use) outputs this rank's
  // slice of the vocabulary, (T, V / T); num_classes stays the full V.
  Model(std::vector<LayerPtr> layers, Shape input_shape, int num_classes, TensorParallelGroup* tp = nullptr);

  size_t size() const { return layers_.size(); }
  Layer& layer(size_t i) const { return *layers_[i]; }
  const Shape& input_shape() const { return shapes_.front(); }
  // Per-sample input shape of layer i; shape(size()) is the output shape.
  const Shape& shape(size_t i) const { return shapes_[i]; }
  int num_classes() const { return num_classes_; }
  // The group the model's layers are split over, or null (also for a group of one rank).
  TensorParallelGroup* tensor_parallel() const { return tp_; }
  std::string summary() const;

  // Forward through layers [begin, end) with one context per layer (resized as needed).
  Tensor forward(const Tensor& x, std::vector<Context>& ctx, const StepInfo& info, size_t begin = 0,
                 size_t end = SIZE_MAX) const;
  // Backward through layers [begin, end) in reverse. Returns the gradient of the input if
  // input_grad (a pipeline stage that sends it on); otherwise stops after the lowest layer
  // with parameters and returns an undefined tensor. after_layer(i), if given, runs as soon
  // as layer i has written its gradients (gradient sync starts buckets from it).
  Tensor backward(const Tensor& dy, std::vector<Context>& ctx, size_t begin = 0, size_t end = SIZE_MAX,
                  const std::function<void(size_t)>& after_layer = {}, bool input_grad = false) const;

 private:
  std::vector<LayerPtr> layers_;
  std::vector<Shape> shapes_;
  std::vector<bool> trainable_;  // layer i has trainable parameters
  int num_classes_;
  TensorParallelGroup* tp_;
};

}  // namespace strata::layers
