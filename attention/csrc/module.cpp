// The CPU kernels as one torch extension (``attention/cpu_kernel.py`` builds and loads it).

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                              torch::Tensor q_indptr, torch::Tensor kv_lens, bool causal,
                              double scale, double k_scale, double v_scale, int64_t tile,
                              std::optional<torch::Tensor> tree_masks);
bool paged_attention_self_check();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::tuple<torch::Tensor, torch::Tensor> rope_qk(torch::Tensor qkv, torch::Tensor cos,
                                                 torch::Tensor sin, int64_t nq, int64_t nk,
                                                 std::optional<torch::Tensor> q_weight,
                                                 std::optional<torch::Tensor> k_weight,
                                                 double eps);
void store_kv(torch::Tensor cache, torch::Tensor k, torch::Tensor v, torch::Tensor blocks,
              torch::Tensor offsets);
torch::Tensor argmax_rows(torch::Tensor x);
bool bf16_linear_available();
torch::Tensor bf16_linear_pack(torch::Tensor weight);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                          std::optional<torch::Tensor> bias);
bool bf16_dp_linear_available();
torch::Tensor bf16_dp_linear_pack(torch::Tensor weight);
torch::Tensor bf16_dp_linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                             std::optional<torch::Tensor> bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  TORCH_CHECK(paged_attention_self_check(), "paged attention: kSlot does not match reduce16");
  m.def("paged_attention", &paged_attention, "Batch-invariant paged attention (CPU)",
        py::arg("q"), py::arg("cache"), py::arg("block_tables"), py::arg("q_indptr"),
        py::arg("kv_lens"), py::arg("causal"), py::arg("scale"), py::arg("k_scale"),
        py::arg("v_scale"), py::arg("tile"), py::arg("tree_masks") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm(residual + x), residual + x) (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of [gate | up] (CPU)");
  m.def("rope_qk", &rope_qk,
        "Rotary embedding of the query and key heads of a QKV row, optionally RMS-normed (CPU)",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("nq"), py::arg("nk"),
        py::arg("q_weight") = py::none(), py::arg("k_weight") = py::none(),
        py::arg("eps") = 0.0);
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1), vectorized (CPU)");
  m.def("bf16_linear_available", &bf16_linear_available,
        "Whether bf16_linear was built (AVX2 and FMA)");
  m.def("bf16_linear_pack", &bf16_linear_pack, "A bf16 weight [N, K] as [N/16, K, 16] panels");
  m.def("bf16_linear", &bf16_linear, "x W^T (+ b), bf16, row-count invariant (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("bf16_dp_linear_available", &bf16_dp_linear_available,
        "Whether bf16_dp_linear was built (AVX512_BF16)");
  m.def("bf16_dp_linear_pack", &bf16_dp_linear_pack,
        "A bf16 weight [N, K] as panels of input pairs [N/16, K/2, 16] (int32 lanes)");
  m.def("bf16_dp_linear", &bf16_dp_linear,
        "x W^T (+ b), bf16 pair products, row-count invariant (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none());
  m.def("store_kv", &store_kv, "Write K/V rows to their cache slots (CPU, same dtype)");
}
