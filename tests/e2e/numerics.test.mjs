// The wasm builds' dot products equal the native build's portable kernels bit for bit, for every
// type with a SIMD128 kernel (and the portable ones): same activation bytes, same f32 results.
// Both builds: SIMD128 (pkg, in Node) and relaxed SIMD (pkg-relaxed, in headless Chromium).
// Reference: `$LES_BIN_DIR/examples/quant_probe` (default target/release) run with LES_NO_SIMD=1 on the same inputs.
import test from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { ROOT, PKG, need, prng } from './common.mjs';
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';

const PROBE = path.join(ROOT, process.env.LES_BIN_DIR || 'target/release', 'examples/quant_probe');

// ggml type id -> [block elements, block bytes, fill(block view, rand)] with valid scales.
const f16 = (r) => {
  // A normal half in [2^-10, 2^-2) with a random sign: sane quantization scales.
  const e = 5 + Math.floor(r() * 8);
  return ((r() < 0.5 ? 0x8000 : 0) | (e << 10) | Math.floor(r() * 1024)) & 0xffff;
};
const put16 = (b, at, v) => { b[at] = v & 0xff; b[at + 1] = v >> 8; };
const TYPES = {
  0: [1, 4, (b, r) => new DataView(b.buffer, b.byteOffset).setFloat32(0, (r() - 0.5) * 4, true)],
  1: [1, 2, (b, r) => put16(b, 0, f16(r) ^ 0x2000)],
  30: [1, 2, (b, r) => { const f = new Float32Array([(r() - 0.5) * 4]); put16(b, 0, new Uint32Array(f.buffer)[0] >>> 16); }],
  2: [32, 18, (b, r) => { rnd(b, r); put16(b, 0, f16(r)); }],
  3: [32, 20, (b, r) => { rnd(b, r); put16(b, 0, f16(r) & 0x7fff); put16(b, 2, f16(r)); }],
  6: [32, 22, (b, r) => { rnd(b, r); put16(b, 0, f16(r)); }],
  7: [32, 24, (b, r) => { rnd(b, r); put16(b, 0, f16(r) & 0x7fff); put16(b, 2, f16(r)); }],
  8: [32, 34, (b, r) => { rnd(b, r); put16(b, 0, f16(r)); }],
  10: [256, 84, (b, r) => { rnd(b, r); put16(b, 80, f16(r) & 0x7fff); put16(b, 82, f16(r) & 0x7fff); }],
  11: [256, 110, (b, r) => { rnd(b, r); put16(b, 108, f16(r)); }],
  12: [256, 144, (b, r) => { rnd(b, r); put16(b, 0, f16(r) & 0x7fff); put16(b, 2, f16(r) & 0x7fff); }],
  13: [256, 176, (b, r) => { rnd(b, r); put16(b, 0, f16(r) & 0x7fff); put16(b, 2, f16(r) & 0x7fff); }],
  14: [256, 210, (b, r) => { rnd(b, r); put16(b, 208, f16(r)); }],
};
// Types with a repacked layout (`quant::repack`: rows four at a time, the relaxed build's
// kernels), checked repacked too against the same native plain-row results.
const REPACKED = [2, 3, 8];
function rnd(b, r) {
  for (let i = 0; i < b.length; i++) b[i] = Math.floor(r() * 256);
}

// Runs `debugMatvec` of one wasm build: in Node (`pkg`), or in headless Chromium (`pkg-relaxed`:
// Node 20's V8 has relaxed SIMD only behind a flag, and its experimental
// `i32x4.relaxed_dot_i8x16_i7x16_add_s` returned twice the products on an AVX-VNNI machine
// (2026-12-06); the browser is what the build ships to).
async function wasmBuild(build) {
  const pkg = path.join(path.dirname(PKG), build);
  need(path.join(pkg, 'les_bg.wasm'), 'run `./build.sh web`');
  if (build === 'pkg') {
    const { default: init, debugMatvec, debugMatmul, debugF32Ops, wasmSimd } = await import(path.join(pkg, 'les.js'));
    await init({ module_or_path: fs.readFileSync(path.join(pkg, 'les_bg.wasm')) });
    return { simd: wasmSimd(), matvec: async (id, w, x, repack) => Array.from(debugMatvec(id, w, x, repack)), matmul: async (id, w, x, cols, repack) => Array.from(debugMatmul(id, w, x, cols, repack)), f32ops: async (x) => Array.from(debugF32Ops(x)), close: async () => {} };
  }
  const srv = await startServer();
  const ctx = await launch();
  const page = await ctx.newPage();
  await page.goto(`http://127.0.0.1:${srv.port}/index.html`);
  const simd = await page.evaluate(async (build) => {
    const m = await import(`/les/${build}/les.js`);
    await m.default();
    globalThis.lesBuild = m;
    return m.wasmSimd();
  }, build);
  return {
    simd,
    matvec: (id, w, x, repack) => page.evaluate(({ id, w, x, repack }) => Array.from(globalThis.lesBuild.debugMatvec(id, new Uint8Array(w), new Float32Array(x), repack)), { id, w: Array.from(w), x: Array.from(x), repack }),
    matmul: (id, w, x, cols, repack) => page.evaluate(({ id, w, x, cols, repack }) => Array.from(globalThis.lesBuild.debugMatmul(id, new Uint8Array(w), new Float32Array(x), cols, repack)), { id, w: Array.from(w), x: Array.from(x), cols, repack }),
    f32ops: (x) => page.evaluate((x) => Array.from(globalThis.lesBuild.debugF32Ops(new Float32Array(x))), Array.from(x)),
    close: async () => { await ctx.close(); srv.server.close(); },
  };
}

