/* Fused element-wise kernels for the CPU training engine (engines/cpu_kernels.py builds and loads
 * this file). fp32, contiguous rows; OpenMP shares the work among torch's threads (the same
 * libgomp: torch loads it first). Each kernel reads its inputs once and writes its outputs once,
 * where eager PyTorch makes a pass per operation. */
#include <math.h>
#include <omp.h>
#include <stdint.h>

int tandem_max_threads(void) { return omp_get_max_threads(); }

/* sigmoid(x) from e = exp(-|x|), in (0, 1]: no infinity on the way at any x (with -ffast-math the
 * division 1 / (1 + inf) would be an approximate reciprocal, and 0 * inf a NaN). */
static inline float sigmoid(float x) {
    float e = expf(-fabsf(x));
    float r = 1.0f / (1.0f + e);
    return x >= 0.0f ? r : e * r;
}

/* SwiGLU: out = silu(gate) * up, silu(x) = x * sigmoid(x). */
void tandem_swiglu_forward(const float *gate, const float *up, float *out, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i];
        out[i] = x * sigmoid(x) * up[i];
    }
}

/* d gate = dy * up * s * (1 + x (1 - s)),  d up = dy * x * s,  s = sigmoid(x), x = gate. */
void tandem_swiglu_backward(const float *grad, const float *gate, const float *up, float *grad_gate,
                            float *grad_up, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i];
        float s = sigmoid(x);
        float d = grad[i];
        grad_up[i] = d * x * s;
        grad_gate[i] = d * up[i] * s * (1.0f + x * (1.0f - s));
    }
}

/* RMSNorm over the last dimension h of `rows` rows: r = 1 / sqrt(mean(x^2) + eps), y = x r w. */
void tandem_rms_norm_forward(const float *x, const float *weight, float *y, float *rstd, int64_t rows,
                             int64_t h, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        const float *xr = x + row * h;
        float *yr = y + row * h;
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t j = 0; j < h; j++) squares += xr[j] * xr[j];
        float r = 1.0f / sqrtf(squares / (float)h + eps);
        rstd[row] = r;
#pragma omp simd
        for (int64_t j = 0; j < h; j++) yr[j] = xr[j] * r * weight[j];
    }
}

/* With x^ = x r and g = dy w:  dx = r (g - x^ mean(g x^)),  dw = sum over rows of dy x^.
 * Each thread sums its rows' dw into its own row of `grad_weight_parts` ([threads, h]); the caller
 * adds the rows. */
void tandem_rms_norm_backward(const float *grad, const float *x, const float *weight, const float *rstd,
                              float *grad_x, float *grad_weight_parts, int64_t rows, int64_t h) {
#pragma omp parallel
    {
        float *part = grad_weight_parts + (int64_t)omp_get_thread_num() * h;
        for (int64_t j = 0; j < h; j++) part[j] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            const float *xr = x + row * h;
            const float *dr = grad + row * h;
            float *out = grad_x + row * h;
            float r = rstd[row];
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < h; j++) {
                float normed = xr[j] * r;
                part[j] += dr[j] * normed;
                dot += dr[j] * weight[j] * normed;
            }
            float mean = dot / (float)h;
#pragma omp simd
            for (int64_t j = 0; j < h; j++) out[j] = r * (dr[j] * weight[j] - xr[j] * r * mean);
        }
    }
}
