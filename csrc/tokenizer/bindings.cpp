// pybind11 entry point of fastbert._C: version and build information.
#include <pybind11/pybind11.h>

#include <string>

namespace py = pybind11;

static py::dict build_info() {
  py::dict info;
  info["version"] = FASTBERT_VERSION;
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  info["cplusplus"] = static_cast<long>(__cplusplus);
  info["cuda"] = false;
  return info;
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastbert native extension: version and build information (tokenizer core lands here)";
  m.attr("__version__") = FASTBERT_VERSION;
  m.def("build_info", &build_info, "Return a dict describing how this extension was built.");
}