for (const [build, simd] of [['pkg', 'simd128'], ['pkg-relaxed', 'relaxed-simd']]) test(`wasm dot products (${build}: ${simd}) are bit-identical to the native portable kernels`, async () => {
  need(PROBE, 'run `cargo build --release --example quant_probe`');
  const wasm = await wasmBuild(build);
  try {
    assert.equal(wasm.simd, simd);
    await compare(wasm.matvec);
  } finally {
    await wasm.close();
  }
});

// The batched products of a prompt (`backend::cpu::matmul::matmul`: four weight rows × four
// tokens where wasm has a tile, one row × four tokens, single dots for the rest) = the native
// portable kernels' single dots (`quant_probe matmul`, LES_NO_SIMD=1), bit for bit: 10 rows (two
// tiles and two rows after them) × 7 tokens (four and a tail of three).
for (const build of ['pkg', 'pkg-relaxed']) test(`wasm batched products (${build}) are bit-identical to the native portable kernels`, async () => {
  need(PROBE, 'run `cargo build --release --example quant_probe`');
  const wasm = await wasmBuild(build);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'les-numerics-'));
  const r = prng(4321);
  try {
    for (const id of [2, 3, 6, 8, 12, 14]) {
      const [bs, bb, fill] = TYPES[id];
      const cols = bs * (bs === 32 ? 18 : 3);
      const rows = 10;
      const toks = 7;
      const w = new Uint8Array((cols / bs) * bb * rows);
      for (let o = 0; o < w.length; o += bb) fill(w.subarray(o, o + bb), r);
      const x = new Float32Array(cols * toks);
      for (let i = 0; i < x.length; i++) x[i] = (r() - 0.5) * Math.exp(3 * (r() - 0.5)) * (i % 97 === 0 ? 40 : 1);
      fs.writeFileSync(path.join(dir, 'w.bin'), w);
      fs.writeFileSync(path.join(dir, 'x.bin'), new Uint8Array(x.buffer));
      const native = execFileSync(PROBE, ['matmul', String(id), path.join(dir, 'w.bin'), path.join(dir, 'x.bin'), String(cols)], { env: { ...process.env, LES_NO_SIMD: '1' } }).toString().trim().split('\n');
      assert.equal(native.length, rows * toks, `type ${id}: native outputs`);
      for (const repack of REPACKED.includes(id) ? [false, true] : [false]) {
        const y = await wasm.matmul(id, w, x, cols, repack);
        const got = Array.from(new Uint32Array(new Float32Array(y).buffer), (b) => b.toString(16).padStart(8, '0'));
        assert.deepEqual(got, native, `${build}: type ${id}${repack ? ', repacked' : ''}: batched products differ`);
      }
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
    await wasm.close();
  }
});

