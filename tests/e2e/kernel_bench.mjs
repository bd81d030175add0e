// Matrix-vector kernel speed of the wasm builds in headless Chromium (issue 38): the shapes of
// SmolLM2-135M's decode (Q4_1 layers, Q8_0 output) and a K-quant pair, each variant in turn,
// alternating, repeated. A variant is a build folder under www/les, `:repack` for the rows in
// `quant::repack`'s layout (the relaxed build's four-row kernels; Q4_0/Q4_1/Q8_0 only, other
// types as the file has them). The weights are copied into wasm memory once per shape and
// variant (`debugMatvecBench`: one thread, the products timed inside wasm). Prints ms per
// product and G elements/s, and the per-token kernel time of SmolLM2-135M (30 layers + output)
// each variant's products add up to.
//   node tests/e2e/kernel_bench.mjs [--rounds 3] [--builds pkg,pkg-relaxed,pkg-relaxed:repack]
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';

const i = process.argv.indexOf('--rounds');
const rounds = i < 0 ? 3 : Number(process.argv[i + 1]);
const j = process.argv.indexOf('--builds');
const VARIANTS = j < 0 ? ['pkg', 'pkg-relaxed', 'pkg-relaxed:repack'] : process.argv[j + 1].split(',');
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
const res = Object.fromEntries(VARIANTS.map((v) => [v, SHAPES.map(() => [])]));
try {
  const pages = {};
  for (const v of VARIANTS) {
    const b = v.split(':')[0];
    if (pages[b]) continue;
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
    const order = r % 2 ? [...VARIANTS].reverse() : VARIANTS;
    for (const v of order) {
      const [b, how] = v.split(':');
      const ms = await pages[b].evaluate(({ shapes, repack }) => shapes.map(([id, bs, bb, rows, cols]) => {
        const w = new Uint8Array((rows * cols) / bs * bb);
        for (let i = 0; i < w.length; i++) w[i] = (Math.imul(i, 2654435761) >>> 24) & 0xff;
        // Sane f16 scales (2^-4) where each block type keeps them.
        const at = { 8: [0], 3: [0, 2], 12: [0, 2], 14: [208] }[id];
        for (let o = 0; o < w.length; o += bb) for (const a of at) { w[o + a] = 0; w[o + a + 1] = 0x2c; }
        const x = new Float32Array(cols).map((_, i) => Math.sin(i));
        return globalThis.lesBuild.debugMatvecBench(id, w, x, Math.max(3, Math.round(1e9 / (rows * cols))), repack);
      }), { shapes: SHAPES, repack: how === 'repack' });
      ms.forEach((x, k) => res[v][k].push(x));
    }
  }
} finally {
  await ctx.close();
  srv.server.close();
}
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const last = VARIANTS.length - 1;
console.log(`| type | rows × cols | ${VARIANTS.map((v) => `${v} ms (G elem/s)`).join(' | ')} | ${VARIANTS[last]} / ${VARIANTS[0]} |`);
console.log(`|---|---:|${VARIANTS.map(() => '---:').join('|')}|---:|`);
const NAMES = { 3: 'Q4_1', 8: 'Q8_0', 12: 'Q4_K', 14: 'Q6_K' };
SHAPES.forEach(([id, , , rows, cols], k) => {
  const m = VARIANTS.map((v) => median(res[v][k]));
  console.log(`| ${NAMES[id]} | ${rows} × ${cols} | ${m.map((v) => `${v.toFixed(3)} (${((rows * cols) / v / 1e6).toFixed(2)})`).join(' | ')} | ${(m[0] / m[last]).toFixed(2)}× |`);
});
const tok = VARIANTS.map((v) => SHAPES.reduce((s, sh, k) => s + sh[5] * median(res[v][k]), 0));
console.log(`\nSmolLM2-135M decode, kernels only: ${VARIANTS.map((v, k) => `${v} ${tok[k].toFixed(1)} ms/token (${(1000 / tok[k]).toFixed(1)} t/s)`).join(', ')}`);
