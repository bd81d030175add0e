// Screenshot of the demo after a real run (docs/browser-demo.png, docs/browser-demo-phone.png):
//   node tests/e2e/screenshot.mjs [backend] [n]
import path from 'node:path';
import { startServer } from './server.mjs';
import { launch, runDemo } from './browser.mjs';
import { ROOT } from './common.mjs';

const backend = process.argv[2] ?? 'cpu';
const n = process.argv[3] ?? '64';
const { server, port } = await startServer();
const ctx = await launch();
try {
  for (const [name, viewport] of [['browser-demo.png', { width: 1100, height: 1300 }], ['browser-demo-phone.png', { width: 390, height: 1500 }]]) {
    const page = await ctx.newPage({ viewport });
    await page.setViewportSize(viewport);
    const r = await runDemo(page, `http://127.0.0.1:${port}`, { model: '/models/smolmoe-32x2.les', budget: '400', backend, prompt: 'The three primary colors are', n }, 900_000);
    if (r.error) throw new Error(JSON.stringify(r.error));
    await page.evaluate(() => document.fonts.ready);
    await page.screenshot({ path: path.join(ROOT, 'docs', name), fullPage: true });
    console.log(name, r.status);
    await page.close();
  }
} finally {
  await ctx.close();
  server.close();
}
