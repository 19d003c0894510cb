// The FFN's GEMMs with BERT's exact (erf) GELU in their epilogues, for Hopper (sm_90a), on CUTLASS 3's
// warp-specialized TMA/wgmma kernels: a consumer warp group's epilogue runs while the other's (ping-pong) or the
// producer's loads (cooperative) keep the tensor cores fed, which a Triton 3.6 GEMM cannot do on sm_90
// (benchmarks/RESULTS.md, thirteenth session) and cuBLASLt does only with the tanh GELU.
//
//   fb_sm90_bias_gelu: y = gelu(z) and g = gelu'(z), z = x @ w^T + bias   x (M, K), w (N, K), bias (N,), y, g (M, N)
//   fb_sm90_dgelu:     dz = (d @ w2) * g                              d (M, K), w2 (K, N), g and dz (M, N)
//                      and d(bias)'s partial column sums of dz, one fp32 row per tile row of the launch shape
//                      (fb_sm90_tile_m), for the caller to add up
//
// The up-projection stores GELU's derivative for the backward, not the pre-activation z: erf is computed once, in
// the forward's epilogue (which yields both gelu(z) and gelu'(z) from the same erf and exp), and the
// down-projection's input-gradient epilogue only multiplies (ABI 2; ABI 1 stored z and recomputed erf there).
//
// All matrices row-major and contiguous, bf16, fp32 accumulation and epilogue math. erf by Abramowitz & Stegun
// 7.1.26 (|error| <= 1.5e-7 with PTX's ex2 / rcp approximations, about 1/25,000 of a bf16 rounding step at 1) in
// about half the instructions of libdevice's erff: the epilogue's arithmetic is what the tensor cores wait for in
// these kernels (benchmarks/RESULTS.md, fifteenth session); GELU's derivative gets exp(-z^2 / 2) from the same
// formula. A plain C ABI (no Python, no torch): fastbert/ops/gemm_sm90.py loads this library with ctypes and passes
// torch's pointers and current stream, so one build serves every Python and a CUDA graph captures the launch. Each
// function returns 0, or cutlass::Status + 1, 100 (a workspace these kernels were not built for), 200 (a launch
// error), -1 (a variant out of range).
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"

using namespace cute;

namespace {

// PTX's one-instruction approximations (flush-to-zero): the reciprocal (kRcp) or 2^x.
template <bool kRcp>
CUTLASS_HOST_DEVICE float ptx_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  if constexpr (kRcp) {
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  } else {
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  }
  return y;
#else
  return kRcp ? 1.0f / x : exp2f(x);
#endif
}

// erf(x), and exp(-x^2) in `gauss`: Abramowitz & Stegun 7.1.26, the polynomial of fastbert/ops/ffn.py's _half_erfc
// (which takes z = sqrt(2) x, folds a sign and 0.5 into the coefficients and returns 0.5 erfc(|x|)).
CUTLASS_HOST_DEVICE float erf_fast(float x, float& gauss) {
  float t = ptx_approx<true>(fmaf(0.3275911f, fabsf(x), 1.0f));
  float p = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f),
                     0.254829592f);
  gauss = ptx_approx<false>(x * x * -1.4426950408889634f);
  return copysignf(1.0f - p * gauss, x);
}

// gelu(z) = z * Phi(z) (0.70710678 = 1 / sqrt(2)).
template <class T>
struct GeluErf {
  CUTLASS_HOST_DEVICE T operator()(T const& z) const {
    float g, zf = float(z);
    return T(0.5f * zf * (1.0f + erf_fast(zf * 0.7071067811865476f, g)));
  }
};

// gelu'(z) = Phi(z) + z * phi(z) (0.3989422804 = 1 / sqrt(2 pi)). Evaluated on the same z as GeluErf in one
// epilogue: erf_fast's instructions (inline asm without side effects) are computed once for both (the sm_90a
// SASS has the two MUFU operations an element of the forward alone, see fb_sm90_bias_gelu).
template <class T>
struct GeluGradErf {
  CUTLASS_HOST_DEVICE T operator()(T const& z) const {
    float gauss, zf = float(z);
    float erf = erf_fast(zf * 0.7071067811865476f, gauss);  // gauss = exp(-z^2 / 2)
    return T(0.5f * (1.0f + erf) + zf * gauss * 0.3989422804014327f);
  }
};

// dy * g, g = gelu'(z) as the forward stored it.
template <class T>
struct TimesGrad {
  CUTLASS_HOST_DEVICE T operator()(T const& dy, T const& g) const { return T(float(dy) * float(g)); }
};

