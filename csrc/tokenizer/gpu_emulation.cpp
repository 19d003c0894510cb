// fastbert._wordpiece.gpu_emulation: the CUDA tokenizer's kernels (csrc/cuda/wordpiece_kernels.h) run as
// plain loops over NumPy arrays. fastbert.tokenization._cuda drives these exactly as it drives the
// GPU module, so CI checks the GPU pipeline's logic (and its equality with the CPU tokenizer)
// without a GPU.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "../cuda/wordpiece_kernels.h"

namespace py = pybind11;

namespace {

// Named arrays and scalars with the checks wordpiece_cuda.cu makes on tensors.
struct NumpyArgs {
  py::dict arrays;
  py::dict scalars;

  template <typename T>
  T* ptr(const char* name) {
    if (!arrays.contains(name)) throw py::key_error(std::string("missing array '") + name + "'");
    py::array a = arrays[name].cast<py::array>();
    const char kind = a.dtype().kind();
    if ((kind != 'i' && kind != 'u') || a.itemsize() != static_cast<py::ssize_t>(sizeof(T)))
      throw py::type_error(std::string("array '") + name + "' must hold " + std::to_string(sizeof(T)) +
                           "-byte integers, got dtype " + std::string(py::str(a.dtype())));
    if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string("array '") + name + "' must be contiguous");
    return static_cast<T*>(a.mutable_data());
  }
  int64_t scalar(const char* name) {
    if (!scalars.contains(name)) throw py::key_error(std::string("missing scalar '") + name + "'");
    return scalars[name].cast<int64_t>();
  }
};

// Items run last to first: a GPU runs them in any order, and an item that writes outside its own
// outputs is usually overwritten (hidden) by a later item in forward order, not in reverse.
template <class Kernel>
void run(py::dict arrays, py::dict scalars) {
  NumpyArgs args{arrays, scalars};
  const Kernel k = Kernel::make(args);
  py::gil_scoped_release release;
  for (int64_t i = k.n - 1; i >= 0; --i) k(i);
}

}  // namespace

void register_gpu_emulation(py::module_& m) {
  auto e = m.def_submodule("gpu_emulation",
                           "The CUDA tokenizer's kernels as sequential CPU loops over NumPy arrays (testing).");
  e.def("count_chars", &run<fastbert::gpu::CountChars>, py::arg("arrays"), py::arg("scalars"));
  e.def("write_chars", &run<fastbert::gpu::WriteChars>, py::arg("arrays"), py::arg("scalars"));
  e.def("word_starts", &run<fastbert::gpu::WordStarts>, py::arg("arrays"), py::arg("scalars"));
  e.def("word_tokens", &run<fastbert::gpu::WordTokens>, py::arg("arrays"), py::arg("scalars"));
  e.def("assemble", &run<fastbert::gpu::Assemble>, py::arg("arrays"), py::arg("scalars"));
}
