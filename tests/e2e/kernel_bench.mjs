// Matrix-vector kernel speed of the wasm builds in headless Chromium (issue 38): the shapes of
// SmolLM2-135M's decode (Q4_1 layers, Q8_0 output) and a K-quant pair, each build in turn,
// alternating, repeated. Prints ms per product and G elements/s, and the per-token kernel time
// of SmolLM2-135M (30 layers + output) each build's products add up to.
//   node tests/e2e/kernel_bench.mjs [--rounds 3] [--builds pkg,pkg-relaxed]  (folders under www/les)
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';

const i = process.argv.indexOf('--rounds');
const rounds = i < 0 ? 3 : Number(process.argv[i + 1]);
const j = process.argv.indexOf('--builds');
const BUILDS = j < 0 ? ['pkg', 'pkg-relaxed'] : process.argv[j + 1].split(',');
// [ggml type id, block elements, block bytes, rows, cols, count per SmolLM2 token]
const SHAPES = [
  [8, 32, 34, 49152, 576, 1], // output (tied token_embd, Q8_0)
  [3, 32, 20, 1536, 576, 60], // ffn_gate, ffn_up
  [3, 32, 20, 576, 1536, 30], // ffn_down
  [3, 32, 20, 576, 576, 60], // attn_q, attn_output
  [3, 32, 20, 192, 576, 60], // attn_k, attn_v
  [12, 256, 144, 1536, 1024, 0], // Q4_K
  [14, 256, 210, 1536, 1024, 0], // Q6_K
];

const srv = await startServer();
const ctx = await launch();
const res = Object.fromEntries(BUILDS.map((b) => [b, SHAPES.map(() => [])]));
try {
  const pages = {};
  for (const b of BUILDS) {
    const page = await ctx.newPage();
    await page.goto(`http://127.0.0.1:${srv.port}/index.html`);
    const simd = await page.evaluate(async (b) => {
      const m = await import(`/les/${b}/les.js`);
      await m.default();
      globalThis.lesBuild = m;
      return m.wasmSimd();
    }, b);
    console.error(`${b}: ${simd}`);
    pages[b] = page;
  }
  for (let r = 0; r < rounds; r++) {
    const order = r % 2 ? [...BUILDS].reverse() : BUILDS;
    for (const b of order) {
      const ms = await pages[b].evaluate((shapes) => shapes.map(([id, bs, bb, rows, cols]) => {
        const w = new Uint8Array((rows * cols) / bs * bb);
        for (let i = 0; i < w.length; i++) w[i] = (Math.imul(i, 2654435761) >>> 24) & 0xff;
        // Sane f16 scales (2^-4) where each block type keeps them.
        const at = { 8: [0], 3: [0, 2], 12: [0, 2], 14: [208] }[id];
        for (let o = 0; o < w.length; o += bb) for (const a of at) { w[o + a] = 0; w[o + a + 1] = 0x2c; }
        const x = new Float32Array(cols).map((_, i) => Math.sin(i));
        globalThis.lesBuild.debugMatvec(id, w, x);
        const reps = Math.max(3, Math.round(2e8 / (rows * cols)));
        const t0 = performance.now();
        for (let k = 0; k < reps; k++) globalThis.lesBuild.debugMatvec(id, w, x);
        return (performance.now() - t0) / reps;
      }), SHAPES);
      ms.forEach((v, k) => res[b][k].push(v));
    }
  }
} finally {
  await ctx.close();
  srv.server.close();
}
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
console.log(`| type | rows × cols | ${BUILDS.map((b) => `${b} ms (G elem/s)`).join(' | ')} | ratio |`);
console.log(`|---|---:|${BUILDS.map(() => '---:').join('|')}|---:|`);
const NAMES = { 3: 'Q4_1', 8: 'Q8_0', 12: 'Q4_K', 14: 'Q6_K' };
SHAPES.forEach(([id, , , rows, cols], k) => {
  const m = BUILDS.map((b) => median(res[b][k]));
  console.log(`| ${NAMES[id]} | ${rows} × ${cols} | ${m.map((v) => `${v.toFixed(3)} (${((rows * cols) / v / 1e6).toFixed(2)})`).join(' | ')} | ${(m[0] / m[1]).toFixed(2)}× |`);
});
const tok = BUILDS.map((b) => SHAPES.reduce((s, sh, k) => s + sh[5] * median(res[b][k]), 0));
console.log(`\nSmolLM2-135M decode, kernels only: ${BUILDS.map((b, k) => `${b} ${tok[k].toFixed(1)} ms/token (${(1000 / tok[k]).toFixed(1)} t/s)`).join(', ')}`);
