//! Vectorised `exp`, the softmax loops of the host kernels ([`super::attention`],
//! [`super::logprobs`]) and SwiGLU's activation. The standard library's `f32::exp` is a call
//! into libm per element, which the compiler cannot vectorise: it was about 6 % of a training
//! step of the default's model (perf, `bench train-step --shape smollm2`). Here `exp` is plain
//! arithmetic (Cephes' single-precision polynomial, within 2 ulp of the exact value in the
//! normal range), so the loops over a row vectorise; each loop is compiled for AVX-512 F, for
//! AVX2 with FMA (the widest the CPU has is chosen at run time) and for the baseline, and sums
//! and maxima run in 16 lanes.
//!
//! Results below `2⁻¹²⁶` (inputs under about −87.34) are flushed to 0; inputs above about 88.72
//! give infinity and NaN stays NaN.

/// Lanes of the reductions: one AVX-512 register of f32.
const LANES: usize = 16;

/// `exp(x)` in f32 (see the module docs for its accuracy and range).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LO: f32 = -87.336_55; // ln 2⁻¹²⁶
    const HI: f32 = 88.722_84; // ln f32::MAX
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two, so that n · LN2_HI is exact for |n| ≤ 128
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // adding 1.5 · 2²³ rounds a float of magnitude < 2²² to an integer (in its low bits)
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI); // NaN stays NaN
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2ⁿ in two factors, so that n = 128 (x near HI) and n = −126 both stay representable
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let half = ni >> 1;
    let s1 = f32::from_bits(((half + 127) << 23) as u32);
    let s2 = f32::from_bits(((ni - half + 127) << 23) as u32);
    let e = y * s1 * s2;
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        e
    }
}

