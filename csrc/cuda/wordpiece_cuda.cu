// fastbert._wordpiece_cuda: the batched tokenizer's kernels (wordpiece_kernels.h) on the GPU. Each entry
// point takes named torch CUDA tensors and integer scalars (including the torch stream to launch
// on), checks them (device, integer width, contiguity) and launches one grid-stride kernel. The
// module needs only pybind11 and the CUDA runtime: tensors are read through their Python API
// (data_ptr, device, element_size), so it builds fast and does not depend on torch's C++ ABI.
// The pipeline around the kernels (scans, allocation, row layout) is fastbert/tokenization/_cuda.py.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>

#include "wordpiece_kernels.h"

namespace py = pybind11;

namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct TensorArgs {
  py::dict tensors;
  py::dict scalars;
  int device = -1;

  template <typename T>
  T* ptr(const char* name) {
    if (!tensors.contains(name)) throw py::key_error(std::string("missing tensor '") + name + "'");
    py::object t = tensors[name];
    const std::string where = std::string("tensor '") + name + "'";
    if (!t.attr("is_cuda").cast<bool>()) throw py::value_error(where + " must be on a CUDA device");
    const int dev = t.attr("get_device")().cast<int>();
    if (device >= 0 && dev != device)
      throw py::value_error(where + " is on cuda:" + std::to_string(dev) + ", the others on cuda:" +
                            std::to_string(device));
    device = dev;
    if (t.attr("is_floating_point")().cast<bool>() || t.attr("is_complex")().cast<bool>() ||
        t.attr("element_size")().cast<int64_t>() != static_cast<int64_t>(sizeof(T)))
      throw py::type_error(where + " must hold " + std::to_string(sizeof(T)) + "-byte integers, got " +
                           py::str(t.attr("dtype")).cast<std::string>());
    if (!t.attr("is_contiguous")().cast<bool>()) throw py::value_error(where + " must be contiguous");
    return reinterpret_cast<T*>(t.attr("data_ptr")().cast<uintptr_t>());
  }
  int64_t scalar(const char* name) {
    if (!scalars.contains(name)) throw py::key_error(std::string("missing scalar '") + name + "'");
    return scalars[name].cast<int64_t>();
  }
};

template <class Kernel>
__global__ void grid_stride(const Kernel k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < k.n; i += stride) k(i);
}

template <class Kernel>
void launch(py::dict tensors, py::dict scalars) {
  TensorArgs args{tensors, scalars};
  const Kernel k = Kernel::make(args);
  const auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(args.scalar("stream")));
  if (k.n == 0) return;
  int previous;
  check_cuda(cudaGetDevice(&previous), "cudaGetDevice");
  if (args.device >= 0 && args.device != previous) check_cuda(cudaSetDevice(args.device), "cudaSetDevice");
  constexpr int threads = 256;
  const int64_t blocks = std::min<int64_t>((k.n + threads - 1) / threads, int64_t(1) << 20);
  grid_stride<Kernel><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(k);
  const cudaError_t status = cudaGetLastError();
  if (args.device >= 0 && args.device != previous) cudaSetDevice(previous);
  check_cuda(status, "tokenizer kernel launch");
}

}  // namespace

PYBIND11_MODULE(_wordpiece_cuda, m) {
  m.doc() = "fastbert CUDA tokenizer kernels (driven by fastbert.tokenization._cuda; see wordpiece_kernels.h).";
  m.def("count_chars", &launch<fastbert::gpu::CountChars>, "Normalized bytes per original character.",
        py::arg("tensors"), py::arg("scalars"));
  m.def("write_chars", &launch<fastbert::gpu::WriteChars>, "Normalized bytes, original indices and flags.",
        py::arg("tensors"), py::arg("scalars"));
  m.def("word_starts", &launch<fastbert::gpu::WordStarts>, "Word-start flag per normalized byte.",
        py::arg("tensors"), py::arg("scalars"));
  m.def("word_tokens", &launch<fastbert::gpu::WordTokens>, "WordPiece per word (mode 0: count, 1: write).",
        py::arg("tensors"), py::arg("scalars"));
  m.def("assemble", &launch<fastbert::gpu::Assemble>, "Rows with special tokens, truncation and padding.",
        py::arg("tensors"), py::arg("scalars"));
}
