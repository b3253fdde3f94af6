// y = x W^T (+ b) with oneDNN's matmul called directly (``models/onednn.py`` builds and loads
// this extension against the ``onednn-cpu-gomp`` wheel).
//
// PyTorch's packed path (``mkldnn._linear_pointwise``) reaches the same library through ideep,
// which rebuilds descriptors, hashes a cache key and wraps tensors on every call: about 20 us
// per product on a 2-core EPYC, ~120 products per decode step. Here the weight is reordered
// once into the layout the matmul prefers, and one primitive per (row count, shape, dtype,
// bias) is created on first use and kept in a cache shared by every weight of that shape (the
// 30 layers of a model share 4 shapes), so a call is a map lookup, three memory wrappers and
// the kernel. The cache is least-recently-used with SPECSERVE_ONEDNN_CACHE entries (default
// 1024: a target and its DFlash draft have about 8 weight shapes of ~68 row counts each; a
// primitive holds about 140 KiB and takes 0.1-1 ms to create): prefill chunks bring new row
// counts all the time, and an unbounded cache grows without end.
//
// Row invariance (a row's bits do not depend on how many rows the product has) is a property
// of the kernel oneDNN picks, not of this code: ``impl`` names the kernel (the gemm fallback
// used where brgemm is missing is not invariant), the caller probes the bits and sets the range
// of row counts a call may have (``set_row_range``: with AMX, oneDNN runs one or two rows on
// AVX-512 kernels and some large counts with another blocking, each rounding differently).

#include <torch/extension.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdlib>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace {

using dnnl::memory;
using tag = memory::format_tag;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

memory::data_type dnnl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return memory::data_type::f32;
    case at::kBFloat16: return memory::data_type::bf16;
    default: TORCH_CHECK(false, "onednn_linear: float32 or bfloat16 only, got ", t);
  }
}

struct Entry {
  dnnl::matmul matmul;
  memory::desc src, dst, bias, weights;
  std::string impl;
};

// Primitives keyed by (rows, in, out, dtype, bias), least recently used dropped first.
class PrimitiveCache {
 public:
  PrimitiveCache() {
    const char* env = std::getenv("SPECSERVE_ONEDNN_CACHE");
    capacity_ = env ? std::max(1L, std::atol(env)) : 1024;
  }

  template <typename Make>
  std::shared_ptr<const Entry> get(const std::string& key, Make make) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      order_.splice(order_.begin(), order_, it->second);
      return it->second->second;
    }
    auto entry = std::make_shared<const Entry>(make());
    order_.emplace_front(key, entry);
    index_[key] = order_.begin();
    while (static_cast<int64_t>(order_.size()) > capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return entry;
  }

  int64_t size() {
    std::lock_guard<std::mutex> guard(mutex_);
    return static_cast<int64_t>(order_.size());
  }
  int64_t capacity() const { return capacity_; }

 private:
  using Item = std::pair<std::string, std::shared_ptr<const Entry>>;
  int64_t capacity_;
  std::mutex mutex_;
  std::list<Item> order_;
  std::unordered_map<std::string, std::list<Item>::iterator> index_;
};

PrimitiveCache& primitive_cache() {
  static PrimitiveCache cache;
  return cache;
}

// The row count the weight layout is chosen for: brgemm picks one blocked layout for every row
// count from 1 on, so any count works; 16 is a typical step.
constexpr int64_t kLayoutRows = 16;
// With a row range set, calls of more than kExactRows rows are padded to a multiple of kRowStep.
constexpr int64_t kExactRows = 64;
constexpr int64_t kRowStep = 16;