/// Compiles `$body` as a function `$name` three times (AVX-512 F, AVX2 with FMA, and the
/// baseline) and calls the widest the CPU has.
macro_rules! dispatch {
    ($(#[$meta:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn imp($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn wide($($arg: $ty),*) -> $ret {
                    imp($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) -> $ret {
                    imp($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512 F (checked above).
                    return unsafe { wide($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}

/// The sum of 16 lanes, pairwise.
#[inline(always)]
fn lane_sum(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// The largest of 16 lanes.
#[inline(always)]
fn lane_max(acc: [f32; LANES]) -> f32 {
    acc.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// Maps `row` through `f` in place and returns its largest value (−∞ when empty).
#[inline(always)]
fn map_max(row: &mut [f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            c[i] = f(c[i]);
            acc[i] = acc[i].max(c[i]);
        }
    }
    for (i, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x = f(*x);
        acc[i] = acc[i].max(*x);
    }
    lane_max(acc)
}

dispatch! {
    /// Multiplies `row` by `scale` in place and returns its largest value (−∞ when empty).
    pub fn scale_max(row: &mut [f32], scale: f32) -> f32 {
        map_max(row, |x| x * scale)
    }
}

dispatch! {
    /// The softmax of `row` in place, given its largest value `max`: `exp(x − max) / Σ`;
    /// returns `Σ exp(x − max)`.
    pub fn softmax_from_max(row: &mut [f32], max: f32) -> f32 {
        let mut acc = [0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                c[i] = exp(c[i] - max);
                acc[i] += c[i];
            }
        }
        for (i, x) in chunks.into_remainder().iter_mut().enumerate() {
            *x = exp(*x - max);
            acc[i] += *x;
        }
        let sum = lane_sum(acc);
        let inv = 1.0 / sum;
        for x in row.iter_mut() {
            *x *= inv;
        }
        sum
    }
}

dispatch! {
    /// Divides `row` by `temperature` in place and returns its largest value (−∞ when empty).
    pub fn divide_max(row: &mut [f32], temperature: f32) -> f32 {
        map_max(row, |x| x / temperature)
    }
}

dispatch! {
    /// `(Σ exp(z − max), Σ exp(z − max) · z)` over `row`.
    pub fn exp_sums(row: &[f32], max: f32) -> (f32, f32) {
        let (mut sum, mut weighted) = ([0f32; LANES], [0f32; LANES]);
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                let e = exp(c[i] - max);
                sum[i] += e;
                weighted[i] += e * c[i];
            }
        }
        for (i, &z) in chunks.remainder().iter().enumerate() {
            let e = exp(z - max);
            sum[i] += e;
            weighted[i] += e * z;
        }
        (lane_sum(sum), lane_sum(weighted))
    }
}

dispatch! {
    /// The gradient of a row of logits `z` in place (the log-probability and entropy backward
    /// pass): `z ← (−p · g_logp − p · (z − mean) · g_entropy) / temperature`, with
    /// `p = exp(z − max) / sum`. The target's `+ g_logp / temperature` is the caller's.
    pub fn logit_grad(
        row: &mut [f32],
        max: f32,
        sum: f32,
        mean: f32,
        g_logp: f32,
        g_entropy: f32,
        temperature: f32,
    ) -> () {
        for z in row.iter_mut() {
            let p = exp(*z - max) / sum;
            *z = (p * -g_logp - p * (*z - mean) * g_entropy) / temperature;
        }
    }
}

dispatch! {
    /// Attention's backward step on one query row: `p ← exp(s · scale − lse)` and
    /// `dp ← p · (dp − delta) · scale`, in place.
    pub fn attention_grad(p: &mut [f32], dp: &mut [f32], scale: f32, lse: f32, delta: f32) -> () {
        for (pj, dpj) in p.iter_mut().zip(dp.iter_mut()) {
            *pj = exp(*pj * scale - lse);
            *dpj = *pj * (*dpj - delta) * scale;
        }
    }
}

/// The logistic sigmoid `1 / (1 + exp(−x))` with this module's `exp` (0 below about −88.7,
/// where `exp(−x)` overflows; 1 above about 87.3).
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

dispatch! {
    /// SwiGLU's activation `silu(gate) · up = gate · sigmoid(gate) · up`, element by element
    /// into `out` (all three the same length).
    pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> () {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g * sigmoid(g) * u;
        }
    }
}

dispatch! {
    /// The gradients of [`swiglu`] for the output gradient `grad`: with `s = sigmoid(gate)`,
    /// `d_gate = grad · up · s · (1 + gate · (1 − s))` and `d_up = grad · gate · s`.
    pub fn swiglu_grad(
        gate: &[f32],
        up: &[f32],
        grad: &[f32],
        d_gate: &mut [f32],
        d_up: &mut [f32],
    ) -> () {
        for (((dg, du), (&g, &u)), &o) in d_gate
            .iter_mut()
            .zip(d_up.iter_mut())
            .zip(gate.iter().zip(up))
            .zip(grad)
        {
            let s = sigmoid(g);
            *du = o * g * s;
            *dg = o * u * s * (1.0 + g * (1.0 - s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `a` and the exact `b`.
    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = (f32::from_bits(b32.to_bits() + 1) - b32) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn exp_is_within_two_ulp_over_the_normal_range() {
        let mut worst = 0f64;
        let n = 2_000_000;
        for i in 0..=n {
            let x = -87.3 + (88.7 + 87.3) * i as f64 / n as f64;
            let x = x as f32;
            worst = worst.max(ulps(exp(x), (x as f64).exp()));
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn exp_handles_the_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        let top = exp(88.72);
        assert!(top.is_finite() && ulps(top, 88.72f32 as f64).is_finite());
        assert!(ulps(top, (88.72f32 as f64).exp()) <= 2.0);
        assert!(ulps(exp(-87.0), (-87f64).exp()) <= 2.0);
    }

    /// Rows of every length around the lane count, including the remainder paths.
    fn rows() -> Vec<Vec<f32>> {
        (0..70)
            .map(|n| {
                (0..n)
                    .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.7)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn swiglu_and_its_gradients_match_f64() {
        let gate: Vec<f32> = (0..203).map(|i| (i as f32 - 101.0) * 0.37).collect();
        let up: Vec<f32> = (0..203)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.5)
            .collect();
        let grad: Vec<f32> = (0..203)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.3)
            .collect();
        let mut out = vec![0f32; 203];
        swiglu(&gate, &up, &mut out);
        let (mut dg, mut du) = (vec![0f32; 203], vec![0f32; 203]);
        swiglu_grad(&gate, &up, &grad, &mut dg, &mut du);
        for i in 0..203 {
            let (g, u, o) = (gate[i] as f64, up[i] as f64, grad[i] as f64);
            let s = 1.0 / (1.0 + (-g).exp());
            let close =
                |got: f32, want: f64| (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs());
            assert!(
                close(out[i], g * s * u),
                "out {i}: {} vs {}",
                out[i],
                g * s * u
            );
            assert!(close(du[i], o * g * s), "d_up {i}");
            let want = o * u * s * (1.0 + g * (1.0 - s));
            assert!(close(dg[i], want), "d_gate {i}: {} vs {want}", dg[i]);
        }
        // Far out of exp's range: sigmoid saturates instead of giving NaN.
        let mut o = [0f32; 2];
        swiglu(&[-200.0, 200.0], &[1.0, 1.0], &mut o);
        assert_eq!(o, [-0.0, 200.0]);
    }

    #[test]
    fn softmax_loops_match_the_scalar_arithmetic() {
        for row in rows() {
            let mut a = row.clone();
            let max = scale_max(&mut a, 0.5);
            let expect_max = row
                .iter()
                .map(|x| x * 0.5)
                .fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max, expect_max);
            if row.is_empty() {
                continue;
            }
            let sum = softmax_from_max(&mut a, max);
            let exact: f64 = row.iter().map(|x| ((x * 0.5 - max) as f64).exp()).sum();
            assert!((sum as f64 - exact).abs() <= 1e-6 * exact);
            for (p, x) in a.iter().zip(&row) {
                let want = ((x * 0.5 - max) as f64).exp() / exact;
                assert!((*p as f64 - want).abs() <= 1e-6, "{p} vs {want}");
            }

            let mut d = row.clone();
            let m = divide_max(&mut d, 2.0);
            assert_eq!(m, expect_max);
            let (s, w) = exp_sums(&d, m);
            let ws: f64 = d.iter().map(|z| ((z - m) as f64).exp() * *z as f64).sum();
            assert!((s as f64 - exact).abs() <= 1e-6 * exact);
            assert!((w as f64 - ws).abs() <= 1e-5 * (1.0 + ws.abs()));

            let mut g = d.clone();
            logit_grad(&mut g, m, s, w / s, 0.3, -0.2, 2.0);
            for (gz, z) in g.iter().zip(&d) {
                let p = ((z - m) as f64).exp() / s as f64;
                let want = (p * -0.3 - p * (*z as f64 - (w / s) as f64) * -0.2) / 2.0;
                assert!((*gz as f64 - want).abs() <= 1e-6, "{gz} vs {want}");
            }

            let (mut p, mut dp) = (row.clone(), row.iter().map(|x| x * 0.1).collect::<Vec<_>>());
            let dp0 = dp.clone();
            attention_grad(&mut p, &mut dp, 0.125, 1.5, 0.25);
            for i in 0..row.len() {
                let want_p = ((row[i] * 0.125 - 1.5) as f64).exp();
                assert!((p[i] as f64 - want_p).abs() <= 2e-7 * want_p.max(1.0));
                let want_dp = want_p * (dp0[i] as f64 - 0.25) * 0.125;
                assert!((dp[i] as f64 - want_dp).abs() <= 1e-6);
            }
        }
    }
}
