// fastbert._launch: the per-launch host work of fastbert/ops/launch.py's Triton shortcut, in C.
//
// prepare(plan, args, kwargs) -> (key, ordered) or None
//
// binds a kernel call's arguments to the kernel's parameters (positional, then keywords, then defaults) and returns
//   key      a tuple that tells apart every pair of calls Triton would compile differently: per parameter, a
//            constexpr's value; None; a bool; a float (one marker: Triton passes every float as fp32); an int's
//            class (the value 1, divisibility by 16, 32-bit / 64-bit / unsigned 64-bit range, as the parameter's
//            do_not_specialize / do_not_specialize_on_alignment flags let Triton see them); a tensor's dtype and
//            whether its address is a multiple of 16. Last, the keywords that are not parameters (num_warps...),
//            as (name, value) pairs.
//   ordered  every parameter's value in the kernel's order, a tensor replaced by its address (an int): Triton's
//            launcher takes an int as the pointer itself, without calling data_ptr() and asking the driver
//            (cuPointerGetAttribute) for each tensor at every launch.
// None where the call is not one this handles (an argument of another type, a tensor subclass, a missing or repeated
// argument, an int beyond 64 bits); the caller then takes Triton's own path.
//
// plan = (names, flags, defaults, index, tensor_types, no_default): parameter names (tuple of str), flags (tuple of
// int: 1 constexpr, 2 do_not_specialize, 4 do_not_specialize_on_alignment), defaults (tuple; no_default where a
// parameter has none), index (dict name -> position), tensor_types (tuple of the exact types handled as tensors).
// Python's binding rules that matter here: a keyword naming a parameter already given positionally is an error (None).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

namespace {

constexpr long kConstexpr = 1, kNoSpecialize = 2, kNoAlign = 4;
constexpr int kMaxParams = 256;

PyObject* g_data_ptr = nullptr;  // interned "data_ptr"
PyObject* g_dtype = nullptr;     // interned "dtype"
PyObject* g_float_mark = nullptr;

// The key item of an int (new reference), or nullptr (beyond 64 bits: not handled).
PyObject* int_item(PyObject* v, long flags) {
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  int range;  // Triton's i32 / i64 / u64
  bool one = false, div16 = false;
  if (overflow == 0) {
    if (x == -1 && PyErr_Occurred()) { PyErr_Clear(); return nullptr; }
    range = (x >= INT32_MIN && x <= INT32_MAX) ? 0 : 1;
    one = x == 1;
    div16 = (x & 15) == 0;
  } else if (overflow > 0) {
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    if (PyErr_Occurred()) { PyErr_Clear(); return nullptr; }
    range = 2;
    div16 = (u & 15) == 0;
  } else {
    return nullptr;
  }
  long code;
  if (flags & kNoSpecialize) code = 1000 + range;                  // the type alone
  else if (one) code = 1100;                                       // Triton's constexpr 1
  else code = 1200 + 2 * range + ((flags & kNoAlign) ? 0 : div16);  // the type and divisibility by 16
  return PyLong_FromLong(code);
}

PyObject* prepare(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 3 || !PyTuple_Check(argv[0]) || !PyTuple_Check(argv[1]) || !PyDict_Check(argv[2])) {
    PyErr_SetString(PyExc_TypeError, "prepare(plan: tuple, args: tuple, kwargs: dict)");
    return nullptr;
  }
  PyObject* plan = argv[0];
  PyObject* args = argv[1];
  PyObject* kwargs = argv[2];
  if (PyTuple_GET_SIZE(plan) != 6) {
    PyErr_SetString(PyExc_TypeError, "prepare: plan must be (names, flags, defaults, index, tensor_types, no_default)");
    return nullptr;
  }
  PyObject* names = PyTuple_GET_ITEM(plan, 0);
  PyObject* flags = PyTuple_GET_ITEM(plan, 1);
  PyObject* defaults = PyTuple_GET_ITEM(plan, 2);
  PyObject* index = PyTuple_GET_ITEM(plan, 3);
  PyObject* tensor_types = PyTuple_GET_ITEM(plan, 4);
  PyObject* no_default = PyTuple_GET_ITEM(plan, 5);
  const Py_ssize_t n = PyTuple_GET_SIZE(names);
  const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
  if (n > kMaxParams || nargs > n) Py_RETURN_NONE;