class PackedLinear {
 public:
  explicit PackedLinear(const torch::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(),
                "onednn_linear: a 2-D CPU weight [out, in] is required");
    dtype_ = weight.scalar_type();
    out_ = weight.size(0);
    in_ = weight.size(1);
    auto w = weight.contiguous();
    const auto dt = dnnl_type(dtype_);
    // [out, in] row-major read as the matmul's [in, out] operand: strides {1, in}
    memory::desc plain({in_, out_}, dt, memory::dims{1, in_});
    memory::desc any({in_, out_}, dt, tag::any);
    auto pd = dnnl::matmul::primitive_desc(cpu_engine(),
                                           memory::desc({kLayoutRows, in_}, dt, tag::ab), any,
                                           memory::desc({kLayoutRows, out_}, dt, tag::ab));
    packed_desc_ = pd.weights_desc();
    key_ = "/" + std::to_string(in_) + "/" + std::to_string(out_) + "/" +
           std::to_string(static_cast<int>(dt));
    packed_ = torch::empty({static_cast<int64_t>(packed_desc_.get_size())},
                           torch::TensorOptions().dtype(torch::kUInt8));
    memory src(plain, cpu_engine(), w.data_ptr());
    memory dst(packed_desc_, cpu_engine(), packed_.data_ptr());
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(src, dst).execute(stream, src, dst);
    stream.wait();
  }

  torch::Tensor forward(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias) {
    TORCH_CHECK(x.scalar_type() == dtype_, "onednn_linear: input is ", x.scalar_type(),
                ", the weight ", dtype_);
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == in_, "onednn_linear: input's last dim is ",
                x.size(-1), ", the weight takes ", in_);
    auto x2 = x.reshape({-1, in_}).contiguous();
    const int64_t rows = x2.size(0);
    auto sizes = x.sizes().vec();
    sizes.back() = out_;
    auto y = torch::empty(sizes, x.options());
    if (rows == 0) return y;
    torch::Tensor b;
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->numel() == out_, "onednn_linear: bias has ", bias->numel(),
                  " elements, the weight ", out_, " outputs");
      b = bias->to(dtype_).contiguous();
    }
    auto y2 = y.view({rows, out_});
    if (max_rows_ == 0) {  // no range set: one call of exactly these rows
      run(x2, y2, b);
      return y;
    }
    for (int64_t start = 0; start < rows;) {
      const int64_t n = std::min(rows - start, max_rows_);
      const int64_t m = call_rows(n);
      auto part = x2.narrow(0, start, n);
      if (m == n) {
        auto out = y2.narrow(0, start, n);
        run(part, out, b);
      } else {  // padded with copies of the part's first row
        auto padded = torch::cat({part, part.narrow(0, 0, 1).expand({m - n, in_})});
        auto out = torch::empty({m, out_}, x.options());
        run(padded, out, b);
        y2.narrow(0, start, n).copy_(out.narrow(0, 0, n));
      }
      start += n;
    }
    return y;
  }

  // Calls are held to row counts the caller measured to give a row the same bits
  // (``models/onednn.py``): at least ``min_rows`` (fewer are padded), at most ``max_rows``
  // (more are split), and above kExactRows a multiple of kRowStep (padded up), so that a
  // weight runs at most ~70 row counts, each one probed, each primitive made once.
  void set_row_range(int64_t min_rows, int64_t max_rows) {
    TORCH_CHECK(min_rows >= 1 && max_rows >= 2 * min_rows &&
                    (max_rows <= kExactRows || max_rows % kRowStep == 0),
                "onednn_linear: row range needs 1 <= min_rows, max_rows >= 2 * min_rows and "
                "max_rows <= ", kExactRows, " or a multiple of ", kRowStep, ", got ", min_rows,
                "..", max_rows);
    min_rows_ = min_rows;
    max_rows_ = max_rows;
  }
  // The row count a call of ``n`` rows (n <= max_rows) runs as (the probe in
  // ``models/onednn.py`` asks this of a fresh op to know which counts to compare).
  int64_t call_rows(int64_t n) const {
    int64_t m = std::max(n, min_rows_);
    if (m > kExactRows) m = (m + kRowStep - 1) / kRowStep * kRowStep;
    return m;
  }
  int64_t min_rows() const { return min_rows_; }
  int64_t max_rows() const { return max_rows_; }

  // The kernel oneDNN runs for ``rows`` rows (e.g. "brg:avx512_core_bf16", "gemm:jit:f32").
  std::string impl(int64_t rows) { return entry(rows, false)->impl; }

  int64_t out_features() const { return out_; }
  int64_t in_features() const { return in_; }
  at::ScalarType dtype() const { return dtype_; }
  int64_t nbytes() const { return packed_.numel(); }

 private:
  // One primitive call: contiguous rows ``src`` [n, in] into ``dst`` [n, out].
  void run(const torch::Tensor& src, torch::Tensor& dst, const torch::Tensor& b) {
    const auto held = entry(src.size(0), b.defined());  // kept alive through the call
    const Entry& e = *held;
    auto& engine = cpu_engine();
    std::unordered_map<int, memory> args{
        {DNNL_ARG_SRC, memory(e.src, engine, src.data_ptr())},
        {DNNL_ARG_WEIGHTS, memory(packed_desc_, engine, packed_.data_ptr())},
        {DNNL_ARG_DST, memory(e.dst, engine, dst.data_ptr())}};
    if (b.defined()) args.emplace(DNNL_ARG_BIAS, memory(e.bias, engine, b.data_ptr()));
    thread_local dnnl::stream stream(engine);  // one per thread, not one per call
    e.matmul.execute(stream, args);
    stream.wait();
  }

  std::shared_ptr<const Entry> entry(int64_t rows, bool with_bias) {
    const auto dt = dnnl_type(dtype_);
    const std::string key = std::to_string(rows) + key_ + (with_bias ? "/b" : "/-");
    auto make = [&]() {
      memory::desc src({rows, in_}, dt, tag::ab), dst({rows, out_}, dt, tag::ab);
      memory::desc bias = with_bias ? memory::desc({1, out_}, dt, tag::ab) : memory::desc();
      auto pd = with_bias
                    ? dnnl::matmul::primitive_desc(cpu_engine(), src, packed_desc_, bias, dst)
                    : dnnl::matmul::primitive_desc(cpu_engine(), src, packed_desc_, dst);
      return Entry{dnnl::matmul(pd), src, dst, bias, packed_desc_, pd.impl_info_str()};
    };
    auto e = primitive_cache().get(key, make);
    // every weight of one shape and dtype is packed into the same layout; should one differ,
    // it gets a primitive of its own rather than a wrong one
    return e->weights == packed_desc_ ? e : std::make_shared<const Entry>(make());
  }

  at::ScalarType dtype_;
  int64_t out_, in_;
  int64_t min_rows_ = 1, max_rows_ = 0;
  memory::desc packed_desc_;
  std::string key_;  // "/in/out/dtype": this weight's part of its primitives' cache keys
  torch::Tensor packed_;  // the reordered weight's bytes
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<PackedLinear>(m, "PackedLinear")
      .def(pybind11::init<const torch::Tensor&>(), pybind11::arg("weight"))
      .def("forward", &PackedLinear::forward, pybind11::arg("x"),
           pybind11::arg("bias") = pybind11::none())
      .def("impl", &PackedLinear::impl, pybind11::arg("rows"))
      .def("set_row_range", &PackedLinear::set_row_range, pybind11::arg("min_rows"),
           pybind11::arg("max_rows"))
      .def("call_rows", &PackedLinear::call_rows, pybind11::arg("rows"))
      .def_property_readonly("min_rows", &PackedLinear::min_rows)
      .def_property_readonly("max_rows", &PackedLinear::max_rows)
      .def_property_readonly("out_features", &PackedLinear::out_features)
      .def_property_readonly("in_features", &PackedLinear::in_features)
      .def_property_readonly("nbytes", &PackedLinear::nbytes)
      .def_property_readonly("is_bfloat16", [](const PackedLinear& p) {
        return p.dtype() == at::kBFloat16;
      });
  m.def("cache_size", []() { return primitive_cache().size(); }, "primitives cached now");
  m.def("cache_capacity", []() { return primitive_cache().capacity(); });
  m.def("version", []() {
    const auto* v = dnnl_version();
    return std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
           std::to_string(v->patch);
  });
}