// The functors above on CUTLASS's fragments (what its epilogue visitors call): the scalar operation element by element.
template <template <class> class Op, class T, int N>
struct OnFragments {
  template <class... Frags>
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(Frags const&... in) const {
    cutlass::Array<T, N> out;
    Op<T> op;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = op(in[i]...);
    return out;
  }
};

template <class T, int N>
struct GeluErf<cutlass::Array<T, N>> : OnFragments<GeluErf, T, N> {};
template <class T, int N>
struct GeluGradErf<cutlass::Array<T, N>> : OnFragments<GeluGradErf, T, N> {};
template <class T, int N>
struct TimesGrad<cutlass::Array<T, N>> : OnFragments<TimesGrad, T, N> {};

}  // namespace

// dz = dy * g with g = gelu'(z) read by the epilogue (CUTLASS's LinCombDeEltAct), and dz's column sums over each tile
// (d(bias)) reduced in the same epilogue, written as one fp32 row per tile row (no final reduction: no workspace,
// no atomics, the same sums in any run). CUTLASS's own fused bias gradient (LinCombDeEltActDePerRowBias) sums
// rows, so this operation brings its callbacks: CUTLASS's, with a row reduction in place of the column one.
template <class T>
struct DGeluDBias : cutlass::epilogue::fusion::LinCombDeEltAct<cutlass::layout::RowMajor, TimesGrad, T, float, T> {};

namespace cutlass::epilogue::fusion {
template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, class T,
          class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom, class CopyOpS2R>
struct FusionCallbacks<epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
                       DGeluDBias<T>, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpS2R>
    : Sm90EVT<Sm90Compute<cutlass::epilogue::thread::Identity, T, float, FloatRoundStyle::round_to_nearest>,
              Sm90EVT<Sm90RowReduction<plus, plus, plus, 0, CtaTileShapeMNK, float, float,
                                       FloatRoundStyle::round_to_nearest, Stride<_0, _1, int64_t>, 4, true, false>,
                      Sm90LinCombDeEltAct<CtaTileShapeMNK, EpilogueTile, StagesC,
                                          cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom,
                                          CopyOpS2R, TimesGrad, float, float, T, T, float>>> {
  using Impl = Sm90EVT<
      Sm90Compute<cutlass::epilogue::thread::Identity, T, float, FloatRoundStyle::round_to_nearest>,
      Sm90EVT<Sm90RowReduction<plus, plus, plus, 0, CtaTileShapeMNK, float, float, FloatRoundStyle::round_to_nearest,
                               Stride<_0, _1, int64_t>, 4, true, false>,
              Sm90LinCombDeEltAct<CtaTileShapeMNK, EpilogueTile, StagesC,
                                  cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom, CopyOpS2R,
                                  TimesGrad, float, float, T, T, float>>>;
  using Operation = DGeluDBias<T>;

  struct Arguments {
    float alpha = 1.0f;
    float beta = 0.0f;
    float const* alpha_ptr = nullptr;
    float const* beta_ptr = nullptr;
    using StrideAlpha = Stride<_0, _0, int64_t>;
    using StrideBeta = Stride<_0, _0, int64_t>;
    StrideAlpha dAlpha = {_0{}, _0{}, 0};
    StrideBeta dBeta = {_0{}, _0{}, 0};
    using StrideAux = cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>;
    T const* aux_ptr = nullptr;
    StrideAux dAux = {};
    float* dbias_partial = nullptr;          // (tiles along M, N rounded up to the tile's N), row-major
    Stride<_0, _1, int64_t> dDbias = {};

    operator typename Impl::Arguments() const {
      return {
          {                                                  // reduce(activation(beta * C + alpha * acc, aux))
              {                                              // activation(beta * C + alpha * acc, aux)
                  {{{beta}, {beta_ptr}, {dBeta}}, {}, {{{alpha}, {alpha_ptr}, {dAlpha}}, {}, {}}, {}},
                  {aux_ptr, T(0), dAux},
                  {}},
              {dbias_partial, 0.0f, dDbias}},
          {}};                                               // identity: the conversion to T
    }
  };

  using Impl::Impl;
};
}  // namespace cutlass::epilogue::fusion

// y = gelu(z) as D and g = gelu'(z) as the aux output, z = acc + bias (per column): z is computed once (the split
// tree's input) and both outputs read it (Sm90SplitTreeFetch). The operation's traits (aux element, layout,
// alignment) are LinCombPerColBiasEltActAux's, so the collective builder lays out the aux store as it does for z.
template <class T>
struct BiasGeluGrad
    : cutlass::epilogue::fusion::LinCombPerColBiasEltActAux<cutlass::layout::RowMajor, GeluErf, T, float, T, T> {};

