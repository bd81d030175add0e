//! Images as llama.cpp's mtmd prepares them (`tools/mtmd/mtmd-image.cpp`, `clip-impl.h`):
//! decoding (PNG, JPEG) to 8-bit RGB, Pillow's resampling, MiniCPM-V's slicing into an overview
//! and a grid of slices (llava-uhd, `mtmd_image_preprocessor_llava_uhd` /
//! `mtmd_image_preprocessor_minicpmv`), and the normalisation `(v / 255 − mean) / std`.

use super::VisionError;

/// The largest image accepted, in pixels (and per side): a decompression bomb (a small file
/// that claims 30000×30000) is refused from its header, before any pixel is allocated.
pub const MAX_PIXELS: u64 = 1 << 26; // 67 Mpx, 192 MiB of RGB
pub const MAX_SIDE: u32 = 1 << 14;

/// An 8-bit RGB image, pixels interleaved row by row (`clip_image_u8`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb8 {
    pub w: usize,
    pub h: usize,
    pub px: Vec<u8>,
}

/// A normalised f32 RGB image, interleaved (`clip_image_f32`).
#[derive(Clone, Debug, PartialEq)]
pub struct RgbF32 {
    pub w: usize,
    pub h: usize,
    pub px: Vec<f32>,
}

/// Decode a PNG or JPEG file's bytes to RGB (alpha dropped, grey expanded, as stb_image with
/// 3 channels). Typed errors for an unknown format, a corrupt or truncated file, an empty image
/// and an image past [`MAX_PIXELS`] / [`MAX_SIDE`] (checked from the header).
pub fn decode(bytes: &[u8]) -> Result<Rgb8, VisionError> {
    use image::{ImageFormat, ImageReader};
    let reader = ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().map_err(|e| VisionError::Decode(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg) => {}
        Some(f) => return Err(VisionError::Format(format!("{f:?}"))),
        None => return Err(VisionError::Format("unknown (not PNG or JPEG)".into())),
    }
    let (w, h) = reader.into_dimensions().map_err(|e| VisionError::Decode(e.to_string()))?;
    check_size(w, h)?;
    let mut reader = ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().map_err(|e| VisionError::Decode(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_PIXELS * 8);
    reader.limits(limits);
    let img = reader.decode().map_err(|e| VisionError::Decode(e.to_string()))?;
    let rgb = img.to_rgb8();
    Ok(Rgb8 { w: rgb.width() as usize, h: rgb.height() as usize, px: rgb.into_raw() })
}

fn check_size(w: u32, h: u32) -> Result<(), VisionError> {
    if w == 0 || h == 0 {
        return Err(VisionError::Empty { w, h });
    }
    if w > MAX_SIDE || h > MAX_SIDE || w as u64 * h as u64 > MAX_PIXELS {
        return Err(VisionError::TooLarge { w, h, max_side: MAX_SIDE, max_pixels: MAX_PIXELS });
    }
    Ok(())
}

/// Pillow's bicubic resampling (`Resample.c`; llama.cpp `img_tool::resize_pillow`): separable,
/// horizontal then vertical, support 2 widened by the scale when shrinking, `a = −0.5`,
/// coefficients normalised then fixed-point with 22 fractional bits, results rounded and
/// clamped to 0..=255 after each pass.
pub fn resize_bicubic(img: &Rgb8, w: usize, h: usize) -> Rgb8 {
    if (w, h) == (img.w, img.h) {
        return img.clone();
    }
    let mut cur = img.clone();
    if w != cur.w {
        let (bounds, k, ks) = coefficients(cur.w, w);
        let mut out = vec![0u8; w * cur.h * 3];
        for y in 0..cur.h {
            let src = &cur.px[y * cur.w * 3..(y + 1) * cur.w * 3];
            for x in 0..w {
                let (x0, n) = bounds[x];
                let kk = &k[x * ks..x * ks + n];
                for c in 0..3 {
                    let mut acc: i32 = 1 << (PRECISION_BITS - 1);
                    for (i, &wt) in kk.iter().enumerate() {
                        acc = acc.wrapping_add(src[(x0 + i) * 3 + c] as i32 * wt);
                    }
                    out[(y * w + x) * 3 + c] = clip8(acc);
                }
            }
        }
        cur = Rgb8 { w, h: cur.h, px: out };
    }
    if h != cur.h {
        let (bounds, k, ks) = coefficients(cur.h, h);
        let row = cur.w * 3;
        let mut out = vec![0u8; row * h];
        let mut acc = vec![0i32; row];
        for y in 0..h {
            let (y0, n) = bounds[y];
            acc.fill(1 << (PRECISION_BITS - 1));
            for i in 0..n {
                let wt = k[y * ks + i];
                let src = &cur.px[(y0 + i) * row..(y0 + i + 1) * row];
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a = a.wrapping_add(s as i32 * wt);
                }
            }
            for (o, &a) in out[y * row..(y + 1) * row].iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
        cur = Rgb8 { w: cur.w, h, px: out };
    }
    cur
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output pixel: (first input pixel, count), and the fixed-point weights (`ksize` apart).
fn coefficients(in_size: usize, out_size: usize) -> (Vec<(usize, usize)>, Vec<i32>, usize) {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut k = vec![0i32; out_size * ksize];
    let mut pre = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin).min(ksize);
        let mut ww = 0.0;
        for (x, p) in pre.iter_mut().enumerate().take(n) {
            let w = bicubic((x as f64 + xmin as f64 - center + 0.5) * ss);
            *p = w;
            ww += w;
        }
        for x in 0..ksize {
            let w = if x < n && ww != 0.0 { pre[x] / ww } else if x < n { pre[x] } else { 0.0 };
            let f = w * (1u64 << PRECISION_BITS) as f64;
            k[xx * ksize + x] = (f + if w < 0.0 { -0.5 } else { 0.5 }) as i32;
        }
        bounds.push((xmin, n));
    }
    (bounds, k, ksize)
}

