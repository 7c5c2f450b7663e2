/* Fused element-wise kernels for the CPU training engine (engines/cpu_kernels.py builds and loads
 * this file). fp32, contiguous rows; OpenMP shares the work among torch's threads (the same
 * libgomp: torch loads it first). Each kernel reads its inputs once and writes its outputs once,
 * where eager PyTorch makes a pass per operation. */
#include <float.h>
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

/* Rotary embedding of x, a [d0, d1, d2, h] view whose last dimension is contiguous, by cos and sin
 * broadcast to it (stride 0 where broadcast). `strides` holds the three outer strides of x, cos, sin
 * and y in that order. With halves (x1, x2) of the last dimension:
 *   forward:  y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2;
 *   inverse (the gradient):  y1 = x1 c1 + x2 s2,  y2 = x2 c2 - x1 s1. */
void tandem_rotary(const float *x, const float *cos, const float *sin, float *y, const int64_t *dims,
                   const int64_t *strides, int inverse) {
    const int64_t *sx = strides, *sc = strides + 3, *ss = strides + 6, *sy = strides + 9;
    int64_t half = dims[3] / 2;
#pragma omp parallel for collapse(3) schedule(static)
    for (int64_t a = 0; a < dims[0]; a++)
        for (int64_t b = 0; b < dims[1]; b++)
            for (int64_t c = 0; c < dims[2]; c++) {
                const float *xr = x + a * sx[0] + b * sx[1] + c * sx[2];
                const float *cr = cos + a * sc[0] + b * sc[1] + c * sc[2];
                const float *sr = sin + a * ss[0] + b * ss[1] + c * ss[2];
                float *yr = y + a * sy[0] + b * sy[1] + c * sy[2];
                if (inverse) {
#pragma omp simd
                    for (int64_t j = 0; j < half; j++) {
                        float x1 = xr[j], x2 = xr[j + half];
                        yr[j] = x1 * cr[j] + x2 * sr[j + half];
                        yr[j + half] = x2 * cr[j + half] - x1 * sr[j];
                    }
                } else {
#pragma omp simd
                    for (int64_t j = 0; j < half; j++) {
                        float x1 = xr[j], x2 = xr[j + half];
                        yr[j] = x1 * cr[j] - x2 * sr[j];
                        yr[j + half] = x2 * cr[j + half] + x1 * sr[j + half];
                    }
                }
            }
}

/* Log-softmax statistics of `rows` rows of v logits (contiguous): per row the log-normaliser
 * lse = m + log(sum exp(z - m)), the target's log-prob z[t] - lse, and, where `entropy` is not NULL,
 * H = -sum p log p = log S - sum e (z - m) / S with e = exp(z - m), S = sum e. With `write_log_p` the
 * row is left as log p = z - lse. */
void tandem_log_softmax_stats(float *logits, const int64_t *targets, float *log_prob, float *lse,
                              float *entropy, int64_t rows, int64_t v, int write_log_p) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        float *z = logits + row * v;
        float m = -FLT_MAX; /* not -INFINITY: -ffast-math assumes no infinities */
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < v; j++) m = z[j] > m ? z[j] : m;
        float sum = 0.0f, weighted = 0.0f;
        if (entropy) {
#pragma omp simd reduction(+ : sum, weighted)
            for (int64_t j = 0; j < v; j++) {
                float d = z[j] - m;
                float e = expf(d);
                sum += e;
                weighted += e * d;
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < v; j++) sum += expf(z[j] - m);
        }
        float log_sum = logf(sum);
        float norm = m + log_sum;
        lse[row] = norm;
        log_prob[row] = z[targets[row]] - norm;
        if (entropy) entropy[row] = log_sum - weighted / sum;
        if (write_log_p) {
#pragma omp simd
            for (int64_t j = 0; j < v; j++) z[j] -= norm;
        }
    }
}

/* The gradient of a loss with respect to the logits, over `rows` rows of v values that hold z with
 * log p = z - shift[row] (shift NULL: the rows are log p already), written in place:
 *   g = -grad_entropy p (log p + H) - grad_log_prob p,  then g[t] += grad_log_prob,
 * p = exp(log p); either gradient may be NULL (no such term). */
void tandem_log_softmax_grad(float *values, const float *shift, const int64_t *targets,
                             const float *grad_log_prob, const float *entropy,
                             const float *grad_entropy, int64_t rows, int64_t v) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        float *z = values + row * v;
        float s = shift ? shift[row] : 0.0f;
        float gl = grad_log_prob ? grad_log_prob[row] : 0.0f;
        float ge = grad_entropy ? grad_entropy[row] : 0.0f;
        float h = entropy && grad_entropy ? entropy[row] : 0.0f;
#pragma omp simd
        for (int64_t j = 0; j < v; j++) {
            float lp = z[j] - s;
            float p = expf(lp);
            z[j] = -p * (ge * (lp + h) + gl);
        }
        if (grad_log_prob) z[targets[row]] += gl;
    }
}