// The f32 loops that run four lanes at a time on wasm (`backend::cpu::lanes`: the FMA, by
// `f32x4.relaxed_madd` where Chromium fuses it, else in f64 with musl's halfway test; SwiGLU's
// exponential; glibc's `expf` with an unfused cubic; an attention head; three query heads sharing
// one KV head, taken together on wasm) = the native portable code (`quant_probe f32ops`,
// LES_NO_SIMD=1) bit for bit, on random values over a wide range and FMAs whose f64 sum lands on
// an f32 midpoint (double rounding) or in the f32 subnormals.
for (const build of ['pkg', 'pkg-relaxed']) test(`wasm f32 lanes (${build}) are bit-identical to the native portable code`, async () => {
  need(PROBE, 'run `cargo build --release --example quant_probe`');
  const n = 4003; // a third of the input: not a multiple of four (a scalar tail)
  const r = prng(99);
  const x = new Float32Array(3 * n + 1);
  for (let i = 0; i < x.length; i++) x[i] = (r() - 0.5) * Math.exp(10 * (r() - 0.5)) * (i % 61 === 0 ? 400 : 1);
  const triple = (i, a, b, c) => { x[i] = a; x[n + i] = b; x[2 * n + i] = c; };
  const t = 1 + 2 ** -12; // t·t = 1 + 2^-11 + 2^-24: the midpoint between two f32 near 1
  for (const [i, c] of [[0, 2 ** -70], [1, -(2 ** -70)], [2, -(1 + 2 ** -11)], [3, 0], [5, 2 ** -90]]) triple(i, t, t, c);
  triple(6, 2 ** -70, 2 ** -70, 2 ** -149); // products and sums in the f32 subnormals
  triple(7, 2 ** -70, -(2 ** -65), 2 ** -130);
  triple(9, 3 * 2 ** -75, 2 ** -60, -(2 ** -126));
  const wasm = await wasmBuild(build);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'les-numerics-'));
  try {
    fs.writeFileSync(path.join(dir, 'x.bin'), new Uint8Array(x.buffer));
    const native = execFileSync(PROBE, ['f32ops', path.join(dir, 'x.bin')], { env: { ...process.env, LES_NO_SIMD: '1' } }).toString().trim().split('\n');
    const y = await wasm.f32ops(x);
    const got = Array.from(new Uint32Array(new Float32Array(y).buffer), (b) => b.toString(16).padStart(8, '0'));
    assert.equal(got.length, native.length, 'output lengths');
    const parts = [['fma', 0, n], ['swiglu', n, 2 * n], ['expf', 2 * n, 2 * n + x.length], ['attention', 2 * n + x.length, 2 * n + x.length + 64], ['grouped attention', 2 * n + x.length + 64, got.length]];
    for (const [what, a, b] of parts) {
      const bad = [];
      for (let i = a; i < b && bad.length < 5; i++) if (got[i] !== native[i]) bad.push(`${what}[${i - a}]: wasm ${got[i]}, native ${native[i]}`);
      assert.deepEqual(bad, [], `${build}: ${what} differs`);
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
    await wasm.close();
  }
});

// The f32 -> f16 rounding of the CPU backend's f16 vector loops on wasm (attention's V
// accumulator, `backend::cpu::lanes::round_half`) = the browser's own Float16Array (IEEE round to nearest
// even) on every half, every midpoint between neighbours (ties) and the f32 values beside them,
// the overflow and underflow edges and random bit patterns; NaNs stay NaNs of the same sign. And
// the other way (`quant::f16x8_to_f32`: attention's keys and values, block scales): every half
// widened to f32 = Float16Array's value (NaNs: NaN of the same sign).
test('wasm f32 <-> f16 vector conversions equal Float16Array (the browser)', async () => {
  const srv = await startServer();
  const ctx = await launch();
  try {
    const page = await ctx.newPage();
    await page.goto(`http://127.0.0.1:${srv.port}/index.html`);
    for (const build of ['pkg', 'pkg-relaxed']) {
      const bad = await page.evaluate(async (build) => {
        const m = await import(`/les/${build}/les.js`);
        await m.default();
        const bits = [];
        const f = new Float32Array(1), u = new Uint32Array(f.buffer);
        const h = new Float16Array(1), hu = new Uint16Array(h.buffer);
        const asF32 = (x) => { f[0] = x; return u[0]; };
        for (let i = 0; i < 0x7c00; i++) {
          hu[0] = i;
          const a = asF32(h[0]);
          hu[0] = i + 1;
          const mid = asF32((h[0] + (hu[0] = i, h[0])) / 2);
          for (const b of [a, a + 1, a - 1, mid, mid + 1, mid - 1]) if (b >= 0) bits.push(b >>> 0, (b | 0x80000000) >>> 0);
        }
        for (const x of [0x7f800000, 0x477ff000, 0x477fefff, 0x477fe000, 0x47800000, 0x33000000, 0x33000001, 0x32ffffff, 0x00000001, 0x007fffff, 0x38800000]) bits.push(x, (x | 0x80000000) >>> 0);
        let s = 12345;
        for (let i = 0; i < 200000; i++) { s = (Math.imul(s, 1103515245) + 12345) >>> 0; bits.push(s); }
        const x = new Float32Array(new Uint32Array(bits).buffer);
        const got = m.debugF16Round(x);
        const want = new Uint16Array(new Float16Array(x).buffer);
        const out = [];
        for (let i = 0; i < x.length && out.length < 5; i++) {
          const isNan = (bits[i] & 0x7fffffff) > 0x7f800000;
          const ok = isNan ? (got[i] & 0x7c00) === 0x7c00 && (got[i] & 0x3ff) !== 0 && (got[i] >> 15) === bits[i] >>> 31 : got[i] === want[i];
          if (!ok) out.push(`f32 ${bits[i].toString(16)}: got ${got[i].toString(16)}, Float16Array ${want[i].toString(16)}`);
        }
        // Widening: every half (in chunks of eight, then a tail of three through `half`).
        const all = new Uint16Array(0x10003);
        for (let i = 0; i < all.length; i++) all[i] = i & 0xffff;
        const wide = m.debugF16Widen(all);
        // The bits through a view: a NaN read as a JS number may lose its sign and payload
        // (SpiderMonkey canonicalizes it).
        const wideBits = new Uint32Array(wide.buffer, wide.byteOffset, wide.length);
        const ref = new Float16Array(all.buffer);
        for (let i = 0; i < all.length && out.length < 5; i++) {
          f[0] = ref[i];
          const want = u[0], got = wideBits[i];
          const nan = Number.isNaN(ref[i]);
          if (nan ? !Number.isNaN(wide[i]) || (got >>> 31) !== (all[i] >> 15) : got !== want) out.push(`half ${all[i].toString(16)}: got f32 ${got.toString(16)}, Float16Array ${want.toString(16)}`);
        }
        return { n: x.length, out };
      }, build);
      assert.ok(bad.n > 300000, `${build}: ${bad.n} values`);
      assert.deepEqual(bad.out, [], `${build}: f32 -> f16 rounding differs`);
    }
  } finally {
    await ctx.close();
    srv.server.close();
  }
});