namespace cutlass::epilogue::fusion {
template <int StagesC, int StagesD, int FragmentSize, bool ReuseSmemC, bool DelayTmaStore, class T,
          class CtaTileShapeMNK, class EpilogueTile, class SmemLayoutAtom, class CopyOpR2S>
struct FusionCallbacks<epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, FragmentSize, ReuseSmemC, DelayTmaStore>,
                       BiasGeluGrad<T>, CtaTileShapeMNK, EpilogueTile, SmemLayoutAtom, CopyOpR2S>
    : Sm90SplitTreeVisitor<
          Sm90EVT<Sm90Compute<plus, float, float, FloatRoundStyle::round_to_nearest>, Sm90AccFetch,
                  Sm90RowBroadcast<0, CtaTileShapeMNK, T, float, Stride<_0, _1, int64_t>, 8>>,
          Sm90EVT<Sm90Compute<GeluErf, T, float, FloatRoundStyle::round_to_nearest>, Sm90SplitTreeFetch>,
          Sm90EVT<Sm90AuxStore<StagesD, EpilogueTile, T, FloatRoundStyle::round_to_nearest,
                               cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom, CopyOpR2S, 8>,
                  Sm90EVT<Sm90Compute<GeluGradErf, float, float, FloatRoundStyle::round_to_nearest>,
                          Sm90SplitTreeFetch>>> {
  using Impl = Sm90SplitTreeVisitor<
      Sm90EVT<Sm90Compute<plus, float, float, FloatRoundStyle::round_to_nearest>, Sm90AccFetch,
              Sm90RowBroadcast<0, CtaTileShapeMNK, T, float, Stride<_0, _1, int64_t>, 8>>,
      Sm90EVT<Sm90Compute<GeluErf, T, float, FloatRoundStyle::round_to_nearest>, Sm90SplitTreeFetch>,
      Sm90EVT<Sm90AuxStore<StagesD, EpilogueTile, T, FloatRoundStyle::round_to_nearest,
                           cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor>, SmemLayoutAtom, CopyOpR2S, 8>,
              Sm90EVT<Sm90Compute<GeluGradErf, float, float, FloatRoundStyle::round_to_nearest>, Sm90SplitTreeFetch>>>;
  using Operation = BiasGeluGrad<T>;

  struct Arguments {
    T const* bias_ptr = nullptr;
    Stride<_0, _1, int64_t> dBias = {};
    T* aux_ptr = nullptr;  // gelu'(z)
    cutlass::gemm::TagToStrideC_t<cutlass::layout::RowMajor> dAux = {};

    operator typename Impl::Arguments() const {
      typename Impl::Arguments args;
      auto& [z_args, aux_args, d_args] = args;
      z_args = {{}, {bias_ptr, T(0), dBias}, {}};  // plus(acc, bias)
      aux_args = {{{}, {}}, {aux_ptr, dAux}};      // store(gelu'(z))
      d_args = {{}, {}};                           // gelu(z)
      return args;
    }
  };

  using Impl::Impl;
};
}  // namespace cutlass::epilogue::fusion

namespace {

struct PingPong {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
};
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
};

// One GEMM: D (M, N) = A (M, K) @ B, A row-major; B (N, K) row-major (kBT: "x @ w^T") or (K, N) row-major.
template <class T, bool kBT, class Fusion, class Tile, class Cluster, class Schedule>
struct Gemm {
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = std::conditional_t<kBT, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlign, T, LayoutD, kAlign,
      typename Schedule::Epilogue, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, LayoutA, kAlign, T, LayoutB, kAlign, float, Tile,
      Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideD = typename Kernel::StrideD;

  static typename Adapter::Arguments arguments(const void* a, const void* b, void* d, int M, int N, int K) {
    StrideA sa = cute::make_stride(int64_t(K), cute::Int<1>{}, int64_t(0));
    StrideB sb;
    if constexpr (kBT) {
      sb = cute::make_stride(int64_t(K), cute::Int<1>{}, int64_t(0));
    } else {
      sb = cute::make_stride(cute::Int<1>{}, int64_t(N), int64_t(0));
    }
    StrideD sd = cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(0));
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const T*>(a), sa, static_cast<const T*>(b), sb},
        {{}, nullptr, sd, static_cast<T*>(d), sd}};
    return args;
  }

  static int run(typename Adapter::Arguments const& args, cudaStream_t stream) {
    Adapter gemm;
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess) return int(status) + 1;
    // These kernels need no workspace (data-parallel persistent tiles, no split-K or stream-K, d(bias) as partials).
    if (Adapter::get_workspace_size(args) != 0) return 100;
    status = gemm.initialize(args, nullptr, stream);
    if (status != cutlass::Status::kSuccess) return int(status) + 1;
    status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess) return int(status) + 1;
    return cudaGetLastError() == cudaSuccess ? 0 : 200;
  }
};

