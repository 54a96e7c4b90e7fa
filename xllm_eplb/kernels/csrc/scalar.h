// A bf16 (uint16_t bits) or fp32 value as float, for the scalar tails of the SIMD variants.
// Included by isa_avx512.cpp and isa_avx2.cpp inside their anonymous namespace, so each copy is
// compiled for that file's target only (no inline code shared across targets).
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  const uint32_t b = uint32_t(v) << 16;
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}
