// Type selection for the kernels' templates (NVRTC has no <type_traits> here).
#pragma once

// A if kFirst, else B.
template <bool kFirst, class A, class B> struct PickType { using type = A; };
template <class A, class B> struct PickType<false, A, B> { using type = B; };
