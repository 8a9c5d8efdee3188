// Python names of the cpu backend's C++ kernels (cpu_kernels.h). Every one runs without the
// GIL, as torch's own ops do: the node's event loop keeps serving meanwhile.
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, "paged decode attention over block tables", py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale") = 1.0, release());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row", release());
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then the RMSNorm of it", release());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] rows", release());
  m.def("rotary", &rotary, "rotate-half rotary embedding of query and key, in place", release());
  m.def("write_kv", &write_kv, "key and value rows into the paged caches at their slots", release());
  m.def("quantize_per_token", &quantize_per_token, "int8 codes and float32 scale of each row (dynamic, symmetric)",
        release());
  m.def("dequant_rows", &dequant_rows, "((acc + int_bias) * col_scale * row_scale + bias) as out_dtype", py::arg("acc"),
        py::arg("col_scale"), py::arg("row_scale") = py::none(), py::arg("int_bias") = py::none(),
        py::arg("bias") = py::none(), py::arg("out_dtype") = at::kFloat, release());
  m.def("quantize_per_tensor", &quantize_per_tensor, "int8 codes clamp(round-half-even(x / scale + offset)) of float32 rows (static, asymmetric)",
        py::arg("x"), py::arg("scale"), py::arg("offset"), release());
  m.def("int8_gemv_supported", &int8_gemv_supported, "whether this CPU has AVX512-VNNI for int8_gemv");
  m.attr("int8_gemv_max_rows") = kInt8GemvMaxRows;
  m.attr("int8_gemv_max_in") = kInt8GemvMaxIn;
  m.def("int8_gemv", &int8_gemv, "int8 x_q [1..4, in <= 4096] @ weight [out, in]^T -> int32, exact (AVX512-VNNI)", py::arg("x_q"),
        py::arg("weight"), release());
  m.def("moe_experts_few_rows", &moe_experts_few_rows,
        "each local expert's gated MLP over its run of rows (sorted by expert, counts per expert), unweighted",
        py::arg("rows"), py::arg("w13"), py::arg("w2"), py::arg("counts"), release());
}