/// Resize keeping the aspect ratio into `w × h`, then pad with `color` (llama.cpp
/// `img_tool::resize` with `PAD_CEIL`: the scaled size rounded up, centred, offsets rounded down).
fn resize_pad(img: &Rgb8, w: usize, h: usize, color: [u8; 3]) -> Rgb8 {
    if (w, h) == (img.w, img.h) {
        return img.clone();
    }
    let scale = (w as f32 / img.w as f32).min(h as f32 / img.h as f32);
    let nw = ((img.w as f32 * scale).ceil() as usize).min(w);
    let nh = ((img.h as f32 * scale).ceil() as usize).min(h);
    let r = resize_bicubic(img, nw, nh);
    let mut out = Rgb8 { w, h, px: color.iter().copied().cycle().take(w * h * 3).collect() };
    let (ox, oy) = ((w - nw) / 2, (h - nh) / 2);
    for y in 0..nh {
        let d = ((y + oy) * w + ox) * 3;
        out.px[d..d + nw * 3].copy_from_slice(&r.px[y * nw * 3..(y + 1) * nw * 3]);
    }
    out
}

fn crop(img: &Rgb8, x: usize, y: usize, w: usize, h: usize) -> Rgb8 {
    let mut px = Vec::with_capacity(w * h * 3);
    for r in y..y + h {
        px.extend_from_slice(&img.px[(r * img.w + x) * 3..(r * img.w + x + w) * 3]);
    }
    Rgb8 { w, h, px }
}

/// The slicing parameters of a llava-uhd projector: the slice size (`clip.vision.image_size`),
/// and the alignment of every side (`patch_size · n_merge`: a whole number of output tokens).
#[derive(Clone, Copy, Debug)]
pub struct Slicing {
    pub image_size: usize,
    pub align: usize,
    /// `minicpmv4_6` with `n_merge == 2` keeps small images at their aspect ratio unsliced.
    pub small_keeps_aspect: bool,
}

/// Where the slices come from: the overview's size, the refined image's size, the grid
/// (columns × rows, 0 × 0 when unsliced).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlicePlan {
    pub overview: (usize, usize),
    pub refined: (usize, usize),
    pub grid: (usize, usize),
}

fn ensure_divide(len: usize, align: usize) -> usize {
    (((len as f32 / align as f32).round() as usize) * align).max(align)
}

fn best_resize(w: usize, h: usize, scale_resolution: usize, align: usize, allow_upscale: bool) -> (usize, usize) {
    let (mut w, mut h) = (w, h);
    if w * h > scale_resolution * scale_resolution || allow_upscale {
        let r = w as f32 / h as f32;
        h = (scale_resolution as f32 / r.sqrt()) as usize;
        w = (h as f32 * r) as usize;
    }
    (ensure_divide(w, align), ensure_divide(h, align))
}

fn best_grid(max_slices: usize, multiple: usize, log_ratio: f32) -> (usize, usize) {
    let mut cands = Vec::new();
    for n in [multiple.saturating_sub(1), multiple, multiple + 1] {
        if n <= 1 || n > max_slices {
            continue;
        }
        for m in 1..=n {
            if n % m == 0 {
                cands.push((m, n / m));
            }
        }
    }
    let mut best = (1, 1);
    let mut min_err = f32::INFINITY;
    for (gw, gh) in cands {
        let err = (log_ratio - ((gw as f64 / gh as f64).ln()) as f32).abs();
        if err < min_err {
            best = (gw, gh);
            min_err = err;
        }
    }
    best
}

