// hisparse_cupy: HS_ABI_CHECK(S), the check of a kernel parameter struct S against its NumPy
// mirror in hisparse_cupy/_abi.py, which defines HS_ABI_<S>_SIZE and HS_ABI_<S>_FIELDS(X) (every
// field's name, size and whether it is a float, in order) for every compile. abi.cuh checks the package's structs with
// it, demo/model.cu the demo model's. Use it where S is in scope (in S's namespace).
//
// NVRTC has no offsetof, so the layout is pinned by what it determines: the size of every field
// and whether it is a float (the same bytes read as another number otherwise), their order (a C++20 designated initializer in _abi.py's order is a compile error when the
// declaration order differs) and the struct's size (_abi.py's structs have no tail padding, so a
// field only one side has changes it).
#pragma once

template <class T> struct hs_abi_float { static constexpr bool value = false; };
template <> struct hs_abi_float<float> { static constexpr bool value = true; };
template <> struct hs_abi_float<double> { static constexpr bool value = true; };

#define HS_ABI_FIELD_SIZE(S, f, n, fl)                                                   \
  static_assert(sizeof(S::f) == (n), #S "." #f ": size differs from _abi.py");           \
  static_assert(hs_abi_float<decltype(S::f)>::value == (fl),                              \
                #S "." #f ": float on one side, integer on the other (_abi.py)");
#define HS_ABI_DESIGNATOR(S, f, n, fl) .f = {},
#define HS_ABI_CHECK(S)                                                                  \
  HS_ABI_##S##_FIELDS(HS_ABI_FIELD_SIZE)                                                 \
  static_assert(sizeof(S{HS_ABI_##S##_FIELDS(HS_ABI_DESIGNATOR)}) == sizeof(S), #S);     \
  static_assert(sizeof(S) == HS_ABI_##S##_SIZE, #S ": size differs from _abi.py")