async function compare(matvec) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'les-numerics-'));
  const r = prng(1234);
  for (const [id, [bs, bb, fill]] of Object.entries(TYPES)) {
    // Columns: a few blocks, and for float types a length that leaves a tail after the 8 lanes.
    const cols = bs === 1 ? 1003 : bs * (bs === 32 ? 18 : 3);
    const rows = 26; // not a multiple of 4: the four-row kernels and the single dots after them
    const w = new Uint8Array((cols / bs) * bb * rows);
    for (let o = 0; o < w.length; o += bb) fill(w.subarray(o, o + bb), r);
    const x = new Float32Array(cols);
    for (let i = 0; i < cols; i++) x[i] = (r() - 0.5) * Math.exp(3 * (r() - 0.5)) * (i % 97 === 0 ? 40 : 1);
    // The first block: |x| up to 127 exactly (the Q8 multiplier 127 / amax is then 1), the rest
    // halfway between integers: every quant a tie (x86 rounding: half to even).
    if (bs > 1) for (let i = 0; i < 32; i++) x[i] = i === 0 ? 127 : (i % 2 ? 1 : -1) * ((i % 17) + 0.5);
    fs.writeFileSync(path.join(dir, 'w.bin'), w);
    fs.writeFileSync(path.join(dir, 'x.bin'), new Uint8Array(x.buffer));
    const native = execFileSync(PROBE, [id, path.join(dir, 'w.bin'), path.join(dir, 'x.bin')], { env: { ...process.env, LES_NO_SIMD: '1' } }).toString().trim().split('\n');
    for (const repack of REPACKED.includes(Number(id)) ? [false, true] : [false]) {
      const y = await matvec(Number(id), w, x, repack);
      const what = `type ${id}${repack ? ', repacked' : ''}`;
      assert.equal(y.length > rows, true, `${what}: wasm returned nothing`);
      let h = 0xcbf29ce484222325n;
      for (const v of y.slice(rows)) h = ((h ^ BigInt(v)) * 0x100000001b3n) & 0xffffffffffffffffn;
      assert.equal(`act ${h.toString(16).padStart(16, '0')}`, native[0], `${what}: activation bytes differ`);
      const bits = new Uint32Array(new Float32Array(y.slice(0, rows)).buffer);
      const got = Array.from(bits, (b) => b.toString(16).padStart(8, '0'));
      assert.deepEqual(got, native.slice(1), `${what}: dot products differ`);
    }
  }
  fs.rmSync(dir, { recursive: true, force: true });
}