/// llama.cpp's `get_slice_instructions` for MiniCPM-V (no pinpoints; at most 9 slices).
pub fn plan(w: usize, h: usize, s: &Slicing) -> SlicePlan {
    let size = s.image_size;
    if s.small_keeps_aspect && (w as f32 * h as f32) / (size * size) as f32 <= 1.0 {
        return SlicePlan { overview: best_resize(w, h, size, s.align, true), refined: (0, 0), grid: (0, 0) };
    }
    if w <= size && h <= size {
        return SlicePlan { overview: (size, size), refined: (0, 0), grid: (0, 0) };
    }
    const MAX_SLICES: usize = 9;
    let overview = best_resize(w, h, size, s.align, false);
    let log_ratio = (w as f32 / h as f32).ln();
    let ratio = (w * h) as f32 / (size * size) as f32;
    let multiple = (ratio.ceil() as usize).min(MAX_SLICES);
    let grid = best_grid(MAX_SLICES, multiple, log_ratio);
    let (rw, rh) = (ensure_divide(w, grid.0), ensure_divide(h, grid.1));
    let cell = best_resize(rw / grid.0, rh / grid.1, size, s.align, true);
    SlicePlan { overview, refined: (cell.0 * grid.0, cell.1 * grid.1), grid }
}

/// An image ready for the encoder: the overview first, then the slices row by row.
pub struct Prepared {
    pub overview: RgbF32,
    pub slices: Vec<RgbF32>,
    /// Columns × rows of the slice grid (0 × 0 when unsliced).
    pub grid: (usize, usize),
}

fn normalize(img: &Rgb8, mean: [f32; 3], std: [f32; 3]) -> RgbF32 {
    let px = img.px.iter().enumerate().map(|(i, &v)| (v as f32 / 255.0 - mean[i % 3]) / std[i % 3]).collect();
    RgbF32 { w: img.w, h: img.h, px }
}

/// Resize, slice and normalise (`mtmd_image_preprocessor_llava_uhd::preprocess`): the overview
/// resized directly (bicubic, no padding), the refined image resized with `PAD_CEIL` in black,
/// then cut into the grid.
pub fn prepare(img: &Rgb8, s: &Slicing, mean: [f32; 3], std: [f32; 3]) -> Prepared {
    let p = plan(img.w, img.h, s);
    let overview = normalize(&resize_bicubic(img, p.overview.0, p.overview.1), mean, std);
    let mut slices = Vec::new();
    if p.grid.0 > 0 {
        let refined = resize_pad(img, p.refined.0, p.refined.1, [0, 0, 0]);
        let (cw, ch) = (p.refined.0 / p.grid.0, p.refined.1 / p.grid.1);
        for gy in 0..p.grid.1 {
            for gx in 0..p.grid.0 {
                slices.push(normalize(&crop(&refined, gx * cw, gy * ch, cw, ch), mean, std));
            }
        }
    }
    Prepared { overview, slices, grid: p.grid }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_and_sizes_follow_llava_uhd() {
        let s = Slicing { image_size: 448, align: 56, small_keeps_aspect: false };
        // Unsliced: the overview is the slice size, squared.
        assert_eq!(plan(300, 200, &s), SlicePlan { overview: (448, 448), refined: (0, 0), grid: (0, 0) });
        // 1000 × 700: 3.49 slice areas → 4 → grids of 3, 4 or 5 slices; log(1000/700) = 0.357 is
        // nearest log(2/2) = 0 (3 × 1: 1.10, 4 × 1: 1.39, ...) → 2 × 2.
        let p = plan(1000, 700, &s);
        assert_eq!(p.grid, (2, 2));
        assert_eq!(p.overview.0 % 56, 0);
        assert_eq!(p.refined.0 % (2 * 56), 0);
    }

    #[test]
    fn bicubic_keeps_a_flat_image_flat() {
        let img = Rgb8 { w: 7, h: 5, px: vec![77; 7 * 5 * 3] };
        for (w, h) in [(3, 2), (14, 9), (7, 11)] {
            let r = resize_bicubic(&img, w, h);
            assert_eq!((r.w, r.h), (w, h));
            assert!(r.px.iter().all(|&v| v == 77), "{w}×{h}: {:?}", &r.px[..6]);
        }
    }
}