template <class Tile, class Cluster, class Schedule>
struct Shapes {
  using Bf16 = cutlass::bfloat16_t;
  using Fwd = Gemm<Bf16, true, BiasGeluGrad<Bf16>, Tile, Cluster, Schedule>;
  using Bwd = Gemm<Bf16, false, DGeluDBias<Bf16>, Tile, Cluster, Schedule>;
  static constexpr int kTileM = cute::size<0>(Tile{});
  static constexpr int kTileN = cute::size<1>(Tile{});

  static int bias_gelu(const void* x, const void* w, const void* bias, void* g, void* y, int M, int N, int K,
                       cudaStream_t stream) {
    auto args = Fwd::arguments(x, w, y, M, N, K);
    args.epilogue.thread.bias_ptr = static_cast<const Bf16*>(bias);
    args.epilogue.thread.aux_ptr = static_cast<Bf16*>(g);
    args.epilogue.thread.dAux = args.epilogue.dD;
    return Fwd::run(args, stream);
  }

  static int dgelu(const void* d, const void* w2, const void* g, void* dz, float* dbias_partial, int M, int N, int K,
                   cudaStream_t stream) {
    auto args = Bwd::arguments(d, w2, dz, M, N, K);
    args.epilogue.thread.aux_ptr = static_cast<const Bf16*>(g);
    args.epilogue.thread.dAux = args.epilogue.dD;
    args.epilogue.thread.dbias_partial = dbias_partial;
    args.epilogue.thread.dDbias = cute::make_stride(cute::Int<0>{}, cute::Int<1>{}, int64_t(0));
    return Bwd::run(args, stream);
  }
};

using Cluster1 = Shape<_1, _1, _1>;
using Cluster2 = Shape<_2, _1, _1>;
// The launch shapes (see fb_sm90_variants).
using V0 = Shapes<Shape<_128, _256, _64>, Cluster2, Cooperative>;
using V1 = Shapes<Shape<_256, _128, _64>, Cluster2, Cooperative>;
using V2 = Shapes<Shape<_128, _128, _64>, Cluster1, PingPong>;
using V3 = Shapes<Shape<_64, _256, _64>, Cluster1, PingPong>;
using V4 = Shapes<Shape<_128, _256, _64>, Cluster1, Cooperative>;

template <class F>
int dispatch(int variant, F&& f) {
  switch (variant) {
    case 0: return f(V0{});
    case 1: return f(V1{});
    case 2: return f(V2{});
    case 3: return f(V3{});
    case 4: return f(V4{});
    default: return -1;
  }
}

}  // namespace

extern "C" {

// Launch shapes: 0 cooperative 128x256x64 in clusters of 2 along M (B's tiles multicast), 1 cooperative 256x128x64
// (clusters of 2), 2 ping-pong 128x128x64, 3 ping-pong 64x256x64, 4 cooperative 128x256x64 without clusters.
// 128x256 ping-pong spills (4.7 KB a thread, sm_90a compile report), so it is not offered.
int fb_sm90_variants() { return 5; }

// What fb_sm90_bias_gelu stores for the backward: 2 = gelu'(z) (this file); libraries without this function stored z
// (ops/gemm_sm90.py refuses them: their dgelu would read the derivative as z).
int fb_sm90_abi() { return 2; }

// Rows of the d(bias) partials fb_sm90_dgelu writes for M rows (columns: N rounded up to fb_sm90_tile_n), or -1.
int fb_sm90_tile_m(int variant) {
  return dispatch(variant, [](auto v) { return decltype(v)::kTileM; });
}
int fb_sm90_tile_n(int variant) {
  return dispatch(variant, [](auto v) { return decltype(v)::kTileN; });
}

int fb_sm90_bias_gelu(const void* x, const void* w, const void* bias, void* g, void* y, int M, int N, int K,
                      int variant, void* stream) {
  return dispatch(variant, [&](auto v) {
    return decltype(v)::bias_gelu(x, w, bias, g, y, M, N, K, static_cast<cudaStream_t>(stream));
  });
}

int fb_sm90_dgelu(const void* d, const void* w2, const void* g, void* dz, float* dbias_partial, int M, int N, int K,
                  int variant, void* stream) {
  return dispatch(variant, [&](auto v) {
    return decltype(v)::dgelu(d, w2, g, dz, dbias_partial, M, N, K, static_cast<cudaStream_t>(stream));
  });
}

}  // extern "C"
