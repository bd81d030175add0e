// Image encoding in the browser against the native engine (BENCHMARKS.md, "Images (issue 36)"),
// same run, interleaved: the CPU path of a cross-origin isolated page in headless Chromium and
// `les run`, at the same thread counts.
//   node tests/e2e/vision_bench.mjs [--mmproj models/X.gguf] [--image F.png] [--threads 1,2] [--rounds 3] [--warmup 1]
// Each round sends the image + "Describe" (greedy, max_tokens 1, streamed) after a text-only turn,
// so the image is encoded every round (the engine's cache would otherwise hold it); then runs
// `les run -m models/rand-qwen35-vl.gguf --mmproj M --image F -p Describe -n 1 --temp 0 -t T`.
// Prints medians: browser encode (stats.images.encode_ms), browser time to first token (from the
// create() call to the first streamed token), native encode ("pieces encoded in X ms").
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch } from './browser.mjs';
import { ROOT, LES, need } from './common.mjs';

const arg = (name, def) => {
  const i = process.argv.indexOf(`--${name}`);
  return i < 0 ? def : process.argv[i + 1];
};
const mmproj = arg('mmproj', 'models/rand-minicpmv-mmproj.gguf');
const image = arg('image', 'tests/data/vision/square_224.png');
const threads = arg('threads', '1,2').split(',').map(Number);
const rounds = Number(arg('rounds', '3'));
const warmup = Number(arg('warmup', '1'));
const model = 'models/rand-qwen35-vl.gguf';
for (const f of [LES, model, mmproj, image]) need(path.resolve(ROOT, f), 'see tests/e2e/vision_bench.mjs');
if (!mmproj.startsWith('models/')) throw new Error('--mmproj must be under models/ (the server serves models/ at /models/)');

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

function native(t) {
  const t0 = performance.now();
  const p = spawnSync(LES, ['run', '-m', model, '--mmproj', mmproj, '--image', image, '-p', 'Describe', '-n', '1', '--temp', '0', '-t', String(t)], { cwd: ROOT });
  const wall = performance.now() - t0;
  const err = p.stderr.toString();
  const m = /pieces encoded in ([\d.]+) ms/.exec(err);
  if (p.status !== 0 || !m) throw new Error(`les run failed (${p.status}): ${err}`);
  return { encode: Number(m[1]), wall, text: p.stdout.toString() };
}

const png = `data:image/png;base64,${fs.readFileSync(path.resolve(ROOT, image)).toString('base64')}`;
const { server, port } = await startServer();
const base = `http://127.0.0.1:${port}`;
const ctx = await launch();
const rows = [];
try {
  const page = await ctx.newPage();
  page.on('console', (m) => process.env.VERBOSE && console.error('page:', m.text()));
  await page.goto(`${base}/`);
  if (!(await page.evaluate(() => crossOriginIsolated))) throw new Error('the page is not cross-origin isolated');
  for (const t of threads) {
    const t0 = performance.now();
    const info = await page.evaluate(async ({ mmproj, t }) => {
      const { createEngine } = await import('/les/index.js');
      const e = await createEngine({ model: '/models/rand-qwen35-vl.gguf', mmproj: `/${mmproj}`, backend: 'cpu', memoryBudgetMB: 0, nCtx: 1024, threads: t });
      window.__e = e;
      return { backend: e.backend, threads: (await e.stats()).threads, projector: e.info.vision?.projector };
    }, { mmproj, t });
    const loadMs = performance.now() - t0;
    console.error(`threads ${t}: engine ${JSON.stringify(info)} created in ${(loadMs / 1000).toFixed(1)} s`);
    const browser = (measured) => page.evaluate(async ({ png }) => {
      const e = window.__e;
      // A text-only turn first: the image conversation then shares only the template's start
      // with the cache, so the image is encoded again.
      await e.chat.completions.create({ messages: [{ role: 'user', content: 'Hi' }], max_tokens: 1, temperature: 0 });
      const t0 = performance.now();
      let first = null, text = '';
      const stream = await e.chat.completions.create({ messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: png } }, { type: 'text', text: 'Describe' }] }], max_tokens: 1, temperature: 0, stream: true });
      for await (const c of stream) {
        const d = c.choices[0]?.delta?.content;
        if (d && first === null) first = performance.now() - t0;
        if (d) text += d;
      }
      const done = performance.now() - t0;
      const s = e.lastResult.stats;
      return { ttft: first ?? done, done, text, images: s.images, prompt_ms: s.prompt_ms, cpu_threads: s.cpu_threads };
    }, { png });
    for (let i = 0; i < warmup; i++) console.error(`  warm-up: ${JSON.stringify(await browser())}`);
    const b = [], n = [];
    for (let r = 0; r < rounds; r++) {
      // Alternate which goes first.
      const order = r % 2 ? ['n', 'b'] : ['b', 'n'];
      for (const o of order) {
        if (o === 'b') {
          const x = await browser();
          if (x.images?.encoded !== 1) throw new Error(`browser round ${r}: the image was not encoded: ${JSON.stringify(x)}`);
          b.push(x);
          console.error(`  round ${r} browser: encode ${x.images.encode_ms.toFixed(0)} ms, image prefill ${x.images.prefill_ms.toFixed(0)} ms, first token ${x.ttft.toFixed(0)} ms, ${x.cpu_threads} threads, ${JSON.stringify(x.text)}`);
        } else {
          const x = native(t);
          n.push(x);
          console.error(`  round ${r} native:  encode ${x.encode} ms, wall ${x.wall.toFixed(0)} ms, ${JSON.stringify(x.text.trim())}`);
        }
      }
    }
    await page.evaluate(() => window.__e.unload());
    const be = median(b.map((x) => x.images.encode_ms)), bt = median(b.map((x) => x.ttft)), ne = median(n.map((x) => x.encode)), nw = median(n.map((x) => x.wall));
    rows.push(`| ${path.basename(mmproj)} | ${path.basename(image)} | ${t} (${b[0].cpu_threads} in the page) | ${be.toFixed(0)} | ${bt.toFixed(0)} | ${ne.toFixed(0)} | ${nw.toFixed(0)} | ${(be / ne).toFixed(2)}× |`);
    console.log(rows.at(-1));
  }
} finally {
  await ctx.close();
  server.close();
}
console.log('| tower | image | threads | browser encode (ms) | browser first token (ms) | native encode (ms) | native wall -n 1 (ms) | encode browser/native |');
console.log('|---|---|---|---:|---:|---:|---:|---:|');
for (const r of rows) console.log(r);