  PyObject* vals[kMaxParams];  // borrowed
  for (Py_ssize_t i = 0; i < n; ++i) vals[i] = i < nargs ? PyTuple_GET_ITEM(args, i) : nullptr;

  PyObject* options = PyList_New(0);
  if (!options) return nullptr;
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(kwargs, &pos, &k, &v)) {
    PyObject* at = PyDict_GetItemWithError(index, k);
    if (at) {
      Py_ssize_t i = PyLong_AsSsize_t(at);
      if (vals[i]) { Py_DECREF(options); Py_RETURN_NONE; }  // given twice: let Triton raise Python's error
      vals[i] = v;
    } else {
      if (PyErr_Occurred()) { Py_DECREF(options); return nullptr; }
      PyObject* pair = PyTuple_Pack(2, k, v);
      if (!pair || PyList_Append(options, pair) < 0) { Py_XDECREF(pair); Py_DECREF(options); return nullptr; }
      Py_DECREF(pair);
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!vals[i]) {
      vals[i] = PyTuple_GET_ITEM(defaults, i);
      if (vals[i] == no_default) { Py_DECREF(options); Py_RETURN_NONE; }
    }
  }

  PyObject* key = PyTuple_New(n + 1);
  PyObject* ordered = PyTuple_New(n);
  if (!key || !ordered) { Py_XDECREF(key); Py_XDECREF(ordered); Py_DECREF(options); return nullptr; }
  PyObject* result = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* val = vals[i];
    const long f = PyLong_AsLong(PyTuple_GET_ITEM(flags, i));
    PyObject* item = nullptr;  // new reference
    PyObject* out = nullptr;   // new reference
    if ((f & kConstexpr) || val == Py_None || PyBool_Check(val)) {
      item = Py_NewRef(val);
      out = Py_NewRef(val);
    } else if (PyLong_Check(val)) {
      item = int_item(val, f);
      if (!item) goto unhandled;
      out = Py_NewRef(val);
    } else if (PyFloat_Check(val)) {
      item = Py_NewRef(g_float_mark);
      out = Py_NewRef(val);
    } else {
      bool tensor = false;
      for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(tensor_types); ++t)
        tensor |= reinterpret_cast<PyObject*>(Py_TYPE(val)) == PyTuple_GET_ITEM(tensor_types, t);
      if (!tensor) goto unhandled;
      PyObject* ptr = PyObject_CallMethodNoArgs(val, g_data_ptr);
      if (!ptr) goto done;
      unsigned long long address = PyLong_AsUnsignedLongLong(ptr);
      if (PyErr_Occurred()) { Py_DECREF(ptr); goto done; }
      PyObject* dtype = PyObject_GetAttr(val, g_dtype);
      if (!dtype) { Py_DECREF(ptr); goto done; }
      PyObject* aligned = (f & kNoAlign) ? Py_None : ((address & 15) == 0 ? Py_True : Py_False);
      item = PyTuple_Pack(2, dtype, aligned);
      Py_DECREF(dtype);
      if (!item) { Py_DECREF(ptr); goto done; }
      out = ptr;
    }
    PyTuple_SET_ITEM(key, i, item);
    PyTuple_SET_ITEM(ordered, i, out);
  }
  {
    PyObject* opts = PyList_AsTuple(options);
    if (!opts) goto done;
    PyTuple_SET_ITEM(key, n, opts);
    result = PyTuple_Pack(2, key, ordered);
  }
  goto done;
unhandled:
  result = Py_NewRef(Py_None);
done:
  Py_DECREF(key);  // unset items are NULL: tuple dealloc skips them
  Py_DECREF(ordered);
  Py_DECREF(options);
  return result;
}

PyMethodDef methods[] = {
    {"prepare", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prepare)), METH_FASTCALL,
     "prepare(plan, args, kwargs) -> (key, ordered) or None: csrc/launch/launch_key.cpp says what each is."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_launch",
                      "The Triton launch shortcut's argument binding and specialization key (fastbert/ops/launch.py).",
                      -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__launch() {
  g_data_ptr = PyUnicode_InternFromString("data_ptr");
  g_dtype = PyUnicode_InternFromString("dtype");
  g_float_mark = PyUnicode_InternFromString("fp32");
  if (!g_data_ptr || !g_dtype || !g_float_mark) return nullptr;
  return PyModule_Create(&module);
}
