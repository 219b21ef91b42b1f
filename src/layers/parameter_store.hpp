// ParameterStore lays out the parameters of a range of a model's layers in one flat buffer, their
// gradients in another and their non-trained buffers in a third, and binds the layers to views.
// ParamEntry names each tensor and its place; Overlap and no_decay_ranges cut ranges of the flat
// layout (shards, optimizer parameter groups).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "layers/layer.hpp"
#include "layers/optimizer.hpp"

namespace strata::layers {

class Model;

struct ParamEntry {
  std::string name;  // stable path "conv1/weight", "block2_1/conv1/weight", "block2_1/shortcut/bn/bias"
  Shape shape;
  int64_t offset = 0;  // elements, in params() or buffers() depending on trainable
  bool trainable = true;
  size_t layer = 0;              // index of the top-level layer that owns it
  bool no_weight_decay = false;  // ParamSpec::no_weight_decay: stepped without weight decay
  TensorSplit split{};           // ParamSpec::split: `shape` is this tp rank's shard
  // The shape of the tensor checkpoints hold (shape itself unless split).
  Shape full_shape() const { return layers::full_shape(shape, split); }
};

// Where entry e's values meet the flat-layout range [begin, end) (a shard, a sharded store):
// `size` elements from element `in_entry` of the entry and element `in_range` of the range;
// size 0 when they do not meet. For copies between full tensors and shards.
struct Overlap {
  int64_t in_entry = 0, in_range = 0, size = 0;
};
Overlap overlap(const ParamEntry& e, int64_t begin, int64_t end);

// The elements of the flat-layout range [begin, end) that take no weight decay (entries marked
// no_weight_decay, each with its alignment padding; neighbours merged), relative to `begin`:
// what Optimizer::set_no_decay takes for an optimizer over that range. Empty when no entry is
// marked (every model but gpt).
std::vector<Optimizer::Range> no_decay_ranges(const std::vector<ParamEntry>& entries, int64_t begin, int64_t end);

// What a ParameterStore lays out and allocates; the defaults are the whole model, unsharded, in
// f32 on the CPU.
struct StoreLayout {
  // The layers [begin, end) of the model whose parameters the store holds.
  size_t begin = 0, end = SIZE_MAX;
  // params() and grads() are padded with zeros to a multiple of pad_multiple elements (a
  // multiple of 16; ZeRO pads to dp equal shards); the padding is never bound to a layer.
  int64_t pad_multiple = kParamAlignment;
  // false (ZeRO stage 2, which keeps only a gradient shard): grads() stays undefined and layers
  // are bound to undefined gradients until bind_grads() points them somewhere.
  bool allocate_grads = true;
  // false (ZeRO stage 3): params() holds only the `shard_size` elements of the flat layout from
  // `shard_begin` on (initialised exactly as the full buffer would be there) and layers are
  // bound to undefined parameters until bind_params() points them at a gathered window.
  bool allocate_params = true;
  int64_t shard_begin = 0, shard_size = 0;
  // Parameters are stored in `dtype` (the compute dtype: f32, bf16 or f16; initial values are
  // drawn in f32 and rounded); gradients and buffers are always f32 (mixed precision keeps f32
  // gradients and master weights: ShardedOptimizer). Everything lives on `device`.
  DType dtype = DType::F32;
  Device device = Device::cpu();
  // If given, makes the zeroed full parameter and gradient buffers (the trainer asks the
  // data-parallel communicator, which may hand out shared memory).
  std::function<Tensor(int64_t numel, DType dtype)> allocate = {};
};

class ParameterStore {
 public:
  // Lays out and binds the parameters of the model's layers that store_layout names. Offsets are
  // aligned to 16 elements (64 bytes). Values are initialised from (seed, name), so they do not
  // depend on how the model is cut into stages.
  explicit ParameterStore(const Model& model, uint64_t seed, const StoreLayout& store_layout = {});
  // The entries such a store would have, without allocating (e.g. to name another stage's).
  static std::vector<ParamEntry> layout(const Model& model, size_t begin = 0, size_t end = SIZE_MAX);
  // Elements of the flat trainable layout of those entries (aligned, without pad_multiple).
  static int64_t layout_numel(const std::vector<ParamEntry>& entries);
  // Elements of the flat buffer of non-trained entries (aligned): what buffers() holds.
  static int64_t buffers_numel(const std::vector<ParamEntry>& entries);

  const Tensor& params() const { return params_; }    // flat, trainable (ZeRO 3: the shard)
  const Tensor& grads() const { return grads_; }      // flat, same layout as params()
  const Tensor& buffers() const { return buffers_; }  // flat, non-trainable state
  const std::vector<ParamEntry>& entries() const { return entries_; }
  // The view of an entry's values (in params() or buffers()); not for sharded parameters.
  Tensor value(const ParamEntry& e) const;
  // Copies the tensor `full` of e.shape (any float dtype, any device) into entry e,
  // converting to the store's dtype and device: all of it, or with sharded parameters (ZeRO 3)
  // the part this rank's shard holds. With a tensor-parallel split, e.shape is this tp rank's
  // shard (take_shard a checkpoint's full tensor first: e.full_shape()).
  void set_value(const ParamEntry& e, const Tensor& full) const;
  Tensor grad(const ParamEntry& e) const;
  int64_t num_trainable() const;  // without alignment padding
  // The trainable elements of each layer that has some, in layout (forward) order: the unit of
  // gradient buckets and of ZeRO-3 parameter gathers.
  struct LayerRange {
    size_t layer;
    int64_t begin, end;  // elements of the flat layout
  };
  std::vector<LayerRange> layer_ranges() const { return layer_ranges(entries_); }
  static std::vector<LayerRange> layer_ranges(const std::vector<ParamEntry>& entries);
  // Elements of params() the layout uses (aligned entries); the rest is pad_multiple padding.
  int64_t used_numel() const { return used_numel_; }
  // The padded length of the flat layout (params().numel() unless the parameters are sharded).
  int64_t flat_numel() const { return flat_numel_; }
  bool sharded_params() const { return sharded_params_; }
  // (Re)binds layer `layer` of `model` (one this store holds) to gradient views into `grads`,
  // whose element 0 stands for element `grads_begin` of the flat layout; its parameters stay
  // bound where they are.
  void bind_grads(const Model& model, size_t layer, const Tensor& grads, int64_t grads_begin) const;
  // Likewise for its trainable parameters: views into `params`, element 0 = `params_begin`.
  void bind_params(const Model& model, size_t layer, const Tensor& params, int64_t params_begin) const;

 private:
  // Where a layer's trainable parameters and gradients are bound now (each element 0 stands
  // for `*_begin` of the flat layout): the two are rebound independently (ZeRO 2 and 3).
  struct Binding {
    Tensor params, grads;
    int64_t params_begin = 0, grads_begin = 0;
  };
  void bind(const Model& model, size_t layer) const;

  Tensor params_, grads_, buffers_;
  std::vector<ParamEntry> entries_;
  int64_t used_numel_ = 0, flat_numel_ = 0;
  int64_t params_begin_ = 0;  // the flat element params() starts at
  bool sharded_params_ = false;
  size_t first_layer_ = 0;
  mutable std::vector<Binding> bindings_;  // per layer from first_layer_
};

}  // namespace strata::layers
